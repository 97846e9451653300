"""Hybrid and MoE families: qwen35 / qwen35moe (gated delta-net layers beside full attention) and qwen3moe.

A qwen35 model's linear-attention layers keep a fixed-size conv and recurrent state each (RecurrentState);
only its full-attention layers are pooled, paged and scored. That state cannot go back, so everything that
moves backwards (a diverging prompt, a prefix snapshot) starts over or is refused. References: libllama's
llama_decode on the same GGUF (tiny random models), and our own full cache for the pooled paths.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from kvflash_ggml import _core
from kvflash_ggml.testing import random_gguf as rg
from greedy_check import (cpu_model as model_of, full_cache_against_libllama, generate_with_live_eviction,
                          random_tokens as tokens, run_fed as run, session_of)

C = _core.CHUNK_TOKENS
N_PROMPT, N_DECODE = 300, 32
MAX_TOKENS = 1024
# Our graph and libllama's run the same ggml kernels (the fused gated delta-net, ssm_conv, mul_mat_id with
# the same top-k routing) in the same order: measured max |diff| 0.0 on every variant (f32, f16, q8_0).
# 1e-5 admits float reassociation only; a graph difference (a gate, a norm, the conv window) moves far more.
TOL_SAME_KERNELS = 1e-5

VARIANTS = {
    "qwen35-f32": ("tiny-qwen35", "f32"),
    "qwen35-f16": ("tiny-qwen35", "f16"),
    "qwen35-q8_0": ("tiny-qwen35", "q8_0"),
    "qwen35moe-f32": ("tiny-qwen35moe", "f32"),
    "qwen35moe-q8_0": ("tiny-qwen35moe", "q8_0"),
    "qwen3moe-f32": ("tiny-qwen3moe", "f32"),
    "qwen3moe-f16": ("tiny-qwen3moe", "f16"),
    "qwen3moe-q8_0": ("tiny-qwen3moe", "q8_0"),
}
HYBRID = ["qwen35-f32", "qwen35moe-f32"]
POOL = 448   # the smallest pool (7 blocks): contexts of 900 tokens page


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return rg.preset_files(tmp_path_factory.mktemp("hybrid"),
                           {name: (shape, dict(weight_type=wt)) for name, (shape, wt) in VARIANTS.items()})


def session(model, pool: int = 0, **kw) -> _core.Session:
    return session_of(model, MAX_TOKENS, pool, **kw)


def greedy_with_reference(path: str, attention: str):
    return full_cache_against_libllama(path, attention, MAX_TOKENS, N_PROMPT, N_DECODE)


# ---- equivalence with libllama ---------------------------------------------------------------------

def test_hparams_name_the_recurrent_layers_and_experts(model_path):
    hp = model_of(model_path("qwen35-f32")).hparams
    assert hp.arch == "qwen35" and list(hp.recurrent_layers) == [1, 0, 1, 0] and hp.n_pooled_layers == 2
    assert hp.ssm_d_inner == hp.ssm_d_state * hp.ssm_dt_rank and hp.n_expert == 0
    moe = model_of(model_path("qwen35moe-f32")).hparams
    assert moe.n_expert > moe.n_expert_used > 0 and moe.n_ff_shexp > 0 and moe.n_pooled_layers == 2
    q3 = model_of(model_path("qwen3moe-f32")).hparams
    assert q3.n_expert > 0 and q3.n_ff_shexp == 0 and not any(q3.recurrent_layers) and q3.n_pooled_layers == q3.n_layer


@pytest.mark.parametrize("attention", ["matmul", "flash"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_cache_matches_libllama(model_path, variant, attention):
    ours, ref, _ = greedy_with_reference(model_path(variant), attention)
    assert np.isfinite(ours).all() and ours.std() > 0.01
    diff = float(np.abs(ours - ref).max())
    assert diff <= TOL_SAME_KERNELS, f"max |logit diff| {diff:.3g}"
    np.testing.assert_array_equal(ours[N_PROMPT - 1:].argmax(-1), ref[N_PROMPT - 1:].argmax(-1))


@pytest.mark.parametrize("attention", ["matmul", "flash"])
@pytest.mark.parametrize("variant", HYBRID + ["qwen3moe-f32"])
def test_pooled_with_room_for_the_context_equals_full_cache(model_path, variant, attention):
    model = model_of(model_path(variant))
    fed = tokens(N_DECODE, seed=9).tolist()
    full = run(session(model, 0, attention=attention), tokens(N_PROMPT), fed)
    for n_batch in (512, 100):   # steps of 100 carry the recurrent state across steps inside the prompt
        pooled = run(session(model, 512, attention=attention, n_batch=n_batch), tokens(N_PROMPT), fed)
        assert float(np.abs(pooled - full).max()) <= TOL_SAME_KERNELS, f"n_batch={n_batch}"


@pytest.mark.parametrize("variant", HYBRID)
def test_only_attention_layers_are_pooled_and_the_state_is_fixed(model_path, variant):
    model = model_of(model_path(variant))
    hp = model.hparams
    s = session(model, POOL, n_batch=64)
    row = hp.n_head_kv * hp.head_dim_k * 2   # f16 K row = V row
    head_v = hp.ssm_d_inner // hp.ssm_dt_rank
    state = (hp.ssm_d_conv - 1) * (hp.ssm_d_inner + 2 * hp.ssm_n_group * hp.ssm_d_state) + head_v * head_v * hp.ssm_dt_rank
    mem = s.memory()
    assert mem["pool_bytes"] == hp.n_pooled_layers * POOL * 2 * row
    assert mem["recurrent_bytes"] >= 2 * state * 4 and mem["ring_bytes"] == 0   # 2 linear-attention layers, F32
    assert s.kv.chunk_bytes == hp.n_pooled_layers * C * 2 * row
    # a context twice the pool: the pool pages, the state does not grow; a reselect pages chunks back in
    s.forward(tokens(896), 0)
    assert s.memory()["recurrent_bytes"] == mem["recurrent_bytes"] and s.pager.stats().page_outs > 0
    scores = np.zeros(s.pager.n_chunks(), np.float32)
    scores[1] = 1.0   # an old chunk, evicted by now (7 blocks: sink + 5 tail chunks + 1 free)
    assert not s.pager.is_resident(1)
    s.reselect(scores)
    s.pager.check_invariants()
    assert s.pager.is_resident(1)
    out = run(s, tokens(40, seed=2), tokens(8, seed=3).tolist())
    assert np.isfinite(out).all()


@pytest.mark.parametrize("policy", ["lru", "qk", "quest", "drafter"])
def test_engine_generates_with_live_eviction(model_path, policy):
    st = generate_with_live_eviction(model_path("qwen35moe-f32"), policy, MAX_TOKENS, POOL)
    assert st["device_recurrent_bytes"] > 0
    assert st["device_peak_bytes"] >= st["device_kv_bytes"] + st["device_recurrent_bytes"]


# ---- going back ---------------------------------------------------------------------------------------

def test_truncate_goes_only_to_the_end_or_to_zero(model_path):
    model = model_of(model_path("qwen35-f32"))
    s = session(model, 0)
    s.forward(tokens(200), 0)
    assert s.can_truncate(200) and s.can_truncate(0) and not s.can_truncate(199) and not s.can_truncate(128)
    state = s.recurrent_state()
    with pytest.raises(ValueError, match="linear-attention"):
        s.truncate(128)
    assert s.n_tokens == 200 and s.recurrent_state() == state   # nothing changed
    s.truncate(0)
    assert s.n_tokens == 0 and s.recurrent_state() == bytes(len(state))
    # starting over gives the cold run's logits
    again = s.forward(tokens(200), 0)
    np.testing.assert_array_equal(again, session(model, 0).forward(tokens(200), 0))


def test_checkpoints_are_the_points_to_go_back_to(model_path):
    model = model_of(model_path("qwen35-f32"))
    s = session(model, POOL, n_batch=64)
    s.forward(tokens(100), 0)
    s.checkpoint()
    s.forward(tokens(100, seed=2), 100)
    s.checkpoint()
    at_200 = s.recurrent_state()
    s.forward(tokens(60, seed=3), 200)
    assert s.memory()["recurrent_checkpoint_bytes"] == 2 * len(at_200)
    assert [s.rewind_point(n) for n in (260, 250, 200, 199, 100, 99)] == [260, 200, 200, 100, 100, 0]
    assert not s.can_truncate(250) and s.can_truncate(200)
    s.truncate(200)
    assert s.n_tokens == 200 and s.recurrent_state() == at_200
    s.pager.check_invariants()
    cold = session(model, POOL, n_batch=64)
    cold.forward(np.concatenate([tokens(100), tokens(100, seed=2)]), 0)
    follow = tokens(30, seed=4)
    np.testing.assert_array_equal(s.forward(follow, 200, all_logits=True), cold.forward(follow, 200, all_logits=True))
    # the newest three are kept (a prompt's end, the token before it, the turn before): a fourth (at 250) drops the
    # oldest (100)
    s.checkpoint()
    assert [s.rewind_point(n) for n in (150, 215, 230)] == [100, 200, 230]
    s.forward(tokens(20, seed=5), 230)
    s.checkpoint()
    assert [s.rewind_point(n) for n in (150, 215, 240, 250)] == [0, 200, 230, 250]


def test_a_stash_on_the_device_is_a_point_to_go_back_to(model_path):
    model = model_of(model_path("qwen35-f32"))
    s = session(model, POOL, n_batch=64)
    s.forward(tokens(150), 0)
    before = s.memory()["recurrent_bytes"]
    s.stash()
    at_150 = s.recurrent_state()
    s.forward(tokens(9, seed=2), 150)   # a verify step of drafts, say
    assert s.memory()["recurrent_bytes"] == 2 * before   # the stash is a second device copy, reported
    assert s.can_truncate(150) and s.rewind_point(155) == 150 and not s.can_truncate(152)
    s.truncate(150)
    assert s.n_tokens == 150 and s.recurrent_state() == at_150
    cold = session(model, POOL, n_batch=64)
    cold.forward(tokens(150), 0)
    follow = tokens(4, seed=3)
    np.testing.assert_array_equal(s.forward(follow, 150, all_logits=True), cold.forward(follow, 150, all_logits=True))
    s.truncate(0)   # below the stash: it is forgotten
    s.forward(tokens(200, seed=4), 0)
    assert not s.can_truncate(150)


def test_the_next_turn_restarts_at_the_prompts_checkpoint(model_path):
    # A chat's next turn shares the previous prompt, not always the generated tail (a template renders the
    # reply its own way): the state kept before the prompt's last token serves it.
    from kvflash_ggml import Model

    kw = dict(model_path=model_path("qwen35moe-f32"), n_ctx=MAX_TOKENS, pool_tokens=POOL, backend="cpu", n_threads=1)
    a = tokens(600)
    b = a.tolist() + tokens(60, seed=7).tolist()   # the first prompt, then something else than the reply
    with Model(**kw) as llm, Model(**kw) as fresh:
        llm.create_completion(a.tolist(), max_tokens=8, temperature=0.0)
        out = llm.create_completion(b, max_tokens=12, temperature=0.0)
        assert llm.stats()["prompt_tokens_reused"] == len(a)   # a layer-major prompt keeps its end too
        assert llm.stats()["host_checkpoint_bytes"] > 0
        cold = fresh.create_completion(b, max_tokens=12, temperature=0.0)
    assert out["choices"][0]["text"] == cold["choices"][0]["text"]


@pytest.mark.parametrize("variant", HYBRID)
def test_a_diverging_prompt_starts_over_and_equals_a_cold_run(model_path, variant):
    from kvflash_ggml import Model

    kw = dict(model_path=model_path(variant), n_ctx=MAX_TOKENS, pool_tokens=POOL, backend="cpu", n_threads=1)
    a, b = tokens(700), tokens(700, seed=5)
    b[:300] = a[:300]   # shares 300 tokens, then diverges
    with Model(**kw) as llm, Model(**kw) as fresh:
        llm.create_completion(a.tolist(), max_tokens=4, temperature=0.0)
        out = llm.create_completion(b.tolist(), max_tokens=12, temperature=0.0)
        assert llm.stats()["prompt_tokens_reused"] == 0
        cold = fresh.create_completion(b.tolist(), max_tokens=12, temperature=0.0)
    assert out["choices"][0]["text"] == cold["choices"][0]["text"]


def test_a_prompt_extending_the_history_reuses_it_exactly(model_path):
    from kvflash_ggml import Model

    kw = dict(model_path=model_path("qwen35-f32"), n_ctx=MAX_TOKENS, pool_tokens=POOL, backend="cpu", n_threads=1)
    a = tokens(400)
    with Model(**kw) as llm, Model(**kw) as fresh:
        first = llm.create_completion(a.tolist(), max_tokens=6, temperature=0.0, logprobs=1)
        held = list(llm.engine.session.tokens)
        b = held + tokens(50, seed=8).tolist()   # the whole history, then more
        out = llm.create_completion(b, max_tokens=12, temperature=0.0)
        assert llm.stats()["prompt_tokens_reused"] == len(held)
        cold = fresh.create_completion(b, max_tokens=12, temperature=0.0)
    assert first["usage"]["completion_tokens"] == 6
    assert out["choices"][0]["text"] == cold["choices"][0]["text"]


def test_prefix_cache_hit_after_a_diverging_turn_continues_as_a_cold_run(model_path, tmp_path):
    from kvflash_ggml import Model

    kw = dict(model_path=model_path("qwen35moe-f32"), n_ctx=MAX_TOKENS, pool_tokens=POOL, backend="cpu",
              n_threads=1, prefix_cache_dir=str(tmp_path))
    a = tokens(330)
    with Model(**kw) as llm:
        llm.create_completion(a.tolist(), max_tokens=5, temperature=0.0)
        stored = list(llm.engine.session.tokens)          # the whole turn is stored (not a chunk-aligned cut)
        llm.create_completion(tokens(200, seed=4).tolist(), max_tokens=3, temperature=0.0)   # diverging turn
        b = stored + tokens(40, seed=6).tolist()
        out = llm.create_completion(b, max_tokens=10, temperature=0.0)
        assert llm.stats()["prompt_tokens_reused"] == len(stored)
    with Model(**{**kw, "prefix_cache_dir": None}) as fresh:
        cold = fresh.create_completion(b, max_tokens=10, temperature=0.0)
    assert out["choices"][0]["text"] == cold["choices"][0]["text"]


# ---- layer-major exact prefill -------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["matmul", "flash"])
@pytest.mark.parametrize("variant", HYBRID)
def test_exact_prefill_equals_the_full_cache(model_path, variant, attention):
    model = model_of(model_path(variant))
    prompt = tokens(700)
    full = session(model, 0, attention=attention, n_batch=128)
    logits_full = full.forward(prompt[:200], 0)
    s = session(model, POOL, attention=attention, n_batch=128)
    s.forward(prompt[:200], 0)
    # the prompt extends a held prefix: only the new part runs, layer by layer, the state carried on
    logits_full = full.forward(prompt[200:], 200)
    logits, _ = s.prefill_exact(prompt[200:], 200, n_batch=128)
    np.testing.assert_array_equal(logits, logits_full)
    assert s.recurrent_state() == full.recurrent_state()
    assert s.pager.stats().page_outs > 0
    for c in range(700 // C):   # every chunk's K/V, resident or in the host store, as the full cache wrote it
        block = s.pager.chunk_blocks()[c]
        assert (s.kv.read_block(block) if block >= 0 else s.kv.host_image(c)) == full.kv.read_block(c), f"chunk {c}"


@pytest.mark.parametrize("variant", HYBRID)
def test_an_exact_prompts_last_token_sees_every_position_and_a_resend_gives_the_same(model_path, variant):
    # The state is kept before a prompt's last token (the next turn or a resend restarts there), yet that token
    # must attend every position as the rest of the exact prefill does: a rerun, rewound to the checkpoint, runs it
    # again exactly, and the same request must give the same logits both times. (A resend of the prompt while it is
    # held unchanged runs nothing: tests/test_resend.py. Here its end is dropped first.)
    from kvflash_ggml import Model

    kw = dict(model_path=model_path(variant), n_ctx=MAX_TOKENS, backend="cpu", n_threads=1, attention="matmul")
    prompt = tokens(900).tolist()
    with Model(pool_tokens=POOL, prefill="exact", **kw) as llm, Model(pool_tokens=None, **kw) as full:
        reference = full.engine.prefill(prompt)
        first = llm.engine.prefill(prompt)
        assert llm.engine.session.pager.stats().page_outs > 0 and llm.stats()["host_checkpoint_bytes"] > 0
        llm.engine.session.truncate(len(prompt) - 1)   # to the checkpoint inside the pass
        again = llm.engine.prefill(prompt)
        assert llm.engine.n_reused == len(prompt) - 1
    # steps of other sizes: reassociation only (the last token run over the pool alone: 0.03-0.06 here)
    diff, again_diff = np.abs(first - reference).max(), np.abs(again - first).max()
    assert diff <= TOL_SAME_KERNELS, f"max |logit diff| to the full cache {diff:.3g}"
    assert again_diff <= TOL_SAME_KERNELS, f"max |logit diff| of the resend to the first {again_diff:.3g}"


def test_a_failed_exact_prefill_leaves_the_state_as_it_was(model_path):
    model = model_of(model_path("qwen35-f32"))
    s = session(model, POOL, n_batch=128)
    s.forward(tokens(100), 0)
    state = s.recurrent_state()
    calls = []

    def interrupt():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        s.prefill_exact(tokens(600, seed=3), 100, n_batch=128, between=interrupt)
    assert s.n_tokens == 100 and s.recurrent_state() == state
    s.pager.check_invariants()
    np.testing.assert_array_equal(s.forward(tokens(5, seed=4), 100), session(model, POOL, n_batch=128).forward(
        np.concatenate([tokens(100), tokens(5, seed=4)]), 0))


# ---- serving --------------------------------------------------------------------------------------------

def test_server_slots_of_a_hybrid_decode_in_batched_steps(model_path, run_scheduled):
    """`kvflash serve --parallel 3` on a hybrid: the slots' decode steps share batched forwards (each slot's
    linear-attention state stepped in the one graph), and every slot gives the tokens the model gives alone. q8_0 on
    the mul_mat path: a batched step's rows are the lone steps' bits, so the tokens must be equal."""
    from kvflash_ggml import Model
    from kvflash_ggml.commands.serve import build_engines, build_parser
    from kvflash_ggml.server.scheduler import Scheduler

    path = model_path("qwen35-q8_0")
    args = build_parser().parse_args(["--model", path, "--parallel", "3", "--kvflash", str(POOL), "--n-ctx",
                                      str(MAX_TOKENS), "--threads", "1", "--backend", "cpu", "--prefix-cache", "off"])
    engines, _, _ = build_engines(args)
    sched = Scheduler(engines, max_queue=4, batch=True)
    assert all(slot.batchable for slot in sched.slots)
    prompts = [tokens(n, seed=20 + n).tolist() for n in (700, 100, 300)]   # 700: an exact prefill that pages

    records = run_scheduled(sched, prompts, 40)
    assert sched.n_batched_steps > 0 and sched.n_batched_tokens > sched.n_batched_steps
    kw = dict(n_ctx=MAX_TOKENS, pool_tokens=POOL, backend="cpu", n_threads=1)
    with Model(path, **kw) as alone:
        want = [[r.token for r in alone.engine.generate(p, max_tokens=40, temperature=0.0) if r.token is not None]
                for p in prompts]
    assert [[r.token for r in recs[:-1]] for recs in records] == want


def test_speculating_slots_of_a_hybrid_verify_in_batched_steps(model_path, run_scheduled):
    """Regression for issue 38 item 3: a hybrid's verify steps ran one slot at a time. Now each slot's pending token
    and drafts join the round's batched forward (its state stashed first, gone back to when drafts are rejected), and
    every slot gives the tokens plain greedy decoding gives it alone."""
    from kvflash_ggml import Model
    from kvflash_ggml.commands.serve import build_engines, build_parser
    from kvflash_ggml.server.scheduler import Scheduler

    path = model_path("qwen35-q8_0")
    args = build_parser().parse_args(["--model", path, "--parallel", "3", "--kvflash", str(POOL), "--n-ctx",
                                      str(MAX_TOKENS), "--threads", "1", "--backend", "cpu", "--prefix-cache", "off",
                                      "--draft", "prompt_lookup"])
    engines, _, _ = build_engines(args)
    sched = Scheduler(engines, max_queue=4, batch=True)
    rows_seen: list[list[int]] = []

    class Recording:   # the scheduler's decoder, noting each batched verify step's rows a slot
        def __init__(self, decoder):
            self.decoder = decoder

        def step_rows(self, sessions, rows, keep=None):
            rows_seen.append([len(r) for r in rows])
            return self.decoder.step_rows(sessions, rows, keep)

        def __getattr__(self, name):
            return getattr(self.decoder, name)

    sched.decoder = Recording(sched.decoder)
    # a repeated phrase: prompt lookup proposes its continuation
    prompts = [np.tile(tokens(n, seed=30 + n), 6).tolist() for n in (50, 20, 35)]
    records = run_scheduled(sched, prompts, 40)
    assert any(max(r) > 1 for r in rows_seen)   # verify steps with drafts went batched
    kw = dict(n_ctx=MAX_TOKENS, pool_tokens=POOL, backend="cpu", n_threads=1)
    with Model(path, **kw) as alone:
        want = [[r.token for r in alone.engine.generate(p, max_tokens=40, temperature=0.0) if r.token is not None]
                for p in prompts]
    assert [[r.token for r in recs[:-1]] for recs in records] == want


# ---- snapshots ------------------------------------------------------------------------------------------

def test_snapshot_carries_the_state(model_path):
    model = model_of(model_path("qwen35-f32"))
    s = session(model, POOL, n_batch=100)
    s.forward(tokens(900), 0)
    data = s.to_bytes()
    assert _core.snapshot_info(data)["format_version"] == 3
    r = _core.Session.from_bytes(model, data)
    assert r.recurrent_state() == s.recurrent_state()
    follow = tokens(20, seed=6)
    np.testing.assert_array_equal(r.forward(follow, 900, all_logits=True), s.forward(follow, 900, all_logits=True))


def test_prefix_snapshots_and_foreign_states_are_refused(model_path):
    model = model_of(model_path("qwen35-f32"))
    s = session(model, POOL)
    s.forward(tokens(300), 0)
    with pytest.raises(_core.SnapshotError, match="linear-attention"):
        s.to_bytes(prefix_chunks=2)
    dense = model_of(model_path("qwen3moe-f32"))
    with pytest.raises(_core.SnapshotError):
        session(dense, POOL).load_bytes(s.to_bytes())   # another model altogether


_RESTORE_AND_CONTINUE = textwrap.dedent("""
    import sys, numpy as np
    from kvflash_ggml import _core
    m = _core.Model(sys.argv[1], backend="cpu", n_threads=1)
    s = _core.Session.restore(m, sys.argv[2])
    follow = np.random.default_rng(6).integers(0, 1000, 20).astype(np.int32)
    np.save(sys.argv[3], s.forward(follow, s.n_tokens, all_logits=True))
