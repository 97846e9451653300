"""The families a random GGUF may be of, the named shapes (SHAPES), and the checks of a shape's options.

The checks raise ValueError naming the option at fault; the layouts they derive (which layers have the sliding
window, laguna's query heads per layer, the rotated dims and M-RoPE sections) are what the writer writes.
"""
from __future__ import annotations

from typing import Sequence

import gguf
from gguf import GGMLQuantizationType as QT

ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "gemma4", "qwen3moe", "qwen35", "qwen35moe", "laguna")
MOE_ARCHS = ("qwen3moe", "qwen35moe", "laguna")   # routed experts instead of the dense FFN
SWA_ARCHS = ("gemma3", "gemma4", "laguna")   # sliding-window layers beside the global ones
HYBRID_ARCHS = ("qwen35", "qwen35moe")       # gated delta-net layers + every interval-th layer full attention
PARTIAL_ROTARY_ARCHS = HYBRID_ARCHS + ("laguna", "gemma4")   # RoPE over part of the (global) head
WEIGHT_TYPES = {"f32": QT.F32, "f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0}

# Named shapes. The 8B ones follow the published configs (Llama 3.1 8B keeps its 128K context but
# plain RoPE, without the llama3 frequency factors; Qwen3 8B as released).
SHAPES: dict[str, dict] = {
    "tiny-llama": dict(arch="llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff=256,
                       n_vocab=1000, n_ctx_train=4096),
    "tiny-qwen2": dict(arch="qwen2", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff=256,
                       n_vocab=1000, n_ctx_train=4096),
    # head_dim * n_head != n_embd, as in the real Qwen3 models
    "tiny-qwen3": dict(arch="qwen3", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128,
                       n_vocab=1000, n_ctx_train=4096),
    # sliding-window layers 0 and 2 (window 96: not a chunk multiple), global layers 1 and 3
    "tiny-gemma3": dict(arch="gemma3", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128,
                        n_vocab=1000, n_ctx_train=4096, n_swa=96, swa_pattern=2, rope_freq_base=1000000.0),
    # gemma4: local layers 0, 1, 3, 4 (window 96, head 32), global 2 and 5 (head 64); per-layer embeddings of 32;
    # FFN widths per layer; no shared K/V (tests ask for it by override:
    # n_shared_kv=3 makes local layers 3 and 4 attend layer 1's K/V and global layer 5 layer 2's), no experts (n_expert=4, n_expert_used=2,
    # n_ff_exp=64 by override).
    "tiny-gemma4": dict(arch="gemma4", n_layer=6, n_embd=64, n_head=4, n_head_kv=2, head_dim=64, head_dim_swa=32,
                        n_ff=128, n_ff_layers=(128, 96, 128, 160, 128, 96), n_vocab=1000, n_ctx_train=4096, n_swa=96,
                        swa_pattern=3, rope_freq_base=1000000.0, rope_freq_base_swa=10000.0, n_embd_per_layer=32,
                        logit_softcap=30.0),
    # Gemma 3 4B / 12B as released: 5 sliding-window layers (1024) to each global one, linear RoPE scaling 8
    # on the global layers, the 262K vocabulary.
    "gemma3-4b": dict(arch="gemma3", n_layer=34, n_embd=2560, n_head=8, n_head_kv=4, head_dim=256, n_ff=10240,
                      n_vocab=262144, n_ctx_train=131072, n_swa=1024, rope_freq_base=1000000.0,
                      rope_scaling_factor=8.0, tied_embeddings=True),
    "gemma3-12b": dict(arch="gemma3", n_layer=48, n_embd=3840, n_head=16, n_head_kv=8, head_dim=256, n_ff=15360,
                       n_vocab=262144, n_ctx_train=131072, n_swa=1024, rope_freq_base=1000000.0,
                       rope_scaling_factor=8.0, tied_embeddings=True),
    # Llama 3.2 1B as released (tied embeddings, the 128K vocabulary of the 8B): a draft for the 8B shape.
    "llama3.2-1b": dict(arch="llama", n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, head_dim=64, n_ff=8192,
                        n_vocab=128256, n_ctx_train=131072, rope_freq_base=500000.0, rms_eps=1e-5,
                        tied_embeddings=True),
    "llama3-8b": dict(arch="llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=14336,
                      n_vocab=128256, n_ctx_train=131072, rope_freq_base=500000.0, rms_eps=1e-5),
    # Llama 3 70B's layer shapes (Llama 3.1's 131072 positions, as the 8B preset): ~38 GiB in Q4_0, more than one
    # 40-80 GiB GPU holds beside a long context: the layer split's shape (issue 40).
    "llama3-70b": dict(arch="llama", n_layer=80, n_embd=8192, n_head=64, n_head_kv=8, head_dim=128, n_ff=28672,
                       n_vocab=128256, n_ctx_train=131072, rope_freq_base=500000.0, rms_eps=1e-5),
    "qwen3-8b": dict(arch="qwen3", n_layer=36, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=12288,
                     n_vocab=151936, n_ctx_train=40960, rope_freq_base=1000000.0, rms_eps=1e-6),
    # 4 experts, 2 a token; n_ff (written, unused by the MoE graph) differs from n_ff_exp to catch mix-ups
    "tiny-qwen3moe": dict(arch="qwen3moe", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128,
                          n_expert=4, n_expert_used=2, n_ff_exp=64, n_vocab=1000, n_ctx_train=4096),
    # global layers 0 and 2 (4 query heads), sliding-window 1 and 3 (8 heads, window 96); layer 0 dense, 1-3 4
    # experts (2 a token) + a shared one; layer 0's gate per element, the others' per head; YaRN x4 over 16 of
    # the global heads' 32 dims, plain RoPE over all 32 on the local ones.
    "tiny-laguna": dict(arch="laguna", n_layer=4, n_embd=64, n_head=4, n_head_swa=8, n_head_kv=2, head_dim=32,
                        n_ff=128, n_expert=4, n_expert_used=2, n_ff_exp=64, n_ff_shexp=96, n_layer_dense_lead=1,
                        expert_weights_scale=2.5, gate_per_element=(True, False, False, False), n_vocab=1000,
                        n_ctx_train=4096, n_swa=96, swa_pattern=2, n_rot=16, n_rot_swa=32,
                        rope_freq_base=500000.0, rope_freq_base_swa=10000.0, rope_scaling_type="yarn",
                        rope_scaling_factor=4.0, rope_orig_ctx=1024),
    # layers 0 and 2 delta-net, 1 and 3 full attention; 2 key heads and 4 value heads of 32; n_rot 8 of 32
    "tiny-qwen35": dict(arch="qwen35", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128,
                        n_vocab=1000, n_ctx_train=4096, full_attention_interval=2, ssm_d_conv=4, ssm_d_state=32,
                        ssm_n_group=2, ssm_dt_rank=4, n_rot=8, rope_sections=(2, 1, 1, 0)),
    "tiny-qwen35moe": dict(arch="qwen35moe", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32,
                           n_expert=4, n_expert_used=2, n_ff_exp=64, n_ff_shexp=128,
                           n_vocab=1000, n_ctx_train=4096, full_attention_interval=2, ssm_d_conv=4, ssm_d_state=32,
                           ssm_n_group=2, ssm_dt_rank=4, n_rot=8, rope_sections=(2, 1, 1, 0)),
    # Qwen3-30B-A3B as released (Qwen/Qwen3-30B-A3B config.json: hidden 2048, intermediate 6144, moe_intermediate
    # 768, 48 layers, 32 heads / 4 KV of 128, 128 experts, 8 a token, 40960 positions, rope_theta 1e6, vocab 151936,
    # untied; read from public copies of that config, not from the Hugging Face page itself).
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_ff=6144,
                          n_expert=128, n_expert_used=8, n_ff_exp=768, n_vocab=151936, n_ctx_train=40960,
                          rope_freq_base=1000000.0, rms_eps=1e-6),
    # Qwen3.5-27B as released (text_config of Qwen/Qwen3.5-27B config.json, read from public copies of it and
    # cross-checked with THUDM/slime scripts/models/qwen3.5-27B.sh): hidden 5120, intermediate 17408, 64 layers
    # (full_attention_interval 4: 16 full-attention layers), 24 heads / 4 KV of 256, partial_rotary_factor 0.25
    # (n_rot 64), mrope_section [11, 11, 10], rope_theta 1e7, linear attention 16 key / 48 value heads of 128,
    # conv kernel 4, 262144 positions, vocab 248320, untied, rms_norm_eps 1e-6.
    "qwen35-27b": dict(arch="qwen35", n_layer=64, n_embd=5120, n_head=24, n_head_kv=4, head_dim=256, n_ff=17408,
                       n_vocab=248320, n_ctx_train=262144, rope_freq_base=10000000.0, rms_eps=1e-6,
                       full_attention_interval=4, ssm_d_conv=4, ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=48,
                       n_rot=64, rope_sections=(11, 11, 10, 0)),
    # Qwen3.5-35B-A3B as released (text_config of Qwen/Qwen3.5-35B-A3B config.json, from public copies, cross-checked
    # with THUDM/slime scripts/models/qwen3.5-35B-A3B.sh and transformers' Qwen3_5MoeTextConfig defaults): hidden
    # 2048, 40 layers (interval 4: 10 full-attention), 16 heads / 2 KV of 256, 256 experts, 8 a token,
    # moe_intermediate 512, shared expert 512, linear attention 16 key / 32 value heads of 128, conv 4, rope as
    # qwen35-27b, 262144 positions, vocab 248320, untied. The config has no intermediate_size: no n_ff.
    "qwen35-35b-a3b": dict(arch="qwen35moe", n_layer=40, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256,
                           n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512,
                           n_vocab=248320, n_ctx_train=262144, rope_freq_base=10000000.0, rms_eps=1e-6,
                           full_attention_interval=4, ssm_d_conv=4, ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32,
                           n_rot=64, rope_sections=(11, 11, 10, 0)),
    # Laguna XS.2's published shape (Poolside's model card and libllama's laguna.cpp): 40 layers, one global layer
    # in four (first), sliding window 512, 131072 positions, 256 experts + 1 shared, 48 query heads on the global
    # layers and 64 on the local ones, head size 128, YaRN over 64 dims on the global layers (theta 5e5), plain
    # RoPE over all 128 on the local ones (theta 1e4), one leading dense layer, per-head gates. NOT published
    # (assumed, Qwen3-30B-A3B-like, ~33B weights): hidden 2048, 8 KV heads, 8 experts a token of width 512,
    # shared expert 512, dense FFN 8192, vocab 100352, YaRN factor 32 over 4096, routed scale 2.5.
    "laguna-xs2": dict(arch="laguna", n_layer=40, n_embd=2048, n_head=48, n_head_swa=64, n_head_kv=8, head_dim=128,
                       n_ff=8192, n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512, n_layer_dense_lead=1,
                       expert_weights_scale=2.5, n_vocab=100352, n_ctx_train=131072, n_swa=512, n_rot=64,
                       n_rot_swa=128, rope_freq_base=500000.0, rope_freq_base_swa=10000.0, rope_scaling_type="yarn",
                       rope_scaling_factor=32.0, rope_orig_ctx=4096, rms_eps=1e-6),
}


