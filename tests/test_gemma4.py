"""gemma4 (Google Gemma 4, text): sliding-window and global layers with head sizes of their own, shared K/V,
per-layer embeddings, experts beside the dense FFN.

What this family adds over gemma3: the local layers' ring rows are narrower than the global layers' pool rows;
the global layers' RoPE has proportional-RoPE factors (rope_freqs) and the local layers' their own base and dims;
V is RMS-normed; FFN widths differ per layer; per-layer token embeddings (PLE) enter every layer; optional routed
experts beside the dense FFN; a per-layer output scale; and the last layers may keep no K/V of their own, attending
an earlier layer's instead. References: libllama's llama_decode on the same GGUF (tiny random models), and our own
full cache for the pooled paths. Exact (layer-major) prefill is covered with every family in test_exact_prefill.py,
shared K/V included; the Engine's default prefill with shared K/V below.
"""
from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
from kvflash_ggml import _core
from kvflash_ggml.testing import random_gguf as rg
from greedy_check import (assert_full_cache_matches_libllama, cpu_model as model_of, full_cache_against_libllama,
                          generate_with_live_eviction, preset_paths, random_tokens as tokens, run_fed as run,
                          session_of)

N_PROMPT, N_DECODE = 300, 24     # three windows of 96: every ring wraps
MAX_TOKENS = 1024
POOL = 448
# Same kernels, same order: bit-identical (measured 0.0 on every variant, rings wrapping included).
TOL_SAME_KERNELS = 1e-5

