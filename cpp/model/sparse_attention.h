// Sparse prefill (prefill="sparse"): a layer-major prefill whose long blocks of queries attend a bounded set of
// keys instead of every earlier position, so a prompt's attention costs about the same per token at 1M as at 16K.
// Every position's K/V is still computed and kept (the staging pool, then the pool or the host store), so decode
// and later reselects can reach any of it: only the prompt's own attention is sparse.
//
// A block of queries [q0, q0 + n) attends, per KV head:
//   - the sink: chunks [0, sink_chunks) (attention's first tokens carry mass whatever the text);
//   - the local window: every position from chunk cl = (chunk of q0) - local_chunks, rounded down to 4 chunks, to
//     the block's last query, under the causal mask;
//   - the far chunks: the top_chunks of [sink_chunks, cl) whose mean key scores highest against the block's mean
//     query (its queries and the query heads of the group averaged: MInference's block-sparse pooling, MoBA's
//     mean-pooled keys), chosen on the device (ggml_top_k) so that a step waits for nothing.
// A block with fewer far chunks than top_chunks attends every earlier key, as the exact prefill does, and so does
// the prompt's last step (SparseStep::dense): over a quantized pool a pair of its queries per attention call, which
// ggml-cuda's vector kernel reads without the F16 copy of every key its other kernels make (graph.cpp: pair_queries:
// 4 GiB a call at 1M on the 8B shape). A block's
// queries choose together, so a position's K/V may depend on later queries of its own block (block_rows - 1 at most),
// as in MInference's block-sparse prefill; never on a later block's.
// The chosen chunks' keys are gathered per head (ggml_get_rows over the staging pool viewed as [head_dim,
// chunk, token in chunk, head]) and stacked before the sink and the window: the far keys all lie before every
// query, so one causal band of a few thousand columns masks the whole block (the far keys as positions just
// before the window's first). Keys then number (sink + top) x 64 + window + block: 3.3K at the defaults.
#pragma once

#include "kv/kv_step_inputs.h"
#include "kv/pooled_kv.h"

#include "ggml-backend.h"
#include "ggml.h"

#include <cstdint>
#include <memory>

namespace kvf {

struct GraphCtx;

struct SparseParams {
    int64_t top_chunks = 0;       // far chunks a block chooses (0: exact prefill)
    int64_t local_chunks = 16;    // chunks of the window before a block's first query's chunk
    int64_t sink_chunks = 1;
    int64_t block_rows = 256;     // queries per block (one choice of chunks per block and KV head)
    bool on() const { return top_chunks > 0; }
    void check(int64_t chunk_tokens) const;   // throws std::invalid_argument naming the bad value
};

// Per device of a sparse prefill: the mean key of every chunk of the layer being prefilled (each step writes its
// chunks', graph.cpp reads them to choose), and the band that every block's mask views.
class SparseIndex {
public:
    SparseIndex(ggml_backend_t backend, const SparseParams & p, int64_t chunk_tokens, int64_t n_chunks,
                int64_t max_row_width, int64_t kv_pad);
    ~SparseIndex();
    SparseIndex(const SparseIndex &) = delete;
    SparseIndex & operator=(const SparseIndex &) = delete;

    const SparseParams & params() const { return p_; }
    int64_t chunk_tokens() const { return C_; }
    int64_t n_chunks() const { return n_chunks_; }
    ggml_tensor * means() const { return means_; }   // F32, [head_dim, n_chunks, n_head_kv] per layer's view
    ggml_tensor * zeros() const { return zeros_; }   // I32 0s: get_rows' broadcast of the chosen chunks over tokens
    const CausalBand & band() const { return *band_; }
    int64_t device_bytes() const;

    // A block's chunks: where its window starts (cl, a chunk) and whether it chooses far chunks at all.
    struct Block {
        int64_t window_chunk;
        bool sparse;
    };
    Block block(int64_t q0) const;

private:
    SparseParams p_;
    int64_t C_, n_chunks_;
    ggml_context * ctx_ = nullptr;
    ggml_backend_buffer_t buf_ = nullptr;
    ggml_tensor * means_ = nullptr;
    ggml_tensor * zeros_ = nullptr;
    std::unique_ptr<CausalBand> band_;
};

// What one step of a sparse prefill gives the graph (GraphCtx::sparse).
struct SparseStep {
    const SparseIndex * index = nullptr;
    int64_t summarize_from = 0;   // first chunk whose mean key this step (re)computes: 0 on a layer's first step
    // The prompt's last step attends every key: the question at a prompt's end is what must find its evidence, and
    // one dense step a layer costs O(length), not O(length^2). Its last block still makes the choice a sparse block
    // ending there would make, to report the share of attention that choice would have held (GraphCtx::coverage).
    bool dense = false;
};

// Writes the mean keys of chunks [summarize_from, the chunk of the step's last position] of layer kl of the staging
// pool into the index (a partial last chunk's mean is recomputed by the next step, before any block reads it).
ggml_tensor * summarize_chunks(GraphCtx & g, const PooledKV & kv, int64_t kl, int64_t head_dim, int64_t first_pos,
                               int64_t n_tokens);

// The attention of one sparse block (its queries qb [head_dim_k, n, n_head] from position q0) over the keys it
// chose, [head_dim_v * n_head, n]; nullptr when the block attends every earlier key (the caller's dense path,
// under sparse_dense_mask's mask). n_lse_rows > 0: *lse is then the log-sum-exp of its last n_lse_rows queries'
// scores over the chosen keys (attention_lse), which beside the one over every key gives the mass they cover.
ggml_tensor * sparse_attend_block(GraphCtx & g, const PooledKV & kv, int64_t kl, ggml_tensor * qb, int64_t q0,
                                  int64_t head_dim_v, float kq_scale, int64_t n_lse_rows = 0, ggml_tensor ** lse = nullptr);
// The mask of a block that attends every earlier key in a sparse prefill, from the index's band: F16, [>= n_kv, n].
KvMaskRows sparse_dense_mask(ggml_context * ctx, const SparseIndex & index, int64_t q0, int64_t n, int64_t n_kv);

}  // namespace kvf
