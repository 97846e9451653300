"""Speculative decoding with the GGUF's own multi-token-prediction (nextn) head: draft="mtp" (qwen35, qwen35moe).

The head's K/V are one more pooled layer written by every step of the session, from the trunk's output-normed states
shifted by one position (the carry); a draft is one step of the head in a free slot of the pool. References:
libllama's MTP context on the same tiny GGUF (random_gguf's mtp=True, written as the converter writes Qwen3.5), our
own full cache for the pooled and layer-major paths, a session that ran only the kept tokens for the drafts after
a rollback or a restore, and plain greedy decoding for the tokens.
"""
from __future__ import annotations


import numpy as np
import pytest
from kvflash_ggml import Model, _core
from kvflash_ggml.engine import Engine
from kvflash_ggml.mtp import MtpDraft
from kvflash_ggml.options import PoolConfig, SamplingParams, SpeculativeConfig
from kvflash_ggml.sampling import Sampler
from kvflash_ggml.snapshot import session_key
from kvflash_ggml.testing import random_gguf as rg
from kvflash_ggml.tokenizer import Tokenizer
from greedy_check import random_tokens as tokens

C = _core.CHUNK_TOKENS
POOL = 448   # 7 blocks: prompts of 700-900 tokens page, and generation evicts as it crosses chunk boundaries
# Our head and libllama's graph_mtp run the same ggml kernels in the same order: measured max |diff| 0.0 on every
# variant and path below; 1e-5 admits float reassociation only, while a norm, a concat order or a position off by
# one moves the logits by ~0.1 (they span ~1).
TOL_SAME_KERNELS = 1e-5

VARIANTS = {
    "qwen35-f32": ("tiny-qwen35", dict(weight_type="f32", mtp=True)),
    "qwen35-q8_0": ("tiny-qwen35", dict(weight_type="q8_0", mtp=True)),
    "qwen35moe-f32": ("tiny-qwen35moe", dict(weight_type="f32", mtp=True)),
    "echo": ("tiny-qwen35", dict(weight_type="q8_0", mtp=True, echo=True)),   # head and trunk repeat the token
    "no-head": ("tiny-qwen35", dict(weight_type="q8_0")),
}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return rg.preset_files(tmp_path_factory.mktemp("mtp"), VARIANTS)


def head_model(path: str) -> _core.Model:
    return _core.Model(path, backend="cpu", n_threads=1, mtp=True)


def session(model, pool: int = 0, **kw) -> _core.Session:
    kw.setdefault("attention", "matmul")
    return _core.Session(model, _core.SessionConfig(max_tokens=1024, pool_tokens=pool, mtp=True, **kw))


def chain(s: _core.Session, token: int, k: int) -> tuple[list[int], np.ndarray]:
    """k greedy draft steps of the head after token: the drafts and each step's logits [k, n_vocab]."""
    drafts, rows = [], []
    for i in range(k):
        rows.append(s.mtp_draft(token, i))
        token = int(rows[-1].argmax())
        drafts.append(token)
    return drafts, np.stack(rows)


def chunk_bytes(s: _core.Session, c: int) -> bytes:
    block = s.pager.chunk_blocks()[c]
    return s.kv.read_block(block) if block >= 0 else s.kv.host_image(c)


# ---- the head against libllama's MTP context --------------------------------------------------------------

