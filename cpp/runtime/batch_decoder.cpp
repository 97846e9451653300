#include "runtime/batch_decoder.h"
#include "model/mtp.h"
#include "model/rpc.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <stdexcept>

namespace kvf {

namespace {

constexpr int64_t k_max_lanes = 64;   // sessions in one step: the graph's node budget is sized for this many

int64_t total_rows(const std::vector<std::vector<int32_t>> & rows) {
    int64_t n = 0;
    for (const auto & r : rows) n += (int64_t) r.size();
    return n;
}

// An arena step attends the same number of slots in every lane: the largest any session needs (past a session's
// own, its slots are empty and masked).
int64_t widest(const std::vector<Session::PlacedStep> & placed) {
    int64_t n_kv = 0;
    for (const Session::PlacedStep & p : placed) n_kv = std::max(n_kv, p.order.n_kv);
    return n_kv;
}

// Runs of one session per lane whose lanes follow one another (the sessions come sorted by lane): session
// i's token is run r's token i - r.token.
template <typename LaneOf>
std::vector<GraphCtx::LaneRun> lane_runs(const std::vector<Session *> & sessions, LaneOf lane_of) {
    std::vector<GraphCtx::LaneRun> runs;
    for (int64_t i = 0; i < (int64_t) sessions.size(); ++i) {
        const int64_t lane = lane_of(*sessions[i]);
        if (!runs.empty() && runs.back().lane + runs.back().n == lane) {
            runs.back().n++;
        } else {
            runs.push_back({i, lane, 1});
        }
    }
    return runs;
}

}  // namespace

size_t BatchDecoder::node_budget(const Session & s) {
    // A lane's own nodes in a layer: about 24 for its attention (full-attention layers) or for its conv and delta
    // rule (linear-attention layers, qwen35.cpp: delta_rule); 32 leaves room.
    const int64_t per_layer = k_max_lanes * 32 + (s.model().on_gpu() ? 0 : max_step_rows * 8);
    return s.graph_size() + (size_t) (per_layer * s.model().hparams().n_layer);
}

BatchDecoder::BatchDecoder(std::shared_ptr<Model> model) : model_(std::move(model)) {
    if (!model_) throw std::invalid_argument("BatchDecoder needs a model");
}

BatchDecoder::~BatchDecoder() {
    if (sched_) ggml_backend_sched_free(sched_);
    if (graph_ctx_) ggml_free(graph_ctx_);
}

std::string BatchDecoder::ineligible(const Session & s) const {
    if (&s.model() != model_.get()) return "it runs another Model object";
    if (s.config().capture_attention) return "it captures attention (the drafter scorer reads one session's step)";
    return "";
}

const PoolArena * BatchDecoder::shared_arena(const std::vector<Session *> & sessions,
                                             const std::vector<std::vector<int32_t>> & rows,
                                             const std::vector<Session::PlacedStep> & placed) {
    const PoolArena * arena = sessions.front()->kv().arena();
    if (!arena) return nullptr;
    // One query a lane along ne3: a session with several rows attends its own pool (GraphCtx::lanes).
    if (total_rows(rows) != (int64_t) rows.size()) return nullptr;
    // The mul_mat path reads V transposed in place; from slot rows it would need a transposed copy per lane.
    if (!sessions.front()->flash_attn() && !arena->layout().v_trans) return nullptr;
    for (size_t i = 0; i < sessions.size(); ++i) {
        if (sessions[i]->kv().arena() != arena || placed[i].order.gathered) return nullptr;
    }
    return arena;
}

const PoolArena * BatchDecoder::shared_recurrent_arena(const std::vector<Session *> & sessions) {
    const RecurrentState * first = sessions.front()->recurrent();
    const PoolArena * arena = first ? first->arena() : nullptr;
    for (const Session * s : sessions) {
        if (!arena || s->recurrent()->arena() != arena) return nullptr;
    }
    return arena;
}

int64_t BatchDecoder::compute_bytes(int device) const {
    int64_t bytes = 0;
    for (ggml_backend_sched_t sched : {sched_, draft_.sched}) bytes += sched ? sched_device_bytes(*model_, sched, device) : 0;
    return bytes;
}

BatchDecoder::DraftGraph::~DraftGraph() {
    if (sched) ggml_backend_sched_free(sched);
    if (ctx) ggml_free(ctx);
}

void BatchDecoder::build_graph(const std::vector<Session *> & sessions, const std::vector<std::vector<int32_t>> & rows,
                               const std::vector<Session::PlacedStep> & placed,
                               bool greedy) {
    const Session & first = *sessions.front();
    const size_t n_nodes = node_budget(first);
    if (!sched_) sched_ = first.new_sched(n_nodes);
    if (graph_ctx_) ggml_free(graph_ctx_);
    graph_ctx_ = first.new_graph_ctx(n_nodes);
    graph_ = GraphCtx{};
    GraphCtx & g = graph_;
    const int64_t n = (int64_t) sessions.size(), n_rows = total_rows(rows);
    g.ctx = graph_ctx_;
    g.gf = ggml_new_graph_custom(graph_ctx_, n_nodes, false);
    g.n_tokens = g.n_outputs = n_rows;
    g.flash_attn = first.flash_attn();
    // A verify step's rows as a session's own verify step computes them (Session::build_graph: one-token kernels
    // on the CPU for a step that reads every row); a decode step of one token a session keeps ggml's own kernels.
    g.one_token_kernels = !model_->on_gpu() && n_rows > n;
    // every session's queries, when one of them scores chunks (qk / quest): split per session after the compute
    const bool scored = std::any_of(sessions.begin(), sessions.end(), [](const Session * s) { return s->tracks_summaries(); });
    g.n_query_tokens = scored ? n_rows : 0;
    g.in.tokens = ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, n_rows);
    g.in.positions = ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, n_rows);
    ggml_set_input(g.in.tokens);
    ggml_set_input(g.in.positions);
    // Each session's linear-attention state (and MTP carry) with its rows of the step.
    std::vector<GraphCtx::LaneState> states;
    for (int64_t i = 0, t0 = 0; i < n && first.recurrent(); t0 += (int64_t) rows[i].size(), ++i) {
        states.push_back({sessions[i]->recurrent(), t0, (int64_t) rows[i].size()});
    }
    // An arena's run of lanes steps one token a lane; a session with several rows (a verify step) steps its own state.
    const PoolArena * recurrent_arena = n_rows == n ? shared_recurrent_arena(sessions) : nullptr;
    if (recurrent_arena) {
        g.recurrent_arena = {recurrent_arena, lane_runs(sessions, [](const Session & s) { return s.recurrent()->lane(); })};
    } else {
        g.lane_recurrent = states;
    }
    for (int64_t i = 0, t0 = 0; i < n && first.ring(); t0 += (int64_t) rows[i].size(), ++i) {
        const PooledKV & ring = sessions[i]->ring()->kv();
        const int64_t ni = (int64_t) rows[i].size();
        const int64_t n_kv = sessions[i]->ring()->step_order().n_kv;
        g.lane_rings.push_back({&ring, kv_step_inputs_new(g.ctx, ring.layout(), ni, n_kv, false), n_kv, t0, ni});
    }
    if (const PoolArena * arena = shared_arena(sessions, rows, placed)) {
        GraphCtx::ArenaBatch & b = g.arena;
        b.arena = arena;
        b.n_kv = widest(placed);
        b.in = kv_step_inputs_new(g.ctx, arena->layout(), n, b.n_kv, false);
        b.runs = lane_runs(sessions, [](const Session & s) { return s.kv().lane(); });
        const size_t row = b.in.mask->nb[1];
        for (const GraphCtx::LaneRun & r : b.runs) {
            b.run_masks.push_back(ggml_view_4d(g.ctx, b.in.mask, b.n_kv, 1, 1, r.n, row, row, row, r.token * row));
        }
    } else {
        for (int64_t i = 0, t0 = 0; i < n; t0 += (int64_t) rows[i].size(), ++i) {
            const PooledKV & kv = sessions[i]->kv();
            const int64_t ni = (int64_t) rows[i].size();
            const KvKeyOrder & order = placed[i].order;
            g.lanes.push_back({&kv, kv_step_inputs_new(g.ctx, kv.layout(), ni, order.n_kv, order.gathered), order.n_kv, t0, ni});
        }
    }
    const bool mtp = first.mtp();
    if (mtp) {   // each session's head: its K/V into its pool's last layer, its carry moved on (model/mtp.h)
        g.all_rows = true;
        g.mtp_kv_layer = first.kv().layout().n_layer - 1;
        g.mtp_lanes = std::move(states);
    }
    const Model & m = *model_;
    ggml_tensor * h = build_stack(g, m);
    if (mtp) h = build_mtp_follow(g, m, h);
    logits_ = build_logits(g, m, h);   // [n_vocab, n_rows]
    argmax_ = nullptr;
    if (greedy) {
        argmax_ = ggml_argmax(g.ctx, logits_);   // I32 [n]: one row per session
        ggml_set_output(argmax_);
        ggml_build_forward_expand(g.gf, argmax_);
    }
    ggml_backend_sched_reset(sched_);
    pin_layer_boundaries(sched_, g, m);
    if (!ggml_backend_sched_alloc_graph(sched_, g.gf)) {
        shape_.clear();
        check_rpc_connections(sched_);   // a lost RPC device allocates nothing
        throw std::runtime_error("could not allocate the batched decode graph (out of memory?)");
    }
}

