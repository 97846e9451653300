// gemma4 family: Google Gemma 4 (text), as libllama's gemma4.cpp builds it. Sliding-window and global layers
// with head sizes of their own (the ring and the pool have their own row widths) and RoPE of their own (the
// global layers' with proportional-RoPE factors, rope_freqs); per-head RMS norms on q and k, V RMS-normed
// without a weight, attention scale 1; norms after attention and after the FFN; GeGLU FFN of a per-layer
// width, beside routed GeGLU experts on MoE layers (the dense FFN then acts as the shared expert); per-layer
// token embeddings (PLE) added after the FFN; an optional per-layer output scale; soft-capped tied logits.
// The last attention.shared_kv_layers layers have no K/V of their own and attend an earlier layer's.
#include "model/ffn.h"
#include "model/graph.h"
#include "model/gguf_meta.h"

#include <cmath>
#include <stdexcept>

namespace kvf {
namespace {

void read_hparams(const gguf_context * g, ModelHparams & hp) {
    const std::string a = hp.arch + ".";
    int64_t n_shared = 0;
    meta_int(g, a + "attention.shared_kv_layers", 0, hp.n_layer, n_shared);
    if (n_shared > 0) hp.n_layer_kv = hp.n_layer - n_shared;   // before the window: only own K/V is pooled
    // libllama requires the window and one flag per layer.
    meta_require_int(g, a + "attention.sliding_window", 1, INT32_MAX);
    const std::string pattern = a + "attention.sliding_window_pattern";
    const int64_t id = gguf_find_key(g, pattern.c_str());
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY) {
        throw std::runtime_error("GGUF " + pattern + " must be an array of one flag per layer (gemma4)");
    }
    read_sliding_window(g, hp, /*period =*/ 0, /*global_first =*/ false);

