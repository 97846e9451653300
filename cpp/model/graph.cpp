#include "model/graph.h"

#include "kv/kv_graph.h"
#include "model/ffn.h"
#include "model/gguf_meta.h"
#include "model/quant_matmul.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace kvf {

ggml_tensor * rms_norm(GraphCtx & g, ggml_tensor * x, ggml_tensor * weight, float eps) {
    return ggml_mul(g.ctx, ggml_rms_norm(g.ctx, x, eps), weight);
}

namespace {

// Types whose ggml CPU product takes its tiled kernels from 8 columns on (ggml-cpu/tiled: ggml_tiled_supported), with
// other sums than the dot product it takes for fewer.
bool tiled_from_8_columns(ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q2_K: case GGML_TYPE_Q3_K: case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K:
        case GGML_TYPE_IQ4_XS: case GGML_TYPE_IQ2_XXS: case GGML_TYPE_IQ2_XS: case GGML_TYPE_IQ2_S:
        case GGML_TYPE_IQ3_XXS: case GGML_TYPE_IQ3_S: case GGML_TYPE_IQ1_S: case GGML_TYPE_IQ1_M:
            return true;
        default:
            return false;
    }
}

// A weight product of a step with one-token kernels (GraphCtx::one_token_kernels): each output as a one-token step
// computes it where ggml's several-column kernels sum otherwise. F16 weights go through f16_mul_mat (ggml takes
// tinyBLAS from 2 columns); the tiled types 7 columns at a time (ggml's dot product below 8: Gemma 3 270M's Q4_K
// and Q6_K layers differed by up to 1.0 in a logit at 8 tokens and more). The other types' products are the dot
// product's already at any column count (Q4_1 and Q8_0 through quant_mul_mat; tinyBLAS's Q4_0 and Q5_0 measured
// equal) or are left as ggml computes them (F32 and BF16 weights: tinyBLAS from 2 columns).
ggml_tensor * one_token_weights(GraphCtx & g, ggml_tensor * w, ggml_tensor * x) {
    if (w->type == GGML_TYPE_F16 && f16_mul_mat_usable()) return f16_mul_mat(g.ctx, w, x);
    constexpr int64_t k_cols = 7;
    if (!tiled_from_8_columns(w->type) || x->ne[1] <= k_cols) return ggml_mul_mat(g.ctx, w, x);
    ggml_tensor * out = nullptr;
    for (int64_t c0 = 0; c0 < x->ne[1]; c0 += k_cols) {
        const int64_t nc = std::min(k_cols, x->ne[1] - c0);
        ggml_tensor * o = ggml_mul_mat(g.ctx, w, ggml_view_2d(g.ctx, x, x->ne[0], nc, x->nb[1], c0 * x->nb[1]));
        out = out ? ggml_concat(g.ctx, out, o, 1) : o;
    }
    return out;
}

}  // namespace

ggml_tensor * mul_mat_weights(GraphCtx & g, ggml_tensor * w, ggml_tensor * x) {
    // several tokens' F32 activations times 2-D weights in host memory (plain blocks, not repacked)
    const bool several = x->type == GGML_TYPE_F32 && x->ne[1] >= 2 && x->ne[2] == 1 && x->ne[3] == 1 &&
                         x->nb[0] == sizeof(float) && w->ne[2] == 1 && w->ne[3] == 1 && w->buffer &&
                         ggml_backend_buffer_is_host(w->buffer) && !w->extra;
    if (several && (w->type == GGML_TYPE_Q4_1 || w->type == GGML_TYPE_Q8_0) && quant_mul_mat_usable(w->type)) {
        const ggml_type type = quant_mul_mat_input_type(w->type);
        ggml_tensor *& xq = g.quantized_inputs[{x, type}];
        if (!xq) xq = ggml_cpy(g.ctx, x, ggml_new_tensor_2d(g.ctx, type, x->ne[0], x->ne[1]));
        return quant_mul_mat(g.ctx, w, xq);
    }
    if (several && g.one_token_kernels) return one_token_weights(g, w, x);
    return ggml_mul_mat(g.ctx, w, x);
}

void load_moe_ffn(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il, bool shared_gate) {
    const std::string p = "blk." + std::to_string(il) + ".";
    const int64_t E = hp.n_expert, F = hp.n_ff_exp;
    w.ffn_gate_inp = src.require(p + "ffn_gate_inp.weight", {hp.n_embd, E});
    w.ffn_gate_up_exps = src.optional(p + "ffn_gate_up_exps.weight", {hp.n_embd, 2 * F, E});
    if (!w.ffn_gate_up_exps) {
        w.ffn_gate_exps = src.require(p + "ffn_gate_exps.weight", {hp.n_embd, F, E});
        w.ffn_up_exps = src.require(p + "ffn_up_exps.weight", {hp.n_embd, F, E});
    }
    w.ffn_down_exps = src.require(p + "ffn_down_exps.weight", {F, hp.n_embd, E});
    if (hp.n_ff_shexp > 0) {
        if (shared_gate) w.ffn_gate_inp_shexp = src.require(p + "ffn_gate_inp_shexp.weight", {hp.n_embd});
        w.ffn_gate_shexp = src.require(p + "ffn_gate_shexp.weight", {hp.n_embd, hp.n_ff_shexp});
        w.ffn_up_shexp = src.require(p + "ffn_up_shexp.weight", {hp.n_embd, hp.n_ff_shexp});
        w.ffn_down_shexp = src.require(p + "ffn_down_shexp.weight", {hp.n_ff_shexp, hp.n_embd});
    }
}

bool read_sliding_window(const gguf_context * g, ModelHparams & hp, int64_t period, bool global_first) {
    const std::string a = hp.arch + ".";
    int64_t n_swa = 0;
    if (!meta_int(g, a + "attention.sliding_window", 0, INT32_MAX, n_swa) || n_swa == 0) return false;
    hp.n_swa = n_swa;
    // One flag per layer, or a period: one global layer in each, the first or the last of it.
    const std::string pattern = a + "attention.sliding_window_pattern";
    const int64_t id = gguf_find_key(g, pattern.c_str());
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_ARRAY || !meta_bool_array(g, pattern, hp.n_layer, hp.swa_layers)) {
        meta_int(g, pattern, 0, INT32_MAX, period);
        hp.swa_layers.assign((size_t) hp.n_layer, 0);
        for (int64_t il = 0; il < hp.n_layer; ++il) {
            hp.swa_layers[(size_t) il] = period == 0 || (global_first ? il % period != 0 : il % period < period - 1);
        }
    }
    if (meta_float(g, a + "rope.freq_base_swa", hp.rope_freq_base_swa) && !(hp.rope_freq_base_swa >= 1.0f)) {
        throw std::runtime_error("GGUF " + a + "rope.freq_base_swa must be >= 1");
    }
    if (hp.n_pooled_layers() == 0) {
        throw std::runtime_error("GGUF " + pattern + " leaves no global layer: nothing to pool");
    }
    return true;
}

