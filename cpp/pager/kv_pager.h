// KvPager: residency bookkeeping for the pooled KV cache. Pure C++, no ggml.
//
// The logical context is cut into chunks of `chunk_tokens` consecutive positions; chunk c holds
// positions [c*chunk_tokens, (c+1)*chunk_tokens). The pool has n_blocks = pool_tokens/chunk_tokens
// blocks of chunk_tokens slots each. A resident chunk owns one block; slot_of(p) = block*chunk + p%chunk.
// An evicted chunk lives only in the host store (owned by PooledKV; the pager only tracks it).
//
// Invariants (check_invariants() verifies all of them and throws on the first violation):
//   I1  every block is owned by at most one chunk, and block_owner / chunk.block agree;
//   I2  resident chunks <= n_blocks;
//   I3  every chunk that has positions (c < n_chunks()) is resident or has a valid host image;
//   I4  protected chunks that have positions are resident: sinks (c < sink_chunks), the tail window
//       (the head chunk, which holds position n_tokens-1, and the tail_chunks before it), pinned chunks;
//   I5  pins leave room: n_blocks - |sinks U pinned| - (tail_chunks + 1) >= 1, so a new chunk always
//       finds an evictable block;
//   I6  chunks >= n_chunks() own no block and no host image;
//   I7  the free list holds exactly the blocks no chunk owns.
//
// Plan, then apply: plan_*() are const and return a Plan; apply(plan) is the only mutator of the
// mapping (besides reset/pins/scores). PooledKV executes the same plan on tensors between the two:
// first every page-out (block -> host), then every page-in (host -> block). A plan records the epoch
// it was made at; applying it after any other mapping change is an error. A plan that cannot be made
// throws and changes nothing.
//
// Epoch: advances on every apply(), unpin_all(), reset(), set_block_order() and replace_state(), so a plan
// is valid only against the exact state it was made from. It is not part of the saved state.
//
// State (snapshots): save_state() writes everything above except the epoch; state_from() is the const
// half that reads and fully validates a saved state against this pager's config (the loaded state must
// pass check_invariants() here) and returns it as a new pager; replace_state() is the commit. Errors in
// saved bytes are SnapshotError (common/byte_io.h), never one of the kinds above.
//
// Block hand-out: free blocks are handed out in block-order (identity unless set_block_order) and a
// released block rejoins the free list at its place in that order. So a fresh pager puts chunk c in
// block c until the first eviction, and truncate-then-rewrite keeps the identity mapping.
//
// Errors: std::invalid_argument for malformed arguments (bad config, start != n_tokens(), wrong score
// count, a block order that is not a permutation); std::out_of_range for positions or chunks outside
// [0, max_tokens) / [0, n_tokens]; std::runtime_error when the request does not fit the pool (a span or a
// pin set too large), for a stale plan, and for set_block_order while chunks are resident;
// std::logic_error from check_invariants(). Every message names the bad value and the valid range.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace kvf {

class ByteReader;
class ByteWriter;

// Positions per chunk unless a config says otherwise: the unit of residency, paging and scoring.
constexpr int64_t k_chunk_tokens = 64;

struct PagerConfig {
    int64_t chunk_tokens = k_chunk_tokens;
    int64_t pool_tokens  = 0;   // device slots; a multiple of chunk_tokens, >= min_pool_tokens()
    int64_t max_tokens   = 0;   // logical context capacity (positions), > 0
    int64_t sink_chunks  = 1;
    int64_t tail_chunks  = 4;
    int64_t chunk_bytes  = 0;   // K+V bytes of one chunk over all pooled layers (for the stats only)

    int64_t min_pool_tokens() const { return (sink_chunks + tail_chunks + 2) * chunk_tokens; }
    void validate() const;      // throws std::invalid_argument naming the bad field (and the minimum);
                                // also pool_tokens <= INT32_MAX, since slots are int32
};

// One chunk moving between a block and the host store.
struct ChunkMove {
    int64_t chunk = -1;
    int64_t block = -1;
    bool    copy  = true;       // page-out only: false when the host image is already valid (drop only)
};

