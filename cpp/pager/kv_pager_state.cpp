// KvPager state for snapshots: save_state / state_from / replace_state (see kv_pager.h).
//
// Layout, version 1 (all little-endian; i64 unless noted):
//   config     chunk_tokens, pool_tokens, max_tokens, sink_chunks, tail_chunks, chunk_bytes
//   head       n_tokens, write_clock (u64)
//   order      array of n_blocks block indices (the hand-out order)
//   chunks     n_chunks, then per chunk c < n_chunks: block, host_valid (u8), pinned (u8), last_write (u64)
//   pins       array of pinned chunks >= n_chunks (pins may be set ahead of the head)
//   scores     array of f32 (at most n_chunks)
//   stats      page_outs, page_ins, bytes_out, bytes_in, reselects, evictions
#include "pager/kv_pager.h"
#include "common/byte_io.h"

#include <algorithm>
#include <string>

namespace kvf {

namespace {

constexpr size_t k_chunk_record_bytes = 8 + 1 + 1 + 8;

std::string str(int64_t v) { return std::to_string(v); }

bool read_flag(ByteReader & r, const char * field) {
    const uint8_t v = r.get<uint8_t>(field);
    if (v > 1) r.fail(std::string(field) + "=" + std::to_string(v) + " is not 0 or 1");
    return v == 1;
}

}  // namespace

void KvPager::save_state(ByteWriter & w) const {
    for (int64_t v : {cfg_.chunk_tokens, cfg_.pool_tokens, cfg_.max_tokens, cfg_.sink_chunks, cfg_.tail_chunks,
                      cfg_.chunk_bytes}) {
        w.put<int64_t>(v);
    }
    w.put<int64_t>(n_tokens_);
    w.put<uint64_t>(write_clock_);
    w.array(block_order_);
    w.put<int64_t>(n_chunks());
    for (int64_t c = 0; c < n_chunks(); ++c) {
        const ChunkState & cs = chunks_[c];
        w.put<int64_t>(cs.block);
        w.put<uint8_t>(cs.host_valid);
        w.put<uint8_t>(cs.pinned);
        w.put<uint64_t>(cs.last_write);
    }
    std::vector<int64_t> later_pins;
    for (int64_t c = n_chunks(); c < (int64_t) chunks_.size(); ++c) {
        if (chunks_[c].pinned) later_pins.push_back(c);
    }
    w.array(later_pins);
    w.array(scores_);
    for (int64_t v : {stats_.page_outs, stats_.page_ins, stats_.bytes_out, stats_.bytes_in, stats_.reselects,
                      stats_.evictions}) {
        w.put<int64_t>(v);
    }
}

KvPager KvPager::state_from(ByteReader & r, uint32_t version) const {
    if (version != k_state_version) {
        r.fail("version " + std::to_string(version) + " is not supported (this build reads " +
               std::to_string(k_state_version) + ")");
    }
    PagerConfig saved;
    for (int64_t * f : {&saved.chunk_tokens, &saved.pool_tokens, &saved.max_tokens, &saved.sink_chunks,
                        &saved.tail_chunks, &saved.chunk_bytes}) {
        *f = r.get<int64_t>("config");
    }
    if (saved.chunk_tokens != cfg_.chunk_tokens) {
        r.fail("saved with chunk_tokens=" + str(saved.chunk_tokens) + " but this session uses chunk_tokens=" +
               str(cfg_.chunk_tokens));
    }
    if (saved.chunk_bytes != cfg_.chunk_bytes) {
        r.fail("saved chunks are " + str(saved.chunk_bytes) + " bytes but this session's are " + str(cfg_.chunk_bytes) +
               " (another KV type or layer layout)");
    }
    KvPager out(cfg_);
    out.n_tokens_ = r.get<int64_t>("n_tokens");
    if (out.n_tokens_ < 0 || out.n_tokens_ > cfg_.max_tokens) {
        r.fail("n_tokens=" + str(out.n_tokens_) + " does not fit this session's max_tokens=" + str(cfg_.max_tokens));
    }
    out.write_clock_ = r.get<uint64_t>("write_clock");

    // The saved pager's own hand-out order: one entry per block of its pool.
    const int64_t saved_blocks = saved.pool_tokens > 0 ? saved.pool_tokens / cfg_.chunk_tokens : 0;
    const std::vector<int64_t> order = r.array<int64_t>("block_order", saved_blocks);
    std::vector<uint8_t> seen(order.size(), 0);
    bool identity = true;
    for (size_t i = 0; i < order.size(); ++i) {
        const int64_t b = order[i];
        if (b < 0 || b >= (int64_t) order.size() || seen[b]) r.fail("block_order is not a permutation");
        seen[b] = 1;
        identity = identity && b == (int64_t) i;
    }
    if ((int64_t) order.size() == n_blocks_) {
        out.block_order_ = order;
    } else if (!identity) {
        r.fail("saved with a custom block order over " + str((int64_t) order.size()) +
               " blocks; it needs a pool of the same size, this one has n_blocks=" + str(n_blocks_));
    }
    out.read_chunk_table(r);

    const std::vector<float> scores = r.array<float>("scores", out.n_chunks());
    out.scores_ = scores;
    for (int64_t * f : {&out.stats_.page_outs, &out.stats_.page_ins, &out.stats_.bytes_out, &out.stats_.bytes_in,
                        &out.stats_.reselects, &out.stats_.evictions}) {
        *f = r.get<int64_t>("stats");
    }
    std::vector<uint8_t> is_free(n_blocks_);
    for (int64_t b = 0; b < n_blocks_; ++b) is_free[b] = out.block_owner_[b] < 0;
    out.free_blocks_ = out.in_hand_out_order(is_free);
    try {
        out.check_invariants();
    } catch (const std::logic_error & e) {
        r.fail(std::string("the saved state does not hold in this session's pool: ") + e.what());
    }
    return out;
}

// Chunk table and the pins ahead of the head, into this (fresh) pager; n_tokens_ is already set.
void KvPager::read_chunk_table(ByteReader & r) {
    const int64_t n = n_chunks();
    r.count("chunk table", k_chunk_record_bytes, n, n);
    for (int64_t c = 0; c < n; ++c) {
        ChunkState & cs = chunks_[c];
        const int64_t b = r.get<int64_t>("chunk block");
        if (b < -1) r.fail("chunk " + str(c) + " has block " + str(b));
        if (b >= n_blocks_) {
            r.fail("chunk " + str(c) + " was resident in block " + str(b) + " but this pool has n_blocks=" +
                   str(n_blocks_) + ": the pool is too small for the saved resident set (restore into a pool of more than " +
                   str(b) + " blocks)");   // b comes from the file: no arithmetic that could overflow
        }
        if (b >= 0 && block_owner_[b] >= 0) {
            r.fail("block " + str(b) + " is claimed by chunks " + str(block_owner_[b]) + " and " + str(c));
        }
        if (b >= 0) take_block(c, b);
        cs.host_valid = read_flag(r, "host_valid");
        cs.pinned = read_flag(r, "pinned");
        cs.last_write = r.get<uint64_t>("last_write");
        if (cs.last_write > write_clock_) {
            r.fail("chunk " + str(c) + " was written at " + std::to_string(cs.last_write) + ", after the write clock " +
                   std::to_string(write_clock_));
        }
    }
    const std::vector<int64_t> later_pins = r.array<int64_t>("pins", (int64_t) chunks_.size() - n);
    int64_t prev = n - 1;
    for (int64_t c : later_pins) {
        if (c <= prev || c >= (int64_t) chunks_.size()) {
            r.fail("pinned chunk " + str(c) + " is out of order or outside [" + str(n) + ", " +
                   str((int64_t) chunks_.size()) + ")");
        }
        chunks_[c].pinned = true;
        prev = c;
    }
}

void KvPager::replace_state(KvPager && loaded) {
    if (loaded.cfg_.chunk_tokens != cfg_.chunk_tokens || loaded.cfg_.pool_tokens != cfg_.pool_tokens ||
        loaded.cfg_.max_tokens != cfg_.max_tokens) {
        throw std::invalid_argument("replace_state: the state was made for another pager config (use state_from)");
    }
    const uint64_t next = epoch_ + 1;
    *this = std::move(loaded);
    epoch_ = next;
}

}  // namespace kvf
