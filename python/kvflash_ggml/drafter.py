"""The drafter residency policy: a second, smaller GGUF model reads the same history in the Engine's
companion session (companion.py), and where its last tokens look says which chunks of the target matter.

Per drafter position: the softmaxed attention of its last CAPTURE_TOKENS (8) positions (max over heads and
layers in C++, then max over those queries), smoothed over a centred window of 13 positions, z-normalised
over the history; then averaged per target chunk. Same vocabulary: drafter position == target position.
Different vocabulary: the target history is detokenised, retokenised for the drafter, and every drafter
token goes to the target chunk holding its first byte. The companion keeps its K/V between rescores and
runs only the tokens it has not seen.

Context: with the same vocabulary the drafter's context is the model's n_ctx. Another vocabulary may split
the same text into more tokens, so the companion's context grows when a history needs more; a prompt that
needs more than the drafter was trained for is refused before the engine computes anything (the engine
asks the companion), and a generation that outgrows it goes on without drafter rescoring (a logged warning).
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from . import _core
from .companion import Companion, DrafterContextError
from .policy import Policy, SessionView

SMOOTH_WINDOW = 13

log = logging.getLogger(__name__)


def smooth(x: np.ndarray, window: int = SMOOTH_WINDOW) -> np.ndarray:
    """Centred moving mean; at the ends the window is cut to the positions that exist, so the first
    and last positions are not pulled toward zero by padding."""
    half = window // 2
    c = np.concatenate([[0.0], np.cumsum(x, dtype=np.float64)])
    idx = np.arange(len(x))
    lo, hi = np.maximum(idx - half, 0), np.minimum(idx + half + 1, len(x))
    return ((c[hi] - c[lo]) / (hi - lo)).astype(np.float32)


def znorm(x: np.ndarray) -> np.ndarray:
    std = float(x.std())
    return np.zeros_like(x) if std == 0.0 else ((x - x.mean()) / std).astype(np.float32)


def position_scores(attention: np.ndarray) -> np.ndarray:
    return znorm(smooth(attention))


def chunk_means(scores: np.ndarray, chunk_of: np.ndarray, n_chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean score per chunk over the positions assigned to it, and how many there were."""
    sums = np.bincount(chunk_of, weights=scores, minlength=n_chunks)[:n_chunks]
    counts = np.bincount(chunk_of, minlength=n_chunks)[:n_chunks]
    return (sums / np.maximum(counts, 1)).astype(np.float32), counts


def token_at_byte(offsets: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Index of the token whose piece holds byte `at`, given piece start offsets [n + 1] (the last entry
    the total); empty pieces (a BOS without text) are skipped for the token starting at the same byte."""
    n = len(offsets) - 1
    return np.clip(np.searchsorted(offsets[:-1], at, side="right") - 1, 0, max(n - 1, 0))


def prompt_attention_scores(attention: np.ndarray, n_chunks: int) -> np.ndarray:
    """Chunk scores from the attention the last prompt tokens paid each position during an exact prefill
    (Session.prefill_exact): the target model's own attention, scored as the drafter's is."""
    s = position_scores(np.asarray(attention, dtype=np.float32))
    out, _ = chunk_means(s, np.arange(len(s)) // _core.CHUNK_TOKENS, n_chunks)
    return out


class DrafterPolicy(Policy):
    """Scores from the attention capture of `companion`, the full-cache session of the drafter model that
    the Engine keeps beside the model."""

    name = "drafter"
    reselects = True
    needs_summaries = False

    def __init__(self, companion: Companion) -> None:
        self.companion = companion
        self._attention: Optional[np.ndarray] = None   # per drafter position, for the tokens held
        self._version = -1                              # the companion's version it was captured at
        self._warned_full = False

    def scores(self, view: SessionView) -> Optional[np.ndarray]:
        C, n_chunks = view.chunk_tokens, view.n_chunks
        history = np.asarray(view.tokens, dtype=np.int32)
        if self.companion.same_vocab:
            s = position_scores(self.attention(history))
            out, _ = chunk_means(s, np.arange(len(s)) // C, n_chunks)
            return out
        tokens, t_off, d_off = self.companion.retokenise(history)
        try:
            self.companion.fit(len(tokens))
        except DrafterContextError as e:   # the generation outgrew the drafter: keep generating, unscored
            if not self._warned_full:
                log.warning("%s; no more drafter rescoring for this history", e)
            self._warned_full = True
            return None
        s = position_scores(self.attention(tokens))
        chunk_of = np.minimum(token_at_byte(t_off, d_off[:-1]) // C, n_chunks - 1)
        out, counts = chunk_means(s, chunk_of, n_chunks)
        # A chunk whose text lies inside one long drafter token gets that token's score.
        empty = np.flatnonzero(counts == 0)
        out[empty] = s[token_at_byte(d_off, t_off[np.minimum(empty * C, len(history) - 1)])]
        return out

    def attention(self, tokens: np.ndarray) -> np.ndarray:
        """Run the tokens the drafter has not seen; its last CAPTURE_TOKENS tokens' attention per position."""
        n, companion = len(tokens), self.companion
        if n == 0:
            raise ValueError("the drafter needs at least one token of history")
        if n > companion.n_ctx:
            raise ValueError(f"the history is {n} drafter tokens, more than the drafter's n_ctx={companion.n_ctx}: "
                             "its context is too small for the history")
        if self._version == companion.version and companion.holds(tokens):
            return self._attention
        # The capture covers the last step only: all of the last CAPTURE_TOKENS tokens must run in it.
        companion.hold(tokens, tail=min(_core.CAPTURE_TOKENS, n))
        self._attention, self._version = companion.session.attention_to_positions(), companion.version
        return self._attention