void read_moe_hparams(const gguf_context * g, ModelHparams & hp, bool shared_expert) {
    const std::string a = hp.arch + ".";
    hp.n_expert = meta_require_int(g, a + "expert_count", 1, 4096);
    hp.n_expert_used = meta_require_int(g, a + "expert_used_count", 1, hp.n_expert);
    // libllama's defaults when a file leaves the expert sizes out: n_ff / n_expert_used, and n_ff.
    hp.n_ff_exp = hp.n_ff > 0 ? hp.n_ff / hp.n_expert_used : 0;
    meta_int(g, a + "expert_feed_forward_length", 1, INT32_MAX, hp.n_ff_exp);
    if (hp.n_ff_exp <= 0) throw std::runtime_error("GGUF has neither " + a + "expert_feed_forward_length nor " + a + "feed_forward_length");
    if (shared_expert) {
        hp.n_ff_shexp = hp.n_ff;
        meta_int(g, a + "expert_shared_feed_forward_length", 1, INT32_MAX, hp.n_ff_shexp);
        if (hp.n_ff_shexp <= 0) {
            throw std::runtime_error("GGUF has neither " + a + "expert_shared_feed_forward_length nor " + a + "feed_forward_length");
        }
    }
}

ggml_tensor * project_heads(GraphCtx & g, ggml_tensor * w, ggml_tensor * b, ggml_tensor * x, int64_t head_dim,
                            int64_t n_heads) {
    ggml_tensor * y = mul_mat_weights(g, w, x);
    if (b) y = ggml_add(g.ctx, y, b);
    return ggml_reshape_3d(g.ctx, y, head_dim, n_heads, g.n_tokens);
}

ggml_tensor * rope(GraphCtx & g, const Model & m, int il, ggml_tensor * x) {
    const ModelHparams & hp = m.hparams();
    if (hp.is_swa(il)) {   // plain RoPE of its own (no YaRN on a window the model was trained at)
        return ggml_rope_ext(g.ctx, x, g.in.positions, m.rope_freqs_of(il), (int) hp.n_rot_swa, hp.rope_type, (int) hp.n_ctx_train,
                             hp.rope_freq_base_swa, hp.rope_freq_scale_swa, 0.0f, 1.0f, 0.0f, 0.0f);
    }
    return rope_global(g, m, il, x);
}

ggml_tensor * rope_global(GraphCtx & g, const Model & m, int64_t il, ggml_tensor * x) {
    const ModelHparams & hp = m.hparams();
    return ggml_rope_ext(g.ctx, x, g.in.positions, m.rope_freqs_of(il), (int) hp.n_rot, hp.rope_type, (int) hp.n_ctx_orig_yarn,
                         hp.rope_freq_base, hp.rope_freq_scale, hp.rope_ext_factor, hp.rope_attn_factor,
                         hp.yarn_beta_fast, hp.yarn_beta_slow);
}

namespace {

// Max over heads of x F32 [n_kv, n_q, n_head]: F32 [n_kv, n_q].
ggml_tensor * head_max(ggml_context * ctx, ggml_tensor * x) {
    const int64_t n_kv = x->ne[0], n_q = x->ne[1], n_head = x->ne[2];
    // Heads into ne0, then a max pool as wide as the heads: ggml has no max-reduction op, and pool_2d
    // runs on CPU and CUDA alike (the greedy argmax uses it the same way).
    ggml_tensor * heads = ggml_cont(ctx, ggml_permute(ctx, x, 1, 2, 0, 3));   // [n_head, n_kv, n_q]
    ggml_tensor * rows = ggml_reshape_2d(ctx, heads, n_head, n_kv * n_q);
    ggml_tensor * best = ggml_pool_2d(ctx, rows, GGML_OP_POOL_MAX, (int) n_head, 1, (int) n_head, 1, 0, 0);   // [1, n_kv * n_q]
    return ggml_reshape_2d(ctx, best, n_kv, n_q);
}

// Keeps a captured attention F32 [n_kv, n_attn_tokens] as a graph output, for the drafter scorer.
void keep_capture(GraphCtx & g, ggml_tensor * best) {
    ggml_set_output(best);
    ggml_build_forward_expand(g.gf, best);
    g.attn.push_back(best);
}

// Softmaxed attention of the last n_attn_tokens queries, max over heads: kq F32 [n_kv, n_tokens, n_head].
void capture_head_max(GraphCtx & g, ggml_tensor * kq) {
    const int64_t n_q = g.n_attn_tokens;
    keep_capture(g, head_max(g.ctx, ggml_view_3d(g.ctx, kq, kq->ne[0], n_q, kq->ne[2], kq->nb[1], kq->nb[2],
                                                 (kq->ne[1] - n_q) * kq->nb[1])));
}

// F32 [nk, n_q, n_head]: q's scores against keys [k0, k0 + nk) of kp, scaled, under those columns of mask [>= n_kv, n_q].
ggml_tensor * masked_scores(ggml_context * ctx, ggml_tensor * q, ggml_tensor * kp, ggml_tensor * mask, float kq_scale,
                            int64_t k0, int64_t nk) {
    ggml_tensor * kb = ggml_view_3d(ctx, kp, kp->ne[0], nk, kp->ne[2], kp->nb[1], kp->nb[2], k0 * kp->nb[1]);
    ggml_tensor * kq = ggml_mul_mat(ctx, kb, q);
    ggml_prec_set_acc(kq, GGML_PREC_F32);
    ggml_tensor * m = ggml_cast(ctx, ggml_view_2d(ctx, mask, nk, q->ne[1], mask->nb[1], k0 * mask->nb[0]), GGML_TYPE_F32);
    return ggml_add(ctx, ggml_scale(ctx, kq, kq_scale), m);
}

// [1, n_q, n_head]: max over ne0 of x (contiguous).
ggml_tensor * row_max(ggml_context * ctx, ggml_tensor * x) {
    ggml_tensor * rows = ggml_reshape_2d(ctx, x, x->ne[0], x->ne[1] * x->ne[2]);
    // pool_2d gives each output one thread: over a block's 32K keys in one pass, n_q x n_head threads scanned
    // them all (0.6 s of a 128K prefill on an H100, R92); through 256-key partial maxima first, every key's
    // pass is parallel. A max is exact whatever the order.
    constexpr int64_t part = 256;
    if (rows->ne[0] % part == 0 && rows->ne[0] > part) {
        rows = ggml_pool_2d(ctx, rows, GGML_OP_POOL_MAX, (int) part, 1, (int) part, 1, 0, 0);   // [keys / part, rows]
    }
    ggml_tensor * m = ggml_pool_2d(ctx, rows, GGML_OP_POOL_MAX, (int) rows->ne[0], 1, (int) rows->ne[0], 1, 0, 0);
    // A row every key of the block masks: a finite max keeps exp(-inf - max) at 0 instead of NaN.
    return ggml_clamp(ctx, ggml_reshape_3d(ctx, m, 1, x->ne[1], x->ne[2]), -1e30f, INFINITY);
}

ggml_tensor * log_sum_exp(ggml_context * ctx, ggml_tensor * x) {   // [1, n_q, n_head]
    ggml_tensor * m = row_max(ctx, x);
    return ggml_add(ctx, ggml_log(ctx, ggml_sum_rows(ctx, ggml_exp(ctx, ggml_sub(ctx, x, m)))), m);
}

}  // namespace