def check_shape(arch: str, weight_type: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, head_dim: int,
                 n_ff: int, n_vocab: int, n_ctx_train: int, n_layer_dense_lead: int = 0) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r} (expected one of {', '.join(ARCHS)})")
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"unknown weight_type {weight_type!r} (expected one of {', '.join(WEIGHT_TYPES)})")
    dims = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_ff=n_ff,
                n_vocab=n_vocab, n_ctx_train=n_ctx_train)
    if arch == "qwen35moe":
        # its FFN is the experts: Qwen3.5 MoE configs have no intermediate_size, the converter no feed_forward_length
        if n_ff:
            raise ValueError(f"qwen35moe has no dense FFN: n_ff must be 0 (its widths are n_ff_exp and n_ff_shexp), "
                             f"got {n_ff}")
        del dims["n_ff"]
    if arch == "laguna" and not n_layer_dense_lead:
        del dims["n_ff"]   # only its leading dense layers have a dense FFN
    for k, v in dims.items():
        if int(v) <= 0:
            raise ValueError(f"{k} must be positive, got {v}")
    if n_head % n_head_kv:
        raise ValueError(f"n_head={n_head} must be a multiple of n_head_kv={n_head_kv}")
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even (RoPE rotates pairs)")
    if arch == "qwen2" and head_dim * n_head != n_embd:
        raise ValueError(f"qwen2 needs head_dim * n_head == n_embd (llama.cpp's qwen2 has square q/o), "
                         f"got {head_dim} * {n_head} != {n_embd}")
    _check_rows(weight_type, n_embd=n_embd, n_ff=n_ff, head_dim_x_n_head=head_dim * n_head)


