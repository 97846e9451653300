"""Residency policies: chunk summaries and scores against NumPy, reselect, user callables, cadence."""
import numpy as np
import pytest

import kvflash_ggml as kvf
from kvflash_ggml import _core
from kvflash_ggml.options import PoolConfig
from kvflash_ggml.testing.prose import prose


@pytest.fixture(scope="module")
def session_8_chunks(smollm2, smollm2_vocab):
    tokens = np.array(smollm2_vocab.tokenize(prose(120, seed=5), add_special=True)[:8 * 64 + 10], np.int32)
    s = _core.Session(smollm2, _core.SessionConfig(max_tokens=1024, pool_tokens=640, track_summaries=True))
    s.forward(tokens, 0)
    return s


def pool_keys(session, chunk):
    """K rows of a resident chunk, from the raw pool bytes: [n_layer, 64, n_head_kv, head_dim] float32."""
    block = int(session.pager.chunk_blocks()[chunk])
    raw = np.frombuffer(session.kv.read_block(block), np.float16)
    per_layer = raw.reshape(30, 2, 64, 192)   # layer, K/V, slot, n_embd (f16 pool of SmolLM2)
    return per_layer[:, 0].astype(np.float32).reshape(30, 64, 3, 64)


def test_summaries_and_scores_match_numpy(session_8_chunks):
    s = session_8_chunks
    n_chunks = s.pager.n_chunks()
    qk, quest = s.chunk_scores("qk"), s.chunk_scores("quest")
    assert qk.shape == (n_chunks,) and np.isnan(qk[-1]) and np.isnan(quest[-1])   # head chunk not sealed
    q = s.queries()                       # [layer, tokens, head, dim]
    assert q.shape[0] == 30 and q.shape[2] == 9 and q.shape[3] == 64
    mean_keys = s.mean_keys()
    quest_layers = {}
    for c in range(n_chunks - 1):
        if not s.pager.is_resident(c):
            continue
        k = pool_keys(s, c)
        mean = k.mean(axis=1)
        mean /= np.linalg.norm(mean, axis=-1, keepdims=True)
        np.testing.assert_allclose(mean_keys[c], mean, atol=1e-5)
        group = np.arange(9) // 3                     # query head -> its KV head
        qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
        cos = np.einsum("lthd,lhd->lth", qn, mean[:, group])
        np.testing.assert_allclose(qk[c], cos.max(axis=2).mean(), rtol=1e-4, atol=1e-5)
        lo, hi = k.min(axis=1)[:, group], k.max(axis=1)[:, group]      # [layer, head, dim]
        bound = np.maximum(q * lo[:, None], q * hi[:, None]).sum(-1)   # [layer, tokens, head]
        quest_layers[c] = bound.max(axis=2).mean(axis=1)                # [layer]
    # quest: per layer z-scored over the chunks with summaries, then the max over layers
    assert len(quest_layers) == n_chunks - 1, "the test needs every sealed chunk resident"
    per_layer = np.stack([quest_layers[c] for c in range(n_chunks - 1)])   # [chunk, layer]
    z = (per_layer - per_layer.mean(0)) / per_layer.std(0)
    np.testing.assert_allclose(quest[:-1], z.max(axis=1), rtol=1e-3, atol=1e-3)


def test_scores_need_summaries(smollm2):
    s = _core.Session(smollm2, _core.SessionConfig(max_tokens=512, pool_tokens=448))
    s.forward(np.arange(100, 200, dtype=np.int32), 0)
    with pytest.raises(RuntimeError, match="track_summaries"):
        s.chunk_scores("qk")


def test_unknown_scorer_raises(session_8_chunks):
    with pytest.raises(ValueError, match="unknown scorer"):
        session_8_chunks.chunk_scores("nope")