ggml_tensor * attention_lse(ggml_context * ctx, ggml_tensor * q, ggml_tensor * kp, ggml_tensor * mask, float kq_scale,
                            int64_t keys_per_block) {
    const int64_t n_kv = kp->ne[1];
    ggml_tensor * lse = nullptr;   // [n_blocks, n_q, n_head], then [1, n_q, n_head]
    for (int64_t k0 = 0; k0 < n_kv; k0 += keys_per_block) {
        ggml_tensor * l = log_sum_exp(ctx, masked_scores(ctx, q, kp, mask, kq_scale, k0, std::min(keys_per_block, n_kv - k0)));
        lse = lse ? ggml_concat(ctx, lse, l, 0) : l;
    }
    return lse->ne[0] == 1 ? lse : log_sum_exp(ctx, lse);
}

namespace {

// The flash path never materialises its probabilities: the captured queries' attention is computed apart,
// from qp [head_dim, n_rows, n_head] (the last block's queries), kp [head_dim, n_kv, n_head_kv] and mask
// [n_kv, n_rows]. One softmax over all keys ([n_kv, n_q, n_head] F32, twice: 256 MiB at 128K on an 8B model)
// unless keys_per_block < n_kv: then two passes over blocks of keys, the first taking each block's
// log-sum-exp per query and head (attention_lse), the second each block's probabilities against their total, so
// no buffer holds more than a block.
void capture_flash(GraphCtx & g, ggml_tensor * qp, ggml_tensor * kp, ggml_tensor * mask, float kq_scale,
                   int64_t keys_per_block) {
    ggml_context * ctx = g.ctx;
    const int64_t n_q = g.n_attn_tokens, off = qp->ne[1] - n_q, n_kv = kp->ne[1];
    ggml_tensor * q_last = ggml_view_3d(ctx, qp, qp->ne[0], n_q, qp->ne[2], qp->nb[1], qp->nb[2], off * qp->nb[1]);
    ggml_tensor * mask_last = ggml_view_2d(ctx, mask, mask->ne[0], n_q, mask->nb[1], off * mask->nb[1]);
    if (keys_per_block >= n_kv) {
        ggml_tensor * kq = ggml_mul_mat(ctx, kp, q_last);   // [n_kv, n_q, n_head]
        ggml_prec_set_acc(kq, GGML_PREC_F32);
        // soft_max wants a contiguous mask of exactly n_kv columns; a band's rows are wider (kv_step_inputs.h)
        ggml_tensor * m = ggml_view_2d(ctx, mask_last, n_kv, n_q, mask_last->nb[1], 0);
        if (!ggml_is_contiguous(m)) m = ggml_cont(ctx, m);
        keep_capture(g, head_max(ctx, ggml_soft_max_ext(ctx, kq, m, kq_scale, 0.0f)));
        return;
    }
    ggml_tensor * lse = attention_lse(ctx, q_last, kp, mask_last, kq_scale, keys_per_block);
    ggml_tensor * best = nullptr;
    for (int64_t k0 = 0; k0 < n_kv; k0 += keys_per_block) {
        const int64_t nk = std::min(keys_per_block, n_kv - k0);
        ggml_tensor * p = ggml_exp(ctx, ggml_sub(ctx, masked_scores(ctx, q_last, kp, mask_last, kq_scale, k0, nk), lse));
        ggml_tensor * b = head_max(ctx, p);
        best = best ? ggml_concat(ctx, best, b, 0) : b;
    }
    keep_capture(g, best);
}

constexpr int64_t k_min_query_block = 32;   // at least the scorers' captured queries (k_capture_tokens)
constexpr int64_t k_min_key_block = 64;

struct QueryBlock {
    int64_t row0, n;
};

}  // namespace

int64_t attention_block_rows(int64_t n_slots, int64_t bytes_per_key, int64_t block_bytes) {
    return std::clamp(block_bytes / (std::max<int64_t>(n_slots, 1) * bytes_per_key), k_min_query_block, k_max_query_block);
}

int64_t attention_bytes_per_key(bool flash_attn, int64_t n_head) {
    return sizeof(ggml_fp16_t) + (flash_attn ? 0 : 2 * n_head * sizeof(float));
}

