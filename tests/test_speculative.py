"""Speculative decoding verified on the pool (speculative.py): greedy speculation returns plain greedy decoding's
tokens, sampled speculation follows the model's sampling distribution, and the drafters (prompt lookup, a draft
model) and their errors.

Greedy equality is exact where a batched step runs the same kernels as single-token steps: on the CPU with
flash attention on one thread (SmolLM2), and with quantized weights on the mul_mat path (the tiny models). With
more threads ggml's CPU flash attention splits a single query's keys across threads, and float matmuls take
another kernel for several columns, so rows differ in the last bits and a near-tie can flip (measured on SmolLM2:
|logit diff| up to 1.1 between a row of a 2-token step and the same token alone): the same property llama.cpp's
speculative decoding has.
"""
from __future__ import annotations

import numpy as np
import pytest
from kvflash_ggml import Model, _core
from kvflash_ggml.options import SamplingParams, SpeculativeConfig
from kvflash_ggml.sampling import Sampler
from kvflash_ggml.speculative import PromptLookup, accept
from kvflash_ggml.tokens import HeldHistory
from kvflash_ggml.testing import random_gguf as rg
from kvflash_ggml.bench.spec import copy_prompt

C = _core.CHUNK_TOKENS


def chi_square_ok(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Pearson's test at p = 0.001 (Wilson-Hilferty quantile), over the cells with an expected count >= 5."""
    n = counts.sum()
    keep = probs * n >= 5
    observed = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(probs[keep] * n, probs[~keep].sum() * n)
    if expected[-1] < 5:
        observed, expected = observed[:-1], expected[:-1]
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = len(observed) - 1
    z = 3.09
    return stat <= df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


# ---- the acceptance rule --------------------------------------------------------------------------------

@pytest.mark.parametrize("drafter_q", [None, "spread"])
def test_accept_rule_keeps_the_target_distribution(drafter_q):
    # One draft over a vocabulary of 8: the token the step emits first (the draft if kept, else the residual's
    # draw) must be distributed as the model's p, whatever q proposed (one-hot, or a distribution of its own).
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, 8)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1))
    p = sampler.distribution(logits)
    q = None if drafter_q is None else np.array([0.3, 0.05, 0.05, 0.2, 0.1, 0.1, 0.1, 0.1])
    rows = np.stack([logits, logits])   # row 1 (after the draft) only matters when the draft is kept
    counts = np.zeros(8)
    for _ in range(20000):
        d = 3 if q is None else int(rng.choice(8, p=q))
        kept, own = accept([d], rows, None if q is None else [q], sampler)
        counts[kept[0] if kept else own] += 1
    assert chi_square_ok(counts, p)


def test_greedy_accept_keeps_the_agreeing_prefix():
    rows = np.zeros((4, 5))
    rows[0, 2] = rows[1, 4] = rows[2, 1] = rows[3, 0] = 1.0
    greedy = Sampler(SamplingParams(temperature=0.0))
    assert accept([2, 4, 3], rows, None, greedy) == ([2, 4], 1)   # draft 3 loses to the model's 1
    assert accept([2, 4, 1], rows, None, greedy) == ([2, 4, 1], 0)  # all kept: the model's own after them


def test_prompt_lookup_proposes_the_continuation_of_the_longest_match():
    lookup = PromptLookup(ngram=3)
    greedy = Sampler(SamplingParams(temperature=0.0))
    h = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    assert lookup.propose(h, 4, greedy) == ([4, 5, 9, 2], None)   # [1, 2, 3] last seen at 0
    assert lookup.propose(h + [7], 3, greedy) == ([8, 1, 2], None)   # [2, 3, 7] seen at 6
    assert lookup.propose([5, 6], 3, greedy) == ([], None)           # a new history: indexed afresh, no match


