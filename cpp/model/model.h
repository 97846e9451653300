// Model: hyperparameters and weights of one GGUF file, placed on a ggml backend.
// Families (llama, qwen2, qwen3, qwen3moe, qwen35, qwen35moe, gemma3, gemma4, laguna) are registered in registry.cpp; each has one file with its tensor
// list and graph builder. Nothing here knows about residency: graphs write K/V into a PooledKV.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

struct gguf_context;

namespace kvf {

struct ModelHparams {
    std::string arch;
    std::string name;
    int64_t n_vocab     = 0;
    int64_t n_embd      = 0;
    int64_t n_layer     = 0;
    int64_t n_head      = 0;          // layer 0's query heads (n_head_of: layer il's)
    int64_t n_head_kv   = 0;
    int64_t head_dim_k  = 0;
    int64_t head_dim_v  = 0;
    int64_t n_ff        = 0;          // layer 0's FFN width (n_ff_of: layer il's)
    int64_t n_ctx_train = 0;
    int64_t n_rot       = 0;
    float   rms_eps     = 1e-6f;
    float   rope_freq_base  = 10000.0f;
    float   rope_freq_scale = 1.0f;   // 1 / scaling factor (linear or YaRN)
    int     rope_type   = 0;          // GGML_ROPE_TYPE_NORMAL (0) or GGML_ROPE_TYPE_NEOX
    // YaRN (rope.scaling.type yarn) on the global layers, with libllama's context defaults: ext_factor 1, the
    // magnitude correction folded into attn_factor as llama_context does, betas 32 / 1, and the context the
    // model was trained at before scaling. ext_factor 0: plain RoPE (every other scaling type).
    float   rope_ext_factor  = 0.0f;
    float   rope_attn_factor = 1.0f;
    float   yarn_beta_fast   = 32.0f;
    float   yarn_beta_slow   = 1.0f;
    int64_t n_ctx_orig_yarn  = 0;
    float   attn_scale  = 0.0f;       // query scale; 0 = 1/sqrt(head_dim_k)
    float   logit_softcap = 0.0f;     // final logits: c * tanh(logits / c) when > 0

    // Sliding-window attention (gemma3): a query at p sees keys at p - n_swa < q <= p on the layers flagged
    // in swa_layers. Those layers keep a ring of their own (kv/sliding_window_kv.h); only the others (the
    // global layers) are pooled and paged. Empty swa_layers: every layer is global.
    int64_t n_swa = 0;
    std::vector<uint8_t> swa_layers;
    float   rope_freq_base_swa  = 10000.0f;
    float   rope_freq_scale_swa = 1.0f;
    int64_t n_rot_swa = 0;            // rope.dimension_count_swa (default n_rot): laguna rotates all of a local head

    // Gemma 4: the sliding-window layers' own head sizes (their ring's rows; 0: the global ones'). Layers
    // from n_layer_kv on keep no K/V of their own: each attends what an earlier layer of its kind wrote
    // (kv_source) and writes none; only layers with K/V of their own are pooled, ringed, paged or scored
    // (-1: every layer has its own). Per-layer token embeddings, n_embd_per_layer wide per layer (0: none).
    int64_t head_dim_k_swa = 0, head_dim_v_swa = 0;
    int64_t n_layer_kv = -1;
    int64_t n_embd_per_layer = 0;
    // rope_freqs.weight belongs to the global layers (LayerWeights::rope_freqs, sized by their head, gemma4),
    // not to every layer's RoPE over n_rot (Model::rope_freqs).
    bool rope_freqs_per_layer = false;
    // FFN width per layer (gemma4's feed_forward_length may be an array); empty: n_ff everywhere.
    std::vector<int64_t> n_ff_layers;

    // Query heads per layer (laguna: its sliding-window layers have more than its global ones); empty: n_head
    // everywhere. K/V heads are the same on every layer.
    std::vector<int64_t> n_head_layers;