def test_callable_policy_pulls_its_favourite_chunk_back(smollm2, smollm2_path):
    tok = kvf.Tokenizer(smollm2_path)
    favourite = 2
    calls = []

    def prefer_chunk_2(view):
        calls.append(view.n_chunks)
        scores = np.zeros(view.n_chunks, np.float32)
        scores[favourite] = 1.0
        return scores

    eng = kvf.Engine(smollm2, tok, PoolConfig(n_ctx=2048, pool_tokens=448), kvf.ResidencyConfig(policy=prefer_chunk_2))
    eng.prefill(tok.encode(prose(200, seed=6))[:1500])
    assert calls, "the policy was never asked"
    assert eng.session.pager.is_resident(favourite)
    assert eng.stats()["reselects"] >= 1 and eng.stats()["page_ins"] >= 1
    eng.session.pager.check_invariants()


@pytest.mark.parametrize("refresh", [64, 0])
def test_prompt_logits_see_the_chunks_the_post_prompt_reselect_paged_in(smollm2, smollm2_path, refresh):
    # Pooled prefill. Reference: after prefill, run the last prompt token again; it attends to the residency
    # the reselect left. With the refresh, prefill's logits already are those (the batched recompute and this
    # one-token step run different CPU kernels: tolerance); without it they were computed before the page-in.
    tok = kvf.Tokenizer(smollm2_path)

    def prefer_chunk_2(view):
        scores = np.zeros(view.n_chunks, np.float32)
        scores[2] = 1.0
        return scores

    eng = kvf.Engine(smollm2, tok, PoolConfig(n_ctx=2048, pool_tokens=448), kvf.ResidencyConfig(policy=prefer_chunk_2,
                     refresh_tokens=refresh, prefill="pooled"))
    prompt = tok.encode(prose(200, seed=6))[:1500]
    logits = eng.prefill(prompt)
    assert eng.stats()["page_ins"] >= 1
    eng.session.truncate(len(prompt) - 1)
    again = eng.session.forward(np.asarray(prompt[-1:], np.int32), len(prompt) - 1)
    diff = float(np.abs(logits - again).max())
    if refresh:
        assert diff < 2e-2 and logits.argmax() == again.argmax()
    else:
        assert diff > 0.1


def test_callable_with_wrong_length_raises(smollm2, smollm2_path):
    tok = kvf.Tokenizer(smollm2_path)
    eng = kvf.Engine(smollm2, tok, PoolConfig(n_ctx=2048, pool_tokens=448),
                     kvf.ResidencyConfig(policy=lambda view: [1.0, 2.0]))
    with pytest.raises(ValueError, match="one per chunk"):
        eng.prefill(tok.encode(prose(200, seed=7))[:1000])


def test_decode_reselects_every_tau_tokens(smollm2, smollm2_path):
    tok = kvf.Tokenizer(smollm2_path)
    # tau is adaptive, max(tau, history / 45): with ~500-550 tokens of history, 16 wins
    eng = kvf.Engine(smollm2, tok, PoolConfig(n_ctx=2048, pool_tokens=448), kvf.ResidencyConfig(policy="qk", tau=16))
    logits = eng.prefill(tok.encode(prose(100, seed=8))[:500])
    after_prefill = eng.stats()["reselects"]
    assert after_prefill == 1
    for _ in range(48):
        logits = eng.decode_one(int(logits.argmax()))
    assert eng.stats()["reselects"] == after_prefill + 3
    assert eng.stats()["time_scoring_ms"] > 0


def test_unknown_policy_and_bad_tau_raise(smollm2, smollm2_path):
    tok = kvf.Tokenizer(smollm2_path)
    with pytest.raises(ValueError, match="available"):
        kvf.Engine(smollm2, tok, PoolConfig(), kvf.ResidencyConfig(policy="psychic"))
    with pytest.raises(ValueError, match="tau"):
        kvf.Engine(smollm2, tok, PoolConfig(), kvf.ResidencyConfig(tau=0))
    with pytest.raises(ValueError, match="refresh_tokens"):
        kvf.Engine(smollm2, tok, PoolConfig(), kvf.ResidencyConfig(refresh_tokens=-1))
