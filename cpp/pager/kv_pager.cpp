// KvPager: see kv_pager.h for the model, the invariants and the error kinds.
#include "pager/kv_pager.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <tuple>

namespace kvf {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

std::string range(int64_t lo, int64_t hi) { return "[" + str(lo) + ", " + str(hi) + ")"; }

int64_t count_set(const std::vector<uint8_t> & mask) {
    return std::count(mask.begin(), mask.end(), uint8_t(1));
}

// A per-chunk mask (protected_mask's) as plan_residency's filter.
std::function<bool(int64_t)> mask_filter(const std::vector<uint8_t> & keep) {
    return [&keep](int64_t c) { return keep[c] != 0; };
}

void check_chunk(int64_t chunk, size_t n, const char * what) {
    if (chunk < 0 || chunk >= (int64_t) n) {
        throw std::out_of_range(std::string(what) + ": chunk=" + str(chunk) + " is outside [0, " + str((int64_t) n) +
                                ") (ceil(max_tokens / chunk_tokens))");
    }
}

}  // namespace

// ---- config -----------------------------------------------------------------------------------------

void PagerConfig::validate() const {
    auto fail = [](const std::string & msg) { throw std::invalid_argument("PagerConfig: " + msg); };
    if (chunk_tokens <= 0) {
        fail("chunk_tokens=" + str(chunk_tokens) + " must be > 0 (64 is the usual value)");
    }
    if (sink_chunks < 0) fail("sink_chunks=" + str(sink_chunks) + " must be >= 0");
    if (tail_chunks < 0) fail("tail_chunks=" + str(tail_chunks) + " must be >= 0");
    if (max_tokens <= 0) fail("max_tokens=" + str(max_tokens) + " must be > 0 (the logical context in positions)");
    // Positions are int32 in every graph, and no product of these below may overflow int64.
    constexpr int64_t k_int32 = std::numeric_limits<int32_t>::max();
    if (max_tokens > k_int32) fail("max_tokens=" + str(max_tokens) + " exceeds the int32 position range (max 2147483647)");
    if (chunk_tokens > k_int32 || sink_chunks > k_int32 || tail_chunks > k_int32) {
        fail("chunk_tokens, sink_chunks and tail_chunks must be at most 2147483647");
    }
    if (chunk_bytes < 0) fail("chunk_bytes=" + str(chunk_bytes) + " must be >= 0");
    if (pool_tokens % chunk_tokens != 0) {
        fail("pool_tokens=" + str(pool_tokens) + " is not a multiple of chunk_tokens=" + str(chunk_tokens));
    }
    if (pool_tokens < min_pool_tokens()) {
        fail("pool_tokens=" + str(pool_tokens) + " is below the minimum " + str(min_pool_tokens()) +
             " = (sink_chunks " + str(sink_chunks) + " + tail_chunks " + str(tail_chunks) + " + 2) * " +
             str(chunk_tokens));
    }
    // slots are handed to ggml_set_rows as int32
    if (pool_tokens > std::numeric_limits<int32_t>::max()) {
        fail("pool_tokens=" + str(pool_tokens) + " exceeds the int32 slot range (max 2147483647)");
    }
}

// ---- construction and small helpers -----------------------------------------------------------------

KvPager::KvPager(const PagerConfig & cfg) : cfg_(cfg) {
    cfg_.validate();
    n_blocks_ = cfg_.pool_tokens / cfg_.chunk_tokens;
    block_order_.resize(n_blocks_);
    std::iota(block_order_.begin(), block_order_.end(), int64_t(0));
    reset();
    epoch_ = 0;
}

int64_t KvPager::n_chunks_for(int64_t n_tokens) const {
    return (n_tokens + cfg_.chunk_tokens - 1) / cfg_.chunk_tokens;
}

int64_t KvPager::n_chunks() const { return n_chunks_for(n_tokens_); }

bool KvPager::is_protected(int64_t chunk, int64_t n_tokens, bool pinned) const {
    if (chunk < cfg_.sink_chunks || pinned) {
        return true;
    }
    if (n_tokens == 0) {
        return false;   // no head yet, so no tail window
    }
    const int64_t head = (n_tokens - 1) / cfg_.chunk_tokens;
    return chunk <= head && chunk >= head - cfg_.tail_chunks;
}

