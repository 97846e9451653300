"""Writing the GGUF: metadata and the tensor table first, then the tensors one at a time.

The tensor table needs every tensor's type and size before any data, and both follow from the
shapes alone, so nothing is loaded until the data pass. The file is written next to the output
under a temporary name and renamed at the end: a failed conversion (a non-finite weight in the
last shard, say) leaves no half-written OUT.gguf behind and does not clobber an existing one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List

import numpy as np
from tqdm import tqdm

from .checkpoint import Checkpoint
from .errors import ConversionError, require_gguf
from .hparams import HParams
from .vocab import VocabSpec

# output type -> gguf.LlamaFileType member (gguf is imported only when a conversion runs)
OUTTYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}


@dataclass
class TensorPlan:
    gguf_name: str
    shape: tuple                                 # numpy order (ggml's reversed)
    qtype: gguf.GGMLQuantizationType
    load: Callable[[], np.ndarray]               # float32 data, already transformed

    @property
    def nbytes(self) -> int:
        gguf = require_gguf()
        if self.qtype == gguf.GGMLQuantizationType.F32:
            return int(np.prod(self.shape)) * 4
        return int(np.prod(gguf.quant_shape_to_byte_shape(self.shape, self.qtype)))


def tensor_type(outtype: str, shape: tuple) -> gguf.GGMLQuantizationType:
    """Norms, biases and rope factors (1-D) stay F32, as llama.cpp keeps them; matrices take the
    requested type, and for q8_0 a matrix whose rows are not whole 32-value blocks falls back to F16."""
    gguf = require_gguf()
    Q = gguf.GGMLQuantizationType
    if outtype == "f32" or len(shape) < 2:
        return Q.F32
    if outtype == "q8_0":
        return Q.Q8_0 if shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] == 0 else Q.F16
    return {"f16": Q.F16, "bf16": Q.BF16}[outtype]


def rope_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Hugging Face Llama stores each Q/K head's rows as [first halves of the rotary pairs; second
    halves] (rotate_half); llama.cpp's llama rotates adjacent pairs. Interleave the halves per head."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _loader(ckpt: Checkpoint, hp: HParams, hf_name: str) -> Callable[[], np.ndarray]:
    heads = {"self_attn.q_proj.weight": hp.n_head, "self_attn.k_proj.weight": hp.n_head_kv}
    n_heads = next((n for suffix, n in heads.items() if hf_name.endswith(suffix)), None)
    if hp.arch == "llama" and n_heads is not None:
        return lambda: rope_permute(ckpt.read(hf_name), n_heads)
    return lambda: ckpt.read(hf_name)


def plan_tensors(ckpt: Checkpoint, hp: HParams, pairs, outtype: str) -> List[TensorPlan]:
    plans = []
    for hf_name, gguf_name in pairs:
        shape = ckpt.tensors[hf_name].shape
        plans.append(TensorPlan(gguf_name, shape, tensor_type(outtype, shape), _loader(ckpt, hp, hf_name)))
    if hp.rope.freq_factors is not None:
        factors = hp.rope.freq_factors
        plans.append(TensorPlan("rope_freqs.weight", factors.shape, require_gguf().GGMLQuantizationType.F32,
                                lambda: factors))
    return plans


def add_hparams(w: "gguf.GGUFWriter", hp: HParams, outtype: str) -> None:
    gguf = require_gguf()
    w.add_name(hp.name)
    w.add_file_type(getattr(gguf.LlamaFileType, OUTTYPES[outtype]))
    if outtype == "q8_0":
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(hp.n_vocab)
    w.add_context_length(hp.n_ctx_train)
    w.add_embedding_length(hp.n_embd)
    w.add_block_count(hp.n_layer)
    w.add_feed_forward_length(hp.n_ff)
    w.add_head_count(hp.n_head)
    w.add_head_count_kv(hp.n_head_kv)
    w.add_key_length(hp.head_dim)
    w.add_value_length(hp.head_dim)
    w.add_layer_norm_rms_eps(hp.rms_eps)
    w.add_rope_freq_base(hp.rope.theta)
    w.add_rope_dimension_count(hp.head_dim)
    if hp.rope.kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(hp.rope.factor)


def _encode(plan: TensorPlan) -> np.ndarray:
    data = plan.load()
    if data.shape != plan.shape:
        raise ConversionError(f"internal: {plan.gguf_name} produced shape {data.shape}, planned {plan.shape}")
    gguf = require_gguf()
    if plan.qtype == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), plan.qtype)


def write_gguf(out: Path, hp: HParams, vocab: VocabSpec, plans: List[TensorPlan], outtype: str,
               progress: bool = True) -> None:
    tmp = partial_path(out)
    w = require_gguf().GGUFWriter(tmp, hp.arch)
    try:
        add_hparams(w, hp, outtype)
        vocab.write(w)
        for p in plans:
            w.add_tensor_info(p.gguf_name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total = sum(p.nbytes for p in plans)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out.name}", disable=not progress) as bar:
            for p in plans:
                bar.set_postfix_str(p.gguf_name, refresh=False)
                w.write_tensor_data(_encode(p))
                bar.update(p.nbytes)
        w.close()
        os.replace(tmp, out)
    except BaseException as e:
        w.close()
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):   # the disk filled up, a file went away: say so, in one line
            where = f" ({e.filename})" if e.filename else ""
            raise ConversionError(f"writing {out} failed: {e.strerror or e}{where}") from None
        raise


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def check_output(out: Path, force: bool) -> None:
    if out.is_dir():
        raise ConversionError(f"output {out} is a directory")
    if out.exists() and not force:
        raise ConversionError(f"output {out} already exists (pass --force to overwrite it)")
    if not out.parent.is_dir():
        raise ConversionError(f"missing file: output directory {out.parent} does not exist")
    # Creating the temporary file is the one honest test of writability (permissions, a read-only mount,
    # root's exemptions), and it is done before any weight is read.
    tmp = partial_path(out)
    existed = tmp.exists()   # left by a conversion that died: write_gguf replaces it
    try:
        tmp.open("ab").close()
        if not existed:
            tmp.unlink()
    except OSError as e:
        raise ConversionError(f"cannot write the output {out}: {e.strerror or e}") from None