    hp.head_dim_k_swa = meta_require_int(g, a + "attention.key_length_swa", 1, INT32_MAX);
    hp.head_dim_v_swa = meta_require_int(g, a + "attention.value_length_swa", 1, INT32_MAX);
    if (hp.head_dim_k != hp.head_dim_v || hp.head_dim_k_swa != hp.head_dim_v_swa) {
        throw std::runtime_error("GGUF " + a + "attention.key_length(_swa) and value_length(_swa) differ: Gemma 4 "
                                 "needs equal K and V head sizes");
    }
    if (hp.n_rot_swa > hp.head_dim_k_swa) {
        throw std::runtime_error("GGUF " + a + "rope.dimension_count_swa=" + std::to_string(hp.n_rot_swa) +
                                 " exceeds the sliding-window head size " + std::to_string(hp.head_dim_k_swa));
    }
    hp.rope_freqs_per_layer = true;
    hp.n_embd_per_layer = meta_require_int(g, a + "embedding_length_per_layer_input", 0, INT32_MAX);
    if (meta_float(g, a + "final_logit_softcapping", hp.logit_softcap) && hp.logit_softcap < 0.0f) {
        throw std::runtime_error("GGUF " + a + "final_logit_softcapping must be >= 0");
    }
    if (gguf_find_key(g, (a + "expert_count").c_str()) >= 0) {
        read_moe_hparams(g, hp, /*shared_expert =*/ false);   // the dense FFN is the shared expert
        hp.expert_gating = ModelHparams::ExpertGating::softmax;
        hp.expert_weights_norm = true;
    }
    if (hp.n_layer_kv >= 0) {
        // libllama's cache reuse assumes the last layer before the cut is global and the one before it local.
        if (hp.n_layer_kv < 2) throw std::runtime_error("GGUF " + a + "attention.shared_kv_layers leaves fewer than 2 layers with K/V");
        for (int64_t il = hp.n_layer_kv; il < hp.n_layer; ++il) {
            if (hp.is_swa(hp.kv_source(il)) != hp.is_swa(il)) {
                throw std::runtime_error("GGUF " + a + "attention.shared_kv_layers: layer " + std::to_string(il) +
                                         " would share the K/V of layer " + std::to_string(hp.kv_source(il)) +
                                         ", which is of the other attention kind");
            }
        }
    }
}

void load_layer(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    const int64_t E = hp.n_embd, D = hp.head_dim_k_of(il), H = hp.n_head_of(il);
    // Files that libllama reads differently from what is built here: refuse rather than compute something else.
    for (const char * t : {"attn_qkv.weight", "attn_q.scale", "attn_k.scale", "attn_v.scale", "attn_output.scale",
                           "ffn_gate.scale", "ffn_up.scale", "ffn_down.scale"}) {
        if (src.stored(p + t)) throw std::runtime_error("GGUF tensor " + p + t + " is not supported (gemma4)");
    }
    w.attn_norm = src.require(p + "attn_norm.weight", {E});
    w.wq = src.require(p + "attn_q.weight", {E, D * H});
    w.q_norm = src.require(p + "attn_q_norm.weight", {D});
    if (hp.has_kv(il)) {
        w.wk = src.require(p + "attn_k.weight", {E, D * hp.n_head_kv});
        w.wv = src.optional(p + "attn_v.weight", {E, D * hp.n_head_kv});   // absent: V is K's projection
        w.k_norm = src.require(p + "attn_k_norm.weight", {D});
    }
    w.wo = src.require(p + "attn_output.weight", {D * H, E});
    w.attn_post_norm = src.require(p + "post_attention_norm.weight", {E});
    w.out_scale = src.optional(p + "layer_output_scale.weight", {1});
    if (!hp.is_swa(il)) w.rope_freqs = src.require("rope_freqs.weight", {hp.head_dim_k / 2});   // one, shared

    load_dense_ffn(w, src, hp, il);
    w.ffn_norm = src.require(p + "ffn_norm.weight", {E});
    w.ffn_post_norm = src.require(p + "post_ffw_norm.weight", {E});
    if (hp.n_expert > 0 && src.stored(p + "ffn_gate_inp.weight")) {   // a MoE layer
        load_moe_ffn(w, src, hp, il, /*shared_gate =*/ false);
        w.ffn_gate_inp_s = src.require(p + "ffn_gate_inp.scale", {E});
        w.ffn_pre_norm_2 = src.require(p + "pre_ffw_norm_2.weight", {E});
        w.ffn_post_norm_1 = src.require(p + "post_ffw_norm_1.weight", {E});
        w.ffn_post_norm_2 = src.require(p + "post_ffw_norm_2.weight", {E});
        // libllama reads the gate and up scales only with separate gate and up tensors.
        if (w.ffn_gate_exps) w.ffn_gate_exps_s = src.optional(p + "ffn_gate_exps.scale", {hp.n_expert});
        if (w.ffn_up_exps) w.ffn_up_exps_s = src.optional(p + "ffn_up_exps.scale", {hp.n_expert});
        w.ffn_down_exps_s = src.optional(p + "ffn_down_exps.scale", {hp.n_expert});
    }
    if (hp.n_embd_per_layer > 0) {
        w.ple_inp_gate = src.require(p + "inp_gate.weight", {E, hp.n_embd_per_layer});
        w.ple_proj = src.require(p + "proj.weight", {hp.n_embd_per_layer, E});
        w.ple_post_norm = src.require(p + "post_norm.weight", {E});
    }
}

ggml_tensor * embed(GraphCtx & g, const Model & m) {
    return ggml_scale(g.ctx, embed_tokens(g, m), std::sqrt((float) m.hparams().n_embd));
}

// Every layer has its own RoPE: the local layers' base, scale and dims, or the global layers' with their
// frequency factors; libllama's context YaRN values apply to both.
ggml_tensor * layer_rope(GraphCtx & g, const Model & m, int il, ggml_tensor * x) {
    const ModelHparams & hp = m.hparams();
    const bool swa = hp.is_swa(il);
    return ggml_rope_ext(g.ctx, x, g.in.positions, swa ? nullptr : m.layers[il].rope_freqs,
                         (int) (swa ? hp.n_rot_swa : hp.n_rot), hp.rope_type, (int) hp.n_ctx_orig_yarn,
                         swa ? hp.rope_freq_base_swa : hp.rope_freq_base, swa ? hp.rope_freq_scale_swa : hp.rope_freq_scale,
                         hp.rope_ext_factor, hp.rope_attn_factor, hp.yarn_beta_fast, hp.yarn_beta_slow);
}

ggml_tensor * attention(GraphCtx & g, const Model & m, int il, ggml_tensor * h) {
    const ModelHparams & hp = m.hparams();
    const LayerWeights & w = m.layers[il];
    ggml_context * ctx = g.ctx;
    const int64_t D = hp.head_dim_k_of(il), n = g.n_tokens;
    ggml_tensor * q = layer_rope(g, m, il, rms_norm(g, project_heads(g, w.wq, nullptr, h, D, hp.n_head_of(il)), w.q_norm, hp.rms_eps));
    ggml_tensor * k = nullptr, * v = nullptr;   // none: the layer attends its source layer's
    if (hp.has_kv(il)) {
        ggml_tensor * kp = ggml_mul_mat(ctx, w.wk, h);
        ggml_tensor * vp = w.wv ? ggml_mul_mat(ctx, w.wv, h) : kp;
        k = layer_rope(g, m, il, rms_norm(g, ggml_reshape_3d(ctx, kp, D, hp.n_head_kv, n), w.k_norm, hp.rms_eps));
        v = ggml_rms_norm(ctx, ggml_reshape_3d(ctx, vp, D, hp.n_head_kv, n), hp.rms_eps);
    }
    return ggml_mul_mat(ctx, w.wo, kv_attend(g, m, il, q, k, v, 1.0f));
}

ggml_tensor * ffn_geglu(GraphCtx & g, const LayerWeights & w, ggml_tensor * x) {
    ggml_context * ctx = g.ctx;
    return ggml_mul_mat(ctx, w.ffn_down, ggml_geglu_split(ctx, ggml_mul_mat(ctx, w.ffn_gate, x), ggml_mul_mat(ctx, w.ffn_up, x)));
}

// mul_mat_id times a per-expert scale, as libllama's build_lora_mm_id applies one.
ggml_tensor * scaled_by_expert(GraphCtx & g, ggml_tensor * y, ggml_tensor * scale, ggml_tensor * chosen) {
    if (!scale) return y;
    ggml_context * ctx = g.ctx;
    ggml_tensor * s = ggml_repeat_4d(ctx, ggml_reshape_3d(ctx, scale, 1, scale->ne[0], 1), 1, scale->ne[0], y->ne[2], 1);
    return ggml_mul(ctx, y, ggml_get_rows(ctx, s, chosen));
}

// The routed experts (libllama's build_moe_ffn with its router logits given): softmax over the router's
// logits of the residual stream (rms-normed, / sqrt(n_embd), times the router's input scale), the top
// n_expert_used weighted by their probabilities renormalised, GeGLU experts on x (the experts' normed input).
ggml_tensor * experts(GraphCtx & g, const ModelHparams & hp, const LayerWeights & w, ggml_tensor * x, ggml_tensor * resid) {
    ggml_context * ctx = g.ctx;
    const int64_t E = hp.n_embd, n = x->ne[1], k = hp.n_expert_used;
    ggml_tensor * r = ggml_scale(ctx, ggml_rms_norm(ctx, resid, hp.rms_eps), 1.0f / std::sqrt((float) E));
    ggml_tensor * probs = ggml_soft_max(ctx, ggml_mul_mat(ctx, w.ffn_gate_inp, ggml_mul(ctx, r, w.ffn_gate_inp_s)));
    ggml_tensor * chosen = ggml_argsort_top_k(ctx, probs, (int) k);   // I32 [k, n]
    ggml_tensor * weights = ggml_reshape_2d(ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, hp.n_expert, n), chosen), k, n);
    weights = ggml_div(ctx, weights, ggml_clamp(ctx, ggml_sum_rows(ctx, weights), 6.103515625e-5f, INFINITY));
    weights = ggml_reshape_3d(ctx, weights, 1, k, n);
    ggml_build_forward_expand(g.gf, weights);   // libllama's node order

    ggml_tensor * xe = ggml_reshape_3d(ctx, x, E, 1, n);
    ggml_tensor * gate, * up;
    if (w.ffn_gate_up_exps) {   // gate rows then up rows of each expert
        ggml_tensor * gu = ggml_mul_mat_id(ctx, w.ffn_gate_up_exps, xe, chosen);
        const int64_t f = gu->ne[0] / 2;
        gate = ggml_view_3d(ctx, gu, f, k, n, gu->nb[1], gu->nb[2], 0);
        up = ggml_view_3d(ctx, gu, f, k, n, gu->nb[1], gu->nb[2], f * gu->nb[0]);
    } else {
        up = scaled_by_expert(g, ggml_mul_mat_id(ctx, w.ffn_up_exps, xe, chosen), w.ffn_up_exps_s, chosen);
        gate = scaled_by_expert(g, ggml_mul_mat_id(ctx, w.ffn_gate_exps, xe, chosen), w.ffn_gate_exps_s, chosen);
    }
    ggml_tensor * out = ggml_mul_mat_id(ctx, w.ffn_down_exps, ggml_geglu_split(ctx, gate, up), chosen);   // [E, k, n]
    out = ggml_mul(ctx, scaled_by_expert(g, out, w.ffn_down_exps_s, chosen), weights);
    ggml_build_forward_expand(g.gf, out);
    ggml_tensor * sum = nullptr;   // over the k chosen, in libllama's order
    for (int64_t i = 0; i < k; ++i) {
        ggml_tensor * e = ggml_view_2d(ctx, out, E, n, out->nb[2], i * out->nb[1]);
        sum = sum ? ggml_add(ctx, sum, e) : e;
    }
    return k == 1 ? ggml_cont(ctx, sum) : sum;
}