std::vector<uint8_t> KvPager::protected_mask(int64_t n_tokens, int64_t pin_c0, int64_t pin_c1) const {
    std::vector<uint8_t> mask(chunks_.size(), 0);
    for (int64_t c = 0; c < n_chunks_for(n_tokens); ++c) {
        const bool pinned = chunks_[c].pinned || (pin_c0 <= c && c < pin_c1);
        mask[c] = is_protected(c, n_tokens, pinned);
    }
    return mask;
}

// Built from the pool's owners rather than a pass over every chunk, so a decode step's plan costs O(pool + span),
// not O(context): pinned chunks that hold positions are resident (I4), and every chunk from n_chunks() on is in the span.
std::vector<int64_t> KvPager::alloc_keep(int64_t start, int64_t n) const {
    const int64_t head = (start + n - 1) / cfg_.chunk_tokens;
    std::vector<int64_t> keep;
    for (int64_t c = 0; c < std::min(cfg_.sink_chunks, head + 1); ++c) keep.push_back(c);
    for (int64_t c : block_owner_) {
        if (c >= 0 && chunks_[c].pinned) keep.push_back(c);
    }
    for (int64_t c = std::max<int64_t>(0, std::min(start / cfg_.chunk_tokens, head - cfg_.tail_chunks)); c <= head; ++c) {
        keep.push_back(c);   // the tail window at the new head and the span
    }
    std::sort(keep.begin(), keep.end());
    keep.erase(std::unique(keep.begin(), keep.end()), keep.end());
    return keep;
}

// Counts every sink and pinned chunk up to max_tokens, written or not: I5 must hold before they exist so
// that writing them later can never run out of evictable blocks.
int64_t KvPager::n_sinks_or_pinned(int64_t pin_c0, int64_t pin_c1) const {
    int64_t n = 0;
    for (int64_t c = 0; c < (int64_t) chunks_.size(); ++c) {
        n += c < cfg_.sink_chunks || chunks_[c].pinned || (pin_c0 <= c && c < pin_c1);
    }
    return n;
}

bool KvPager::pins_leave_room(int64_t n_sinks_or_pinned) const {
    return n_blocks_ - n_sinks_or_pinned - (cfg_.tail_chunks + 1) >= 1;
}

std::vector<int64_t> KvPager::in_hand_out_order(const std::vector<uint8_t> & is_free) const {
    std::vector<int64_t> out;
    for (int64_t b : block_order_) {
        if (is_free[b]) {
            out.push_back(b);
        }
    }
    return out;
}

void KvPager::take_block(int64_t chunk, int64_t block) {
    chunks_[chunk].block = block;
    block_owner_[block]  = chunk;
}

void KvPager::release_block(int64_t chunk) {
    const int64_t b = chunks_[chunk].block;
    if (b >= 0) {
        block_owner_[b] = -1;
    }
    chunks_[chunk].block = -1;
}

// ---- eviction order ---------------------------------------------------------------------------------

// Victims first: unscored (no score or NaN) below every real score, then lower score; on ties a
// non-resident chunk before a resident one (so a reselect keeps what it already has and moves nothing
// needlessly), then the oldest written (LRU), then the lower chunk index (determinism).
std::vector<int64_t> KvPager::rank_for_eviction(std::vector<int64_t> candidates,
                                                const std::vector<float> & scores) const {
    auto key = [&](int64_t c) {
        const bool scored = c < (int64_t) scores.size() && !std::isnan(scores[c]);
        return std::make_tuple(scored, scored ? scores[c] : 0.0f, chunks_[c].block >= 0,
                               chunks_[c].last_write, c);
    };
    std::sort(candidates.begin(), candidates.end(), [&](int64_t a, int64_t b) { return key(a) < key(b); });
    return candidates;
}

std::vector<int64_t> KvPager::victims_in_order(const ChunkFilter & kept) const {
    std::vector<int64_t> candidates;
    for (int64_t c : block_owner_) {   // the resident chunks, O(pool); rank_for_eviction fixes their order
        if (c >= 0 && !kept(c)) {
            candidates.push_back(c);
        }
    }
    return rank_for_eviction(std::move(candidates), scores_);
}