@pytest.mark.parametrize("attention", ["matmul", "flash"])
@pytest.mark.parametrize("variant", ["qwen35-f32", "qwen35-q8_0", "qwen35moe-f32"])
def test_draft_logits_equal_libllamas_mtp_context(path, variant, attention):
    # The first draft pairs the pending token with the trunk's last state, each next one its own token with the
    # head's output; after a multi-token step (a verify step's shape) and a one-token step the chains agree again.
    ref = _core.testing.LlamaReference(path(variant), n_ctx=1024, n_threads=1, flash_attn=attention == "flash", mtp=True)
    s = session(head_model(path(variant)), attention=attention)
    prompt = tokens(300)
    diffs = []
    logits = s.forward(prompt, 0)
    diffs.append(np.abs(logits - ref.decode(prompt.tolist())).max())
    for fed in ([], [7, 300, 42], [99]):
        if fed:
            logits = s.forward(np.array(fed, np.int32), s.n_tokens, all_logits=True)[-1]
            diffs.append(np.abs(logits - ref.decode(fed, all_logits=True)[-1]).max())
        pending = int(logits.argmax())
        drafts, ours = chain(s, pending, 4)
        theirs = ref.mtp_draft([pending, *drafts[:-1]])
        assert np.isfinite(ours).all() and ours.std() > 0.01
        diffs.append(np.abs(ours - theirs).max())
    assert max(diffs) <= TOL_SAME_KERNELS, diffs


def test_a_file_with_a_nextn_layer_loads_with_or_without_its_head(path):
    # The converter counts the nextn layer in block_count and flags every block in attention.recurrent_layers: the
    # trunk is n_layer - 1 blocks either way, and the head's weights are loaded only when asked for.
    plain = _core.Model(path("qwen35-f32"), backend="cpu", n_threads=1)
    head = head_model(path("qwen35-f32"))
    for m in (plain, head):
        assert m.hparams.n_layer == 4 and m.hparams.n_layer_nextn == 1 and len(m.hparams.recurrent_layers) == 4
    assert not plain.has_mtp and head.has_mtp and head.weight_bytes > plain.weight_bytes
    assert plain.fingerprint != head.fingerprint   # snapshots of one never restore into the other
    with pytest.raises(ValueError, match="mtp=True"):
        session(plain)
    # the head changes nothing the trunk computes (its last layer then runs every row: summation order only)
    prompt = tokens(200)
    ours = session(head).forward(prompt, 0, all_logits=True)
    theirs = _core.Session(plain, _core.SessionConfig(max_tokens=1024, attention="matmul")).forward(prompt, 0, all_logits=True)
    np.testing.assert_allclose(ours, theirs, atol=TOL_SAME_KERNELS)
    with pytest.raises(ValueError, match="nextn"):
        head_model(path("no-head"))


def test_draft_steps_follow_one_another(path):
    model = head_model(path("qwen35-f32"))
    s = session(model)
    s.forward(tokens(100), 0)
    with pytest.raises(ValueError, match="must follow"):
        s.mtp_draft(5, 1)   # no step 0 yet
    s.mtp_draft(5, 0)
    s.forward(np.array([5], np.int32), 100)
    with pytest.raises(ValueError, match="must follow"):
        s.mtp_draft(6, 1)   # the session moved on: the chain is over
    assert s.mtp_room() == 1024 - 101
    s.mtp_draft(6, 0)
    _core.BatchDecoder(model).step([s], [3])   # a batched step moves the session on too
    with pytest.raises(ValueError, match="must follow"):
        s.mtp_draft(7, 1)


# ---- the head's K/V and carry on every path ---------------------------------------------------------------

