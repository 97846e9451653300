"""GGUF files with random weights, for tests and benchmarks of every supported family and size.

    write_random_gguf("m.gguf", "qwen3", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32,
                      n_ff=128, n_vocab=1000, n_ctx_train=4096)
    write_preset("m.gguf", "llama3-8b", weight_type="q4_0")
    python -m kvflash_ggml.testing.random_gguf OUT.gguf --shape llama3-8b --type q4_0

(Moved from kvflash_ggml.bench.random_gguf: a test fixture, not a benchmark; the command line moved along.)

The files are what llama.cpp's converter writes for llama / qwen2 / qwen3 (tensor names from gguf-py's
constants, the same metadata keys), so libllama loads them too and is the reference in tests. Each
file carries a small byte-level BPE tokenizer (256 byte tokens, merges learned from a built-in text,
chatml special tokens, padded with unused tokens up to n_vocab) and a chatml chat template.

Weights: norms are 1, everything else ~N(0, weight_std). Quantized types (q8_0, q4_0) are written as
random blocks directly (random quants, one fp16 scale per block with a random sign, sized so the
dequantized weights have std weight_std): nothing is quantized in Python. Tensors are streamed to disk
in pieces, so memory stays bounded (tens of MB) whatever the model size. Tensors larger than
_FRESH_MAX elements take their values from random windows of a fixed random reservoir, so an 8B model
is written at disk speed; small (test-sized) tensors get fresh values.
"""
from __future__ import annotations

import argparse
import functools
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import gguf
import numpy as np
from gguf import MODEL_TENSOR as T
from gguf import GGMLQuantizationType as QT

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
WEIGHT_TYPES = {"f32": QT.F32, "f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0}
_FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
               "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}

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
    # Gemma 3 4B / 12B as released: 5 sliding-window layers (1024) to each global one, linear RoPE scaling 8
    # on the global layers, the 262K vocabulary.
    "gemma3-4b": dict(arch="gemma3", n_layer=34, n_embd=2560, n_head=8, n_head_kv=4, head_dim=256, n_ff=10240,
                      n_vocab=262144, n_ctx_train=131072, n_swa=1024, rope_freq_base=1000000.0,
                      rope_scaling_factor=8.0, tied_embeddings=True),
    "gemma3-12b": dict(arch="gemma3", n_layer=48, n_embd=3840, n_head=16, n_head_kv=8, head_dim=256, n_ff=15360,
                       n_vocab=262144, n_ctx_train=131072, n_swa=1024, rope_freq_base=1000000.0,
                       rope_scaling_factor=8.0, tied_embeddings=True),
    "llama3-8b": dict(arch="llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=14336,
                      n_vocab=128256, n_ctx_train=131072, rope_freq_base=500000.0, rms_eps=1e-5),
    "qwen3-8b": dict(arch="qwen3", n_layer=36, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=12288,
                     n_vocab=151936, n_ctx_train=40960, rope_freq_base=1000000.0, rms_eps=1e-6),
}

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>")
# Pre-tokenizer names libllama knows (src/llama-vocab.cpp), one per family, as the real models use.
_TOKENIZER_PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "gemma3": "default"}
_MAX_MERGES = 600

# The text the BPE merges are learned from (ASCII; any text tokenizes, this only decides the merges).
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A pooled key-value cache keeps the most relevant chunks of a
long context resident on the device, and pages the others out to host memory. When the scorer says that an
evicted chunk matters again, it is paged back in. The model then attends over the pool only, so the cost of
decoding one token is set by the size of the pool and not by the length of the context.
In the beginning there was a question, and the question was simple: how much of what we have seen do we need
to remember in order to say the next word? Most of it, it turns out, can wait in a slower place.
def forward(tokens, start):
    logits = session.forward(tokens, start)
    return logits.argmax(-1)
