#include "model/sparse_attention.h"

#include "model/graph.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace kvf {

namespace {

// A window starts on a multiple of 4 chunks: with sink + top a multiple of 4 too, a block's keys are a multiple of
// 256 (64-token chunks), which ggml-cuda's grouped-query flash attention kernels want (fattn.cu: gqa_opt_applies).
constexpr int64_t k_window_align = 4;

// The largest query position, counted from a sparse block's first key, that any block's mask holds.
int64_t band_span(const SparseParams & p, int64_t C) {
    return (p.top_chunks + p.sink_chunks + p.local_chunks + k_window_align) * C + p.block_rows;
}

}  // namespace

void SparseParams::check(int64_t chunk_tokens) const {
    const auto bad = [](const std::string & what) { throw std::invalid_argument("sparse prefill: " + what); };
    if (top_chunks < 0) bad("top_chunks must be >= 0 (0: exact prefill), got " + std::to_string(top_chunks));
    if (!on()) return;
    if (local_chunks < 0) bad("local_chunks must be >= 0, got " + std::to_string(local_chunks));
    if (sink_chunks < 1) bad("sink_chunks must be >= 1, got " + std::to_string(sink_chunks));
    if (block_rows < 32 || block_rows > 4096) bad("block_rows must be in [32, 4096], got " + std::to_string(block_rows));
    if (chunk_tokens <= 0) bad("the pool's chunk_tokens must be positive");
}

SparseIndex::SparseIndex(ggml_backend_t backend, const SparseParams & p, int64_t chunk_tokens, int64_t n_chunks,
                         int64_t max_row_width, int64_t kv_pad)
    : p_(p), C_(chunk_tokens), n_chunks_(std::max<int64_t>(n_chunks, 1)) {
    p_.check(C_);
    ggml_init_params ip{2 * ggml_tensor_overhead(), nullptr, true};
    ctx_ = ggml_init(ip);
    means_ = ggml_new_tensor_1d(ctx_, GGML_TYPE_F32, max_row_width * n_chunks_);
    zeros_ = ggml_new_tensor_1d(ctx_, GGML_TYPE_I32, C_ * std::max<int64_t>(max_row_width, 1));
    buf_ = ggml_backend_alloc_ctx_tensors(ctx_, backend);
    if (!buf_) {
        ggml_free(ctx_);
        throw std::runtime_error("could not allocate the sparse prefill's chunk means (" +
                                 std::to_string(max_row_width * n_chunks_ * 4) + " bytes)");
    }
    ggml_backend_buffer_clear(buf_, 0);
    band_ = std::make_unique<CausalBand>(backend, band_span(p_, C_), p_.block_rows, kv_pad);
}

SparseIndex::~SparseIndex() {
    band_.reset();
    ggml_backend_buffer_free(buf_);
    ggml_free(ctx_);
}

int64_t SparseIndex::device_bytes() const { return (int64_t) ggml_backend_buffer_get_size(buf_) + band_->device_bytes(); }

SparseIndex::Block SparseIndex::block(int64_t q0) const {
    const int64_t cl = std::max<int64_t>(0, q0 / C_ - p_.local_chunks) / k_window_align * k_window_align;
    return {cl, cl - p_.sink_chunks >= p_.top_chunks};   // equal: chooses them all (the tests' exact check)
}

