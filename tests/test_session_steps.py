"""Session.step_tokens: the session's split of a forward into steps, defined once in C++; Session.shared_prefix.

A step takes at most n_batch tokens and what the pool can place; a session that captures queries
(track_summaries) or attention (capture_attention) keeps at least CAPTURE_TOKENS tokens for its last step,
since the capture covers the last step only. Session.forward takes exactly these steps.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvflash_ggml import _core

N_BATCH = 16


def _session(path, **kw):
    model = _core.Model(path, backend="cpu", n_threads=1)
    return _core.Session(model, _core.SessionConfig(**{"max_tokens": 512, "n_batch": N_BATCH, **kw}))


def _tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, 1000, n).astype(np.int32)


def test_plain_session_steps_are_n_batch(tiny_gguf):
    s = _session(tiny_gguf())
    assert s.step_tokens(N_BATCH + 2) == N_BATCH
    assert s.step_tokens(5) == 5
    with pytest.raises(ValueError, match="n_remaining"):
        s.step_tokens(0)


@pytest.mark.parametrize("capture", [dict(capture_attention=True), dict(track_summaries=True)])
def test_capture_keeps_a_full_last_step(tiny_gguf, capture):
    k = _core.CAPTURE_TOKENS
    n = N_BATCH + 2   # n_batch then 2 would leave the capture only 2 queries
    s = _session(tiny_gguf(), **capture)
    assert s.step_tokens(n) == n - k and s.step_tokens(k) == k
    assert s.step_tokens(k - 1) == k - 1   # fewer than CAPTURE_TOKENS in all: one step
    assert s.step_tokens(N_BATCH + k) == N_BATCH   # the last step is full anyway
    for m in range(1, 3 * N_BATCH):   # the rule over every length: steps to the end, last one long enough
        steps, left = [], m
        while left:
            steps.append(s.step_tokens(left))
            assert 0 < steps[-1] <= min(left, N_BATCH)
            left -= steps[-1]
        assert steps[-1] >= min(m, k), (m, steps)

    computes = s.timings.n_computes
    tokens = _tokens(n)
    logits = s.forward(tokens, 0, all_logits=True)
    assert s.timings.n_computes - computes == 2
    if capture.get("capture_attention"):
        assert s.attention_capture().shape == (k, n)
    else:
        assert s.queries().shape[1] == k

    # forward's own split is the one step_tokens gives: the same steps by hand, bit for bit
    by_hand = _session(tiny_gguf(), **capture)
    a = by_hand.forward(tokens[:n - k], 0, all_logits=True)
    b = by_hand.forward(tokens[n - k:], n - k, all_logits=True)
    np.testing.assert_array_equal(logits, np.concatenate([a, b]))


def test_shared_prefix_compares_with_the_held_tokens(tiny_gguf):
    s = _session(tiny_gguf())
    held = _tokens(40)
    s.forward(held, 0)
    other = held.copy()
    other[25] += 1
    assert s.shared_prefix(held) == 40
    assert s.shared_prefix(np.concatenate([held, _tokens(5, seed=1)])) == 40   # a longer sequence: all held
    assert s.shared_prefix(held[:10]) == 10
    assert s.shared_prefix(other) == 25
    assert s.shared_prefix(other[20:], 20) == 25      # the first 20 vouched for, the rest compared
    assert s.shared_prefix(other[30:], 30) == 40      # only what follows `start` is compared
    assert s.shared_prefix([], 0) == 0 and s.shared_prefix(held[40:], 40) == 40
    assert s.shared_prefix(list(map(int, held))) == 40   # a list of ints, as prompts come
    with pytest.raises(ValueError, match="start must be in"):
        s.shared_prefix(held, 41)
    with pytest.raises(ValueError, match="start must be in"):
        s.shared_prefix(held, -1)
