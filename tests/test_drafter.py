"""The drafter policy (issue 4): the C++ attention capture against NumPy attention recomputed from the
pool's K bytes and the captured queries; the policy's chunk scores against a NumPy reading of the spec
(centred window of 13, z-norm, chunk mean); incremental consumption; mapping across vocabularies by
byte offsets; an engine run that pages in; errors. Tiny random-weight GGUFs, one CPU thread."""
from __future__ import annotations

import numpy as np
import pytest

import kvflash_ggml as kvf
from kvflash_ggml import _core
from kvflash_ggml.testing import random_gguf as rg
from kvflash_ggml.companion import Companion
from kvflash_ggml.drafter import DrafterPolicy
from kvflash_ggml.options import PoolConfig
from kvflash_ggml.engine_parts import make_policy
from kvflash_ggml.policy import SessionView

N_THREADS = 1
C = 64
TEXT = ("The quick brown fox jumps over the lazy dog. A pooled key-value cache keeps the relevant chunks of a "
        "long context resident, and pages the others out to host memory. ")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """target (n_vocab 1000), a drafter of the same vocabulary, one whose vocabulary only adds unused
    tokens (1009: same token ids for any text), one with fewer merges (300: other tokens, about twice as
    many), and one trained for 1024 tokens only, of each vocabulary."""
    root = tmp_path_factory.mktemp("drafter")
    specs = {"target": dict(seed=0), "same": dict(seed=1), "v1009": dict(seed=2, n_vocab=1009),
             "v300": dict(seed=3, n_vocab=300), "short": dict(seed=4, n_ctx_train=1024),
             "v300short": dict(seed=5, n_vocab=300, n_ctx_train=1024)}
    return {k: str(rg.write_preset(root / f"{k}.gguf", "tiny-llama", **kw)) for k, kw in specs.items()}


@pytest.fixture(scope="module")
def target(paths):
    return _core.Model(paths["target"], backend="cpu", n_threads=N_THREADS)


@pytest.fixture(scope="module")
def tok(paths):
    return kvf.Tokenizer(paths["target"])


def random_tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 990, n).astype(np.int32)


# -- (a) the capture --------------------------------------------------------------------------------

def pool_keys(session, n: int, n_layer: int, n_head_kv: int, head_dim: int) -> np.ndarray:
    """K rows of positions [0, n) from the raw pool bytes: [n_layer, n, n_head_kv, head_dim] float32."""
    out = np.zeros((n_layer, n, n_head_kv, head_dim), np.float32)
    blocks = session.pager.chunk_blocks()
    for c in range(session.pager.n_chunks()):
        raw = np.frombuffer(session.kv.read_block(int(blocks[c])), np.float16)
        k = raw.reshape(n_layer, 2, C, n_head_kv * head_dim)[:, 0]   # K then V per layer (f16, equal widths)
        lo, hi = c * C, min(c * C + C, n)
        out[:, lo:hi] = k[:, :hi - lo].astype(np.float32).reshape(n_layer, hi - lo, n_head_kv, head_dim)
    return out


@pytest.mark.parametrize("n_tokens", [300, 5])
def test_capture_equals_numpy_attention(target, n_tokens):
    hp = target.hparams
    s = _core.Session(target, _core.SessionConfig(max_tokens=512, capture_attention=True, track_summaries=True))
    s.forward(random_tokens(n_tokens), 0)
    capture = s.attention_capture()
    n_q = min(n_tokens, 8)
    assert capture.shape == (n_q, n_tokens) and not s.flash_attn
    q = s.queries()                                              # [layer, n_q, head, dim], post-RoPE
    k = pool_keys(s, n_tokens, hp.n_layer, hp.n_head_kv, hp.head_dim_k)
    group = np.arange(hp.n_head) // (hp.n_head // hp.n_head_kv)  # query head -> its KV head
    logits = np.einsum("lqhd,lphd->lqph", q, k[:, :, group]) / np.sqrt(hp.head_dim_k)
    q_pos = np.arange(n_tokens - n_q, n_tokens)
    causal = np.arange(n_tokens)[None, :] <= q_pos[:, None]      # [n_q, n_tokens]
    logits = np.where(causal[None, :, :, None], logits, -np.inf)
    p = np.exp(logits - logits.max(axis=2, keepdims=True))
    p /= p.sum(axis=2, keepdims=True)
    reference = p.max(axis=(0, 3))                               # max over layers and heads
    # The graph multiplies F16 keys by queries rounded to F16; probabilities here are ~1/n_tokens.
    np.testing.assert_allclose(capture, reference, rtol=2e-3, atol=1e-5)
    np.testing.assert_array_equal(s.attention_to_positions(), capture.max(axis=0))