ggml_tensor * summarize_chunks(GraphCtx & g, const PooledKV & kv, int64_t kl, int64_t head_dim, int64_t first_pos,
                               int64_t n_tokens) {
    ggml_context * ctx = g.ctx;
    const SparseIndex & ix = *g.sparse.index;
    const int64_t C = ix.chunk_tokens(), c0 = g.sparse.summarize_from, c1 = (first_pos + n_tokens + C - 1) / C;
    ggml_tensor * k = kv.k(kl);   // [row_width, pool_tokens]: slot j holds position j
    const int64_t row_width = k->ne[0], n_head_kv = row_width / head_dim;
    if (c1 > ix.n_chunks() || c1 * C > k->ne[1]) throw std::logic_error("summarize_chunks: chunks past the staging pool");
    ggml_tensor * rows = ggml_cast(ctx, ggml_view_2d(ctx, k, row_width, (c1 - c0) * C, k->nb[1], c0 * C * k->nb[1]),
                                   GGML_TYPE_F32);
    ggml_tensor * means = ggml_pool_2d(ctx, rows, GGML_OP_POOL_AVG, 1, (int) C, 1, (int) C, 0, 0);   // [row_width, c1 - c0]
    means = ggml_permute(ctx, ggml_reshape_3d(ctx, means, head_dim, n_head_kv, c1 - c0), 0, 2, 1, 3);
    ggml_tensor * m = ix.means();
    ggml_tensor * dst = ggml_view_3d(ctx, m, head_dim, c1 - c0, n_head_kv, head_dim * m->nb[0], ix.n_chunks() * head_dim * m->nb[0],
                                     c0 * head_dim * m->nb[0]);
    return ggml_cpy(ctx, means, dst);
}

namespace {

// The chosen chunks' rows of a staging pool tensor (K or V, [row_width, pool_tokens]), per head: pool viewed as
// [head_dim, far chunk, token in chunk, head] from chunk `first`, chosen [top, C, n_head_kv] -> F32 [head_dim,
// top x C, n_head_kv] (key order within a head does not matter: every far key is seen by every query).
ggml_tensor * gather_chunks(ggml_context * ctx, ggml_tensor * pool, int64_t head_dim, int64_t C, int64_t first,
                            int64_t n_chunks, ggml_tensor * chosen) {
    const int64_t n_head_kv = pool->ne[0] / head_dim, top = chosen->ne[0];
    ggml_tensor * src = ggml_view_4d(ctx, pool, head_dim, n_chunks, C, n_head_kv, C * pool->nb[1], pool->nb[1],
                                     ggml_row_size(pool->type, head_dim), first * C * pool->nb[1]);
    return ggml_reshape_3d(ctx, ggml_get_rows(ctx, src, chosen), head_dim, top * C, n_head_kv);
}

// Positions [p0, p1) of a staging pool tensor as F32 [head_dim, p1 - p0, n_head_kv].
ggml_tensor * span_f32(ggml_context * ctx, ggml_tensor * pool, int64_t head_dim, int64_t p0, int64_t p1) {
    ggml_tensor * v = ggml_view_3d(ctx, pool, head_dim, pool->ne[0] / head_dim, p1 - p0, ggml_row_size(pool->type, head_dim),
                                   pool->nb[1], p0 * pool->nb[1]);
    return ggml_cast(ctx, ggml_permute(ctx, v, 0, 2, 1, 3), GGML_TYPE_F32);
}

}  // namespace

