// Session: one sequence running through a Model with its K/V in a PooledKV managed by a KvPager.
// forward(tokens, start) = allocate slots (pager plan) -> page bytes (PooledKV executes the plan)
// -> build or reuse the graph -> set inputs -> compute -> read logits.
// Phases follow ggml: backends and scheduler once per session; graphs built in a no_alloc context and
// reused while their shape (n_tokens, n_kv, n_outputs) repeats; inputs re-uploaded before every compute.
// The session also keeps the tokens whose K/V it holds (tokens()), so a snapshot of it is complete.
//
// Threads: every public method that reads or changes the session's state holds the session's mutex
// for the whole call (a second thread waits until the first is done); those that touch the backend
// (forward, paging, reading K/V, queries or attention) then also hold the model's compute_mutex(), so
// sessions of one model never compute at once. Lock order: session mutexes first (adopt takes both of
// its sessions' at once, deadlock-free), model mutexes last. Both are recursive, so public methods may
// call one another. pager(), kv(), tokens() and summaries() return references: their callers hold
// lock() while they use them (the bindings' Session.pager / Session.kv take it for every call). A
// caller that holds Python's GIL must release it before calling in: a compute may log through Python.
#pragma once

#include "common/host_memory.h"
#include "kv/kv_step_inputs.h"
#include "kv/pool_arena.h"
#include "kv/pooled_kv.h"
#include "kv/recurrent_state.h"
#include "kv/sliding_window_kv.h"
#include "model/graph.h"
#include "model/model.h"
#include "pager/kv_pager.h"
#include "scorer/chunk_summaries.h"

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace kvf {

class ByteReader;
class ByteWriter;

// The last tokens of a step whose queries (track_summaries) and attention (capture_attention) a session keeps
// for the scorers: the observation window of the question at the end of a prompt.
constexpr int64_t k_capture_tokens = 8;

struct SessionConfig {
    int64_t max_tokens   = 4096;    // logical context
    int64_t pool_tokens  = 0;       // 0: full-cache mode (pool = context, identity mapping)
    std::string kv_type  = "f16";
    std::string attention = "auto"; // "auto" | "flash" | "matmul"
    int64_t n_batch      = 512;     // most tokens per compute
    int64_t chunk_tokens = k_chunk_tokens;
    int64_t sink_chunks  = 1;
    int64_t tail_chunks  = 4;
    bool allow_beyond_train_ctx = false;
    // Attend in position order once the mapping leaves identity (f16/f32 KV), so results do not depend
    // on which blocks chunks landed in (slot order changes results only by float summation order, which
    // flips ~2% of SmolLM2's argmaxes). Costs a copy of the pool per layer per step (1.5 of 5.3 ms of
    // an 8B decode step on an H100) and, on the mul_mat path, keeps V in slot rows, which costs a
    // transposed copy per step on top. 1 = on; 0 or -1 (auto) = off: slot order.
    int ordered_attention = -1;
    // Summarise each chunk when it is sealed (mean key, min/max) for the qk and quest scorers.
    bool track_summaries = false;
    // Keep the attention probabilities of the last (up to 8) tokens of every step, max over heads, for
    // attention_capture() (the drafter scorer). Needs the mul_mat attention path: "auto" picks it.
    bool capture_attention = false;
    // Run the model's multi-token-prediction head (model/mtp.h; the model loaded with ModelOptions::mtp): every step
    // also writes the head's K/V, one more pooled layer after the trunk's (paged, truncated and saved with them), and
    // moves its carry on (RecurrentState); mtp_draft drafts with it. Only hybrid families have a head.
    bool mtp = false;
};

// Attention of the last n_q tokens of the latest step to every position held, max over heads and layers.
struct AttentionCapture {
    int64_t n_q = 0, n_positions = 0;
    std::vector<float> data;   // [n_q, n_positions] row-major; 0 where a position is not resident
    std::vector<float> max_over_queries() const;   // [n_positions]
};

// How a layer-major prefill runs (Session::prefill_exact, begin_prefill_exact).
struct ExactPrefillOptions {
    int64_t n_batch = 0;                 // tokens per step (0: the session's)
    // What each block of queries' mask (and, without flash attention, its attention matrix) may hold; a step attends
    // its queries in blocks that fit (0: k_grouped_block_bytes where blocks share calls, else k_attention_block_bytes).
    int64_t attention_block_bytes = 0;
    // With flash attention over F16 K/V (a dense pass), up to this many blocks of queries share one call as its
    // sequences (graph.cpp: attend_block_group), at most a step's worth. 0: as many as make a call of up to
    // k_max_query_block queries; 1: a call per block.
    int64_t blocks_per_call = 0;
    // Most rows of a step its feed-forward takes at once (0: k_exact_ffn_part_rows, the default step's whole, SiLU and
    // the product in place of the gate; k_ffn_part_rows: llama.cpp's ubatch, one F32 intermediate of a part more).
    int64_t ffn_part_rows = 0;
    SparseParams sparse;                 // a sparse prefill's choice of keys (model/sparse_attention.h; top_chunks 0: exact)
    // Keep the linear-attention state (and the MTP carry) as it stands before the prompt's last token as a
    // checkpoint (what checkpoint() there keeps: the next turn or a resend restarts there), while that token still
    // runs inside the pass and attends every position. The layers that carry state take their last token as a step
    // of its own; the others' steps do not change.
    bool checkpoint_before_last = false;
};

// What Session::prefill_exact returns.
struct ExactPrefill {
    std::vector<float> logits;      // [n_vocab] after the last token
    // Per position held: the attention the last (up to k_capture_tokens) prompt tokens pay it, max over
    // those queries, heads and layers: the target model's own exact attention, for post-prompt scoring.
    std::vector<float> attention;
};

// Device memory a session holds besides the weights (bytes). On the CPU backend "device" is host RAM.
// One device of the model's split: what the session holds there (and the model's weights, for the whole picture).
struct DeviceMemory {
    std::string name;                  // ggml's backend name ("CPU", "CUDA0", "RPC0[127.0.0.1:50052]")
    int64_t weight_bytes = 0, pool_bytes = 0, ring_bytes = 0, recurrent_bytes = 0, compute_bytes = 0;
};

struct SessionMemory {
    std::vector<DeviceMemory> devices; // per device (the sums below add them up)
    int64_t pool_bytes = 0;            // the K/V pool (global layers)
    int64_t ring_bytes = 0;            // the sliding-window layers' rings (fixed size, never paged)
    int64_t recurrent_bytes = 0;       // the linear-attention layers' conv and recurrent state (fixed size)
    int64_t recurrent_checkpoint_bytes = 0;   // host copies of that state kept to go back to (checkpoint())
    int64_t compute_bytes = 0;         // the step graphs' compute buffer (as large as the largest step since the
                                       // last layer-major prompt, which gives it back while it runs)
    int64_t prefill_peak_bytes = 0;    // layer-major prefill's transient workspace, largest so far: the
                                       // one-layer staging K/V + its compute buffer (freed after each prompt),
                                       // with the MTP head's buffer that stays beside it
    int64_t prefill_staging_bytes = 0; // ... of which the staging K/V (one layer's of the prompt)
    int64_t prefill_host_bytes = 0;    // ... and its host buffers (hidden states, bounce), largest so far
    int64_t host_store_bytes = 0;      // the host store's capacity (held images and free slots: reserve_host)
    int64_t prefill_rows_bytes = 0;    // the exact prefill's hidden-state rows kept between prompts (reserve_host)
};

// A scheduler's compute buffers on the model's devices (device: that one; -1: all of them).
int64_t sched_device_bytes(const Model & m, ggml_backend_sched_t sched, int device = -1);

struct SessionTimings {
    double t_paging_ms  = 0;   // executing page-outs/page-ins
    double t_compute_ms = 0;   // graph build/alloc + compute + logits read
    double t_scoring_ms = 0;   // summarising sealed chunks (scoring itself is timed by the caller)
    int64_t n_computes  = 0;
    int64_t n_graph_builds = 0;
    // layer-major prefill's share of t_compute_ms: building and allocating its one-layer graphs, and moving
    // hidden states and K/V between host, staging and pool (the rest is the graphs' compute)
    double t_prefill_graph_ms = 0;
    double t_prefill_io_ms    = 0;
    // layer-major prefill: steps (each layer's last aside) whose graph has other nodes than the layer's first step's;
    // ggml's allocator re-reserves for each, which waits for the device (should stay 0)
    int64_t n_prefill_graph_changes = 0;
    // layer-major prefill: blocks of queries attended a pair at a time, so that ggml-cuda reads a quantized pool's
    // keys without an F16 copy of them (a sparse prefill's dense last step; model/graph.cpp: pair_queries)
    int64_t n_prefill_paired_blocks = 0;
    // layer-major prefill: flash attention calls that several blocks of queries shared
    // (ExactPrefillOptions::blocks_per_call)
    int64_t n_prefill_shared_calls = 0;
};

// Held by one thread: the session's mutex and, unless taken for bookkeeping only, its model's.
struct SessionLock {
    std::unique_lock<std::recursive_mutex> session, device;
};

class Session {
public:
    // arena: keep the pool in a lane of it (kv/pool_arena.h), so batched decode steps of the arena's
    // sessions write and attend all their pools at once; nullptr: the pool has memory of its own.
    Session(std::shared_ptr<Model> model, const SessionConfig & cfg, std::shared_ptr<PoolArena> arena = nullptr);
    ~Session();
    Session(const Session &) = delete;
    Session & operator=(const Session &) = delete;

    // Run tokens at positions [start, start+n); start must equal n_tokens(). Returns the logits of the
    // last token ([n_vocab]) or of every token ([n, n_vocab], row-major) when all_logits.
    std::vector<float> forward(const int32_t * tokens, int64_t n, int64_t start, bool all_logits);
    // The same step, returning only the greedy token after the last one: the argmax runs on the backend,
    // so a GPU sends back 4 bytes instead of the logits (0.5 MB for a 128K vocabulary).
    int32_t forward_greedy(const int32_t * tokens, int64_t n, int64_t start);

    void truncate(int64_t n);                        // forget positions >= n (throws unless can_truncate(n))
    // The latest position <= n that truncate reaches exactly (n itself unless rings or a linear-attention
    // state cannot go back that far: then a checkpoint, or 0).
    int64_t rewind_point(int64_t n) const;
    // Keep the linear-attention state at n_tokens() in host memory (RecurrentState::checkpoint), so a later
    // truncate can go back here; a no-op for models without such layers.
    void checkpoint();
    // The same on the device (RecurrentState::stash: one copy, overwritten by the next): speculative decoding
    // stashes before a verify step, to go back when drafts are rejected. A no-op without such layers.
    void stash();
    // The positions unchanged since mark_unchanged(): how many of the first positions held then are still held as
    // they were (every truncate below them, reset() and restore since lowers it; appending and paging do not). The
    // engine keeps a prompt's logits while its positions stay so: a resend is answered without running again.
    void mark_unchanged();
    int64_t n_unchanged() const;
    // Whether truncate(n) is exact: always, unless sliding-window rings no longer hold the window before n,
    // or the model has linear-attention layers, whose state goes back only to 0 (or stays at the end).
    bool can_truncate(int64_t n) const;
    // Append positions [n_tokens(), n) with the K/V that `src` holds for them instead of computing them.
    // src ran the same tokens on the same model, so the bytes are what forward would have written had
    // every earlier position been resident: exact prefill (Engine prefill="exact") computes a long prompt
    // in a transient full-cache session and adopts it. Allocation and paging run as in forward, so the
    // pool ends as a pooled prefill would leave it. n_tokens() must be a chunk boundary (blocks are
    // written whole); src may hold the chunks in its pool or its host store.
    void adopt(const Session & src, int64_t n);
    // Layer-major exact prefill (session_prefill.cpp): append tokens [start, start+n) with the K/V a
    // full-cache run writes, in device memory set by the pool. Every new position is placed first, as a
    // pooled prefill would leave the pager; then, layer by layer, the whole prompt runs through one layer
    // in steps of n_batch, attending a one-layer staging copy of every position's K/V (held chunks come
    // from the pool or the host store), the hidden states waiting in host memory between layers, and the
    // layer's new K/V go to their blocks or host images. start must equal n_tokens(). n_batch: tokens per step (0: the session's; a pooled session's steps are small to keep the
    // pool's window wide, which exactness does not need). between() runs after each layer and after each
    // step that ran to its end (the caller's interrupt point); if anything throws, the session forgets the new positions and holds its first
    // `start` tokens again.
    // The options: ExactPrefillOptions (above the class).
    ExactPrefill prefill_exact(const int32_t * tokens, int64_t n, int64_t start, const ExactPrefillOptions & options = {},
                               const std::function<void()> & between = {});
    // The same prefill as a resumable state, for a caller that interleaves other work between its steps (a server's
    // rounds; prefill_exact is one advanced to its end under the session's lock): begin_prefill_exact checks the
    // arguments and makes the workspace, changing nothing; between: prefill_exact's callback; advance(k) runs up
    // to k more steps (0: all that are left) and says whether all have run; finish() returns the result. While a
    // run is open the session refuses every other call (SessionLock) but timings() and memory(); a run closed or
    // destroyed unfinished, or whose advance threw, leaves the session holding its first `start` tokens. On a GPU
    // an advance may return while its steps still run on the device: the next call on the model queues behind them.
private:
    class ExactPrefillPass;   // one exact prefill: its workspace, stage a layer, run it, write back, roll back
public:
    class ExactPrefillRun {
    public:
        ~ExactPrefillRun();
        ExactPrefillRun(const ExactPrefillRun &) = delete;
        ExactPrefillRun & operator=(const ExactPrefillRun &) = delete;
        bool advance(int64_t max_steps);
        ExactPrefill finish();
        void close();                 // unfinished: roll the session back; then (or finished) release the workspace
        int64_t n_steps() const;      // every layer's steps
        int64_t steps_run() const;
        bool open() const { return pass_ != nullptr; }

    private:
        friend class Session;
        ExactPrefillRun(Session & s, const int32_t * tokens, int64_t n, int64_t start, const ExactPrefillOptions & options,
                        std::function<void()> between);
        Session & s_;
        std::vector<int32_t> tokens_;
        std::function<void()> between_;   // prefill_exact's; none for a caller whose loop is the interrupt point
        std::unique_ptr<ExactPrefillPass> pass_;
        bool done_ = false;
    };
    std::unique_ptr<ExactPrefillRun> begin_prefill_exact(const int32_t * tokens, int64_t n, int64_t start,
                                                         ExactPrefillOptions options = {},
                                                         std::function<void()> between = {});
    void reselect(const std::vector<float> & scores);// resident set := protected + top-scored chunks
    // Pin the chunks of positions [lo, hi) (paged in now if evicted; chunks not yet written are protected
    // once written) until unpin_all(). Throws if the pins would leave no block evictable.
    void pin(int64_t lo, int64_t hi);
    void unpin_all();
    void reset();
    // Make the host store hold the images of a context of n_tokens positions (all its chunks: paged-in ones keep theirs) now, as
    // llama.cpp makes its KV cache when a context is created: a first long prompt then pins nothing (pinning runs
    // at ~8 GiB/s and held the first layer of a 32K exact prefill on an H100 for 0.3 s, R93); and the hidden-state
    // rows of an exact prefill of up to n_tokens (4 bytes x n_embd a token: an eighth of the 8B shape's f16 images),
    // kept for every exact prefill to come. Returns the store's bytes. The store keeps its slabs and the rows stay
    // until the session goes (reset() empties the store but keeps both).
    int64_t reserve_host(int64_t n_tokens);

    // How many of n_remaining tokens the next forward step takes: at most n_batch and what the pager can
    // place at once; when the session captures queries or attention (track_summaries, capture_attention),
    // split so that the last step holds at least min(n_remaining, k_capture_tokens) tokens, since the
    // capture covers the last step only (n_batch=16, 18 tokens: 10 then 8, not 16 then 2). Throws when the
    // pool has no room for another token.
    int64_t step_tokens(int64_t n_remaining) const;

    // ---- the multi-token-prediction head (session_mtp.cpp; cfg.mtp) ----
    // Draft step `step` after the held tokens: the head's logits ([n_vocab]) for the token after `token`, which is
    // at position n_tokens() + step: step 0's token is the one to be fed next (the head pairs it with the carry),
    // step i's the draft chosen from step i-1's logits (paired with that step's output). Steps follow one another
    // with nothing else run on the session between; each writes its K/V into a free slot of the pool (no position
    // is placed: the pager never sees them, and the verify step that follows writes the real ones).
    std::vector<float> mtp_draft(int32_t token, int64_t step);
    // How many draft steps can follow the held tokens now: the pool's free slots (a pool that is full at a chunk
    // boundary has none) and the context left.
    int64_t mtp_room() const;
    // One draft step of this session in a graph built elsewhere (BatchDecoder::mtp_draft: several sessions' steps in
    // one). plan_mtp_draft checks `token` and `step` as mtp_draft does and says where the draft's K/V go and which
    // keys its query sees (changes nothing); start_mtp_draft then begins the step (step 0 starts from the carry) and
    // gives the hidden state it reads and overwrites. The chain waits for finish_mtp_draft (the graph computed) and
    // ends if it never comes. The caller holds the session's lock throughout.
    struct MtpDraftStep {
        int32_t pos = 0;      // the draft's position: n_tokens() + step
        Plan alloc;           // its slot, a free one
        KvKeyOrder order;     // the pool's keys, the free slots of this chain's drafts seen as their positions
    };
    MtpDraftStep plan_mtp_draft(int32_t token, int64_t step) const;
    ggml_tensor * start_mtp_draft(int64_t step);   // F32 [n_embd]
    void finish_mtp_draft(int64_t step, double compute_ms);

    // Post-RoPE queries of the last (up to 8) tokens of the latest step, per layer.
    StepQueries queries() const;
    // Per-chunk relevance for the latest step's queries ("qk" or "quest"); NaN where no summary exists.
    std::vector<float> chunk_scores(const std::string & kind);
    const ChunkSummaries * summaries() const { return summaries_.get(); }
    // The latest step's captured attention (session_capture.cpp); needs cfg.capture_attention.
    AttentionCapture attention_capture() const;

    // This session's mutex, then (device) its model's compute mutex; see "Threads" above. Throws while an
    // ExactPrefillRun is open, unless during_run (a read that the run's steps do not disturb).
    SessionLock lock(bool device = true, bool during_run = false) const;

    // ---- one step of this session in a graph built elsewhere (BatchDecoder: several sessions' steps in one) ----
    // check_step checks tokens [n_tokens(), + n) as forward does (and that the pool and a ring take them at once);
    // place_step, after those checks (check_step's, or forward's and step_tokens'), places them: the pager's plan
    // carried out, the ring's rows and the recurrent state's row. Then exactly one
    // of finish_step (the graph computed: hold the tokens, count the step's share of compute_ms, keep its queries
    // and seal the chunks it completed, as the session's own step does) or unplace_step (not computed: the session
    // holds what it held before). The caller holds the session's lock throughout; place_step changes nothing when it
    // throws.
    // The pool's part of a placed step; the other memories keep theirs (a ring's rows and key order: step_plan(),
    // step_order()) until their next place_step.
    struct PlacedStep {
        int64_t start = 0, n = 0;
        Plan plan;                         // the pool's slots for the step's tokens
        KvKeyOrder order;                  // the pool's keys as the step's attention reads them
        size_t n_memories = 0;             // memories_ placed, in order (unplace_step takes those back)
    };
    void check_step(const int32_t * tokens, int64_t n) const;   // changes nothing
    PlacedStep place_step(int64_t n);
    // queries_kept false: the batched step kept no queries for this session (BatchDecoder's keep_queries), and
    // queries() / chunk_scores() refuse until its next step.
    void finish_step(const PlacedStep & step, const int32_t * tokens, double compute_ms, StepQueries queries,
                     bool queries_kept = true);
    void unplace_step(const PlacedStep & step);
    bool in_exact_run() const { return open_run_ != nullptr; }   // an ExactPrefillRun is open (every step is refused)
    bool tracks_summaries() const { return summaries_ != nullptr; }   // the qk / quest scorers' chunk summaries
    // Unique among the process's sessions, unlike an address that a later session may take: what a batched step's
    // graph is keyed by (a graph built for a session that is gone must not step another).
    uint64_t serial() const { return serial_; }
    // A graph of this session's model beside its own: its node budget, backends (inputs pinned on a GPU) and context.
    size_t graph_size() const;
    ggml_backend_sched_t new_sched(size_t n_nodes = 0) const;   // for graphs of up to n_nodes (0: graph_size())
    ggml_context * new_graph_ctx(size_t n_nodes = 0) const;     // a no_alloc context for one graph

    int64_t n_tokens() const;
    const std::vector<int32_t> & tokens() const { return tokens_; }   // the n_tokens() tokens held
    // The length of the prefix that the held tokens share with a sequence whose positions [start, start + n) are
    // tokens[0, n) and whose first `start` the caller knows to be held (at most n_tokens()): compared from start
    // on, without a copy of what the session holds.
    int64_t shared_prefix(const int32_t * tokens, int64_t n, int64_t start) const;
    bool full_cache() const { return full_cache_; }
    bool flash_attn() const { return flash_attn_; }
    bool ordered_attention() const { return ordered_; }
    const SessionConfig & config() const { return cfg_; }
    const Model & model() const { return *model_; }
    KvPager & pager() { return *pager_; }
    const KvPager & pager() const { return *pager_; }
    PooledKV & kv() { return *kv_; }
    const PooledKV & kv() const { return *kv_; }
    const SlidingWindowKV * ring() const { return ring_.get(); }   // null: the model has no sliding-window layers
    const RecurrentState * recurrent() const { return recurrent_.get(); }   // null: no linear-attention layers
    bool mtp() const { return cfg_.mtp; }
    SessionTimings timings() const;   // a copy: the live counters change under the lock
    // After a sparse prefill, per pooled layer: the share of the prompt's last tokens' exact attention (mean over
    // those queries and heads) that the keys their block chose held (1: the block saw every key). Of the last
    // layer-major prefill: empty if it was exact.
    std::vector<float> prefill_coverage() const;
    SessionMemory memory() const;

    // ---- state (session_state.cpp): the config and a token count; snapshot/ composes the rest ----
    static constexpr uint32_t k_state_version = 2;   // 2: the mtp flag
    void save_state(ByteWriter & w, int64_t n_tokens) const;
    static SessionConfig config_from(ByteReader & r, uint32_t version, int64_t & n_tokens);
    // Commit a validated snapshot: `pager` from pager().state_from, one image per chunk of it (from
    // kv().state_from), its n_tokens() tokens, and the saved summaries (from summaries()->state_from;
    // null: none saved, so a session that tracks them starts over). Only allocation failures can throw.
    void restore_state(KvPager && pager, const std::vector<const uint8_t *> & images, std::vector<int32_t> tokens,
                       std::unique_ptr<ChunkSummaries> summaries, const SlidingWindowKV::Saved * ring,
                       const RecurrentState::Copy * recurrent);

private:
    void execute(const Plan & plan);   // PooledKV carries the plan out, then the pager applies it
    // Gives the step graphs' compute buffer back to the device (the next step allocates it again): a layer-major
    // prompt runs graphs of its own, so its workspace never sits beside that buffer.
    void release_step_buffer();
    void check_tokens(const int32_t * tokens, int64_t n, int64_t start) const;   // forward's argument checks
    // ---- layer-major prefill (session_prefill.cpp) ----
    const ExactPrefillRun * open_run_ = nullptr;   // set while a run is open: every other call is refused
    mutable bool in_run_ = false;                   // the open run's own calls (under the mutex)
    void place_prompt(const int32_t * tokens, int64_t n, int64_t start);
    void seal_chunks(int64_t start, int64_t n);   // summarise chunks completed by positions [start, start+n)
    // Place, compute, read back and finish steps of at most n_batch tokens; either output may be null. A step whose
    // compute throws is unplaced: the session holds the tokens of the steps before it.
    void run(const int32_t * tokens, int64_t n, int64_t start, bool all_logits, float * logits, int32_t * greedy);
    void compute(const int32_t * tokens, const PlacedStep & step, bool all_logits, float * logits_out,
                 int32_t * greedy_out);
    void build_graph(int64_t n_tokens, int64_t n_kv, int64_t n_outputs, bool gathered, int64_t n_ring_kv);
    // (a ring's rows and key order: those of its step placed last)
    void set_inputs(const int32_t * tokens, int64_t n, const Plan & alloc, int64_t n_outputs, const KvKeyOrder & order);
    void keep_capture_order(const KvKeyOrder & order);   // session_capture.cpp
    // ---- outputs (session_outputs.cpp) ----
    // ---- multi-token prediction (session_mtp.cpp) ----
    struct MtpDrafts;                  // the draft graph, its scheduler and the draft's hidden state
    static void check_mtp(const Model & model);   // the model can run the head (throws std::invalid_argument)
    std::unique_ptr<MtpDrafts, void (*)(MtpDrafts *)> new_mtp_drafts() const;
    void build_mtp_graph(int64_t n_kv);
    int64_t mtp_compute_bytes() const;   // the draft graph's compute buffer and hidden state
    void read_logits(float * out);     // the logits_ rows, through pinned staging on a GPU
    void build_greedy(GraphCtx & g);   // the argmax of the logits, in two parallel stages
    int32_t read_greedy();

    std::shared_ptr<Model> model_;
    SessionConfig cfg_;
    const uint64_t serial_;
    bool full_cache_ = false;
    bool flash_attn_ = false;
    bool ordered_ = false;  // cfg_.ordered_attention resolved
    int64_t kv_pad_ = 256;  // n_kv is a multiple of this (or the whole pool)
    std::unique_ptr<KvPager> pager_;
    std::unique_ptr<PooledKV> kv_;
    std::unique_ptr<SlidingWindowKV> ring_;       // null unless the model has sliding-window layers
    std::unique_ptr<RecurrentState> recurrent_;   // null unless the model has linear-attention layers
    std::vector<ContextMemory *> memories_;       // ring_ and recurrent_ where present: going back, clearing, rolling back
    std::unique_ptr<ChunkSummaries> summaries_;   // null unless cfg.track_summaries
    std::unique_ptr<MtpDrafts, void (*)(MtpDrafts *)> mtp_{nullptr, nullptr};   // null unless cfg.mtp
    ggml_backend_sched_t sched_ = nullptr;

    // The current graph and its shape; rebuilt only when the shape changes.
    ggml_context * graph_ctx_ = nullptr;
    GraphCtx graph_;
    ggml_tensor * logits_ = nullptr;   // F32 [n_vocab, n_outputs]
    struct GreedyOutputs {                 // graphs with one output row only
        // F32 [2 R]: the maximum of each of R rows of row_len logits, then the argmax within each row (as a
        // float: exact, row_len < 2^24). One tensor, so that one read brings both (one round trip over ggml-rpc).
        ggml_tensor * rows = nullptr;
        int64_t row_len = 0;
    } greedy_;
    std::vector<float> greedy_scratch_;
    int64_t shape_[5] = {-1, -1, -1, -1, -1};   // n_tokens, n_kv, n_outputs, gathered, ring n_kv

    std::vector<int64_t> attn_key_pos_;   // capture_attention: position of attended key j in the last step
    int64_t attn_n_tokens_ = -1;          // ... and n_tokens() after it (-1: nothing captured)
    std::vector<int32_t> tokens_;      // tokens_[p] is the token at position p, p < n_tokens()
    int64_t n_unchanged_ = 0;          // n_unchanged(): <= n_tokens()
    // The latest step's queries when that step ran outside graph_: a layer-major prefill's last prompt tokens, or
    // this session's token of a batched step (BatchDecoder). Empty: queries() reads graph_'s.
    StepQueries held_queries_;
    bool queries_dropped_ = false;   // the latest step was batched and kept none (queries() refuses)
    int64_t prefill_peak_bytes_ = 0;   // its largest device workspace (SessionMemory::prefill_peak_bytes)
    int64_t prefill_staging_bytes_ = 0;   // ... of which staging
    int64_t prefill_host_bytes_ = 0;   // ... and host buffers
    std::shared_ptr<HostMemory> prefill_rows_;   // hidden-state rows kept for the exact prefills to come (reserve_host)
    std::vector<float> prefill_coverage_;   // the last layer-major prefill's, when sparse (prefill_coverage)
    std::vector<uint8_t> input_scratch_, ring_scratch_;
    ggml_backend_buffer_t logits_host_ = nullptr;   // GPU only: pinned staging for the logits read
    SessionTimings timings_;
    mutable std::recursive_mutex mutex_;
};

}  // namespace kvf
