// The graph's writes into the pool and its views of it, as llama.cpp's KV cache has cpy_k / cpy_v /
// get_k / get_v: the only graph code that knows how K and V lie in the pool (slot rows, V transposed
// for the mul_mat path, a position-ordered copy). Attention calls these and never branches on the layout.
// Each takes the step's pool inputs (kv_step_inputs.h); tensors are in ggml order.
#pragma once

#include "kv/kv_step_inputs.h"
#include "kv/pool_arena.h"
#include "kv/pooled_kv.h"

#include "ggml.h"

#include <cstdint>

namespace kvf {

// Writes layer il's K of this step into the pool rows of its tokens. k: [head_dim_k, n_head_kv, n_tokens],
// RoPE'd. Returns the write (a set_rows node) for the caller to add to its graph.
ggml_tensor * cpy_k(ggml_context * ctx, const PooledKV & kv, const KvStepInputs & in, int64_t il, ggml_tensor * k);
// The same for V: v: [head_dim_v, n_head_kv, n_tokens]; with v_trans every value is scattered on its own.
ggml_tensor * cpy_v(ggml_context * ctx, const PooledKV & kv, const KvStepInputs & in, int64_t il, ggml_tensor * v);

// The first n_kv keys of layer il, in the order attention sees them (the position-ordered copy when
// in.kv_order is set): [head_dim_k, n_head_kv, n_kv].
ggml_tensor * get_k(ggml_context * ctx, const PooledKV & kv, const KvStepInputs & in, int64_t il, int64_t n_kv,
                    int64_t head_dim_k);
// Their values for flash attention: [head_dim_v, n_head_kv, n_kv]. Needs V in slot rows (no v_trans).
ggml_tensor * get_v(ggml_context * ctx, const PooledKV & kv, const KvStepInputs & in, int64_t il, int64_t n_kv,
                    int64_t head_dim_v);
// Their values for the mul_mat path, slots in ne0: [n_kv, head_dim_v, n_head_kv] (a view under v_trans,
// else a transposed copy of this step's n_kv slots).
ggml_tensor * get_v_trans(ggml_context * ctx, const PooledKV & kv, const KvStepInputs & in, int64_t il, int64_t n_kv,
                          int64_t head_dim_v);

// ---- the lanes of a pool arena (kv/pool_arena.h), for a batched decode step ----
// in: the step's inputs over the arena (kv_step_inputs_set_lanes): slots are arena rows (lane * pool_tokens +
// slot) and, under v_trans, V indices are elements of the arena's V.
// One set_rows writes every token's K (V) into its own lane.
ggml_tensor * cpy_k_lanes(ggml_context * ctx, const PoolArena & arena, const KvStepInputs & in, int64_t il, ggml_tensor * k);
ggml_tensor * cpy_v_lanes(ggml_context * ctx, const PoolArena & arena, const KvStepInputs & in, int64_t il, ggml_tensor * v);
// The first n_kv slots of lanes [lane, lane + n_lanes), the lanes along ne3: [head_dim, n_head_kv, n_kv, n_lanes]
// (V in slot rows for get_v_lanes).
ggml_tensor * get_k_lanes(ggml_context * ctx, const PoolArena & arena, int64_t il, int64_t n_kv, int64_t head_dim_k,
                          int64_t lane, int64_t n_lanes);
ggml_tensor * get_v_lanes(ggml_context * ctx, const PoolArena & arena, int64_t il, int64_t n_kv, int64_t head_dim_v,
                          int64_t lane, int64_t n_lanes);
// The same values for the mul_mat path from a transposed V: [n_kv, head_dim_v, n_head_kv, n_lanes], a view.
ggml_tensor * get_v_trans_lanes(ggml_context * ctx, const PoolArena & arena, int64_t il, int64_t n_kv,
                                int64_t head_dim_v, int64_t lane, int64_t n_lanes);

}  // namespace kvf