// x + the post-normed FFN block of residual stream x: the dense GeGLU FFN, or on a MoE layer that FFN and the
// experts, each normed before and after. In row parts added into x's rows (add_in_row_parts).
ggml_tensor * add_ffn(GraphCtx & g, const ModelHparams & hp, const LayerWeights & w, ggml_tensor * x) {
    return add_in_row_parts(g, x, x, [&](ggml_tensor * part) {
        ggml_tensor * out = ffn_geglu(g, w, rms_norm(g, part, w.ffn_norm, hp.rms_eps));
        if (w.ffn_gate_inp) {
            ggml_tensor * routed = experts(g, hp, w, rms_norm(g, part, w.ffn_pre_norm_2, hp.rms_eps), part);
            out = ggml_add(g.ctx, rms_norm(g, out, w.ffn_post_norm_1, hp.rms_eps),
                           rms_norm(g, routed, w.ffn_post_norm_2, hp.rms_eps));
        }
        return rms_norm(g, out, w.ffn_post_norm, hp.rms_eps);
    });
}

// Layer il's per-layer input [n_embd_per_layer, n_tokens]: its slice of the token's per-layer embedding
// (x sqrt(width)) plus the normed projection of the scaled token embedding, / sqrt(2). libllama computes
// every layer's at once before layer 0; layers are built one at a time here (layer-major prefill too), so
// each computes its own slice from the step's tokens: the same values, row by row.
ggml_tensor * per_layer_input(GraphCtx & g, const Model & m, int il) {
    const ModelHparams & hp = m.hparams();
    ggml_context * ctx = g.ctx;
    const int64_t P = hp.n_embd_per_layer, n = g.n_tokens;
    ggml_tensor * rows = ggml_get_rows(ctx, m.per_layer_tok_embd, g.in.tokens);   // [P * n_layer, n]
    ggml_tensor * tok = ggml_cont(ctx, ggml_view_2d(ctx, rows, P, n, rows->nb[1], il * P * rows->nb[0]));
    tok = ggml_scale(ctx, tok, std::sqrt((float) P));
    const ggml_tensor * wp = m.per_layer_model_proj;
    ggml_tensor * proj_w = ggml_view_2d(ctx, m.per_layer_model_proj, wp->ne[0], P, wp->nb[1], il * P * wp->nb[1]);
    ggml_tensor * proj = ggml_scale(ctx, ggml_mul_mat(ctx, proj_w, embed(g, m)), 1.0f / std::sqrt((float) hp.n_embd));
    proj = rms_norm(g, proj, m.per_layer_proj_norm, hp.rms_eps);
    return ggml_scale(ctx, ggml_add(ctx, proj, tok), 1.0f / std::sqrt(2.0f));
}