""")


def test_restore_in_a_fresh_process_continues_bit_identically(model_path, tmp_path):
    path = model_path("qwen35moe-f32")
    s = session(model_of(path), POOL, n_batch=100)
    s.forward(tokens(850), 0)
    s.save(tmp_path / "s.kvf")
    r = subprocess.run([sys.executable, "-c", _RESTORE_AND_CONTINUE, path, str(tmp_path / "s.kvf"),
                        str(tmp_path / "out.npy")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    follow = np.random.default_rng(6).integers(0, 1000, 20).astype(np.int32)
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), s.forward(follow, 850, all_logits=True))


# ---- bad files -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,missing", [("tiny-qwen35", "blk.0.ssm_conv1d.weight"), ("tiny-qwen35", "blk.2.ssm_a"),
                                           ("tiny-qwen35", "blk.1.attn_q_norm.weight"),
                                           ("tiny-qwen35moe", "blk.1.ffn_gate_inp_shexp.weight"),
                                           ("tiny-qwen3moe", "blk.0.ffn_down_exps.weight")])
def test_missing_tensor_is_named(tmp_path, shape, missing):
    p = rg.write_preset(tmp_path / "m.gguf", shape, omit_tensors=[missing])
    with pytest.raises(RuntimeError, match=f"GGUF is missing the tensor {missing}"):
        model_of(str(p))


@pytest.mark.parametrize("key,value,message", [
    ("qwen35.ssm.inner_size", 100, "qwen35.ssm.inner_size=100 must equal ssm.state_size x ssm.time_step_rank"),
    ("qwen35.ssm.time_step_rank", 3, "ssm.inner_size=.* must equal"),
    ("qwen35.ssm.group_count", 3, "must be a multiple of ssm.group_count=3"),
    ("qwen35.full_attention_interval", 5, "leaves no full-attention layer"),
    ("qwen35.ssm.conv_kernel", 1, "qwen35.ssm.conv_kernel"),
    ("qwen35.ssm.conv_kernel", 3, r"tensor blk.0.ssm_conv1d.weight has shape \[4, 256\], expected \[3, 256\]"),
    ("qwen35.ssm.state_size", 16, "ssm.inner_size=128 must equal ssm.state_size x ssm.time_step_rank = 16 x 4"),
])
def test_inconsistent_hyperparameters_are_named(model_path, tmp_path, key, value, message):
    import re
    import shutil

    import gguf

    dst = tmp_path / "bad.gguf"
    shutil.copy(model_path("qwen35-f32"), dst)
    r = gguf.GGUFReader(dst, "r+")
    field = r.fields[key]
    field.parts[field.data[0]][0] = value
    del r
    with pytest.raises(RuntimeError) as e:
        model_of(str(dst))
    assert re.search(message, str(e.value)), str(e.value)
