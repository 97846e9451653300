"""The drafter residency policy: a second, smaller GGUF model reads the same history in its own
full-cache session, and where its last tokens look says which chunks of the target matter.

Per drafter position: the softmaxed attention of its last 8 positions (max over heads and layers in
C++, then max over those 8 queries), smoothed over a centred window of 13 positions, z-normalised over
the history; then averaged per target chunk. Same vocabulary: drafter position == target position.
Different vocabulary: the target history is detokenised, retokenised for the drafter, and every
drafter token goes to the target chunk holding its first byte. The drafter keeps its K/V between
rescores and runs only the tokens it has not seen (after the history diverged: from where it did).

Context: with the same vocabulary the drafter's context is the model's n_ctx. Another vocabulary may
split the same text into more tokens, so the drafter's context grows (a new session, by a quarter more
than needed, up to the drafter's trained context) when a history needs more; a prompt that needs more
than the drafter was trained for is refused before the engine computes anything (check_prompt), and
a generation that outgrows it goes on without drafter rescoring (a logged warning).
"""
from __future__ import annotations

import logging
import os
from typing import Optional, Sequence, Union

import numpy as np

from . import _core
from .known_models import resolve_model_path
from .policy import Policy, SessionView
from .tokenizer import Tokenizer
from .tokens import common_prefix, forward_in_steps

SMOOTH_WINDOW = 13
N_QUERY = 8   # the session captures the attention of the last 8 tokens of a step
GROWTH = 1.25  # a grown drafter context holds this much more than the history that outgrew it

log = logging.getLogger(__name__)


class DrafterContextError(ValueError):
    """The history, in the drafter's tokens, is longer than the drafter was trained for."""


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


def same_vocabulary(a: Tokenizer, b: Tokenizer) -> bool:
    """Identical token -> text tables (and special tokens): positions then map one to one."""
    if (a.n_vocab, a.bos, a.eos) != (b.n_vocab, b.bos, b.eos):
        return False
    ids = np.arange(a.n_vocab, dtype=np.int32)
    ta, oa = a.pieces(ids)
    tb, ob = b.pieces(ids)
    return ta == tb and np.array_equal(oa, ob)


