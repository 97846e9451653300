// gemma3 family: Gemma 3 (interleaved sliding-window and global attention; the sliding-window layers keep
// their own ring and only the global layers are pooled). Per-head RMS norms on q and k, NeoX RoPE with its
// own base on sliding-window layers, queries pre-scaled (query_pre_attn_scalar), norms after attention and
// after the FFN as well as before, GeGLU FFN, embeddings scaled by sqrt(n_embd), tied output.
#include "model/graph.h"
#include "model/gguf_meta.h"

#include <cmath>
#include <stdexcept>

namespace kvf {
namespace {

void read_hparams(const gguf_context * g, ModelHparams & hp) {
    const std::string a = hp.arch + ".";
    int64_t n_swa = 0;
    if (meta_int(g, a + "attention.sliding_window", 0, INT32_MAX, n_swa) && n_swa > 0) {
        hp.n_swa = n_swa;
        // Every 6th layer is global unless the file says otherwise: one flag per layer, or a period.
        const std::string pattern = a + "attention.sliding_window_pattern";
        const int64_t id = gguf_find_key(g, pattern.c_str());
        if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY ||
            !meta_bool_array(g, pattern, hp.n_layer, hp.swa_layers)) {
            int64_t period = 6;
            meta_int(g, pattern, 0, INT32_MAX, period);
            hp.swa_layers.assign((size_t) hp.n_layer, 0);
            for (int64_t il = 0; il < hp.n_layer; ++il) hp.swa_layers[(size_t) il] = period == 0 || il % period < period - 1;
        }
        if (meta_float(g, a + "rope.freq_base_swa", hp.rope_freq_base_swa) && !(hp.rope_freq_base_swa >= 1.0f)) {
            throw std::runtime_error("GGUF " + a + "rope.freq_base_swa must be >= 1");
        }
        if (hp.n_pooled_layers() == 0) {
            throw std::runtime_error("GGUF " + a + "attention.sliding_window_pattern leaves no global layer: nothing to pool");
        }
    }
    if (meta_float(g, a + "final_logit_softcapping", hp.logit_softcap) && hp.logit_softcap < 0.0f) {
        throw std::runtime_error("GGUF " + a + "final_logit_softcapping must be >= 0");
    }
    // Gemma 3 27B scales queries by 1/sqrt(n_embd / n_head), the others by 1/sqrt(head_dim) (libllama's rule).
    hp.attn_scale = 1.0f / std::sqrt(hp.n_layer == 62 ? (float) (hp.n_embd / hp.n_head) : (float) hp.head_dim_k);
}

void load_layer(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il) {
    load_decoder_layer(w, src, hp, il);
    const std::string p = "blk." + std::to_string(il) + ".";
    w.q_norm = src.require(p + "attn_q_norm.weight", {hp.head_dim_k});
    w.k_norm = src.require(p + "attn_k_norm.weight", {hp.head_dim_k});
    w.attn_post_norm = src.require(p + "post_attention_norm.weight", {hp.n_embd});
    w.ffn_post_norm = src.require(p + "post_ffw_norm.weight", {hp.n_embd});
}

ggml_tensor * embed(GraphCtx & g, const Model & m) {
    return ggml_scale(g.ctx, embed_tokens(g, m), std::sqrt((float) m.hparams().n_embd));
}

ggml_tensor * layer(GraphCtx & g, const Model & m, int il, ggml_tensor * x) {
    const ModelHparams & hp = m.hparams();
    const LayerWeights & w = m.layers[il];
    ggml_context * ctx = g.ctx;

    ggml_tensor * h = rms_norm(g, x, w.attn_norm, hp.rms_eps);
    ggml_tensor * q = project_heads(g, w.wq, nullptr, h, hp.head_dim_k, hp.n_head);
    ggml_tensor * k = project_heads(g, w.wk, nullptr, h, hp.head_dim_k, hp.n_head_kv);
    ggml_tensor * v = project_heads(g, w.wv, nullptr, h, hp.head_dim_v, hp.n_head_kv);
    q = ggml_scale(ctx, rope(g, m, il, rms_norm(g, q, w.q_norm, hp.rms_eps)), hp.attn_scale);
    k = rope(g, m, il, rms_norm(g, k, w.k_norm, hp.rms_eps));
    ggml_tensor * attn = kv_attention(g, m, il, q, k, v, 1.0f);
    if (il == hp.n_layer - 1) {   // only the output rows go on
        attn = select_outputs(g, attn);
        x = select_outputs(g, x);
    }
    x = ggml_add(ctx, rms_norm(g, attn, w.attn_post_norm, hp.rms_eps), x);

    h = rms_norm(g, x, w.ffn_norm, hp.rms_eps);
    ggml_tensor * ffn = ggml_mul_mat(ctx, w.ffn_down,
                                     ggml_geglu_split(ctx, ggml_mul_mat(ctx, w.ffn_gate, h), ggml_mul_mat(ctx, w.ffn_up, h)));
    return ggml_add(ctx, rms_norm(g, ffn, w.ffn_post_norm, hp.rms_eps), x);
}

}  // namespace

extern const ArchSpec arch_gemma3;   // registered in registry.cpp
const ArchSpec arch_gemma3 = {"gemma3", GGML_ROPE_TYPE_NEOX, read_hparams, load_layer, embed, layer};

}  // namespace kvf
