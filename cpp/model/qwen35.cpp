// qwen35 family: Qwen3.5 dense (qwen35) and with routed experts plus a shared expert (qwen35moe). A hybrid:
// most layers are linear attention (a gated delta-net, whose memory is a fixed-size conv and recurrent state:
// kv/recurrent_state.h), and every full_attention_interval-th layer is full attention, the only layers with
// K/V that grows with the context, so the only ones pooled and paged.
//
// Every layer is the shared pre-norm decoder layer (graph.h decoder_layer): x += mixer(rms_norm(x));
// x += ffn(rms_norm(x)); the GGUF names the FFN's norm post_attention_norm.
// Full attention: attn_q yields each head's query and an output gate side by side; per-head RMS norms on q
// and k; partial NeoX RoPE (libllama's IMROPE sections, which for text tokens rotate exactly as NeoX: every
// section gets the same position); attention * sigmoid(gate), then wo.
// Linear attention: q, k, v from one projection through a causal depthwise conv (kernel d_conv, its last
// d_conv - 1 inputs kept in the conv state), L2-normed q and k, the gated delta rule over the recurrent
// state (ggml_gated_delta_net: decay exp(softplus(alpha + dt) * a), write strength sigmoid(beta)), an
// RMS norm gated by silu(z), then ssm_out. Multi-token-prediction (nextn) layers are skipped.
#include "model/graph.h"
#include "model/gguf_meta.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace kvf {
namespace {

void log_warning(const std::string & line) {
    ggml_log_callback cb = nullptr;
    void * ud = nullptr;
    ggml_log_get(&cb, &ud);
    if (cb) cb(GGML_LOG_LEVEL_WARN, (line + "\n").c_str(), ud);
}

void read_hybrid(const gguf_context * g, ModelHparams & hp) {
    const std::string a = hp.arch + ".";
    constexpr int64_t k_max = INT32_MAX;
    // libllama counts the nextn layers in block_count and never runs them in the main pass: neither do we.
    int64_t n_nextn = 0;
    meta_int(g, a + "nextn_predict_layers", 0, hp.n_layer - 1, n_nextn);
    if (n_nextn > 0) {
        hp.n_layer -= n_nextn;
        log_warning("kvflash: " + hp.arch + ": skipping " + std::to_string(n_nextn) +
                    " multi-token-prediction (nextn) layer(s); they are not run");
    }
    hp.ssm_d_conv = meta_require_int(g, a + "ssm.conv_kernel", 2, 64);
    hp.ssm_d_inner = meta_require_int(g, a + "ssm.inner_size", 1, k_max);
    hp.ssm_d_state = meta_require_int(g, a + "ssm.state_size", 1, 4096);
    hp.ssm_dt_rank = meta_require_int(g, a + "ssm.time_step_rank", 1, 4096);
    hp.ssm_n_group = meta_require_int(g, a + "ssm.group_count", 1, 4096);
    // libllama sizes the value heads by d_state and runs them by d_inner / dt_rank: they must agree.
    if (hp.ssm_d_inner != hp.ssm_d_state * hp.ssm_dt_rank) {
        throw std::runtime_error("GGUF " + a + "ssm.inner_size=" + std::to_string(hp.ssm_d_inner) + " must equal ssm.state_size x " +
                                 "ssm.time_step_rank = " + std::to_string(hp.ssm_d_state) + " x " + std::to_string(hp.ssm_dt_rank));
    }
    if (hp.ssm_dt_rank % hp.ssm_n_group != 0) {
        throw std::runtime_error("GGUF " + a + "ssm.time_step_rank=" + std::to_string(hp.ssm_dt_rank) +
                                 " (value heads) must be a multiple of ssm.group_count=" + std::to_string(hp.ssm_n_group) + " (key heads)");
    }
    // Which layers are linear attention: one flag per layer, else every interval-th layer attends (default 4).
    if (!meta_bool_array(g, a + "attention.recurrent_layers", hp.n_layer, hp.recurrent_layers)) {
        int64_t interval = 4;
        meta_int(g, a + "full_attention_interval", 1, k_max, interval);
        hp.recurrent_layers.assign((size_t) hp.n_layer, 0);
        for (int64_t il = 0; il < hp.n_layer; ++il) hp.recurrent_layers[(size_t) il] = (il + 1) % interval != 0;
    }
    if (hp.n_pooled_layers() == 0) {
        throw std::runtime_error("GGUF " + a + "full_attention_interval leaves no full-attention layer among " +
                                 std::to_string(hp.n_layer) + ": nothing to pool");
    }
    std::vector<int64_t> sections;
    if (meta_int_array(g, a + "rope.dimension_sections", 4, 0, hp.n_rot, sections)) {
        int64_t sum = 0;
        for (int i = 0; i < 4; ++i) sum += hp.rope_sections[i] = (int) sections[(size_t) i];
        if (sum > hp.n_rot / 2) {
            throw std::runtime_error("GGUF " + a + "rope.dimension_sections sum to " + std::to_string(sum) +
                                     ", more than rope.dimension_count / 2 = " + std::to_string(hp.n_rot / 2));
        }
    }
}

void read_hybrid_moe(const gguf_context * g, ModelHparams & hp) {
    read_hybrid(g, hp);
    read_moe_hparams(g, hp, /*shared_expert =*/ true);
}

void load_layer(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    const int64_t E = hp.n_embd;
    w.attn_norm = src.require(p + "attn_norm.weight", {E});
    w.ffn_norm = src.require(p + "post_attention_norm.weight", {E});   // the norm before the FFN, whatever its name
    if (hp.is_recurrent(il)) {
        const int64_t key_dim = hp.ssm_d_state * hp.ssm_n_group, value_dim = hp.ssm_d_inner, H = hp.ssm_dt_rank;
        w.ssm_qkv = src.require(p + "attn_qkv.weight", {E, 2 * key_dim + value_dim});
        w.ssm_z = src.require(p + "attn_gate.weight", {E, value_dim});
        w.ssm_conv1d = src.require(p + "ssm_conv1d.weight", {hp.ssm_d_conv, hp.ssm_conv_channels()});
        if (w.ssm_conv1d->type != GGML_TYPE_F32) {   // ggml's ssm_conv kernels read F32 weights only
            throw std::runtime_error("tensor " + p + "ssm_conv1d.weight has type " + ggml_type_name(w.ssm_conv1d->type) +
                                     ", expected f32");
        }
        w.ssm_dt = src.require(p + "ssm_dt.bias", {H});
        w.ssm_a = src.require(p + "ssm_a", {H});
        w.ssm_beta = src.require(p + "ssm_beta.weight", {E, H});
        w.ssm_alpha = src.require(p + "ssm_alpha.weight", {E, H});
        w.ssm_norm = src.require(p + "ssm_norm.weight", {hp.ssm_head_v()});
        w.ssm_out = src.require(p + "ssm_out.weight", {value_dim, E});
    } else {
        const int64_t D = hp.head_dim_k;
        w.wq = src.require(p + "attn_q.weight", {E, 2 * D * hp.n_head_of(il)});   // queries and their output gates
        w.wk = src.require(p + "attn_k.weight", {E, hp.n_embd_k()});
        w.wv = src.require(p + "attn_v.weight", {E, hp.n_embd_v()});
        w.wo = src.require(p + "attn_output.weight", {hp.head_dim_v * hp.n_head_of(il), E});
        w.q_norm = src.require(p + "attn_q_norm.weight", {D});
        w.k_norm = src.require(p + "attn_k_norm.weight", {D});
    }
    if (hp.n_expert > 0) {
        load_moe_ffn(w, src, hp, il);
    } else {
        load_dense_ffn(w, src, hp, il);
    }
}

ggml_tensor * full_attention(GraphCtx & g, const Model & m, int il, ggml_tensor * x) {
    const ModelHparams & hp = m.hparams();
    const LayerWeights & w = m.layers[il];
    ggml_context * ctx = g.ctx;
    const int64_t D = hp.head_dim_k, H = hp.n_head_of(il), n = g.n_tokens;
    // Each head's 2*D outputs are its query, then its gate.
    ggml_tensor * qg = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, w.wq, x), 2 * D, H, n);
    ggml_tensor * q = ggml_view_3d(ctx, qg, D, H, n, qg->nb[1], qg->nb[2], 0);
    ggml_tensor * gate = ggml_view_3d(ctx, qg, D, H, n, qg->nb[1], qg->nb[2], D * ggml_element_size(qg));
    gate = ggml_cont_2d(ctx, gate, D * H, n);
    q = rope(g, m, il, rms_norm(g, q, w.q_norm, hp.rms_eps));
    ggml_tensor * k = rope(g, m, il, rms_norm(g, project_heads(g, w.wk, nullptr, x, D, hp.n_head_kv), w.k_norm, hp.rms_eps));
    ggml_tensor * v = project_heads(g, w.wv, nullptr, x, hp.head_dim_v, hp.n_head_kv);
    const float scale = hp.attn_scale > 0.0f ? hp.attn_scale : 1.0f / std::sqrt((float) D);
    ggml_tensor * out = ggml_mul(ctx, kv_attend(g, m, il, q, k, v, scale), ggml_sigmoid(ctx, gate));
    return ggml_mul_mat(ctx, w.wo, out);
}

