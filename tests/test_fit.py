"""pool_tokens="auto" sizing (kvflash_ggml.fit): the measured per-session costs, and the arithmetic that turns
free device memory into a pool per session. The measurement runs on the CPU backend here (the same graphs);
the GPU run is in docs/RESULTS.md."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kvflash_ggml import _core
from kvflash_ggml.engine_parts import make_session
from kvflash_ggml.fit import GPU_POOL_ALIGN, MIN_HEADROOM, SlotCosts, fit_pool_tokens, measure, solve
from kvflash_ggml.options import PoolConfig
from kvflash_ggml.tokens import forward_in_steps

C = _core.CHUNK_TOKENS
MIB = 1 << 20
COSTS = SlotCosts(kv_per_token=128 * 1024, compute_per_token=100, compute_fixed=13 * MIB, state=0,
                  layer_per_token=4096, compute_max=20 * MIB, exact_step=1024,
                  n_batch=512)


def need(costs: SlotCosts, pool: int, n_slots: int, n_ctx: int) -> float:
    """Bytes n_slots sessions of `pool` tokens, one exact prefill and the headroom take (total memory small)."""
    return n_slots * (pool * (costs.kv_per_token + costs.compute_per_token) + costs.compute_fixed + costs.state) + \
        n_ctx * costs.layer_per_token + _core.ATTENTION_BLOCK_BYTES + costs.compute_max * 2 + MIN_HEADROOM


def gpu_aligned(pool: int, min_pool: int = 448) -> int:
    """The pool a GPU fit keeps of `pool` fitting tokens: a multiple of GPU_POOL_ALIGN where that stays >= min_pool."""
    aligned = pool // GPU_POOL_ALIGN * GPU_POOL_ALIGN
    return aligned if aligned >= min_pool else pool


def test_solve_takes_the_largest_pool_that_fits():
    for pool in (448, 4096, 71424):
        exact = need(COSTS, pool, 8, 131072)
        fits = solve(COSTS, free=math.ceil(exact) + 1, total=0, n_slots=8, n_ctx=131072, min_pool=448)
        assert fits.pool_tokens == pool
        if pool > 448:
            short = solve(COSTS, free=math.floor(exact) - 1, total=0, n_slots=8, n_ctx=131072, min_pool=448)
            assert short.pool_tokens == gpu_aligned(pool - C) == pool - GPU_POOL_ALIGN


def test_a_gpu_pool_is_a_multiple_of_256_where_it_can_be():
    # ggml-cuda's grouped-query flash attention needs n_kv % 256 == 0, and a full pool's n_kv is the pool.
    for tokens in (448 + C, 4096 + 3 * C, 71488):
        fits = solve(COSTS, free=math.ceil(need(COSTS, tokens, 8, 131072)) + 1, total=0, n_slots=8, n_ctx=131072,
                     min_pool=448)
        assert fits.pool_tokens == gpu_aligned(tokens) and fits.pool_tokens % C == 0
    assert gpu_aligned(448 + C) == 448 + C   # 256 would be below the pager's minimum: chunks, as before
    whole = solve(COSTS, free=1 << 40, total=1 << 40, n_slots=8, n_ctx=32768 + 192, min_pool=448)
    assert whole.pool_tokens == 33024 and "whole context" in whole.reason


def test_solve_stops_at_the_whole_context_and_refuses_below_the_minimum():
    big = 1 << 40
    fit = solve(COSTS, free=big, total=big, n_slots=4, n_ctx=5000, min_pool=448)
    assert fit.pool_tokens == 5120 and "whole context" in fit.reason   # n_ctx rounded up to 256 (a GPU's)
    small = math.floor(need(COSTS, 448, 8, 32768)) - 1
    with pytest.raises(ValueError, match="8 session"):
        solve(COSTS, free=small, total=0, n_slots=8, n_ctx=32768, min_pool=448)


def test_solve_counts_a_draft_models_session_beside_each():
    # Speculative decoding with a draft model: every slot holds a draft session of the same pool too.
    draft = dataclasses.replace(COSTS, kv_per_token=32 * 1024, compute_fixed=5 * MIB, layer_per_token=1024)
    pool, n_slots, n_ctx = 4096, 8, 131072
    exact = need(COSTS, pool, n_slots, n_ctx) + \
        n_slots * (pool * (draft.kv_per_token + draft.compute_per_token) + draft.compute_fixed + draft.state)
    fits = solve(COSTS, free=math.ceil(exact) + 1, total=0, n_slots=n_slots, n_ctx=n_ctx, min_pool=448, draft=draft)
    assert fits.pool_tokens == pool and "draft model" in fits.reason
    short = solve(COSTS, free=math.floor(exact) - 1, total=0, n_slots=n_slots, n_ctx=n_ctx, min_pool=448, draft=draft)
    assert short.pool_tokens == pool - GPU_POOL_ALIGN
    alone = solve(COSTS, free=math.ceil(exact) + 1, total=0, n_slots=n_slots, n_ctx=n_ctx, min_pool=448)
    assert alone.pool_tokens > pool   # without the draft the same memory holds a larger pool


@pytest.mark.slow
def test_measured_costs_cover_a_real_session(smollm2):
    """The linear model (fixed + per pool token, probed at the largest step) does not underestimate sessions
    of other pools, each after a prompt that fills it in its own steps (smaller pools take smaller steps)."""
    costs = measure(smollm2, PoolConfig(n_ctx=8192, pool_tokens="auto"))
    for pool_tokens in (512, 2048, 4096):
        s = make_session(smollm2, PoolConfig(n_ctx=8192, pool_tokens=pool_tokens))
        assert costs.kv_per_token == s.kv.chunk_bytes / C
        forward_in_steps(s, np.zeros(pool_tokens + 2 * C, dtype=np.int32), 0)
        mem = s.memory()
        predicted = pool_tokens * (costs.kv_per_token + costs.compute_per_token) + costs.compute_fixed + costs.state
        assert mem["pool_bytes"] + mem["compute_bytes"] <= predicted, (pool_tokens, mem, dataclasses.asdict(costs))


def test_solve_counts_the_slots_batched_steps():
    # Several slots: the server's batched decoder holds its own compute buffers beside the sessions' (once; the
    # MTP head's shared draft step, one row a slot; each slot's lane inputs).
    batched = dataclasses.replace(COSTS, batch_fixed=40 * MIB, batch_per_token=300, batch_draft_per_slot=2 * MIB,
                                  batch_lane_fixed=0.5 * MIB, batch_lane_per_token=20)
    pool, n_ctx = 4096, 131072
    exact = need(COSTS, pool, 8, n_ctx) + batched.batch_fixed + pool * batched.batch_per_token + \
        8 * (batched.batch_draft_per_slot + batched.batch_lane_fixed + pool * batched.batch_lane_per_token)
    fits = solve(batched, free=math.ceil(exact) + 1, total=0, n_slots=8, n_ctx=n_ctx, min_pool=448)
    assert fits.pool_tokens == pool and "batched steps" in fits.reason
    short = solve(batched, free=math.floor(exact) - 1, total=0, n_slots=8, n_ctx=n_ctx, min_pool=448)
    assert short.pool_tokens == pool - GPU_POOL_ALIGN
    one = need(COSTS, pool, 1, n_ctx)   # one session (a Model) never batches
    alone = solve(batched, free=math.ceil(one) + 1, total=0, n_slots=1, n_ctx=n_ctx, min_pool=448)
    assert alone.pool_tokens == pool and "batched" not in alone.reason


def test_measured_batched_step_covers_a_servers_largest_step(tiny_models):
    """The batched step's buffer, measured from the probe sessions' steps of 1 and 32 rows, is not below what a
    batched step of the most rows (4 slots x 32) over full pools of other sizes takes, their pools their own or
    lanes of one arena (a server's)."""
    model = tiny_models("llama", n_ctx_train=8192)
    costs = measure(model, PoolConfig(n_ctx=8192, pool_tokens="auto"))
    rows = _core.BatchDecoder.max_session_rows
    n_slots = _core.BatchDecoder.max_step_rows // rows   # 4 sessions of 32 rows
    for pool_tokens, arena in [(512, None), (4096, None), (4096, _core.PoolArena(4))]:
        sessions = [make_session(model, PoolConfig(n_ctx=8192, pool_tokens=pool_tokens), arena=arena)
                    for _ in range(n_slots)]
        for s in sessions:
            forward_in_steps(s, np.zeros(pool_tokens + C, dtype=np.int32), 0)
        decoder = _core.BatchDecoder(model)
        decoder.step_rows(sessions, [[0] * rows] * n_slots)
        predicted = costs.batch_fixed + pool_tokens * costs.batch_per_token + \
            n_slots * (costs.batch_lane_fixed + pool_tokens * costs.batch_lane_per_token)
        assert 0 < decoder.compute_bytes <= predicted, (pool_tokens, decoder.compute_bytes, dataclasses.asdict(costs))
    # each device's share (one device here: the CPU) sums to the whole; a device the model lacks is an error
    assert sum(decoder.device_compute_bytes(d) for d in range(len(model.devices))) == decoder.compute_bytes
    with pytest.raises(IndexError, match="device 1 of a model on 1 device"):
        decoder.device_compute_bytes(1)


def test_measured_batched_draft_step_covers_the_heads_shared_steps(tmp_path):
    """Slots drafting with the MTP head share its draft steps (a second graph of the batched decoder, one row a
    slot): the per-slot figure the probes measure covers 4 slots' shared draft step over their pools."""
    from kvflash_ggml.testing import random_gguf as rg
    path = rg.write_preset(tmp_path / "mtp.gguf", "tiny-qwen35", mtp=True, n_ctx_train=8192)
    model = _core.Model(str(path), backend="cpu", n_threads=1, mtp=True)
    costs = measure(model, PoolConfig(n_ctx=8192, pool_tokens="auto"), mtp=True)
    assert costs.batch_draft_per_slot > 0
    sessions = [make_session(model, PoolConfig(n_ctx=8192, pool_tokens=1024), mtp=True) for _ in range(4)]
    for s in sessions:
        forward_in_steps(s, np.zeros(1024 + C, dtype=np.int32), 0)
    decoder = _core.BatchDecoder(model)
    decoder.step(sessions, [0] * 4)
    steps = decoder.compute_bytes
    decoder.mtp_draft(sessions, [0] * 4, 0)
    assert 0 < decoder.compute_bytes - steps <= 4 * costs.batch_draft_per_slot


def test_cpu_backend_keeps_the_engine_rule(smollm2):
    fit = fit_pool_tokens(smollm2, PoolConfig(n_ctx=16384, pool_tokens="auto"), 4)
    assert fit.pool_tokens == 4096 and "CPU" in fit.reason


def test_a_cuda_pool_off_the_256_grid_is_warned_about():
    from kvflash_ggml.engine_parts import pool_alignment_warning
    warning = pool_alignment_warning("CUDA0", True, 4160)
    assert "4160" in warning and "4352" in warning
    assert pool_alignment_warning("CUDA0", True, 4096) is None    # on the grid
    assert pool_alignment_warning("CUDA0", False, 4160) is None   # mul_mat attention
    assert pool_alignment_warning("CPU", True, 4160) is None
