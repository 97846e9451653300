// Session's multi-token-prediction drafts (model/mtp.h): one step of the head per call, in a graph of its own.
//
// Where a draft's K/V go: the head attends its own K/V of every held position (the trunk's steps wrote them into the
// pool's last layer) and of the drafts before it, which are positions the pager has not placed. They take the pool's
// first free slots (slots that hold no position: the head chunk's rows past the last token, or free blocks), which
// nothing reads: a slot the pager hands out later is written (by the step that places its position) or paged in
// before any query sees it. So drafting moves nothing and changes no ledger; the verify step that follows places the
// drafts' positions and writes every layer there, the head's included, from the trunk's own states.
#include "runtime/session.h"

#include "model/mtp.h"
#include "model/rpc.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

namespace kvf {

struct Session::MtpDrafts {
    ggml_backend_sched_t sched = nullptr;
    ggml_context * graph_ctx = nullptr;
    GraphCtx g;                        // the step's graph, rebuilt when n_kv changes
    ggml_tensor * logits = nullptr;    // F32 [n_vocab, 1]
    int64_t n_kv = -1;
    ggml_context * h_ctx = nullptr;    // the draft's hidden state: the carry, then each step's output
    ggml_backend_buffer_t h_buf = nullptr;
    ggml_tensor * h = nullptr;         // F32 [n_embd]
    uint64_t epoch = 0;                // the pager's epoch at step 0 (any change to the session ends the chain)
    int64_t next = -1;                 // the step that may come next (-1: only step 0)

    ~MtpDrafts() {
        if (graph_ctx) ggml_free(graph_ctx);
        if (sched) ggml_backend_sched_free(sched);
        if (h_buf) ggml_backend_buffer_free(h_buf);
        if (h_ctx) ggml_free(h_ctx);
    }
};

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The first n slots that hold no position.
std::vector<int64_t> free_slots(const std::vector<int64_t> & slot_pos, int64_t n) {
    std::vector<int64_t> out;
    for (int64_t s = 0; s < (int64_t) slot_pos.size() && (int64_t) out.size() < n; ++s) {
        if (slot_pos[s] < 0) out.push_back(s);
    }
    return out;
}

}  // namespace

void Session::check_mtp(const Model & model) {
    if (!model.has_mtp()) {
        throw std::invalid_argument("mtp: the model was loaded without its multi-token-prediction (nextn) head (load "
                                    "it with mtp=True; a GGUF needs " + model.hparams().arch + ".nextn_predict_layers)");
    }
    // The carry lives beside the linear-attention state, which only hybrid families have.
    if (model.hparams().n_recurrent_layers() == 0) {
        throw std::invalid_argument("mtp: the " + model.hparams().arch + " family has no linear-attention state to keep "
                                    "the head's carry in");
    }
}

std::unique_ptr<Session::MtpDrafts, void (*)(Session::MtpDrafts *)> Session::new_mtp_drafts() const {
    std::unique_ptr<MtpDrafts, void (*)(MtpDrafts *)> d(new MtpDrafts, [](MtpDrafts * p) { delete p; });
    ggml_init_params params = {ggml_tensor_overhead(), nullptr, true};
    d->h_ctx = ggml_init(params);
    if (!d->h_ctx) throw std::runtime_error("could not create the MTP draft's context");
    d->h = ggml_new_tensor_1d(d->h_ctx, GGML_TYPE_F32, model_->hparams().n_embd);
    d->h_buf = ggml_backend_alloc_ctx_tensors(d->h_ctx, model_->backend());
    if (!d->h_buf) throw std::runtime_error("could not allocate the MTP draft's hidden state");
    d->sched = new_sched();
    return d;
}

int64_t Session::mtp_room() const {
    const SessionLock held = lock(false);
    if (!cfg_.mtp) return 0;
    const int64_t left = cfg_.max_tokens - pager_->n_tokens();
    return std::min(left, (int64_t) free_slots(pager_->slot_positions(), left).size());
}

void Session::build_mtp_graph(int64_t n_kv) {
    MtpDrafts & d = *mtp_;
    if (d.graph_ctx) ggml_free(d.graph_ctx);
    d.graph_ctx = new_graph_ctx();
    d.g = GraphCtx{};
    GraphCtx & g = d.g;
    g.ctx = d.graph_ctx;
    g.gf = ggml_new_graph_custom(g.ctx, graph_size(), false);
    g.kv = kv_.get();
    g.n_tokens = 1;
    g.n_kv = n_kv;
    g.n_outputs = 1;
    g.flash_attn = flash_attn_;
    g.mtp_kv_layer = kv_->layout().n_layer - 1;
    g.in.tokens = ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, 1);
    g.in.positions = ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, 1);
    ggml_set_input(g.in.tokens);
    ggml_set_input(g.in.positions);
    g.in.kv = kv_step_inputs_new(g.ctx, kv_->layout(), 1, n_kv, false);   // slot order: no position-ordered copy
    d.logits = build_mtp_draft(g, *model_, {d.h});
    ggml_backend_sched_reset(d.sched);
    if (!ggml_backend_sched_alloc_graph(d.sched, g.gf)) {
        d.n_kv = -1;
        check_rpc_connections(d.sched);   // a lost RPC device allocates nothing
        throw std::runtime_error("could not allocate the MTP draft graph (out of memory?)");
    }
    d.n_kv = n_kv;
    timings_.n_graph_builds++;
}

