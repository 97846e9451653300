"""Residency policies: which chunks deserve the pool. A policy only scores chunks; the pager decides
what moves (protected chunks always stay; the rest by score) and the engine decides when to ask.

  lru     never reselects: the pager evicts the oldest-written chunk (a StreamingLLM-like baseline)
  qk      cos(query, mean key of the chunk), max over query heads, mean over layers (C++)
  quest   Quest's upper bound sum_i max(q_i*min_i, q_i*max_i), max over heads, mean over layers (C++)
  drafter a second, smaller model's attention from its last tokens to the history (drafter.py)
  callable(view) -> one score per chunk (higher = keep), for your own ideas
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from . import _core


@dataclass
class SessionView:
    """What a user policy may look at; arrays (the tokens too) are read from the session on demand."""

    session: _core.Session

    @property
    def tokens(self) -> np.ndarray:
        """The tokens whose K/V the session holds, in order."""
        return self.session.tokens

    @property
    def n_chunks(self) -> int:
        return self.session.pager.n_chunks()

    @property
    def chunk_tokens(self) -> int:
        return self.session.pager.config().chunk_tokens

    def queries(self) -> np.ndarray:
        """[n_layer, n_tokens, n_head, head_dim] post-RoPE queries of the latest step."""
        return self.session.queries()

    def mean_keys(self) -> np.ndarray:
        """[n_chunks_sealed, n_layer, n_head_kv, head_dim] L2-normalised mean keys."""
        return self.session.mean_keys()

    def builtin_scores(self, kind: str) -> np.ndarray:
        return self.session.chunk_scores(kind)


class Policy:
    name = "base"
    reselects = False          # does the engine ask this policy to reselect?
    needs_summaries = False    # must the session summarise sealed chunks?

    def scores(self, view: SessionView) -> Optional[np.ndarray]:
        return None


class LRU(Policy):
    name = "lru"


class BuiltinScorer(Policy):
    reselects = True
    needs_summaries = True

    def __init__(self, kind: str) -> None:
        self.name = kind

    def scores(self, view: SessionView) -> np.ndarray:
        return view.builtin_scores(self.name)


class CallablePolicy(Policy):
    reselects = True
    needs_summaries = True

    def __init__(self, fn: Callable[[SessionView], Sequence[float]]) -> None:
        self.fn = fn
        self.name = getattr(fn, "__name__", "callable")

    def scores(self, view: SessionView) -> np.ndarray:
        s = np.asarray(self.fn(view), dtype=np.float32)
        if s.shape != (view.n_chunks,):
            raise ValueError(f"policy {self.name!r} returned {s.shape} scores; expected ({view.n_chunks},), "
                             "one per chunk")
        return s
