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
// RMS norm gated by silu(z), then ssm_out.
// Multi-token prediction (MtpArch, run by model/mtp.cpp): the first nextn layer after the trunk is a full-attention
// block like the trunk's (its FFN the family's: dense or experts), loaded only for a session that drafts with it.
#include "model/ffn.h"
#include "model/graph.h"
#include "model/gguf_meta.h"
#include "kv/pool_arena.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace kvf {
namespace {

void read_hybrid(const gguf_context * g, ModelHparams & hp) {
    const std::string a = hp.arch + ".";
    constexpr int64_t k_max = INT32_MAX;
    // libllama counts the nextn layers in block_count and never runs them in the main pass: neither do we.
    meta_int(g, a + "nextn_predict_layers", 0, hp.n_layer - 1, hp.n_layer_nextn);
    hp.n_layer -= hp.n_layer_nextn;
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
    // Which layers are linear attention: one flag per layer (the converter writes one per block, the nextn layers'
    // false, as they attend), else every interval-th layer attends (default 4).
    if (meta_bool_array(g, a + "attention.recurrent_layers", hp.n_layer + hp.n_layer_nextn, hp.recurrent_layers)) {
        for (int64_t il = hp.n_layer; il < hp.n_layer + hp.n_layer_nextn; ++il) {
            if (hp.recurrent_layers[(size_t) il]) {
                throw std::runtime_error("GGUF " + a + "attention.recurrent_layers flags nextn layer " + std::to_string(il) +
                                         " as linear attention; a multi-token-prediction layer attends");
            }
        }
        hp.recurrent_layers.resize((size_t) hp.n_layer);
    } else {
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

// A full-attention layer's tensors: attn_q yields each head's query and output gate side by side.
void load_gated_attention(LayerWeights & w, TensorSource & src, const ModelHparams & hp, const std::string & p,
                          int64_t n_head) {
    const int64_t E = hp.n_embd, D = hp.head_dim_k;
    w.wq = src.require(p + "attn_q.weight", {E, 2 * D * n_head});
    w.wk = src.require(p + "attn_k.weight", {E, hp.n_embd_k()});
    w.wv = src.require(p + "attn_v.weight", {E, hp.n_embd_v()});
    w.wo = src.require(p + "attn_output.weight", {hp.head_dim_v * n_head, E});
    w.q_norm = src.require(p + "attn_q_norm.weight", {D});
    w.k_norm = src.require(p + "attn_k_norm.weight", {D});
}

void load_ffn(LayerWeights & w, TensorSource & src, const ModelHparams & hp, int il) {
    if (hp.n_expert > 0) {
        load_moe_ffn(w, src, hp, il);
    } else {
        load_dense_ffn(w, src, hp, il);
    }
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
        load_gated_attention(w, src, hp, p, hp.n_head_of(il));
    }
    load_ffn(w, src, hp, il);
}

// Full attention's pieces, shared by the trunk's layers and the MTP block (w): K and V of the step's tokens
// ([head_dim, n_head_kv, n_tokens], K normed and rotated), and the queries with their output gates.
struct GatedQuery {
    ggml_tensor * q;      // [head_dim, n_head, n_tokens], normed and rotated
    ggml_tensor * gate;   // [head_dim * n_head, n_tokens]
};

// il: the layer (n_layer: the MTP block), for its device's copy of the RoPE factors.
void gated_kv(GraphCtx & g, const Model & m, int64_t il, const LayerWeights & w, ggml_tensor * x, ggml_tensor *& k,
              ggml_tensor *& v) {
    const ModelHparams & hp = m.hparams();
    k = rope_global(g, m, il, rms_norm(g, project_heads(g, w.wk, nullptr, x, hp.head_dim_k, hp.n_head_kv), w.k_norm, hp.rms_eps));
    v = project_heads(g, w.wv, nullptr, x, hp.head_dim_v, hp.n_head_kv);
}

GatedQuery gated_query(GraphCtx & g, const Model & m, int64_t il, const LayerWeights & w, int64_t n_head, ggml_tensor * x) {
    const ModelHparams & hp = m.hparams();
    ggml_context * ctx = g.ctx;
    const int64_t D = hp.head_dim_k, n = g.n_tokens;
    // Each head's 2*D outputs are its query, then its gate.
    ggml_tensor * qg = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, w.wq, x), 2 * D, n_head, n);
    ggml_tensor * q = ggml_view_3d(ctx, qg, D, n_head, n, qg->nb[1], qg->nb[2], 0);
    ggml_tensor * gate = ggml_view_3d(ctx, qg, D, n_head, n, qg->nb[1], qg->nb[2], D * ggml_element_size(qg));
    return {rope_global(g, m, il, rms_norm(g, q, w.q_norm, hp.rms_eps)), ggml_cont_2d(ctx, gate, D * n_head, n)};
}

