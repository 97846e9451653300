"""--kvflash auto for P slots: the largest pool per slot that the GPU's free memory holds, as llama.cpp's
--fit sizes a context. Measured, not guessed: two probe sessions (the smallest pool and twice it) each run
a pool-filling prompt, and their compute buffers give the per-slot cost as fixed + per-pool-token bytes.
On the CPU backend the pool is the engine's own 'auto' (min(n_ctx, 4096)): host RAM is not the limit a pool
is for."""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from .. import _core
from ..engine import make_session
from ..options import PoolConfig
from ..tokens import forward_in_steps

log = logging.getLogger(__name__)

HEADROOM_FRACTION = 0.05      # of the device's memory, left free for the backend's own allocations
MIN_HEADROOM = 512 << 20


@dataclasses.dataclass(frozen=True)
class Fit:
    pool_tokens: int
    reason: str


def _probe(model: _core.Model, pool: PoolConfig, pool_tokens: int) -> dict:
    n = pool_tokens + _core.CHUNK_TOKENS   # past the pool: paging runs too
    session = make_session(model, dataclasses.replace(pool, pool_tokens=pool_tokens, n_ctx=max(pool.n_ctx, n)))
    tokens = np.zeros(n, dtype=np.int32)
    forward_in_steps(session, tokens, 0)
    mem = session.memory()
    return {"compute": mem["compute_bytes"], "ring": mem["ring_bytes"], "pool": mem["pool_bytes"],
            "kv_per_token": session.kv.chunk_bytes / _core.CHUNK_TOKENS,
            "layer_per_token": session.kv.layer_chunk_bytes / _core.CHUNK_TOKENS}


def fit_pool_tokens(model: _core.Model, pool: PoolConfig, n_slots: int) -> Fit:
    """Pool tokens per slot for n_slots slots of `pool` (whose pool_tokens is 'auto')."""
    auto = pool.resolved_pool_tokens()
    devices = _core.gpu_devices()
    if not model.on_gpu or not devices:
        return Fit(auto, f"CPU backend: the engine's auto pool, min(n_ctx, {auto}) tokens")
    C = _core.CHUNK_TOKENS
    lo = pool._pager_config(0).min_pool_tokens()
    small, large = _probe(model, pool, lo), _probe(model, pool, 2 * lo)
    compute_per_token = max(0.0, (large["compute"] - small["compute"]) / lo)
    compute_fixed = max(0.0, small["compute"] - compute_per_token * lo)
    free, total = devices[0]["memory_free"], devices[0]["memory_total"]
    headroom = max(MIN_HEADROOM, int(HEADROOM_FRACTION * total))
    # One exact prefill runs at a time (the scheduler computes one prompt at once): one layer's K/V of a
    # whole-context prompt, beside its compute buffer.
    prefill = small["layer_per_token"] * pool.n_ctx + large["compute"]
    fixed = n_slots * (compute_fixed + small["ring"]) + prefill + headroom
    per_token = n_slots * (small["kv_per_token"] + compute_per_token)
    fitted = int((free - fixed) / per_token) // C * C
    ceiling = -(-pool.n_ctx // C) * C
    chosen = min(fitted, ceiling)
    figures = (f"{free / 2**30:.2f} GiB free after the weights; per slot {small['kv_per_token'] / 1024:.1f} KiB of "
               f"K/V + {compute_per_token / 1024:.1f} KiB of compute per pool token, {compute_fixed / 2**20:.0f} MiB "
               f"compute + {small['ring'] / 2**20:.0f} MiB rings fixed; {prefill / 2**20:.0f} MiB for the exact "
               f"prefill of an n_ctx prompt; {headroom / 2**20:.0f} MiB headroom")
    if chosen < lo:
        raise ValueError(f"--kvflash auto: {n_slots} slots do not fit the GPU's free memory ({figures}); each "
                         f"needs a pool of at least {lo} tokens. Use fewer slots (--parallel) or a smaller n_ctx")
    why = "the whole context" if chosen == ceiling else "what the free memory holds"
    return Fit(chosen, f"{chosen} tokens per slot x {n_slots} ({why}): {figures}")