def test_prompt_lookup_follows_a_history_that_goes_back():
    # One index through extensions, rewinds to a shared prefix and new prompts (each followed first, as a
    # generation does) proposes what a lookup that indexed each history afresh proposes.
    rng = np.random.default_rng(0)
    greedy = Sampler(SamplingParams(temperature=0.0))
    lookup, h = PromptLookup(ngram=3), rng.integers(0, 6, 40).tolist()
    lookup.follow(h)
    for step in range(300):
        r = rng.random()
        if r < 0.6:
            h = h + rng.integers(0, 6, int(rng.integers(1, 4))).tolist()   # tokens picked
        elif r < 0.9:
            h = h[:int(rng.integers(1, len(h) + 1))] + rng.integers(0, 6, int(rng.integers(0, 3))).tolist()   # back
            lookup.follow(h)
        else:
            h = rng.integers(0, 6, int(rng.integers(2, 30))).tolist()   # another prompt
            lookup.follow(h)
        k = int(rng.integers(1, 6))
        assert lookup.propose(h, k, greedy) == PromptLookup(ngram=3).propose(h, k, greedy), step


def test_held_history_reads_the_session_then_the_pending_token(tiny):
    # A generation's history is the session's tokens and the one picked next: a view that copies only what is read.
    s = _core.Session(_core.Model(tiny("llama"), backend="cpu", n_threads=1), _core.SessionConfig(max_tokens=512))
    tokens = np.random.default_rng(1).integers(0, 500, 100).astype(np.int32)
    s.forward(tokens, 0)
    h, want = HeldHistory(s, 7), [*tokens.tolist(), 7]
    assert len(h) == 101 and list(h) == want and h[-1] == 7 and h[0] == want[0] and h[99] == want[99]
    for sl in (slice(None), slice(3, 40), slice(90, None), slice(-3, None), slice(100, None), slice(50, 50),
               slice(60, 10), slice(-200, 5)):
        assert h[sl] == want[sl], sl
    np.testing.assert_array_equal(np.asarray(h, dtype=np.int64), want)
    with pytest.raises(IndexError):
        h[101]
    with pytest.raises(IndexError, match="token_range"):
        s.token_range(50, 101)


def test_a_drafter_follows_the_prompt_and_every_token_picked(tiny):
    # What the speculator is given before each verify step: the prompt, then every token the generation gave.
    seen = []
    motif = np.random.default_rng(3).integers(0, 1000, 37).tolist()
    prompt = (motif * 12)[:400]
    with Model(tiny("llama"), n_ctx=1024, pool_tokens=448, backend="cpu", n_threads=1, attention="matmul",
               speculative="prompt_lookup") as spec:
        propose = spec.engine.speculator.propose

        def spy(history, *args, **kw):
            seen.append(list(history))
            return propose(history, *args, **kw)
        spec.engine.speculator.propose = spy
        got = [r.token for r in spec.engine.generate(prompt, max_tokens=40, temperature=0.0) if r.token is not None]
    assert len(seen) > 1
    for history in seen:
        n = len(history) - len(prompt)
        assert history == prompt + got[:n] and 1 <= n <= len(got)


@pytest.mark.parametrize("target,own", [("smollm2", "gemma3-270m"), ("gemma3-270m", "smollm2")])
def test_text_mapping_grows_as_a_whole_mapping_would(target, own):
    # The draft of another vocabulary maps the history incrementally (only the text near the old end is
    # tokenized again); token by token it must hold what mapping the whole history gives.
    from kvflash_ggml.companion import retokenise
    from kvflash_ggml.known_models import resolve_model_path
    from kvflash_ggml.speculative import TextMappedDraft
    from kvflash_ggml.tokenizer import Tokenizer
    t, o = Tokenizer(resolve_model_path(target)), Tokenizer(resolve_model_path(own))
    history = copy_prompt(t, 600)
    history += t.encode(" Then: naïve café, 3.14159 — «quoted» text\n\n  indented\tcode();", add_special=False)
    mapped = TextMappedDraft(None, o, t)
    whole = lambda h: retokenise(np.asarray(h, np.int32), t, o)[0].tolist()
    for n in list(range(1, 40)) + list(range(560, len(history) + 1)):   # a generation's steps: only extensions
        assert mapped._map(history[:n], compare=False) == whole(history[:n]), n
    assert mapped._map(history[:100], compare=True) == whole(history[:100])   # went back
    other = history[1:100] + history[99:100]   # another prompt that ends in the same token: compared whole
    assert mapped._map(other, compare=True) == whole(other)