@pytest.mark.parametrize("attention", ["matmul", "flash"])
def test_layer_major_and_stepwise_prefills_write_the_heads_kv_as_a_full_cache(path, attention):
    # Every chunk (the head's layer included: the pool's last), in a block or the host store, and the carry (in the
    # recurrent state) as a full cache writes them: from a layer-major prefill that extends a held prefix into the
    # minimum pool (in the full cache's steps), and from a full cache run in steps of 64 (the carry crosses every
    # step; on the mul_mat path only: flash attention tiles a step's queries by its size, summation order).
    model = head_model(path("qwen35-f32"))
    prompt = tokens(700)
    full = session(model, 0, attention=attention, n_batch=128)
    full.forward(prompt[:200], 0)
    logits_full = full.forward(prompt[200:], 200)
    exact = session(model, POOL, attention=attention, n_batch=128)
    exact.forward(prompt[:200], 0)
    logits, _ = exact.prefill_exact(prompt[200:], 200, n_batch=128)
    stepwise = session(model, 0, attention=attention, n_batch=64)
    stepwise.forward(prompt, 0)
    np.testing.assert_array_equal(logits, logits_full)
    assert exact.pager.stats().page_outs > 0 and exact.kv.layer_chunk_bytes * 3 == exact.kv.chunk_bytes
    for s in (exact, stepwise) if attention == "matmul" else (exact,):
        assert s.recurrent_state() == full.recurrent_state()
        for c in range(700 // C):
            assert chunk_bytes(s, c) == full.kv.read_block(c), f"chunk {c}"
    # with every chunk resident the drafts are the full cache's (flash attention's steps of another size: its F16
    # accumulation's summation order, ~1e-3 of logits that span ~1)
    pending = int(logits.argmax())
    np.testing.assert_allclose(chain(stepwise, pending, 3)[1], chain(full, pending, 3)[1],
                               atol=TOL_SAME_KERNELS if attention == "matmul" else 2e-3)


def test_a_layer_major_prefill_keeps_the_state_before_its_last_token(path):
    # checkpoint_before_last: the pass keeps the linear-attention state and the head's carry as they stood before the
    # prompt's last token (a host copy, as checkpoint() there would), while that token still runs inside the pass;
    # going back there gives what a full cache holds after every token but the last (in the same steps).
    model = head_model(path("qwen35-f32"))
    prompt = tokens(700)
    before_last = session(model, 0, n_batch=128)
    before_last.forward(prompt[:200], 0)
    before_last.forward(prompt[200:699], 200)
    runs = {}
    for keep in (False, True):
        s = runs[keep] = session(model, POOL, n_batch=128)
        s.forward(prompt[:200], 0)
        s.prefill_exact(prompt[200:], 200, n_batch=128, checkpoint_before_last=keep)
    assert runs[False].rewind_point(699) < 699 and runs[True].rewind_point(699) == 699
    assert runs[True].memory()["recurrent_checkpoint_bytes"] > 0
    runs[True].truncate(699)
    assert runs[True].n_tokens == 699 and runs[True].recurrent_state() == before_last.recurrent_state()


def test_a_snapshot_carries_the_heads_kv_and_carry(path):
    model = head_model(path("qwen35-f32"))
    s = session(model, POOL, n_batch=100)
    s.forward(tokens(900), 0)
    r = _core.Session.from_bytes(model, s.to_bytes())
    assert r.mtp and r.recurrent_state() == s.recurrent_state()
    np.testing.assert_array_equal(chain(r, 17, 3)[1], chain(s, 17, 3)[1])
    plain = _core.Session(model, _core.SessionConfig(max_tokens=1024, pool_tokens=POOL, attention="matmul"))
    with pytest.raises(_core.SnapshotError, match="multi-token-prediction"):
        plain.load_bytes(s.to_bytes())
    assert session_key(plain, model) != session_key(s, model)   # a prefix cache keeps them apart


# ---- speculative decoding -----------------------------------------------------------------------------------

KW = dict(n_ctx=2048, backend="cpu", n_threads=1, attention="matmul", policy="lru", tau=16)


def greedy(model: Model, prompt: list[int], n: int) -> list[int]:
    return [r.token for r in model.engine.generate(prompt, max_tokens=n, temperature=0.0) if r.token is not None]


@pytest.mark.parametrize("pool", [None, POOL])
@pytest.mark.parametrize("variant", ["qwen35-q8_0", "echo"])
def test_greedy_speculation_with_mtp_equals_plain(path, variant, pool):
    # q8_0 on the mul_mat path: a verify step's rows are the plain steps' bits. The random head's drafts are nearly
    # all rejected (the stash and a rerun each step); the echo model's are all kept. In the pool, generation crosses
    # chunk boundaries and evicts while drafting.
    prompt = tokens(900, seed=7).tolist()
    with Model(path(variant), **KW, pool_tokens=pool) as plain, \
            Model(path(variant), **KW, pool_tokens=pool, speculative="mtp") as spec:
        want = greedy(plain, prompt, 96)
        gen = spec.engine.generate(prompt, max_tokens=96, temperature=0.0)
        got = [next(gen).token]   # the prompt and the first token: drafting follows
        before = spec.stats()
        got += [r.token for r in gen if r.token is not None]
        st = spec.stats()
    assert got == want and len(want) == 96
    assert st["spec_mode"] == "mtp" and st["spec_drafted"] > 40
    assert st["spec_acceptance"] == 1.0 if variant == "echo" else st["spec_accepted"] < st["spec_drafted"]
    if pool:
        assert st["page_outs"] > before["page_outs"]


class Checked:
    """The engine's MTP drafter, each proposal checked against a session that ran only the history (its own steps,
    one prompt, no drafts, no rollback, no restore): the head's K/V and carry must be the same, so the logits of
    every draft step too. wrong_second: replace the second draft by another token, so a step keeps one draft and
    rejects the next (the rollback reruns the kept one)."""

    def __init__(self, drafter: MtpDraft, ref_model: _core.Model, wrong_second: bool = False) -> None:
        self.drafter, self.wrong_second = drafter, wrong_second
        self.ref = _core.Session(ref_model, _core.SessionConfig(max_tokens=2048, attention="matmul", mtp=True))
        self.n_checked = 0

    def propose(self, history, k, sampler):
        s, ref = self.drafter.session, self.ref
        if ref.n_tokens:
            ref.reset()
        ref.forward(np.asarray(history[:-1], np.int32), 0)
        k = min(k, s.mtp_room())
        drafts, ours = chain(s, int(history[-1]), k)
        _, theirs = chain(ref, int(history[-1]), k)
        # Measured up to 3.2e-3: a token's trunk state in a one-token step and inside the reference's one long
        # step round differently now and then. A carry or K/V of another token moves the logits by ~0.6.
        np.testing.assert_allclose(ours, theirs, atol=2e-2)
        self.n_checked += 1
        if self.wrong_second and len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % 1000
        return drafts, None


@pytest.mark.parametrize("variant,wrong_second", [("qwen35-q8_0", False), ("echo", True)])
def test_drafts_after_a_rollback_are_a_fresh_sessions(path, variant, wrong_second):
    prompt = tokens(300, seed=3).tolist()
    with Model(path(variant), **KW, pool_tokens=POOL) as plain, \
            Model(path(variant), **KW, pool_tokens=POOL, speculative="mtp") as spec:
        want = greedy(plain, prompt, 24)
        checked = spec.engine.speculator.drafter = Checked(spec.engine.speculator.drafter, spec.engine.model, wrong_second)
        got = greedy(spec, prompt, 24)
        st = spec.stats()
    assert got == want and checked.n_checked > 5
    assert 0 < st["spec_accepted"] < st["spec_drafted"] if wrong_second else st["spec_accepted"] < st["spec_drafted"]


def test_a_snapshot_mid_generation_restores_and_drafts_on(path, tmp_path):
    # Twenty tokens, a snapshot, a fresh Model that restores it and generates twenty more: the tokens of one
    # uninterrupted run, and drafts a session that ran only the history would make (the carry came back too). A
    # full cache, so that the reference attends what the head attends (a pooled snapshot: the test above).
    prompt = tokens(700, seed=4).tolist()
    with Model(path("qwen35-q8_0"), **KW, speculative="mtp") as whole:
        want = greedy(whole, prompt, 40)
    with Model(path("qwen35-q8_0"), **KW, speculative="mtp") as first:
        assert greedy(first, prompt, 20) == want[:20]
        first.save_state(tmp_path / "mid.kvf")
    with Model(path("qwen35-q8_0"), **KW, speculative="mtp") as resumed:
        resumed.load_state(tmp_path / "mid.kvf")
        assert resumed.engine.session.n_tokens == len(prompt) + 19
        eng = resumed.engine
        checked = eng.speculator.drafter = Checked(eng.speculator.drafter, eng.model)
        got = greedy(resumed, prompt + want[:20], 20)
        st = resumed.stats()
    assert got == want[20:] and checked.n_checked > 5 and st["prompt_tokens_computed"] == 1


def test_sampled_drafts_come_with_their_distributions(path):
    s = session(head_model(path("qwen35-f32")), POOL)
    s.forward(tokens(300), 0)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=8, top_p=1.0, min_p=0.0, seed=1))
    drafts, q = MtpDraft(s).propose(tokens(300).tolist() + [5], 4, sampler)
    assert len(drafts) == len(q) == 4
    for d, p in zip(drafts, q):
        assert abs(p.sum() - 1.0) < 1e-6 and p[d] > 0 and (p > 0).sum() <= 8
    with pytest.raises(RuntimeError, match="pending"):
        MtpDraft(s).propose([1, 2, 3], 2, sampler)   # a history the session does not hold


