"""pool_tokens="auto" (--kvflash auto): the largest pool per session, for n_slots sessions (the server's slots; 1
for a Model), that every device's memory holds, as llama.cpp's --fit sizes a context; and max_device_bytes
(--max-device-memory): a cap on each device's whole footprint (weights + pools + rings and state + compute
buffers + the exact prefill's workspace + headroom), which sizes 'auto' and checks a pool given as a number.

A session's costs per device come from two probe sessions (fit_probe.py). On every device that limits the pool
(a GPU, an RPC device; the local CPU only under a budget) n_slots sessions' shares (their layers' K/V per pool
token, compute buffers fixed + per pool token, rings and state), the exact prefill's workspace (its staging
K/V on each device with pooled layers, a step's compute and attention block on each), the compute buffer of the
slots' batched steps (several slots: the server steps them together) and a headroom must fit the
device's free memory after the weights (under a budget: the budget less the weights there). The pool is the
smallest device's answer, at most the whole context; the reason names the device that limits it.
A speculative draft model gives every session a second pooled session of the same pool size (its own
costs on its own devices, measured the same way); its weights are loaded before the fit, so they are counted.
On the CPU backend without a budget the pool is the engine's own 'auto' (min(n_ctx, 4096)): host RAM is not
the limit a pool is for; with a budget, the budget sizes it up to that same rule."""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from . import _core
from .fit_probe import SlotCosts, measure, measure_devices
from .options import GPU_POOL_ALIGN, PoolConfig

__all__ = ["Fit", "SlotCosts", "measure", "measure_devices", "solve", "fit_pool_tokens", "resolve_pool"]
log = logging.getLogger(__name__)

HEADROOM_FRACTION = 0.05      # of the device's memory, left free for the backend's own allocations
MIN_HEADROOM = 512 << 20      # a GPU's (or RPC device's) CUDA context, cuBLAS workspace, allocator slack
GIB, MIB = float(1 << 30), float(1 << 20)


@dataclasses.dataclass(frozen=True)
class Fit:
    pool_tokens: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Room:
    """One device as the solver sees it: the bytes its sessions may take, the headroom left free of them, and
    where the first figure comes from (for the reason)."""
    name: str
    free: float
    headroom: float
    figures: str


def _exact_prefill_bytes(costs: SlotCosts, n_ctx: int) -> float:
    """One layer's K/V of a whole-context prompt (on each device with pooled layers; layer_per_token is 0 elsewhere),
    one attention block's mask and attention matrix (_core.ATTENTION_BLOCK_BYTES, whatever the context) and a
    step's compute buffer (probed at n_batch tokens, scaled to the exact step)."""
    return n_ctx * costs.layer_per_token + _core.ATTENTION_BLOCK_BYTES + \
        costs.compute_max * costs.exact_step / max(1, costs.n_batch)


def _session_figures(c: SlotCosts) -> str:
    return (f"{c.kv_per_token / 1024:.1f} KiB of K/V + {c.compute_per_token / 1024:.1f} KiB of compute per pool token, "
            f"{c.compute_fixed / MIB:.0f} MiB compute + {c.state / MIB:.0f} MiB rings and recurrent state fixed")


def _capacity(room: Room, main: Optional[SlotCosts], draft: Optional[SlotCosts], n_slots: int,
              n_ctx: int) -> tuple[int, str]:
    """The largest chunk-aligned pool per session whose n_slots sessions (and their draft sessions), one exact
    prefill of an n_ctx prompt and the headroom fit the room; and the figures behind it."""
    C = _core.CHUNK_TOKENS
    sessions = [c for c in (main, draft) if c is not None]
    # One exact prefill runs at a time (the server computes one prompt at once; a draft model follows it after).
    prefill = max(_exact_prefill_bytes(c, n_ctx) for c in sessions)
    # Several slots step together: a batched decoder of each model beside the sessions (server/scheduler.py).
    batched = [(c.batch_fixed + n_slots * (c.batch_draft_per_slot + c.batch_lane_fixed),
                c.batch_per_token + n_slots * c.batch_lane_per_token) for c in sessions] if n_slots > 1 else []
    fixed = n_slots * sum(c.compute_fixed + c.state for c in sessions) + prefill + sum(f for f, _ in batched) + \
        room.headroom
    per_token = n_slots * sum(c.kv_per_token + c.compute_per_token for c in sessions) + sum(t for _, t in batched)
    if per_token > 0:
        fitted = int((room.free - fixed) / per_token) // C * C
    else:   # no pooled layer here: any pool fits, or none
        fitted = 1 << 62 if room.free >= fixed else -C
    parts = [room.figures] + ([f"per session {_session_figures(main)}"] if main is not None else [])
    if draft is not None:
        parts.append(f"a draft model's session beside each: {_session_figures(draft)}")
    parts += [f"{prefill / MIB:.0f} MiB for the exact prefill of an n_ctx prompt"]
    if batched:
        parts.append(f"{sum(f for f, _ in batched) / MIB:.0f} MiB + {sum(t for _, t in batched) / 1024:.1f} KiB "
                     f"per pool token for the slots' batched steps")
    parts.append(f"{room.headroom / MIB:.0f} MiB headroom")
    return fitted, "; ".join(parts)