# ---- greedy equality ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("pool", [None, 512])
@pytest.mark.parametrize("draft", ["prompt_lookup", "smollm2"])
def test_greedy_speculation_equals_plain_on_smollm2(smollm2_path, pool, draft):
    kw = dict(n_ctx=4096, pool_tokens=pool, backend="cpu", n_threads=1, attention="flash")
    with Model(smollm2_path, **kw) as plain, Model(smollm2_path, **kw, speculative=draft) as spec:
        prompt = copy_prompt(plain.tokenizer, 1000)   # twice the pool: a document, then the request to copy it
        want = [r.token for r in plain.engine.generate(prompt, max_tokens=160, temperature=0.0) if r.token is not None]
        gen = spec.engine.generate(prompt, max_tokens=160, temperature=0.0)
        got = [next(gen).token]   # the prompt and the first token: what follows is speculative decoding
        before = spec.engine.stats()
        got += [r.token for r in gen if r.token is not None]
        st = spec.stats()
    assert got == want and len(want) == 160
    assert st["spec_steps"] > before.get("spec_steps", 0) and st["spec_accepted"] > 0
    if draft == "smollm2":
        # The model as its own draft: with a full cache every draft is what the model picks. In a pool the draft
        # session computed the prompt in its pool (not layer-major) and pages on its own schedule, so it sees
        # another context now and then (measured 0.993).
        assert (st["spec_acceptance"] == 1.0 if pool is None else st["spec_acceptance"] > 0.95), st["spec_acceptance"]
    if pool:   # the pool paged while the drafts were verified
        assert st["page_outs"] > before["page_outs"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return lambda arch: str(rg.write_preset(root / f"{arch}.gguf", f"tiny-{arch}", weight_type="q8_0"))


def _by_length(view):
    """A policy that reselects: random scores seeded by the tokens held, so a reselect after another token than
    plain decoding's would keep other chunks."""
    return np.random.default_rng(len(view.tokens)).random(view.n_chunks)


@pytest.mark.parametrize("arch,policy", [(a, "lru") for a in ["llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "qwen35",
                                                                "qwen35moe", "laguna", "gemma4"]] +
                         [("llama", _by_length)])
def test_greedy_speculation_equals_plain_on_tiny_models(tiny, arch, policy):
    # q8_0 weights on the mul_mat path: a row of a verify step is bit-identical to the same token alone. The
    # hybrids go back to the state stashed before each verify step and run the kept tokens again. A policy that
    # reselects (every 16 tokens) ends a verify step where a reselect falls due, so it runs after the same
    # token as in plain decoding; lru never reselects, and its steps do not stop there.
    kw = dict(n_ctx=2048, pool_tokens=448, backend="cpu", n_threads=1, attention="matmul", policy=policy, tau=16)
    rng = np.random.default_rng(2)
    motif = rng.integers(0, 1000, 37).tolist()
    prompt = (motif * 30)[:1000]   # repeats: prompt lookup has something to find
    with Model(tiny(arch), **kw) as plain, Model(tiny(arch), **kw, speculative="prompt_lookup") as spec:
        want = [r.token for r in plain.engine.generate(prompt, max_tokens=96, temperature=0.0) if r.token is not None]
        got = [r.token for r in spec.engine.generate(prompt, max_tokens=96, temperature=0.0) if r.token is not None]
        st = spec.stats()
    assert got == want
    assert st["spec_steps"] > 0 and st["spec_drafted"] > 0
    if policy is _by_length:
        assert st["reselects"] > 0


class _CountingSession:
    """A session that counts its layer-major prefills and passes everything else through."""

    def __init__(self, session) -> None:
        self._session, self.exact = session, 0

    def prefill_exact(self, *args, **kw):
        self.exact += 1
        return self._session.prefill_exact(*args, **kw)

    def __getattr__(self, name):
        return getattr(self._session, name)


def test_a_draft_model_runs_layer_major_for_the_prompt_only(tiny):
    # Each layer-major prefill copies every held position's K/V through the staging layer: once per prompt is
    # the design, once per verify step made speculation slower the longer the context (0.04x plain at 128K).
    path = tiny("llama")
    kw = dict(n_ctx=2048, pool_tokens=448, backend="cpu", n_threads=1, attention="matmul")
    with Model(path, **kw, speculative=path) as spec:
        draft = spec.engine.speculator.draft_model
        draft.session = counting = _CountingSession(draft.session)
        prompt = np.random.default_rng(4).integers(0, 1000, 1000).tolist()
        out = [r.token for r in spec.engine.generate(prompt, max_tokens=48, temperature=0.0) if r.token is not None]
        st = spec.stats()
    assert len(out) == 48 and st["spec_steps"] > 3 and st["spec_acceptance"] > 0.5
    assert counting.exact == 1


@pytest.mark.slow
@pytest.mark.parametrize("target,draft", [("smollm2", "gemma3-270m"), ("gemma3-270m", "smollm2")])
def test_greedy_speculation_with_a_draft_of_another_vocabulary(target, draft):
    # The draft follows the history's text in its own tokens and proposes the model's tokens for the text of its
    # continuation. Whatever it proposes, the tokens must be plain greedy decoding's; the pool pages meanwhile.
    kw = dict(n_ctx=4096, pool_tokens=512, backend="cpu", n_threads=1, attention="flash")
    with Model(target, **kw) as plain, Model(target, **kw, speculative=draft, draft_max=6) as spec:
        prompt = copy_prompt(plain.tokenizer, 700)
        want = [r.token for r in plain.engine.generate(prompt, max_tokens=48, temperature=0.0) if r.token is not None]
        got = [r.token for r in spec.engine.generate(prompt, max_tokens=48, temperature=0.0) if r.token is not None]
        st = spec.stats()
    assert got == want and len(want) == 48
    assert st["spec_vocab"] == "mapped through text" and st["spec_drafted"] > 0 and st["spec_accepted"] > 0
    assert st["device_drafter_bytes"] > 0   # the draft model's weights and session are counted


def test_an_echo_model_drafting_itself_keeps_every_draft(tmp_path):
    # random_gguf's echo model predicts the token it was given by a margin no kernel order can flip, so with
    # itself as the draft every draft is kept even on two threads with flash attention (the H100 bench's upper
    # bound of the machinery, measured without trained weights).
    path = str(rg.write_preset(tmp_path / "echo.gguf", "tiny-llama", weight_type="q8_0", echo=True))
    prompt = np.random.default_rng(1).integers(0, 1000, 900).tolist()
    kw = dict(n_ctx=2048, pool_tokens=448, backend="cpu", n_threads=2, attention="flash")
    with Model(path, **kw, speculative=path, draft_max=8) as m:
        got = [r.token for r in m.engine.generate(prompt, max_tokens=48, temperature=0.0) if r.token is not None]
        st = m.stats()
    assert got == [prompt[-1]] * 48
    assert st["spec_drafted"] > 20 and st["spec_acceptance"] == 1.0


def test_logprobs_with_speculation_are_plain_decodings(tiny):
    # Each token of a verify step reports its logprobs from its own row: the values plain decoding reports.
    kw = dict(n_ctx=2048, pool_tokens=448, backend="cpu", n_threads=1, attention="matmul")
    motif = np.random.default_rng(3).integers(0, 1000, 37).tolist()
    prompt = (motif * 20)[:700]
    with Model(tiny("llama"), **kw) as plain, Model(tiny("llama"), **kw, speculative="prompt_lookup") as spec:
        want = [r for r in plain.engine.generate(prompt, max_tokens=48, temperature=0.0, logprobs=3) if r.token is not None]
        got = [r for r in spec.engine.generate(prompt, max_tokens=48, temperature=0.0, logprobs=3) if r.token is not None]
        st = spec.stats()
    assert [r.token for r in got] == [r.token for r in want]
    assert all(r.logprobs is not None for r in got) and [r.logprobs for r in got] == [r.logprobs for r in want]
    assert st["spec_accepted"] > 0   # several tokens came from one verify step


# ---- sampling ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("draft_kind", ["other-weights", "itself"])
def test_sampled_speculation_follows_the_model_distribution(tiny, tmp_path, draft_kind):
    # The second token of many seeded runs, against the model's own distribution after the prompt and the
    # first token. The draft's q differs from the model's p, so both branches of the rule run: a draft kept with
    # probability min(1, p/q), else a token drawn from max(p - q, 0). Another random model is rarely right
    # (mostly the residual); the model itself always is (p / q = 1: every draft kept).
    path = tiny("llama")
    draft = str(rg.write_preset(tmp_path / "draft.gguf", "tiny-llama", weight_type="q8_0", seed=5)
                if draft_kind == "other-weights" else path)
    params = dict(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0)
    prompt = ([5, 17, 42, 99, 7] * 20)
    with Model(path, n_ctx=512, backend="cpu", n_threads=1, speculative=draft) as spec:
        pairs = []
        for seed in range(1500):
            toks = [r.token for r in spec.engine.generate(prompt, max_tokens=3, seed=seed, **params) if r.token is not None]
            pairs.append(tuple(toks[:2]))
        st = spec.stats()
    assert st["spec_drafted"] >= 1500   # every run drafted its second token
    assert 0 < st["spec_acceptance"] < 0.2 if draft_kind == "other-weights" else st["spec_acceptance"] == 1.0
    pairs = [p for p in pairs if len(p) == 2]   # (an end-of-generation token ends a run early)
    firsts = [a for a, _ in pairs]
    first = max(set(firsts), key=firsts.count)   # condition on the commonest first token
    seconds = np.array([b for a, b in pairs if a == first])
    assert len(seconds) > 200
    model = _core.Model(path, backend="cpu", n_threads=1)
    s = _core.Session(model, _core.SessionConfig(max_tokens=512))
    logits = s.forward(np.array(prompt + [first], np.int32), 0)
    p = Sampler(SamplingParams(**params)).distribution(logits)
    counts = np.bincount(seconds, minlength=p.shape[0]).astype(float)
    assert counts[p == 0].sum() == 0
    assert chi_square_ok(counts[p > 0], p[p > 0])


# ---- stats and errors -------------------------------------------------------------------------------------

def test_stats_report_the_drafts(tiny):
    with Model(tiny("llama"), n_ctx=512, backend="cpu", n_threads=1, speculative="prompt_lookup", draft_max=4) as m:
        m.create_completion([5, 17, 42, 99, 7] * 20, max_tokens=20, temperature=0.0)
        st = m.stats()
    assert st["spec_mode"] == "prompt_lookup" and st["spec_drafted"] >= st["spec_accepted"] >= 0
    assert 0.0 <= st["spec_acceptance"] <= 1.0


def test_a_verify_step_out_of_order_is_refused(tiny):
    # A server drives a verify step by halves (verify_rows, the forward, judge_verify, advance_verify(None)); the
    # halves out of order are clear errors that change nothing: the generation then goes on as plain greedy's.
    kw = dict(n_ctx=1024, pool_tokens=448, backend="cpu", n_threads=1, attention="matmul")
    prompt = np.tile(np.arange(40, 70, dtype=np.int32), 8).tolist()
    with Model(tiny("llama"), **kw, speculative="prompt_lookup") as spec, Model(tiny("llama"), **kw) as plain:
        want = [r.token for r in plain.engine.generate(prompt, max_tokens=12, temperature=0.0) if r.token is not None]
        gen = spec.engine.generate(prompt, max_tokens=12, temperature=0.0)
        got = [next(gen).token]
        with pytest.raises(RuntimeError, match="without judge_verify"):
            gen.advance_verify(None)
        with pytest.raises(RuntimeError, match="without verify_rows"):
            gen.judge_verify(np.zeros((1, 8), dtype=np.float32))
        got += [r.token for r in gen if r.token is not None]
    assert got == want


def test_bad_speculative_options_are_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match="max_draft"):
        SpeculativeConfig(max_draft=0)
    with pytest.raises(ValueError, match="nextn"):
        Model(tiny("llama"), n_ctx=512, backend="cpu", n_threads=1, speculative="mtp")
    with pytest.raises(FileNotFoundError):
        Model(tiny("llama"), n_ctx=512, backend="cpu", n_threads=1, speculative=str(tmp_path / "missing.gguf"))


