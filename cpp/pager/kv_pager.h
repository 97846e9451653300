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
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvf {

struct PagerConfig {
    int64_t chunk_tokens = 64;
    int64_t pool_tokens  = 0;   // device slots; a multiple of chunk_tokens, >= min_pool_tokens()
    int64_t max_tokens   = 0;   // logical context capacity (positions), > 0
    int64_t sink_chunks  = 1;
    int64_t tail_chunks  = 4;
    int64_t chunk_bytes  = 0;   // K+V bytes of one chunk over all pooled layers (for the stats only)

    int64_t min_pool_tokens() const { return (sink_chunks + tail_chunks + 2) * chunk_tokens; }
    void validate() const;      // throws std::invalid_argument naming the bad field (and the minimum)
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

    bool moves_bytes() const { return !page_outs.empty() || !page_ins.empty(); }
};

struct PagerStats {
    int64_t page_outs   = 0;   // chunks paged out (copies and drops)
    int64_t page_ins    = 0;
    int64_t bytes_out   = 0;   // bytes copied block -> host
    int64_t bytes_in    = 0;   // bytes copied host -> block
    int64_t reselects   = 0;
    int64_t evictions   = 0;   // page-outs caused by allocation (not reselect)
};

class KvPager {
public:
    explicit KvPager(const PagerConfig & cfg);

    const PagerConfig & config() const { return cfg_; }
    int64_t n_blocks() const { return n_blocks_; }
    int64_t n_tokens() const { return n_tokens_; }              // append head: positions [0, n_tokens) exist
    int64_t n_chunks() const;                                   // chunks holding at least one position
    uint64_t epoch() const { return epoch_; }

    // Allocation for positions [start, start+n). start must equal n_tokens() (truncate first to rewrite).
    // Every chunk of the span becomes resident and protected for this call; victims are the lowest-scored
    // evictable chunks when scores exist (unscored ones first), else the oldest written.
    Plan plan_alloc(int64_t start, int64_t n) const;
    // The largest span (tokens) that plan_alloc can take in one call starting at n_tokens().
    int64_t max_span_tokens() const;

    // Resident set := protected chunks + the highest-scored other chunks that fit. scores.size() must be
    // n_chunks(); NaN means "no score" and ranks below every real score.
    Plan plan_reselect(const std::vector<float> & scores) const;

    // Forget positions >= n (n <= n_tokens). Pages in what becomes the tail window if it was evicted.
    Plan plan_truncate(int64_t n) const;

    // Pin chunks overlapping the half-open token range [lo, hi). Pinned chunks that exist are paged in.
    // Throws if the pins would leave nothing evictable (I5).
    Plan plan_pin(int64_t lo, int64_t hi) const;

    void apply(const Plan & plan);
    void unpin_all();
    void reset();   // back to a fresh pager (epoch still advances)

    // Test-only hook: the order in which free blocks are handed out (a permutation of [0, n_blocks)).
    // Only allowed while no chunk is resident. The default is identity order.
    void set_block_order(const std::vector<int64_t> & order);

    // Queries.
    int64_t slot_of(int64_t pos) const;                    // -1 if pos is not resident (or not written)
    std::vector<int64_t> slot_positions() const;           // per slot: the position it holds, -1 if none
    std::vector<int64_t> chunk_blocks() const;             // per chunk < n_chunks(): block or -1
    std::vector<uint8_t> chunk_host_valid() const;         // per chunk < n_chunks(): host image valid
    std::vector<uint8_t> protected_chunks() const;         // per chunk < n_chunks(): protected now
    std::vector<float>   scores() const { return scores_; }
    bool is_resident(int64_t chunk) const;
    bool is_pinned(int64_t chunk) const;
    bool is_identity() const;                              // every resident chunk c sits in block c
    int64_t n_resident() const;
    int64_t n_host_images() const;
    int64_t host_bytes() const { return n_host_images() * cfg_.chunk_bytes; }
    const PagerStats & stats() const { return stats_; }

    void check_invariants() const;

private:
    struct ChunkState {
        int64_t  block      = -1;      // -1: not resident
        bool     host_valid = false;   // the host store holds an exact image of this chunk
        bool     pinned     = false;
        uint64_t last_write = 0;       // write clock at the last alloc touching it (LRU order)
    };

    bool is_protected(int64_t chunk, int64_t n_tokens) const;
    int64_t n_chunks_for(int64_t n_tokens) const;
    int64_t n_sinks_or_pinned() const;
    // Plan page-outs/page-ins so that every chunk in `need` is resident, evicting only chunks outside
    // `keep`. Blocks freed by `release` are reusable. Throws if they cannot all fit.
    void plan_residency(Plan & plan, const std::vector<int64_t> & need, const std::vector<uint8_t> & keep,
                        const std::vector<int64_t> & release, bool fresh_need) const;
    std::vector<int64_t> victims_in_order(const std::vector<uint8_t> & keep) const;

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
