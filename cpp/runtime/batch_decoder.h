// BatchDecoder: one decode step of several sessions of one Model as one graph. Every layer's weights are
// read once for all the sessions' tokens (what makes a server's aggregate decode grow with its streams);
// attention runs per session over that session's own pool, under its own slot rows and mask
// (GraphCtx::lanes). Each session's pager places its token and pages as its forward would, so a session
// ends a batched step exactly where forward_greedy / forward would have left it.
//
// Which sessions can share a step (eligible()): same Model, same attention path, and no attention capture
// (capture_attention: the drafter's companion session, whose probabilities its scorer reads). Others decode alone.
// Sessions that run the multi-token-prediction head (model/mtp.h) share steps with each other: each writes the
// head's K/V into its own pool and moves its own carry on, as its own step does (GraphCtx::mtp_lanes), and their
// draft steps share graphs of their own (mtp_draft: the head's one layer for every session).
// A session that tracks chunk summaries (the qk / quest scorers) batches: the step
// keeps every session's query per pooled layer, and each such session ends holding its own (Session::queries)
// and the summary of a chunk its token completed, as after its own step. Sliding-window layers attend each session's own
// ring (one attention call per session and layer: rings are small and are not in an arena). A hybrid's
// linear-attention layers project every session's token at once; sessions whose states are lanes of one arena
// (kv/pool_arena.h) then run one conv and one delta rule per run of lanes (GraphCtx::recurrent_arena), others each
// session's tokens over its own RecurrentState (GraphCtx::lane_recurrent: also a verify step's several tokens).
// Either computes each session's tokens as its own step does.
//
// On an error no session changes: every check, placement and the graph's allocation come before the compute, and
// the sessions are put back to the tokens they held. One limit: a linear-attention state is written in place, so a
// compute that fails midway (a lost device; ggml's CPU backend fails only before it starts) may have moved it on.
// Going back would need a copy of every state each step, and on a lost device the state is gone with it anyway.
//
// Threads: a step holds every session's mutex (taken in address order, so two steps over overlapping
// sessions cannot deadlock) and then the model's compute mutex, as Session's own calls do.
#pragma once