float attention_scale(const ModelHparams & hp) {
    return hp.attn_scale > 0.0f ? hp.attn_scale : 1.0f / std::sqrt((float) hp.head_dim_k);
}

// The attention output ([head_dim_v * n_head, n_tokens]) gated and projected back.
ggml_tensor * gated_output(GraphCtx & g, const LayerWeights & w, ggml_tensor * attn, ggml_tensor * gate) {
    return ggml_mul_mat(g.ctx, w.wo, ggml_mul(g.ctx, attn, ggml_sigmoid(g.ctx, gate)));
}

ggml_tensor * full_attention(GraphCtx & g, const Model & m, int il, ggml_tensor * x) {
    const LayerWeights & w = m.layers[il];
    const GatedQuery qg = gated_query(g, m, il, w, m.hparams().n_head_of(il), x);
    ggml_tensor * k, * v;
    gated_kv(g, m, il, w, x, k, v);
    return gated_output(g, w, kv_attend(g, m, il, qg.q, k, v, attention_scale(m.hparams())), qg.gate);
}

// L2 norm over each head (ne0), as libllama writes it: rms_norm with eps / n, scaled by 1 / sqrt(n).
ggml_tensor * l2_norm(ggml_context * ctx, ggml_tensor * x, float eps) {
    const float n = (float) x->ne[0];
    return ggml_scale(ctx, ggml_rms_norm(ctx, x, eps / n), 1.0f / std::sqrt(n));
}

// What the delta rule reads of every token of a step, projected from the normed input in one pass over the
// weights, whichever sequence each token belongs to.
struct DeltaInputs {
    ggml_tensor * qkv;     // [channels, n]: the conv's input
    ggml_tensor * decay;   // [1, Hv, n, 1]: log of the decay, <= 0
    ggml_tensor * beta;    // [1, Hv, n, 1]: write strength
};

// The causal conv and the gated delta rule for tokens [t0, t0 + n_t * n_s) of the step: n_s sequences of n_t tokens
// each, whose states conv_state [K - 1, channels, n_s] and state [Dv, Dv, Hv, n_s] they read and overwrite in place
// (one session's own, or a run of an arena's lanes). The output: [Dv, Hv, n_t * n_s, 1].
ggml_tensor * delta_rule(GraphCtx & g, const ModelHparams & hp, const LayerWeights & w, ggml_tensor * conv_state,
                         ggml_tensor * state, const DeltaInputs & in, int64_t t0, int64_t n_t, int64_t n_s) {
    ggml_context * ctx = g.ctx;
    const int64_t S = hp.ssm_d_state, Hk = hp.ssm_n_group, Hv = hp.ssm_dt_rank, Dv = hp.ssm_head_v();
    const int64_t channels = hp.ssm_conv_channels(), key_dim = S * Hk, K = hp.ssm_d_conv;
    ggml_tensor * qkv = ggml_view_3d(ctx, in.qkv, channels, n_t, n_s, in.qkv->nb[1], n_t * in.qkv->nb[1],
                                     t0 * in.qkv->nb[1]);
    auto tokens = [&](ggml_tensor * x) {   // [1, Hv, n_t, n_s] of the step's [1, Hv, n_tokens, 1]
        return ggml_view_4d(ctx, x, 1, Hv, n_t, n_s, x->nb[1], x->nb[2], n_t * x->nb[2], t0 * x->nb[2]);
    };

    // The causal conv sees the kept inputs, then the step's; its last K - 1 inputs are kept for the next step.
    ggml_tensor * conv_in = ggml_concat(ctx, conv_state, ggml_permute(ctx, qkv, 1, 0, 2, 3), 0);   // [K - 1 + n_t, channels, n_s]
    ggml_tensor * keep = ggml_view_3d(ctx, conv_in, K - 1, channels, n_s, conv_in->nb[1], conv_in->nb[2],
                                      n_t * ggml_element_size(conv_in));
    ggml_build_forward_expand(g.gf, ggml_cpy(ctx, keep, conv_state));
    ggml_tensor * conv = ggml_silu(ctx, ggml_ssm_conv(ctx, conv_in, w.ssm_conv1d));   // [channels, n_t, n_s]

    const size_t f = ggml_element_size(conv);   // q, k, v are the conv's channel ranges
    ggml_tensor * q = ggml_view_4d(ctx, conv, S, Hk, n_t, n_s, S * f, conv->nb[1], conv->nb[2], 0);
    ggml_tensor * k = ggml_view_4d(ctx, conv, S, Hk, n_t, n_s, S * f, conv->nb[1], conv->nb[2], key_dim * f);
    ggml_tensor * v = ggml_view_4d(ctx, conv, Dv, Hv, n_t, n_s, Dv * f, conv->nb[1], conv->nb[2], 2 * key_dim * f);
    q = l2_norm(ctx, q, hp.rms_eps);
    k = l2_norm(ctx, k, hp.rms_eps);

    // Output [Dv, Hv, n_t, n_s] followed by the final states; the states go back where they came from.
    ggml_tensor * res = ggml_gated_delta_net(ctx, q, k, v, tokens(in.decay), tokens(in.beta), state, 1);
    const size_t rf = ggml_element_size(res);
    const int64_t n = n_t * n_s;
    ggml_tensor * out = ggml_view_4d(ctx, res, Dv, Hv, n, 1, Dv * rf, Dv * Hv * rf, Dv * Hv * n * rf, 0);
    ggml_tensor * next = ggml_view_4d(ctx, res, Dv, Dv, Hv, n_s, Dv * rf, Dv * Dv * rf, Dv * Dv * Hv * rf, Dv * Hv * n * rf);
    ggml_build_forward_expand(g.gf, ggml_cpy(ctx, next, state));
    return out;
}