Placed = tuple[Room, Optional[SlotCosts], Optional[SlotCosts]]   # a device, and a session's and a draft's costs there


def solve_devices(placed: list[Placed], *, n_slots: int, n_ctx: int, min_pool: int, ceiling: int,
                  ceiling_why: str = "the whole context", align: int = _core.CHUNK_TOKENS) -> Fit:
    """The largest pool per session that every device holds, at most `ceiling`, a multiple of `align` (the chunk;
    GPU_POOL_ALIGN on a GPU) where that leaves at least min_pool. ValueError naming the device below min_pool."""
    capacities = [(_capacity(room, main, draft, n_slots, n_ctx), room) for room, main, draft in placed]
    (fitted, figures), room = min(capacities, key=lambda c: c[0][0])
    chosen = min(fitted, ceiling)
    if chosen < ceiling and chosen // align * align >= min_pool:
        chosen = chosen // align * align
    if chosen < min_pool:
        raise ValueError(f"pool_tokens='auto': {n_slots} session(s) do not fit {room.name}'s memory ({figures}); each "
                         f"needs a pool of at least {min_pool} tokens. Use fewer slots (--parallel), a smaller n_ctx, "
                         f"a larger max_device_bytes if one is set, or a pool size")
    why = ceiling_why if chosen == ceiling else f"what {room.name}'s memory holds"
    others = [f"{r.name} {min(f, ceiling)}" for (f, _), r in capacities if r is not room]
    beside = f"; the other devices would hold {', '.join(others)} tokens" if others else ""
    return Fit(chosen, f"{chosen} tokens per session x {n_slots} ({why}): {figures}{beside}")


def solve(costs: SlotCosts, *, free: int, total: int, n_slots: int, n_ctx: int, min_pool: int,
          draft: Optional[SlotCosts] = None) -> Fit:
    """One device (a local GPU): the largest chunk-aligned pool per session such that n_slots sessions (and as
    many draft-model sessions of the same pool, with costs `draft`), one exact prefill of an n_ctx prompt and the
    headroom fit in `free` bytes; at most the whole context. ValueError below min_pool."""
    room = Room("the GPU", free, _gpu_headroom(total), f"{free / GIB:.2f} GiB free after the weights")
    return solve_devices([(room, costs, draft)], n_slots=n_slots, n_ctx=n_ctx, min_pool=min_pool,
                         ceiling=_whole_context(n_ctx, GPU_POOL_ALIGN), align=GPU_POOL_ALIGN)


def _gpu_headroom(total: float) -> float:
    return max(MIN_HEADROOM, int(HEADROOM_FRACTION * total))