for i in range(10): print(i, i * i, "hello world")
User: What is the capital of France?
Assistant: The capital of France is Paris. It is known for the Eiffel Tower, the Louvre and its cafes.
User: Write a short poem about the sea.
Assistant: The sea is wide, the sea is deep; it sings the sailors into sleep. Its waves come in, its waves go
out, and no one knows what they're about.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 16 32 64 128 256 512 1024 2048 4096 8192 2024 3.14159 42.
"""
_PRETOKENIZE = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


# ---- tokenizer ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@functools.lru_cache(maxsize=4)
def _learn_merges(max_merges: int) -> tuple[tuple[str, str], ...]:
    """Byte-level BPE merges learned from _CORPUS, most frequent pair first (ties: smallest pair)."""
    b2u = bytes_to_unicode()
    words = Counter(tuple(b2u[b] for b in w.encode("utf-8")) for w in _PRETOKENIZE.findall(_CORPUS))
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        pairs: Counter = Counter()
        for w, f in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += f
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if best[1] < 2:
            break
        a, b = best[0]
        merges.append((a, b))
        merged: Counter = Counter()
        for w, f in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += f
        words = merged
    return tuple(merges)


@dataclass(frozen=True)
class TokenizerSpec:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]          # "left right", in rank order
    pre: str                   # tokenizer.ggml.pre
    bos: int
    eos: int
    pad: int
    add_bos: bool
    chat_template: str = CHATML_TEMPLATE

    @property
    def special_ids(self) -> dict[str, int]:
        return {t: self.tokens.index(t) for t in SPECIAL_TOKENS}


def build_tokenizer(arch: str, n_vocab: int) -> TokenizerSpec:
    """Vocabulary of exactly n_vocab tokens: bytes, learned merges, special tokens, then [PADi] (unused)."""
    n_fixed = 256 + len(SPECIAL_TOKENS)
    if n_vocab < n_fixed:
        raise ValueError(f"n_vocab={n_vocab} is too small: the byte-level vocabulary needs at least {n_fixed} tokens")
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    seen = set(tokens)
    merges = []
    for a, b in _learn_merges(_MAX_MERGES):
        if len(tokens) + len(SPECIAL_TOKENS) >= n_vocab:
            break
        merges.append(f"{a} {b}")
        if a + b not in seen:   # two merge paths can build the same string: one token for it
            seen.add(a + b)
            tokens.append(a + b)
    types = [gguf.TokenType.NORMAL] * len(tokens)
    tokens += SPECIAL_TOKENS
    types += [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
    n_pad = n_vocab - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(n_pad)]
    types += [gguf.TokenType.UNUSED] * n_pad
    ids = {t: tokens.index(t) for t in SPECIAL_TOKENS}
    if arch in ("llama", "gemma3"):   # Llama 3 / Gemma style: a BOS that is added to every prompt
        bos, add_bos = ids["<|begin_of_text|>"], True
    else:                 # Qwen style: no BOS added
        bos, add_bos = ids["<|endoftext|>"], False
    return TokenizerSpec(tokens=tokens, token_types=[int(t) for t in types], merges=merges,
                         pre=_TOKENIZER_PRE[arch], bos=bos, eos=ids["<|im_end|>"], pad=ids["<|endoftext|>"],
                         add_bos=add_bos)


# ---- tensors --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]        # ggml order: ne[0] is the row length
    kind: str                  # "weight" (weight_type), "norm" (F32 ones) or "bias" (F32 random)
    qtype: QT

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.ne))

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return self.n_elements // block * size


def _name(t: T, suffix: str, bid: int | None = None) -> str:
    base = gguf.TENSOR_NAMES[t]
    return (base.format(bid=bid) if bid is not None else base) + "." + suffix


def tensor_specs(arch: str, *, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, head_dim: int, n_ff: int,
                 n_vocab: int, weight_type: str = "f32", tied_embeddings: bool = False) -> list[TensorSpec]:
    """Every tensor of the model, in file order, with llama.cpp's names and shapes."""
    wt = WEIGHT_TYPES[weight_type]
    n_q, n_kv = head_dim * n_head, head_dim * n_head_kv
    specs = [TensorSpec(_name(T.TOKEN_EMBD, "weight"), (n_embd, n_vocab), "weight", wt)]
    for il in range(n_layer):
        specs.append(TensorSpec(_name(T.ATTN_NORM, "weight", il), (n_embd,), "norm", QT.F32))
        specs.append(TensorSpec(_name(T.ATTN_Q, "weight", il), (n_embd, n_q), "weight", wt))
        specs.append(TensorSpec(_name(T.ATTN_K, "weight", il), (n_embd, n_kv), "weight", wt))
        specs.append(TensorSpec(_name(T.ATTN_V, "weight", il), (n_embd, n_kv), "weight", wt))
        if arch == "qwen2":
            specs.append(TensorSpec(_name(T.ATTN_Q, "bias", il), (n_q,), "bias", QT.F32))
            specs.append(TensorSpec(_name(T.ATTN_K, "bias", il), (n_kv,), "bias", QT.F32))
            specs.append(TensorSpec(_name(T.ATTN_V, "bias", il), (n_kv,), "bias", QT.F32))
        if arch in ("qwen3", "gemma3"):
            specs.append(TensorSpec(_name(T.ATTN_Q_NORM, "weight", il), (head_dim,), "norm", QT.F32))
            specs.append(TensorSpec(_name(T.ATTN_K_NORM, "weight", il), (head_dim,), "norm", QT.F32))
        specs.append(TensorSpec(_name(T.ATTN_OUT, "weight", il), (n_q, n_embd), "weight", wt))
        if arch == "gemma3":
            specs.append(TensorSpec(_name(T.ATTN_POST_NORM, "weight", il), (n_embd,), "norm", QT.F32))
        specs.append(TensorSpec(_name(T.FFN_NORM, "weight", il), (n_embd,), "norm", QT.F32))
        specs.append(TensorSpec(_name(T.FFN_GATE, "weight", il), (n_embd, n_ff), "weight", wt))
        specs.append(TensorSpec(_name(T.FFN_UP, "weight", il), (n_embd, n_ff), "weight", wt))
        specs.append(TensorSpec(_name(T.FFN_DOWN, "weight", il), (n_ff, n_embd), "weight", wt))
        if arch == "gemma3":
            specs.append(TensorSpec(_name(T.FFN_POST_NORM, "weight", il), (n_embd,), "norm", QT.F32))
    specs.append(TensorSpec(_name(T.OUTPUT_NORM, "weight"), (n_embd,), "norm", QT.F32))
    if not tied_embeddings:
        specs.append(TensorSpec(_name(T.OUTPUT, "weight"), (n_embd, n_vocab), "weight", wt))
    return specs