// L2 norm over each head (ne0), as libllama writes it: rms_norm with eps / n, scaled by 1 / sqrt(n).
ggml_tensor * l2_norm(ggml_context * ctx, ggml_tensor * x, float eps) {
    const float n = (float) x->ne[0];
    return ggml_scale(ctx, ggml_rms_norm(ctx, x, eps / n), 1.0f / std::sqrt(n));
}

ggml_tensor * linear_attention(GraphCtx & g, const Model & m, int il, ggml_tensor * x) {
    const ModelHparams & hp = m.hparams();
    const LayerWeights & w = m.layers[il];
    ggml_context * ctx = g.ctx;
    const int64_t n = g.n_tokens, S = hp.ssm_d_state, Hk = hp.ssm_n_group, Hv = hp.ssm_dt_rank, Dv = hp.ssm_head_v();
    const int64_t channels = hp.ssm_conv_channels(), key_dim = S * Hk, K = hp.ssm_d_conv;
    const int64_t l = hp.kv_index(il);
    ggml_tensor * conv_state = ggml_reshape_2d(ctx, g.recurrent->conv(l), K - 1, channels);
    ggml_tensor * state = ggml_reshape_4d(ctx, g.recurrent->ssm(l), Dv, Dv, Hv, 1);

    ggml_tensor * qkv = ggml_mul_mat(ctx, w.ssm_qkv, x);   // [channels, n]
    ggml_tensor * z = ggml_mul_mat(ctx, w.ssm_z, x);       // [Dv * Hv, n]
    ggml_tensor * beta = ggml_reshape_4d(ctx, ggml_sigmoid(ctx, ggml_mul_mat(ctx, w.ssm_beta, x)), 1, Hv, n, 1);
    ggml_tensor * decay = ggml_softplus(ctx, ggml_add(ctx, ggml_mul_mat(ctx, w.ssm_alpha, x), w.ssm_dt));
    decay = ggml_reshape_4d(ctx, ggml_mul(ctx, decay, w.ssm_a), 1, Hv, n, 1);   // log of the decay: <= 0

    // The causal conv sees the kept inputs, then the step's; its last K - 1 inputs are kept for the next step.
    ggml_tensor * conv_in = ggml_concat(ctx, conv_state, ggml_transpose(ctx, qkv), 0);   // [K - 1 + n, channels]
    ggml_tensor * keep = ggml_view_2d(ctx, conv_in, K - 1, channels, conv_in->nb[1], n * ggml_element_size(conv_in));
    ggml_build_forward_expand(g.gf, ggml_cpy(ctx, keep, conv_state));
    ggml_tensor * conv = ggml_silu(ctx, ggml_ssm_conv(ctx, ggml_reshape_3d(ctx, conv_in, K - 1 + n, channels, 1), w.ssm_conv1d));

    const size_t f = ggml_element_size(conv);   // conv: [channels, n, 1]; q, k, v are its channel ranges
    ggml_tensor * q = ggml_view_4d(ctx, conv, S, Hk, n, 1, S * f, conv->nb[1], conv->nb[1] * n, 0);
    ggml_tensor * k = ggml_view_4d(ctx, conv, S, Hk, n, 1, S * f, conv->nb[1], conv->nb[1] * n, key_dim * f);
    ggml_tensor * v = ggml_view_4d(ctx, conv, Dv, Hv, n, 1, Dv * f, conv->nb[1], conv->nb[1] * n, 2 * key_dim * f);
    q = l2_norm(ctx, q, hp.rms_eps);
    k = l2_norm(ctx, k, hp.rms_eps);

    // Output [Dv, Hv, n] followed by the final state; the state goes back where it came from.
    ggml_tensor * res = ggml_gated_delta_net(ctx, q, k, v, decay, beta, state, 1);
    const size_t rf = ggml_element_size(res);
    ggml_tensor * out = ggml_view_4d(ctx, res, Dv, Hv, n, 1, Dv * rf, Dv * Hv * rf, Dv * Hv * n * rf, 0);
    ggml_tensor * next = ggml_view_4d(ctx, res, Dv, Dv, Hv, 1, Dv * rf, Dv * Dv * rf, Dv * Dv * Hv * rf, Dv * Hv * n * rf);
    ggml_build_forward_expand(g.gf, ggml_cpy(ctx, next, state));

    ggml_tensor * gated = ggml_mul(ctx, rms_norm(g, out, w.ssm_norm, hp.rms_eps),
                                   ggml_silu(ctx, ggml_reshape_4d(ctx, z, Dv, Hv, n, 1)));
    return ggml_mul_mat(ctx, w.ssm_out, ggml_reshape_2d(ctx, gated, Dv * Hv, n));
}

// The layer's mixer: linear attention (a gated delta-net) or full attention, by the layer's flag.
ggml_tensor * mixer(GraphCtx & g, const Model & m, int il, ggml_tensor * x) {
    return m.hparams().is_recurrent(il) ? linear_attention(g, m, il, x) : full_attention(g, m, il, x);
}

ggml_tensor * layer(GraphCtx & g, const Model & m, int il, ggml_tensor * x) { return decoder_layer(g, m, il, x, mixer); }

}  // namespace

extern const ArchSpec arch_qwen35, arch_qwen35moe;   // registered in registry.cpp
const ArchSpec arch_qwen35 = {"qwen35", GGML_ROPE_TYPE_NEOX, read_hybrid, load_layer, embed_tokens, layer};
const ArchSpec arch_qwen35moe = {"qwen35moe", GGML_ROPE_TYPE_NEOX, read_hybrid_moe, load_layer, embed_tokens, layer};

}  // namespace kvf