namespace {

// The blocks of a step's n queries: one unless the mask is made per block (or one_query: a block per query);
// then sparse_rows (a sparse prefill's blocks: each chooses its chunks) or as many queries per block as block_bytes
// allows at bytes_per_key per query and key of the band's whole pool (at most k_max_query_block), the last block
// whole (it holds the captured queries). Sized by the pool, not by the step's keys, every step of a layer has as
// many blocks, so its graphs have as many nodes: ggml's allocator keeps the layer's reservation
// only for such graphs, and re-reserving makes the host wait for the device (once per step at 128K, when a
// layer's later steps had more blocks than its first).
std::vector<QueryBlock> query_blocks(const KvStepInputs & in, int64_t n, int64_t bytes_per_key, int64_t block_bytes,
                                     bool one_query, int64_t sparse_rows) {
    if (!in.band && one_query) {
        std::vector<QueryBlock> blocks;
        for (int64_t row0 = 0; row0 < n; ++row0) blocks.push_back({row0, 1});
        return blocks;
    }
    if (!in.band) return {{0, n}};
    const int64_t per_block = sparse_rows > 0 ? sparse_rows : attention_block_rows(in.band->n_slots(), bytes_per_key, block_bytes);
    const int64_t first = n - (n - 1) / per_block * per_block;   // the short block goes first
    std::vector<QueryBlock> blocks = {{0, first}};
    for (int64_t row0 = first; row0 < n; row0 += per_block) blocks.push_back({row0, per_block});
    return blocks;
}

// Blocks' outputs [w, n_b] stacked along rows into [w, sum of n_b]. A chain of concats copies the rows stacked so far
// again at every block (k(k+1)/2 - 1 blocks' worth for k equal ones: 1.2 s of a 256K exact prefill's 94 at 8 blocks
// a step, H100, R95), and each concat holds two blocks' outputs at once: over a quantized pool ggml-cuda's flash
// attention allocates an F16 copy of the keys and values it reads inside its output (fattn-common.cuh: 4 KB a key
// on the 8B shape, 4 GiB for a dense block at 1M). So F32 blocks are stacked in place: the first padded to the whole
// (one pass), each other one set into it (one copy each), each freed as soon as it is set.
ggml_tensor * stack_rows(ggml_context * ctx, const std::vector<ggml_tensor *> & parts) {
    const bool settable = parts.size() >= 2 && std::all_of(parts.begin(), parts.end(), [](const ggml_tensor * t) {
        return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t);
    });
    if (!settable) {
        ggml_tensor * out = parts.front();
        for (size_t i = 1; i < parts.size(); ++i) out = ggml_concat(ctx, out, parts[i], 1);
        return out;
    }
    int64_t n = 0;
    for (const ggml_tensor * t : parts) n += t->ne[1];
    ggml_tensor * out = ggml_pad(ctx, parts.front(), 0, (int) (n - parts.front()->ne[1]), 0, 0);
    int64_t row0 = parts.front()->ne[1];
    for (size_t i = 1; i < parts.size(); ++i) {
        out = ggml_set_2d_inplace(ctx, out, parts[i], out->nb[1], row0 * out->nb[1]);
        row0 += parts[i]->ne[1];
    }
    return out;
}

// Over a quantized pool ggml-cuda's flash attention for more than 2 queries (its tile and tensor-core kernels) reads
// F16 only: it converts every key and value the call reads into a copy inside its output (fattn-common.cuh), 4 KB a
// key on the 8B shape, 4 GiB for a block over 1M keys. Its vector kernel reads q8_0 / q4_0 as they are, for at most 2
// queries a call. So a block whose copy would pass the attention budget attends its queries a pair per call: no copy,
// each pair reading the keys once. Worth it where a layer attends so once, O(length) reads: a sparse prefill's dense
// last step (attend; ggml's views cannot broadcast one K over lanes along ne3, as attend_lanes' arena lanes do).
bool pair_queries(const GraphCtx & g, const PooledKV & kv, int64_t kl, int64_t n_kv, int64_t head_dim_k,
                  int64_t head_dim_v) {
    if (!g.flash_attn || !g.sparse.dense) return false;
    if (!ggml_is_quantized(kv.k(kl)->type) && !ggml_is_quantized(kv.v(kl)->type)) return false;
    // The vector kernel's heads (64, 128, 256; K as wide as V) and whole 256-key tiles (FATTN_KQ_STRIDE; a flash
    // attention session pads its keys so). Elsewhere ggml-cuda would copy every key for every pair: worse than a block.
    if (head_dim_k != head_dim_v || head_dim_k > 256 || head_dim_k % 64 != 0 || n_kv % 256 != 0) return false;
    const int64_t f16_copy = n_kv * (kv.layout().n_embd_k + kv.layout().n_embd_v) * (int64_t) sizeof(ggml_fp16_t);
    return f16_copy > g.attention_block_bytes;
}

// qb [head_dim_k, n, n_head], kp / vp [head_dim, n_kv, n_head_kv], mask F16 [>= n_kv, n] contiguous: flash attention
// [head_dim_v * n_head, n], a call per pair of queries (an odd first one alone): pair_queries says why.
ggml_tensor * flash_attn_pairs(ggml_context * ctx, ggml_tensor * qb, ggml_tensor * kp, ggml_tensor * vp,
                               ggml_tensor * mask, float kq_scale) {
    const int64_t n = qb->ne[1];
    std::vector<ggml_tensor *> parts;
    for (int64_t row0 = 0; row0 < n;) {
        const int64_t nr = row0 == 0 && n % 2 ? 1 : 2;
        ggml_tensor * q = ggml_view_3d(ctx, qb, qb->ne[0], nr, qb->ne[2], qb->nb[1], qb->nb[2], row0 * qb->nb[1]);
        ggml_tensor * m = ggml_view_2d(ctx, mask, mask->ne[0], nr, mask->nb[1], row0 * mask->nb[1]);
        ggml_tensor * o = ggml_flash_attn_ext(ctx, q, kp, vp, m, kq_scale, 0.0f, 0.0f);   // [head_dim_v, n_head, nr]
        ggml_prec_set_acc(o, GGML_PREC_F32);
        parts.push_back(ggml_reshape_2d(ctx, o, vp->ne[0] * qb->ne[2], nr));
        row0 += nr;
    }
    return stack_rows(ctx, parts);
}