def _check_rows(weight_type: str, **rows: int) -> None:
    """Quantized rows (ne[0]) come in whole blocks. Real models' rows all do; tensors whose rows may not
    (1-D ones, ssm_conv1d, the routers) are F32, as the converter writes them."""
    block = gguf.GGML_QUANT_SIZES[WEIGHT_TYPES[weight_type]][0]
    for k, v in rows.items():
        if v % block:
            raise ValueError(f"{weight_type} rows come in blocks of {block}: {k}={v} is not a multiple")


def check_moe(arch: str, weight_type: str, n_expert: int, n_expert_used: int, n_ff_exp: int, n_ff_shexp: int) -> None:
    if arch == "gemma4" and n_expert:   # optional experts, beside the dense FFN that acts as the shared one
        if n_ff_shexp:
            raise ValueError(f"gemma4's shared expert is its dense FFN (n_ff): n_ff_shexp must be 0, got {n_ff_shexp}")
        if not 0 < n_expert_used <= n_expert or n_ff_exp <= 0:
            raise ValueError(f"gemma4 experts need 0 < n_expert_used <= n_expert and n_ff_exp > 0, got "
                             f"{n_expert_used} / {n_expert} / {n_ff_exp}")
        _check_rows(weight_type, n_ff_exp=n_ff_exp)
        return
    if arch not in MOE_ARCHS:
        if n_expert or n_expert_used or n_ff_exp or n_ff_shexp:
            raise ValueError(f"experts (n_expert, n_expert_used, n_ff_exp, n_ff_shexp) are {' / '.join(MOE_ARCHS)} "
                             f"options, not {arch}'s")
        return
    for k, v in dict(n_expert=n_expert, n_expert_used=n_expert_used, n_ff_exp=n_ff_exp).items():
        if int(v) <= 0:
            raise ValueError(f"{arch} needs {k} > 0, got {v}")
    if n_expert_used > n_expert:
        raise ValueError(f"n_expert_used={n_expert_used} must be at most n_expert={n_expert}")
    if arch in ("qwen35moe", "laguna") and n_ff_shexp <= 0:
        # libllama would fall back to n_ff (qwen35moe files have none) or n_ff_exp (laguna: the converter writes it)
        raise ValueError(f"{arch} needs a shared expert: n_ff_shexp > 0, got {n_ff_shexp}")
    if arch == "qwen3moe" and n_ff_shexp:
        raise ValueError(f"qwen3moe has no shared expert: n_ff_shexp must be 0, got {n_ff_shexp}")
    _check_rows(weight_type, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp)


