#include "model/mtp.h"

namespace kvf {

namespace {

// The block's input: eh_proj([enorm(embedding of the step's tokens); hnorm(h)]), h [n_embd, n_tokens].
ggml_tensor * mtp_input(GraphCtx & g, const Model & m, ggml_tensor * h) {
    const MtpWeights & w = m.mtp;
    const float eps = m.hparams().rms_eps;
    ggml_tensor * e = ggml_get_rows(g.ctx, w.embed_tokens ? w.embed_tokens : m.tok_embd, g.in.tokens);
    ggml_tensor * eh = ggml_concat(g.ctx, rms_norm(g, e, w.enorm, eps), rms_norm(g, h, w.hnorm, eps), 0);
    return ggml_mul_mat(g.ctx, w.eh_proj, eh);
}

}  // namespace

ggml_tensor * build_mtp_follow(GraphCtx & g, const Model & m, ggml_tensor * h) {
    ggml_context * ctx = g.ctx;
    const int64_t E = h->ne[0];
    ggml_tensor * hn = rms_norm(g, h, m.output_norm, m.hparams().rms_eps);   // [E, n]: what the logits see
    // Each session's tokens [t0, t0 + n) pair with its carry and then its own states (one session: all of them).
    const std::vector<GraphCtx::LaneState> one = {{g.recurrent, 0, g.n_tokens}};
    const std::vector<GraphCtx::LaneState> & lanes = g.mtp_lanes.empty() ? one : g.mtp_lanes;
    const auto carry_of = [&](const GraphCtx::LaneState & l) { return ggml_reshape_2d(ctx, l.state->mtp_carry(), E, 1); };
    const auto states = [&](int64_t t0, int64_t n) { return ggml_view_2d(ctx, hn, E, n, hn->nb[1], t0 * hn->nb[1]); };
    ggml_tensor * shifted = nullptr;
    for (const GraphCtx::LaneState & l : lanes) {
        ggml_tensor * s = l.n == 1 ? carry_of(l) : ggml_concat(ctx, carry_of(l), states(l.t0, l.n - 1), 1);
        shifted = shifted ? ggml_concat(ctx, shifted, s, 1) : s;
    }
    m.arch().mtp->write_kv(g, m, mtp_input(g, m, shifted));
    // Each carry moves on to its tokens' last state. The writes above read the old carry, and the graph runs its nodes
    // in the order they were added (as the linear-attention layers' conv state relies on too).
    for (const GraphCtx::LaneState & l : lanes) {
        ggml_build_forward_expand(g.gf, ggml_cpy(ctx, states(l.t0 + l.n - 1, 1), carry_of(l)));
    }
    return select_outputs(g, h);
}

ggml_tensor * build_mtp_draft(GraphCtx & g, const Model & m, const std::vector<ggml_tensor *> & hs) {
    ggml_context * ctx = g.ctx;
    const MtpWeights & w = m.mtp;
    const auto column = [&](ggml_tensor * h) { return ggml_reshape_2d(ctx, h, h->ne[0], 1); };
    ggml_tensor * h = column(hs.front());
    for (size_t i = 1; i < hs.size(); ++i) h = ggml_concat(ctx, h, column(hs[i]), 1);
    ggml_tensor * y = m.arch().mtp->block(g, m, mtp_input(g, m, h));
    y = rms_norm(g, y, w.head_norm ? w.head_norm : m.output_norm, m.hparams().rms_eps);   // libllama's h_nextn
    ggml_tensor * logits = ggml_mul_mat(ctx, w.head ? w.head : m.output, y);   // no softcap: libllama's graph_mtp has none
    ggml_set_name(logits, "mtp_logits");
    ggml_set_output(logits);
    ggml_build_forward_expand(g.gf, logits);
    // y depends on every h: the copies come after every read of them
    for (size_t i = 0; i < hs.size(); ++i) {
        ggml_tensor * yi = ggml_view_2d(ctx, y, y->ne[0], 1, y->nb[1], i * y->nb[1]);
        ggml_build_forward_expand(g.gf, ggml_cpy(ctx, yi, column(hs[i])));
    }
    return logits;
}

}  // namespace kvf