void BatchDecoder::step(const std::vector<Session *> & sessions, const std::vector<int32_t> & tokens,
                        std::vector<int32_t> * greedy, std::vector<float> * logits,
                        const std::vector<uint8_t> * keep_queries) {
    if (tokens.size() != sessions.size()) {
        throw std::invalid_argument("a batched step needs one token per session (" + std::to_string(tokens.size()) +
                                    " tokens for " + std::to_string(sessions.size()) + " sessions)");
    }
    std::vector<std::vector<int32_t>> rows;
    for (int32_t t : tokens) rows.push_back({t});
    run(sessions, rows, greedy, logits, keep_queries);
}

void BatchDecoder::step_rows(const std::vector<Session *> & sessions, const std::vector<std::vector<int32_t>> & rows,
                             std::vector<float> * logits, const std::vector<uint8_t> * keep_queries) {
    if (rows.size() != sessions.size()) {
        throw std::invalid_argument("a batched step needs the tokens of every session (" + std::to_string(rows.size()) +
                                    " lists for " + std::to_string(sessions.size()) + " sessions)");
    }
    run(sessions, rows, nullptr, logits, keep_queries);
}

void BatchDecoder::run(const std::vector<Session *> & sessions, const std::vector<std::vector<int32_t>> & rows,
                       std::vector<int32_t> * greedy, std::vector<float> * logits,
                       const std::vector<uint8_t> * keep_queries) {
    const int64_t n = (int64_t) sessions.size();
    if (keep_queries && keep_queries->size() != sessions.size()) {
        throw std::invalid_argument("keep_queries needs one flag per session (" + std::to_string(keep_queries->size()) +
                                    " for " + std::to_string(n) + " sessions)");
    }
    const auto held = lock_all(sessions, *model_);
    for (int64_t i = 0; i < n; ++i) check_joins(*sessions[i], *sessions.front(), i, (int64_t) rows[i].size());
    if (total_rows(rows) > max_step_rows) {
        throw std::invalid_argument("a batched step takes at most " + std::to_string(max_step_rows) + " tokens, got " +
                                    std::to_string(total_rows(rows)));
    }
    for (int64_t i = 0; i < n; ++i) {
        const Session & s = *sessions[i];
        const int64_t ni = (int64_t) rows[i].size();
        try {   // before any session is placed, so that a bad step moves no chunk
            s.check_step(rows[i].data(), ni);
        } catch (const std::invalid_argument & e) {
            throw std::invalid_argument("session " + std::to_string(i) + ": " + e.what());
        }
    }

    const auto t0 = std::chrono::steady_clock::now();
    // The graph takes the sessions in lane order (runs of consecutive lanes share one attention call);
    // results go back in the caller's order.
    std::vector<int64_t> order(n);
    for (int64_t i = 0; i < n; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        return sessions[a]->kv().lane() < sessions[b]->kv().lane();
    });
    std::vector<Session *> in_order(n);
    std::vector<std::vector<int32_t>> rows_in_order(n);
    std::vector<uint8_t> keep_in_order(n, 1);
    for (int64_t i = 0; i < n; ++i) {
        in_order[i] = sessions[order[i]];
        rows_in_order[i] = rows[order[i]];
        if (keep_queries) keep_in_order[i] = (*keep_queries)[order[i]];
    }
    auto [placed, queries] = step_in_order(in_order, rows_in_order, greedy, logits, keep_in_order);
    // back to the caller's order (a server's slots come in lane order: nothing to move)
    if (!std::is_sorted(order.begin(), order.end())) {
        if (greedy) {
            std::vector<int32_t> g(*greedy);
            for (int64_t i = 0; i < n; ++i) (*greedy)[order[i]] = g[i];
        }
        if (logits) {
            const size_t n_vocab = logits->size() / (size_t) total_rows(rows);
            std::vector<size_t> first(n + 1, 0);   // the caller's row of session i's first row
            for (int64_t i = 0; i < n; ++i) first[i + 1] = first[i] + rows[i].size();
            std::vector<float> l(*logits);
            for (int64_t i = 0, from = 0; i < n; from += (int64_t) rows_in_order[i].size(), ++i) {
                std::copy_n(l.begin() + from * n_vocab, rows_in_order[i].size() * n_vocab,
                            logits->begin() + first[order[i]] * n_vocab);
            }
        }
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    for (int64_t i = 0; i < n; ++i) {   // each session's share of the step's time
        in_order[i]->finish_step(placed[i], rows_in_order[i].data(), ms / (double) n, std::move(queries[i]),
                                 keep_in_order[i] != 0);
    }
}

