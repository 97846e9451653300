"""BatchDecoder: several sessions' decode steps as one graph. Each session must end exactly where its own
forward would have left it: the same greedy tokens and logits, the same tokens held, the same pager state.
References are the same sessions stepped alone (which the CPU and CUDA tests compare with libllama)."""
from __future__ import annotations

import numpy as np
import pytest

from kvflash_ggml import _core
from kvflash_ggml.testing import random_gguf as rg


def session(model, pool, attention="auto", **kw):
    return _core.Session(model, _core.SessionConfig(max_tokens=4096, pool_tokens=pool, n_batch=64, attention=attention,
                                                    **kw))


def prompts(n_vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, n_vocab, n).astype(np.int32) for n in lengths]


def twins(model, pools, lengths, attention="auto"):
    """Two identical sets of sessions, each holding its prompt; the first greedy token of each."""
    ps = prompts(model.hparams.n_vocab, lengths)
    alone = [session(model, p, attention) for p in pools]
    batched = [session(model, p, attention) for p in pools]
    first = [s.forward_greedy(p, 0) for s, p in zip(alone, ps)]
    assert [s.forward_greedy(p, 0) for s, p in zip(batched, ps)] == first
    return alone, batched, first


def step_both(alone, batched, decoder, tokens, n_steps):
    """n_steps greedy steps: `alone` one session at a time, `batched` through the decoder; the tokens must agree.
    Returns the last tokens."""
    tok_a = tok_b = tokens
    for _ in range(n_steps):
        tok_a = [s.forward_greedy(np.array([t], np.int32), s.n_tokens) for s, t in zip(alone, tok_a)]
        tok_b = decoder.step_greedy(batched, tok_b)
        assert tok_a == tok_b
    assert [pager_state(s) for s in alone] == [pager_state(s) for s in batched]
    return tok_a


def pager_state(s):
    st = s.pager.stats()
    return s.n_tokens, s.pager.n_resident(), st.page_outs, st.page_ins, s.tokens.tolist()


@pytest.mark.parametrize("attention", ["matmul", "flash"])
def test_batched_steps_equal_steps_alone(tiny_gguf, attention):
    """Pools of different sizes and a full cache, contexts past the pools (paging during the steps)."""
    model = _core.Model(tiny_gguf(), backend="cpu", n_threads=2)
    alone, batched, tok = twins(model, [448, 0, 640, 448], [400, 90, 700, 30], attention)
    decoder = _core.BatchDecoder(model)
    tok = step_both(alone, batched, decoder, tok, 120)
    assert any(s.pager.stats().page_outs > 0 for s in batched)   # the steps paged
    logits_a = np.stack([s.forward(np.array([t], np.int32), s.n_tokens) for s, t in zip(alone, tok)])
    logits_b = decoder.step(batched, tok)
    assert logits_b.shape == logits_a.shape
    # f16 weights: a 4-column matmul sums in another order than a 1-column one (SmolLM2's Q4_1: equal bytes)
    np.testing.assert_allclose(logits_b, logits_a, rtol=0, atol=2e-3)
    assert decoder.compute_bytes > 0


@pytest.mark.slow
def test_smollm2_batched_greedy(smollm2):
    alone, batched, tok = twins(smollm2, [512, 0, 1024], [700, 90, 1500])
    step_both(alone, batched, _core.BatchDecoder(smollm2), tok, 32)


def test_who_cannot_join(tiny_gguf, tmp_path):
    model = _core.Model(tiny_gguf(), backend="cpu", n_threads=2)
    other = _core.Model(tiny_gguf(), backend="cpu", n_threads=2)
    gemma = _core.Model(str(rg.write_preset(tmp_path / "g.gguf", "tiny-gemma3")), backend="cpu", n_threads=2)
    decoder = _core.BatchDecoder(model)
    assert decoder.ineligible(session(model, 448)) is None
    assert "summaries" in decoder.ineligible(session(model, 448, track_summaries=True))
    assert "captures attention" in decoder.ineligible(session(model, 448, capture_attention=True))
    assert "another Model" in decoder.ineligible(session(other, 448))
    assert "sliding-window" in _core.BatchDecoder(gemma).ineligible(
        _core.Session(gemma, _core.SessionConfig(max_tokens=1024, pool_tokens=448)))


def test_bad_steps_change_nothing(tiny_gguf):
    model = _core.Model(tiny_gguf(), backend="cpu", n_threads=2)
    decoder = _core.BatchDecoder(model)
    a, b = session(model, 448), session(model, 448)
    for s in (a, b):
        s.forward(np.arange(1, 70, dtype=np.int32), 0)
    before = [pager_state(s) for s in (a, b)]
    for sessions, tokens, match in [
        ([a, b], [5], "one token per session"),
        ([a, a], [5, 6], "twice"),
        ([a, b], [5, model.hparams.n_vocab], "outside the vocabulary"),
        ([], [], "at least one session"),
        ([a, session(model, 448, "flash")], [5, 6], "attention path"),
        ([a, session(model, 448, track_summaries=True)], [5, 6], "cannot join"),
    ]:
        with pytest.raises(ValueError, match=match):
            decoder.step_greedy(sessions, tokens)
    assert [pager_state(s) for s in (a, b)] == before
    full = _core.Session(model, _core.SessionConfig(max_tokens=70, pool_tokens=0))
    full.forward(np.arange(1, 71, dtype=np.int32), 0)
    with pytest.raises(ValueError, match="max_tokens"):
        decoder.step_greedy([a, full], [5, 6])
    assert [pager_state(s) for s in (a, b)] == before