def check_delta_net(arch: str, weight_type: str, n_layer: int, ssm_d_conv: int, ssm_d_state: int, ssm_n_group: int,
                     ssm_dt_rank: int, full_attention_interval: int | None) -> None:
    shape = dict(ssm_d_conv=ssm_d_conv, ssm_d_state=ssm_d_state, ssm_n_group=ssm_n_group, ssm_dt_rank=ssm_dt_rank)
    if arch not in HYBRID_ARCHS:
        if any(shape.values()) or full_attention_interval is not None:
            raise ValueError(f"delta-net layers ({', '.join(shape)}, full_attention_interval) are "
                             f"{' / '.join(HYBRID_ARCHS)} options, not {arch}'s")
        return
    for k, v in shape.items():
        if int(v) <= 0:
            raise ValueError(f"{arch} needs {k} > 0 (the gated delta-net's shape), got {v}")
    if ssm_dt_rank % ssm_n_group:
        # libllama repeats (or broadcasts) the key heads over the value heads
        raise ValueError(f"ssm_dt_rank={ssm_dt_rank} (value heads) must be a multiple of ssm_n_group={ssm_n_group} "
                         f"(key heads)")
    interval = 4 if full_attention_interval is None else full_attention_interval
    if interval <= 0:
        raise ValueError(f"full_attention_interval must be positive, got {interval}")
    if interval > n_layer:
        # libllama sizes a KV cache for the attention layers and fails on an empty one (GGML_ASSERT(buffer))
        raise ValueError(f"{arch} needs a full-attention layer: full_attention_interval={interval} > n_layer={n_layer}")
    _check_rows(weight_type, ssm_d_state_x_ssm_dt_rank=ssm_d_state * ssm_dt_rank)   # ssm_out's rows