SHARED = dict(n_shared_kv=3)                                  # local 3, 4 attend layer 1's K/V, global 5 layer 2's
MOE = dict(n_expert=4, n_expert_used=2, n_ff_exp=64)          # every layer: experts beside the dense FFN
VARIANTS = {
    "f32": dict(weight_type="f32"),
    "q8_0": dict(weight_type="q8_0"),
    "shared-f32": dict(weight_type="f32", **SHARED),
    "shared-q8_0": dict(weight_type="q8_0", **SHARED),
    "moe-f32": dict(weight_type="f32", **MOE),
    "moe-shared-q8_0": dict(weight_type="q8_0", **MOE, **SHARED),
    # separate gate and up experts, each with per-expert scales (libllama's other expert layout)
    "moe-split-f32": dict(weight_type="f32", **MOE, split_experts=True),
    # layer 2 (global) and 3 (local) without attn_v: V is K's projection, normed without a weight
    "k-as-v-q8_0": dict(weight_type="q8_0", omit_tensors=["blk.2.attn_v.weight", "blk.3.attn_v.weight"]),
    "no-ple-f32": dict(weight_type="f32", n_embd_per_layer=0),
    "no-ple-shared-q8_0": dict(weight_type="q8_0", n_embd_per_layer=0, **SHARED),
    # the global layers rotate 32 of their 64 dims (rope_freqs still has 32 factors: libllama reads the first 16)
    "partial-rope-f32": dict(weight_type="f32", n_rot=32),
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return preset_paths(tmp_path_factory, "tiny-gemma4", VARIANTS)


def session(model, pool: int = 0, **kw) -> _core.Session:
    return session_of(model, MAX_TOKENS, pool, **kw)


# ---- equivalence with libllama ----------------------------------------------------------------------

def test_hparams_name_head_sizes_windows_sharing_and_ple(model_path):
    hp = model_of(model_path()).hparams
    assert hp.arch == "gemma4" and list(hp.swa_layers) == [1, 1, 0, 1, 1, 0] and hp.n_swa == 96
    assert (hp.head_dim_k, hp.head_dim_v, hp.head_dim_k_swa, hp.head_dim_v_swa) == (64, 64, 32, 32)
    assert list(hp.n_ff_layers) == [128, 96, 128, 160, 128, 96] and hp.n_embd_per_layer == 32
    assert hp.n_layer_kv == -1 and hp.n_pooled_layers == 2 and hp.logit_softcap == 30.0 and hp.n_expert == 0
    shared = model_of(model_path("shared-f32")).hparams
    assert shared.n_layer_kv == 3 and shared.n_pooled_layers == 1   # global layer 5 reads layer 2's
    moe = model_of(model_path("moe-f32")).hparams
    assert (moe.n_expert, moe.n_expert_used, moe.n_ff_exp, moe.n_ff_shexp) == (4, 2, 64, 0)


@pytest.mark.parametrize("attention", ["matmul", "flash"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_cache_matches_libllama(model_path, variant, attention):
    assert_full_cache_matches_libllama(model_path(variant), attention, MAX_TOKENS, N_PROMPT, N_DECODE, TOL_SAME_KERNELS)


def _edit(src: str, dst, name: str, values) -> str:
    """A copy of src with tensor `name`'s F32 values replaced in place (every other byte the same)."""
    shutil.copy(src, dst)
    r = gguf.GGUFReader(dst, "r+")
    t = next(t for t in r.tensors if t.name == name)
    t.data[...] = values
    del r
    return str(dst)


@pytest.mark.parametrize("variant,name,values", [
    ("moe-f32", "rope_freqs.weight", 1.0), ("moe-f32", "blk.1.layer_output_scale.weight", 3.0),
    ("moe-f32", "blk.2.ffn_down_exps.scale", 0.25), ("moe-f32", "blk.0.ffn_gate_inp.scale", 4.0),
    ("moe-f32", "per_layer_proj_norm.weight", 2.0), ("moe-split-f32", "blk.3.ffn_gate_exps.scale", 0.5),
    ("moe-split-f32", "blk.4.ffn_up_exps.scale", 2.0)])
def test_each_small_tensor_is_read_where_libllama_reads_it(model_path, tmp_path, variant, name, values):
    """Changing one factor (all other weights equal) moves our logits, and libllama's the same way: neither a no-op
    nor a tensor applied in the wrong place would pass."""
    base = model_path(variant)
    edited = _edit(base, tmp_path / "edited.gguf", name, values)
    prompt = tokens(N_PROMPT)
    before = session(model_of(base)).forward(prompt, 0)
    ours, ref, _ = full_cache_against_libllama(edited, "matmul", MAX_TOKENS, N_PROMPT, 4)
    assert float(np.abs(ours[N_PROMPT - 1] - before).max()) > 1e-3, "the edit changed nothing"
    assert float(np.abs(ours - ref).max()) <= TOL_SAME_KERNELS


# ---- the pool and the rings --------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["matmul", "flash"])
@pytest.mark.parametrize("variant", ["f32", "moe-shared-q8_0"])
def test_pooled_with_room_for_the_context_equals_full_cache(model_path, variant, attention):
    model = model_of(model_path(variant))
    fed = tokens(N_DECODE, seed=9).tolist()
    full = run(session(model, 0, attention=attention), tokens(N_PROMPT), fed)
    same = run(session(model, 512, attention=attention), tokens(N_PROMPT), fed)
    assert float(np.abs(same - full).max()) <= TOL_SAME_KERNELS


@pytest.mark.parametrize("variant,n_ring,n_pool", [("f32", 4, 2), ("shared-f32", 2, 1)])
def test_rings_hold_local_heads_and_only_layers_with_their_own_kv(model_path, variant, n_ring, n_pool):
    model = model_of(model_path(variant))
    hp = model.hparams
    local_row, global_row = hp.n_head_kv * 32 * 2, hp.n_head_kv * 64 * 2   # f16 K row = V row
    s = session(model, POOL, n_batch=128)
    mem = s.memory()
    assert s.ring_tokens == 256   # 96 + 128, rounded up to the CPU mul_mat path's 64
    assert mem["ring_bytes"] == n_ring * s.ring_tokens * 2 * local_row
    assert mem["pool_bytes"] == n_pool * POOL * 2 * global_row
    s.forward(tokens(900), 0)
    assert s.memory()["ring_bytes"] == mem["ring_bytes"] and s.pager.stats().page_outs > 0


@pytest.mark.parametrize("policy", ["lru", "qk", "quest", "drafter"])
def test_engine_generates_with_live_eviction(model_path, policy):
    assert generate_with_live_eviction(model_path(), policy, MAX_TOKENS, POOL)["device_ring_bytes"] > 0


@pytest.mark.parametrize("policy", ["lru", "qk"])
def test_engine_with_shared_kv_evicts_with_a_pooled_prefill(model_path, policy):
    generate_with_live_eviction(model_path("moe-shared-q8_0"), policy, MAX_TOKENS, POOL, prefill="pooled")


@pytest.mark.parametrize("variant", ["f32", "shared-q8_0"])
def test_snapshot_restores_and_continues_exactly(model_path, variant):
    model = model_of(model_path(variant))
    s = session(model, POOL, n_batch=100)
    s.forward(tokens(900), 0)
    r = _core.Session.from_bytes(model, s.to_bytes())
    follow = tokens(20, seed=6)
    np.testing.assert_array_equal(r.forward(follow, 900, all_logits=True), s.forward(follow, 900, all_logits=True))


@pytest.mark.parametrize("variant", ["shared-f32", "moe-shared-q8_0"])
def test_engine_default_prefill_with_shared_kv_starts_as_the_full_cache(model_path, variant):
    """prefill="exact" (the default) of a prompt larger than the pool, on a model whose last layers share K/V: the
    first token's distribution is the full cache's, byte for byte (steps of 64 in both, so rings of one size), and
    generation goes on in the pool, paging. The tokens after it are not compared: decode steps see the 7 resident
    chunks of 15, which on a random model moves logits by ~0.5 against margins of ~0.05."""
    from kvflash_ggml import Model

    prompt = tokens(900).tolist()
    kw = dict(model_path=model_path(variant), n_ctx=MAX_TOKENS, backend="cpu", n_threads=1, attention="matmul", n_batch=64)
    with Model(pool_tokens=POOL, **kw) as pooled, Model(pool_tokens=None, **kw) as full:
        made = [list(m.engine.generate(prompt, max_tokens=4, temperature=0.0, logprobs=5)) for m in (pooled, full)]
        st = pooled.stats()
    assert made[0][0].token == made[1][0].token and made[0][0].logprobs == made[1][0].logprobs
    assert sum(r.token is not None for r in made[0]) == 4
    assert st["page_outs"] > 0 and st["device_prefill_peak_bytes"] > 0   # it ran layer-major


# ---- bad files ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant,missing", [
    ("f32", "rope_freqs.weight"), ("f32", "per_layer_token_embd.weight"), ("f32", "blk.3.inp_gate.weight"),
    ("f32", "blk.1.post_ffw_norm.weight"), ("f32", "blk.0.attn_k_norm.weight"), ("moe-f32", "blk.2.pre_ffw_norm_2.weight"),
    ("moe-f32", "blk.0.ffn_gate_inp.scale"), ("moe-f32", "blk.4.ffn_down_exps.weight")])
def test_missing_tensor_is_named(tmp_path, variant, missing):
    p = rg.write_preset(tmp_path / "m.gguf", "tiny-gemma4", **VARIANTS[variant], omit_tensors=[missing])
    with pytest.raises(RuntimeError, match=f"GGUF is missing the tensor {missing}"):
        model_of(str(p))


def test_shared_layers_need_no_kv_tensors_of_their_own(tmp_path):
    p = rg.write_preset(tmp_path / "m.gguf", "tiny-gemma4", **SHARED,
                        omit_tensors=["blk.4.attn_k.weight", "blk.4.attn_k_norm.weight", "blk.5.attn_v.weight"])
    assert model_of(str(p)).hparams.n_layer_kv == 3


def test_inconsistent_files_are_refused(model_path, tmp_path):
    # a cut whose shared local layer would read a global layer's K/V (libllama's rule picks layer n_kv - 2)
    p = rg.write_preset(tmp_path / "cut.gguf", "tiny-gemma4", n_shared_kv=2)
    with pytest.raises(RuntimeError, match="layer 4 would share the K/V of layer 2, which is of the other attention kind"):
        model_of(str(p))
    # a local head size the local tensors do not have
    dst = tmp_path / "head.gguf"
    shutil.copy(model_path(), dst)
    r = gguf.GGUFReader(dst, "r+")
    r.fields["gemma4.attention.key_length_swa"].parts[-1][0] = 16
    r.fields["gemma4.attention.value_length_swa"].parts[-1][0] = 16
    r.fields["gemma4.rope.dimension_count_swa"].parts[-1][0] = 16
    del r
    with pytest.raises(RuntimeError, match=r"tensor blk.0.attn_q.weight has shape \[64, 128\], expected \[64, 64\]"):
        model_of(str(dst))
    # local layers rotating more than their head
    dst = tmp_path / "rot.gguf"
    shutil.copy(model_path(), dst)
    r = gguf.GGUFReader(dst, "r+")
    r.fields["gemma4.rope.dimension_count_swa"].parts[-1][0] = 48
    del r
    with pytest.raises(RuntimeError, match="rope.dimension_count_swa=48 exceeds the sliding-window head size 32"):
        model_of(str(dst))


def test_writer_rejects_what_gemma4_cannot_be(tmp_path):
    with pytest.raises(ValueError, match="gemma4 needs a sliding window"):
        rg.write_preset(tmp_path / "a.gguf", "tiny-gemma4", n_swa=0, swa_pattern=None)
    with pytest.raises(ValueError, match="n_ff_layers needs 6 positive widths"):
        rg.write_preset(tmp_path / "b.gguf", "tiny-gemma4", n_ff_layers=(128, 128))
    with pytest.raises(ValueError, match="are gemma4 options, not gemma3's"):
        rg.write_preset(tmp_path / "c.gguf", "tiny-gemma3", n_embd_per_layer=16)
    with pytest.raises(ValueError, match="n_shared_kv=5 must leave at least 2 layers"):
        rg.write_preset(tmp_path / "d.gguf", "tiny-gemma4", n_shared_kv=5)