_FRESH_MAX = 1 << 20         # tensors up to this many elements get fresh random values
_RESERVOIR = 1 << 22         # elements per type in the reservoir large tensors are cut from
_PIECE = 1 << 22             # most elements generated and written at once
# std of a uniformly random quant: int8 in [-128, 127] (q8_0), nibble - 8 in [-8, 7] (q4_0)
_QUANT_STD = {QT.Q8_0: float(np.sqrt((256**2 - 1) / 12)), QT.Q4_0: float(np.sqrt((16**2 - 1) / 12))}


class _Random:
    """Encoded random tensor bytes: fresh for small tensors, windows of a fixed reservoir for large ones.

    Reservoirs hold _RESERVOIR already encoded elements per type (twice, so any window fits), so writing
    a large tensor costs a slice per piece and the file is written at disk speed.
    """

    def __init__(self, seed: int, std: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.std = std
        self._reservoirs: dict[QT, np.ndarray] = {}

    def encode(self, qtype: QT, n: int) -> np.ndarray:
        """n fresh random elements of type qtype, as bytes (n is a multiple of the type's block size)."""
        if qtype in (QT.F32, QT.F16):
            x = self.rng.standard_normal(n, dtype=np.float32) * np.float32(self.std)
            return x.astype(np.float32 if qtype == QT.F32 else np.float16).view(np.uint8)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        nb = n // block
        out = np.empty((nb, block_bytes), dtype=np.uint8)
        out[:, 2:] = np.frombuffer(self.rng.bytes(nb * (block_bytes - 2)), dtype=np.uint8).reshape(nb, -1)
        # random-sign scales: a uniform nibble - 8 has mean -0.5, the sign keeps the weights zero-mean
        d = np.float16(self.std / _QUANT_STD[qtype])
        scales = np.where(self.rng.integers(0, 2, nb, dtype=np.uint8) == 1, -d, d).astype(np.float16)
        out[:, :2] = scales.view(np.uint8).reshape(nb, 2)
        return out.reshape(-1)

    def window(self, qtype: QT, n: int) -> np.ndarray:
        """n elements (n <= _RESERVOIR) cut from the type's reservoir at a random block offset."""
        res = self._reservoirs.get(qtype)
        if res is None:
            r = self.encode(qtype, _RESERVOIR)
            res = self._reservoirs[qtype] = np.concatenate([r, r])
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        start = int(self.rng.integers(0, _RESERVOIR // block)) * block_bytes
        return res[start:start + n // block * block_bytes]


def _pieces(spec: TensorSpec, rnd: _Random) -> Iterator[np.ndarray]:
    """The tensor's bytes, in pieces of at most _PIECE elements."""
    n = spec.n_elements
    if spec.kind == "norm":
        yield np.ones(n, dtype=np.float32).view(np.uint8)
        return
    for p0 in range(0, n, _PIECE):
        m = min(_PIECE, n - p0)
        yield rnd.encode(spec.qtype, m) if n <= _FRESH_MAX else rnd.window(spec.qtype, m)


# ---- the file -------------------------------------------------------------------------------------

def _check_shape(arch: str, weight_type: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, head_dim: int,
                 n_ff: int, n_vocab: int, n_ctx_train: int) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r} (expected one of {', '.join(ARCHS)})")
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"unknown weight_type {weight_type!r} (expected one of {', '.join(WEIGHT_TYPES)})")
    dims = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_ff=n_ff,
                n_vocab=n_vocab, n_ctx_train=n_ctx_train)
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
    block = gguf.GGML_QUANT_SIZES[WEIGHT_TYPES[weight_type]][0]
    for k, v in dict(n_embd=n_embd, n_ff=n_ff, head_dim_x_n_head=head_dim * n_head).items():
        if v % block:
            raise ValueError(f"{weight_type} rows come in blocks of {block}: {k}={v} is not a multiple")


def write_random_gguf(path: str | Path, arch: str, *, n_layer: int, n_embd: int, n_head: int, n_head_kv: int,
                      head_dim: int, n_ff: int, n_vocab: int, n_ctx_train: int, weight_type: str = "f32",
                      tied_embeddings: bool = False, seed: int = 0, rope_freq_base: float = 10000.0,
                      rms_eps: float = 1e-6, weight_std: float = 0.02, name: str | None = None,
                      omit_tensors: Iterable[str] = (), n_swa: int = 0, swa_pattern: int | Sequence[bool] | None = None,
                      rope_freq_base_swa: float | None = None, rope_scaling_factor: float | None = None,
                      logit_softcap: float | None = None) -> Path:
    """Write a random-weights GGUF of family `arch` to `path`; returns the path.

    gemma3 only: n_swa (sliding window; 0 = every layer global), swa_pattern (a period: every period-th layer
    is global, libllama's default 6; or one flag per layer, True = sliding window), rope_freq_base_swa,
    logit_softcap (final_logit_softcapping). rope_scaling_factor: linear RoPE scaling (global layers).

    weight_type applies to every 2-D weight (embeddings and output included); norms and biases are F32.
    tied_embeddings: no output.weight (the model reuses token_embd.weight, like small Qwen models).
    omit_tensors: tensor names to leave out (tests of the loader's error for a missing tensor).
    """
    _check_shape(arch, weight_type, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_ctx_train)
    if arch != "gemma3" and (n_swa or swa_pattern is not None or rope_freq_base_swa or logit_softcap):
        raise ValueError(f"sliding windows and logit soft-capping are gemma3 options, not {arch}'s")
    path = Path(path)
    tok = build_tokenizer(arch, n_vocab)
    specs = tensor_specs(arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                         head_dim=head_dim, n_ff=n_ff, n_vocab=n_vocab, weight_type=weight_type,
                         tied_embeddings=tied_embeddings)
    omit = set(omit_tensors)
    unknown = omit - {s.name for s in specs}
    if unknown:
        raise ValueError(f"omit_tensors names tensors this model does not have: {sorted(unknown)}")
    specs = [s for s in specs if s.name not in omit]

    w = gguf.GGUFWriter(path, arch)
    w.add_name(name or f"random-{arch}-{n_layer}L-{n_embd}E-{weight_type}")
    w.add_file_type(int(_FILE_TYPES[weight_type]))
    if weight_type in ("q8_0", "q4_0"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_freq_base)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_vocab_size(n_vocab)
    if rope_scaling_factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scaling_factor)
    if n_swa:
        w.add_sliding_window(n_swa)
        if swa_pattern is not None:
            w.add_sliding_window_pattern(swa_pattern if isinstance(swa_pattern, int) else [bool(f) for f in swa_pattern])
        if rope_freq_base_swa:
            w.add_rope_freq_base_swa(rope_freq_base_swa)
    if logit_softcap:
        w.add_final_logit_softcapping(logit_softcap)

    _add_tokenizer(w, tok)
    for s in specs:
        # numpy order (reversed ne); a non-uint8 dtype tells gguf-py the shape is in elements, not bytes
        w.add_tensor_info(s.name, tuple(reversed(s.ne)), np.dtype(np.float32), s.nbytes, raw_dtype=s.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    _write_tensor_data(w, specs, _Random(seed, weight_std))
    w.close()
    return path


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


def _write_tensor_data(w: gguf.GGUFWriter, specs: list[TensorSpec], rnd: _Random) -> None:
    """Streams every tensor piece by piece, laid out as GGUFWriter.write_tensor_data does: each tensor
    starts at an aligned offset (the offsets in the tensor infos already written assume exactly this)."""
    assert w.fout is not None and len(w.fout) == 1
    fout = w.fout[0]
    for s in specs:
        w.write_padding(fout, fout.tell())
        written = 0
        for piece in _pieces(s, rnd):
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvflash_ggml.testing.random_gguf",
                                 description="Write a GGUF model with random weights (llama / qwen2 / qwen3 / gemma3).")
    ap.add_argument("out", help="output .gguf path")
    ap.add_argument("--shape", default="tiny-llama", choices=sorted(SHAPES), help="named shape (default tiny-llama)")
    ap.add_argument("--type", dest="weight_type", default="f16", choices=list(WEIGHT_TYPES),
                    help="type of the 2-D weights (default f16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tied-embeddings", action="store_true", help="no output.weight: reuse token_embd.weight")
    ap.add_argument("--n-layer", type=int, default=None, help="override the shape's layer count")
    ap.add_argument("--n-ctx-train", type=int, default=None, help="override the shape's trained context")
    args = ap.parse_args(argv)
    overrides = dict(weight_type=args.weight_type, seed=args.seed, tied_embeddings=args.tied_embeddings)
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