def test_cli_generate_with_a_draft(tiny, capsys):
    from kvflash_ggml.commands.generate import main

    assert main(["--model", tiny("llama"), "--prompt", "one two one two one two one", "--max-tokens", "12",
                 "--draft", "prompt_lookup", "--draft-max", "4", "--threads", "1", "--stats", "--json"]) == 0
    assert '"spec_mode": "prompt_lookup"' in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_a_step_that_keeps_some_drafts_continues_exactly(tiny, arch):
    # A drafter that proposes the right next token, then a wrong one: every verify step keeps one draft and
    # rejects one, so the rejected position is truncated (pool) or the stashed state is restored and the kept
    # token run again (linear attention). The tokens must still be plain greedy decoding's.
    kw = dict(n_ctx=2048, pool_tokens=448, backend="cpu", n_threads=1, attention="matmul")
    prompt = np.random.default_rng(4).integers(0, 1000, 700).tolist()
    with Model(tiny(arch), **kw) as plain, Model(tiny(arch), **kw, speculative="prompt_lookup") as spec:
        want = [r.token for r in plain.engine.generate(prompt, max_tokens=40, temperature=0.0) if r.token is not None]

        class HalfRight:
            def propose(self, history, k, sampler):
                i = len(history) - len(prompt)   # the next token is want[i]
                if i + 1 >= len(want):
                    return [], None
                return ([want[i], (want[i + 1] + 1) % 1000] if k >= 2 else [want[i]]), None

        spec.engine.speculator.drafter = HalfRight()
        got = [r.token for r in spec.engine.generate(prompt, max_tokens=40, temperature=0.0) if r.token is not None]
        st = spec.stats()
    assert got == want
    assert st["spec_accepted"] > 0 and st["spec_accepted"] < st["spec_drafted"]


