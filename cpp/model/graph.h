// Shared graph-building blocks. A family's build() uses these to write its decoder stack in one screen.
// Graph builders take no host arrays and read no pager state: every per-step value is an input tensor
// that Session::set_inputs fills before each compute. How K/V lie in the pool is cpp/kv's business
// (kv/kv_graph.h): attention writes and reads the pool only through cpy_k / cpy_v / get_k / get_v.
#pragma once

#include "kv/kv_step_inputs.h"
#include "kv/pooled_kv.h"
#include "kv/recurrent_state.h"
#include "model/model.h"
#include "model/sparse_attention.h"

#include <functional>
#include <map>
#include <utility>

namespace kvf {

// A layer-major prefill's attention calls each hold at most this much mask (and attention matrix): its steps
// attend their queries a block at a time, so these buffers stay this size whatever the context. One call over
// a step of 1024 queries and 128K keys held a 256 MiB mask beside the 512 MiB of an 8B model's layer of K/V.
// H100, 8B shape, 1024-token steps (experiments/prefill_blocks.py): 32 MiB split a 32K prompt's steps in two
// and cost 4% of its speed; 64 MiB keeps them whole there, and at 128K (four blocks) was as fast as one block.
constexpr int64_t k_attention_block_bytes = 64ll << 20;
// Most queries one flash attention call of a layer-major step takes (llama.cpp's ubatch): ggml-cuda took 18% longer
// for 1024-query calls than for twice as many 512-query ones over the same keys (R91: H100, 8B shape, 32K).
constexpr int64_t k_max_query_block = 512;
// Where a step's blocks of queries share flash attention calls (F16 K/V, dense: ExactPrefillOptions::blocks_per_call),
// each block's mask holds this much: at 256K, blocks of 64 queries eight to a call took 67.9 s of flash attention,
// libllama's 512-query calls 67.8, and a call per 128-query block (64 MiB) 71.9 (R124: H100, 8B shape). Half the
// mask table, too.
constexpr int64_t k_grouped_block_bytes = 32ll << 20;

// Queries per attention call of a layer-major prefill's step over a pool of n_slots keys: as many as block_bytes
// holds at bytes_per_key (attention_bytes_per_key) per query and key, between 32 and 512 (llama.cpp's ubatch).
int64_t attention_block_rows(int64_t n_slots, int64_t bytes_per_key, int64_t block_bytes);
// What an attention call holds per query and key: its F16 mask and, without flash attention, the F32 attention
// matrix of each of the n_head heads twice (scores and softmax).
int64_t attention_bytes_per_key(bool flash_attn, int64_t n_head);
// log sum_k exp(scale q.k + mask) of queries q [head_dim, n_q, n_head] over keys kp [head_dim, n_kv, n_head_kv] under
// mask [>= n_kv, n_q]: F32 [1, n_q, n_head], computed over blocks of keys_per_block keys (no buffer holds more).
ggml_tensor * attention_lse(ggml_context * ctx, ggml_tensor * q, ggml_tensor * kp, ggml_tensor * mask, float kq_scale,
                            int64_t keys_per_block);

struct StepInputs {
    ggml_tensor * tokens    = nullptr;   // I32 [n_tokens]
    ggml_tensor * positions = nullptr;   // I32 [n_tokens]
    ggml_tensor * out_ids   = nullptr;   // I32 [n_outputs]  tokens whose logits are computed (nullptr: all)
    KvStepInputs kv;                     // the pool's: slot rows, slot mask, key order (kv/kv_step_inputs.h)
};

struct GraphCtx {
    ggml_context * ctx = nullptr;
    ggml_cgraph * gf = nullptr;
    const PooledKV * kv = nullptr;
    // The pool holds only the layer being built (layer-major prefill's one-layer staging): every pooled
    // layer reads and writes its layer 0.
    bool one_layer_kv = false;
    StepInputs in;
    // The sliding-window layers' rings (kv/sliding_window_kv.h), when the model has such layers: their K/V
    // and this step's inputs for them (slot rows p % ring size, a mask by position and window).
    const PooledKV * ring = nullptr;
    KvStepInputs ring_in;
    int64_t n_ring_kv = 0;
    // The linear-attention layers' conv and recurrent state (kv/recurrent_state.h), when the model has such
    // layers: a step reads layer l's and writes it back in place.
    const RecurrentState * recurrent = nullptr;
    // The multi-token-prediction head (model/mtp.h), when the graph runs it: its layer in kv (-1: none), and the
    // trunk's last layer keeping every row (the head pairs each token with the trunk's state at the one before).
    // A batched step's sessions each write the head's K/V into their own pool and move their own carry on
    // (mtp_lanes: each session's state, whose carry it is, and its tokens; empty for a step of one session).
    int64_t mtp_kv_layer = -1;
    bool all_rows = false;
    int64_t n_tokens = 0;
    int64_t n_kv = 0;          // pool slots attended (a prefix of the pool)
    int64_t n_outputs = 0;
    bool flash_attn = false;
    // Attend a step's queries with the kernels a one-token step takes, so that every row of the step is bit for
    // bit what the same token computes alone, and so are the K/V the next layers write from it (speculation's
    // verify step then keeps plain greedy decoding's tokens). ggml's CPU backend computes several queries with
    // other kernels than one: the mul_mat path's F16 products go through tinyBLAS (llamafile's sgemm), flash
    // attention tiles queries and splits a lone query's keys across threads; a verify step's rows differed from
    // plain decoding's by up to ~0.9 in a logit on SmolLM2 (2 threads or 1), flipping greedy near-ties. Set by
    // Session::build_graph on the CPU for a step that reads every row's logits, of up to 32 tokens; graph.cpp:
    // attend (f16_mul_mat, or a query at a time).
    bool one_token_kernels = false;
    // What one attention call of a step whose mask is made per block of queries (KvStepInputs::band) may hold
    // for that block's mask and, on the mul_mat path, its attention matrix (graph.cpp: query_blocks).
    int64_t attention_block_bytes = k_attention_block_bytes;
    // Most rows of a step its feed-forward takes at once (ffn.h: add_in_row_parts; 0: k_ffn_part_rows).
    int64_t ffn_part_rows = 0;
    // A sparse prefill's step (model/sparse_attention.h; index nullptr: attention is exact): its pooled layers attend
    // blocks of queries over the chunks each block chooses.
    SparseStep sparse;
    int64_t n_query_tokens = 0;             // last tokens whose queries are kept for the scorers (a batched step: all)
    std::vector<ggml_tensor *> queries;     // per layer: F32 [head_dim, n_head, n_query_tokens] (outputs)
    int64_t n_attn_tokens = 0;              // last tokens whose attention probabilities are kept (mul_mat path)
    std::vector<ggml_tensor *> attn;        // per layer: F32 [n_kv, n_attn_tokens], max over heads (outputs)
    // A sparse prefill's captured queries: per layer whose last block chose its keys, the share of their exact
    // attention those keys hold, F32 [1, n_attn_tokens, n_head] (outputs; none where the block saw every key).
    std::vector<ggml_tensor *> coverage;
    int64_t n_paired_blocks = 0;   // blocks of queries attended a pair at a time (graph.cpp: pair_queries says why)
    int64_t n_shared_calls = 0;    // flash attention calls that several blocks of queries share (attend_block_group)
    // A batched step of several sessions (runtime/batch_decoder.h): lane i is session i's tokens [t0, t0 + n) of
    // the step (one for a decode step, several for a verify step), which attend only that session's pool, under
    // its own inputs. Empty: the graph runs one sequence (kv, in.kv).
    struct Lane {
        const PooledKV * kv;
        KvStepInputs in;
        int64_t n_kv;
        int64_t t0 = 0, n = 1;
    };
    std::vector<Lane> lanes;
    // Per session of a batched step, its sliding-window rings (the sliding-window layers attend these one session
    // at a time; empty when the model has no such layers).
    std::vector<Lane> lane_rings;
    // Per session of a batched step, its linear-attention state and its tokens [t0, t0 + n) of the step (empty when
    // the model has no such layers): each session's conv and delta rule read and write back its own state
    // (qwen35.cpp: linear_attention), over one token (a decode step) or several (a verify step).
    struct LaneState {
        const RecurrentState * state;
        int64_t t0, n;
    };
    std::vector<LaneState> lane_recurrent;
    std::vector<LaneState> mtp_lanes;
    // A batched decode whose sessions all keep their pools in one arena (kv/pool_arena.h; lanes then stays
    // empty): one K/V write for every token, and one attention call per run of tokens whose lanes follow
    // one another (tokens [token, token + n) are lanes [lane, lane + n)), the lanes along ne3.
    struct LaneRun {
        int64_t token, lane, n;
    };
    struct ArenaBatch {
        const PoolArena * arena = nullptr;
        KvStepInputs in;   // slots: arena rows; mask [n_kv, n_tokens]: row t is token t's own pool's
        int64_t n_kv = 0;
        std::vector<LaneRun> runs;
        // Each run's rows of the mask, [n_kv, 1, 1, run's n], viewed once with the runs and read by every layer: ggml's
        // scheduler uploads each view of a host input as its own input, and a view per layer made 32 uploads of
        // the same rows a step on the 8B shape (R110: 36 copies and 104 stream syncs between two steps).
        std::vector<ggml_tensor *> run_masks;
    } arena;
    // A batched decode whose sessions all keep their linear-attention state in one arena too (lane_recurrent then
    // stays empty): one conv and one delta rule per run of lanes that follow one another, the lanes as sequences.
    struct RecurrentBatch {
        const PoolArena * arena = nullptr;
        std::vector<LaneRun> runs;
    } recurrent_arena;

