"""The bytes of a random GGUF's tensors, by the kind of each (see TensorSpec), streamed in pieces.

Weights: norms are 1, everything else ~N(0, weight_std), but for the delta-net's own parameters, which
get what an untrained real model has so the recurrence is stable and not trivial: ssm_a = -A with
A ~ U(1, 16), ssm_dt.bias = softplus^-1(dt) with dt log-uniform in [1e-3, 0.1] (Mamba2's dt init: the
per-token decay exp(-A * softplus(dt_bias + alpha)) spans short to very long memories), ssm_conv1d ~
N(0, 1/d_conv) (the conv's fan-in scale). Quantized types (q8_0, q4_0) are written as random blocks
directly (random quants, one fp16 scale per block with a random sign, sized so the dequantized weights
have std weight_std): nothing is quantized in Python. Tensors are streamed to disk in pieces, so memory
stays bounded (tens of MB) whatever the model size. Tensors larger than _FRESH_MAX elements take their
values from random windows of a fixed random reservoir, so an 8B model is written at disk speed; small
(test-sized) tensors get fresh values.
echo: see ECHO_SCALE.
"""
from __future__ import annotations

from typing import Iterator

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from .gguf_tensors import TensorSpec

_FRESH_MAX = 1 << 20         # tensors up to this many elements get fresh random values
_RESERVOIR = 1 << 22         # elements per type in the reservoir large tensors are cut from
_PIECE = 1 << 22             # most elements generated and written at once
# std of a uniformly random quant: int8 in [-128, 127] (q8_0), nibble - 8 in [-8, 7] (q4_0)
_QUANT_STD = {QT.Q8_0: float(np.sqrt((256**2 - 1) / 12)), QT.Q4_0: float(np.sqrt((16**2 - 1) / 12))}