// t [a, b, c] as [a, b, c, n] whose every ne3 index holds the same bytes (stride 0, set after the view is made: ggml
// sizes a view as if contiguous): one K or V for every sequence of a flash attention call.
ggml_tensor * repeat_along_ne3(ggml_context * ctx, ggml_tensor * t, int64_t n) {
    ggml_tensor * v = ggml_view_4d(ctx, t, t->ne[0], t->ne[1], t->ne[2], 1, t->nb[1], t->nb[2], t->nb[2] * t->ne[2], 0);
    v->ne[3] = n;
    v->nb[3] = 0;
    return v;
}

// How many of a band step's blocks of queries from blocks[i] on share one flash attention call (attend_block_group):
// whole blocks of the band's rows, up to the band's group (which the pass sets above 1 only for flash attention over
// F16 K/V in a dense pass: session_prefill.cpp); else 1.
size_t blocks_in_group(const KvStepInputs & in, const ggml_tensor * q, const std::vector<QueryBlock> & blocks, size_t i) {
    if (!in.band || in.band->max_group() < 2 || !ggml_is_contiguous(q) || blocks[i].n != in.band->max_rows()) return 1;
    size_t n = 1;
    while (i + n < blocks.size() && n < (size_t) in.band->max_group() && blocks[i + n].n == blocks[i].n) ++n;
    return n;
}

// Blocks [row0 + b n_rows, row0 + (b + 1) n_rows) for b < n_blocks of a band step's queries q [head_dim_k, n_head, n]
// in one flash attention call, the blocks along ne3 (the latest first, as CausalBand::group_mask's mask), over kp / vp
// [head_dim, n_kv, n_head_kv] (the keys the latest block sees; an earlier block's mask hides the rest). ggml-cuda then
// runs the tiles of one call of n_blocks x n_rows queries over one block's rows of mask table: at 256K on the H100,
// 8 blocks of 64 queries a call took 67.9 s of flash attention, libllama's 512-query calls 67.8 and a call per
// 128-query block 71.9 (R124), where a 512-query call of its own would need a 256 MiB table (R115). 1024-query calls
// (8 x 128, R117) were no faster than a call per block: hence at most k_max_query_block queries a call.
// Returns [head_dim_v * n_head, n_blocks * n_rows], in position order.
ggml_tensor * attend_block_group(ggml_context * ctx, const CausalBand & band, ggml_tensor * q, ggml_tensor * kp,
                                 ggml_tensor * vp, int64_t row0, int64_t n_rows, int64_t n_blocks, int64_t first_pos,
                                 int64_t n_kv, float kq_scale) {
    const int64_t head_dim = q->ne[0], n_head = q->ne[1], n = n_blocks * n_rows;
    ggml_tensor * order = band.block_order(ctx, n_blocks);
    ggml_tensor * q2 = ggml_reshape_2d(ctx, q, head_dim * n_head, q->ne[2]);
    q2 = ggml_get_rows(ctx, ggml_view_2d(ctx, q2, q2->ne[0], n, q2->nb[1], row0 * q2->nb[1]), order);
    ggml_tensor * qg = ggml_permute(ctx, ggml_reshape_4d(ctx, q2, head_dim, n_head, n_rows, n_blocks), 0, 2, 1, 3);
    ggml_tensor * mask = band.group_mask(ctx, n_kv, n_rows, first_pos, n_blocks);
    ggml_tensor * o = ggml_flash_attn_ext(ctx, qg, repeat_along_ne3(ctx, kp, n_blocks), repeat_along_ne3(ctx, vp, n_blocks),
                                          mask, kq_scale, 0.0f, 0.0f);   // [head_dim_v, n_head, n_rows, n_blocks]
    CausalBand::as_sequences(mask, n_rows, n_blocks);
    ggml_prec_set_acc(o, GGML_PREC_F32);
    return ggml_get_rows(ctx, ggml_reshape_2d(ctx, o, vp->ne[0] * n_head, n), order);   // the order is its own inverse
}