    // Where layer il keeps its K/V (or, without K/V of its own, reads its source layer's): the pool (global
    // layers) or the ring (sliding-window layers). Only pooled layers are paged and scored, so only they keep
    // queries and attention for the scorers.
    struct LayerKv {
        const PooledKV * kv;
        const KvStepInputs * in;
        int64_t layer;   // the layer's index inside kv
        int64_t n_kv;    // slots attended
        bool pooled;
    };
    // Activations quantized for quant_mul_mat, by the F32 tensor and the type (one cpy per input: q, k and v
    // read the same one).
    std::map<std::pair<const ggml_tensor *, ggml_type>, ggml_tensor *> quantized_inputs;
    // The hidden state entering each layer of build_stack, as (x, il); il == n_layer: the output layer's input.
    // pin_layer_boundaries reads it.
    std::vector<std::pair<ggml_tensor *, int64_t>> layer_inputs;
    LayerKv layer_kv(const ModelHparams & hp, int il) const {
        if (hp.is_swa(il)) return {ring, &ring_in, hp.kv_index(il), n_ring_kv, false};
        return {kv, &in.kv, one_layer_kv ? 0 : hp.kv_index(il), n_kv, hp.is_pooled(il)};
    }
};

ggml_tensor * rms_norm(GraphCtx & g, ggml_tensor * x, ggml_tensor * weight, float eps);
// A weight matrix times activations [K, n]: ggml_mul_mat, except Q4_1 and Q8_0 weights in host memory times
// several tokens, which go through quant_mul_mat (model/quant_matmul.h: ggml's sums, several tokens per pass)
// where it is usable.
ggml_tensor * mul_mat_weights(GraphCtx & g, ggml_tensor * w, ggml_tensor * x);
// q, k, v: [head_dim, n_head(_kv), n_tokens], q and k already RoPE'd. Writes k and v where layer il keeps
// its K/V (the pool, or a sliding-window layer's ring: GraphCtx::layer_kv) with cpy_k / cpy_v, attends over
// the slots of the step (get_k / get_v) under the step's mask, applies wo. k and v nullptr: a layer without
// K/V of its own (hp.has_kv) attends its source layer's, written earlier in the same graph.
ggml_tensor * kv_attention(GraphCtx & g, const Model & m, int il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
                           float kq_scale);
// The same before wo: [head_dim_v * n_head, n_tokens] (qwen35 gates it before its output projection).
ggml_tensor * kv_attend(GraphCtx & g, const Model & m, int il, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
                        float kq_scale);
// RoPE of layer il (sliding-window layers have their own base and scale).
ggml_tensor * rope(GraphCtx & g, const Model & m, int il, ggml_tensor * x);
// RoPE of the global layers (and of the MTP head, outside the stack).
ggml_tensor * rope_global(GraphCtx & g, const Model & m, int64_t il, ggml_tensor * x);   // il: whose RoPE factors
// A layer outside the family's stack (the MTP head) with its K/V in layer kl of the step's pool (GraphCtx::kv,
// in.kv, n_kv): pool_write writes k and v of the step's tokens (a batched step's: each session's into its own pool);
// pool_attend also attends the first n_kv slots under the step's mask ([head_dim_v * n_head, n_tokens]). Nothing of it
// is kept for the scorers.
void pool_write(GraphCtx & g, int64_t kl, ggml_tensor * k, ggml_tensor * v);
ggml_tensor * pool_attend(GraphCtx & g, int64_t kl, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float kq_scale);
// x + bias when bias is present; reshape to [head_dim, n_heads, n_tokens].
ggml_tensor * project_heads(GraphCtx & g, ggml_tensor * w, ggml_tensor * b, ggml_tensor * x, int64_t head_dim,
                            int64_t n_heads);
// Keep only the output rows (last layer): get_rows when out_ids is set.
ggml_tensor * select_outputs(GraphCtx & g, ggml_tensor * x);

}  // namespace kvf

