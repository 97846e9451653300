"""Every tensor of a random GGUF, per family, in file order, with llama.cpp's names and shapes (TensorSpec: name,
ne, the kind of values it gets, its type), as the converter writes them for llama / qwen2 / qwen3 / gemma3 /
gemma4 / qwen3moe / qwen35 / qwen35moe / laguna (tensor names from gguf-py's constants). Nothing here makes
values or writes bytes.

The families beyond llama / qwen2 / qwen3 / gemma3:
  qwen3moe   qwen3's attention, every FFN replaced by n_expert routed experts (n_expert_used per token,
             width n_ff_exp); 3-D expert tensors, ne = (n_embd, n_ff_exp, n_expert) for gate/up and
             (n_ff_exp, n_embd, n_expert) for down.
  qwen35     Qwen3.5 dense hybrid: gated delta-net (linear attention) layers, and every
             full_attention_interval-th layer (layer i iff (i + 1) % interval == 0) full attention with
             an output gate (attn_q is twice as wide: queries and gate), partial interleaved M-RoPE
             (n_rot < head_dim, rope_sections). Delta-net shape: ssm_n_group key heads and ssm_dt_rank
             value heads of ssm_d_state each, a causal conv of ssm_d_conv taps.
  qwen35moe  qwen35 with routed experts plus a gated shared expert (n_ff_shexp) instead of the dense FFN;
             no feed_forward_length key, as the converter writes none for it.
  laguna     Poolside's Laguna: sigmoid-routed experts with a per-expert selection bias (exp_probs_b) and
             an ungated shared expert, the first n_layer_dense_lead layers dense (n_ff); a softplus attention
             output gate per head or per element (gate_per_element, per layer); q/k norms; n_head_swa query
             heads on the sliding-window layers (one global layer per swa_pattern period, first); YaRN on the
             global layers over n_rot dims (rope_scaling_type="yarn"), plain RoPE over n_rot_swa on the local.
  gemma4     Google Gemma 4 (text): sliding-window layers with their own head size (head_dim_swa, all of it
             rotated) beside global ones (head_dim, rope_freqs proportional-RoPE factors); q/k norms, post-attention
             and post-FFN norms; GeGLU FFN of a per-layer width (n_ff_layers); n_shared_kv last layers without K/V
             of their own; per-layer embeddings of n_embd_per_layer per layer; with n_expert, every layer also has
             routed experts (fused gate_up, per-expert down scales, a router input scale) beside its dense FFN;
             a layer_output_scale per layer. Its norms and scales are random around 1 (not ones), so a norm
             applied in the wrong place shows.
mtp=True (qwen35 / qwen35moe): one multi-token-prediction (nextn) layer after the trunk, as the converter writes
Qwen3.5's (block_count counts it, {arch}.nextn_predict_layers = 1, attention.recurrent_layers has one flag per
block, False for it): blk.N.* a full-attention block of the family (gated attention, q/k norms, the family's FFN)
and blk.N.nextn.{eh_proj, enorm, hnorm, shared_head_norm}; no nextn.embed_tokens / shared_head_head (the trunk's
are shared). Its norms are random around 1, so swapping enorm and hnorm shows; with echo they are ones and
eh_proj passes the normed embedding through, so the head, like the trunk, predicts the token it was given.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import gguf
import numpy as np
from gguf import MODEL_TENSOR as T
from gguf import GGMLQuantizationType as QT

from .gguf_shapes import HYBRID_ARCHS, MOE_ARCHS, WEIGHT_TYPES


@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]        # ggml order: ne[0] is the row length
    # "weight" (weight_type, or F32 where the converter keeps F32), "norm" (F32 ones), "bias" (F32 random), "scale"
    # (F32 in [0.5, 1.5): gemma4's norms and scales), "rope_freqs" (F32 proportional-RoPE factors), and the
    # delta-net's own F32 parameters: "conv" (ssm_conv1d), "decay" (ssm_a, negative), "dt_bias" (ssm_dt.bias); "eh_proj"
    # (a nextn layer's projection: a weight), "eh_echo" (the same of an echo model: F32 [I, 0])
    kind: str
    qtype: QT

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.ne))

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return self.n_elements // block * size


def _name(t: T, suffix: str, bid: int | None = None) -> str:
    """gguf-py's name for tensor t (of block bid), then "." + suffix; suffix "" for bare names (ssm_a)."""
    base = gguf.TENSOR_NAMES[t]
    base = base.format(bid=bid) if bid is not None else base
    return base + "." + suffix if suffix else base