void KvPager::plan_residency(Plan & plan, const std::vector<int64_t> & need, const ChunkFilter & kept,
                             const std::vector<int64_t> & release) const {
    if (need.empty()) return;   // most decode steps: nothing to place, so no victims to rank
    std::vector<uint8_t> is_free(n_blocks_, 0);
    for (int64_t b : free_blocks_) is_free[b] = 1;
    for (int64_t b : release) is_free[b] = 1;
    // free blocks first (in hand-out order); evict only once they are used up
    const std::vector<int64_t> avail   = in_hand_out_order(is_free);
    const std::vector<int64_t> victims = victims_in_order(kept);
    size_t next_free = 0;
    size_t next_victim = 0;
    for (int64_t c : need) {
        int64_t b = -1;
        if (next_free < avail.size()) {
            b = avail[next_free++];
        } else if (next_victim < victims.size()) {
            const int64_t v = victims[next_victim++];
            b = chunks_[v].block;
            plan.page_outs.push_back({ v, b, !chunks_[v].host_valid });
        } else {
            throw std::logic_error("KvPager: no evictable block left for chunk " + str(c) +
                                   " (capacity check missed; n_blocks=" + str(n_blocks_) + ")");
        }
        (c < n_chunks() ? plan.page_ins : plan.fresh).push_back({ c, b, true });
    }
}

// ---- plans ------------------------------------------------------------------------------------------

Plan KvPager::plan_alloc(int64_t start, int64_t n) const {
    if (start != n_tokens_) {
        throw std::invalid_argument("plan_alloc: start=" + str(start) + " must equal n_tokens()=" + str(n_tokens_) +
                                    " (truncate first to rewrite positions)");
    }
    if (n <= 0) {
        throw std::invalid_argument("plan_alloc: n=" + str(n) + " must be >= 1");
    }
    if (n > cfg_.max_tokens - start) {
        throw std::out_of_range("plan_alloc: positions " + range(start, start + n) + " exceed max_tokens=" +
                                str(cfg_.max_tokens) + "; at most " + str(cfg_.max_tokens - start) +
                                " more positions fit");
    }
    const std::vector<int64_t> keep = alloc_keep(start, n);
    if ((int64_t) keep.size() > n_blocks_) {
        throw std::runtime_error("plan_alloc: span " + range(start, start + n) + " needs " + str((int64_t) keep.size()) +
                                 " resident chunks (sinks, pins, tail window, the span) but the pool has n_blocks=" +
                                 str(n_blocks_) + "; max_span_tokens()=" + str(max_span_tokens()) +
                                 " (split the span)");
    }
    Plan plan;
    plan.epoch          = epoch_;
    plan.span_start     = start;
    plan.span_n         = n;
    plan.n_tokens_after = start + n;
    std::vector<int64_t> need;
    for (int64_t c : keep) {
        if (chunks_[c].block < 0) {
            need.push_back(c);
        }
    }
    plan_residency(plan, need, [&keep](int64_t c) { return std::binary_search(keep.begin(), keep.end(), c); }, {});

    // the block of every span chunk after apply: unchanged if resident, else from the plan
    const int64_t ct = cfg_.chunk_tokens;
    const int64_t c0 = start / ct;
    std::vector<int64_t> block_after((start + n - 1) / ct - c0 + 1);
    for (size_t i = 0; i < block_after.size(); ++i) block_after[i] = chunks_[c0 + i].block;
    for (const ChunkMove & m : plan.page_ins) if (m.chunk >= c0) block_after[m.chunk - c0] = m.block;
    for (const ChunkMove & m : plan.fresh)    if (m.chunk >= c0) block_after[m.chunk - c0] = m.block;
    plan.slots.resize(n);
    for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = start + i;
        plan.slots[i] = (int32_t) (block_after[pos / ct - c0] * ct + pos % ct);
    }
    return plan;
}

int64_t KvPager::max_span_tokens(int64_t limit) const {
    // Each probe is O(pool + span): a decode step asks with limit 1, so it pays for one probe, not ~17.
    const int64_t room = std::min(cfg_.max_tokens - n_tokens_, std::max<int64_t>(limit, 1));
    auto fits = [&](int64_t n) { return (int64_t) alloc_keep(n_tokens_, n).size() <= n_blocks_; };
    if (room == 0 || !fits(1)) {
        return 0;   // fits(1) holds whenever room > 0, by I5
    }
    // The keep count never shrinks as n grows (the span and the tail window only extend to the right, and
    // a chunk leaving the window is replaced by the new head chunk), so the feasible spans are [1, answer].
    int64_t lo = 1;
    int64_t hi = room;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo + 1) / 2;
        if (fits(mid)) lo = mid; else hi = mid - 1;
    }
    return lo;
}