std::vector<std::unique_lock<std::recursive_mutex>> BatchDecoder::lock_all(const std::vector<Session *> & sessions,
                                                                             const Model & model) {
    if (sessions.empty()) throw std::invalid_argument("a batched step needs at least one session");
    if ((int64_t) sessions.size() > k_max_lanes) {
        throw std::invalid_argument("a batched step takes at most " + std::to_string(k_max_lanes) + " sessions, got " +
                                    std::to_string(sessions.size()));
    }
    std::vector<Session *> by_address(sessions);
    std::sort(by_address.begin(), by_address.end());
    if (std::adjacent_find(by_address.begin(), by_address.end()) != by_address.end()) {
        throw std::invalid_argument("a session appears twice in one batched step");
    }
    std::vector<std::unique_lock<std::recursive_mutex>> held;
    for (Session * s : by_address) {
        if (!s) throw std::invalid_argument("a batched step got no session");
        held.push_back(std::move(s->lock(false, true).session));   // an open exact prefill: check_joins says so
    }
    held.emplace_back(model.compute_mutex());
    return held;
}

void BatchDecoder::check_joins(const Session & s, const Session & first, int64_t i, int64_t n_rows) const {
    const std::string who = "session " + std::to_string(i);
    const std::string why = ineligible(s);
    if (!why.empty()) throw std::invalid_argument(who + " cannot join a batched step: " + why);
    if (s.in_exact_run()) {   // its positions are placed already and its state is the run's (Session::lock refuses it too)
        throw std::invalid_argument(who + " is in the middle of an exact prefill (an open ExactPrefillRun): finish or "
                                    "close it first");
    }
    if (s.flash_attn() != first.flash_attn()) throw std::invalid_argument(who + " takes another attention path than session 0");
    if (s.mtp() != first.mtp()) {
        throw std::invalid_argument(who + (s.mtp() ? " runs" : " does not run") + " the multi-token-prediction head, "
                                    "session 0 " + (first.mtp() ? "does" : "does not") + " (a step runs it for all or none)");
    }
    if (n_rows < 1 || n_rows > max_session_rows) {
        throw std::invalid_argument(who + " got " + std::to_string(n_rows) + " tokens: a batched step takes 1 to " +
                                    std::to_string(max_session_rows) + " a session");
    }
}

