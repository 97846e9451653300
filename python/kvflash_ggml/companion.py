"""The companion: a full-cache session of a second model (or of the model itself) that the Engine keeps
holding its history. The drafter policy scores from its attention capture. Its K/V is a full cache of the
history (not bounded by the pool): stats() reports its device bytes as such.

It runs only the tokens it does not hold (after the history diverged: from where it did). Its tokens are
the target's when both vocabularies are the same; otherwise the target history is detokenised and
retokenised for it, and a split into more tokens grows its context (a new session, a quarter more than
needed, up to what its model was trained for). A history longer than that is a DrafterContextError,
raised by check() before the engine changes anything for a prompt.
"""
from __future__ import annotations

import os
from typing import Optional, Union

import numpy as np

from . import _core
from .options import DeviceConfig
from .tokenizer import Tokenizer
from .tokens import forward_in_steps, keep_prefix
from .weights import load_model

GROWTH = 1.25  # a grown context holds this much more than the history that outgrew it


class DrafterContextError(ValueError):
    """The history, in the companion's tokens, is longer than its model was trained for."""


def same_vocabulary(a: Tokenizer, b: Tokenizer) -> bool:
    """Identical token -> text tables (and special tokens): positions then map one to one."""
    if (a.n_vocab, a.bos, a.eos) != (b.n_vocab, b.bos, b.eos):
        return False
    ids = np.arange(a.n_vocab, dtype=np.int32)
    ta, oa = a.pieces(ids)
    tb, ob = b.pieces(ids)
    return ta == tb and np.array_equal(oa, ob)


def retokenise(history, target: Tokenizer, own: Tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`own`'s tokens for the text of `target`'s tokens `history`, the target's piece offsets [n + 1] and its
    own [m + 1], both in bytes of that text. Special tokens are written out and parsed back, so a template's
    markers stay markers when both vocabularies know them."""
    text, t_off = target.pieces(history)
    # Invalid UTF-8 (a character cut between tokens at the end) is replaced: offsets after it shift
    # by a byte or two, which moves no token across a chunk in practice.
    tokens = own.encode(text.decode("utf-8", errors="replace"), add_special=False, parse_special=True)
    _, d_off = own.pieces(tokens)
    if own.add_bos and own.bos >= 0 and (not tokens or tokens[0] != own.bos):
        tokens = [own.bos] + tokens   # a BOS of no text, at byte 0
        d_off = np.concatenate([[0], d_off])
    return np.asarray(tokens, dtype=np.int32), t_off, d_off


class Companion:
    """model: a GGUF path (or known short name), or a loaded _core.Model (shared weights: a model may be its
    own companion). target_tokenizer: the engine's, to map by text when the vocabularies differ. n_ctx: the
    session's context, in the companion's tokens."""

    def __init__(self, model: Union[str, os.PathLike, _core.Model], target_tokenizer: Optional[Tokenizer], *,
                 n_ctx: int, backend: str = "auto", n_threads: Optional[int] = None, n_batch: int = 512) -> None:
        if isinstance(model, _core.Model):
            self.model = model
        else:
            _, self.model = load_model(model, DeviceConfig(backend=backend, n_threads=n_threads))
        if n_ctx > self.model.hparams.n_ctx_train:
            raise ValueError(f"the drafter {os.path.basename(self.model.path)} was trained for "
                             f"{self.model.hparams.n_ctx_train} tokens, less than n_ctx={n_ctx}: its context is "
                             "too small for the history")
        self.tokenizer = Tokenizer(self.model.path)
        self.target_tokenizer = target_tokenizer
        self.same_vocab = target_tokenizer is None or same_vocabulary(target_tokenizer, self.tokenizer)
        self.n_batch = n_batch
        self.n_forwarded = 0   # tokens run so far (tests count what each rescore costs)
        self.version = 0       # bumped by every hold(): the attention capture read before it is stale
        self._new_session(n_ctx)

    def _new_session(self, n_ctx: int) -> None:
        self.n_ctx = n_ctx
        self.session = _core.Session(self.model, _core.SessionConfig(
            max_tokens=n_ctx, pool_tokens=0, n_batch=self.n_batch, capture_attention=True))

    # -- context ---------------------------------------------------------------------------------
    def fit(self, n: int) -> None:
        """Make room for n of its tokens (a larger session: the held K/V are recomputed on the next run)."""
        if n <= self.n_ctx:
            return
        n_train = self.model.hparams.n_ctx_train
        if n > n_train:
            raise DrafterContextError(
                f"the history is {n} tokens for the drafter {os.path.basename(self.model.path)} (its vocabulary "
                f"splits the text differently), more than it was trained for ({n_train}): its context is too "
                f"small for the history; use a shorter prompt or a drafter with a longer context")
        C = _core.CHUNK_TOKENS
        self._new_session(min(n_train, -(-int(n * GROWTH) // C) * C))

    def check(self, tokens: np.ndarray) -> None:
        """Raise DrafterContextError if it cannot hold a history of these target tokens (growing to hold it)."""
        if not self.same_vocab:
            self.fit(len(self.retokenise(np.asarray(tokens, dtype=np.int32))[0]))

    def retokenise(self, history: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return retokenise(history, self.target_tokenizer, self.tokenizer)

    # -- holding tokens --------------------------------------------------------------------------
    def holds(self, tokens: np.ndarray) -> bool:
        return self.session.n_tokens == len(tokens) and self.session.shared_prefix(tokens) == len(tokens)

    def hold(self, tokens: np.ndarray, *, tail: int = 0) -> None:
        """Make the session hold `tokens` (its own), keeping the K/V of the prefix it shares with them and
        running at least the last `tail` of them again. The session captures attention, so its own step split
        (Session.step_tokens) runs the last CAPTURE_TOKENS of them in its last step, the one the capture covers."""
        tokens = np.asarray(tokens, dtype=np.int32)
        keep = keep_prefix(self.session, min(self.session.shared_prefix(tokens), len(tokens) - tail))
        self.version += 1
        new = tokens[keep:]
        if len(new):   # in steps: a long history is many short calls, so Ctrl-C is honoured between them
            forward_in_steps(self.session, new, keep)
        self.n_forwarded += len(new)