// Writes k and v of the step's tokens into layer kl of `kv` and attends its first n_kv slots under `in`:
// q, k, v [head_dim, n_heads, n]; returns [head_dim_v * n_head, n]. k and v nullptr: the layer writes
// nothing and attends what an earlier layer of the graph wrote into kl (gemma4's shared K/V, whose V heads
// are as wide as its K heads). capture_attn: keep the last queries' attention for the drafter scorer (one
// sequence only).
ggml_tensor * attend(GraphCtx & g, const PooledKV & kv, const KvStepInputs & in, int64_t kl, int64_t n_kv,
                     ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float kq_scale, bool capture_attn) {
    ggml_context * ctx = g.ctx;
    const int64_t head_dim_k = q->ne[0], head_dim_v = v ? v->ne[0] : head_dim_k, n_head = q->ne[1], n = q->ne[2];
    if (k) ggml_build_forward_expand(g.gf, cpy_k(ctx, kv, in, kl, k));
    if (v) ggml_build_forward_expand(g.gf, cpy_v(ctx, kv, in, kl, v));
    const SparseIndex * index = in.band ? g.sparse.index : nullptr;   // a sparse prefill's pooled layer
    if (index && !g.flash_attn) throw std::logic_error("attend: a sparse prefill needs flash attention");
    if (index && k) ggml_build_forward_expand(g.gf, summarize_chunks(g, kv, kl, head_dim_k, in.first_pos, n));
    const SparseIndex * sparse = g.sparse.dense ? nullptr : index;   // its blocks choose their keys
    ggml_tensor * qp = ggml_permute(ctx, q, 0, 2, 1, 3);   // [head_dim_k, n, n_head]
    const int64_t bytes_per_key = attention_bytes_per_key(g.flash_attn, n_head);
    // The pool's views for the keys a block sees, made once for every block that sees as many (a position-ordered
    // pool gathers its rows, and V rows are transposed, in each view).
    struct Views {
        int64_t n_kv = -1;
        ggml_tensor * k = nullptr, * v = nullptr;   // [head_dim_k, n_kv, n_head_kv]; V as flash or mul_mat reads it
    } views;
    const auto views_for = [&](int64_t nk) -> const Views & {
        if (views.n_kv == nk) return views;
        views.n_kv = nk;
        views.k = ggml_permute(ctx, get_k(ctx, kv, in, kl, nk, head_dim_k), 0, 2, 1, 3);
        views.v = g.flash_attn ? ggml_permute(ctx, get_v(ctx, kv, in, kl, nk, head_dim_v), 0, 2, 1, 3)   // [head_dim_v, n_kv, n_head_kv]
                               : get_v_trans(ctx, kv, in, kl, nk, head_dim_v);   // [n_kv, head_dim_v, n_head_kv]
        return views;
    };
    // One-token kernels (GraphCtx::one_token_kernels): the mul_mat path's F16 products go through f16_mul_mat
    // (ggml's one-column dot product, several columns per pass); flash attention, and pools it cannot read,
    // attend a query at a time.
    const bool one_token = g.one_token_kernels && !capture_attn && !in.band && n > 1;
    const bool f16_products = one_token && !g.flash_attn && kv.k(kl)->type == GGML_TYPE_F16 &&
                              kv.v(kl)->type == GGML_TYPE_F16 && f16_mul_mat_usable();
    const auto rows = [&](int64_t row0, int64_t nr) {
        return nr == n ? qp : ggml_view_3d(ctx, qp, head_dim_k, nr, n_head, qp->nb[1], qp->nb[2], row0 * qp->nb[1]);
    };
    const auto keys_per_capture_block = [&] {
        const int64_t per_key = g.n_attn_tokens * n_head * 2 * sizeof(float);   // scores and their exp
        return in.band ? std::max<int64_t>(k_min_key_block, g.attention_block_bytes / per_key) : n_kv;
    };
    // A sparse prefill's captured queries: their log-sum-exp over every key, beside the one over the keys their block
    // chose (or, in the dense last step, would choose) gives the share those keys hold (GraphCtx::coverage).
    ggml_tensor * lse_all = nullptr;
    const auto keep_coverage = [&](ggml_tensor * lse_chosen) {
        ggml_tensor * cover = ggml_exp(ctx, ggml_sub(ctx, lse_chosen, lse_all));
        ggml_set_output(cover);
        ggml_build_forward_expand(g.gf, cover);
        g.coverage.push_back(cover);
    };
    if (index && capture_attn) {
        const int64_t n_q = g.n_attn_tokens;
        const KvMaskRows mr = kv_mask_rows(ctx, in, n_kv, n - n_q, n_q);
        if (mr.n_kv != n_kv) throw std::logic_error("attend: the captured queries see fewer keys");
        if (sparse) {   // what the last queries attend among every key, though their block attends fewer
            capture_flash(g, rows(n - n_q, n_q), views_for(n_kv).k, mr.mask, kq_scale, keys_per_capture_block());
        }
        lse_all = attention_lse(ctx, rows(n - n_q, n_q), views_for(n_kv).k, mr.mask, kq_scale, keys_per_capture_block());
        if (!sparse) {   // the dense last step: the choice of a block of queries ending here, made and not attended
            const int64_t nr = std::min(n, index->params().block_rows);
            ggml_tensor * lse_chosen = nullptr;
            sparse_attend_block(g, kv, kl, rows(n - nr, nr), in.first_pos + n - nr, head_dim_v, kq_scale, n_q, &lse_chosen);
            if (lse_chosen) keep_coverage(lse_chosen);
        }
    }
    std::vector<ggml_tensor *> outs;
    const std::vector<QueryBlock> blocks = query_blocks(in, n, bytes_per_key, g.attention_block_bytes,
                                                        one_token && !f16_products, sparse ? sparse->params().block_rows : 0);
    for (size_t i = 0; i < blocks.size(); ++i) {
        const QueryBlock & b = blocks[i];
        const size_t n_group = blocks_in_group(in, q, blocks, i);
        const QueryBlock & latest = blocks[i + n_group - 1];   // b, unless blocks after it share its call
        ggml_tensor * qb = rows(b.row0, b.n);
        if (sparse) {
            const bool last = b.row0 + b.n == n;
            ggml_tensor * lse_chosen = nullptr;
            if (ggml_tensor * o = sparse_attend_block(g, kv, kl, qb, in.first_pos + b.row0, head_dim_v, kq_scale,
                                                      lse_all && last ? g.n_attn_tokens : 0, &lse_chosen)) {
                if (lse_chosen) keep_coverage(lse_chosen);
                outs.push_back(o);
                continue;
            }
        }
        const KvMaskRows mr = sparse ? sparse_dense_mask(ctx, *sparse, in.first_pos + b.row0, b.n, n_kv)
                                     : kv_mask_rows(ctx, in, n_kv, latest.row0, latest.n);
        const bool last = latest.row0 + latest.n == n, capture_here = capture_attn && last && !sparse;
        if (capture_here && mr.n_kv != n_kv) throw std::logic_error("attend: the last query block sees fewer keys");
        const Views & kv_views = views_for(mr.n_kv);
        ggml_tensor * kp = kv_views.k;
        ggml_tensor * o;
        if (g.flash_attn) {
            if (capture_here) capture_flash(g, rows(latest.row0, latest.n), kp, mr.mask, kq_scale, keys_per_capture_block());
            if (n_group > 1) {
                o = attend_block_group(ctx, *in.band, q, kp, kv_views.v, b.row0, b.n, (int64_t) n_group,
                                       in.first_pos + b.row0, mr.n_kv, kq_scale);
                i += n_group - 1;
                g.n_shared_calls++;
            } else if (index && pair_queries(g, kv, kl, mr.n_kv, head_dim_k, head_dim_v)) {
                o = flash_attn_pairs(ctx, qb, kp, kv_views.v, mr.mask, kq_scale);
                g.n_paired_blocks++;
            } else {
                o = ggml_flash_attn_ext(ctx, qb, kp, kv_views.v, mr.mask, kq_scale, 0.0f, 0.0f);   // [head_dim_v, n_head, b.n]
                ggml_prec_set_acc(o, GGML_PREC_F32);
                o = ggml_reshape_2d(ctx, o, head_dim_v * n_head, b.n);
            }
        } else {
            const auto product = [&](ggml_tensor * a, ggml_tensor * b) {
                return f16_products ? f16_mul_mat(ctx, a, b) : ggml_mul_mat(ctx, a, b);
            };
            ggml_tensor * kq = product(kp, qb);   // [n_kv, b.n, n_head]
            ggml_prec_set_acc(kq, GGML_PREC_F32);
            kq = ggml_soft_max_ext(ctx, kq, kv_mask_exact(ctx, mr), kq_scale, 0.0f);
            if (capture_here) capture_head_max(g, kq);
            ggml_tensor * kqv = product(kv_views.v, kq);                 // [head_dim_v, b.n, n_head]
            o = ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), head_dim_v * n_head, b.n);
        }
        outs.push_back(o);
    }
    return stack_rows(ctx, outs);
}

