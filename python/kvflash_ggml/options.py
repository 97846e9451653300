"""Option dataclasses shared by the Python API, the CLI and the server (defined once here)."""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

from . import _core

EXACT_PREFILL_STEP = 1024
AUTO_POOL_TOKENS = 4096
# A GPU pool 'auto' chooses is a multiple of this many slots: a decode step attends n_kv = min(occupied rounded up
# to 256, pool) slots, and ggml-cuda's flash attention takes its grouped-query kernels only when n_kv % 256 == 0
# (fattn.cu: gqa_opt_applies); a whole-context pool of 32,960 slots (8 x 32K served) left n_kv at 32,960 for every
# decode step. The core pads n_kv to 256 for the same reason (session.cpp: k_kv_pad).
GPU_POOL_ALIGN = 256
# Adaptive tau: decode tokens between reselects are max(tau, held tokens // TAU_CONTEXT_DIVISOR), so a long
# context is rescored less often (each rescore costs more) while a short one follows tau.
TAU_CONTEXT_DIVISOR = 45
# Prompt tokens recomputed after the post-prompt reselect pages evidence in: one chunk. Measured on SmolLM2
# passkeys at 8K (experiments/retrieval_sweep.py, H100, 18 cases), oracle policy, pool 1024: recall 0.22 with 8,
# 0.78 with 64 or 256; pool 512: 0.11 / 0.44 / 0.50, and 0 with 512 (a refresh as large as the pool pushes
# the evidence it should read back out).
REFRESH_TOKENS = _core.CHUNK_TOKENS
PREFILL_MODES = ("auto", "exact", "sparse", "pooled")
# prefill="auto": a prompt whose context ends past SPARSE_FROM_TOKENS runs sparse where it can (flash attention), else
# exact. The crossover, measured on an H100 / H200 (8B shape, RESULTS R98-R99): exact 8,590-8,760 tok/s at 32K,
# 4,640 at 128K, 2,740-2,810 at 256K (its cost per token grows with the context); sparse 7,180-7,220 at 32K,
# 6,840-6,880 at 256K: a line through exact's figures meets sparse's near 60K.
SPARSE_FROM_TOKENS = 65536
# A sparse prefill's blocks of queries attend the sink chunk, the window of SPARSE_LOCAL_CHUNKS chunks before them and
# the SPARSE_TOP_CHUNKS chunks their mean query scores highest (model/sparse_attention.h): 2,048 + 1,024 keys plus the
# block's own, whatever the prompt's length.
SPARSE_TOP_CHUNKS = 31
SPARSE_LOCAL_CHUNKS = 16
KV_TYPES = ("f16", "q8_0", "q4_0")
# tail_chunks="auto": the protected tail window (the head chunk and tail_chunks before it, cpp/pager/kv_pager.h I4)
# takes at most a quarter of the pool's chunks, 1 to TAIL_CHUNKS. At pool 512 (8 chunks) a tail of 4 left 2 chunks for
# evidence; 2 kept the full cache's figures on SmolLM2 RULER at 8K, 50 cases a task: multiquery 0.195 -> 0.250 and
# multivalue 0.245 -> 0.285 (the full cache's 0.265 / 0.305), niah, multikey, vt, cwe and passkeys equal or better
# (docs/RESULTS.md R130, R133, R134). Pools of 1024 and up keep 4, as measured.
TAIL_CHUNKS = 4
# How the post-prompt reselect scores chunks after an exact prefill: "attention", the attention the prompt's
# last tokens paid each chunk, captured during the prefill (the target model's own attention: no second
# model), or "policy", the residency policy's scores. "auto": attention for the built-in policies, the
# policy for your own (a callable or Policy object is asked whenever the engine reselects).
PROMPT_SCORES = ("auto", "attention", "policy")