    // Linear-attention layers (qwen35's gated delta-net): flagged in recurrent_layers, each with a fixed-size
    // conv state and recurrent state of its own (kv/recurrent_state.h), never paged. Sizes as libllama
    // names them: the conv kernel, the value width (d_inner = d_state * dt_rank), the head size (d_state),
    // the value heads (dt_rank) and key heads (n_group).
    std::vector<uint8_t> recurrent_layers;
    int64_t ssm_d_conv = 0, ssm_d_inner = 0, ssm_d_state = 0, ssm_dt_rank = 0, ssm_n_group = 0;
    // Multi-section RoPE (qwen35's IMROPE): dimensions per section. A text token has the same position in
    // every section, so the rotation equals NeoX RoPE over n_rot dimensions; read and checked, not needed.
    int rope_sections[4] = {0, 0, 0, 0};
    // Multi-token-prediction (nextn) layers the file has after the trunk (qwen35): block_count counts them, n_layer
    // does not; libllama never runs them in its main pass, and neither do we. The first one is the MTP drafter's
    // head when the model is loaded with ModelOptions::mtp (Model::mtp).
    int64_t n_layer_nextn = 0;

    // Mixture of experts (qwen3moe, qwen35moe, laguna): n_expert routed experts of n_ff_exp, n_expert_used per
    // token, chosen by the router's softmax or sigmoid (plus a per-expert selection bias where the layer has
    // one), weighted by those probabilities renormalised over the chosen (expert_weights_norm) and scaled by
    // expert_weights_scale (0: 1); n_ff_shexp: the shared expert (0: none). The first n_layer_dense_lead
    // layers have a dense FFN instead (laguna).
    enum class ExpertGating { softmax, sigmoid };
    int64_t n_expert = 0, n_expert_used = 0, n_ff_exp = 0, n_ff_shexp = 0;
    ExpertGating expert_gating = ExpertGating::softmax;
    bool expert_weights_norm = true;
    float expert_weights_scale = 0.0f;
    int64_t n_layer_dense_lead = 0;