// A layer's conv or recurrent state of n_s sequences ([elems] or [elems, n_s], contiguous), shaped for delta_rule.
ggml_tensor * conv_state_of(ggml_context * ctx, const ModelHparams & hp, ggml_tensor * t) {
    return ggml_reshape_3d(ctx, t, hp.ssm_d_conv - 1, hp.ssm_conv_channels(), ggml_nelements(t) / hp.ssm_conv_state());
}
ggml_tensor * ssm_state_of(ggml_context * ctx, const ModelHparams & hp, ggml_tensor * t) {
    return ggml_reshape_4d(ctx, t, hp.ssm_head_v(), hp.ssm_head_v(), hp.ssm_dt_rank, ggml_nelements(t) / hp.ssm_recurrent_state());
}

// The projections read the weights once for the step's tokens, whichever sequences they belong to; the conv and the
// delta rule then run over one session's state (a step of one session), over each run of an arena's lanes (a batched
// decode: g.recurrent_arena), or over each session's own state and tokens (g.lane_recurrent: a batched step whose
// states are not one arena's lanes, or a verify step of several tokens a session); the outputs go through the gate
// and ssm_out together again.
ggml_tensor * linear_attention(GraphCtx & g, const Model & m, int il, ggml_tensor * x) {
    const ModelHparams & hp = m.hparams();
    const LayerWeights & w = m.layers[il];
    ggml_context * ctx = g.ctx;
    const int64_t n = g.n_tokens, Hv = hp.ssm_dt_rank, Dv = hp.ssm_head_v();
    const int64_t l = hp.kv_index(il);

    DeltaInputs in;
    in.qkv = ggml_mul_mat(ctx, w.ssm_qkv, x);             // [channels, n]
    ggml_tensor * z = ggml_mul_mat(ctx, w.ssm_z, x);       // [Dv * Hv, n]
    in.beta = ggml_reshape_4d(ctx, ggml_sigmoid(ctx, ggml_mul_mat(ctx, w.ssm_beta, x)), 1, Hv, n, 1);
    ggml_tensor * decay = ggml_softplus(ctx, ggml_add(ctx, ggml_mul_mat(ctx, w.ssm_alpha, x), w.ssm_dt));
    in.decay = ggml_reshape_4d(ctx, ggml_mul(ctx, decay, w.ssm_a), 1, Hv, n, 1);

    ggml_tensor * out = nullptr;   // [Dv, Hv, n, 1]
    auto append = [&](ggml_tensor * o) { out = out ? ggml_concat(ctx, out, o, 2) : o; };
    if (const PoolArena * arena = g.recurrent_arena.arena) {
        for (const GraphCtx::LaneRun & r : g.recurrent_arena.runs) {
            append(delta_rule(g, hp, w, conv_state_of(ctx, hp, arena->conv_lanes(ctx, l, r.lane, r.n)),
                              ssm_state_of(ctx, hp, arena->ssm_lanes(ctx, l, r.lane, r.n)), in, r.token, 1, r.n));
        }
    } else if (!g.lane_recurrent.empty()) {
        for (const GraphCtx::LaneState & r : g.lane_recurrent) {
            const RecurrentState & rs = *r.state;
            append(delta_rule(g, hp, w, conv_state_of(ctx, hp, rs.conv(l)), ssm_state_of(ctx, hp, rs.ssm(l)), in, r.t0, r.n, 1));
        }
    } else {
        const RecurrentState & rs = *g.recurrent;
        append(delta_rule(g, hp, w, conv_state_of(ctx, hp, rs.conv(l)), ssm_state_of(ctx, hp, rs.ssm(l)), in, 0, n, 1));
    }
    ggml_tensor * gated = ggml_mul(ctx, rms_norm(g, out, w.ssm_norm, hp.rms_eps),
                                   ggml_silu(ctx, ggml_reshape_4d(ctx, z, Dv, Hv, n, 1)));
    return ggml_mul_mat(ctx, w.ssm_out, ggml_reshape_2d(ctx, gated, Dv * Hv, n));
}

