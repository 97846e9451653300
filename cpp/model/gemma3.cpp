// gemma3 family: Gemma 3 (interleaved sliding-window and global attention; the sliding-window layers keep
// their own ring and only the global layers are pooled). Per-head RMS norms on q and k, NeoX RoPE with its
// own base on sliding-window layers, queries pre-scaled (query_pre_attn_scalar), norms after attention and
// after the FFN as well as before, GeGLU FFN, embeddings scaled by sqrt(n_embd), tied output.
#include "model/ffn.h"
#include "model/graph.h"
#include "model/gguf_meta.h"

#include <cmath>
#include <stdexcept>

namespace kvf {
namespace {

void read_hparams(const gguf_context * g, ModelHparams & hp) {
    const std::string a = hp.arch + ".";
    read_sliding_window(g, hp, /*period =*/ 6, /*global_first =*/ false);   // every 6th layer global
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
    ggml_tensor * q = project_heads(g, w.wq, nullptr, h, hp.head_dim_k, hp.n_head_of(il));
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

    return add_in_row_parts(g, x, rms_norm(g, x, w.ffn_norm, hp.rms_eps), [&](ggml_tensor * part) {
        ggml_tensor * ffn = ggml_mul_mat(ctx, w.ffn_down, ggml_geglu_split(ctx, ggml_mul_mat(ctx, w.ffn_gate, part),
                                                                             ggml_mul_mat(ctx, w.ffn_up, part)));
        return rms_norm(g, ffn, w.ffn_post_norm, hp.rms_eps);
    });
}

}  // namespace

extern const ArchSpec arch_gemma3;   // registered in registry.cpp
const ArchSpec arch_gemma3 = {"gemma3", GGML_ROPE_TYPE_NEOX, read_hparams, load_layer, embed, layer};

}  // namespace kvf