    int64_t n_embd_k() const { return head_dim_k * n_head_kv; }
    int64_t n_embd_v() const { return head_dim_v * n_head_kv; }
    int64_t n_embd_k_swa() const { return (head_dim_k_swa > 0 ? head_dim_k_swa : head_dim_k) * n_head_kv; }
    int64_t n_embd_v_swa() const { return (head_dim_v_swa > 0 ? head_dim_v_swa : head_dim_v) * n_head_kv; }
    int64_t head_dim_k_of(int64_t il) const { return is_swa(il) && head_dim_k_swa > 0 ? head_dim_k_swa : head_dim_k; }
    int64_t head_dim_v_of(int64_t il) const { return is_swa(il) && head_dim_v_swa > 0 ? head_dim_v_swa : head_dim_v; }
    int64_t n_head_of(int64_t il) const { return n_head_layers.empty() ? n_head : n_head_layers[(size_t) il]; }
    int64_t n_ff_of(int64_t il) const { return n_ff_layers.empty() ? n_ff : n_ff_layers[(size_t) il]; }
    bool is_swa(int64_t il) const { return !swa_layers.empty() && swa_layers[(size_t) il]; }
    bool is_recurrent(int64_t il) const { return !recurrent_layers.empty() && recurrent_layers[(size_t) il]; }
    bool has_kv(int64_t il) const { return n_layer_kv < 0 || il < n_layer_kv; }
    // The layer whose K/V layer il attends: itself, or (no K/V of its own) libllama's choice for Gemma 4:
    // the last layer before the cut for a global layer, the one before that for a sliding-window layer
    // (gemma4's read_hparams checks that it is of the same kind).
    int64_t kv_source(int64_t il) const { return has_kv(il) ? il : n_layer_kv - (is_swa(il) ? 2 : 1); }
    bool is_pooled(int64_t il) const { return !is_swa(il) && !is_recurrent(il) && has_kv(il); }
    int64_t n_swa_layers() const;   // the sliding-window layers with K/V of their own (the ring's layers)
    int64_t n_recurrent_layers() const;
    int64_t n_pooled_layers() const;
    // Index of layer il's K/V among the layers of its kind that have their own (its row in the pool, its ring,
    // or its recurrent state); a layer without K/V of its own gets its source's.
    int64_t kv_index(int64_t il) const;
    // A recurrent layer's state sizes (F32 elements): the last d_conv - 1 inputs of every conv channel, and
    // the delta-net state [head_v, head_v, n_v_heads].
    int64_t ssm_conv_channels() const { return ssm_d_inner + 2 * ssm_n_group * ssm_d_state; }
    int64_t ssm_conv_state() const { return (ssm_d_conv - 1) * ssm_conv_channels(); }
    int64_t ssm_head_v() const { return ssm_dt_rank > 0 ? ssm_d_inner / ssm_dt_rank : 0; }
    int64_t ssm_recurrent_state() const { return ssm_head_v() * ssm_head_v() * ssm_dt_rank; }
};

struct LayerWeights {
    ggml_tensor * attn_norm = nullptr;   // [n_embd]
    ggml_tensor * wq = nullptr;          // [n_embd, head_dim_k * n_head]
    ggml_tensor * wk = nullptr;          // [n_embd, n_embd_k]
    ggml_tensor * wv = nullptr;          // [n_embd, n_embd_v]
    ggml_tensor * wo = nullptr;          // [head_dim_v * n_head, n_embd]
    ggml_tensor * bq = nullptr;          // [head_dim_k * n_head]   qwen2
    ggml_tensor * bk = nullptr;          // [n_embd_k]              qwen2
    ggml_tensor * bv = nullptr;          // [n_embd_v]              qwen2
    ggml_tensor * q_norm = nullptr;      // [head_dim_k]            qwen3
    ggml_tensor * k_norm = nullptr;      // [head_dim_k]            qwen3
    ggml_tensor * attn_gate = nullptr;   // [n_embd, n_head] or [n_embd, head_dim_v * n_head]   laguna (softplus)
    ggml_tensor * ffn_norm = nullptr;    // [n_embd]
    ggml_tensor * ffn_gate = nullptr;    // [n_embd, n_ff]
    ggml_tensor * ffn_up   = nullptr;    // [n_embd, n_ff]
    ggml_tensor * ffn_down = nullptr;    // [n_ff, n_embd]
    ggml_tensor * attn_post_norm = nullptr;   // [n_embd]         gemma3 (norm of the attention output)
    ggml_tensor * ffn_post_norm  = nullptr;   // [n_embd]         gemma3
    // gemma4
    ggml_tensor * rope_freqs = nullptr;       // [head_dim_k / 2]  global layers' proportional-RoPE factors
    ggml_tensor * out_scale = nullptr;        // [1]               layer_output_scale
    ggml_tensor * ffn_gate_inp_s = nullptr;   // [n_embd]          the router input's scale
    ggml_tensor * ffn_pre_norm_2 = nullptr;   // [n_embd]          the experts' input norm
    ggml_tensor * ffn_post_norm_1 = nullptr;  // [n_embd]          the dense (shared) FFN's output norm
    ggml_tensor * ffn_post_norm_2 = nullptr;  // [n_embd]          the experts' output norm
    ggml_tensor * ffn_gate_exps_s = nullptr;  // [n_expert]        per-expert output scales
    ggml_tensor * ffn_up_exps_s = nullptr;    // [n_expert]
    ggml_tensor * ffn_down_exps_s = nullptr;  // [n_expert]
    ggml_tensor * ple_inp_gate = nullptr;     // [n_embd, n_embd_per_layer]   per-layer embedding: inp_gate
    ggml_tensor * ple_proj = nullptr;         // [n_embd_per_layer, n_embd]   proj
    ggml_tensor * ple_post_norm = nullptr;    // [n_embd]                     post_norm
    // gated delta-net (qwen35's linear-attention layers)
    ggml_tensor * ssm_qkv = nullptr;      // [n_embd, 2 * key_dim + value_dim]   attn_qkv
    ggml_tensor * ssm_z = nullptr;        // [n_embd, value_dim]                 attn_gate (output gate)
    ggml_tensor * ssm_conv1d = nullptr;   // [d_conv, conv_channels]
    ggml_tensor * ssm_dt = nullptr;       // [dt_rank]   bias of the decay
    ggml_tensor * ssm_a = nullptr;        // [dt_rank]   -exp(A_log)
    ggml_tensor * ssm_beta = nullptr;     // [n_embd, dt_rank]
    ggml_tensor * ssm_alpha = nullptr;    // [n_embd, dt_rank]
    ggml_tensor * ssm_norm = nullptr;     // [head_v]
    ggml_tensor * ssm_out = nullptr;      // [value_dim, n_embd]
    // mixture of experts
    ggml_tensor * ffn_gate_inp = nullptr;     // [n_embd, n_expert]             router
    ggml_tensor * ffn_exp_probs_b = nullptr;  // [n_expert]   selection bias (laguna): picks experts, not their weights
    ggml_tensor * ffn_gate_exps = nullptr;    // [n_embd, n_ff_exp, n_expert]
    ggml_tensor * ffn_up_exps = nullptr;      // [n_embd, n_ff_exp, n_expert]
    ggml_tensor * ffn_gate_up_exps = nullptr; // [n_embd, 2 * n_ff_exp, n_expert] (gate and up in one, newer files)
    ggml_tensor * ffn_down_exps = nullptr;    // [n_ff_exp, n_embd, n_expert]
    ggml_tensor * ffn_gate_inp_shexp = nullptr;   // [n_embd]   the shared expert's sigmoid gate
    ggml_tensor * ffn_gate_shexp = nullptr;   // [n_embd, n_ff_shexp]
    ggml_tensor * ffn_up_shexp = nullptr;     // [n_embd, n_ff_shexp]
    ggml_tensor * ffn_down_shexp = nullptr;   // [n_ff_shexp, n_embd]
};

// Every tensor slot of a layer, for code that treats them alike (loading mirrors each one).
inline constexpr ggml_tensor * LayerWeights::* k_layer_tensors[] = {
    &LayerWeights::attn_norm, &LayerWeights::wq, &LayerWeights::wk, &LayerWeights::wv, &LayerWeights::wo,
    &LayerWeights::bq, &LayerWeights::bk, &LayerWeights::bv, &LayerWeights::q_norm, &LayerWeights::k_norm,
    &LayerWeights::attn_gate, &LayerWeights::ffn_exp_probs_b,
    &LayerWeights::ffn_norm, &LayerWeights::ffn_gate, &LayerWeights::ffn_up, &LayerWeights::ffn_down,
    &LayerWeights::attn_post_norm, &LayerWeights::ffn_post_norm, &LayerWeights::ssm_qkv, &LayerWeights::ssm_z,
    &LayerWeights::ssm_conv1d, &LayerWeights::ssm_dt, &LayerWeights::ssm_a, &LayerWeights::ssm_beta,
    &LayerWeights::ssm_alpha, &LayerWeights::ssm_norm, &LayerWeights::ssm_out, &LayerWeights::ffn_gate_inp,
    &LayerWeights::ffn_gate_exps, &LayerWeights::ffn_up_exps, &LayerWeights::ffn_gate_up_exps,
    &LayerWeights::ffn_down_exps, &LayerWeights::ffn_gate_inp_shexp, &LayerWeights::ffn_gate_shexp,
    &LayerWeights::ffn_up_shexp, &LayerWeights::ffn_down_shexp, &LayerWeights::rope_freqs, &LayerWeights::out_scale,
    &LayerWeights::ffn_gate_inp_s, &LayerWeights::ffn_pre_norm_2, &LayerWeights::ffn_post_norm_1,
    &LayerWeights::ffn_post_norm_2, &LayerWeights::ffn_gate_exps_s, &LayerWeights::ffn_up_exps_s,
    &LayerWeights::ffn_down_exps_s, &LayerWeights::ple_inp_gate, &LayerWeights::ple_proj, &LayerWeights::ple_post_norm};

// The multi-token-prediction (nextn) head: a full-attention decoder block of the family whose input at position p
// is eh_proj([enorm(embedding of token p); hnorm(the trunk's output-normed hidden state at p - 1)]); its output,
// normed by head_norm, predicts token p + 2 through head and is the hidden state of the next draft's input.
struct MtpWeights {
    LayerWeights block;                   // attention (gated, q/k norms), the FFN's norm (ffn_norm) and the FFN
    ggml_tensor * eh_proj = nullptr;      // [2 * n_embd, n_embd]
    ggml_tensor * enorm = nullptr;        // [n_embd]
    ggml_tensor * hnorm = nullptr;        // [n_embd]
    ggml_tensor * embed_tokens = nullptr; // [n_embd, n_vocab]  (nullptr: the trunk's tok_embd)
    ggml_tensor * head_norm = nullptr;    // [n_embd]           shared_head_norm (nullptr: the trunk's output_norm)
    ggml_tensor * head = nullptr;         // [n_embd, n_vocab]  shared_head_head (nullptr: the trunk's output)
};

class Model;
struct GraphCtx;

// Tensor lookup during loading: every miss or shape mismatch is an error that names the tensor.
class TensorSource {
public:
    virtual ~TensorSource() = default;
    virtual ggml_tensor * require(const std::string & name, std::vector<int64_t> shape) = 0;
    virtual ggml_tensor * optional(const std::string & name, std::vector<int64_t> shape) = 0;
    // The tensor's metadata as stored (nullptr: absent), for a family whose layout follows a tensor's shape.
    virtual const ggml_tensor * stored(const std::string & name) = 0;
};

// A family's multi-token-prediction head (model/mtp.h runs it): its tensors (layer il: the first nextn layer), the
// K and V its block writes for the step's tokens from the block's input x ([n_embd, n_tokens]), and the whole block
// over x (writing the same K/V and attending them: GraphCtx::mtp_kv_layer), its output before head_norm.
struct MtpArch {
    void (*load)(MtpWeights & w, TensorSource & src, const ModelHparams & hp, int il);
    void (*write_kv)(GraphCtx & g, const Model & m, ggml_tensor * x);
    ggml_tensor * (*block)(GraphCtx & g, const Model & m, ggml_tensor * x);
};

// One model family: how its layers are named and how its graph is built, one layer at a time, so a
// step can run the whole stack (build_stack in graph.h) or one layer of many tokens (layer-major prefill).
struct ArchSpec {
    const char * name;
    int rope_type;
    // The family's own metadata keys, after the common ones are read (nullptr: none).
    void (*read_hparams)(const gguf_context * g, ModelHparams & hp);
    void (*load_layer)(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il);
    // The input hidden state of the step's tokens: [n_embd, n_tokens].
    ggml_tensor * (*embed)(GraphCtx & g, const Model & model);
    // Layer il: hidden state in ([n_embd, n_tokens]), hidden state out; the last layer keeps only the
    // output rows ([n_embd, n_outputs]).
    ggml_tensor * (*layer)(GraphCtx & g, const Model & model, int il, ggml_tensor * x);
    const MtpArch * mtp = nullptr;   // nullptr: the family runs no multi-token-prediction head
};

const ArchSpec * find_arch(const std::string & name);   // nullptr if unsupported
std::string supported_archs();                          // "llama, qwen2, qwen3, ..."

struct ModelOptions {
    // Where the layers go (model/device_split.h), as llama.cpp picks its devices: the first device of each
    // ggml-rpc-server in `rpc` ("host:port"), then this host's GPU ("auto": if there is one; "cuda": required);
    // none of those: the CPU. "rpc": the servers alone; "cpu": the CPU alone.
    std::string backend = "auto";   // "auto" | "cpu" | "cuda" | "rpc"
    std::vector<std::string> rpc;
    // The devices in layer order ("cpu", "cudaN", "rpc:HOST:PORT"), instead of backend and rpc.
    std::vector<std::string> devices;
    // Each device's share of the layers (llama.cpp's --tensor-split); empty: in proportion to free memory.
    std::vector<double> tensor_split;
    int n_threads = 0;               // 0 = all physical cores
    // Load the first multi-token-prediction (nextn) layer (the MTP drafter's head; a file or family without one
    // is an error). Off, its weights are skipped: they take device memory only where a session drafts with them.
    bool mtp = false;
};

// One device of a model's split: its backend and the weights of the layers it holds.
struct ModelDevice {
    ggml_backend_t backend = nullptr;
    bool is_cpu = false;   // this host's CPU backend (Model::cpu_backend())
    bool is_rpc = false;
    ggml_context * ctx_w = nullptr;
    ggml_backend_buffer_t buf_w = nullptr;
    std::shared_ptr<void> rpc_hold;   // this process's connection to its RPC endpoint is in use (model/rpc.h)
};

class Model {
public:
    Model(const std::string & path, const ModelOptions & opts);
    ~Model();
    Model(const Model &) = delete;
    Model & operator=(const Model &) = delete;

