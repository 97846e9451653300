// Session state for snapshots (see session.h).
//
// Layout, version 1: max_tokens, pool_tokens, n_batch, chunk_tokens, sink_chunks, tail_chunks (i64),
// kv_type, attention (u32 length + bytes), allow_beyond_train_ctx, ordered_attention, track_summaries (u8),
// n_tokens (i64). Version 2 adds mtp (u8) after track_summaries; version 1 reads as mtp off.
#include "runtime/session.h"
#include "common/byte_io.h"

#include <chrono>
#include <cstdint>

namespace kvf {

void Session::save_state(ByteWriter & w, int64_t n_tokens) const {
    const SessionLock held = lock(false);
    for (int64_t v : {cfg_.max_tokens, cfg_.pool_tokens, cfg_.n_batch, cfg_.chunk_tokens, cfg_.sink_chunks,
                      cfg_.tail_chunks}) {
        w.put<int64_t>(v);
    }
    w.str(cfg_.kv_type);
    w.str(cfg_.attention);
    w.put<uint8_t>(cfg_.allow_beyond_train_ctx);
    w.put<uint8_t>(cfg_.ordered_attention > 0);   // the effective flag (auto = -1 = off)
    w.put<uint8_t>(cfg_.track_summaries);
    w.put<uint8_t>(cfg_.mtp);
    w.put<int64_t>(n_tokens);
}

SessionConfig Session::config_from(ByteReader & r, uint32_t version, int64_t & n_tokens) {
    if (version != 1 && version != k_state_version) {
        r.fail("version " + std::to_string(version) + " is not supported (this build reads 1 and " +
               std::to_string(k_state_version) + ")");
    }
    // Ranges wide enough for any real session, narrow enough that no product of them overflows before
    // Session's own validation sees it (positions and slots are int32).
    constexpr int64_t k_int32 = INT32_MAX, k_small = 1 << 20;
    SessionConfig c;
    c.max_tokens = r.i64_in("max_tokens", 1, k_int32);
    c.pool_tokens = r.i64_in("pool_tokens", 0, k_int32);
    c.n_batch = r.i64_in("n_batch", 1, k_int32);
    c.chunk_tokens = r.i64_in("chunk_tokens", 1, k_small);
    c.sink_chunks = r.i64_in("sink_chunks", 0, k_small);
    c.tail_chunks = r.i64_in("tail_chunks", 0, k_small);
    c.kv_type = r.str("kv_type", 16);
    c.attention = r.str("attention", 16);
    c.allow_beyond_train_ctx = r.get<uint8_t>("allow_beyond_train_ctx") != 0;
    c.ordered_attention = r.get<uint8_t>("ordered_attention") != 0;
    c.track_summaries = r.get<uint8_t>("track_summaries") != 0;
    c.mtp = version >= 2 && r.get<uint8_t>("mtp") != 0;
    n_tokens = r.i64_in("n_tokens", 0, c.max_tokens);
    return c;
}

void Session::restore_state(KvPager && pager, const std::vector<const uint8_t *> & images, std::vector<int32_t> tokens,
                            std::unique_ptr<ChunkSummaries> summaries, const SlidingWindowKV::Saved * ring,
                            const RecurrentState::Copy * recurrent) {
    const SessionLock held = lock();
    const auto t0 = std::chrono::steady_clock::now();
    kv_->load_state(images, pager.chunk_blocks(), pager.chunk_host_valid());
    if (ring_) ring_->load_state(*ring);
    if (recurrent_) recurrent_->restore(*recurrent);
    pager_->replace_state(std::move(pager));
    tokens_ = std::move(tokens);
    n_unchanged_ = 0;   // another state's positions, though their tokens may be the same
    if (summaries_ && summaries) {
        summaries_ = std::move(summaries);
    } else if (summaries_) {
        summaries_->clear();   // the old ones describe other chunks
    }
    timings_.t_paging_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace kvf