# ---- a server's slots drafting with one draft model -----------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_model_steps_proposed_together_are_each_slots_own(tiny, temperature):
    """Slots whose draft sessions run one draft model propose in shared draft steps (one BatchDecoder step of the
    draft model a draft step): each catches up with its own history, then drafts what it drafts alone (q8_0 weights
    on the mul_mat path: a row of a batched step is the same token's alone), with the same probabilities when
    sampling; a slot that asks for no drafts does not even catch up."""
    from kvflash_ggml.engine_parts import make_session
    from kvflash_ggml.options import PoolConfig
    from kvflash_ggml.speculative import DraftModel, propose_with_draft_model_together

    model = _core.Model(tiny("llama"), backend="cpu", n_threads=1)
    pool = PoolConfig(n_ctx=2048, pool_tokens=448, attention="matmul")
    rng = np.random.default_rng(3)
    histories = [rng.integers(0, 1000, n).tolist() for n in (300, 130, 200, 90)]
    lengths = [3, 1, 5, 0]
    alone, shared = ([DraftModel(model, make_session(model, pool), pool) for _ in histories] for _ in range(2))
    samplers = [[Sampler(SamplingParams(temperature=temperature, seed=j)) for j in range(4)] for _ in range(2)]
    want = [d.propose(h, k, s) if k else ([], None) for d, h, k, s in zip(alone, histories, lengths, samplers[0])]
    decoder = _core.BatchDecoder(model)
    got = propose_with_draft_model_together(decoder, shared, histories, lengths, samplers[1])
    assert [d for d, _ in got] == [d for d, _ in want] and [len(d) for d, _ in got] == lengths
    for (_, q_got), (_, q_want), k in zip(got, want, lengths):
        if temperature == 0.0 or k == 0:
            assert q_got in (None, []) and q_want in (None, [])
        else:
            np.testing.assert_array_equal(np.stack(q_got), np.stack(q_want))
    assert [d.session.n_tokens for d in shared] == [d.session.n_tokens for d in alone]
    assert shared[3].session.n_tokens == 0   # no drafts asked: nothing run

    # The next round: each history keeps some of its drafts and one token of the model's own, so each draft
    # session catches up a few tokens: all of them in one batched step.
    histories = [h + d[:n] + [7] for h, (d, _), n in zip(histories, want, (3, 0, 1, 0))]
    lengths = [2, 4, 3, 0]
    want = [d.propose(h, k, s) if k else ([], None) for d, h, k, s in zip(alone, histories, lengths, samplers[0])]
    counted = _CountedSteps(decoder)
    got = propose_with_draft_model_together(counted, shared, histories, lengths, samplers[1])
    # the catch-ups: the model's token, after the last draft where all were kept (draft steps ran the others), and
    # after going back past the rejected drafts where one was kept of five
    assert counted.rows[0] == [2, 1, 1]
    assert [d for d, _ in got] == [d for d, _ in want]
    for (_, q_got), (_, q_want), k in zip(got, want, lengths):
        if temperature > 0.0 and k > 0:
            np.testing.assert_array_equal(np.stack(q_got), np.stack(q_want))
    assert [d.session.n_tokens for d in shared] == [d.session.n_tokens for d in alone]
    assert [list(d.session.tokens) for d in shared] == [list(d.session.tokens) for d in alone]