Plan KvPager::plan_reselect(const std::vector<float> & scores) const {
    if ((int64_t) scores.size() != n_chunks()) {
        throw std::invalid_argument("plan_reselect: scores has " + str((int64_t) scores.size()) +
                                    " entries but n_chunks()=" + str(n_chunks()) + " (one per chunk, NaN for none)");
    }
    std::vector<uint8_t> keep = protected_mask(n_tokens_);
    std::vector<int64_t> candidates;
    for (int64_t c = 0; c < n_chunks(); ++c) {
        if (!keep[c]) {
            candidates.push_back(c);
        }
    }
    // the last `budget` of the eviction order are the highest-scored: they join the protected chunks
    const int64_t budget = n_blocks_ - count_set(keep);
    const std::vector<int64_t> ranked = rank_for_eviction(std::move(candidates), scores);
    for (int64_t i = std::max<int64_t>(0, (int64_t) ranked.size() - budget); i < (int64_t) ranked.size(); ++i) {
        keep[ranked[i]] = 1;
    }
    Plan plan;
    plan.epoch          = epoch_;
    plan.n_tokens_after = n_tokens_;
    plan.scores         = scores;
    plan.sets_scores    = true;
    const std::vector<int64_t> need = evicted_among(keep);
    // When the keep set fills the pool, making room for `need` evicts every resident chunk outside it.
    plan_residency(plan, need, mask_filter(keep), {});
    return plan;
}

Plan KvPager::plan_truncate(int64_t n) const {
    if (n < 0 || n > n_tokens_) {
        throw std::out_of_range("plan_truncate: n=" + str(n) + " must be in [0, n_tokens()=" + str(n_tokens_) + "]");
    }
    Plan plan;
    plan.epoch          = epoch_;
    plan.n_tokens_after = n;
    std::vector<uint8_t> keep = protected_mask(n);
    std::vector<int64_t> release;
    for (int64_t c = n_chunks_for(n); c < n_chunks(); ++c) {
        plan.dropped.push_back(c);
        if (chunks_[c].block >= 0) {
            release.push_back(chunks_[c].block);
        }
        keep[c] = 1;   // a dropped chunk releases its block; it is never an eviction victim
    }
    std::vector<int64_t> need;
    for (int64_t c = 0; c < n_chunks_for(n); ++c) {
        if (keep[c] && chunks_[c].block < 0) {
            need.push_back(c);
        }
    }
    plan_residency(plan, need, mask_filter(keep), release);
    return plan;
}

Plan KvPager::plan_pin(int64_t lo, int64_t hi) const {
    if (lo < 0 || lo > hi || hi > cfg_.max_tokens) {
        throw std::out_of_range("plan_pin: range " + range(lo, hi) + " must satisfy 0 <= lo <= hi <= max_tokens=" +
                                str(cfg_.max_tokens));
    }
    Plan plan;
    plan.epoch          = epoch_;
    plan.n_tokens_after = n_tokens_;
    if (lo == hi) {
        return plan;
    }
    const int64_t c0 = lo / cfg_.chunk_tokens;
    const int64_t c1 = (hi - 1) / cfg_.chunk_tokens + 1;
    const int64_t n_sp = n_sinks_or_pinned(c0, c1);
    if (!pins_leave_room(n_sp)) {
        throw std::runtime_error("plan_pin: pinning " + range(lo, hi) + " (chunks " + range(c0, c1) + ") makes " +
                                 str(n_sp) + " sink or pinned chunks; with n_blocks=" + str(n_blocks_) +
                                 " and a tail window of tail_chunks+1=" + str(cfg_.tail_chunks + 1) +
                                 " at most " + str(n_blocks_ - cfg_.tail_chunks - 2) +
                                 " are allowed (one block must stay evictable)");
    }
    for (int64_t c = c0; c < c1; ++c) {
        if (!chunks_[c].pinned) {
            plan.pins.push_back(c);
        }
    }
    const std::vector<uint8_t> keep = protected_mask(n_tokens_, c0, c1);
    const std::vector<int64_t> need = evicted_among(keep);
    plan_residency(plan, need, mask_filter(keep), {});
    return plan;
}

std::vector<int64_t> KvPager::evicted_among(const std::vector<uint8_t> & keep) const {
    std::vector<int64_t> out;
    for (int64_t c = 0; c < n_chunks(); ++c) {
        if (keep[c] && chunks_[c].block < 0) {
            out.push_back(c);
        }
    }
    return out;
}

// ---- mutators ---------------------------------------------------------------------------------------

