// laguna family: Poolside's Laguna. Sigmoid-routed experts chosen with a per-expert selection bias, plus an
// ungated shared expert (the first leading_dense_block_count layers have a dense FFN instead); a softplus
// gate on the attention output, per head or per element (read from the gate's width); per-head RMS norms on
// q and k; more query heads on the sliding-window layers than on the global ones. The global layers use
// YaRN over part of the head, the sliding-window layers (when the file has a window: XS.2, one global layer
// in four, first) plain RoPE over all of it. Only the global layers are pooled.
#include "model/graph.h"
#include "model/gguf_meta.h"

#include <cmath>
#include <stdexcept>

namespace kvf {
namespace {

void read_hparams(const gguf_context * g, ModelHparams & hp) {
    const std::string a = hp.arch + ".";
    read_moe_hparams(g, hp, /*shared_expert =*/ false);
    // One shared expert, its width stored apart from the routed ones' (libllama: n_ff_exp x count without it).
    int64_t n_shared = 1;
    meta_int(g, a + "expert_shared_count", 1, 64, n_shared);
    hp.n_ff_shexp = hp.n_ff_exp * n_shared;
    meta_int(g, a + "expert_shared_feed_forward_length", 1, INT32_MAX, hp.n_ff_shexp);
    int64_t gating = 2;   // libllama's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID, Laguna's default
    meta_int(g, a + "expert_gating_func", 0, INT32_MAX, gating);
    if (gating != 0 && gating != 1 && gating != 2) {
        throw std::runtime_error("GGUF " + a + "expert_gating_func=" + std::to_string(gating) +
                                 " is not supported (1 softmax, 2 sigmoid)");
    }
    hp.expert_gating = gating == 1 ? ModelHparams::ExpertGating::softmax : ModelHparams::ExpertGating::sigmoid;
    hp.expert_weights_norm = false;
    meta_bool(g, a + "expert_weights_norm", hp.expert_weights_norm);
    meta_float(g, a + "expert_weights_scale", hp.expert_weights_scale);
    hp.n_layer_dense_lead = meta_require_int(g, a + "leading_dense_block_count", 0, hp.n_layer);

    hp.rope_freq_base_swa = hp.rope_freq_base;   // the local layers' own base when the file has one
    hp.rope_freq_scale_swa = 1.0f;               // and never the global layers' YaRN scale
    read_sliding_window(g, hp, /*period =*/ 4, /*global_first =*/ true);
}

void load_layer(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il) {
    const bool dense = il < hp.n_layer_dense_lead;
    load_decoder_layer(w, src, hp, il, /*dense_ffn =*/ dense);
    const std::string p = "blk." + std::to_string(il) + ".";
    if (!dense) {
        load_moe_ffn(w, src, hp, il, /*shared_gate =*/ false);
        w.ffn_exp_probs_b = src.require(p + "exp_probs_b.bias", {hp.n_expert});
    }
    w.q_norm = src.require(p + "attn_q_norm.weight", {hp.head_dim_k});
    w.k_norm = src.require(p + "attn_k_norm.weight", {hp.head_dim_k});
    // The gate's width says its kind: one output per head, or one per element of the attention output.
    const int64_t H = hp.n_head_of(il);
    const ggml_tensor * gate = src.stored(p + "attn_gate.weight");
    const bool per_element = gate && gate->ne[1] == H * hp.head_dim_v;
    w.attn_gate = src.require(p + "attn_gate.weight", {hp.n_embd, per_element ? H * hp.head_dim_v : H});
}

ggml_tensor * attention(GraphCtx & g, const Model & m, int il, ggml_tensor * x) {
    const ModelHparams & hp = m.hparams();
    const LayerWeights & w = m.layers[il];
    ggml_context * ctx = g.ctx;
    const int64_t D = hp.head_dim_k, H = hp.n_head_of(il), n = g.n_tokens;
    ggml_tensor * q = rope(g, m, il, rms_norm(g, project_heads(g, w.wq, nullptr, x, D, H), w.q_norm, hp.rms_eps));
    ggml_tensor * k = rope(g, m, il, rms_norm(g, project_heads(g, w.wk, nullptr, x, D, hp.n_head_kv), w.k_norm, hp.rms_eps));
    ggml_tensor * v = project_heads(g, w.wv, nullptr, x, hp.head_dim_v, hp.n_head_kv);
    ggml_tensor * out = kv_attend(g, m, il, q, k, v, 1.0f / std::sqrt((float) D));   // [head_dim_v * H, n]
    // The gate comes from the layer's normed input, like q, k and v.
    ggml_tensor * gate = ggml_softplus(ctx, ggml_mul_mat(ctx, w.attn_gate, x));
    if (w.attn_gate->ne[1] == H) {   // one gate per head, over the head's values
        out = ggml_mul(ctx, ggml_reshape_3d(ctx, out, hp.head_dim_v, H, n), ggml_reshape_3d(ctx, gate, 1, H, n));
        out = ggml_reshape_2d(ctx, out, hp.head_dim_v * H, n);
    } else {
        out = ggml_mul(ctx, out, gate);
    }
    return ggml_mul_mat(ctx, w.wo, out);
}

ggml_tensor * layer(GraphCtx & g, const Model & m, int il, ggml_tensor * x) { return decoder_layer(g, m, il, x, attention); }

}  // namespace

extern const ArchSpec arch_laguna;   // registered in registry.cpp
const ArchSpec arch_laguna = {"laguna", GGML_ROPE_TYPE_NEOX, read_hparams, load_layer, embed_tokens, layer};

}  // namespace kvf