def test_capture_errors(target):
    plain = _core.Session(target, _core.SessionConfig(max_tokens=512))
    plain.forward(random_tokens(20), 0)
    with pytest.raises(RuntimeError, match="capture_attention"):
        plain.attention_capture()
    s = _core.Session(target, _core.SessionConfig(max_tokens=512, capture_attention=True))
    with pytest.raises(RuntimeError, match="forward first"):
        s.attention_capture()
    s.forward(random_tokens(20), 0)
    s.truncate(10)   # the capture described 20 tokens
    with pytest.raises(RuntimeError, match="forward first"):
        s.attention_capture()
    with pytest.raises(ValueError, match="mul_mat"):
        _core.Session(target, _core.SessionConfig(max_tokens=512, capture_attention=True, attention="flash"))
    with pytest.raises(ValueError, match="mul_mat"):
        _core.Session(target, _core.SessionConfig(max_tokens=512, capture_attention=True, kv_type="q8_0"))


# -- (b) scores per chunk -----------------------------------------------------------------------------

def spec_scores(attention: np.ndarray, chunk_of: np.ndarray, n_chunks: int) -> np.ndarray:
    """The issue's words, one loop each: centred window of 13 (cut at the ends), z-norm, chunk mean."""
    n = len(attention)
    attention = np.asarray(attention, dtype=np.float64)   # the reference in float64: float32 means drift ~1e-5
    smooth = np.array([attention[max(0, i - 6):i + 7].mean() for i in range(n)])
    z = (smooth - smooth.mean()) / smooth.std()
    return np.array([z[chunk_of == c].mean() for c in range(n_chunks)])