ggml_tensor * sparse_attend_block(GraphCtx & g, const PooledKV & kv, int64_t kl, ggml_tensor * qb, int64_t q0,
                                  int64_t head_dim_v, float kq_scale, int64_t n_lse_rows, ggml_tensor ** lse) {
    const SparseIndex & ix = *g.sparse.index;
    const SparseIndex::Block blk = ix.block(q0);
    if (!blk.sparse) return nullptr;
    ggml_context * ctx = g.ctx;
    const SparseParams & p = ix.params();
    const int64_t C = ix.chunk_tokens(), head_dim = qb->ne[0], n = qb->ne[1], n_head = qb->ne[2];
    ggml_tensor * kpool = kv.k(kl), * vpool = kv.v(kl);
    const int64_t n_head_kv = kpool->ne[0] / head_dim, group = n_head / n_head_kv;
    const int64_t first = p.sink_chunks, n_far = blk.window_chunk - first;
    const int64_t win0 = blk.window_chunk * C, kv_end = ix.band().keys_seen(q0 + n - 1, kpool->ne[1]);

    // The block's mean query per KV head: over its queries, then over the group's query heads.
    ggml_tensor * qmean = ggml_pool_2d(ctx, ggml_cont(ctx, qb), GGML_OP_POOL_AVG, 1, (int) n, 1, (int) n, 0, 0);
    qmean = ggml_pool_2d(ctx, ggml_reshape_3d(ctx, qmean, head_dim, group, n_head_kv), GGML_OP_POOL_AVG, 1, (int) group,
                         1, (int) group, 0, 0);   // [head_dim, 1, n_head_kv]
    ggml_tensor * m = ix.means();
    ggml_tensor * means = ggml_view_3d(ctx, m, head_dim, n_far, n_head_kv, head_dim * m->nb[0], ix.n_chunks() * head_dim * m->nb[0],
                                       first * head_dim * m->nb[0]);
    ggml_tensor * scores = ggml_mul_mat(ctx, means, qmean);   // [n_far, 1, n_head_kv]
    ggml_tensor * top = ggml_top_k(ctx, ggml_reshape_2d(ctx, scores, n_far, n_head_kv), (int) p.top_chunks);
    // Each chosen chunk index repeated for the chunk's C tokens: get_rows of row 0, C times (ggml has no I32 repeat).
    ggml_tensor * chosen = ggml_get_rows(ctx, ggml_reshape_3d(ctx, top, p.top_chunks, 1, n_head_kv),
                                         ggml_view_2d(ctx, ix.zeros(), C, n_head_kv, C * ix.zeros()->nb[0], 0));

    // [hd, n_keys, n_head_kv] in the pool's type: far | sink | window. The F32 rows go back to the pool's type
    // (a quantized row requantizes to its own bytes: its largest value sets the same scale), so flash attention
    // takes the kernels and precision it takes for the exact prefill's keys.
    const auto keys = [&](ggml_tensor * pool, int64_t hd) {
        ggml_tensor * all = ggml_concat(ctx, gather_chunks(ctx, pool, hd, C, first, n_far, chosen),
                                        span_f32(ctx, pool, hd, 0, first * C), 1);
        return ggml_cast(ctx, ggml_concat(ctx, all, span_f32(ctx, pool, hd, win0, kv_end), 1), pool->type);
    };
    ggml_tensor * k_all = keys(kpool, head_dim), * v_all = keys(vpool, head_dim_v);
    // The far and sink keys stand as the positions just before the window: all before every query of the block.
    const int64_t origin = win0 - (p.top_chunks + first) * C, n_keys = k_all->ne[1];
    ggml_tensor * mask = ix.band().mask(ctx, n_keys, n, q0 - origin);
    if (n_lse_rows > 0) {
        const int64_t r0 = n - n_lse_rows;
        ggml_tensor * q_last = ggml_view_3d(ctx, qb, head_dim, n_lse_rows, n_head, qb->nb[1], qb->nb[2], r0 * qb->nb[1]);
        *lse = attention_lse(ctx, q_last, k_all, ix.band().mask(ctx, n_keys, n_lse_rows, q0 + r0 - origin), kq_scale, n_keys);
    }
    ggml_tensor * o = ggml_flash_attn_ext(ctx, qb, k_all, v_all, mask, kq_scale, 0.0f, 0.0f);   // [head_dim_v, n_head, n]
    ggml_prec_set_acc(o, GGML_PREC_F32);
    return ggml_reshape_2d(ctx, o, head_dim_v * n_head, n);
}

KvMaskRows sparse_dense_mask(ggml_context * ctx, const SparseIndex & index, int64_t q0, int64_t n, int64_t n_kv) {
    const int64_t seen = index.band().keys_seen(q0 + n - 1, n_kv);
    return {index.band().mask(ctx, seen, n, q0), seen};
}

}  // namespace kvf