def test_text_mapped_drafts_proposed_together_are_each_slots_own():
    """Slots drafting with a draft model of another vocabulary share its steps too: each maps its history into the
    draft's tokens, catches up (a few tokens in one batched step after the first round), drafts greedily in shared
    steps and maps the drafts back; the proposals and the draft sessions' tokens are each slot's own propose's."""
    from kvflash_ggml.engine_parts import make_session
    from kvflash_ggml.known_models import resolve_model_path
    from kvflash_ggml.options import PoolConfig
    from kvflash_ggml.speculative import DraftModel, TextMappedDraft, propose_with_draft_model_together
    from kvflash_ggml.tokenizer import Tokenizer

    target, own = Tokenizer(resolve_model_path("gemma3-270m")), Tokenizer(resolve_model_path("smollm2"))
    model = _core.Model(resolve_model_path("smollm2"), backend="cpu", n_threads=1)
    pool = PoolConfig(n_ctx=1024, pool_tokens=448, attention="matmul")
    prompt = copy_prompt(target, 600)
    histories = [prompt[:n] for n in (560, 170, 240)]   # the first past the pool: its prompt runs layer-major
    alone, shared = ([TextMappedDraft(DraftModel(model, make_session(model, pool), pool), own, target)
                      for _ in histories] for _ in range(2))
    sampler = Sampler(SamplingParams(temperature=0.7, seed=1))   # the model's: a mapped draft is greedy whatever it is
    decoder = _core.BatchDecoder(model)
    for step, lengths in enumerate([[3, 2, 4], [4, 3, 0]]):
        want = [d.propose(h, k, sampler) if k else ([], None) for d, h, k in zip(alone, histories, lengths)]
        counted = _CountedSteps(decoder)
        got = propose_with_draft_model_together(counted, shared, histories, lengths, [sampler] * 3)
        assert got == want and all(d for (d, _), k in zip(got, lengths) if k)
        assert [list(d.draft.session.tokens) for d in shared] == [list(d.draft.session.tokens) for d in alone]
        if step == 1:
            assert len(counted.rows[0]) == 2 and max(counted.rows[0]) <= 8   # the catch-ups in one step
        # the model keeps the first draft and picks a token of its own
        histories = [h + d[:1] + [target.encode(" the", add_special=False)[0]] for h, (d, _) in zip(histories, want)]


