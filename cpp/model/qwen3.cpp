// qwen3 family: Qwen3 dense (qwen3) and Qwen3 MoE (qwen3moe: the same attention, routed experts instead of
// the dense FFN). Per-head RMS norm on q and k before RoPE; NeoX RoPE; no biases.
#include "model/graph.h"

#include <cmath>

namespace kvf {
namespace {

void load_qk_norms(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    w.q_norm = src.require(p + "attn_q_norm.weight", {hp.head_dim_k});
    w.k_norm = src.require(p + "attn_k_norm.weight", {hp.head_dim_k});
}

void load_layer(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il) {
    load_decoder_layer(w, src, hp, il);
    load_qk_norms(w, src, hp, il);
}

void read_moe(const gguf_context * g, ModelHparams & hp) { read_moe_hparams(g, hp, /*shared_expert =*/ false); }

void load_moe_layer(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il) {
    load_decoder_layer(w, src, hp, il, /*dense_ffn =*/ false);
    load_qk_norms(w, src, hp, il);
    load_moe_ffn(w, src, hp, il);
}

ggml_tensor * attention(GraphCtx & g, const Model & m, int il, ggml_tensor * x) {
    const ModelHparams & hp = m.hparams();
    const LayerWeights & w = m.layers[il];
    ggml_tensor * q = project_heads(g, w.wq, nullptr, x, hp.head_dim_k, hp.n_head_of(il));
    ggml_tensor * k = project_heads(g, w.wk, nullptr, x, hp.head_dim_k, hp.n_head_kv);
    q = rope(g, m, il, rms_norm(g, q, w.q_norm, hp.rms_eps));
    k = rope(g, m, il, rms_norm(g, k, w.k_norm, hp.rms_eps));
    ggml_tensor * v = project_heads(g, w.wv, nullptr, x, hp.head_dim_v, hp.n_head_kv);
    return kv_attention(g, m, il, q, k, v, 1.0f / std::sqrt((float) hp.head_dim_k));
}

ggml_tensor * layer(GraphCtx & g, const Model & m, int il, ggml_tensor * x) { return decoder_layer(g, m, il, x, attention); }

}  // namespace

extern const ArchSpec arch_qwen3, arch_qwen3moe;   // registered in registry.cpp
const ArchSpec arch_qwen3 = {"qwen3", GGML_ROPE_TYPE_NEOX, nullptr, load_layer, embed_tokens, layer};
const ArchSpec arch_qwen3moe = {"qwen3moe", GGML_ROPE_TYPE_NEOX, read_moe, load_moe_layer, embed_tokens, layer};

}  // namespace kvf