    const ModelHparams & hparams() const { return hp_; }
    const ArchSpec & arch() const { return *arch_; }
    const std::string & path() const { return path_; }
    // The split (model/device_split.h): device d's backend, which device holds layer il (il == n_layer: the
    // output layer: final norm, logits, the MTP head), and that device's backend.
    int n_devices() const { return (int) devices_.size(); }
    ggml_backend_t device_backend(int d) const { return devices_[(size_t) d].backend; }
    int device_of(int64_t il) const { return layer_device_[(size_t) il]; }
    ggml_backend_t layer_backend(int64_t il) const { return device_backend(device_of(il)); }
    // The output layer's device: the logits, and the buffers of a session that belong to no layer.
    ggml_backend_t backend() const { return layer_backend(hp_.n_layer); }
    ggml_backend_t cpu_backend() const { return cpu_backend_; } // always present (scheduler fallback)
    // Throws RpcLost (model/rpc.h) when the connection to one of the devices was lost: its weights are gone.
    void check_rpc_connections() const;
    // Some layer on a device other than the local CPU (a GPU, or an RPC device): the scheduler keeps the
    // CPU backend as fallback and the step inputs on the host.
    bool on_gpu() const;
    bool on_rpc() const;
    int n_threads() const { return n_threads_; }
    void set_n_threads(int n);   // waits for a compute in progress
    int64_t weight_bytes() const;                 // every device's
    int64_t device_weight_bytes(int d) const;
    bool device_is_cpu(int d) const { return devices_[(size_t) d].is_cpu; }   // this host's CPU backend
    bool device_is_rpc(int d) const { return devices_[(size_t) d].is_rpc; }
    // Device d's memory as its backend reports it now (ggml_backend_dev_memory: a GPU's driver figures; this
    // host's CPU: its physical RAM as both; an RPC device: what its server's device reports, asked over the
    // connection). Throws RpcLost when that connection was lost (its answer would read as zeros).
    void device_memory(int d, size_t & free, size_t & total) const;
    // Layer il's copy of the llama-3 RoPE frequency factors (one per device, as llama.cpp duplicates them, so no
    // layer's RoPE reaches across devices); nullptr: the file has none.
    ggml_tensor * rope_freqs_of(int64_t il) const { return rope_freqs_.empty() ? nullptr : rope_freqs_[(size_t) device_of(il)]; }
    std::string fingerprint() const;                             // changes when hparams or weights change