// The layer's mixer: linear attention (a gated delta-net) or full attention, by the layer's flag.
ggml_tensor * mixer(GraphCtx & g, const Model & m, int il, ggml_tensor * x) {
    return m.hparams().is_recurrent(il) ? linear_attention(g, m, il, x) : full_attention(g, m, il, x);
}

ggml_tensor * layer(GraphCtx & g, const Model & m, int il, ggml_tensor * x) { return decoder_layer(g, m, il, x, mixer); }

// ---- multi-token prediction: the nextn layer, as libllama's qwen35 / qwen35moe load_block_mtp and graph_mtp ----

void load_mtp(MtpWeights & w, TensorSource & src, const ModelHparams & hp, int il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    const int64_t E = hp.n_embd;
    w.block.attn_norm = src.require(p + "attn_norm.weight", {E});
    w.block.ffn_norm = src.require(p + "post_attention_norm.weight", {E});
    load_gated_attention(w.block, src, hp, p, hp.n_head);
    load_ffn(w.block, src, hp, il);
    w.eh_proj = src.require(p + "nextn.eh_proj.weight", {2 * E, E});
    w.enorm = src.require(p + "nextn.enorm.weight", {E});
    w.hnorm = src.require(p + "nextn.hnorm.weight", {E});
    // Qwen3.5's converter writes none of these three: the trunk's embeddings, output norm and head serve.
    w.embed_tokens = src.optional(p + "nextn.embed_tokens.weight", {E, hp.n_vocab});
    w.head_norm = src.optional(p + "nextn.shared_head_norm.weight", {E});
    w.head = src.optional(p + "nextn.shared_head_head.weight", {E, hp.n_vocab});
}

// Only K and V of the block: what the trunk's steps write for the head's later drafts (no query, no attention).
void mtp_write_kv(GraphCtx & g, const Model & m, ggml_tensor * x) {
    const LayerWeights & w = m.mtp.block;
    ggml_tensor * k, * v;
    gated_kv(g, m, m.hparams().n_layer, w, rms_norm(g, x, w.attn_norm, m.hparams().rms_eps), k, v);
    pool_write(g, g.mtp_kv_layer, k, v);
}

ggml_tensor * mtp_block(GraphCtx & g, const Model & m, ggml_tensor * x) {
    const ModelHparams & hp = m.hparams();
    const LayerWeights & w = m.mtp.block;
    ggml_tensor * xn = rms_norm(g, x, w.attn_norm, hp.rms_eps);
    const GatedQuery qg = gated_query(g, m, hp.n_layer, w, hp.n_head, xn);
    ggml_tensor * k, * v;
    gated_kv(g, m, hp.n_layer, w, xn, k, v);
    ggml_tensor * attn = pool_attend(g, g.mtp_kv_layer, qg.q, k, v, attention_scale(hp));
    x = ggml_add(g.ctx, x, gated_output(g, w, attn, qg.gate));
    return add_layer_ffn(g, hp, w, x);
}

const MtpArch mtp_qwen35 = {load_mtp, mtp_write_kv, mtp_block};

}  // namespace

extern const ArchSpec arch_qwen35, arch_qwen35moe;   // registered in registry.cpp
const ArchSpec arch_qwen35 = {"qwen35", GGML_ROPE_TYPE_NEOX, read_hybrid, load_layer, embed_tokens, layer, &mtp_qwen35};
const ArchSpec arch_qwen35moe = {"qwen35moe", GGML_ROPE_TYPE_NEOX, read_hybrid_moe, load_layer, embed_tokens, layer,
                                 &mtp_qwen35};

}  // namespace kvf