def test_a_model_without_a_head_is_refused_clearly(path):
    with pytest.raises(ValueError, match="nextn"):
        Model(path("no-head"), n_ctx=512, backend="cpu", n_threads=1, speculative="mtp")
    loaded_without = _core.Model(path("qwen35-q8_0"), backend="cpu", n_threads=1)
    with pytest.raises(ValueError, match="mtp=True"):
        Engine(loaded_without, Tokenizer(path("qwen35-q8_0")), PoolConfig(n_ctx=512),
               speculative=SpeculativeConfig(draft="mtp"))


# ---- the commands and the server ----------------------------------------------------------------------------

def test_cli_generate_with_draft_mtp(path, capsys):
    from kvflash_ggml.commands.generate import main

    assert main(["--model", path("echo"), "--prompt", "one two three four", "--max-tokens", "12", "--draft", "mtp",
                 "--threads", "1", "--stats", "--json"]) == 0
    err = capsys.readouterr().err
    assert '"spec_mode": "mtp"' in err and '"spec_acceptance": 1.0' in err


@pytest.mark.parametrize("variant", ["echo", "qwen35-q8_0"])
def test_serve_slots_draft_with_mtp_and_verify_batched(path, variant, run_scheduled):
    # `kvflash serve --draft mtp`: every slot's session runs the head (their pools one arena); the head drafts in each
    # slot's own steps and the slots' verify steps share batched forwards (issue 38 item 3: they stepped alone), each
    # writing the head's K/V and carry of its own rows; every slot gives plain greedy decoding's tokens. echo: every
    # draft kept; the random q8_0 model: drafts rejected too (the stash, then the kept ones again).
    from kvflash_ggml.commands.serve import build_engines, build_parser
    from kvflash_ggml.server.scheduler import Scheduler

    args = build_parser().parse_args(["--model", path(variant), "--draft", "mtp", "--parallel", "2", "--kvflash",
                                      str(POOL), "--n-ctx", "2048", "--threads", "1", "--backend", "cpu",
                                      "--prefix-cache", "off"])
    engines, _, _ = build_engines(args)
    assert all(e.session.mtp and e.speculator.stats()["spec_mode"] == "mtp" for e in engines)
    sched = Scheduler(engines, max_queue=4, batch=True)
    assert all(slot.batchable for slot in sched.slots)
    sched.decoder = counted = CountedDrafts(sched.decoder)
    # the second prompt is short: it has run while the first slot decodes, and their steps share forwards
    prompts = [tokens(n, seed=5 + n).tolist() for n in (500, 60)]
    records = run_scheduled(sched, prompts, 120)
    with Model(path(variant), **{**KW, "policy": "lru"}, pool_tokens=POOL) as plain:
        want = [greedy(plain, p, 120) for p in prompts]
    assert [[r.token for r in recs[:-1]] for recs in records] == want
    assert sched.n_batched_steps > 0 and sched.n_batched_tokens > 2 * sched.n_batched_steps   # verify steps' drafts
    assert 2 in counted.sessions   # both slots' draft steps in one graph
    stats = [recs[-1].stats for recs in records]
    if variant == "echo":
        assert all(st["spec_accepted"] == st["spec_drafted"] > 0 for st in stats)
    else:
        assert all(st["spec_accepted"] < st["spec_drafted"] for st in stats)
        # both slots rejected drafts in one round: their kept tokens ran again from the stash in one batched step
        assert 2 in counted.again