// Trusts the plan: it can only come from a plan_*() call on this pager at this epoch, so nothing below
// can fail half-way.
void KvPager::apply(const Plan & plan) {
    if (plan.epoch != epoch_) {
        throw std::runtime_error("apply: stale plan made at epoch " + std::to_string(plan.epoch) +
                                 "; the pager is at epoch " + std::to_string(epoch_) +
                                 " (plan again after every apply, unpin_all, reset or set_block_order)");
    }
    for (int64_t c : plan.dropped) {
        release_block(c);
        chunks_[c].host_valid = false;
        chunks_[c].last_write = 0;
    }
    for (const ChunkMove & m : plan.page_outs) {
        release_block(m.chunk);
        chunks_[m.chunk].host_valid = true;
        stats_.page_outs += 1;
        stats_.bytes_out += m.copy ? cfg_.chunk_bytes : 0;
        stats_.evictions += plan.sets_scores ? 0 : 1;
    }
    for (const ChunkMove & m : plan.page_ins) {
        take_block(m.chunk, m.block);
        stats_.page_ins += 1;
        stats_.bytes_in += cfg_.chunk_bytes;
    }
    for (const ChunkMove & m : plan.fresh) {
        take_block(m.chunk, m.block);
    }
    if (plan.span_n > 0) {
        // the written chunks differ from any host image now, and are the most recently written
        ++write_clock_;
        const int64_t ct = cfg_.chunk_tokens;
        for (int64_t c = plan.span_start / ct; c <= (plan.span_start + plan.span_n - 1) / ct; ++c) {
            chunks_[c].host_valid = false;
            chunks_[c].last_write = write_clock_;
        }
    }
    for (int64_t c : plan.pins) {
        chunks_[c].pinned = true;
    }
    n_tokens_ = plan.n_tokens_after;
    if (plan.sets_scores) {
        scores_ = plan.scores;
        stats_.reselects += 1;
    }
    if ((int64_t) scores_.size() > n_chunks()) {
        scores_.resize(n_chunks());   // a truncate forgets the scores of dropped chunks
    }
    std::vector<uint8_t> is_free(n_blocks_);
    for (int64_t b = 0; b < n_blocks_; ++b) is_free[b] = block_owner_[b] < 0;
    free_blocks_ = in_hand_out_order(is_free);
    ++epoch_;
}

void KvPager::unpin_all() {
    for (ChunkState & cs : chunks_) {
        cs.pinned = false;
    }
    ++epoch_;
}

void KvPager::reset() {
    n_tokens_    = 0;
    write_clock_ = 0;
    chunks_.assign(n_chunks_for(cfg_.max_tokens), ChunkState{});
    block_owner_.assign(n_blocks_, -1);
    free_blocks_ = block_order_;
    scores_.clear();
    stats_ = PagerStats{};
    ++epoch_;
}

void KvPager::set_block_order(const std::vector<int64_t> & order) {
    if (n_resident() > 0) {
        throw std::runtime_error("set_block_order: only allowed while no chunk is resident (n_resident()=" +
                                 str(n_resident()) + "); reset() first");
    }
    if ((int64_t) order.size() != n_blocks_) {
        throw std::invalid_argument("set_block_order: order has " + str((int64_t) order.size()) +
                                    " entries; it must be a permutation of [0, n_blocks=" + str(n_blocks_) + ")");
    }
    std::vector<uint8_t> seen(n_blocks_, 0);
    for (size_t i = 0; i < order.size(); ++i) {
        const int64_t b = order[i];
        if (b < 0 || b >= n_blocks_ || seen[b]) {
            throw std::invalid_argument("set_block_order: order[" + std::to_string(i) + "]=" + str(b) +
                                        " is out of range or repeated; it must be a permutation of [0, n_blocks=" +
                                        str(n_blocks_) + ")");
        }
        seen[b] = 1;
    }
    block_order_ = order;
    free_blocks_ = block_order_;
    ++epoch_;
}

// ---- queries ----------------------------------------------------------------------------------------

int64_t KvPager::slot_of(int64_t pos) const {
    if (pos < 0 || pos >= cfg_.max_tokens) {
        throw std::out_of_range("slot_of: pos=" + str(pos) + " is outside [0, max_tokens=" + str(cfg_.max_tokens) + ")");
    }
    if (pos >= n_tokens_) {
        return -1;
    }
    const int64_t b = chunks_[pos / cfg_.chunk_tokens].block;
    return b < 0 ? -1 : b * cfg_.chunk_tokens + pos % cfg_.chunk_tokens;
}