@dataclass(frozen=True)
class _Dims:
    """The widths one layer's tensors are cut to (see tensor_specs for what each means)."""
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_expert: int
    n_ff_exp: int
    n_ff_shexp: int
    ssm_d_conv: int
    ssm_d_state: int
    ssm_n_group: int
    ssm_dt_rank: int


def tensor_specs(arch: str, *, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, head_dim: int, n_ff: int,
                 n_vocab: int, weight_type: str = "f32", tied_embeddings: bool = False, n_expert: int = 0,
                 n_ff_exp: int = 0, n_ff_shexp: int = 0, ssm_d_conv: int = 0, ssm_d_state: int = 0,
                 ssm_n_group: int = 0, ssm_dt_rank: int = 0, full_attention_interval: int = 4,
                 swa_layers: Sequence[bool] = (), n_head_swa: int = 0, n_layer_dense_lead: int = 0,
                 gate_per_element: Sequence[bool] = (), head_dim_swa: int = 0, n_ff_layers: Sequence[int] = (),
                 n_embd_per_layer: int = 0, split_experts: bool = False, n_nextn: int = 0) -> list[TensorSpec]:
    """Every tensor of the model, in file order, with llama.cpp's names and shapes.

    n_expert / n_ff_exp: routed experts and their width (qwen3moe, qwen35moe, laguna); n_ff_shexp: the shared
    expert's width (qwen35moe, laguna). ssm_*: the delta-net's conv taps, head size, key heads and value heads
    (qwen35*); full_attention_interval: which of their layers attend (layer i iff (i + 1) % interval == 0).
    laguna: swa_layers (one flag per layer) with n_head_swa query heads, the first n_layer_dense_lead layers
    dense, gate_per_element (one flag per layer: the attention gate per element, else per head).
    gemma4: head_dim_swa (the sliding-window layers' head size), n_ff_layers (FFN width per layer),
    n_embd_per_layer (per-layer embeddings; 0: none), n_expert (routed experts on every layer; 0: none),
    split_experts (separate gate and up expert tensors, each with per-expert scales, instead of fused gate_up).
    n_nextn: multi-token-prediction layers after the n_layer of the trunk (qwen35*; see mtp in the module doc).
    """
    wt = WEIGHT_TYPES[weight_type]
    d = _Dims(n_embd, n_head, n_head_kv, head_dim, n_ff, n_expert, n_ff_exp, n_ff_shexp, ssm_d_conv, ssm_d_state,
              ssm_n_group, ssm_dt_rank)
    specs = [TensorSpec(_name(T.TOKEN_EMBD, "weight"), (n_embd, n_vocab), "weight", wt)]
    if arch == "gemma4":
        specs += _gemma4_globals(n_layer, n_vocab, d, wt, n_embd_per_layer)
    for il in range(n_layer):
        if arch == "gemma4":
            local = bool(swa_layers and swa_layers[il])
            specs += _gemma4_layer(il, replace(d, head_dim=head_dim_swa if local else head_dim,
                                               n_ff=n_ff_layers[il] if n_ff_layers else n_ff), wt, n_embd_per_layer,
                                  split_experts)
        elif arch in HYBRID_ARCHS:
            specs += _hybrid_layer(arch, il, d, wt, attends=(il + 1) % full_attention_interval == 0)
        elif arch == "laguna":
            heads = n_head_swa if swa_layers and swa_layers[il] else n_head
            specs += _laguna_layer(il, replace(d, n_head=heads), wt, dense=il < n_layer_dense_lead,
                                   gate_per_element=bool(gate_per_element and gate_per_element[il]))
        else:
            specs += _transformer_layer(arch, il, d, wt)
    for il in range(n_layer, n_layer + n_nextn):
        specs += _hybrid_layer(arch, il, d, wt, attends=True) + _nextn(il, d, wt)
    specs.append(TensorSpec(_name(T.OUTPUT_NORM, "weight"), (n_embd,), "norm", QT.F32))
    if not tied_embeddings:
        specs.append(TensorSpec(_name(T.OUTPUT, "weight"), (n_embd, n_vocab), "weight", wt))
    return specs


