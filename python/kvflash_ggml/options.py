"""Option dataclasses shared by the Python API, the CLI and the server (defined once here)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

CHUNK_TOKENS = 64
AUTO_POOL_TOKENS = 4096


@dataclass(frozen=True)
class PoolConfig:
    """Where the KV cache lives. pool_tokens=None is full-cache mode (every position resident);
    an int or "auto" is KVFlash with that many device slots."""

    n_ctx: int = 4096
    pool_tokens: Union[None, int, str] = None
    kv_type: str = "f16"
    attention: str = "auto"        # "auto" | "flash" | "matmul"
    n_batch: int = 512
    sink_chunks: int = 1
    tail_chunks: int = 4
    allow_beyond_train_ctx: bool = False

    def __post_init__(self) -> None:
        # Checked here, by name: the core would report a bad n_ctx as its own max_tokens.
        for name in ("n_ctx", "n_batch", "sink_chunks", "tail_chunks"):
            value = getattr(self, name)
            if not _is_int(value) or value < (0 if name.endswith("chunks") else 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def resolved_pool_tokens(self) -> int:
        """0 for full cache, else the pool size in tokens (a multiple of 64)."""
        p = self.pool_tokens
        if p is None or p == "off":
            return 0
        if p == "auto":
            ctx = -(-self.n_ctx // CHUNK_TOKENS) * CHUNK_TOKENS
            minimum = (self.sink_chunks + self.tail_chunks + 2) * CHUNK_TOKENS
            return max(min(ctx, AUTO_POOL_TOKENS), minimum)
        if isinstance(p, bool) or not isinstance(p, int):
            raise ValueError(f"pool_tokens must be None, 'auto' or an int, not {p!r}")
        if p <= 0:
            raise ValueError(f"pool_tokens must be positive (got {p}); use None for full cache")
        return p

    def prefill_batch(self) -> int:
        """Tokens per forward step. A pooled step's tokens see only what the pool holds besides the step
        itself, so the K/V of a long prompt are computed under a window of pool - step tokens (+ sinks),
        and retrieval later reads them. Pooled steps are therefore kept at 1/8 of the pool: on SmolLM2 8K
        passkeys (scripts/retrieval_sweep.py, H100, 18 cases), drafter policy at pool 512, step 512 -> 64
        raised recall 0.44 -> 0.67 (oracle 0.44 -> 0.67, quest 0.00 -> 0.22). Pools of 4096+ keep 512."""
        pool = self.resolved_pool_tokens()
        if pool == 0:
            return self.n_batch
        return min(self.n_batch, max(CHUNK_TOKENS, pool // 8 // CHUNK_TOKENS * CHUNK_TOKENS))


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