struct Plan {
    uint64_t epoch = 0;                  // pager epoch the plan was made at
    std::vector<ChunkMove> page_outs;    // executed first: block bytes -> host image (if copy)
    std::vector<ChunkMove> page_ins;     // then: host image -> block
    std::vector<ChunkMove> fresh;        // chunks that get an empty block (no bytes move)
    std::vector<int64_t>   dropped;      // chunks forgotten (truncate): block and host image released
    int64_t n_tokens_after = 0;          // append head after apply
    // alloc plans only: the span being written and its slot per position
    int64_t span_start = 0;
    int64_t span_n     = 0;
    std::vector<int32_t> slots;
    // reselect plans only: the scores that become current on apply
    std::vector<float> scores;
    bool sets_scores = false;
    // pin plans only: chunks that become pinned on apply
    std::vector<int64_t> pins;

    bool moves_bytes() const { return !page_outs.empty() || !page_ins.empty(); }
};

struct PagerStats {
    int64_t page_outs   = 0;   // chunks paged out (copies and drops)
    int64_t page_ins    = 0;
    int64_t bytes_out   = 0;   // bytes copied block -> host
    int64_t bytes_in    = 0;   // bytes copied host -> block
    int64_t reselects   = 0;
    int64_t evictions   = 0;   // page-outs not chosen by a reselect (alloc, pin, truncate making room)
};

class KvPager {
public:
    explicit KvPager(const PagerConfig & cfg);

    const PagerConfig & config() const { return cfg_; }
    int64_t n_blocks() const { return n_blocks_; }
    int64_t n_tokens() const { return n_tokens_; }              // append head: positions [0, n_tokens) exist
    int64_t n_chunks() const;                                   // chunks holding at least one position
    uint64_t epoch() const { return epoch_; }

    // Allocation for positions [start, start+n). start must equal n_tokens() (truncate first to rewrite),
    // n >= 1, start+n <= max_tokens. Every chunk of the span becomes resident and protected for this call
    // (as are the sinks, pins and the tail window at the new head); victims are the lowest-scored evictable
    // chunks when scores exist (unscored ones first), else the oldest written. Writing into a chunk
    // invalidates its host image.
    Plan plan_alloc(int64_t start, int64_t n) const;
    // The largest span (tokens) that plan_alloc can take in one call starting at n_tokens().
    int64_t max_span_tokens(int64_t limit = INT64_MAX) const;   // limit: the caller wants no more (cheaper)

    // Resident set := protected chunks + the highest-scored other chunks that fit. scores.size() must be
    // n_chunks(); NaN means "no score" and ranks below every real score. Ties keep a resident chunk over a
    // non-resident one (no needless moves), then the more recently written.
    Plan plan_reselect(const std::vector<float> & scores) const;

    // Forget positions >= n (n <= n_tokens). Pages in what becomes the tail window if it was evicted.
    Plan plan_truncate(int64_t n) const;

    // Pin chunks overlapping the half-open token range [lo, hi). Pinned chunks that exist are paged in.
    // Throws if the pins would leave nothing evictable (I5).
    Plan plan_pin(int64_t lo, int64_t hi) const;

    void apply(const Plan & plan);
    void unpin_all();
    // Back to a fresh pager: no positions, pins, scores or host images, zero stats. The epoch still
    // advances, and a block order set by set_block_order is kept.
    void reset();

    // Test-only hook: the order in which free blocks are handed out (a permutation of [0, n_blocks)).
    // Only allowed while no chunk is resident. The default is identity order.
    void set_block_order(const std::vector<int64_t> & order);

    // Queries.
    int64_t slot_of(int64_t pos) const;                    // -1 if pos is not resident (or not written);
                                                           // out_of_range unless 0 <= pos < max_tokens
    std::vector<int64_t> slot_positions() const;           // per slot: the position it holds, -1 if none
    std::vector<int64_t> chunk_blocks() const;             // per chunk < n_chunks(): block or -1
    std::vector<uint8_t> chunk_host_valid() const;         // per chunk < n_chunks(): host image valid
    std::vector<uint8_t> protected_chunks() const;         // per chunk < n_chunks(): protected now
    std::vector<float>   scores() const { return scores_; }
    bool is_resident(int64_t chunk) const;                 // out_of_range unless 0 <= chunk < max chunks
    bool is_pinned(int64_t chunk) const;                   // (ceil(max_tokens / chunk_tokens))
    bool is_identity() const;                              // every resident chunk c sits in block c
    int64_t n_resident() const;
    int64_t n_host_images() const;
    int64_t host_bytes() const { return n_host_images() * cfg_.chunk_bytes; }
    const PagerStats & stats() const { return stats_; }

