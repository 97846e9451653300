"""Token lists and the forward steps that feed them: what the engine, the companion session and the
drafter share (no module of the package below this one)."""
from __future__ import annotations

import collections.abc
import numbers
from typing import Callable, Generator, Sequence, TypeVar, Union

import numpy as np

from . import _core

T = TypeVar("T")


def forward_in_steps(session: _core.Session, tokens: np.ndarray, start: int, *,
                     between: Callable[[], None] = lambda: None) -> np.ndarray:
    """session.forward(tokens, start), one forward call per step the session would take anyway
    (Session.step_tokens: n_batch tokens, fewer where the pool cannot place more, and a last step that holds
    the captured tokens whole), with between() called between them: a long prompt is then many short C calls,
    and Python runs its signal handlers (Ctrl-C) after each rather than after the whole prompt. Same steps,
    so the same numbers as one call. The logits after the last token."""
    return drive(forward_steps(session, tokens, start), between)


def forward_steps(session: _core.Session, tokens: np.ndarray, start: int) -> Generator[None, None, np.ndarray]:
    """forward_in_steps as a generator: it yields between the steps and returns the logits (a server's round
    runs one step of a prompt, then the other slots' decode steps)."""
    n, done = len(tokens), 0
    while True:
        step = session.step_tokens(n - done)
        if done + step >= n:
            return session.forward(tokens[done:], start + done)
        session.forward(tokens[done:done + step], start + done)
        done += step
        yield


def drive(steps: Generator[None, None, T], between: Callable[[], None]) -> T:
    """Run a generator of steps to its end, calling between() at each of its yields; if between() raises, the
    generator is closed first (its clean-up runs: a prompt rolls back), then the exception goes on."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        try:
            between()
        except BaseException:
            steps.close()
            raise


def rewind(session: _core.Session, n: int) -> int:
    """Make the session hold its first n tokens, or as many of them as it can go back to exactly; returns how
    many it holds. A sliding-window model's rings hold only the last window + n_batch positions, and a
    linear-attention state only the end and its checkpoints (Session.rewind_point), so going back further
    lands on the latest checkpoint before n, or starts over from nothing held (0): continuing from a state
    that does not belong to the held tokens would be wrong."""
    m = session.rewind_point(n)
    if m == 0:
        session.reset()
    else:
        session.truncate(m)
    return m


def keep_prefix(session: _core.Session, n_keep: int) -> int:
    """Make the session hold at most its first n_keep tokens (the prefix its caller found shared with what comes
    next): goes back only when it holds more, and then to where it can go back exactly (rewind); returns how
    many it holds. The engine's prompt, the draft model and the drafter's companion all hold tokens so."""
    return rewind(session, n_keep) if n_keep < session.n_tokens else n_keep


class HeldHistory(collections.abc.Sequence):
    """A generation's history as its session holds it: the held tokens, then `pending` (picked, fed by the next
    step). The session owns the tokens; this view reads only the positions asked for (a slice is a list of those
    alone), so a drafter that follows a long history pays for what is new, not for a copy of it all."""

    def __init__(self, session: _core.Session, pending: int) -> None:
        self.session, self.pending = session, int(pending)

    def __len__(self) -> int:
        return self.session.n_tokens + 1

    def __getitem__(self, i):
        n = len(self)
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step != 1:
                raise ValueError("HeldHistory: slices have step 1")
            if stop <= start:
                return []
            held = self.session.token_range(start, min(stop, n - 1)).tolist() if start < n - 1 else []
            return held + [self.pending] if stop == n else held
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"HeldHistory index {i} out of range for {n} tokens")
        return self.pending if j == n - 1 else int(self.session.token_range(j, j + 1)[0])

    def __iter__(self):
        return iter(self[:])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self[:], dtype=dtype if dtype is not None else np.int32)


def token_ids(tokens: Sequence[int], n_vocab: int) -> list[int]:
    """The prompt as Python ints, each a token id of the vocabulary; a clear error otherwise."""
    out = []
    for i, t in enumerate(tokens):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise ValueError(f"prompt[{i}] is {t!r}: a prompt is text (str or UTF-8 bytes), chat messages, "
                             f"or token ids (ints)")
        out.append(int(t))
    bad = [(i, t) for i, t in enumerate(out) if not 0 <= t < n_vocab]
    if bad:
        i, t = bad[0]
        raise ValueError(f"token id {t} (prompt[{i}]) is outside the vocabulary [0, {n_vocab})"
                         + (f" ({len(bad)} ids are)" if len(bad) > 1 else ""))
    return out


# Bytes-like prompts: text. A memoryview is also a sequence of ints, and list() of it once made token ids.
BYTES_LIKE = (bytes, bytearray, memoryview)


def utf8_text(data: Union[bytes, bytearray, memoryview]) -> str:
    if isinstance(data, memoryview) and data.format not in ("B", "b", "c"):
        raise ValueError(f"a memoryview prompt is UTF-8 text, but this one holds items of format {data.format!r}, "
                         f"not bytes; pass token ids as a list of ints")
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"a bytes prompt is UTF-8 text, but this one is not valid UTF-8 ({e})") from None


def text_if_bytes(prompt: object) -> object:
    """A bytes-like prompt (bytes, bytearray, memoryview) as the UTF-8 text it holds; any other as it is."""
    return utf8_text(prompt) if isinstance(prompt, BYTES_LIKE) else prompt


def chunk_aligned_batches(start: int, end: int, step: int) -> list[tuple[int, int]]:
    """[lo, hi) batches of at most `step` tokens that end on chunk boundaries (but the last)."""
    batches, lo = [], start
    while lo < end:
        hi = min(lo + step - lo % _core.CHUNK_TOKENS, end)
        batches.append((lo, hi))
        lo = hi
    return batches


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n
