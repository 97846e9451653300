#include "kv/kv_graph.h"

#include <stdexcept>

namespace kvf {

namespace {

// Attention sums over keys in slot order; once chunks sit in shuffled blocks that order differs from the
// full cache's and the floating-point sums differ (enough to flip ~2% of SmolLM2's argmaxes). A copy in
// position order makes the result independent of where chunks landed. pool: [row width, pool_tokens].
ggml_tensor * ordered(ggml_context * ctx, const KvStepInputs & in, ggml_tensor * pool) {
    if (!in.kv_order) return pool;
    return ggml_set_rows(ctx, ggml_new_tensor_2d(ctx, pool->type, pool->ne[0], pool->ne[1]), pool, in.kv_order);
}

// The first n_kv slot rows of a pool in slot rows, split into heads: [head_dim, n_head_kv, n_kv].
ggml_tensor * heads_view(ggml_context * ctx, ggml_tensor * pool, int64_t head_dim, int64_t n_kv) {
    return ggml_view_3d(ctx, pool, head_dim, pool->ne[0] / head_dim, n_kv, ggml_row_size(pool->type, head_dim),
                        pool->nb[1], 0);
}

}  // namespace

ggml_tensor * cpy_k(ggml_context * ctx, const PooledKV & kv, const KvStepInputs & in, int64_t il, ggml_tensor * k) {
    // RoPE happened before this write, so a K row is position-independent and may live in any slot.
    // Flattened with a view (not a reshape), as llama.cpp does: ggml-cuda fuses rope -> view -> set_rows
    // into one kernel that writes the rotated K straight into the pool.
    ggml_tensor * k_rows = ggml_view_2d(ctx, k, k->ne[0] * k->ne[1], k->ne[2], k->nb[2], 0);
    return ggml_set_rows(ctx, kv.k(il), k_rows, in.slots);
}

ggml_tensor * cpy_v(ggml_context * ctx, const PooledKV & kv, const KvStepInputs & in, int64_t il, ggml_tensor * v) {
    ggml_tensor * v_pool = kv.v(il);   // [n_embd_v, pool_tokens], or [pool_tokens, n_embd_v] if v_trans
    if (kv.layout().v_trans) {   // every V value is its own one-element row, scattered to (channel, slot)
        ggml_tensor * v_vals = ggml_reshape_2d(ctx, ggml_is_contiguous(v) ? v : ggml_cont(ctx, v), 1, ggml_nelements(v));
        return ggml_set_rows(ctx, ggml_reshape_2d(ctx, v_pool, 1, ggml_nelements(v_pool)), v_vals, in.v_slots);
    }
    ggml_tensor * v_rows = ggml_view_2d(ctx, v, v->ne[0] * v->ne[1], v->ne[2], v->nb[2], 0);
    return ggml_set_rows(ctx, v_pool, v_rows, in.slots);
}

ggml_tensor * get_k(ggml_context * ctx, const PooledKV & kv, const KvStepInputs & in, int64_t il, int64_t n_kv,
                    int64_t head_dim_k) {
    return heads_view(ctx, ordered(ctx, in, kv.k(il)), head_dim_k, n_kv);
}

ggml_tensor * get_v(ggml_context * ctx, const PooledKV & kv, const KvStepInputs & in, int64_t il, int64_t n_kv,
                    int64_t head_dim_v) {
    if (kv.layout().v_trans) throw std::logic_error("get_v: V is transposed (v_trans); use get_v_trans");
    return heads_view(ctx, ordered(ctx, in, kv.v(il)), head_dim_v, n_kv);
}

ggml_tensor * get_v_trans(ggml_context * ctx, const PooledKV & kv, const KvStepInputs & in, int64_t il, int64_t n_kv,
                          int64_t head_dim_v) {
    ggml_tensor * v_pool = kv.v(il);
    if (kv.layout().v_trans) {   // [pool_tokens, n_embd_v]: mul_mat reads the first n_kv slots of each channel as is
        const int64_t n_head_kv = v_pool->ne[1] / head_dim_v;
        return ggml_view_3d(ctx, v_pool, n_kv, head_dim_v, n_head_kv, v_pool->nb[1], v_pool->nb[1] * head_dim_v, 0);
    }
    // slot rows (position-ordered copies included): transpose this step's n_kv slots
    return ggml_cont(ctx, ggml_permute(ctx, get_v(ctx, kv, in, il, n_kv, head_dim_v), 1, 2, 0, 3));
}

namespace {

// Lanes [lane, lane + n_lanes) of an arena tensor in slot rows, first n_kv rows of each, split into heads.
ggml_tensor * lanes_view(ggml_context * ctx, ggml_tensor * t, int64_t pool_tokens, int64_t head_dim, int64_t n_kv,
                         int64_t lane, int64_t n_lanes) {
    return ggml_view_4d(ctx, t, head_dim, t->ne[0] / head_dim, n_kv, n_lanes, ggml_row_size(t->type, head_dim), t->nb[1],
                        t->nb[1] * pool_tokens, t->nb[1] * pool_tokens * lane);
}

}  // namespace

ggml_tensor * cpy_k_lanes(ggml_context * ctx, const PoolArena & arena, const KvStepInputs & in, int64_t il, ggml_tensor * k) {
    ggml_tensor * k_rows = ggml_view_2d(ctx, k, k->ne[0] * k->ne[1], k->ne[2], k->nb[2], 0);
    return ggml_set_rows(ctx, arena.k(il), k_rows, in.slots);
}

ggml_tensor * cpy_v_lanes(ggml_context * ctx, const PoolArena & arena, const KvStepInputs & in, int64_t il, ggml_tensor * v) {
    ggml_tensor * v_arena = arena.v(il);
    if (arena.layout().v_trans) {
        ggml_tensor * v_vals = ggml_reshape_2d(ctx, ggml_is_contiguous(v) ? v : ggml_cont(ctx, v), 1, ggml_nelements(v));
        return ggml_set_rows(ctx, ggml_reshape_2d(ctx, v_arena, 1, ggml_nelements(v_arena)), v_vals, in.v_slots);
    }
    ggml_tensor * v_rows = ggml_view_2d(ctx, v, v->ne[0] * v->ne[1], v->ne[2], v->nb[2], 0);
    return ggml_set_rows(ctx, v_arena, v_rows, in.slots);
}

ggml_tensor * get_k_lanes(ggml_context * ctx, const PoolArena & arena, int64_t il, int64_t n_kv, int64_t head_dim_k,
                          int64_t lane, int64_t n_lanes) {
    return lanes_view(ctx, arena.k(il), arena.layout().pool_tokens, head_dim_k, n_kv, lane, n_lanes);
}

ggml_tensor * get_v_lanes(ggml_context * ctx, const PoolArena & arena, int64_t il, int64_t n_kv, int64_t head_dim_v,
                          int64_t lane, int64_t n_lanes) {
    if (arena.layout().v_trans) throw std::logic_error("get_v_lanes: V is transposed (v_trans); use get_v_trans_lanes");
    return lanes_view(ctx, arena.v(il), arena.layout().pool_tokens, head_dim_v, n_kv, lane, n_lanes);
}

ggml_tensor * get_v_trans_lanes(ggml_context * ctx, const PoolArena & arena, int64_t il, int64_t n_kv,
                                int64_t head_dim_v, int64_t lane, int64_t n_lanes) {
    if (!arena.layout().v_trans) throw std::logic_error("get_v_trans_lanes: V is in slot rows; use get_v_lanes");
    ggml_tensor * v = arena.v(il);   // [pool_tokens, n_embd_v * n_lanes]: lane l's channels after lane l-1's
    const int64_t n_embd_v = arena.layout().n_embd_v;
    return ggml_view_4d(ctx, v, n_kv, head_dim_v, n_embd_v / head_dim_v, n_lanes, v->nb[1], v->nb[1] * head_dim_v,
                        v->nb[1] * n_embd_v, v->nb[1] * n_embd_v * lane);
}

}  // namespace kvf