def test_scores_follow_the_spec(target, tok, paths):
    eng = kvf.Engine(target, tok, PoolConfig(n_ctx=2048, pool_tokens=448), kvf.ResidencyConfig(policy="drafter", prompt_scores="policy",
                     drafter_model=paths["same"]))
    history = tok.encode(TEXT * 12)[:900]
    eng.prefill(history)
    policy = eng.policy
    assert policy.companion.same_vocab and policy.companion.session.tokens.tolist() == history
    attention = policy.companion.session.attention_capture().max(axis=0)
    view = SessionView(eng.session)
    scores = policy.scores(view)
    assert scores.shape == (view.n_chunks,) == (15,)
    np.testing.assert_allclose(scores, spec_scores(attention, np.arange(900) // C, 15), rtol=1e-4, atol=1e-5)


# -- (c) incremental ----------------------------------------------------------------------------------

def test_drafter_runs_only_new_tokens_and_follows_truncation(target, tok, paths):
    eng = kvf.Engine(target, tok, PoolConfig(n_ctx=2048, pool_tokens=448), kvf.ResidencyConfig(policy="drafter", prompt_scores="policy",
                     drafter_model=paths["same"], tau=64))
    policy = eng.policy
    prompt = tok.encode(TEXT * 12)[:700]
    logits = eng.prefill(prompt)
    assert policy.companion.n_forwarded == 700
    for _ in range(64):   # adaptive tau: max(64, 764 // 45) = 64, one reselect
        logits = eng.decode_one(int(logits.argmax()))
    assert eng.stats()["reselects"] == 2 and policy.companion.n_forwarded == 764
    assert policy.companion.session.tokens.tolist() == eng.session.tokens.tolist()
    eng.reselect()        # nothing new: the capture is reused
    assert policy.companion.n_forwarded == 764
    # A prompt that leaves the history after 300 tokens: the engine truncates, so does the drafter.
    other = prompt[:300] + tok.encode(" Something else entirely, said the fox." * 20)[1:400]
    eng.prefill(other)
    assert 300 <= eng.n_reused < 310 and policy.companion.n_forwarded == 764 + len(other) - eng.n_reused
    assert policy.companion.session.tokens.tolist() == eng.session.tokens.tolist() == other
    # Fewer new tokens than the 8 the capture needs: the last 8 run again.
    before = policy.companion.n_forwarded
    for t in (5, 6, 7):   # fewer than tau: no reselect, so the drafter has not seen them
        eng.decode_one(t)
    policy.scores(SessionView(eng.session))
    assert policy.companion.n_forwarded == before + 8 and policy.companion.session.n_tokens == len(other) + 3


# -- (d) different vocabularies -------------------------------------------------------------------------

def test_vocab_with_extra_unused_tokens_maps_one_to_one(target, tok, paths):
    """n_vocab 1009 vs 1000: the tables differ, so the text path runs, and must give what the position
    path would: the same tokens (BOS included, written out and parsed back) and the same scores."""
    policy = DrafterPolicy(Companion(paths["v1009"], tok, n_ctx=2048, backend="cpu", n_threads=N_THREADS))
    assert not policy.companion.same_vocab
    history = tok.encode(TEXT * 10)[:700]
    session = _core.Session(target, _core.SessionConfig(max_tokens=2048))
    session.forward(np.asarray(history, np.int32), 0)
    scores = policy.scores(SessionView(session))
    assert policy.companion.session.tokens.tolist() == history
    attention = policy.companion.session.attention_to_positions()
    np.testing.assert_allclose(scores, spec_scores(attention, np.arange(700) // C, 11), rtol=1e-4, atol=1e-5)


def byte_starts(vocab_tok, tokens) -> np.ndarray:
    """Where each token's text starts, one piece at a time (not through Tokenizer.pieces)."""
    lengths = [len(vocab_tok.token_text(t).encode()) if t == vocab_tok.bos else len(vocab_tok.piece(t))
               for t in tokens]
    return np.concatenate([[0], np.cumsum(lengths)])[:-1]


class SpikeAt(DrafterPolicy):
    """The drafter's attention replaced by one spike at the drafter token holding byte `at`."""

    at = 0

    def attention(self, tokens):
        real = super().attention(tokens)
        starts = byte_starts(self.companion.tokenizer, tokens)
        spike = np.zeros_like(real)
        spike[np.searchsorted(starts, self.at, side="right") - 1] = 1.0
        return spike


def test_other_vocab_maps_scores_to_chunks_by_byte_offsets(target, tok, paths):
    needle = " Zanzibar"
    text = TEXT * 6 + needle + TEXT * 12
    history = tok.encode(text)[:1000]
    at = len((TEXT * 6).encode()) + 1                 # the needle's first letter
    t_starts = byte_starts(tok, history)
    needle_chunk = int(np.searchsorted(t_starts, at, side="right") - 1) // C
    policy = SpikeAt(Companion(paths["v300"], tok, n_ctx=2048, backend="cpu", n_threads=N_THREADS))
    policy.at = at
    session = _core.Session(target, _core.SessionConfig(max_tokens=2048))
    session.forward(np.asarray(history, np.int32), 0)
    view = SessionView(session)
    scores = policy.scores(view)
    d_tokens = policy.companion.session.tokens.tolist()
    assert not policy.companion.same_vocab and len(d_tokens) != len(history)    # other tokens for the same text
    assert policy.companion.tokenizer.decode(d_tokens) == tok.decode(history)
    assert int(np.argmax(scores)) == needle_chunk and scores.shape == (view.n_chunks,)
    # Every chunk against the spec with the assignment done one drafter token at a time.
    d_starts = byte_starts(policy.companion.tokenizer, d_tokens)
    chunk_of = np.array([(np.searchsorted(t_starts, b, side="right") - 1) // C for b in d_starts])
    spike = np.zeros(len(d_tokens))
    spike[np.searchsorted(d_starts, at, side="right") - 1] = 1.0
    np.testing.assert_allclose(scores, spec_scores(spike, np.minimum(chunk_of, view.n_chunks - 1), view.n_chunks),
                               rtol=1e-4, atol=1e-5)


# -- (e) end to end -------------------------------------------------------------------------------------

def test_engine_reselects_the_drafters_top_chunks(paths):
    with kvf.Model(paths["target"], n_ctx=2048, pool_tokens=448, policy="drafter", drafter_model=paths["same"],
                   tau=16, backend="cpu", n_threads=N_THREADS) as llm:
        eng = llm.engine
        out = llm.create_completion(TEXT * 12, max_tokens=40, temperature=0.0)
        stats = out["usage"]["kvflash"]
        assert stats["policy"] == "drafter" and stats["reselects"] >= 2 and stats["page_ins"] >= 1
        pager = eng.session.pager
        pager.check_invariants()
        eng.reselect()
        scores = eng.policy.scores(SessionView(eng.session))
        free = ~pager.protected_chunks()
        resident = np.array([pager.is_resident(c) for c in range(pager.n_chunks())])
        n_free = int((resident & free).sum())
        top = np.argsort(-np.where(free, scores, -np.inf), kind="stable")[:n_free]
        assert sorted(top.tolist()) == np.flatnonzero(resident & free).tolist()


def test_model_shares_weights_with_itself_as_drafter(paths):
    with kvf.Model(paths["target"], n_ctx=1024, pool_tokens=448, policy="drafter", drafter_model=paths["target"],
                   backend="cpu", n_threads=N_THREADS) as llm:
        companion = llm.engine.companion
        assert llm.engine.policy.companion is companion   # the engine's, lent to the policy
        assert companion.model is llm._core_model and companion.same_vocab


# -- (f) errors -------------------------------------------------------------------------------------------

def test_bad_input_raises(target, tok, paths):
    with pytest.raises(ValueError, match="drafter_model"):
        make_policy("drafter")
    with pytest.raises(ValueError, match="drafter_model"):
        kvf.Engine(target, tok, PoolConfig(n_ctx=1024, pool_tokens=448), kvf.ResidencyConfig(policy="drafter", prompt_scores="policy"))
    with pytest.raises(ValueError, match="too small"):   # trained for 1024 tokens, asked for 2048
        kvf.Engine(target, tok, PoolConfig(n_ctx=2048, pool_tokens=448), kvf.ResidencyConfig(policy="drafter", prompt_scores="policy",
                   drafter_model=paths["short"]))
    with pytest.raises(FileNotFoundError):
        Companion("/nonexistent.gguf", tok, n_ctx=1024)


def test_command_lines(paths, capsys):
    from kvflash_ggml.commands import generate
    from kvflash_ggml.bench.retrieval import cli
    rc = generate.main(["--model", paths["target"], "--n-ctx", "2048", "--kvflash", "448", "--policy", "drafter",
                        "--drafter-model", paths["same"], "--threads", "1", "--backend", "cpu", "--max-tokens", "4",
                        "--prompt", TEXT * 8, "--stats", "--json"])
    assert rc == 0 and '"policy": "drafter"' in capsys.readouterr().err
    rc = generate.main(["--model", paths["target"], "--kvflash", "448", "--policy", "drafter", "--prompt", "x"])
    assert rc == 2 and "drafter_model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main("niah", ["--model", paths["target"], "--policies", "lru,drafter"])
    assert "--drafter-model" in capsys.readouterr().err


# -- another vocabulary: the drafter's context follows its own token count (issue 18) ---------------------

def test_other_vocab_context_grows_with_the_retokenised_history(target, tok, paths):
    policy = DrafterPolicy(Companion(paths["v300"], tok, n_ctx=128, backend="cpu", n_threads=N_THREADS))
    history = tok.encode(TEXT * 3)[:120]
    n_drafter = len(policy.companion.retokenise(np.asarray(history, np.int32))[0])
    assert n_drafter > 128                                  # more than the model's n_ctx once retokenised
    session = _core.Session(target, _core.SessionConfig(max_tokens=256))
    session.forward(np.asarray(history, np.int32), 0)
    scores = policy.scores(SessionView(session))
    assert scores.shape == (2,) and np.isfinite(scores).all()
    assert n_drafter <= policy.companion.n_ctx <= 64 * -(-int(n_drafter * 1.25) // 64)


def test_other_vocab_prompt_longer_for_the_drafter(paths):
    # A prompt within the model's n_ctx that the drafter's vocabulary splits into about twice as many
    # tokens: it runs (the drafter's context grows), and once it is more than the drafter was trained
    # for, the call is refused before the model computes anything or the session changes.
    text = TEXT * 14
    with kvf.Model(paths["target"], n_ctx=1024, pool_tokens=448, policy="drafter", drafter_model=paths["v300"],
                   backend="cpu", n_threads=N_THREADS) as llm:
        prompt = llm.tokenize(text)[:1000]
        assert len(llm.engine.companion.retokenise(np.asarray(prompt, np.int32))[0]) > 1024
        out = llm.create_completion(prompt, max_tokens=4, temperature=0.0)
        assert out["usage"]["kvflash"]["reselects"] >= 1 and llm.engine.companion.n_ctx > 1024
    with kvf.Model(paths["target"], n_ctx=1024, pool_tokens=448, policy="drafter",
                   drafter_model=paths["v300short"], backend="cpu", n_threads=N_THREADS) as llm:
        eng = llm.engine
        first = llm.tokenize(TEXT)
        llm.create_completion(first, max_tokens=2, temperature=0.0)
        held, computes = eng.session.tokens.tolist(), eng.session.timings.n_computes
        with pytest.raises(ValueError, match=r"tokens for the drafter .* more than it was trained for \(1024\)"):
            llm.create_completion(prompt, max_tokens=4, temperature=0.0)
        assert eng.session.tokens.tolist() == held
        assert eng.session.timings.n_computes == computes


def test_generation_outgrowing_the_drafter_goes_on_unscored(target, tok, paths, caplog):
    policy = DrafterPolicy(Companion(paths["v300short"], tok, n_ctx=1024, backend="cpu", n_threads=N_THREADS))
    history = tok.encode(TEXT * 14)[:1000]
    session = _core.Session(target, _core.SessionConfig(max_tokens=1024))
    session.forward(np.asarray(history, np.int32), 0)
    with caplog.at_level("WARNING", logger="kvflash_ggml.drafter"):
        assert policy.scores(SessionView(session)) is None
        assert policy.scores(SessionView(session)) is None
    warnings = [r for r in caplog.records if "more than it was trained for" in r.getMessage()]
    assert len(warnings) == 1
