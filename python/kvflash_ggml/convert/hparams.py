"""Architecture, hyperparameters and tensor names of a checkpoint, all derived from the checkpoint itself.

config.json says what the model should be; the tensor shapes say what it is. Every value that both
determine is taken from config.json and checked against the shapes, and a disagreement is an error
naming the field, the config value and the value the shape implies (the seed project's converter
stamped one model's hyperparameters on every draft, and every other draft then failed to load).
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .checkpoint import Checkpoint, layer_indices
from .errors import ConversionError

log = logging.getLogger(__name__)

# GGUF architecture -> the Hugging Face model_type / architectures names laid out like it.
FAMILIES = {
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "llama": ("llama", "mistral", "LlamaForCausalLM", "MistralForCausalLM"),
}
SUPPORTED_ROPE = ("default", "linear", "llama3")

# per-block Hugging Face suffix -> GGUF suffix, shared by all three families
_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_BLOCK_EXTRA = {
    "qwen2": {"self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
              "self_attn.v_proj.bias": "attn_v.bias"},
    "qwen3": {"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"},
    "llama": {},
}
# Buffers some checkpoints carry that hold no weights.
_IGNORED = re.compile(r"^model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")


@dataclass
class RopeSettings:
    theta: float = 10000.0
    kind: str = "default"                 # one of SUPPORTED_ROPE
    factor: float = 1.0
    freq_factors: Optional[np.ndarray] = None   # llama3: [head_dim / 2] divisors of each frequency


@dataclass
class HParams:
    arch: str
    name: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx_train: int
    rms_eps: float
    tied: bool
    rope: RopeSettings = field(default_factory=RopeSettings)


def detect_arch(config: Dict[str, Any], requested: str = "auto") -> str:
    """The GGUF architecture for a config: from model_type, else architectures; --arch must agree."""
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    detected = None
    for arch, names in FAMILIES.items():
        if model_type in names or any(a in names for a in archs):
            detected = arch
            break
    if requested not in ("auto", *FAMILIES):
        raise ConversionError(f"unknown --arch {requested!r} (supported: auto, {', '.join(FAMILIES)})")
    if requested != "auto":
        if detected and detected != requested:
            raise ConversionError(f"--arch {requested} contradicts config.json (model_type {model_type!r}, "
                                  f"architectures {archs}), which is a {detected} checkpoint")
        return requested
    if detected is None:
        supported = "; ".join(f"{a} ({', '.join(n)})" for a, n in FAMILIES.items())
        raise ConversionError(f"unsupported architecture: config.json has model_type {model_type!r} and "
                              f"architectures {archs}; supported: {supported}. If the checkpoint is laid out "
                              f"exactly like one of them, pass --arch")
    return detected


def _mismatch(field_name: str, config_value: Any, tensor: str, shape: tuple, shape_value: Any, how: str = "") -> None:
    if isinstance(shape_value, float) and shape_value.is_integer():
        shape_value = int(shape_value)
    raise ConversionError(f"config.json {field_name} = {config_value} disagrees with the weights: {tensor} has shape "
                          f"{list(shape)}, which gives {field_name} = {shape_value}{how}")


def _require(ckpt: Checkpoint, name: str) -> tuple:
    shape = ckpt.shape(name)
    if shape is None:
        raise ConversionError(f"missing tensor: {name} is not in the checkpoint (needed to check the hyperparameters)")
    return shape


def _config_int(config: Dict[str, Any], key: str, default: Optional[int] = None) -> int:
    value = config.get(key)
    if value is None:   # absent or null
        value = default
    if value is None:
        raise ConversionError(f"config.json has no {key}")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConversionError(f"config.json {key} = {value!r} is not a positive integer")
    return value


def _config_float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConversionError(f"config.json {key} = {value!r} is not a positive number")
    return float(value)


def _check_layers(ckpt: Checkpoint, n_layer: int) -> None:
    present = layer_indices(list(ckpt.tensors))
    n_present = (present[-1] + 1) if present else 0
    if n_present != n_layer:
        _mismatch("num_hidden_layers", n_layer, "model.layers.*", (n_present,), n_present,
                  f" (blocks present: {present[0] if present else '-'}..{present[-1] if present else '-'})")
    gaps = sorted(set(range(n_layer)) - set(present))
    if gaps:
        raise ConversionError(f"missing tensor: block {gaps[0]} has no tensors (model.layers.{gaps[0]}.*)")


def _check_attention(ckpt: Checkpoint, arch: str, config: Dict[str, Any], n_embd: int) -> Tuple[int, int, int]:
    """(n_head, n_head_kv, head_dim), each checked against block 0's projections."""
    n_head = _config_int(config, "num_attention_heads")
    n_head_kv = _config_int(config, "num_key_value_heads", n_head)
    head_dim = config.get("head_dim") or n_embd // n_head
    q, k, v = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    q_shape, k_shape, v_shape = _require(ckpt, q), _require(ckpt, k), _require(ckpt, v)
    if arch == "qwen3":   # the per-head norms give head_dim on their own, so both head counts are checked
        qn = "model.layers.0.self_attn.q_norm.weight"
        qn_shape = _require(ckpt, qn)
        if qn_shape[0] != head_dim:
            _mismatch("head_dim", head_dim, qn, qn_shape, qn_shape[0])
        if q_shape[0] != n_head * head_dim:
            _mismatch("num_attention_heads", n_head, q, q_shape, q_shape[0] / head_dim, f" heads of {head_dim}")
    else:
        shape_head_dim = q_shape[0] / n_head
        if shape_head_dim != head_dim:
            _mismatch("head_dim", head_dim, q, q_shape, shape_head_dim,
                      f" ({q_shape[0]} rows / num_attention_heads {n_head})")
    if k_shape[0] != n_head_kv * head_dim:
        _mismatch("num_key_value_heads", n_head_kv, k, k_shape, k_shape[0] / head_dim,
                  f" ({k_shape[0]} rows / head_dim {head_dim})")
    if v_shape != k_shape:
        raise ConversionError(f"{v} has shape {list(v_shape)} but {k} has {list(k_shape)}; "
                              f"different key and value head sizes are not supported")
    if n_head % n_head_kv:
        raise ConversionError(f"config.json num_attention_heads = {n_head} is not a multiple of "
                              f"num_key_value_heads = {n_head_kv}")
    return n_head, n_head_kv, head_dim