def test_serve_slots_share_their_draft_models_steps(tiny, run_scheduled):
    # `kvflash serve --draft MODEL` with two slots: their draft sessions run one draft model (the slots share its
    # weights), so the draft steps of a round run as one batched step of it; every slot gives plain greedy tokens.
    from kvflash_ggml.commands.serve import build_engines, build_parser
    from kvflash_ggml.server.scheduler import Scheduler

    path = tiny("llama")
    args = build_parser().parse_args(["--model", path, "--draft", path, "--parallel", "2", "--kvflash", "448",
                                      "--n-ctx", "2048", "--threads", "1", "--backend", "cpu", "--attention", "matmul",
                                      "--prefix-cache", "off"])
    engines, _, _ = build_engines(args)
    sched = Scheduler(engines, max_queue=4, batch=True)
    assert sched.draft_decoder is not None
    sched.draft_decoder = counted = _CountedSteps(sched.draft_decoder)
    rng = np.random.default_rng(6)
    motif = rng.integers(0, 1000, 29).tolist()
    prompts = [(motif * 20)[:n] for n in (500, 90)]
    records = run_scheduled(sched, prompts, 64)
    kw = dict(n_ctx=2048, pool_tokens=448, backend="cpu", n_threads=1, attention="matmul")
    with Model(path, **kw) as plain:
        want = [[r.token for r in plain.engine.generate(p, max_tokens=64, temperature=0.0) if r.token is not None]
                for p in prompts]
    assert [[r.token for r in recs[:-1]] for recs in records] == want
    assert 2 in counted.sessions   # both slots' draft steps in one batched step of the draft model
    assert all(recs[-1].stats["spec_drafted"] > 0 for recs in records)


