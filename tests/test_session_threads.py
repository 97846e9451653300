"""Sessions used from several Python threads (issue 18): serialised in C++, never a crash.

Session.forward releases the GIL, and sessions of one model compute through the model's one CPU backend
(its work buffer is shared), so before the fix two threads on one session, or on two sessions of one
model, crashed the process (SIGSEGV). Now every Session method holds the session's mutex, compute holds
the model's, and Session.pager / Session.kv take the session's lock per call. Each scenario runs in a
child process, so a crash fails the test with its exit code instead of killing pytest, and a deadlock
runs into the child's timeout. Results are compared bit for bit with a single-threaded twin: a
serialised computation is the same computation.
"""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

N_THREADS = 4
STEPS = 40            # forwards per thread
CONFIG = dict(max_tokens=1024, pool_tokens=128, chunk_tokens=16, track_summaries=True)   # 8 blocks: pages


def _core():
    from kvflash_ggml import _core
    return _core


def _model(path):
    return _core().Model(path, backend="cpu", n_threads=1)


def _session(model, **kw):
    c = _core()
    return c.Session(model, c.SessionConfig(**{**CONFIG, **kw}))


def _run_threads(targets):
    errors = []

    def guard(fn):
        def run():
            try:
                fn()
            except BaseException as e:   # noqa: BLE001 - reported by the main thread
                errors.append(e)
        return run

    threads = [threading.Thread(target=guard(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _append(s, tok):
    """Append tok at the head, retrying when another thread moved the head first; (start, logits)."""
    while True:
        start = s.n_tokens
        try:
            return start, s.forward(tok, start)
        except ValueError as e:   # another thread appended between n_tokens and forward
            assert "start=" in str(e), e


def one_session_many_threads(path: str) -> None:
    """N threads append tokens to one session (retrying when another thread moved the head first) while a
    reader polls its pager, pool, tokens and scores. Every logit vector must equal the twin's at that
    position, the twin being one thread replaying the final token order."""
    model = _model(path)
    s = _session(model)
    got: dict[int, np.ndarray] = {}
    done = threading.Event()

    def writer(seed):
        rng = np.random.default_rng(seed)
        for _ in range(STEPS):
            tok = np.array([rng.integers(0, 1000)], np.int32)
            start, logits = _append(s, tok)
            got[start] = logits

    def reader():
        while not done.is_set():
            p = s.pager
            p.n_chunks(), p.chunk_blocks(), p.stats(), repr(p)
            s.kv.host_bytes, s.tokens, s.timings, s.queries()
            if s.n_tokens:
                s.chunk_scores("qk")

    writers = [lambda i=i: writer(i) for i in range(N_THREADS)]
    read = threading.Thread(target=reader)
    read.start()
    try:
        _run_threads(writers)
    finally:
        done.set()
        read.join()
    s.pager.check_invariants()
    tokens = s.tokens
    assert len(tokens) == N_THREADS * STEPS == len(got)
    twin = _session(model)
    for p, t in enumerate(tokens):
        np.testing.assert_array_equal(got[p], twin.forward(np.array([t], np.int32), p), err_msg=f"position {p}")
    print("one session: ok")


def two_sessions_one_model(path: str) -> None:
    """Two sessions of one model, two threads each (prefill bursts, decode steps, truncates), plus a
    drafter-like full-cache session of the same model: each session's final logits equal its twin's."""
    model = _model(path)
    prompts = [np.random.default_rng(10 + i).integers(0, 1000, 200).astype(np.int32) for i in range(3)]
    sessions = [_session(model), _session(model), _session(model, pool_tokens=0, track_summaries=False)]
    finals = {}

    def drive(i):
        s, prompt = sessions[i], prompts[i]
        for rep in range(3):
            s.truncate(0) if rep else None
            s.forward(prompt[:150], 0)
            for p in range(150, 200):
                logits = s.forward(prompt[p:p + 1], p)
        finals[i] = logits

    _run_threads([lambda i=i: drive(i) for i in range(3)] +
                 [lambda: [sessions[0].pager.slot_positions() for _ in range(200)],
                  lambda: [sessions[1].kv.read_block(0) for _ in range(200)]])
    for i, prompt in enumerate(prompts):
        twin = _session(model, **({"pool_tokens": 0, "track_summaries": False} if i == 2 else {}))
        twin.forward(prompt[:150], 0)
        for p in range(150, 200):
            want = twin.forward(prompt[p:p + 1], p)
        np.testing.assert_array_equal(finals[i], want, err_msg=f"session {i}")
    print("two sessions: ok")


def adopt_both_ways(path: str) -> None:
    """A.adopt(B) and B.adopt(A) at once: both sessions are locked together, so neither thread can
    hold one and wait for the other."""
    model = _model(path)
    prompt = np.random.default_rng(3).integers(0, 1000, 64).astype(np.int32)
    a, b = _session(model, pool_tokens=0), _session(model, pool_tokens=0)
    a.forward(prompt, 0)
    b.forward(prompt, 0)

    def swap(dst, src):
        for _ in range(200):
            dst.truncate(0)
            try:
                dst.adopt(src, 64)
            except ValueError as e:   # the other thread had just truncated src
                assert "adopt" in str(e), e
            dst.truncate(0)
            dst.forward(prompt, 0)

    _run_threads([lambda: swap(a, b), lambda: swap(b, a)])
    np.testing.assert_array_equal(a.tokens, prompt)
    np.testing.assert_array_equal(b.tokens, prompt)
    print("adopt both ways: ok")


def pin_while_computing(path: str) -> None:
    """Threads append tokens while another pins and unpins chunks (paging them in) through Session.pin:
    the pins hold between the pinner's own calls, and the ledger stays consistent."""
    model = _model(path)
    s = _session(model)
    C = CONFIG["chunk_tokens"]
    done = threading.Event()

    def writer(seed):
        rng = np.random.default_rng(seed)
        for _ in range(STEPS):
            tok = np.array([rng.integers(0, 1000)], np.int32)
            _append(s, tok)

    errors, n_pins = [], [0]

    def pinner():
        rng = np.random.default_rng(7)
        try:
            while not done.is_set():
                n_written = s.n_tokens // C   # chunks written whole: resident once pinned
                if n_written == 0:
                    continue
                c = int(rng.integers(0, n_written))
                s.pin(c * C, (c + 1) * C)
                assert s.pager.is_pinned(c) and s.pager.is_resident(c)
                s.unpin_all()
                assert not s.pager.is_pinned(c)
                n_pins[0] += 1
        except BaseException as e:   # fails the scenario below, not just this thread
            errors.append(e)

    pin = threading.Thread(target=pinner)
    pin.start()
    try:
        _run_threads([lambda i=i: writer(i) for i in range(2)])
    finally:
        done.set()
        pin.join()
    assert not errors, errors
    assert n_pins[0] > 0
    s.pager.check_invariants()
    assert len(s.tokens) == s.n_tokens == 2 * STEPS
    print("pin while computing: ok")


def _in_child(tiny_gguf, scenario: str, timeout: int = 240) -> str:
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_session_threads as t; " \
           f"t.{scenario}({tiny_gguf()!r})"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{scenario} died with exit code {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}"
    return p.stdout


@pytest.mark.parametrize("scenario", ["one_session_many_threads", "two_sessions_one_model", "adopt_both_ways",
                                      "pin_while_computing"])
def test_threads_are_serialised(tiny_gguf, scenario):
    assert "ok" in _in_child(tiny_gguf, scenario)


def test_session_pager_and_kv_are_read_only(tiny_gguf):
    """Session.pager / Session.kv are the session's own ledger and pool, read-only: the ledger moves with
    the session's tokens and K/V, so plans are made and carried out only by the session's own calls
    (forward, truncate, reselect, pin, unpin_all, reset). The mutable pager and pool are test-only."""
    c = _core()
    s = _session(_model(tiny_gguf()))
    s.forward(np.arange(40, dtype=np.int32), 0)
    for name in ("apply", "plan_alloc", "plan_truncate", "plan_reselect", "plan_pin", "unpin_all", "reset",
                 "set_block_order"):
        with pytest.raises(AttributeError):
            getattr(s.pager, name)
    for name in ("execute", "write_block"):
        with pytest.raises(AttributeError):
            getattr(s.kv, name)
    s.pin(0, 16)   # pins do not move the head
    assert s.pager.is_pinned(0) and s.n_tokens == 40 and len(s.tokens) == 40
    s.unpin_all()
    assert not s.pager.is_pinned(0)
    s.pager.check_invariants()
    assert isinstance(s.pager, c.SessionPager) and isinstance(s.kv, c.SessionKV)
    assert isinstance(c.testing.KvPager(s.pager.config()), c.testing.KvPager)