class DrafterPolicy(Policy):
    """drafter_model: a GGUF path (or known short name), or a loaded _core.Model (shared weights: a model
    may be its own drafter). tokenizer: the target's, to map by text when the vocabularies differ.
    n_ctx: the drafter session's context, in drafter tokens."""

    name = "drafter"
    reselects = True
    needs_summaries = False

    def __init__(self, drafter_model: Union[str, os.PathLike, _core.Model], tokenizer: Optional[Tokenizer], *,
                 n_ctx: int, backend: str = "auto", n_threads: Optional[int] = None, n_batch: int = 512) -> None:
        if isinstance(drafter_model, _core.Model):
            self.model = drafter_model
        else:
            self.model = _core.Model(resolve_model_path(drafter_model), backend=backend, n_threads=n_threads or 0)
        hp = self.model.hparams
        if n_ctx > hp.n_ctx_train:
            raise ValueError(f"the drafter {os.path.basename(self.model.path)} was trained for {hp.n_ctx_train} "
                             f"tokens, less than n_ctx={n_ctx}: its context is too small for the history")
        self.tokenizer = Tokenizer(self.model.path)
        self.target_tokenizer = tokenizer
        self.same_vocab = tokenizer is None or same_vocabulary(tokenizer, self.tokenizer)
        self.n_batch = n_batch
        self._new_session(n_ctx)
        self.n_forwarded = 0            # drafter tokens run so far (tests count what each rescore costs)
        self._warned_full = False

    def _new_session(self, n_ctx: int) -> None:
        self.n_ctx = n_ctx
        self.session = _core.Session(self.model, _core.SessionConfig(
            max_tokens=n_ctx, pool_tokens=0, n_batch=self.n_batch, capture_attention=True))
        self._attention: Optional[np.ndarray] = None   # per drafter position, for the tokens held

    def _fit(self, n: int) -> None:
        """Make room for n drafter tokens (a larger session: the held K/V are recomputed on the next run)."""
        if n <= self.n_ctx:
            return
        n_train = self.model.hparams.n_ctx_train
        if n > n_train:
            raise DrafterContextError(
                f"the history is {n} tokens for the drafter {os.path.basename(self.model.path)} (its vocabulary "
                f"splits the text differently), more than it was trained for ({n_train}): its context is too "
                f"small for the history; use a shorter prompt or a drafter with a longer context")
        self._new_session(min(n_train, -(-int(n * GROWTH) // 64) * 64))

    def check_prompt(self, tokens: Sequence[int]) -> None:
        if not self.same_vocab:
            self._fit(len(self.retokenise(np.asarray(tokens, dtype=np.int32))[0]))

    def scores(self, view: SessionView) -> Optional[np.ndarray]:
        C, n_chunks = view.chunk_tokens, view.n_chunks
        history = np.asarray(view.tokens, dtype=np.int32)
        if self.same_vocab:
            s = position_scores(self.attention(history))
            out, _ = chunk_means(s, np.arange(len(s)) // C, n_chunks)
            return out
        tokens, t_off, d_off = self.retokenise(history)
        try:
            self._fit(len(tokens))
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

    def full_cache_for(self, model: _core.Model, tokens) -> Optional[_core.Session]:
        """A model that is its own drafter already computes the whole history in a full cache: lend it."""
        if model is not self.model or not self.same_vocab or len(tokens) > self.n_ctx:
            return None
        tokens = np.asarray(tokens, dtype=np.int32)
        self._run_from(tokens, common_prefix(self.session.tokens, tokens))
        return self.session

    def retokenise(self, history: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Drafter tokens for the target history's text, the target's piece offsets [n + 1] and the
        drafter's [m + 1], both in bytes of that text. Special tokens are written out and parsed back, so
        a template's markers stay markers when both vocabularies know them."""
        text, t_off = self.target_tokenizer.pieces(history)
        # Invalid UTF-8 (a character cut between tokens at the end) is replaced: offsets after it shift
        # by a byte or two, which moves no token across a 64-token chunk in practice.
        tokens = self.tokenizer.encode(text.decode("utf-8", errors="replace"), add_special=False,
                                       parse_special=True)
        _, d_off = self.tokenizer.pieces(tokens)
        bos = self.tokenizer.bos
        if self.tokenizer.add_bos and bos >= 0 and (not tokens or tokens[0] != bos):
            tokens = [bos] + tokens   # a BOS of no text, at byte 0
            d_off = np.concatenate([[0], d_off])
        return np.asarray(tokens, dtype=np.int32), t_off, d_off

    def attention(self, tokens: np.ndarray) -> np.ndarray:
        """Run the tokens the drafter has not seen; its last N_QUERY tokens' attention per position."""
        n = len(tokens)
        if n == 0:
            raise ValueError("the drafter needs at least one token of history")
        if n > self.n_ctx:
            raise ValueError(f"the history is {n} drafter tokens, more than the drafter's n_ctx={self.n_ctx}: "
                             "its context is too small for the history")
        held = self.session.tokens
        keep = common_prefix(held, tokens)
        if keep == n == len(held) and self._attention is not None:
            return self._attention
        # The capture covers the last step only: all of the last N_QUERY tokens must run in it.
        tail = min(N_QUERY, n)
        self._run_from(tokens, min(keep, n - tail), tail)
        self._attention = self.session.attention_to_positions()
        return self._attention

    def _run_from(self, tokens: np.ndarray, keep: int, tail: int = 0) -> None:
        """Make the session hold `tokens`, keeping the K/V of its first `keep` and running the rest, with at
        least the last `tail` of them in the session's last step (the one the capture covers)."""
        if keep < self.session.n_tokens:
            self.session.truncate(keep)
        self._attention = None
        new = tokens[keep:]
        # forward_in_steps: a long history is many short calls, so Ctrl-C is honoured between them
        if 0 < len(new) % self.session.config.n_batch < tail:   # the session's last step would be short
            forward_in_steps(self.session, new[:len(new) - tail], keep)
            self.session.forward(new[len(new) - tail:], len(tokens) - tail)
        elif len(new):
            forward_in_steps(self.session, new, keep)
        self.n_forwarded += len(new)