namespace kvf {

// The tensors every llama-like layer has (norms, q/k/v/o projections, SwiGLU FFN).
// dense_ffn=false: the FFN is the family's own (experts), loaded separately.
void load_decoder_layer(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il, bool dense_ffn = true);
void load_dense_ffn(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il);   // gate, up, down
// A mixture-of-experts FFN's tensors (router, experts; the shared expert when hp.n_ff_shexp > 0, with its
// sigmoid gate when shared_gate), and the metadata that sizes them (expert counts and widths, libllama's
// defaults where a file leaves them out).
void load_moe_ffn(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il, bool shared_gate = true);
void read_moe_hparams(const gguf_context * g, ModelHparams & hp, bool shared_expert);
// The sliding window and which layers have it (attention.sliding_window_pattern: one flag per layer, or a
// period whose first (global_first) or last layer is global, `period` when the file has neither); the local
// layers' rope base. false when the file has no window (every layer global).
bool read_sliding_window(const gguf_context * g, ModelHparams & hp, int64_t period, bool global_first);

// The token embeddings of the step: [n_embd, n_tokens].
ggml_tensor * embed_tokens(GraphCtx & g, const Model & m);
// The pre-norm decoder layer shared by the llama-like families: x += attention(rms_norm(x));
// x += layer_ffn(rms_norm(x)); on the last layer only the output rows go through the FFN (unless g.all_rows).
// `attention` is the family-specific part: it maps the normed input of layer il to the block output.
using AttentionFn = ggml_tensor * (*)(GraphCtx & g, const Model & m, int il, ggml_tensor * x);
ggml_tensor * decoder_layer(GraphCtx & g, const Model & m, int il, ggml_tensor * x, AttentionFn attention);

// The whole stack of a step: the family's embed, then each of its layers; [n_embd, n_outputs].
ggml_tensor * build_stack(GraphCtx & g, const Model & m);
// On a split model, run the ops that read layer il's input on layer il's device and the op that makes it on
// layer il - 1's: ggml's scheduler otherwise puts a layer's first norm (it has no weight among its sources) on
// the previous layer's device, so both the hidden state and its norm cross between devices, and over ggml-rpc
// that is one more round trip a step. llama.cpp pins its "norm" and "l_last" ops the same way
// (llama_context::graph_get_cb). Call between ggml_backend_sched_reset and the graph's allocation.
void pin_layer_boundaries(ggml_backend_sched_t sched, const GraphCtx & g, const Model & m);
// The output norm and head: logits [n_vocab, n_rows] of the final hidden state, marked as an output.
ggml_tensor * build_logits(GraphCtx & g, const Model & m, ggml_tensor * h);

}  // namespace kvf
