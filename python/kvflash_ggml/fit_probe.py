"""What one session costs on the devices, measured for pool_tokens="auto" and max_device_bytes (fit.py solves).

Measured, not guessed: two probe sessions (pools of two and four steps) each run a pool-filling prompt in steps
of the largest size a pool takes (n_batch), and their compute buffers give a session's cost as fixed +
per-pool-token bytes. A pool's compute buffer grows with its keys times its step (the mask, and without flash
attention the attention matrix), and smaller pools take smaller steps (PoolConfig.prefill_batch), so probing
at the largest step bounds every pool's buffer from above. The same probes give each device's share on a model
split across devices (Session.memory()["devices"]): its layers' K/V, rings and state, and its compute buffers.
Drafting with the model's own multi-token-prediction head (mtp) puts one more layer in every pool: the probes
run the head too."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from . import _core
from .engine_parts import make_session
from .options import PoolConfig
from .tokens import forward_in_steps


@dataclasses.dataclass(frozen=True)
class SlotCosts:
    """What one session costs on a device (or on all of a model's devices together), measured by the probes:
    bytes per pool token (K/V, and the compute buffer's growth with the pool), fixed bytes (compute buffer,
    sliding-window rings, linear-attention state: `state`), and one layer's K/V per prompt token (the exact
    prefill's staging pool: on each device that holds pooled layers, 0 on the others)."""
    kv_per_token: float
    compute_per_token: float
    compute_fixed: float
    state: float   # sliding-window rings and linear-attention state: fixed per session
    layer_per_token: float
    compute_max: float        # the larger probe's compute buffer (beside the exact prefill's staging)
    exact_step: int           # tokens per step of the exact prefill
    n_batch: int              # the probes' step
    # a server's batched step of the most rows it takes (one buffer for all its slots): fixed + per pool token
    batch_fixed: float = 0.0
    batch_per_token: float = 0.0
    # and what each slot's lane adds to it besides its rows (its own small inputs): fixed + per pool token, per slot
    batch_lane_fixed: float = 0.0
    batch_lane_per_token: float = 0.0
    batch_draft_per_slot: float = 0.0   # the MTP head's batched draft step (BatchDecoder.mtp_draft), per slot


def _probe(model: _core.Model, pool: PoolConfig, pool_tokens: int, mtp: bool = False) -> dict:
    n = pool_tokens + _core.CHUNK_TOKENS   # past the pool: paging runs too
    room = n + 2 + 2 * (1 + _core.BatchDecoder.max_session_rows)   # the batched steps' rows: alone, then in pairs
    config = dataclasses.replace(pool, pool_tokens=pool_tokens, n_ctx=max(pool.n_ctx, room))
    session = make_session(model, config, n_batch=pool.n_batch, mtp=mtp)
    tokens = np.zeros(n, dtype=np.int32)
    forward_in_steps(session, tokens, 0)
    mem = session.memory()

    def twin() -> _core.Session:   # a second session holding the prompt: another lane of a batched step
        other = make_session(model, config, n_batch=pool.n_batch, mtp=mtp)
        if mem["ring_bytes"] + mem["recurrent_bytes"]:   # adopt copies pooled chunks only
            forward_in_steps(other, tokens, 0)
        else:
            other.adopt(session, n)
        return other

    return {"compute": mem["compute_bytes"], "state": mem["ring_bytes"] + mem["recurrent_bytes"],
            "pool": mem["pool_bytes"], "devices": mem["devices"],
            "kv_per_token": session.kv.chunk_bytes / _core.CHUNK_TOKENS,
            "layer_per_token": session.kv.layer_chunk_bytes / _core.CHUNK_TOKENS, "flash": session.flash_attn,
            **_batched_step_bytes(model, session, twin)}


def _batched_step_bytes(model: _core.Model, session: _core.Session, make_twin: Callable[[], _core.Session]) -> dict:
    """The compute buffers of a server's batched steps, on each of the model's devices: "batch_step", a step of the
    most rows one takes (BatchDecoder.max_step_rows, its slots' decode and verify rows together), from two steps of
    this session alone (1 and max_session_rows rows); "batch_draft", the MTP head's draft step of one slot (its graph
    is a second one, whose rows are the slots). The step's buffer grows with its rows, hardly with the number of
    sessions (measured on the CPU, SmolLM2, pool 2048: 38.2 MiB for 4 x 32 rows, 19.1 for 2 x 32, 9.5 for 1 x 32 and
    for 4 x 8), so the two steps' line gives it; a little above on the CPU (the one-row step's fixed part counted
    once; its growth with the pool belongs to one session's rows at a time, the line scales it to all: SmolLM2 at
    pool 4096, 4 x 32 rows: 40.6 MB taken, 40.9 counted). "batch_lane": what each further session's lane adds besides
    its rows (its own small inputs), from steps of this session beside a twin holding its tokens, one row each and
    the most rows each (the larger): on the H100 the tiny llama's 4 x 32-row step took 1,140 bytes more than the
    line (R124), which counts one session's, and still 645 more with the one-row lane alone (R126).
    0 for a session a batched step refuses (its slots would step alone)."""
    decoder = _core.BatchDecoder(model)
    devices = range(len(model.devices))
    if decoder.ineligible(session) is not None:
        return {key: [0.0 for _ in devices] for key in ("batch_step", "batch_draft", "batch_lane")}
    rows = _core.BatchDecoder.max_session_rows
    sizes = []
    for n in (1, rows):
        decoder.step_rows([session], [[0] * n])
        sizes.append([decoder.device_compute_bytes(d) for d in devices])
    per_row = [(many - one) / (rows - 1) for one, many in zip(*sizes)]
    steps = [one + row * (_core.BatchDecoder.max_step_rows - 1) for one, row in zip(sizes[0], per_row)]
    drafts = [0.0 for _ in devices]
    if session.mtp:
        decoder.mtp_draft([session], [0], 0)
        drafts = [decoder.device_compute_bytes(d) - before for d, before in zip(devices, sizes[1])]
    twin, pair = make_twin(), _core.BatchDecoder(model)
    lanes = [0.0 for _ in devices]
    for n, alone in ((1, sizes[0]), (rows, sizes[1])):
        pair.step_rows([session, twin], [[0] * n, [0] * n])
        lanes = [max(lane, pair.device_compute_bytes(d) - size - n * row)
                 for d, lane, size, row in zip(devices, lanes, alone, per_row)]
    return {"batch_step": steps, "batch_draft": drafts, "batch_lane": lanes}


def _probes(model: _core.Model, pool: PoolConfig, mtp: bool) -> tuple[int, dict, dict]:
    C = _core.CHUNK_TOKENS
    lo = max(pool._pager_config(0).min_pool_tokens(), -(-2 * pool.n_batch // C) * C)
    return lo, _probe(model, pool, lo, mtp), _probe(model, pool, 2 * lo, mtp)


def _costs(pool: PoolConfig, lo: int, small: dict, large: dict, kv_per_token: float, layer_per_token: float,
           state: float, device: Optional[int] = None) -> SlotCosts:
    """device: one device's share of the batched steps (its index), None: all devices'."""
    per_token = max(0.0, (large["compute"] - small["compute"]) / lo)
    pick = (lambda figures: figures[device]) if device is not None else sum
    small_step, large_step = pick(small["batch_step"]), pick(large["batch_step"])
    batch_per_token = max(0.0, (large_step - small_step) / lo)
    small_lane, large_lane = pick(small["batch_lane"]), pick(large["batch_lane"])
    lane_per_token = max(0.0, (large_lane - small_lane) / lo)
    return SlotCosts(kv_per_token=kv_per_token, compute_per_token=per_token,
                     compute_fixed=max(0.0, small["compute"] - per_token * lo), state=state,
                     layer_per_token=layer_per_token, compute_max=large["compute"],
                     exact_step=pool.exact_prefill_batch(small["flash"]), n_batch=pool.n_batch,
                     batch_fixed=max(0.0, small_step - batch_per_token * lo), batch_per_token=batch_per_token,
                     batch_lane_fixed=max(0.0, small_lane - lane_per_token * lo), batch_lane_per_token=lane_per_token,
                     batch_draft_per_slot=max(pick(small["batch_draft"]), pick(large["batch_draft"])))


def measure(model: _core.Model, pool: PoolConfig, mtp: bool = False) -> SlotCosts:
    """One session's costs on all of the model's devices together."""
    lo, small, large = _probes(model, pool, mtp)
    return _costs(pool, lo, small, large, small["kv_per_token"], small["layer_per_token"], small["state"])


def measure_devices(model: _core.Model, pool: PoolConfig, mtp: bool = False) -> dict[str, SlotCosts]:
    """One session's costs per device of the model's split, by the device's backend name (a device that holds
    no part of a session is left out). A device's share of the pool is its layers' share of the pool's bytes; the
    exact prefill stages one layer's K/V of the prompt on each device that holds pooled layers (session_prefill.cpp)."""
    lo, small, large = _probes(model, pool, mtp)
    out = {}
    for d, (d_small, d_large) in enumerate(zip(small["devices"], large["devices"])):
        if not (d_small["pool_bytes"] or d_large["compute_bytes"] or d_small["weight_bytes"]):
            continue
        share = d_small["pool_bytes"] / small["pool"] if small["pool"] else 0.0
        out[d_small["name"]] = _costs(
            pool, lo, dict(small, compute=d_small["compute_bytes"]), dict(large, compute=d_large["compute_bytes"]),
            small["kv_per_token"] * share, small["layer_per_token"] if d_small["pool_bytes"] else 0.0,
            d_small["ring_bytes"] + d_small["recurrent_bytes"], device=d)
    return out
