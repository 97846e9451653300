// llama family: SmolLM2, Llama 2/3 (rope frequency factors when present), Mistral.
#include "model/graph.h"

#include <cmath>

namespace kvf {
namespace {

void load_layer(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il) {
    load_decoder_layer(w, src, hp, il);
}

ggml_tensor * attention(GraphCtx & g, const Model & m, int il, ggml_tensor * x) {
    const ModelHparams & hp = m.hparams();
    const LayerWeights & w = m.layers[il];
    ggml_tensor * q = rope(g, m, il, project_heads(g, w.wq, nullptr, x, hp.head_dim_k, hp.n_head_of(il)));
    ggml_tensor * k = rope(g, m, il, project_heads(g, w.wk, nullptr, x, hp.head_dim_k, hp.n_head_kv));
    ggml_tensor * v = project_heads(g, w.wv, nullptr, x, hp.head_dim_v, hp.n_head_kv);
    return kv_attention(g, m, il, q, k, v, 1.0f / std::sqrt((float) hp.head_dim_k));
}

ggml_tensor * layer(GraphCtx & g, const Model & m, int il, ggml_tensor * x) { return decoder_layer(g, m, il, x, attention); }

}  // namespace

extern const ArchSpec arch_llama;   // registered in registry.cpp
const ArchSpec arch_llama = {"llama", GGML_ROPE_TYPE_NORMAL, nullptr, load_layer, embed_tokens, layer};

}  // namespace kvf
