"""laguna (Poolside's Laguna): sliding-window layers beside global ones, sigmoid-routed experts, gated attention.

What this family adds over gemma3's rings and qwen3moe's experts: per-layer query head counts (its local layers
have more), YaRN over part of the head on the global layers and plain RoPE over all of it on the local ones, a
per-expert selection bias, an ungated shared expert, leading dense layers, and a softplus gate on the attention
output, per head or per element. References: libllama's llama_decode on the same GGUF (tiny random models), and
our own full cache for the pooled paths. Exact prefill is covered with every family in test_exact_prefill.py.
"""
from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
from kvflash_ggml import _core
from kvflash_ggml.testing import random_gguf as rg
from greedy_check import (assert_full_cache_matches_libllama, cpu_model as model_of, generate_with_live_eviction,
                          preset_paths, random_tokens as tokens, run_fed as run, session_of)

N_PROMPT, N_DECODE = 300, 24     # three windows of 96: every ring wraps
MAX_TOKENS = 1024
POOL = 448
# Same kernels, same order: bit-identical (measured 0.0 on every variant, rings wrapping included).
TOL_SAME_KERNELS = 1e-5
# Rings of another size hold their keys in another order, so attention sums them in another order (as in
# test_sliding_window.py): float reassociation on the mul_mat path, F16 accumulation of V on the CPU's flash path.
TOL_RING_ORDER = {"matmul": 2e-4, "flash": 5e-3}