    // Held while anything runs on this model's backends: ggml's CPU backend keeps one work buffer per
    // backend object (a GPU backend one stream and memory pool), and every session of this model
    // computes through the same ones, so sessions of one model never compute at once. Sessions take it
    // after their own mutex (session.h), never the other way round. Recursive, so a holder may re-enter.
    std::recursive_mutex & compute_mutex() const { return compute_mutex_; }

    ggml_tensor * tok_embd = nullptr;     // [n_embd, n_vocab]
    ggml_tensor * output_norm = nullptr;  // [n_embd]
    ggml_tensor * output = nullptr;       // [n_embd, n_vocab] (tok_embd when tied; a copy of it on a split)
    // Per-layer embeddings (gemma4, when hp.n_embd_per_layer > 0): token rows of every layer's slice, the
    // projection of the token embeddings into them, and its norm.
    ggml_tensor * per_layer_tok_embd = nullptr;     // [n_embd_per_layer * n_layer, n_vocab]
    ggml_tensor * per_layer_model_proj = nullptr;   // [n_embd, n_embd_per_layer * n_layer]
    ggml_tensor * per_layer_proj_norm = nullptr;    // [n_embd_per_layer]
    std::vector<LayerWeights> layers;
    MtpWeights mtp;   // loaded with ModelOptions::mtp, else empty
    bool has_mtp() const { return mtp.eh_proj != nullptr; }

private:
    void read_hparams(gguf_context * gctx);
    void read_head_counts(gguf_context * gctx);
    void check_pooled_head_counts() const;
    void read_rope(gguf_context * gctx);
    void check_mtp(bool want) const;   // the head can be loaded (want), or a warning that it is not
    void open_devices(const ModelOptions & opts);
    void load_tensors(gguf_context * gctx, ggml_context * meta, bool with_mtp);
    void free_devices();

    std::string path_;
    ModelHparams hp_;
    const ArchSpec * arch_ = nullptr;
    ggml_backend_t cpu_backend_ = nullptr;
    std::vector<ModelDevice> devices_;
    std::vector<int> layer_device_;            // [n_layer + 1]
    std::vector<ggml_tensor *> rope_freqs_;    // one per device, or empty
    std::atomic<int> n_threads_{1};   // read without the compute mutex, set under it
    uint64_t weights_hash_ = 0;
    mutable std::recursive_mutex compute_mutex_;
};

}  // namespace kvf