class CountedDrafts:
    """A BatchDecoder that counts the sessions of each shared draft step (mtp_draft), and of each step that runs
    rejecting slots' kept tokens again (step_rows without keep_queries)."""

    def __init__(self, decoder: _core.BatchDecoder) -> None:
        self.decoder, self.sessions, self.again = decoder, [], []

    def mtp_draft(self, sessions, tokens, step):
        self.sessions.append(len(sessions))
        return self.decoder.mtp_draft(sessions, tokens, step)

    def step_rows(self, sessions, rows, keep=None):
        if keep is None:
            self.again.append(len(sessions))
        return self.decoder.step_rows(sessions, rows, keep)

    def __getattr__(self, name):
        return getattr(self.decoder, name)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafts_proposed_together_are_each_sessions_own(path, temperature):
    """Sessions drafting with the head in shared draft steps (propose_together: a server's slots) propose what each
    proposes alone (MtpDraft.propose), and with the same probabilities when sampling; a session asking for fewer drafts
    leaves the later steps, one asking for more than its room drafts what fits."""
    from kvflash_ggml.mtp import propose_together

    model = head_model(path("qwen35-q8_0"))
    prompts = [tokens(n, seed=n) for n in (300, 130, 200)]
    twins = [[session(model, pool, attention="flash") for pool in (POOL, 0, POOL)] for _ in range(2)]
    for group in twins:
        for s, p in zip(group, prompts):
            s.forward(p[:-1], 0)
    alone, shared = twins
    lengths = [3, 1, 5]
    samplers = [[Sampler(SamplingParams(temperature=temperature, seed=j)) for j in range(3)] for _ in range(2)]
    want = [MtpDraft(s).propose(p.tolist(), k, sampler) for s, p, k, sampler in zip(alone, prompts, lengths, samplers[0])]
    got = propose_together(_core.BatchDecoder(model), shared, [int(p[-1]) for p in prompts], lengths, samplers[1])
    assert [d for d, _ in got] == [d for d, _ in want] and [len(d) for d, _ in got] == lengths
    for (_, q_got), (_, q_want) in zip(got, want):
        assert (q_got is None) == (q_want is None) == (temperature == 0.0)
        if q_got is not None:
            np.testing.assert_array_equal(np.stack(q_got), np.stack(q_want))
    room = shared[0].mtp_room()
    got = propose_together(_core.BatchDecoder(model), shared[:1], [1], [room + 5], samplers[1][:1])
    assert len(got[0][0]) == room


def test_bench_spec_runs_with_draft_mtp(path, tmp_path, capsys):
    import json

    from kvflash_ggml.bench.spec import main

    out = tmp_path / "spec.json"
    assert main(["--model", path("echo"), "--draft", "mtp,prompt_lookup", "--task", "random", "--contexts", "600",
                 "--n-gen", "24", "--reps", "1", "--threads", "1", "--kvflash", str(POOL), "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]["spec"]["mtp"]
    assert row["same_tokens"] and row["acceptance"] == 1.0
    assert "mtp" in capsys.readouterr().out