std::vector<StepQueries> BatchDecoder::split_queries(const std::vector<Session *> & sessions,
                                                     const std::vector<std::vector<int32_t>> & rows,
                                                     const std::vector<uint8_t> & keep) const {
    std::vector<StepQueries> out(sessions.size());
    if (graph_.queries.empty()) return out;
    auto kept = [&](size_t i) { return sessions[i]->tracks_summaries() && keep[i]; };
    // The rows [lo, hi) of the step that the keeping sessions' queries lie in: one read per layer, of those only.
    int64_t lo = INT64_MAX, hi = 0;
    for (size_t i = 0, first = 0; i < sessions.size(); first += rows[i].size(), ++i) {
        if (!kept(i)) continue;
        lo = std::min<int64_t>(lo, (int64_t) first);
        hi = (int64_t) (first + rows[i].size());
    }
    if (hi == 0) return out;
    const ggml_tensor * t0 = graph_.queries[0];   // per pooled layer: [head_dim, n_head, every row of the step]
    const int64_t n_layer = (int64_t) graph_.queries.size(), row = t0->ne[0] * t0->ne[1], per_layer = ggml_nelements(t0);
    std::vector<float> all((size_t) (n_layer * per_layer));
    for (int64_t il = 0; il < n_layer; ++il) {
        ggml_backend_tensor_get(graph_.queries[il], all.data() + il * per_layer + lo * row, (size_t) (lo * t0->nb[2]),
                                (size_t) ((hi - lo) * t0->nb[2]));
    }
    for (size_t i = 0, first = 0; i < sessions.size(); first += rows[i].size(), ++i) {
        if (!kept(i)) continue;
        const int64_t n_keep = std::min<int64_t>((int64_t) rows[i].size(), k_capture_tokens);   // the last rows
        const int64_t from = (int64_t) (first + rows[i].size()) - n_keep;
        StepQueries & q = out[i];
        q.n_layer = n_layer;
        q.n_tokens = n_keep;
        q.n_head = t0->ne[1];
        q.head_dim = t0->ne[0];
        q.data.resize((size_t) (n_layer * n_keep * row));
        for (int64_t il = 0; il < n_layer; ++il) {
            std::copy_n(all.begin() + il * per_layer + from * row, n_keep * row, q.data.begin() + il * n_keep * row);
        }
    }
    return out;
}