Session::MtpDraftStep Session::plan_mtp_draft(int32_t token, int64_t step) const {
    if (!cfg_.mtp) throw std::logic_error("mtp_draft needs a session made with mtp=True");
    const MtpDrafts & d = *mtp_;
    const int64_t n = pager_->n_tokens(), n_vocab = model_->hparams().n_vocab;
    MtpDraftStep out;
    out.pos = (int32_t) (n + step);
    if (step < 0 || (step > 0 && (step != d.next || pager_->epoch() != d.epoch))) {
        throw std::invalid_argument("mtp_draft: step " + std::to_string(step) + " must follow step " +
                                    std::to_string(step - 1) + " of the same drafts (nothing run on the session between)");
    }
    if (token < 0 || token >= n_vocab) {
        throw std::invalid_argument("token id " + std::to_string(token) + " outside the vocabulary [0, " +
                                    std::to_string(n_vocab) + ")");
    }
    if (n + step >= cfg_.max_tokens) {
        throw std::invalid_argument("mtp_draft: position " + std::to_string(n + step) + " is past max_tokens=" +
                                    std::to_string(cfg_.max_tokens));
    }
    // The drafts' slots (free_slots' first step + 1), seen by this step's query as the positions they draft.
    KvKeyOrder & order = out.order;
    order.key_pos = pager_->slot_positions();
    const std::vector<int64_t> slots = free_slots(order.key_pos, step + 1);
    if ((int64_t) slots.size() <= step) {
        throw std::invalid_argument("mtp_draft: the pool has no free slot for draft " + std::to_string(step) +
                                    " (mtp_room() says how many drafts fit)");
    }
    int64_t last = -1;
    for (int64_t j = 0; j <= step; ++j) order.key_pos[slots[j]] = n + j;
    for (int64_t s = 0; s < (int64_t) order.key_pos.size(); ++s) if (order.key_pos[s] >= 0) last = s;
    order.n_kv = std::min(round_up(last + 1, kv_pad_), (int64_t) order.key_pos.size());
    out.alloc.span_start = out.pos;
    out.alloc.span_n = 1;
    out.alloc.slots = {(int32_t) slots[step]};
    return out;
}

ggml_tensor * Session::start_mtp_draft(int64_t step) {
    MtpDrafts & d = *mtp_;
    if (step == 0) {   // the draft starts from the carry: the trunk's state at the last held position
        ggml_backend_tensor_copy(recurrent_->mtp_carry(), d.h);
        d.epoch = pager_->epoch();
    }
    d.next = -1;   // a step that is not finished ends the chain
    return d.h;
}

void Session::finish_mtp_draft(int64_t step, double compute_ms) {
    mtp_->next = step + 1;
    timings_.t_compute_ms += compute_ms;
    timings_.n_computes++;
}

std::vector<float> Session::mtp_draft(int32_t token, int64_t step) {
    const SessionLock held = lock();
    const MtpDraftStep st = plan_mtp_draft(token, step);
    const auto t0 = std::chrono::steady_clock::now();
    start_mtp_draft(step);
    MtpDrafts & d = *mtp_;
    if (d.n_kv != st.order.n_kv) build_mtp_graph(st.order.n_kv);
    ggml_backend_tensor_set(d.g.in.tokens, &token, 0, sizeof(int32_t));
    ggml_backend_tensor_set(d.g.in.positions, &st.pos, 0, sizeof(int32_t));
    kv_step_inputs_set(d.g.in.kv, kv_->layout(), st.order, st.alloc, &st.pos, input_scratch_);
    if (ggml_backend_sched_graph_compute(d.sched, d.g.gf) != GGML_STATUS_SUCCESS) {
        throw std::runtime_error("ggml graph compute failed");
    }
    std::vector<float> logits((size_t) model_->hparams().n_vocab);
    ggml_backend_tensor_get(d.logits, logits.data(), 0, logits.size() * sizeof(float));
    finish_mtp_draft(step, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    return logits;
}

int64_t Session::mtp_compute_bytes() const {
    if (!mtp_) return 0;
    return (int64_t) ggml_backend_sched_get_buffer_size(mtp_->sched, model_->backend()) +
           (int64_t) ggml_backend_buffer_get_size(mtp_->h_buf);
}

}  // namespace kvf