def _transformer_layer(arch: str, il: int, d: _Dims, wt: QT) -> list[TensorSpec]:
    """llama / qwen2 / qwen3 / gemma3 / qwen3moe: attention then a dense or routed FFN, each pre-normed."""
    n_embd, head_dim = d.n_embd, d.head_dim
    n_q, n_kv = head_dim * d.n_head, head_dim * d.n_head_kv
    specs = [TensorSpec(_name(T.ATTN_NORM, "weight", il), (n_embd,), "norm", QT.F32),
             TensorSpec(_name(T.ATTN_Q, "weight", il), (n_embd, n_q), "weight", wt),
             TensorSpec(_name(T.ATTN_K, "weight", il), (n_embd, n_kv), "weight", wt),
             TensorSpec(_name(T.ATTN_V, "weight", il), (n_embd, n_kv), "weight", wt)]
    if arch == "qwen2":
        specs.append(TensorSpec(_name(T.ATTN_Q, "bias", il), (n_q,), "bias", QT.F32))
        specs.append(TensorSpec(_name(T.ATTN_K, "bias", il), (n_kv,), "bias", QT.F32))
        specs.append(TensorSpec(_name(T.ATTN_V, "bias", il), (n_kv,), "bias", QT.F32))
    if arch in ("qwen3", "gemma3", "qwen3moe"):
        specs.append(TensorSpec(_name(T.ATTN_Q_NORM, "weight", il), (head_dim,), "norm", QT.F32))
        specs.append(TensorSpec(_name(T.ATTN_K_NORM, "weight", il), (head_dim,), "norm", QT.F32))
    specs.append(TensorSpec(_name(T.ATTN_OUT, "weight", il), (n_q, n_embd), "weight", wt))
    if arch == "gemma3":
        specs.append(TensorSpec(_name(T.ATTN_POST_NORM, "weight", il), (n_embd,), "norm", QT.F32))
    specs.append(TensorSpec(_name(T.FFN_NORM, "weight", il), (n_embd,), "norm", QT.F32))
    specs += _routed_experts(il, d, wt) if arch in MOE_ARCHS else _dense_ffn(il, d, wt)
    if arch == "gemma3":
        specs.append(TensorSpec(_name(T.FFN_POST_NORM, "weight", il), (n_embd,), "norm", QT.F32))
    return specs


def _laguna_layer(il: int, d: _Dims, wt: QT, dense: bool, gate_per_element: bool) -> list[TensorSpec]:
    """Attention with q/k norms and a softplus output gate (attn_gate: one output per head or per element), then
    a dense FFN or routed experts (with their selection bias) beside an ungated shared expert."""
    n_q, n_kv = d.head_dim * d.n_head, d.head_dim * d.n_head_kv
    specs = [TensorSpec(_name(T.ATTN_NORM, "weight", il), (d.n_embd,), "norm", QT.F32),
             TensorSpec(_name(T.ATTN_Q, "weight", il), (d.n_embd, n_q), "weight", wt),
             TensorSpec(_name(T.ATTN_K, "weight", il), (d.n_embd, n_kv), "weight", wt),
             TensorSpec(_name(T.ATTN_V, "weight", il), (d.n_embd, n_kv), "weight", wt),
             TensorSpec(_name(T.ATTN_Q_NORM, "weight", il), (d.head_dim,), "norm", QT.F32),
             TensorSpec(_name(T.ATTN_K_NORM, "weight", il), (d.head_dim,), "norm", QT.F32),
             TensorSpec(_name(T.ATTN_GATE, "weight", il), (d.n_embd, n_q if gate_per_element else d.n_head),
                        "weight", wt),
             TensorSpec(_name(T.ATTN_OUT, "weight", il), (n_q, d.n_embd), "weight", wt),
             TensorSpec(_name(T.FFN_NORM, "weight", il), (d.n_embd,), "norm", QT.F32)]
    if dense:
        return specs + _dense_ffn(il, d, wt)
    f = d.n_ff_shexp
    return specs + _routed_experts(il, d, wt) + [
        TensorSpec(_name(T.FFN_EXP_PROBS_B, "bias", il), (d.n_expert,), "bias", QT.F32),
        TensorSpec(_name(T.FFN_GATE_SHEXP, "weight", il), (d.n_embd, f), "weight", wt),
        TensorSpec(_name(T.FFN_UP_SHEXP, "weight", il), (d.n_embd, f), "weight", wt),
        TensorSpec(_name(T.FFN_DOWN_SHEXP, "weight", il), (f, d.n_embd), "weight", wt)]