BatchDecoder::StepResult BatchDecoder::step_in_order(const std::vector<Session *> & sessions,
                                                     const std::vector<std::vector<int32_t>> & rows,
                                                     std::vector<int32_t> * greedy, std::vector<float> * logits,
                                                     const std::vector<uint8_t> & keep) {
    const int64_t n = (int64_t) sessions.size();
    std::vector<Session::PlacedStep> placed;
    std::vector<int32_t> pos;   // every row's position
    try {
        for (int64_t i = 0; i < n; ++i) {
            placed.push_back(sessions[i]->place_step((int64_t) rows[i].size()));
            for (int64_t j = 0; j < placed[i].n; ++j) pos.push_back((int32_t) (placed[i].start + j));
        }
        // The graph's shape: an arena step's attends the lanes' largest n_kv, the other's each session's own.
        std::vector<int64_t> shape = {greedy != nullptr, shared_arena(sessions, rows, placed) != nullptr};
        for (int64_t i = 0; i < n; ++i) {
            shape.insert(shape.end(), {(int64_t) sessions[i]->serial(), placed[i].order.gathered, (int64_t) rows[i].size()});
        }
        if (shape[1]) {
            shape.push_back(widest(placed));
        } else {
            for (const Session::PlacedStep & p : placed) shape.push_back(p.order.n_kv);
        }
        for (const Session * s : sessions) {
            if (s->ring()) shape.push_back(s->ring()->step_order().n_kv);
        }
        if (shape != shape_) {
            build_graph(sessions, rows, placed, greedy != nullptr);
            shape_ = shape;
        }
        std::vector<int32_t> tokens;
        for (const auto & r : rows) tokens.insert(tokens.end(), r.begin(), r.end());
        ggml_backend_tensor_set(graph_.in.tokens, tokens.data(), 0, tokens.size() * sizeof(int32_t));
        ggml_backend_tensor_set(graph_.in.positions, pos.data(), 0, pos.size() * sizeof(int32_t));
        for (size_t i = 0; i < graph_.lane_rings.size(); ++i) {
            const SlidingWindowKV & ring = *sessions[i]->ring();
            kv_step_inputs_set(graph_.lane_rings[i].in, ring.kv().layout(), ring.step_order(), ring.step_plan(),
                               &pos[graph_.lane_rings[i].t0], scratch_);
        }
        if (graph_.arena.arena) {   // one row a session (shared_arena)
            std::vector<LaneToken> lt;
            for (int64_t i = 0; i < n; ++i) lt.push_back({sessions[i]->kv().lane(), placed[i].plan.slots[0], pos[i], &placed[i].order});
            kv_step_inputs_set_lanes(graph_.arena.in, graph_.arena.arena->layout(), lt, scratch_);
        } else {
            for (int64_t i = 0; i < n; ++i) {
                kv_step_inputs_set(graph_.lanes[i].in, sessions[i]->kv().layout(), placed[i].order, placed[i].plan,
                                   &pos[graph_.lanes[i].t0], scratch_);
            }
        }
        if (ggml_backend_sched_graph_compute(sched_, graph_.gf) != GGML_STATUS_SUCCESS) {
            throw std::runtime_error("ggml graph compute failed");
        }
        if (greedy) {
            greedy->resize((size_t) n);
            ggml_backend_tensor_get(argmax_, greedy->data(), 0, n * sizeof(int32_t));
        }
        if (logits) {
            logits->resize((size_t) ggml_nelements(logits_));
            ggml_backend_tensor_get(logits_, logits->data(), 0, ggml_nbytes(logits_));
        }
        std::vector<StepQueries> queries = split_queries(sessions, rows, keep);
        check_rpc_connections(sched_);   // a lost RPC device reads as zeros
        return {std::move(placed), std::move(queries)};
    } catch (...) {   // forget the positions placed so far: no session changes on an error
        for (size_t i = 0; i < placed.size(); ++i) sessions[i]->unplace_step(placed[i]);
        throw;
    }
}