ggml_tensor * layer(GraphCtx & g, const Model & m, int il, ggml_tensor * x) {
    const ModelHparams & hp = m.hparams();
    const LayerWeights & w = m.layers[il];
    ggml_context * ctx = g.ctx;
    const bool last = il == hp.n_layer - 1;   // only the output rows go on after attention

    ggml_tensor * attn = attention(g, m, il, rms_norm(g, x, w.attn_norm, hp.rms_eps));
    if (last) {
        attn = select_outputs(g, attn);
        x = select_outputs(g, x);
    }
    x = ggml_add(ctx, rms_norm(g, attn, w.attn_post_norm, hp.rms_eps), x);
    x = add_ffn(g, hp, w, x);
    if (hp.n_embd_per_layer > 0) {
        ggml_tensor * in = per_layer_input(g, m, il);
        if (last) in = select_outputs(g, in);
        ggml_tensor * pe = ggml_mul(ctx, ggml_gelu(ctx, ggml_mul_mat(ctx, w.ple_inp_gate, x)), in);
        x = ggml_add(ctx, x, rms_norm(g, ggml_mul_mat(ctx, w.ple_proj, pe), w.ple_post_norm, hp.rms_eps));
    }
    return w.out_scale ? ggml_mul(ctx, x, w.out_scale) : x;
}

}  // namespace

extern const ArchSpec arch_gemma4;   // registered in registry.cpp
const ArchSpec arch_gemma4 = {"gemma4", GGML_ROPE_TYPE_NEOX, read_hparams, load_layer, embed, layer};

}  // namespace kvf