@dataclass(frozen=True)
class PoolConfig:
    """Where the KV cache lives. pool_tokens=None is full-cache mode (every position resident);
    an int or "auto" is KVFlash with that many device slots. "auto" resolves here to min(n_ctx, 4096); a Model
    (and the server) on a GPU or on devices of a split replaces it with what every device's free memory holds,
    and under max_device_bytes with what the budget holds (fit.py).

    "auto" is the default: a context the pool holds runs as the full cache would (nothing is paged, and the
    output is the full cache's), and a longer one pages instead of holding it all on the device; a prompt larger
    than the pool is computed exactly (ResidencyConfig.prefill). None asks for the full cache.

    max_device_bytes: a cap on each device's whole footprint (weights, pools, rings and state, compute buffers,
    the exact prefill's workspace, headroom), the local CPU's included: "auto" is sized within it, and a pool
    given as a number (or the full cache) is checked against it and refused if it does not fit (fit.py).

    max_host_bytes: a cap on the host store, the K/V the sessions' pools send to host memory (at most an image per
    chunk of n_ctx); None: the memory the host has available when the sessions are made. Sessions whose context
    could outgrow it are refused when made (host_store.py), not ended by the OOM killer part way.

    sink_chunks / tail_chunks: the chunks never evicted besides the pinned: the first sink_chunks, and the tail window
    (the head chunk and tail_chunks before it); tail_chunks "auto": a quarter of the pool's chunks, 1 to TAIL_CHUNKS."""

    n_ctx: int = 4096
    pool_tokens: Union[None, int, str] = "auto"
    kv_type: str = "f16"
    attention: str = "auto"        # "auto" | "flash" | "matmul"
    n_batch: int = 512
    sink_chunks: int = 1
    tail_chunks: Union[int, str] = "auto"
    allow_beyond_train_ctx: bool = False
    max_device_bytes: Optional[int] = None
    max_host_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        # Checked here, by name: the core would report a bad n_ctx as its own max_tokens.
        for name in ("n_ctx", "n_batch", "sink_chunks", "tail_chunks"):
            value = getattr(self, name)
            if name == "tail_chunks" and value == "auto":
                continue
            least, what = (0, "an integer >= 0") if name.endswith("chunks") else (1, "a positive integer")
            if name == "tail_chunks":
                what += " or 'auto'"
            if not _is_int(value) or value < least:
                raise ValueError(f"{name} must be {what}, got {value!r}")
        for name in ("max_device_bytes", "max_host_bytes"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value <= 0):
                raise ValueError(f"{name} must be a positive number of bytes (or None: "
                                 f"{'no cap' if name == 'max_device_bytes' else 'the memory available'}), got {value!r}")
        pool = self.resolved_pool_tokens()
        if pool:   # the core's own rules (a multiple of a chunk, at least the minimum), before any weight loads
            self._pager_config(pool).validate()

    def _pager_config(self, pool_tokens: int) -> _core.PagerConfig:
        return _core.PagerConfig(chunk_tokens=_core.CHUNK_TOKENS, pool_tokens=pool_tokens, max_tokens=self.n_ctx,
                                 sink_chunks=self.sink_chunks, tail_chunks=self.resolved_tail_chunks(pool_tokens))

    def resolved_tail_chunks(self, pool_tokens: int) -> int:
        """The tail window's chunks besides the head chunk for a pool of pool_tokens (0: the smallest pool's)."""
        if self.tail_chunks != "auto":
            return self.tail_chunks
        return min(TAIL_CHUNKS, max(1, pool_tokens // _core.CHUNK_TOKENS // 4))

    def resolved_pool_tokens(self) -> int:
        """0 for full cache, else the pool size in tokens (a multiple of the chunk size)."""
        p = self.pool_tokens
        if p is None or p == "off":
            return 0
        if p == "auto":
            C = _core.CHUNK_TOKENS
            return max(min(-(-self.n_ctx // C) * C, AUTO_POOL_TOKENS), self._pager_config(0).min_pool_tokens())
        if isinstance(p, bool) or not isinstance(p, int):
            raise ValueError(f"pool_tokens must be None, 'auto' or an int, not {p!r}")
        return p

    def prefill_batch(self) -> int:
        """Tokens per forward step. A pooled step's tokens see only what the pool holds besides the step
        itself, so the K/V of a long prompt are computed under a window of pool - step tokens (+ sinks),
        and retrieval later reads them. Pooled steps are therefore kept at 1/8 of the pool: on SmolLM2 8K
        passkeys (experiments/retrieval_sweep.py, H100, 18 cases), drafter policy at pool 512, step 512 -> 64
        raised recall 0.44 -> 0.67 (oracle 0.44 -> 0.67, quest 0.00 -> 0.22). Pools of 4096+ keep 512."""
        pool = self.resolved_pool_tokens()
        if pool == 0:
            return self.n_batch
        C = _core.CHUNK_TOKENS
        return min(self.n_batch, max(C, pool // 8 // C * C))

    def exact_prefill_batch(self, flash_attn: bool) -> int:
        """Tokens per step of the exact (layer-major) prefill. With flash attention at least EXACT_PREFILL_STEP:
        each step pays a fixed cost besides its kernels (its hidden-state tile in and out of host memory, and a
        graph launch), and the exact prefill takes n_layer steps where a full cache takes one: on the H100 (8B,
        32K prompt, experiments/profile_prefill.py) steps of 512 spent 5.7 s, of 2048 4.9 s, for the same kernel
        time. The step's mask and attention matrix do not grow with it: a step attends its queries in blocks
        that fit _core.ATTENTION_BLOCK_BYTES. Without flash attention (the CPU's default path) the step stays
        n_batch: larger steps were measured only with flash attention on the H100."""
        return max(self.n_batch, EXACT_PREFILL_STEP) if flash_attn else self.n_batch


@dataclass(frozen=True)
class ResidencyConfig:
    """Which chunks stay in the pool, and how a prompt is computed.
    policy: "lru" | "qk" | "quest" | "drafter", a Policy, or a callable view -> one score per chunk.
    tau: decode tokens between reselects (adaptive: see TAU_CONTEXT_DIVISOR).
    prefill_reselect: reselect before each prefill batch (the previous batch's queries pick what stays).
    refresh_tokens: prompt tokens run again after a pooled prefill's post-prompt reselect paged anything in
    (0 = none).
    prefill: "exact" gives every prompt position the K/V a full-cache run writes: a prompt larger than the pool runs
    layer-major (Session.prefill_exact), in device memory of the pool plus one layer's K/V of the prompt. "sparse"
    runs it layer-major too, but each block of 256 queries past the first few thousand positions attends only the
    sink, a window and the sparse_top_chunks chunks its queries score highest (the prompt's last step attends every
    key): its attention costs about the same per token at any length; every position's K/V is still computed and
    kept. "auto" (default): sparse for a context past SPARSE_FROM_TOKENS with flash attention, else exact. "pooled"
    computes a prompt in the pool: cheaper, but a K/V written after its evidence was paged out never saw it.
    sparse_top_chunks: the far chunks a sparse prefill's block chooses.
    prompt_scores: how the post-prompt reselect after an exact prefill scores chunks (see PROMPT_SCORES).
    drafter_model: the GGUF path, short name or loaded _core.Model that policy="drafter" runs beside the model."""

    policy: Union[str, Callable] = "lru"
    tau: int = 64
    prefill_reselect: bool = False
    refresh_tokens: int = REFRESH_TOKENS
    prefill: str = "auto"
    prompt_scores: str = "auto"
    sparse_top_chunks: int = SPARSE_TOP_CHUNKS
    drafter_model: Union[None, str, os.PathLike, _core.Model] = None

    def __post_init__(self) -> None:
        if self.prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {self.prefill!r}")
        if self.prompt_scores not in PROMPT_SCORES:
            raise ValueError(f"prompt_scores must be one of {PROMPT_SCORES}, got {self.prompt_scores!r}")
        if not _is_int(self.sparse_top_chunks) or self.sparse_top_chunks <= 0:
            raise ValueError(f"sparse_top_chunks must be a positive number of chunks, got {self.sparse_top_chunks!r}")
        if not _is_int(self.tau) or self.tau <= 0:
            raise ValueError(f"tau must be positive, got {self.tau}")
        if not _is_int(self.refresh_tokens) or self.refresh_tokens < 0:
            raise ValueError(f"refresh_tokens must be >= 0, got {self.refresh_tokens}")

    def reselect_every(self, n_tokens: int) -> int:
        """Decode tokens between reselects with n_tokens held (adaptive tau)."""
        return max(self.tau, n_tokens // TAU_CONTEXT_DIVISOR)


@dataclass(frozen=True)
class DeviceConfig:
    """Where the layers go and how many CPU threads compute, as llama.cpp splits a model (each layer's weights and
    K/V on its device). backend: "auto" (the RPC servers' devices, then this host's GPU if any, else the CPU),
    "cpu", "cuda" or "rpc" (the servers alone). rpc: ggml-rpc-servers as "host:port" (a list, or one comma-separated
    string), then this host's GPU; or devices: the list in layer order ("cpu", "cudaN", "rpc:HOST:PORT");
    tensor_split: their shares of the layers (default: by free memory). n_threads: CPU threads (None or 0: the
    cores other processes leave free, threads.py).

    Checked here: the shapes above and n_threads. How the devices combine (rpc beside devices, one share per
    device, an endpoint's spelling and whether it answers within 5 s) is the core's to check when the model loads
    (cpp/model/device_split.h, cpp/model/rpc.h): ValueError, or ConnectionError for a server that does not answer."""

    backend: str = "auto"
    rpc: Sequence[str] = ()
    devices: Sequence[str] = ()
    tensor_split: Sequence[float] = ()
    n_threads: Optional[int] = None

    def __post_init__(self) -> None:
        rpc = self.rpc
        if isinstance(rpc, str):   # "host:port,host:port", as --rpc spells it
            rpc = [e.strip() for e in rpc.split(",") if e.strip()]
        # Stored as tuples (a frozen config holds no list a caller could change); None is "none given".
        for name, value in (("rpc", rpc), ("devices", self.devices), ("tensor_split", self.tensor_split)):
            object.__setattr__(self, name, tuple(value or ()))
        if self.n_threads is not None and (not _is_int(self.n_threads) or self.n_threads < 0):
            raise ValueError(f"n_threads must be a positive integer or None (the free cores), got {self.n_threads!r}")

    def placement(self) -> dict:
        """_core.Model(...)'s keywords for where the layers go (the thread count is resolved when the model loads:
        loading.load)."""
        return dict(backend=self.backend, rpc=list(self.rpc), devices=list(self.devices),
                    tensor_split=list(self.tensor_split))


SPECULATIVE_MODES = ("prompt_lookup", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a drafter proposes up to max_draft tokens, the model verifies them in one step on
    the pool and keeps the longest prefix its own choice agrees with (greedy), or accepts each by the standard
    rule (sampling), so the output is what plain decoding gives (greedy) or follows its distribution (sampled).
    draft: "prompt_lookup" (the continuation of the latest earlier occurrence of the last n-gram of the held
    tokens: no second model), "mtp" (the GGUF's own multi-token-prediction layers), or a smaller GGUF (a path,
    a short name or a loaded _core.Model) with the same vocabulary.
    max_draft: the most tokens proposed per step; the count adapts to the recent acceptance.
    ngram: prompt lookup matches the last ngram tokens, then fewer, down to 1."""

    draft: Union[str, os.PathLike, _core.Model] = "prompt_lookup"
    max_draft: int = 8
    ngram: int = 3

    def __post_init__(self) -> None:
        if not _is_int(self.max_draft) or not 1 <= self.max_draft <= 64:
            raise ValueError(f"max_draft must be an integer in [1, 64], got {self.max_draft!r}")
        if not _is_int(self.ngram) or not 1 <= self.ngram <= 16:
            raise ValueError(f"ngram must be an integer in [1, 16], got {self.ngram!r}")
        if not isinstance(self.draft, (str, os.PathLike, _core.Model)):
            raise ValueError(f"draft must be 'prompt_lookup', 'mtp', a GGUF path or a loaded model, got {self.draft!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen, with llama-cpp-python's conventions: temperature 0 is greedy
    (deterministic), seed None or -1 is a fresh random seed, max_tokens None generates until an
    end-of-generation token or a full context."""

    max_tokens: Optional[int] = 128
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: Optional[int] = None
    stop: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise ValueError(f"max_tokens must be an integer >= 0, or None (until the context is full), "
                             f"got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not self.temperature >= 0.0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < -1):
            raise ValueError(f"seed must be an integer >= 0, or None / -1 (random), got {self.seed!r}")
        if self.seed == -1:
            object.__setattr__(self, "seed", None)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a sequence of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