#include "runtime/session.h"

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace kvf {

class BatchDecoder {
public:
    static constexpr int64_t max_session_rows = 32;   // a session's tokens in one step (Session's one-token bound)
    static constexpr int64_t max_step_rows = 128;     // every session's tokens in one step (the node budget's)

    explicit BatchDecoder(std::shared_ptr<Model> model);
    ~BatchDecoder();
    BatchDecoder(const BatchDecoder &) = delete;
    BatchDecoder & operator=(const BatchDecoder &) = delete;

    // Why `s` cannot share this decoder's steps ("" when it can).
    std::string ineligible(const Session & s) const;
    // Feed tokens[i] to sessions[i] at its n_tokens(). greedy: each session's argmax after its token, else
    // logits [n, n_vocab] row-major (the other output is left empty). On an error no session changes.
    // keep_queries (nullptr: every session's): which sessions that score chunks keep the step's queries (read back
    // from the device each step: ~4 MB for 8 sessions of the 8B shape, a third of a step). A scheduler keeps those
    // whose reselect falls due after this step; the others' queries() refuse until their next step.
    void step(const std::vector<Session *> & sessions, const std::vector<int32_t> & tokens,
              std::vector<int32_t> * greedy, std::vector<float> * logits,
              const std::vector<uint8_t> * keep_queries = nullptr);
    // A step in which a session may take several tokens (a speculative verify step: the pending token and its
    // drafts): feed rows[i] to sessions[i] at its n_tokens(); `logits` gets every row's, [sum of the rows' sizes,
    // n_vocab], session after session in the caller's order. On the CPU every row is computed with the kernels of
    // a one-token step (GraphCtx::one_token_kernels), as a session's own verify step is, so its rows and K/V are
    // the ones that step writes. A session with a linear-attention state steps its state through every row, as
    // its own verify step does: a caller that may reject drafts stashes it first (Session::stash) and goes back
    // there (truncate), as speculative decoding does alone. On an error no session changes.
    void step_rows(const std::vector<Session *> & sessions, const std::vector<std::vector<int32_t>> & rows,
                   std::vector<float> * logits, const std::vector<uint8_t> * keep_queries = nullptr);
    // Draft step `step` of the multi-token-prediction head for every session (each made with mtp=True), as
    // Session::mtp_draft(tokens[i], step) of each: logits [n, n_vocab] row-major in the caller's order. Each session
    // attends its own pool. On an error no session holds other tokens; a step that fails past the checks ends the
    // sessions' draft chains (their next draft is a step 0).
    void mtp_draft(const std::vector<Session *> & sessions, const std::vector<int32_t> & tokens, int64_t step,
                   std::vector<float> & logits);
    // the step graphs' compute buffers (decode and verify steps, draft steps): on all devices, or on one of the model's
    int64_t compute_bytes(int device = -1) const;
    int n_devices() const { return model_->n_devices(); }
    // The last step graph's nodes, and its splits in ggml's scheduler (a run of nodes on one backend each).
    int64_t graph_nodes() const { return graph_.gf ? ggml_graph_n_nodes(graph_.gf) : 0; }
    int64_t graph_splits() const { return sched_ ? ggml_backend_sched_get_n_splits(sched_) : 0; }
    // Attention calls per layer in the last step's graph: its runs of consecutive arena lanes, or one per session
    // when the sessions do not share an arena.
    int64_t attention_calls() const { return graph_.arena.arena ? (int64_t) graph_.arena.runs.size() : (int64_t) graph_.lanes.size(); }
    // Conv + delta-rule calls per linear-attention layer in the last step's graph: one per run of consecutive arena
    // lanes, one per session otherwise, none without such layers.
    int64_t delta_rule_calls() const {
        return graph_.recurrent_arena.arena ? (int64_t) graph_.recurrent_arena.runs.size() : (int64_t) graph_.lane_recurrent.size();
    }

private:
    // Graph nodes of a batched step: a session's graph, plus per session and layer its own attention (token
    // views, K/V writes, pool views, permutes, attention, concat), and on the CPU per row of a verify step its
    // one-token attention.
    static size_t node_budget(const Session & s);
    // The arena every session's pool is a lane of, when the step can attend them all at once; else nullptr
    // (each session then attends its own pool: GraphCtx::lanes).
    static const PoolArena * shared_arena(const std::vector<Session *> & sessions,
                                          const std::vector<std::vector<int32_t>> & rows,
                                          const std::vector<Session::PlacedStep> & placed);
    // The arena every session's linear-attention state is a lane of (one conv and delta rule per run of lanes);
    // else nullptr (each session's tokens run over its own: GraphCtx::lane_recurrent).
    static const PoolArena * shared_recurrent_arena(const std::vector<Session *> & sessions);
    // Why session i (n_rows tokens) cannot take part in this step beside `first`: std::invalid_argument.
    void check_joins(const Session & s, const Session & first, int64_t i, int64_t n_rows) const;
    // step() and step_rows(): the checks, the sessions' locks, the lane order and the outputs back in the
    // caller's order.
    void run(const std::vector<Session *> & sessions, const std::vector<std::vector<int32_t>> & rows,
             std::vector<int32_t> * greedy, std::vector<float> * logits, const std::vector<uint8_t> * keep_queries);
    // run() with the sessions sorted by lane: places, computes, reads the outputs in this order; returns each
    // session's placed step and the queries of the sessions that score chunks (empty for the others).
    struct StepResult {
        std::vector<Session::PlacedStep> placed;
        std::vector<StepQueries> queries;
    };
    StepResult step_in_order(const std::vector<Session *> & sessions, const std::vector<std::vector<int32_t>> & rows,
                             std::vector<int32_t> * greedy, std::vector<float> * logits,
                             const std::vector<uint8_t> & keep);
    // The computed step's queries: per session that tracks summaries and keeps them (keep[i]), its last rows' (up
    // to k_capture_tokens), as its own step keeps them; read for the layers' rows those sessions need only.
    std::vector<StepQueries> split_queries(const std::vector<Session *> & sessions,
                                           const std::vector<std::vector<int32_t>> & rows,
                                           const std::vector<uint8_t> & keep) const;
    void build_graph(const std::vector<Session *> & sessions, const std::vector<std::vector<int32_t>> & rows,
                     const std::vector<Session::PlacedStep> & placed, bool greedy);

    // The held sessions' locks, in address order, then the model's compute mutex; refuses an empty step, one of more
    // than k_max_lanes sessions and a session twice.
    static std::vector<std::unique_lock<std::recursive_mutex>> lock_all(const std::vector<Session *> & sessions,
                                                                         const Model & model);
    // The draft steps' graph (mtp_draft), beside the decode and verify steps' so that neither rebuilds the other.
    struct DraftGraph {
        ggml_backend_sched_t sched = nullptr;
        ggml_context * ctx = nullptr;
        GraphCtx g;
        ggml_tensor * logits = nullptr;   // F32 [n_vocab, n]
        std::vector<int64_t> shape;       // per session: serial, n_kv
        ~DraftGraph();
    };
    // hs: each session's hidden state (Session::start_mtp_draft)
    void build_draft_graph(const std::vector<Session *> & sessions, const std::vector<Session::MtpDraftStep> & steps,
                           const std::vector<ggml_tensor *> & hs);

    std::shared_ptr<Model> model_;
    DraftGraph draft_;
    ggml_backend_sched_t sched_ = nullptr;
    ggml_context * graph_ctx_ = nullptr;
    GraphCtx graph_;
    ggml_tensor * logits_ = nullptr;   // F32 [n_vocab, rows]
    ggml_tensor * argmax_ = nullptr;   // I32 [rows]: greedy steps only (one row a session)
    std::vector<int64_t> shape_;       // what the graph was built for (rebuilt on change)
    std::vector<uint8_t> scratch_;
};

}  // namespace kvf