def _check_unsupported_features(config: Dict[str, Any]) -> None:
    act = config.get("hidden_act", config.get("hidden_activation", "silu"))
    if act != "silu":
        raise ConversionError(f"config.json hidden_act = {act!r}: only 'silu' (SwiGLU) is supported")
    if config.get("use_sliding_window"):
        raise ConversionError("config.json use_sliding_window = true: sliding-window attention is not supported "
                              "for this architecture")
    if "sliding_attention" in (config.get("layer_types") or []):
        raise ConversionError("config.json layer_types has sliding_attention layers: not supported for "
                              "this architecture")
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConversionError(f"config.json partial_rotary_factor = {config['partial_rotary_factor']}: "
                              f"partial RoPE is not supported")
    window, n_ctx = config.get("sliding_window"), config.get("max_position_embeddings")
    if window and n_ctx and window < n_ctx and config.get("model_type") == "mistral":
        log.warning("config.json sliding_window = %d is ignored (as llama.cpp does for Mistral): "
                    "attention is full over the whole context", window)


def read_hparams(ckpt: Checkpoint, requested_arch: str = "auto") -> HParams:
    config = ckpt.config
    arch = detect_arch(config, requested_arch)
    _check_unsupported_features(config)
    emb = "model.embed_tokens.weight"
    emb_shape = _require(ckpt, emb)
    n_embd = _config_int(config, "hidden_size")
    n_vocab = _config_int(config, "vocab_size")
    if emb_shape[1] != n_embd:
        _mismatch("hidden_size", n_embd, emb, emb_shape, emb_shape[1])
    if emb_shape[0] != n_vocab:
        _mismatch("vocab_size", n_vocab, emb, emb_shape, emb_shape[0])
    n_layer = _config_int(config, "num_hidden_layers")
    _check_layers(ckpt, n_layer)
    n_head, n_head_kv, head_dim = _check_attention(ckpt, arch, config, n_embd)
    n_ff = _config_int(config, "intermediate_size")
    gate = "model.layers.0.mlp.gate_proj.weight"
    gate_shape = _require(ckpt, gate)
    if gate_shape[0] != n_ff:
        _mismatch("intermediate_size", n_ff, gate, gate_shape, gate_shape[0])
    tied = bool(config.get("tie_word_embeddings", False))
    if not tied and "lm_head.weight" not in ckpt.tensors:
        raise ConversionError("missing tensor: lm_head.weight (config.json tie_word_embeddings is false)")
    name = str(config.get("_name_or_path") or ckpt.src.resolve().name)
    return HParams(arch=arch, name=name, n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                   n_head_kv=n_head_kv, head_dim=head_dim, n_ff=n_ff,
                   n_ctx_train=_config_int(config, "max_position_embeddings", 4096),
                   rms_eps=_config_float(config.get("rms_norm_eps", 1e-6), "rms_norm_eps"), tied=tied,
                   rope=read_rope(config, head_dim))