class RandomValues:
    """Encoded random tensor bytes: fresh for small tensors, windows of a fixed reservoir for large ones.

    Reservoirs hold _RESERVOIR already encoded elements per type (twice, so any window fits), so writing
    a large tensor costs a slice per piece and the file is written at disk speed.
    """

    def __init__(self, seed: int, std: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.std = std
        self._reservoirs: dict[tuple[QT, float], np.ndarray] = {}

    def encode(self, qtype: QT, n: int, scale: float = 1.0) -> np.ndarray:
        """n fresh random elements of type qtype and std self.std * scale, as bytes (n is a multiple of the
        type's block size)."""
        std = self.std * scale
        if qtype in (QT.F32, QT.F16):
            x = self.rng.standard_normal(n, dtype=np.float32) * np.float32(std)
            return x.astype(np.float32 if qtype == QT.F32 else np.float16).view(np.uint8)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        nb = n // block
        out = np.empty((nb, block_bytes), dtype=np.uint8)
        out[:, 2:] = np.frombuffer(self.rng.bytes(nb * (block_bytes - 2)), dtype=np.uint8).reshape(nb, -1)
        # random-sign scales: a uniform nibble - 8 has mean -0.5, the sign keeps the weights zero-mean
        d = np.float16(std / _QUANT_STD[qtype])
        scales = np.where(self.rng.integers(0, 2, nb, dtype=np.uint8) == 1, -d, d).astype(np.float16)
        out[:, :2] = scales.view(np.uint8).reshape(nb, 2)
        return out.reshape(-1)

    def window(self, qtype: QT, n: int, scale: float = 1.0) -> np.ndarray:
        """n elements (n <= _RESERVOIR) cut from the reservoir of (type, scale) at a random block offset."""
        res = self._reservoirs.get((qtype, scale))
        if res is None:
            r = self.encode(qtype, _RESERVOIR, scale)
            res = self._reservoirs[(qtype, scale)] = np.concatenate([r, r])
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        start = int(self.rng.integers(0, _RESERVOIR // block)) * block_bytes
        return res[start:start + n // block * block_bytes]


def _delta_net_values(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """F32 values for the delta-net's own parameters, as an untrained real model has them (small tensors)."""
    n = spec.n_elements
    if spec.kind == "conv":        # depthwise conv: fan-in d_conv (ne[0]) scale
        return rng.standard_normal(n, dtype=np.float32) / np.float32(np.sqrt(spec.ne[0]))
    if spec.kind == "decay":       # ssm_a = -exp(A_log), A ~ U(1, 16) (HF inits A ~ U(0, 16)): strictly negative
        return -rng.uniform(1.0, 16.0, n).astype(np.float32)
    if spec.kind == "dt_bias":     # softplus^-1 of a log-uniform dt in [1e-3, 0.1] (Mamba2's dt init)
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), n))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
    raise ValueError(f"unknown tensor kind {spec.kind!r} ({spec.name})")


# echo=True: the projections that write into the residual stream, and their weights' scale. With them small the
# last token's own embedding dominates the final hidden state, so (tied embeddings) the model predicts the token
# it was given, by a margin of ~sqrt(n_embd) logits over the rest: greedy decoding repeats it, and no kernel's
# summation order can flip the choice. The compute is a real model's; what it predicts is certain.
ECHO_SCALE = 1e-3
_RESIDUAL_WRITERS = ("attn_output.", "ffn_down.", "ffn_down_exps.", "ffn_down_shexp.", "ssm_out.")


def tensor_pieces(spec: TensorSpec, rnd: RandomValues) -> Iterator[np.ndarray]:
    """The tensor's bytes, in pieces of at most _PIECE elements."""
    n = spec.n_elements
    if spec.kind == "norm":
        yield np.ones(n, dtype=np.float32).view(np.uint8)
        return
    if spec.kind in ("conv", "decay", "dt_bias"):
        assert spec.qtype == QT.F32, spec
        yield _delta_net_values(spec, rnd.rng).view(np.uint8)
        return
    if spec.kind == "scale":
        yield rnd.rng.uniform(0.5, 1.5, n).astype(np.float32).view(np.uint8)
        return
    if spec.kind == "rope_freqs":
        # Gemma 4's proportional RoPE: a first part of the pairs at their own frequency, then slower ones, then
        # pairs that never rotate (a factor so large the angle is 0), as the converter writes them.
        f = np.ones(n, dtype=np.float32)
        f[n // 2:] = rnd.rng.uniform(1.0, 8.0, n - n // 2)
        f[3 * n // 4:] = 1e30
        yield f.view(np.uint8)
        return
    if spec.kind == "eh_echo":   # [I, 0]: the MTP block's input is its normed token embedding (F32 rows of 2 * n_embd)
        e = spec.ne[1]
        w = np.zeros((e, 2 * e), dtype=np.float32)
        w[:, :e] = np.eye(e, dtype=np.float32)
        yield w.reshape(-1).view(np.uint8)
        return
    scale = ECHO_SCALE if spec.kind == "echo" else 1.0
    for p0 in range(0, n, _PIECE):
        m = min(_PIECE, n - p0)
        yield rnd.encode(spec.qtype, m, scale) if n <= _FRESH_MAX else rnd.window(spec.qtype, m, scale)


def echo_specs(specs: list[TensorSpec]) -> list[TensorSpec]:
    """An echo model's tensors (see ECHO_SCALE): the residual writers' weights scaled down, and its nextn tensors
    (see _echo_nextn)."""
    specs = [TensorSpec(s.name, s.ne, "echo", s.qtype) if any(r in s.name for r in _RESIDUAL_WRITERS) else s
             for s in specs]
    return [_echo_nextn(s) if ".nextn." in s.name else s for s in specs]


def _echo_nextn(spec: TensorSpec) -> TensorSpec:
    """An echo model's nextn tensors: norms of ones, and an eh_proj that passes the normed embedding through (F32)."""
    if spec.kind == "eh_proj":
        return TensorSpec(spec.name, spec.ne, "eh_echo", QT.F32)
    return TensorSpec(spec.name, spec.ne, "norm", QT.F32) if spec.kind == "scale" else spec
