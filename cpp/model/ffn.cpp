#include "model/ffn.h"

#include <algorithm>
#include <cmath>

namespace kvf {

namespace {

int64_t part_rows(const GraphCtx & g) { return g.ffn_part_rows > 0 ? g.ffn_part_rows : k_ffn_part_rows; }

}  // namespace

ggml_tensor * ffn_swiglu(GraphCtx & g, const LayerWeights & w, ggml_tensor * x) {
    ggml_tensor * gate = mul_mat_weights(g, w.ffn_gate, x);
    ggml_tensor * up = mul_mat_weights(g, w.ffn_up, x);
    // ggml-alloc never runs the fused GLU in place: over more rows than a part, SiLU and the product take the gate's
    // memory, so the graph holds two F32 intermediates of the rows, not three.
    if (x->ne[1] > k_ffn_part_rows) {
        return mul_mat_weights(g, w.ffn_down, ggml_mul_inplace(g.ctx, ggml_silu_inplace(g.ctx, gate), up));
    }
    return mul_mat_weights(g, w.ffn_down, ggml_swiglu_split(g.ctx, gate, up));
}

ggml_tensor * ffn_moe(GraphCtx & g, const ModelHparams & hp, const LayerWeights & w, ggml_tensor * x) {
    ggml_context * ctx = g.ctx;
    const int64_t n_embd = x->ne[0], n = x->ne[1], k = hp.n_expert_used;
    // Route as libllama's build_moe_ffn: softmax or sigmoid over every expert, the top k by that probability
    // plus the selection bias, weighted by their unbiased probabilities, renormalised to sum to 1 (clamped
    // as libllama does, so a sum of tiny weights never divides by 0) and scaled.
    ggml_tensor * logits = ggml_mul_mat(ctx, w.ffn_gate_inp, x);   // [n_expert, n]
    ggml_tensor * probs = hp.expert_gating == ModelHparams::ExpertGating::sigmoid ? ggml_sigmoid(ctx, logits)
                                                                                   : ggml_soft_max(ctx, logits);
    ggml_tensor * selection = w.ffn_exp_probs_b ? ggml_add(ctx, probs, w.ffn_exp_probs_b) : probs;
    ggml_tensor * chosen = ggml_argsort_top_k(ctx, selection, (int) k);   // I32 [k, n]
    ggml_tensor * weights = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, hp.n_expert, n), chosen);   // [1, k, n]
    if (hp.expert_weights_norm) {
        weights = ggml_reshape_2d(ctx, weights, k, n);
        weights = ggml_div(ctx, weights, ggml_clamp(ctx, ggml_sum_rows(ctx, weights), 6.103515625e-5f, INFINITY));
        weights = ggml_reshape_3d(ctx, weights, 1, k, n);
    }
    if (hp.expert_weights_scale != 0.0f && hp.expert_weights_scale != 1.0f) {
        weights = ggml_scale(ctx, weights, hp.expert_weights_scale);
    }

    ggml_tensor * xe = ggml_reshape_3d(ctx, x, n_embd, 1, n);
    ggml_tensor * gate, * up;
    if (w.ffn_gate_up_exps) {   // one matrix: gate rows then up rows of each expert
        ggml_tensor * gu = ggml_mul_mat_id(ctx, w.ffn_gate_up_exps, xe, chosen);   // [2 * n_ff_exp, k, n]
        const int64_t f = gu->ne[0] / 2;
        gate = ggml_view_3d(ctx, gu, f, k, n, gu->nb[1], gu->nb[2], 0);
        up = ggml_view_3d(ctx, gu, f, k, n, gu->nb[1], gu->nb[2], f * gu->nb[0]);
    } else {
        up = ggml_mul_mat_id(ctx, w.ffn_up_exps, xe, chosen);       // [n_ff_exp, k, n]
        gate = ggml_mul_mat_id(ctx, w.ffn_gate_exps, xe, chosen);
    }
    ggml_tensor * experts = ggml_mul_mat_id(ctx, w.ffn_down_exps, ggml_swiglu_split(ctx, gate, up), chosen);   // [n_embd, k, n]
    experts = ggml_mul(ctx, experts, weights);
    ggml_tensor * out = nullptr;   // the sum over the k chosen experts, in libllama's order
    for (int64_t i = 0; i < k; ++i) {
        ggml_tensor * e = ggml_view_2d(ctx, experts, n_embd, n, experts->nb[2], i * experts->nb[1]);
        out = out ? ggml_add(ctx, out, e) : e;
    }
    if (k == 1) out = ggml_cont(ctx, out);
    if (w.ffn_up_shexp) {   // the shared expert, gated per token by a sigmoid where it has a gate (qwen35moe)
        ggml_tensor * shared = ggml_mul_mat(ctx, w.ffn_down_shexp,
                                            ggml_swiglu_split(ctx, ggml_mul_mat(ctx, w.ffn_gate_shexp, x),
                                                              ggml_mul_mat(ctx, w.ffn_up_shexp, x)));
        if (w.ffn_gate_inp_shexp) shared = ggml_mul(ctx, shared, ggml_sigmoid(ctx, ggml_mul_mat(ctx, w.ffn_gate_inp_shexp, x)));
        out = ggml_add(ctx, out, shared);
    }
    return out;
}

ggml_tensor * add_layer_ffn(GraphCtx & g, const ModelHparams & hp, const LayerWeights & w, ggml_tensor * x) {
    return add_in_row_parts(g, x, rms_norm(g, x, w.ffn_norm, hp.rms_eps), [&](ggml_tensor * part) {
        return w.ffn_gate_inp ? ffn_moe(g, hp, w, part) : ffn_swiglu(g, w, part);
    });
}

ggml_tensor * add_in_row_parts(GraphCtx & g, ggml_tensor * residual, ggml_tensor * x,
                               const std::function<ggml_tensor *(ggml_tensor *)> & f) {
    const int64_t rows = x->ne[1], per_part = part_rows(g);
    if (rows <= per_part) return ggml_add(g.ctx, residual, f(x));
    GGML_ASSERT(residual->ne[1] == rows && ggml_is_contiguous(residual));
    const size_t row_bytes = residual->nb[1];
    // Each part's rows are viewed from the sum of the part before, so the graph holds (and runs) every part's add.
    ggml_tensor * sum = residual;
    int64_t sum_row = 0;   // sum's first row
    for (int64_t r = 0; r < rows; r += per_part) {
        const int64_t n = std::min(per_part, rows - r);
        ggml_tensor * part = f(ggml_view_2d(g.ctx, x, x->ne[0], n, x->nb[1], r * x->nb[1]));
        sum = ggml_add_inplace(g.ctx, ggml_view_2d(g.ctx, sum, residual->ne[0], n, row_bytes, (r - sum_row) * row_bytes), part);
        sum_row = r;
    }
    // Every row, as a view of the last part's sum: the offset back to row 0 wraps in size_t (ggml adds view offsets).
    return ggml_view_2d(g.ctx, sum, residual->ne[0], rows, row_bytes, (size_t) 0 - (size_t) sum_row * row_bytes);
}

}  // namespace kvf
