// PoolArena: the pools of several sessions of one Model in one allocation, lane after lane. Per pooled
// layer, K is [n_embd_k, pool_tokens * n_lanes] (lane l's slot s is row l * pool_tokens + s), V the same,
// or [pool_tokens, n_embd_v * n_lanes] when transposed (lane l's [pool_tokens, n_embd_v] block after
// lane l-1's). A session's PooledKV is then a view of its lane and pages, snapshots and attends as if it
// owned the memory, while a batched decode step (runtime/batch_decoder.h) writes every lane's K/V with one
// set_rows and attends every lane's pool with one attention call per layer, the lanes along ggml's
// sequence dimension (ne[3]), as llama.cpp's multi-stream KV cache does. Eight sessions each calling their
// own set_rows and flash attention per layer made a step ~4x slower than one session's (H100, 8B, 32K).
//
// A hybrid model's sessions keep their linear-attention state here too, in the lane of their pool: per recurrent
// layer, conv [conv_elems, n_lanes] and ssm [ssm_elems, n_lanes]. A session's RecurrentState views its lane; a
// batched decode runs one conv and one delta rule per run of lanes instead of one per session (each session's
// own ops made the Qwen3.5-27B shape's 8-lane step ~4,200 kernels: R106).
//
// The first session to join fixes the per-lane layout (sessions compute it from their config and the
// attention path) and allocates the arena; every later one must bring the same layout. A lane is held
// until its PooledKV goes away, and is zeroed when taken again.
//
// Threads: acquire and release lock the arena (sessions of a server are made and dropped on any thread).
#pragma once

#include "kv/pooled_kv.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace kvf {

class PoolArena {
public:
    explicit PoolArena(int64_t n_lanes);
    ~PoolArena();
    PoolArena(const PoolArena &) = delete;
    PoolArena & operator=(const PoolArena &) = delete;

    // A free lane for a pool of `layout` whose layer il lives on backends[il] (the arena is allocated on the first
    // call, each layer on its backend). Throws std::invalid_argument when the layout or the backends differ from
    // the first session's, and when every lane is taken.
    int64_t acquire(const LayerBackends & backends, const KvLayout & layout);
    void release(int64_t lane);

    int64_t n_lanes() const { return n_lanes_; }
    int64_t lanes_free() const;
    const KvLayout & layout() const { return layout_; }   // one lane's (valid once allocated)
    ggml_tensor * k(int64_t il) const { return k_[il]; }   // [n_embd_k, pool_tokens * n_lanes]
    ggml_tensor * v(int64_t il) const { return v_[il]; }   // [n_embd_v, pool_tokens * n_lanes] or [pool_tokens, n_embd_v * n_lanes]
    int64_t device_bytes() const;   // the pools' and the recurrent state's

    // Room for each lane's linear-attention state: n_layer layers, layer l on backends[l] (allocated on the first
    // call; later calls must bring the same sizes and backends: std::invalid_argument otherwise).
    void reserve_recurrent(const LayerBackends & backends, int64_t n_layer, int64_t conv_elems, int64_t ssm_elems);
    // Lanes [lane, lane + n) of layer l's conv or recurrent state, F32 [conv_elems, n] / [ssm_elems, n], a view made
    // in ctx (a graph's: its scheduler binds it).
    ggml_tensor * conv_lanes(ggml_context * ctx, int64_t l, int64_t lane, int64_t n) const;
    ggml_tensor * ssm_lanes(ggml_context * ctx, int64_t l, int64_t lane, int64_t n) const;
    // One lane of them, [conv_elems, 1] / [ssm_elems, 1], bound to the arena's memory (a session's own view).
    ggml_tensor * lane_conv(ggml_context * ctx, int64_t l, int64_t lane) const;
    ggml_tensor * lane_ssm(ggml_context * ctx, int64_t l, int64_t lane) const;

    // Lane `lane` of layer il's K or V, shaped as a PooledKV's own tensors; made in ctx (no_alloc) and
    // bound to the arena's memory.
    ggml_tensor * lane_k(ggml_context * ctx, int64_t il, int64_t lane) const;
    ggml_tensor * lane_v(ggml_context * ctx, int64_t il, int64_t lane) const;

private:
    void allocate(const LayerBackends & backends, const KvLayout & layout);

    const int64_t n_lanes_;
    mutable std::mutex mutex_;
    std::vector<bool> taken_;
    KvLayout layout_;
    LayerBackends backends_;
    std::unique_ptr<BackendBuffers> bufs_;
    std::vector<ggml_tensor *> k_, v_;
    LayerBackends recurrent_backends_;
    std::unique_ptr<BackendBuffers> recurrent_bufs_;
    std::vector<ggml_tensor *> conv_, ssm_;
};

}  // namespace kvf