def _whole_context(n_ctx: int, align: int = _core.CHUNK_TOKENS) -> int:
    return -(-n_ctx // align) * align


def device_rooms(models: list[_core.Model], budget: Optional[int]) -> list[Room]:
    """The devices that limit a pool, each with the bytes sessions may take there: what its memory holds after
    the weights of `models` (and, under a budget, the budget less those weights). The local CPU limits nothing
    without a budget (host RAM is not what a pool is for)."""
    readings: dict[str, dict] = {}
    for m in models:
        for r in m.device_memory():
            e = readings.setdefault(r["name"], dict(r, weight_bytes=0))
            e["weight_bytes"] += r["weight_bytes"]
    rooms = []
    for name, r in readings.items():
        weights = r["weight_bytes"]
        if budget is not None and budget <= weights:
            raise ValueError(f"max_device_bytes={budget} ({budget / GIB:.3f} GiB) is below the weights on {name} "
                             f"({weights} bytes, {weights / GIB:.3f} GiB)")
        if r["kind"] == "cpu":
            if budget is None:
                continue
            # No backend context or library workspace to leave room for: the headroom is the fraction alone.
            rooms.append(Room(name, budget - weights, HEADROOM_FRACTION * budget,
                              f"max_device_bytes {budget / GIB:.3f} GiB less {weights / MIB:.1f} MiB of weights"))
            continue
        # A GPU's free memory (its driver's) already excludes what we placed on it. A CPU device behind
        # ggml-rpc-server reports its host's physical RAM as both free and total, and the figure does not drop
        # as we allocate there (ggml-cpu's get_memory; measured: 700 MiB reported before and after our weights),
        # so the room is also at most the total less our weights. (ggml-rpc-server at this commit has no -m flag
        # to report less; an RPC device does not say whether it is a CPU: both rules apply to every device.)
        free = min(r["memory_free"], r["memory_total"] - weights)
        figures = f"{free / GIB:.2f} GiB free after the weights"
        total = r["memory_total"]
        if budget is not None and budget - weights < free:
            free, total = budget - weights, min(total, budget)
            figures = f"max_device_bytes {budget / GIB:.3f} GiB less {weights / MIB:.1f} MiB of weights"
        rooms.append(Room(name, free, _gpu_headroom(total), figures))
    return rooms


def _placed(model: _core.Model, pool: PoolConfig, draft_model: Optional[_core.Model], mtp: bool) -> list[Placed]:
    costs = measure_devices(model, pool, mtp)
    draft = measure_devices(draft_model, pool) if draft_model is not None else {}
    models = [model] + ([draft_model] if draft_model is not None and draft_model is not model else [])
    rooms = device_rooms(models, pool.max_device_bytes)   # after the probes are freed
    return [(r, costs.get(r.name), draft.get(r.name)) for r in rooms if r.name in costs or r.name in draft]


def fit_pool_tokens(model: _core.Model, pool: PoolConfig, n_slots: int, *,
                    draft_model: Optional[_core.Model] = None, mtp: bool = False) -> Fit:
    """Pool tokens per session for n_slots sessions of `pool` (whose pool_tokens is 'auto'), each with a session
    of draft_model beside it if one is given (loaded already, so its weights are counted); mtp: the sessions run
    the model's multi-token-prediction head (loaded already). Under pool.max_device_bytes every device's whole
    footprint stays within it."""
    auto = dataclasses.replace(pool, pool_tokens="auto").resolved_pool_tokens()
    if not model.on_gpu and pool.max_device_bytes is None:
        return Fit(auto, f"CPU backend: the engine's auto pool, min(n_ctx, {auto}) tokens")
    placed = _placed(model, pool, draft_model, mtp)
    if not placed:   # no device that limits a pool holds any part of a session
        return Fit(auto, f"no device limits the pool: the engine's auto pool, min(n_ctx, {auto}) tokens")
    align = GPU_POOL_ALIGN if model.on_gpu else _core.CHUNK_TOKENS
    ceiling, why = (_whole_context(pool.n_ctx, align), "the whole context") if model.on_gpu else \
        (auto, f"the CPU's auto pool, min(n_ctx, {auto})")
    return solve_devices(placed, n_slots=n_slots, n_ctx=pool.n_ctx, min_pool=pool._pager_config(0).min_pool_tokens(),
                         ceiling=ceiling, ceiling_why=why, align=align)


def check_budget(model: _core.Model, pool: PoolConfig, n_slots: int, *,
                 draft_model: Optional[_core.Model] = None, mtp: bool = False) -> str:
    """A pool given as a number (or the full cache, checked as a pool of the whole context) under
    pool.max_device_bytes: the reason it fits, or ValueError naming the device it does not fit (never a silent
    change of the number)."""
    wanted = pool.resolved_pool_tokens() or _whole_context(pool.n_ctx)
    what = f"pool_tokens={wanted}" if pool.resolved_pool_tokens() else f"the full cache ({wanted} tokens)"
    for room, main, draft in _placed(model, pool, draft_model, mtp):
        fitted, figures = _capacity(room, main, draft, n_slots, pool.n_ctx)
        if fitted < wanted:
            raise ValueError(f"{what} x {n_slots} session(s) does not fit max_device_bytes={pool.max_device_bytes} "
                             f"on {room.name}: at most {max(fitted, 0)} tokens per session fit there ({figures})")
    return f"{wanted} tokens per session x {n_slots}, within max_device_bytes={pool.max_device_bytes} on every device"


def resolve_pool(model: _core.Model, pool: PoolConfig, n_slots: int, *,
                 draft_model: Optional[_core.Model] = None, mtp: bool = False) -> tuple[PoolConfig, str]:
    """The pool a Model or the server runs: 'auto' sized (fit_pool_tokens), a number or the full cache checked
    against max_device_bytes when one is given; and why it has its size."""
    if pool.pool_tokens == "auto":
        fit = fit_pool_tokens(model, pool, n_slots, draft_model=draft_model, mtp=mtp)
        return dataclasses.replace(pool, pool_tokens=fit.pool_tokens), fit.reason
    if pool.max_device_bytes is not None:
        return pool, check_budget(model, pool, n_slots, draft_model=draft_model, mtp=mtp)
    return pool, "full cache" if pool.pool_tokens is None else f"{pool.pool_tokens} tokens, as given"