void BatchDecoder::build_draft_graph(const std::vector<Session *> & sessions,
                                     const std::vector<Session::MtpDraftStep> & steps, const std::vector<ggml_tensor *> & hs) {
    const Session & first = *sessions.front();
    const int64_t n = (int64_t) sessions.size();
    const size_t n_nodes = first.graph_size() + (size_t) (k_max_lanes * 32);   // one layer's attention per session
    DraftGraph & d = draft_;
    d.shape.clear();
    if (!d.sched) d.sched = first.new_sched(n_nodes);
    if (d.ctx) ggml_free(d.ctx);
    d.ctx = first.new_graph_ctx(n_nodes);
    d.g = GraphCtx{};
    GraphCtx & g = d.g;
    g.ctx = d.ctx;
    g.gf = ggml_new_graph_custom(d.ctx, n_nodes, false);
    g.n_tokens = g.n_outputs = n;
    g.flash_attn = first.flash_attn();
    g.mtp_kv_layer = first.kv().layout().n_layer - 1;
    g.in.tokens = ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, n);
    g.in.positions = ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, n);
    ggml_set_input(g.in.tokens);
    ggml_set_input(g.in.positions);
    for (int64_t i = 0; i < n; ++i) {
        const PooledKV & kv = sessions[i]->kv();
        const int64_t n_kv = steps[i].order.n_kv;
        g.lanes.push_back({&kv, kv_step_inputs_new(g.ctx, kv.layout(), 1, n_kv, false), n_kv, i, 1});
    }
    d.logits = build_mtp_draft(g, *model_, hs);
    ggml_backend_sched_reset(d.sched);
    if (!ggml_backend_sched_alloc_graph(d.sched, g.gf)) {
        check_rpc_connections(d.sched);
        throw std::runtime_error("could not allocate the batched MTP draft graph (out of memory?)");
    }
}