def _gemma4_globals(n_layer: int, n_vocab: int, d: _Dims, wt: QT, n_embd_per_layer: int) -> list[TensorSpec]:
    """The global layers' proportional-RoPE factors (one tensor, libllama reads it for each), and the per-layer
    embeddings' token rows, projection and norm."""
    specs = [TensorSpec(_name(T.ROPE_FREQS, "weight"), (d.head_dim // 2,), "rope_freqs", QT.F32)]
    if n_embd_per_layer:
        width = n_embd_per_layer * n_layer
        specs += [TensorSpec(_name(T.PER_LAYER_TOKEN_EMBD, "weight"), (width, n_vocab), "weight", wt),
                  TensorSpec(_name(T.PER_LAYER_MODEL_PROJ, "weight"), (d.n_embd, width), "weight", wt),
                  TensorSpec(_name(T.PER_LAYER_PROJ_NORM, "weight"), (n_embd_per_layer,), "scale", QT.F32)]
    return specs


def _gemma4_layer(il: int, d: _Dims, wt: QT, n_embd_per_layer: int, split_experts: bool) -> list[TensorSpec]:
    """Attention with q/k norms and a post-norm, a GeGLU FFN with a post-norm (beside routed experts with their own
    norms when n_expert), the per-layer embedding's gate, projection and norm, the layer's output scale. K and V
    are written for every layer, as the converter does; libllama ignores them on shared-KV layers."""
    e, n_q, n_kv = d.n_embd, d.head_dim * d.n_head, d.head_dim * d.n_head_kv
    specs = [TensorSpec(_name(T.ATTN_NORM, "weight", il), (e,), "scale", QT.F32),
             TensorSpec(_name(T.ATTN_Q, "weight", il), (e, n_q), "weight", wt),
             TensorSpec(_name(T.ATTN_Q_NORM, "weight", il), (d.head_dim,), "scale", QT.F32),
             TensorSpec(_name(T.ATTN_K, "weight", il), (e, n_kv), "weight", wt),
             TensorSpec(_name(T.ATTN_K_NORM, "weight", il), (d.head_dim,), "scale", QT.F32),
             TensorSpec(_name(T.ATTN_V, "weight", il), (e, n_kv), "weight", wt),
             TensorSpec(_name(T.ATTN_OUT, "weight", il), (n_q, e), "weight", wt),
             TensorSpec(_name(T.ATTN_POST_NORM, "weight", il), (e,), "scale", QT.F32),
             TensorSpec(_name(T.FFN_NORM, "weight", il), (e,), "scale", QT.F32)]
    specs += _dense_ffn(il, d, wt)
    specs.append(TensorSpec(_name(T.FFN_POST_NORM, "weight", il), (e,), "scale", QT.F32))
    if d.n_expert:
        x, f = d.n_expert, d.n_ff_exp
        specs += [TensorSpec(_name(T.FFN_GATE_INP, "weight", il), (e, x), "weight", QT.F32),
                  TensorSpec(_name(T.FFN_GATE_INP, "scale", il), (e,), "scale", QT.F32),
                  TensorSpec(_name(T.FFN_PRE_NORM_2, "weight", il), (e,), "scale", QT.F32),
                  TensorSpec(_name(T.FFN_POST_NORM_1, "weight", il), (e,), "scale", QT.F32),
                  TensorSpec(_name(T.FFN_POST_NORM_2, "weight", il), (e,), "scale", QT.F32)]
        if split_experts:   # libllama reads these scales only beside separate gate and up tensors
            specs += [TensorSpec(_name(T.FFN_GATE_EXP, "weight", il), (e, f, x), "weight", wt),
                      TensorSpec(_name(T.FFN_GATE_EXP, "scale", il), (x,), "scale", QT.F32),
                      TensorSpec(_name(T.FFN_UP_EXP, "weight", il), (e, f, x), "weight", wt),
                      TensorSpec(_name(T.FFN_UP_EXP, "scale", il), (x,), "scale", QT.F32)]
        else:
            specs.append(TensorSpec(_name(T.FFN_GATE_UP_EXP, "weight", il), (e, 2 * f, x), "weight", wt))
        specs += [TensorSpec(_name(T.FFN_DOWN_EXP, "weight", il), (f, e, x), "weight", wt),
                  TensorSpec(_name(T.FFN_DOWN_EXP, "scale", il), (x,), "scale", QT.F32)]
    if n_embd_per_layer:
        specs += [TensorSpec(_name(T.PER_LAYER_INP_GATE, "weight", il), (e, n_embd_per_layer), "weight", wt),
                  TensorSpec(_name(T.PER_LAYER_PROJ, "weight", il), (n_embd_per_layer, e), "weight", wt),
                  TensorSpec(_name(T.PER_LAYER_POST_NORM, "weight", il), (e,), "scale", QT.F32)]
    return specs + [TensorSpec(_name(T.LAYER_OUT_SCALE, "weight", il), (1,), "scale", QT.F32)]


def _hybrid_layer(arch: str, il: int, d: _Dims, wt: QT, attends: bool) -> list[TensorSpec]:
    """qwen35 / qwen35moe: gated attention or gated delta-net, post-attention norm, dense FFN or experts."""
    specs = [TensorSpec(_name(T.ATTN_NORM, "weight", il), (d.n_embd,), "norm", QT.F32)]
    specs += _gated_attention(il, d, wt) if attends else _delta_net(il, d, wt)
    # Qwen3.5 names its FFN pre-norm post_attention_layernorm: libllama's ATTN_POST_NORM, there is no ffn_norm
    specs.append(TensorSpec(_name(T.ATTN_POST_NORM, "weight", il), (d.n_embd,), "norm", QT.F32))
    if arch == "qwen35moe":
        return specs + _routed_experts(il, d, wt) + _shared_expert(il, d, wt)
    return specs + _dense_ffn(il, d, wt)


def _gated_attention(il: int, d: _Dims, wt: QT) -> list[TensorSpec]:
    """Full attention whose attn_q also projects a per-head output gate: queries and gate interleaved per head,
    so its output width is twice n_head * head_dim."""
    n_q, n_kv = d.head_dim * d.n_head, d.head_dim * d.n_head_kv
    return [TensorSpec(_name(T.ATTN_Q, "weight", il), (d.n_embd, 2 * n_q), "weight", wt),
            TensorSpec(_name(T.ATTN_K, "weight", il), (d.n_embd, n_kv), "weight", wt),
            TensorSpec(_name(T.ATTN_V, "weight", il), (d.n_embd, n_kv), "weight", wt),
            TensorSpec(_name(T.ATTN_Q_NORM, "weight", il), (d.head_dim,), "norm", QT.F32),
            TensorSpec(_name(T.ATTN_K_NORM, "weight", il), (d.head_dim,), "norm", QT.F32),
            TensorSpec(_name(T.ATTN_OUT, "weight", il), (n_q, d.n_embd), "weight", wt)]


def _nextn(il: int, d: _Dims, wt: QT) -> list[TensorSpec]:
    """A multi-token-prediction layer's own tensors: the projection of [enorm(embedding), hnorm(hidden)] into the
    block's input, those norms, and the norm before the (shared) head."""
    e = d.n_embd
    return [TensorSpec(_name(T.NEXTN_EH_PROJ, "weight", il), (2 * e, e), "eh_proj", wt),
            TensorSpec(_name(T.NEXTN_ENORM, "weight", il), (e,), "scale", QT.F32),
            TensorSpec(_name(T.NEXTN_HNORM, "weight", il), (e,), "scale", QT.F32),
            TensorSpec(_name(T.NEXTN_SHARED_HEAD_NORM, "weight", il), (e,), "scale", QT.F32)]


def _delta_net(il: int, d: _Dims, wt: QT) -> list[TensorSpec]:
    """Gated delta-net, in libllama's layout: q, k (ssm_n_group heads) and v (ssm_dt_rank heads), all of
    ssm_d_state, come from one attn_qkv projection and a depthwise causal conv over its channels."""
    key_dim, value_dim = d.ssm_d_state * d.ssm_n_group, d.ssm_d_state * d.ssm_dt_rank
    conv_dim = 2 * key_dim + value_dim
    return [TensorSpec(_name(T.ATTN_QKV, "weight", il), (d.n_embd, conv_dim), "weight", wt),
            TensorSpec(_name(T.ATTN_GATE, "weight", il), (d.n_embd, value_dim), "weight", wt),
            # ggml_ssm_conv reads its kernel as F32, and the converter keeps SSM_CONV1D F32 whatever the type
            TensorSpec(_name(T.SSM_CONV1D, "weight", il), (d.ssm_d_conv, conv_dim), "conv", QT.F32),
            TensorSpec(_name(T.SSM_DT, "bias", il), (d.ssm_dt_rank,), "dt_bias", QT.F32),
            TensorSpec(_name(T.SSM_A, "", il), (d.ssm_dt_rank,), "decay", QT.F32),    # -exp(A_log): no suffix
            TensorSpec(_name(T.SSM_BETA, "weight", il), (d.n_embd, d.ssm_dt_rank), "weight", wt),
            TensorSpec(_name(T.SSM_ALPHA, "weight", il), (d.n_embd, d.ssm_dt_rank), "weight", wt),
            TensorSpec(_name(T.SSM_NORM, "weight", il), (d.ssm_d_state,), "norm", QT.F32),
            TensorSpec(_name(T.SSM_OUT, "weight", il), (value_dim, d.n_embd), "weight", wt)]


def _dense_ffn(il: int, d: _Dims, wt: QT) -> list[TensorSpec]:
    return [TensorSpec(_name(T.FFN_GATE, "weight", il), (d.n_embd, d.n_ff), "weight", wt),
            TensorSpec(_name(T.FFN_UP, "weight", il), (d.n_embd, d.n_ff), "weight", wt),
            TensorSpec(_name(T.FFN_DOWN, "weight", il), (d.n_ff, d.n_embd), "weight", wt)]


def _routed_experts(il: int, d: _Dims, wt: QT) -> list[TensorSpec]:
    """The router (F32: the converter and llama-quantize never quantize ffn_gate_inp) and the experts stacked
    into 3-D tensors, expert index outermost."""
    e, f = d.n_expert, d.n_ff_exp
    return [TensorSpec(_name(T.FFN_GATE_INP, "weight", il), (d.n_embd, e), "weight", QT.F32),
            TensorSpec(_name(T.FFN_GATE_EXP, "weight", il), (d.n_embd, f, e), "weight", wt),
            TensorSpec(_name(T.FFN_UP_EXP, "weight", il), (d.n_embd, f, e), "weight", wt),
            TensorSpec(_name(T.FFN_DOWN_EXP, "weight", il), (f, d.n_embd, e), "weight", wt)]


def _shared_expert(il: int, d: _Dims, wt: QT) -> list[TensorSpec]:
    """qwen35moe's shared expert and its sigmoid gate (one output: a 1-D F32 tensor, as the converter writes it)."""
    f = d.n_ff_shexp
    return [TensorSpec(_name(T.FFN_GATE_INP_SHEXP, "weight", il), (d.n_embd,), "weight", QT.F32),
            TensorSpec(_name(T.FFN_GATE_SHEXP, "weight", il), (d.n_embd, f), "weight", wt),
            TensorSpec(_name(T.FFN_UP_SHEXP, "weight", il), (d.n_embd, f), "weight", wt),
            TensorSpec(_name(T.FFN_DOWN_SHEXP, "weight", il), (f, d.n_embd), "weight", wt)]