def test_serve_slots_share_a_text_mapped_draft_models_steps(run_scheduled):
    # `kvflash serve --draft smollm2` for Gemma 3 (another vocabulary) with two slots: the slots' draft sessions
    # run one draft model, so their draft steps are batched steps of it; every slot gives plain greedy tokens.
    from kvflash_ggml.commands.serve import build_engines, build_parser
    from kvflash_ggml.server.scheduler import Scheduler

    flags = ["--n-ctx", "2048", "--kvflash", "448", "--threads", "2", "--backend", "cpu", "--attention", "matmul"]
    args = build_parser().parse_args(["--model", "gemma3-270m", "--draft", "smollm2", "--parallel", "2",
                                      "--prefix-cache", "off", *flags])
    engines, _, _ = build_engines(args)
    sched = Scheduler(engines, max_queue=4, batch=True)
    assert sched.draft_decoder is not None
    sched.draft_decoder = counted = _CountedSteps(sched.draft_decoder)
    prompts = [copy_prompt(engines[0].tokenizer, n) for n in (300, 200)]   # the pool holds both: they decode together
    records = run_scheduled(sched, prompts, 32)
    with Model("gemma3-270m", n_ctx=2048, pool_tokens=448, backend="cpu", n_threads=2, attention="matmul") as plain:
        want = [[r.token for r in plain.engine.generate(p, max_tokens=32, temperature=0.0) if r.token is not None]
                for p in prompts]
    assert [[r.token for r in recs[:-1]] for recs in records] == want
    assert 2 in counted.sessions   # both slots' draft steps in one batched step of the draft model
    assert all(recs[-1].stats["spec_vocab"] == "mapped through text" and recs[-1].stats["spec_drafted"] > 0
               for recs in records)


class _CountedSteps:
    """A BatchDecoder that counts the sessions of each step() it runs, and each step_rows' rows a session."""

    def __init__(self, decoder) -> None:
        self.decoder, self.sessions, self.rows = decoder, [], []

    def step_rows(self, sessions, rows, *a, **kw):
        self.rows.append([len(r) for r in rows])
        return self.decoder.step_rows(sessions, rows, *a, **kw)

    def step(self, sessions, tokens, *a, **kw):
        self.sessions.append(len(sessions))
        return self.decoder.step(sessions, tokens, *a, **kw)

    def __getattr__(self, name):
        return getattr(self.decoder, name)
