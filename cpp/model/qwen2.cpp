// qwen2 family: Qwen2 / Qwen2.5 (biases on q, k, v; NeoX RoPE).
#include "model/graph.h"

#include <cmath>

namespace kvf {
namespace {

void load_layer(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il) {
    load_decoder_layer(w, src, hp, il);
    const std::string p = "blk." + std::to_string(il) + ".";
    w.bq = src.require(p + "attn_q.bias", {hp.head_dim_k * hp.n_head_of(il)});
    w.bk = src.require(p + "attn_k.bias", {hp.n_embd_k()});
    w.bv = src.require(p + "attn_v.bias", {hp.n_embd_v()});
}

ggml_tensor * attention(GraphCtx & g, const Model & m, int il, ggml_tensor * x) {
    const ModelHparams & hp = m.hparams();
    const LayerWeights & w = m.layers[il];
    ggml_tensor * q = rope(g, m, il, project_heads(g, w.wq, w.bq, x, hp.head_dim_k, hp.n_head_of(il)));
    ggml_tensor * k = rope(g, m, il, project_heads(g, w.wk, w.bk, x, hp.head_dim_k, hp.n_head_kv));
    ggml_tensor * v = project_heads(g, w.wv, w.bv, x, hp.head_dim_v, hp.n_head_kv);
    return kv_attention(g, m, il, q, k, v, 1.0f / std::sqrt((float) hp.head_dim_k));
}

ggml_tensor * layer(GraphCtx & g, const Model & m, int il, ggml_tensor * x) { return decoder_layer(g, m, il, x, attention); }

}  // namespace

extern const ArchSpec arch_qwen2;   // registered in registry.cpp
const ArchSpec arch_qwen2 = {"qwen2", GGML_ROPE_TYPE_NEOX, nullptr, load_layer, embed_tokens, layer};

}  // namespace kvf