def read_rope(config: Dict[str, Any], head_dim: int) -> RopeSettings:
    """theta and scaling from either transformers layout: rope_parameters (v5) or rope_theta + rope_scaling."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise ConversionError(f"config.json {key} = {value!r} is not an object (expected e.g. "
                                  f'{{"rope_type": "linear", "factor": 2.0}})')
    theta = _config_float(params.get("rope_theta", config.get("rope_theta", 10000.0)), "rope_theta")
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if kind not in SUPPORTED_ROPE:
        raise ConversionError(f"config.json rope scaling type {kind!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_ROPE)})")
    rope = RopeSettings(theta=theta, kind=kind, factor=_config_float(scaling.get("factor", 1.0), "rope factor"))
    if kind == "llama3":
        rope.freq_factors = llama3_freq_factors(scaling, theta, head_dim)
    return rope


def llama3_freq_factors(scaling: Dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """Llama 3's frequency-dependent scaling as per-frequency divisors (ggml's rope freq_factors):
    high frequencies are kept, low ones divided by `factor`, the band between interpolated."""
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    n_ctx_orig = float(scaling.get("original_max_position_embeddings", 8192))
    out = np.empty(head_dim // 2, dtype=np.float32)
    for i in range(head_dim // 2):
        wavelen = 2 * math.pi * theta ** (2 * i / head_dim)
        if wavelen < n_ctx_orig / high:
            out[i] = 1.0
        elif wavelen > n_ctx_orig / low:
            out[i] = factor
        else:
            smooth = (n_ctx_orig / wavelen - low) / (high - low)
            out[i] = 1.0 / ((1.0 - smooth) / factor + smooth)
    return out


def gguf_tensor_name(hf_name: str, hp: HParams) -> Optional[str]:
    """The GGUF name of a checkpoint tensor; None for tensors that are deliberately dropped."""
    if _IGNORED.match(hf_name) or (hf_name == "lm_head.weight" and hp.tied):
        return None
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf_name)
    if m:
        suffix = {**_BLOCK, **_BLOCK_EXTRA[hp.arch]}.get(m.group(2))
        if suffix is not None and int(m.group(1)) < hp.n_layer:
            return f"blk.{int(m.group(1))}.{suffix}"
    raise ConversionError(f"unknown tensor: {hf_name} has no place in a {hp.arch} model "
                          f"(a feature this converter does not support, or a different architecture)")


def expected_shapes(hp: HParams) -> Dict[str, tuple]:
    """Every checkpoint tensor the model needs, with its shape in Hugging Face (numpy) order."""
    q_dim, kv_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    block = {
        "input_layernorm.weight": (hp.n_embd,),
        "self_attn.q_proj.weight": (q_dim, hp.n_embd),
        "self_attn.k_proj.weight": (kv_dim, hp.n_embd),
        "self_attn.v_proj.weight": (kv_dim, hp.n_embd),
        "self_attn.o_proj.weight": (hp.n_embd, q_dim),
        "post_attention_layernorm.weight": (hp.n_embd,),
        "mlp.gate_proj.weight": (hp.n_ff, hp.n_embd),
        "mlp.up_proj.weight": (hp.n_ff, hp.n_embd),
        "mlp.down_proj.weight": (hp.n_embd, hp.n_ff),
    }
    if hp.arch == "qwen2":
        block.update({"self_attn.q_proj.bias": (q_dim,), "self_attn.k_proj.bias": (kv_dim,),
                      "self_attn.v_proj.bias": (kv_dim,)})
    if hp.arch == "qwen3":
        block.update({"self_attn.q_norm.weight": (hp.head_dim,), "self_attn.k_norm.weight": (hp.head_dim,)})
    out = {"model.embed_tokens.weight": (hp.n_vocab, hp.n_embd), "model.norm.weight": (hp.n_embd,)}
    if not hp.tied:
        out["lm_head.weight"] = (hp.n_vocab, hp.n_embd)
    for il in range(hp.n_layer):
        out.update({f"model.layers.{il}.{k}": v for k, v in block.items()})
    return out


def check_tensor_set(ckpt: Checkpoint, hp: HParams) -> List[Tuple[str, str]]:
    """(checkpoint name, GGUF name) of every tensor to write, after checking names and shapes."""
    expected = expected_shapes(hp)
    pairs = []
    for hf_name in sorted(ckpt.tensors, key=_natural_key):
        gguf_name = gguf_tensor_name(hf_name, hp)
        if gguf_name is None:
            continue
        shape = ckpt.tensors[hf_name].shape
        if shape != expected[hf_name]:
            raise ConversionError(f"tensor {hf_name} has shape {list(shape)}, expected {list(expected[hf_name])} "
                                  f"from config.json")
        pairs.append((hf_name, gguf_name))
    missing = [n for n in expected if n not in ckpt.tensors]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConversionError(f"missing tensor: {missing[0]}{more} (needed by a {hp.arch} model)")
    return pairs


def _natural_key(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))