    void check_invariants() const;

    // ---- state (kv_pager_state.cpp) ----
    static constexpr uint32_t k_state_version = 1;
    void save_state(ByteWriter & w) const;
    // The state save_state wrote (at `version`), on a pager with this pager's config: the chunk size and
    // chunk_bytes must match; a different pool or context works when every resident block and position
    // fits and the protections hold. A saved non-identity block order needs the same number of blocks.
    KvPager state_from(ByteReader & r, uint32_t version) const;
    // Become `loaded` (made by state_from on this pager); the epoch moves past this pager's.
    void replace_state(KvPager && loaded);

private:
    struct ChunkState {
        int64_t  block      = -1;      // -1: not resident
        bool     host_valid = false;   // the host store holds an exact image of this chunk
        bool     pinned     = false;
        uint64_t last_write = 0;       // write clock at the last alloc touching it (LRU order)
    };

    // The one definition of "protected" (pinned is passed in so a pin plan can ask about pins to be).
    bool is_protected(int64_t chunk, int64_t n_tokens, bool pinned) const;
    // Per chunk (sized for max_tokens): protected at n_tokens, with chunks [pin_c0, pin_c1) counted pinned.
    std::vector<uint8_t> protected_mask(int64_t n_tokens, int64_t pin_c0 = 0, int64_t pin_c1 = 0) const;
    // What must be resident after writing [start, start+n): the protection at the new head + the span, sorted.
    std::vector<int64_t> alloc_keep(int64_t start, int64_t n) const;
    int64_t n_chunks_for(int64_t n_tokens) const;
    int64_t n_sinks_or_pinned(int64_t pin_c0 = 0, int64_t pin_c1 = 0) const;
    bool pins_leave_room(int64_t n_sinks_or_pinned) const;   // the I5 rule
    // Plan page-outs/page-ins/fresh so that every chunk in `need` is resident, evicting only chunks
    // `kept` refuses. Blocks freed by `release` are reusable. A needed chunk below n_chunks() is paged in (it has a
    // host image by I3), one above gets a fresh block. Callers check capacity first; throws logic_error if
    // it still does not fit.
    using ChunkFilter = std::function<bool(int64_t)>;   // kept(chunk): never an eviction victim
    void plan_residency(Plan & plan, const std::vector<int64_t> & need, const ChunkFilter & kept,
                        const std::vector<int64_t> & release) const;
    std::vector<int64_t> victims_in_order(const ChunkFilter & kept) const;
    // Chunks with positions that `keep` marks but that are not resident (they must be paged in).
    std::vector<int64_t> evicted_among(const std::vector<uint8_t> & keep) const;
    // The one eviction order: `candidates` sorted from first victim to last under `scores`.
    std::vector<int64_t> rank_for_eviction(std::vector<int64_t> candidates, const std::vector<float> & scores) const;
    // The one hand-out order: the blocks with is_free[b], in block_order_.
    std::vector<int64_t> in_hand_out_order(const std::vector<uint8_t> & is_free) const;
    void take_block(int64_t chunk, int64_t block);
    void release_block(int64_t chunk);
    void read_chunk_table(ByteReader & r);   // state_from's chunk table and pins, into a fresh pager

    PagerConfig cfg_;
    int64_t n_blocks_ = 0;
    int64_t n_tokens_ = 0;
    uint64_t epoch_ = 0;
    uint64_t write_clock_ = 0;
    std::vector<ChunkState> chunks_;       // indexed by chunk, sized for max_tokens
    std::vector<int64_t> block_owner_;     // per block: owning chunk or -1
    std::vector<int64_t> free_blocks_;     // handed out from the front
    std::vector<int64_t> block_order_;     // hand-out order used when (re)building the free list
    std::vector<float> scores_;            // last reselect's scores (empty: none yet)
    PagerStats stats_;
};

}  // namespace kvf
