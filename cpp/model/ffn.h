#pragma once
// The feed-forward blocks: SwiGLU, the routed experts, and a step's rows through them in parts.

#include "model/graph.h"

#include <functional>

namespace kvf {

// Most rows a feed-forward takes at once (llama.cpp's ubatch): a larger step (the exact prefill's 1024 rows) runs its
// FFN in parts of this many, one after the other, so the graph holds one part's intermediates (the 8B shape's F32 gate,
// up and product: 3 x 56 MiB at 1024 rows) and each part's matrix products take a full cache's shapes.
constexpr int64_t k_ffn_part_rows = 512;
// The exact prefill's (ExactPrefillOptions::ffn_part_rows 0): its default step's 1024 rows at once, SiLU and the product
// in the gate's memory, so each layer's FFN weights are read once a step for two F32 intermediates of the step's rows
// where parts held three of a part's (H100, 8B shape, R134: 32K 0.99x -> 1.00x llama-bench, 128K 1.00x -> 1.01x, for
// 28-30 MiB more; a larger step still runs in parts of this many).
constexpr int64_t k_exact_ffn_part_rows = 1024;

// SwiGLU feed-forward: down(silu(gate(x)) * up(x)).
ggml_tensor * ffn_swiglu(GraphCtx & g, const LayerWeights & w, ggml_tensor * x);
// Mixture-of-experts feed-forward (qwen3moe, qwen35moe): the top n_expert_used SwiGLU experts by softmax
// router probability, weighted by those renormalised; plus the sigmoid-gated shared expert when the layer has one.
ggml_tensor * ffn_moe(GraphCtx & g, const ModelHparams & hp, const LayerWeights & w, ggml_tensor * x);
// x + the layer's feed-forward of rms_norm(x): its experts when it has a router (ffn_moe), else SwiGLU; in row parts
// added into x's rows (add_in_row_parts).
ggml_tensor * add_layer_ffn(GraphCtx & g, const ModelHparams & hp, const LayerWeights & w, ggml_tensor * x);
// residual + f(x) for x [n, rows] and residual [m, rows] (a tensor of this graph's own, which it changes; it may be x),
// f computed on parts of at most GraphCtx::ffn_part_rows rows (0: k_ffn_part_rows), one after the other so that the
// graph's allocator reuses a part's intermediates for the next, and each part added into the residual's rows in place:
// f must treat each row alone (a feed-forward), and no join copies the parts (concats of 30 ms in a 32K prefill's
// 3.8 s on the H100, R131).
ggml_tensor * add_in_row_parts(GraphCtx & g, ggml_tensor * residual, ggml_tensor * x,
                               const std::function<ggml_tensor *(ggml_tensor *)> & f);

}  // namespace kvf