// A batched decode over a pool arena: every token writes its own lane with one set_rows per K/V, and each
// run of consecutive lanes is attended by one call with the lanes along ne3 (one query per lane), under each
// token's own mask row. Same arguments and result as attend.
ggml_tensor * attend_lanes(GraphCtx & g, int64_t kl, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float kq_scale) {
    ggml_context * ctx = g.ctx;
    const GraphCtx::ArenaBatch & b = g.arena;
    const PoolArena & arena = *b.arena;
    const int64_t head_dim_k = q->ne[0], head_dim_v = v ? v->ne[0] : head_dim_k, n_head = q->ne[1];
    if (k) ggml_build_forward_expand(g.gf, cpy_k_lanes(ctx, arena, b.in, kl, k));
    if (v) ggml_build_forward_expand(g.gf, cpy_v_lanes(ctx, arena, b.in, kl, v));
    ggml_tensor * out = nullptr;
    for (size_t i = 0; i < b.runs.size(); ++i) {
        const GraphCtx::LaneRun & r = b.runs[i];
        ggml_tensor * qp = ggml_permute(ctx, ggml_view_4d(ctx, q, head_dim_k, n_head, 1, r.n, q->nb[1], q->nb[2], q->nb[2],
                                                          r.token * q->nb[2]), 0, 2, 1, 3);   // [head_dim_k, 1, n_head, n]
        ggml_tensor * kp = ggml_permute(ctx, get_k_lanes(ctx, arena, kl, b.n_kv, head_dim_k, r.lane, r.n), 0, 2, 1, 3);
        ggml_tensor * mask = b.run_masks[i];
        ggml_tensor * o;
        if (g.flash_attn) {
            ggml_tensor * vp = ggml_permute(ctx, get_v_lanes(ctx, arena, kl, b.n_kv, head_dim_v, r.lane, r.n), 0, 2, 1, 3);
            o = ggml_flash_attn_ext(ctx, qp, kp, vp, mask, kq_scale, 0.0f, 0.0f);   // [head_dim_v, n_head, 1, n]
            ggml_prec_set_acc(o, GGML_PREC_F32);
            o = ggml_reshape_2d(ctx, o, head_dim_v * n_head, r.n);
        } else {
            ggml_tensor * kq = ggml_mul_mat(ctx, kp, qp);   // [n_kv, 1, n_head, n]
            ggml_prec_set_acc(kq, GGML_PREC_F32);
            kq = ggml_soft_max_ext(ctx, kq, mask, kq_scale, 0.0f);
            ggml_tensor * kqv = ggml_mul_mat(ctx, get_v_trans_lanes(ctx, arena, kl, b.n_kv, head_dim_v, r.lane, r.n), kq);
            o = ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), head_dim_v * n_head, r.n);   // kqv: [head_dim_v, 1, n_head, n]
        }
        out = out ? ggml_concat(ctx, out, o, 1) : o;
    }
    return out;
}

// Tokens [t0, t0 + n) of x [ne0, ne1, n_tokens] as [ne0, ne1, n] (nullptr stays nullptr).
ggml_tensor * token_view(ggml_context * ctx, ggml_tensor * x, int64_t t0, int64_t n) {
    if (!x) return nullptr;
    return ggml_view_3d(ctx, x, x->ne[0], x->ne[1], n, x->nb[1], x->nb[2], t0 * x->nb[2]);
}

// A batched step's lanes (a session's tokens, its own pool or ring and inputs), each attended on its own; the
// outputs one after another, as attend's.
ggml_tensor * attend_each_lane(GraphCtx & g, const std::vector<GraphCtx::Lane> & lanes, int64_t kl, ggml_tensor * q,
                               ggml_tensor * k, ggml_tensor * v, float kq_scale) {
    ggml_context * ctx = g.ctx;
    ggml_tensor * out = nullptr;
    for (const GraphCtx::Lane & lane : lanes) {
        ggml_tensor * o = attend(g, *lane.kv, lane.in, kl, lane.n_kv, token_view(ctx, q, lane.t0, lane.n),
                                 token_view(ctx, k, lane.t0, lane.n), token_view(ctx, v, lane.t0, lane.n), kq_scale, false);
        out = out ? ggml_concat(ctx, out, o, 1) : o;
    }
    return out;
}

}  // namespace

ggml_tensor * kv_attend(GraphCtx & g, const Model & m, int il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
                        float kq_scale) {
    ggml_context * ctx = g.ctx;
    const bool swa = m.hparams().is_swa(il);
    if (!swa && m.hparams().is_pooled(il) && g.n_query_tokens > 0) {   // post-RoPE queries for the qk/quest scorers
        // the step's last n_query_tokens (a batched step: every session's token)
        const int64_t n_q = g.n_query_tokens;
        ggml_tensor * last = ggml_cont(ctx, ggml_view_3d(ctx, q, q->ne[0], q->ne[1], n_q, q->nb[1], q->nb[2],
                                                         (g.n_tokens - n_q) * q->nb[2]));
        ggml_set_output(last);
        ggml_build_forward_expand(g.gf, last);
        g.queries.push_back(last);
    }
    if (g.arena.arena && !swa) return attend_lanes(g, m.hparams().kv_index(il), q, k, v, kq_scale);
    if (!g.lanes.empty() || g.arena.arena) {   // a batched step: each session's tokens attend its own pool or ring
        return attend_each_lane(g, swa ? g.lane_rings : g.lanes, m.hparams().kv_index(il), q, k, v, kq_scale);
    }
    const GraphCtx::LayerKv lkv = g.layer_kv(m.hparams(), il);
    return attend(g, *lkv.kv, *lkv.in, lkv.layer, lkv.n_kv, q, k, v, kq_scale, lkv.pooled && g.n_attn_tokens > 0);
}