def check_gemma4(arch: str, weight_type: str, n_layer: int, head_dim_swa: int, n_ff_layers: Sequence[int],
                  n_embd_per_layer: int, n_shared_kv: int, swa_layers: list[bool], split_experts: bool) -> None:
    if arch != "gemma4":
        if head_dim_swa or n_ff_layers or n_embd_per_layer or n_shared_kv or split_experts:
            raise ValueError(f"head_dim_swa, n_ff_layers, n_embd_per_layer, n_shared_kv and split_experts are gemma4 "
                             f"options, not {arch}'s")
        return
    if not swa_layers:
        raise ValueError("gemma4 needs a sliding window (n_swa > 0): libllama requires the window and its pattern")
    if head_dim_swa <= 0 or head_dim_swa % 2:
        raise ValueError(f"gemma4 needs an even head_dim_swa > 0 (the sliding-window layers' head size), got {head_dim_swa}")
    if n_ff_layers and (len(n_ff_layers) != n_layer or min(n_ff_layers) <= 0):
        raise ValueError(f"n_ff_layers needs {n_layer} positive widths, got {list(n_ff_layers)}")
    if n_embd_per_layer < 0:
        raise ValueError(f"n_embd_per_layer must be >= 0, got {n_embd_per_layer}")
    # libllama's cache reuse wants the layer before the cut global and the one before that local; other cuts are
    # written anyway (the loader's refusal of them is tested)
    if not 0 <= n_shared_kv <= n_layer - 2:
        raise ValueError(f"n_shared_kv={n_shared_kv} must leave at least 2 layers with K/V of their own")
    _check_rows(weight_type, head_dim_swa=head_dim_swa, n_embd_per_layer=n_embd_per_layer,
                **{f"n_ff_layers[{i}]": f for i, f in enumerate(n_ff_layers)})