std::vector<int64_t> KvPager::slot_positions() const {   // O(pool): every decode step asks
    const int64_t ct = cfg_.chunk_tokens;
    std::vector<int64_t> out(cfg_.pool_tokens, -1);
    for (int64_t b = 0; b < n_blocks_; ++b) {
        const int64_t c = block_owner_[b];
        for (int64_t i = 0; c >= 0 && i < ct && c * ct + i < n_tokens_; ++i) {
            out[b * ct + i] = c * ct + i;
        }
    }
    return out;
}

std::vector<int64_t> KvPager::chunk_blocks() const {
    std::vector<int64_t> out(n_chunks());
    for (int64_t c = 0; c < n_chunks(); ++c) out[c] = chunks_[c].block;
    return out;
}

std::vector<uint8_t> KvPager::chunk_host_valid() const {
    std::vector<uint8_t> out(n_chunks());
    for (int64_t c = 0; c < n_chunks(); ++c) out[c] = chunks_[c].host_valid;
    return out;
}

std::vector<uint8_t> KvPager::protected_chunks() const {
    std::vector<uint8_t> mask = protected_mask(n_tokens_);
    mask.resize(n_chunks());
    return mask;
}

bool KvPager::is_resident(int64_t chunk) const {
    check_chunk(chunk, chunks_.size(), "is_resident");
    return chunks_[chunk].block >= 0;
}

bool KvPager::is_pinned(int64_t chunk) const {
    check_chunk(chunk, chunks_.size(), "is_pinned");
    return chunks_[chunk].pinned;
}

bool KvPager::is_identity() const {
    for (int64_t b = 0; b < n_blocks_; ++b) {
        if (block_owner_[b] >= 0 && block_owner_[b] != b) {
            return false;
        }
    }
    return true;
}

int64_t KvPager::n_resident() const {
    return std::count_if(block_owner_.begin(), block_owner_.end(), [](int64_t c) { return c >= 0; });
}

int64_t KvPager::n_host_images() const {
    return std::count_if(chunks_.begin(), chunks_.end(), [](const ChunkState & cs) { return cs.host_valid; });
}

// ---- invariants -------------------------------------------------------------------------------------

void KvPager::check_invariants() const {
    auto fail = [](const std::string & msg) { throw std::logic_error("KvPager invariant " + msg); };
    if (n_tokens_ < 0 || n_tokens_ > cfg_.max_tokens) fail("n_tokens=" + str(n_tokens_) + " outside [0, max_tokens]");
    for (int64_t b = 0; b < n_blocks_; ++b) {
        const int64_t o = block_owner_[b];
        if (o != -1 && (o < 0 || o >= (int64_t) chunks_.size() || chunks_[o].block != b)) {
            fail("I1: block " + str(b) + " owner " + str(o) + " does not point back to it");
        }
    }
    for (int64_t c = 0; c < (int64_t) chunks_.size(); ++c) {
        const int64_t b = chunks_[c].block;
        if (b != -1 && (b < 0 || b >= n_blocks_ || block_owner_[b] != c)) {
            fail("I1: chunk " + str(c) + " claims block " + str(b) + " which it does not own");
        }
    }
    if (n_resident() > n_blocks_) fail("I2: " + str(n_resident()) + " resident chunks > n_blocks=" + str(n_blocks_));
    const std::vector<uint8_t> prot = protected_mask(n_tokens_);
    for (int64_t c = 0; c < n_chunks(); ++c) {
        const ChunkState & cs = chunks_[c];
        if (cs.block < 0 && !cs.host_valid) fail("I3: chunk " + str(c) + " is neither resident nor on the host");
        if (prot[c] && cs.block < 0) fail("I4: protected chunk " + str(c) + " is not resident");
    }
    if (!pins_leave_room(n_sinks_or_pinned())) {
        fail("I5: " + str(n_sinks_or_pinned()) + " sink or pinned chunks leave no evictable block of " + str(n_blocks_));
    }
    for (int64_t c = n_chunks(); c < (int64_t) chunks_.size(); ++c) {
        if (chunks_[c].block >= 0 || chunks_[c].host_valid) {
            fail("I6: chunk " + str(c) + " >= n_chunks()=" + str(n_chunks()) + " owns a block or host image");
        }
    }
    std::vector<uint8_t> is_free(n_blocks_);
    for (int64_t b = 0; b < n_blocks_; ++b) is_free[b] = block_owner_[b] < 0;
    if (free_blocks_ != in_hand_out_order(is_free)) {
        fail("I7: the free list is not exactly the unowned blocks in hand-out order");
    }
    if ((int64_t) scores_.size() > n_chunks()) fail("scores cover " + str((int64_t) scores_.size()) + " chunks > n_chunks()");
}

}  // namespace kvf