void pool_write(GraphCtx & g, int64_t kl, ggml_tensor * k, ggml_tensor * v) {
    ggml_context * ctx = g.ctx;
    if (const PoolArena * arena = g.arena.arena) {   // a batched step: every token into its session's lane
        ggml_build_forward_expand(g.gf, cpy_k_lanes(ctx, *arena, g.arena.in, kl, k));
        ggml_build_forward_expand(g.gf, cpy_v_lanes(ctx, *arena, g.arena.in, kl, v));
        return;
    }
    if (!g.lanes.empty()) {   // a batched step: each session's tokens into its own pool
        for (const GraphCtx::Lane & lane : g.lanes) {
            ggml_build_forward_expand(g.gf, cpy_k(ctx, *lane.kv, lane.in, kl, token_view(ctx, k, lane.t0, lane.n)));
            ggml_build_forward_expand(g.gf, cpy_v(ctx, *lane.kv, lane.in, kl, token_view(ctx, v, lane.t0, lane.n)));
        }
        return;
    }
    ggml_build_forward_expand(g.gf, cpy_k(ctx, *g.kv, g.in.kv, kl, k));
    ggml_build_forward_expand(g.gf, cpy_v(ctx, *g.kv, g.in.kv, kl, v));
}

ggml_tensor * pool_attend(GraphCtx & g, int64_t kl, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float kq_scale) {
    if (!g.lanes.empty()) return attend_each_lane(g, g.lanes, kl, q, k, v, kq_scale);   // a batched draft step
    return attend(g, *g.kv, g.in.kv, kl, g.n_kv, q, k, v, kq_scale, false);
}

ggml_tensor * kv_attention(GraphCtx & g, const Model & m, int il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
                           float kq_scale) {
    return mul_mat_weights(g, m.layers[il].wo, kv_attend(g, m, il, q, k, v, kq_scale));
}

ggml_tensor * select_outputs(GraphCtx & g, ggml_tensor * x) {
    return g.in.out_ids ? ggml_get_rows(g.ctx, x, g.in.out_ids) : x;
}

}  // namespace kvf

namespace kvf {

ggml_tensor * embed_tokens(GraphCtx & g, const Model & m) {
    return ggml_get_rows(g.ctx, m.tok_embd, g.in.tokens);   // [n_embd, n_tokens]
}

ggml_tensor * decoder_layer(GraphCtx & g, const Model & m, int il, ggml_tensor * x, AttentionFn attention) {
    const ModelHparams & hp = m.hparams();
    const LayerWeights & w = m.layers[il];
    ggml_tensor * attn = attention(g, m, il, rms_norm(g, x, w.attn_norm, hp.rms_eps));
    if (il == hp.n_layer - 1 && !g.all_rows) {   // only the output rows go through the last FFN
        attn = select_outputs(g, attn);
        x = select_outputs(g, x);
    }
    x = ggml_add(g.ctx, x, attn);
    return add_layer_ffn(g, hp, w, x);
}

ggml_tensor * build_stack(GraphCtx & g, const Model & m) {
    ggml_tensor * x = m.arch().embed(g, m);
    for (int il = 0; il < m.hparams().n_layer; ++il) {
        g.layer_inputs.emplace_back(x, il);
        x = m.arch().layer(g, m, il, x);
    }
    g.layer_inputs.emplace_back(x, m.hparams().n_layer);
    return x;
}

void pin_layer_boundaries(ggml_backend_sched_t sched, const GraphCtx & g, const Model & m) {
    if (m.n_devices() < 2) return;
    std::unordered_map<const ggml_tensor *, int64_t> entering(g.layer_inputs.begin(), g.layer_inputs.end());
    auto pin = [&](ggml_tensor * t, int64_t il) {
        ggml_backend_t b = m.layer_backend(il);
        if (ggml_backend_supports_op(b, t)) ggml_backend_sched_set_tensor_backend(sched, t, b);
    };
    for (int i = 0; i < ggml_graph_n_nodes(g.gf); ++i) {
        ggml_tensor * node = ggml_graph_node(g.gf, i);
        if (auto made = entering.find(node); made != entering.end() && made->second > 0) pin(node, made->second - 1);
        for (ggml_tensor * src : node->src) {
            if (!src) continue;
            if (auto read = entering.find(src); read != entering.end()) {
                pin(node, read->second);
                break;
            }
        }
    }
}

ggml_tensor * build_logits(GraphCtx & g, const Model & m, ggml_tensor * h) {
    const ModelHparams & hp = m.hparams();
    ggml_tensor * logits = mul_mat_weights(g, m.output, rms_norm(g, h, m.output_norm, hp.rms_eps));
    if (hp.logit_softcap > 0.0f) {   // c * tanh(logits / c), as libllama computes it
        logits = ggml_scale(g.ctx, ggml_tanh(g.ctx, ggml_scale(g.ctx, logits, 1.0f / hp.logit_softcap)), hp.logit_softcap);
    }
    ggml_set_name(logits, "logits");
    ggml_set_output(logits);
    ggml_build_forward_expand(g.gf, logits);
    return logits;
}

}  // namespace kvf

namespace kvf {

void load_decoder_layer(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il, bool dense_ffn) {
    const std::string p = "blk." + std::to_string(il) + ".";
    w.attn_norm = src.require(p + "attn_norm.weight", {hp.n_embd});
    w.wq = src.require(p + "attn_q.weight", {hp.n_embd, hp.head_dim_k * hp.n_head_of(il)});
    w.wk = src.require(p + "attn_k.weight", {hp.n_embd, hp.n_embd_k()});
    w.wv = src.require(p + "attn_v.weight", {hp.n_embd, hp.n_embd_v()});
    w.wo = src.require(p + "attn_output.weight", {hp.head_dim_v * hp.n_head_of(il), hp.n_embd});
    w.ffn_norm = src.require(p + "ffn_norm.weight", {hp.n_embd});
    if (dense_ffn) load_dense_ffn(w, src, hp, il);
}

void load_dense_ffn(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    if (hp.n_ff <= 0) throw std::runtime_error("GGUF is missing the required key " + hp.arch + ".feed_forward_length");
    const int64_t F = hp.n_ff_of(il);
    w.ffn_gate = src.require(p + "ffn_gate.weight", {hp.n_embd, F});
    w.ffn_up = src.require(p + "ffn_up.weight", {hp.n_embd, F});
    w.ffn_down = src.require(p + "ffn_down.weight", {F, hp.n_embd});
}

}  // namespace kvf