void BatchDecoder::mtp_draft(const std::vector<Session *> & sessions, const std::vector<int32_t> & tokens, int64_t step,
                             std::vector<float> & logits) {
    if (tokens.size() != sessions.size()) {
        throw std::invalid_argument("a batched draft step needs one token per session (" + std::to_string(tokens.size()) +
                                    " tokens for " + std::to_string(sessions.size()) + " sessions)");
    }
    const auto held = lock_all(sessions, *model_);
    const int64_t n = (int64_t) sessions.size();
    std::vector<Session::MtpDraftStep> steps;
    std::vector<int64_t> shape;
    for (int64_t i = 0; i < n; ++i) {   // every session planned before any session's chain moves
        const Session & s = *sessions[i];
        if (!s.mtp()) {
            throw std::invalid_argument("session " + std::to_string(i) + " does not run the multi-token-prediction "
                                        "head (made without mtp=True)");
        }
        check_joins(s, *sessions.front(), i, 1);
        try {
            steps.push_back(s.plan_mtp_draft(tokens[i], step));
        } catch (const std::invalid_argument & e) {
            throw std::invalid_argument("session " + std::to_string(i) + ": " + e.what());
        }
        shape.insert(shape.end(), {(int64_t) s.serial(), steps.back().order.n_kv});
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<ggml_tensor *> hs;
    for (Session * s : sessions) hs.push_back(s->start_mtp_draft(step));
    if (shape != draft_.shape) {
        build_draft_graph(sessions, steps, hs);
        draft_.shape = shape;
    }
    GraphCtx & g = draft_.g;
    std::vector<int32_t> pos;
    for (const Session::MtpDraftStep & st : steps) pos.push_back(st.pos);
    ggml_backend_tensor_set(g.in.tokens, tokens.data(), 0, n * sizeof(int32_t));
    ggml_backend_tensor_set(g.in.positions, pos.data(), 0, n * sizeof(int32_t));
    for (int64_t i = 0; i < n; ++i) {
        kv_step_inputs_set(g.lanes[i].in, sessions[i]->kv().layout(), steps[i].order, steps[i].alloc, &pos[i], scratch_);
    }
    if (ggml_backend_sched_graph_compute(draft_.sched, g.gf) != GGML_STATUS_SUCCESS) {
        throw std::runtime_error("ggml graph compute failed");
    }
    logits.resize((size_t) ggml_nelements(draft_.logits));
    ggml_backend_tensor_get(draft_.logits, logits.data(), 0, ggml_nbytes(draft_.logits));
    check_rpc_connections(draft_.sched);   // a lost RPC device reads as zeros
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    for (int64_t i = 0; i < n; ++i) sessions[i]->finish_mtp_draft(step, ms / (double) n);
}

}  // namespace kvf