def _default_sections(n_rot: int) -> list[int]:
    """M-RoPE sections (pairs per t/h/w position) that split n_rot / 2 pairs as Qwen3.5 does: 32 -> [11, 11, 10, 0]."""
    q, r = divmod(n_rot // 2, 3)
    return [q + (r > 0), q + (r > 1), q, 0]


def rope_dims(arch: str, head_dim: int, n_rot: int | None,
               rope_sections: Sequence[int] | None) -> tuple[int, list[int] | None]:
    """(rope.dimension_count, rope.dimension_sections or None), checked. The qwen35 families rotate part of the
    head (n_rot defaults to head_dim / 4, partial_rotary_factor 0.25 as released) with interleaved M-RoPE; laguna's
    and gemma4's global layers may (n_rot, default head_dim; no sections)."""
    if arch not in PARTIAL_ROTARY_ARCHS:
        if (n_rot is not None and n_rot != head_dim) or rope_sections is not None:
            raise ValueError(f"partial rotary (n_rot) and rope_sections are {' / '.join(PARTIAL_ROTARY_ARCHS)} "
                             f"options, not {arch}'s (which rotates all head_dim={head_dim})")
        return head_dim, None
    if n_rot is None:
        n_rot = head_dim // 4 if arch in HYBRID_ARCHS else head_dim
    if n_rot <= 0 or n_rot > head_dim or n_rot % 2:
        raise ValueError(f"n_rot={n_rot} must be even and in (0, head_dim={head_dim}]")
    if arch not in HYBRID_ARCHS:
        if rope_sections is not None:
            raise ValueError(f"rope_sections are {' / '.join(HYBRID_ARCHS)} options, not {arch}'s")
        return n_rot, None
    sections = _default_sections(n_rot) if rope_sections is None else [int(v) for v in rope_sections]
    if len(sections) != 4 or min(sections) < 0 or 2 * sum(sections) != n_rot:
        # ggml's rope_multi gives each of the n_rot / 2 rotated pairs a section (t, h, w, extra)
        raise ValueError(f"rope_sections={sections} must be 4 non-negative pair counts summing to n_rot / 2 = "
                         f"{n_rot // 2}")
    return n_rot, sections


def swa_layer_flags(arch: str, n_layer: int, n_swa: int, swa_pattern: int | Sequence[bool] | None) -> list[bool]:
    """Which layers have the sliding window, as libllama reads the pattern: one flag per layer, or a period with
    one global layer in each, the last (gemma3, default 6) or the first (laguna, default 4). []: no window."""
    if not n_swa:
        if swa_pattern is not None:
            raise ValueError("swa_pattern needs a sliding window (n_swa > 0)")
        return []
    if swa_pattern is not None and not isinstance(swa_pattern, int):
        flags = [bool(f) for f in swa_pattern]
        if len(flags) != n_layer:
            raise ValueError(f"swa_pattern has {len(flags)} flags for {n_layer} layers")
    else:
        period = swa_pattern if swa_pattern is not None else (4 if arch == "laguna" else 6)
        first = arch == "laguna"
        flags = [period == 0 or (il % period != 0 if first else il % period < period - 1) for il in range(n_layer)]
    if all(flags):
        raise ValueError("swa_pattern leaves no global layer")
    return flags


def laguna_heads(arch: str, n_layer: int, n_head: int, n_head_kv: int, n_head_swa: int, swa_layers: list[bool],
                  n_rot_swa: int | None, head_dim: int, n_layer_dense_lead: int, expert_weights_scale: float | None,
                  gate_per_element: Sequence[bool]) -> list[int]:
    """laguna's per-layer query head counts (written as an array, as its converter does), its options checked;
    [] for the other families, which must not use those options."""
    if arch != "laguna":
        if n_head_swa or n_rot_swa is not None or n_layer_dense_lead or expert_weights_scale is not None \
                or gate_per_element:
            raise ValueError(f"n_head_swa, n_rot_swa, n_layer_dense_lead, expert_weights_scale and gate_per_element "
                             f"are laguna options, not {arch}'s")
        return []
    n_head_swa = n_head_swa or n_head
    if n_head_swa % n_head_kv:
        raise ValueError(f"n_head_swa={n_head_swa} must be a multiple of n_head_kv={n_head_kv}")
    if n_rot_swa is not None and (n_rot_swa <= 0 or n_rot_swa > head_dim or n_rot_swa % 2):
        raise ValueError(f"n_rot_swa={n_rot_swa} must be even and in (0, head_dim={head_dim}]")
    if not 0 <= n_layer_dense_lead <= n_layer:
        raise ValueError(f"n_layer_dense_lead={n_layer_dense_lead} must be in [0, n_layer={n_layer}]")
    if gate_per_element and len(gate_per_element) != n_layer:
        raise ValueError(f"gate_per_element has {len(gate_per_element)} flags for {n_layer} layers")
    return [n_head_swa if swa_layers and swa_layers[il] else n_head for il in range(n_layer)]

