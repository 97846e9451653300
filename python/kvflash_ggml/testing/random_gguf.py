"""GGUF files with random weights, for tests and benchmarks of every supported family and size.

    write_random_gguf("m.gguf", "qwen3", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32,
                      n_ff=128, n_vocab=1000, n_ctx_train=4096)
    write_preset("m.gguf", "llama3-8b", weight_type="q4_0")
    python -m kvflash_ggml.testing.random_gguf OUT.gguf --shape llama3-8b --type q4_0

(Moved from kvflash_ggml.bench.random_gguf: a test fixture, not a benchmark; the command line moved along.)

The files are what llama.cpp's converter writes for llama / qwen2 / qwen3 / gemma3 / gemma4 / qwen3moe / qwen35 /
qwen35moe / laguna (tensor names from gguf-py's constants, the same metadata keys and shapes), so libllama loads
them too and is the reference in tests. Each file carries a small byte-level BPE tokenizer and a chatml chat
template.

The modules it is made of, one job each:
  gguf_shapes     the families (ARCHS ...), the named shapes (SHAPES), the checks of a shape's options
  gguf_tokenizer  the toy byte-level BPE tokenizer and chatml template every file carries
  gguf_tensors    every tensor of a family, with llama.cpp's names and shapes (the families' layouts and mtp)
  gguf_values     the tensors' random values (the weights' distributions, the reservoir, echo's scale)
This module writes the file (metadata keys as the converter writes them, then the tensors streamed in pieces,
so memory stays bounded whatever the model size) and is the public face: the names tests and benchmarks use
(__all__) are importable from it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import gguf
import numpy as np

from .gguf_shapes import (ARCHS, HYBRID_ARCHS, MOE_ARCHS, PARTIAL_ROTARY_ARCHS, SHAPES, SWA_ARCHS, WEIGHT_TYPES,
                          check_delta_net, check_gemma4, check_moe, check_shape, laguna_heads, rope_dims,
                          swa_layer_flags)
from .gguf_tensors import TensorSpec, tensor_specs
from .gguf_tokenizer import CHATML_TEMPLATE, SPECIAL_TOKENS, TokenizerSpec, build_tokenizer, bytes_to_unicode
from .gguf_values import ECHO_SCALE, RandomValues, echo_specs, tensor_pieces

__all__ = ["ARCHS", "CHATML_TEMPLATE", "ECHO_SCALE", "HYBRID_ARCHS", "MOE_ARCHS", "PARTIAL_ROTARY_ARCHS", "SHAPES",
           "SPECIAL_TOKENS", "SWA_ARCHS", "TensorSpec", "TokenizerSpec", "WEIGHT_TYPES", "build_tokenizer",
           "bytes_to_unicode", "main", "preset_files", "tensor_specs", "write_preset", "write_random_gguf"]

_FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
               "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}


def write_random_gguf(path: str | Path, arch: str, *, n_layer: int, n_embd: int, n_head: int, n_head_kv: int,
                      head_dim: int, n_ff: int = 0, n_vocab: int, n_ctx_train: int, weight_type: str = "f32",
                      tied_embeddings: bool = False, seed: int = 0, rope_freq_base: float = 10000.0,
                      rms_eps: float = 1e-6, weight_std: float = 0.02, name: str | None = None,
                      omit_tensors: Iterable[str] = (), n_swa: int = 0, swa_pattern: int | Sequence[bool] | None = None,
                      rope_freq_base_swa: float | None = None, rope_scaling_factor: float | None = None,
                      logit_softcap: float | None = None, n_expert: int = 0, n_expert_used: int = 0,
                      n_ff_exp: int = 0, n_ff_shexp: int = 0, ssm_d_conv: int = 0, ssm_d_state: int = 0,
                      ssm_n_group: int = 0, ssm_dt_rank: int = 0, full_attention_interval: int | None = None,
                      n_rot: int | None = None, rope_sections: Sequence[int] | None = None, echo: bool = False,
                      rope_scaling_type: str = "linear", rope_orig_ctx: int | None = None, n_head_swa: int = 0,
                      n_rot_swa: int | None = None, n_layer_dense_lead: int = 0,
                      expert_weights_scale: float | None = None, gate_per_element: Sequence[bool] = (),
                      head_dim_swa: int = 0, n_ff_layers: Sequence[int] = (), n_embd_per_layer: int = 0,
                      n_shared_kv: int = 0, split_experts: bool = False, mtp: bool = False) -> Path:
    """Write a random-weights GGUF of family `arch` to `path`; returns the path.

    gemma3 and laguna: n_swa (sliding window; 0 = every layer global), swa_pattern (a period: one global layer
    in each, the last (gemma3, libllama's default 6) or the first (laguna, default 4); or one flag per layer,
    True = sliding window), rope_freq_base_swa. gemma3: logit_softcap (final_logit_softcapping).
    rope_scaling_factor: RoPE scaling of the global layers, rope_scaling_type "linear" or "yarn" (with
    rope_orig_ctx, the context before scaling; default n_ctx_train).

    laguna: n_head_swa (query heads of the sliding-window layers; default n_head), n_rot (the global layers'
    rotated dims) and n_rot_swa (the local ones'), n_layer_dense_lead (leading layers with a dense FFN of n_ff),
    expert_weights_scale (routed weights' scale), gate_per_element (per layer; default per-head gates).

    gemma4: head_dim_swa (the sliding-window layers' head size; head_dim is the global layers'), n_ff_layers (the
    FFN width of each layer; default n_ff everywhere), n_embd_per_layer (per-layer embeddings; 0: none),
    n_shared_kv (the last layers without K/V of their own), n_expert / n_expert_used / n_ff_exp (routed experts on
    every layer beside the dense FFN; 0: none; split_experts: separate gate and up tensors with per-expert scales
    instead of the fused gate_up the converter writes), logit_softcap. The window's pattern is written as one flag per layer.

    qwen3moe / qwen35moe: n_expert routed experts of width n_ff_exp, n_expert_used a token; qwen35moe also a
    shared expert of width n_ff_shexp, and no n_ff (qwen3moe writes n_ff, which its graph does not use).
    qwen35 / qwen35moe: ssm_d_conv (conv taps), ssm_d_state (key and value head size), ssm_n_group (key heads),
    ssm_dt_rank (value heads), full_attention_interval (default 4: layers 3, 7, ... attend), n_rot (rotated
    head dims, default head_dim / 4) and rope_sections (4 M-RoPE pair counts summing to n_rot / 2; default
    the n_rot / 2 pairs split in three as Qwen3.5's [11, 11, 10, 0]).

    weight_type applies to every 2-D and 3-D weight (embeddings, output and experts included) but the expert
    routers and ssm_conv1d; those, norms, biases and the other 1-D tensors are F32, as the converter writes them.
    tied_embeddings: no output.weight (the model reuses token_embd.weight, like small Qwen models).
    echo: a model that predicts the token it was given, with certainty (see ECHO_SCALE; implies tied
    embeddings): speculative decoding with the model as its own draft then keeps every draft (and, with mtp,
    with its multi-token-prediction layer as the draft).
    mtp: one multi-token-prediction (nextn) layer after the trunk (qwen35 / qwen35moe; see gguf_tensors'
    module doc).
    omit_tensors: tensor names to leave out (tests of the loader's error for a missing tensor).
    """
    check_shape(arch, weight_type, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_ctx_train,
                 n_layer_dense_lead)
    if arch not in SWA_ARCHS and (n_swa or swa_pattern is not None or rope_freq_base_swa):
        raise ValueError(f"sliding windows are {' / '.join(SWA_ARCHS)} options, not {arch}'s")
    if arch not in ("gemma3", "gemma4") and logit_softcap:
        raise ValueError(f"logit soft-capping is a gemma3 / gemma4 option, not {arch}'s")
    check_moe(arch, weight_type, n_expert, n_expert_used, n_ff_exp, n_ff_shexp)
    check_delta_net(arch, weight_type, n_layer, ssm_d_conv, ssm_d_state, ssm_n_group, ssm_dt_rank,
                     full_attention_interval)
    n_rot, rope_sections = rope_dims(arch, head_dim, n_rot, rope_sections)
    swa_layers = swa_layer_flags(arch, n_layer, n_swa, swa_pattern)
    check_gemma4(arch, weight_type, n_layer, head_dim_swa, n_ff_layers, n_embd_per_layer, n_shared_kv, swa_layers,
                  split_experts)
    heads = laguna_heads(arch, n_layer, n_head, n_head_kv, n_head_swa, swa_layers, n_rot_swa, head_dim,
                          n_layer_dense_lead, expert_weights_scale, gate_per_element)
    if mtp and arch not in HYBRID_ARCHS:
        raise ValueError(f"mtp (a multi-token-prediction layer) is a {' / '.join(HYBRID_ARCHS)} option, not {arch}'s")
    n_nextn = 1 if mtp else 0
    if rope_scaling_type not in ("linear", "yarn"):
        raise ValueError(f"rope_scaling_type must be 'linear' or 'yarn', got {rope_scaling_type!r}")
    if full_attention_interval is None:
        full_attention_interval = 4    # libllama's default for a file without the key; written anyway
    path = Path(path)
    tied_embeddings = tied_embeddings or echo
    tok = build_tokenizer(arch, n_vocab)
    specs = tensor_specs(arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                         head_dim=head_dim, n_ff=n_ff, n_vocab=n_vocab, weight_type=weight_type,
                         tied_embeddings=tied_embeddings, n_expert=n_expert, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp,
                         ssm_d_conv=ssm_d_conv, ssm_d_state=ssm_d_state, ssm_n_group=ssm_n_group,
                         ssm_dt_rank=ssm_dt_rank, full_attention_interval=full_attention_interval,
                         swa_layers=swa_layers, n_head_swa=n_head_swa or n_head, n_layer_dense_lead=n_layer_dense_lead,
                         gate_per_element=gate_per_element, head_dim_swa=head_dim_swa, n_ff_layers=n_ff_layers,
                         n_embd_per_layer=n_embd_per_layer, split_experts=split_experts, n_nextn=n_nextn)
    omit = set(omit_tensors)
    unknown = omit - {s.name for s in specs}
    if unknown:
        raise ValueError(f"omit_tensors names tensors this model does not have: {sorted(unknown)}")
    specs = [s for s in specs if s.name not in omit]
    if echo:
        specs = echo_specs(specs)

    w = gguf.GGUFWriter(path, arch)
    w.add_name(name or f"random-{arch}-{n_layer}L-{n_embd}E-{weight_type}")
    _add_shape_keys(w, weight_type, n_ctx_train=n_ctx_train, n_embd=n_embd, n_block=n_layer + n_nextn, n_ff=n_ff,
                    n_ff_layers=n_ff_layers, n_head=heads if heads else n_head, n_head_kv=n_head_kv,
                    head_dim=head_dim, n_rot=n_rot, rope_freq_base=rope_freq_base, rms_eps=rms_eps, n_vocab=n_vocab)
    _add_family_keys(w, arch, n_layer=n_layer, n_nextn=n_nextn, head_dim=head_dim, swa_layers=swa_layers,
                     rope_scaling_factor=rope_scaling_factor, rope_scaling_type=rope_scaling_type,
                     rope_orig_ctx=rope_orig_ctx, n_swa=n_swa, swa_pattern=swa_pattern,
                     rope_freq_base_swa=rope_freq_base_swa, logit_softcap=logit_softcap, n_expert=n_expert,
                     n_expert_used=n_expert_used, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp,
                     expert_weights_scale=expert_weights_scale, n_layer_dense_lead=n_layer_dense_lead,
                     n_rot_swa=n_rot_swa, head_dim_swa=head_dim_swa, n_embd_per_layer=n_embd_per_layer,
                     n_shared_kv=n_shared_kv, ssm_d_conv=ssm_d_conv, ssm_d_state=ssm_d_state, ssm_n_group=ssm_n_group,
                     ssm_dt_rank=ssm_dt_rank, full_attention_interval=full_attention_interval,
                     rope_sections=rope_sections)

    _add_tokenizer(w, tok)
    for s in specs:
        # numpy order (reversed ne); a non-uint8 dtype tells gguf-py the shape is in elements, not bytes
        w.add_tensor_info(s.name, tuple(reversed(s.ne)), np.dtype(np.float32), s.nbytes, raw_dtype=s.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    _write_tensor_data(w, specs, RandomValues(seed, weight_std))
    w.close()
    return path


def _add_shape_keys(w: gguf.GGUFWriter, weight_type: str, *, n_ctx_train: int, n_embd: int, n_block: int, n_ff: int,
                    n_ff_layers: Sequence[int], n_head, n_head_kv: int, head_dim: int, n_rot: int,
                    rope_freq_base: float, rms_eps: float, n_vocab: int) -> None:
    """The keys every family writes. n_head: a count, or one per layer (laguna); n_ff_layers: one per layer (gemma4)."""
    w.add_file_type(int(_FILE_TYPES[weight_type]))
    if weight_type in ("q8_0", "q4_0"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_block)
    if n_ff_layers:
        w.add_feed_forward_length([int(f) for f in n_ff_layers])
    elif n_ff:
        w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(n_rot)
    w.add_rope_freq_base(rope_freq_base)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_vocab_size(n_vocab)


def _add_family_keys(w: gguf.GGUFWriter, arch: str, *, n_layer: int, n_nextn: int, head_dim: int,
                     swa_layers: list[bool], rope_scaling_factor: float | None, rope_scaling_type: str,
                     rope_orig_ctx: int | None, n_swa: int, swa_pattern: int | Sequence[bool] | None,
                     rope_freq_base_swa: float | None, logit_softcap: float | None, n_expert: int,
                     n_expert_used: int, n_ff_exp: int, n_ff_shexp: int, expert_weights_scale: float | None,
                     n_layer_dense_lead: int, n_rot_swa: int | None, head_dim_swa: int, n_embd_per_layer: int,
                     n_shared_kv: int, ssm_d_conv: int, ssm_d_state: int, ssm_n_group: int, ssm_dt_rank: int,
                     full_attention_interval: int, rope_sections: Sequence[int]) -> None:
    """The keys beyond every family's own: RoPE scaling, sliding windows, soft-capping, experts, and what the
    converter writes for laguna, gemma4 and the hybrids (their recurrent and nextn layers)."""
    if rope_scaling_factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN if rope_scaling_type == "yarn" else gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scaling_factor)
        if rope_orig_ctx:
            w.add_rope_scaling_orig_ctx_len(rope_orig_ctx)
    if n_swa:
        w.add_sliding_window(n_swa)
        if arch == "gemma4":   # libllama's gemma4 reads only the per-layer flags
            w.add_sliding_window_pattern(swa_layers)
        elif swa_pattern is not None:
            w.add_sliding_window_pattern(swa_pattern if isinstance(swa_pattern, int) else [bool(f) for f in swa_pattern])
        if rope_freq_base_swa:
            w.add_rope_freq_base_swa(rope_freq_base_swa)
    if logit_softcap:
        w.add_final_logit_softcapping(logit_softcap)
    if arch in MOE_ARCHS:
        _add_moe_keys(w, n_expert, n_expert_used, n_ff_exp, n_ff_shexp)
    if arch == "laguna":   # what the converter's LagunaModel writes besides
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(1.0 if expert_weights_scale is None else expert_weights_scale)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_leading_dense_block_count(n_layer_dense_lead)
        if n_swa:
            w.add_rope_dimension_count_swa(head_dim if n_rot_swa is None else n_rot_swa)
    if arch == "gemma4":   # what the converter's Gemma4 class writes besides
        w.add_key_length_swa(head_dim_swa)
        w.add_value_length_swa(head_dim_swa)
        w.add_rope_dimension_count_swa(head_dim_swa)
        w.add_embedding_length_per_layer_input(n_embd_per_layer)
        if n_shared_kv:
            w.add_shared_kv_layers(n_shared_kv)
        if n_expert:
            _add_moe_keys(w, n_expert, n_expert_used, n_ff_exp, 0)
    if arch in HYBRID_ARCHS:
        _add_delta_net_keys(w, ssm_d_conv, ssm_d_state, ssm_n_group, ssm_dt_rank, full_attention_interval,
                            rope_sections)
    if n_nextn:   # as the converter's Qwen3.5 classes (config.json has layer_types): a flag for every block
        w.add_nextn_predict_layers(n_nextn)
        w.add_array(f"{arch}.attention.recurrent_layers",
                    [(il + 1) % full_attention_interval != 0 for il in range(n_layer)] + [False] * n_nextn)


def _add_moe_keys(w: gguf.GGUFWriter, n_expert: int, n_expert_used: int, n_ff_exp: int, n_ff_shexp: int) -> None:
    """What the converter's Qwen2MoeModel writes (expert_count / expert_used_count come from TextModel)."""
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_expert_feed_forward_length(n_ff_exp)
    if n_ff_shexp:
        w.add_expert_shared_feed_forward_length(n_ff_shexp)


def _add_delta_net_keys(w: gguf.GGUFWriter, ssm_d_conv: int, ssm_d_state: int, ssm_n_group: int, ssm_dt_rank: int,
                        full_attention_interval: int, rope_sections: Sequence[int] | None) -> None:
    """What the converter's Qwen3NextModel / Qwen3.5 classes write; libllama requires every one but the interval.
    The converter also writes attention.recurrent_layers when config.json lists layer_types; the interval alone
    says the same here (and is all libllama reads without the array)."""
    w.add_ssm_conv_kernel(ssm_d_conv)
    w.add_ssm_state_size(ssm_d_state)
    w.add_ssm_group_count(ssm_n_group)
    w.add_ssm_time_step_rank(ssm_dt_rank)
    w.add_ssm_inner_size(ssm_d_state * ssm_dt_rank)    # linear_value_head_dim * linear_num_value_heads
    w.add_full_attention_interval(full_attention_interval)
    w.add_rope_dimension_sections(list(rope_sections or ()))


def _add_tokenizer(w: gguf.GGUFWriter, tok: TokenizerSpec) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok.pre)
    w.add_token_list(tok.tokens)
    w.add_token_types(tok.token_types)
    w.add_token_merges(tok.merges)
    w.add_bos_token_id(tok.bos)
    w.add_eos_token_id(tok.eos)
    w.add_pad_token_id(tok.pad)
    w.add_add_bos_token(tok.add_bos)
    w.add_chat_template(tok.chat_template)


def _write_tensor_data(w: gguf.GGUFWriter, specs: list[TensorSpec], rnd: RandomValues) -> None:
    """Streams every tensor piece by piece, laid out as GGUFWriter.write_tensor_data does: each tensor
    starts at an aligned offset (the offsets in the tensor infos already written assume exactly this)."""
    assert w.fout is not None and len(w.fout) == 1
    fout = w.fout[0]
    for s in specs:
        w.write_padding(fout, fout.tell())
        written = 0
        for piece in tensor_pieces(s, rnd):
            fout.write(memoryview(piece))
            written += piece.nbytes
        assert written == s.nbytes, (s.name, written, s.nbytes)
        w.write_padding(fout, s.nbytes)


def write_preset(path: str | Path, shape: str, **overrides) -> Path:
    """write_random_gguf with a named shape from SHAPES; keyword arguments override the shape's values."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    kw = {**SHAPES[shape], **overrides}
    return write_random_gguf(path, kw.pop("arch"), **kw)


def preset_files(root: str | Path, variants: dict) -> Callable[[str], str]:
    """variant -> the path of its GGUF under root, written on first use: variants maps a name to (shape,
    overrides, ...) (tests keep a tolerance or more after them)."""
    paths: dict[str, str] = {}

    def get(variant: str) -> str:
        if variant not in paths:
            shape, overrides = variants[variant][:2]
            paths[variant] = str(write_preset(Path(root) / f"{variant}.gguf", shape, **overrides))
        return paths[variant]

    return get


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvflash_ggml.testing.random_gguf",
                                 description="Write a GGUF model with random weights (" + " / ".join(ARCHS) + ").")
    ap.add_argument("out", help="output .gguf path")
    ap.add_argument("--shape", default="tiny-llama", choices=sorted(SHAPES), help="named shape (default tiny-llama)")
    ap.add_argument("--type", dest="weight_type", default="f16", choices=list(WEIGHT_TYPES),
                    help="type of the 2-D weights (default f16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tied-embeddings", action="store_true", help="no output.weight: reuse token_embd.weight")
    ap.add_argument("--echo", action="store_true",
                    help="a model that predicts the token it was given, with certainty (speculation's upper bound)")
    ap.add_argument("--n-layer", type=int, default=None,
                    help="override the shape's layer count (hybrid shapes keep their full-attention interval)")
    ap.add_argument("--n-ctx-train", type=int, default=None, help="override the shape's trained context")
    ap.add_argument("--mtp", action="store_true",
                    help="add a multi-token-prediction (nextn) layer after the trunk (qwen35 / qwen35moe shapes)")
    args = ap.parse_args(argv)
    overrides = dict(weight_type=args.weight_type, seed=args.seed, tied_embeddings=args.tied_embeddings, echo=args.echo)
    if args.mtp:
        overrides["mtp"] = True
    if args.n_layer is not None:
        overrides["n_layer"] = args.n_layer
    if args.n_ctx_train is not None:
        overrides["n_ctx_train"] = args.n_ctx_train
    t0 = time.perf_counter()
    try:
        path = write_preset(args.out, args.shape, **overrides)
    except ValueError as e:
        ap.error(str(e))
    dt = time.perf_counter() - t0
    size = path.stat().st_size
    print(f"wrote {path} ({args.shape}, {args.weight_type}): {size / 2**20:.1f} MiB in {dt:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