VARIANTS = {
    # XS.2's layout: global layers 0 and 2 (YaRN over 16 of 32 dims, 4 heads), local 1 and 3 (8 heads);
    # layer 0 dense with a per-element gate, the others experts with per-head gates
    "xs-f32": dict(weight_type="f32"),
    "xs-q8_0": dict(weight_type="q8_0"),
    # M.1's layout: no window (every layer global, one head count), per-element gates, three dense layers,
    # plain RoPE over the whole head
    "m-f32": dict(weight_type="f32", n_swa=0, swa_pattern=None, n_head_swa=0, n_rot=32, n_rot_swa=None,
                  rope_freq_base_swa=None, gate_per_element=(True,) * 4, n_layer_dense_lead=3,
                  rope_scaling_type="linear", rope_scaling_factor=None, rope_orig_ctx=None),
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return preset_paths(tmp_path_factory, "tiny-laguna", VARIANTS)


def session(model, pool: int = 0, **kw) -> _core.Session:
    return session_of(model, MAX_TOKENS, pool, **kw)


# ---- equivalence with libllama ----------------------------------------------------------------------

def test_hparams_name_heads_windows_and_experts(model_path):
    hp = model_of(model_path()).hparams
    assert hp.arch == "laguna" and list(hp.n_head_layers) == [4, 8, 4, 8] and hp.n_head == 4
    assert list(hp.swa_layers) == [0, 1, 0, 1] and hp.n_swa == 96 and hp.n_pooled_layers == 2
    assert hp.n_expert == 4 and hp.n_expert_used == 2 and hp.n_ff_exp == 64 and hp.n_ff_shexp == 96
    m = model_of(model_path("m-f32")).hparams
    assert list(m.n_head_layers) == [4] * 4 and not any(m.swa_layers) and m.n_pooled_layers == 4


@pytest.mark.parametrize("attention", ["matmul", "flash"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_cache_matches_libllama(model_path, variant, attention):
    assert_full_cache_matches_libllama(model_path(variant), attention, MAX_TOKENS, N_PROMPT, N_DECODE, TOL_SAME_KERNELS)


def test_the_layout_options_change_the_logits(model_path, tmp_path):
    """Each option the graph reads moves the logits, so matching libllama above is not matching a no-op."""
    prompt = tokens(N_PROMPT)
    base = session(model_of(model_path())).forward(prompt, 0)
    for name, kw in {"no yarn": dict(rope_scaling_type="linear"), "gates per element": dict(gate_per_element=(True,) * 4),
                     "no selection scale": dict(expert_weights_scale=1.0), "all dense": dict(n_layer_dense_lead=4)}.items():
        other = model_of(str(rg.write_preset(tmp_path / f"{len(name)}.gguf", "tiny-laguna", weight_type="f32", **kw)))
        assert float(np.abs(session(other).forward(prompt, 0) - base).max()) > 1e-3, name


# ---- the pool ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["matmul", "flash"])
def test_pooled_with_room_for_the_context_equals_full_cache(model_path, attention):
    model = model_of(model_path())
    fed = tokens(N_DECODE, seed=9).tolist()
    full = run(session(model, 0, attention=attention), tokens(N_PROMPT), fed)
    same = run(session(model, 512, attention=attention), tokens(N_PROMPT), fed)
    assert float(np.abs(same - full).max()) <= TOL_SAME_KERNELS
    # steps of 100: rings of 256 rows that wrap, so the keys sit out of position order
    wrapped = run(session(model, 512, attention=attention, n_batch=100), tokens(N_PROMPT), fed)
    assert float(np.abs(wrapped - full).max()) <= TOL_RING_ORDER[attention]


def test_only_global_layers_are_pooled_and_local_ones_keep_rings(model_path):
    model = model_of(model_path())
    hp = model.hparams
    row = hp.n_head_kv * hp.head_dim_k * 2   # f16 K row = V row: the same on both kinds of layer
    s = session(model, POOL, n_batch=128)
    mem = s.memory()
    assert s.ring_tokens == 256   # 96 + 128, rounded up to the CPU mul_mat path's 64
    assert mem["ring_bytes"] == 2 * s.ring_tokens * 2 * row   # local layers 1 and 3, K and V
    assert mem["pool_bytes"] == 2 * POOL * 2 * row            # global layers 0 and 2
    s.forward(tokens(900), 0)
    assert s.memory()["ring_bytes"] == mem["ring_bytes"] and s.pager.stats().page_outs > 0


@pytest.mark.parametrize("policy", ["lru", "qk", "quest", "drafter"])
def test_engine_generates_with_live_eviction(model_path, policy):
    st = generate_with_live_eviction(model_path(), policy, MAX_TOKENS, POOL)
    assert st["device_ring_bytes"] > 0 and st["device_peak_bytes"] >= st["device_kv_bytes"] + st["device_ring_bytes"]


def test_snapshot_restores_and_continues_exactly(model_path):
    model = model_of(model_path())
    s = session(model, POOL, n_batch=100)
    s.forward(tokens(900), 0)
    r = _core.Session.from_bytes(model, s.to_bytes())
    follow = tokens(20, seed=6)
    np.testing.assert_array_equal(r.forward(follow, 900, all_logits=True), s.forward(follow, 900, all_logits=True))


# ---- bad files ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("missing", ["blk.1.exp_probs_b.bias", "blk.1.attn_gate.weight", "blk.2.ffn_up_shexp.weight",
                                     "blk.0.ffn_down.weight"])
def test_missing_tensor_is_named(tmp_path, missing):
    p = rg.write_preset(tmp_path / "m.gguf", "tiny-laguna", omit_tensors=[missing])
    with pytest.raises(RuntimeError, match=f"GGUF is missing the tensor {missing}"):
        model_of(str(p))


def test_global_layers_with_different_head_counts_are_refused(model_path, tmp_path):
    """The scorers read one block of queries per global layer: their head counts must agree."""
    dst = tmp_path / "heads.gguf"
    shutil.copy(model_path(), dst)
    r = gguf.GGUFReader(dst, "r+")
    field = r.fields["laguna.attention.head_count"]
    field.parts[field.data[2]][0] = 8   # global layer 2 gets the local layers' count
    del r
    with pytest.raises(RuntimeError, match="head_count differs between global layers 0 and 2"):
        model_of(str(dst))


def test_writer_rejects_what_laguna_cannot_be(tmp_path):
    with pytest.raises(ValueError, match="laguna needs a shared expert"):
        rg.write_preset(tmp_path / "a.gguf", "tiny-laguna", n_ff_shexp=0)
    with pytest.raises(ValueError, match="n_head_swa=6 must be a multiple of n_head_kv=4"):
        rg.write_preset(tmp_path / "b.gguf", "tiny-laguna", n_head=4, n_head_kv=4, n_head_swa=6)
    with pytest.raises(ValueError, match="are laguna options, not qwen3moe's"):
        rg.write_preset(tmp_path / "c.gguf", "tiny-qwen3moe", n_layer_dense_lead=1)
    with pytest.raises(ValueError, match="gate_per_element has 2 flags for 4 layers"):
        rg.write_preset(tmp_path / "d.gguf", "tiny-laguna", gate_per_element=(True, False))
