"""pool_tokens="auto" (--kvflash auto) on a GPU: the largest pool per session, for P sessions (the server's
slots; 1 for a Model), that the GPU's free memory holds, as llama.cpp's --fit sizes a context. Measured, not
guessed: two probe sessions (pools of two and four steps) each run a pool-filling prompt in steps of the
largest size a pool takes (n_batch), and their compute buffers give a session's cost as fixed +
per-pool-token bytes. A pool's compute buffer grows with its keys times its step (the mask, and without
flash attention the attention matrix), and smaller pools take smaller steps (PoolConfig.prefill_batch), so
probing at the largest step bounds every pool's buffer from above.
A speculative draft model gives every session a second pooled session of the same pool size (its own
costs, measured the same way); its weights are loaded before the fit, so the free memory excludes them.
Drafting with the model's own multi-token-prediction head (mtp) puts one more layer in every pool: the probes
run the head too.
On the CPU backend the pool is the engine's own 'auto' (min(n_ctx, 4096)): host RAM is not the limit a pool
is for; so is it for a model split across devices (a Model's and the server's alike), which no fit here measures."""
from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import numpy as np

from . import _core
from .engine_parts import make_session
from .options import PoolConfig
from .tokens import forward_in_steps

log = logging.getLogger(__name__)

HEADROOM_FRACTION = 0.05      # of the device's memory, left free for the backend's own allocations
MIN_HEADROOM = 512 << 20


@dataclasses.dataclass(frozen=True)
class Fit:
    pool_tokens: int
    reason: str


def _probe(model: _core.Model, pool: PoolConfig, pool_tokens: int, mtp: bool = False) -> dict:
    n = pool_tokens + _core.CHUNK_TOKENS   # past the pool: paging runs too
    session = make_session(model, dataclasses.replace(pool, pool_tokens=pool_tokens, n_ctx=max(pool.n_ctx, n)),
                           n_batch=pool.n_batch, mtp=mtp)
    tokens = np.zeros(n, dtype=np.int32)
    forward_in_steps(session, tokens, 0)
    mem = session.memory()
    return {"compute": mem["compute_bytes"], "state": mem["ring_bytes"] + mem["recurrent_bytes"],
            "kv_per_token": session.kv.chunk_bytes / _core.CHUNK_TOKENS,
            "layer_per_token": session.kv.layer_chunk_bytes / _core.CHUNK_TOKENS, "flash": session.flash_attn}


@dataclasses.dataclass(frozen=True)
class SlotCosts:
    """What one session costs on the device, measured by _probe: bytes per pool token (K/V, and the compute
    buffer's growth with the pool), fixed bytes (compute buffer, sliding-window rings, linear-attention state: `state`), and one layer's K/V
    per prompt token (the exact prefill's staging pool)."""
    kv_per_token: float
    compute_per_token: float
    compute_fixed: float
    state: float   # sliding-window rings and linear-attention state: fixed per session
    layer_per_token: float
    compute_max: float        # the larger probe's compute buffer (beside the exact prefill's staging)
    exact_step: int           # tokens per step of the exact prefill
    n_batch: int              # the probes' step


def measure(model: _core.Model, pool: PoolConfig, mtp: bool = False) -> SlotCosts:
    C = _core.CHUNK_TOKENS
    lo = max(pool._pager_config(0).min_pool_tokens(), -(-2 * pool.n_batch // C) * C)
    small, large = _probe(model, pool, lo, mtp), _probe(model, pool, 2 * lo, mtp)
    per_token = max(0.0, (large["compute"] - small["compute"]) / lo)
    return SlotCosts(kv_per_token=small["kv_per_token"], compute_per_token=per_token,
                     compute_fixed=max(0.0, small["compute"] - per_token * lo), state=small["state"],
                     layer_per_token=small["layer_per_token"], compute_max=large["compute"],
                     exact_step=pool.exact_prefill_batch(small["flash"]),
                     n_batch=pool.n_batch)


def _exact_prefill_bytes(costs: SlotCosts, n_ctx: int) -> float:
    """One layer's K/V of a whole-context prompt, one attention block's mask and attention matrix
    (_core.ATTENTION_BLOCK_BYTES, whatever the context) and a step's compute buffer (probed at n_batch tokens,
    scaled to the exact step)."""
    return n_ctx * costs.layer_per_token + _core.ATTENTION_BLOCK_BYTES + \
        costs.compute_max * costs.exact_step / max(1, costs.n_batch)


def _session_figures(c: SlotCosts) -> str:
    return (f"{c.kv_per_token / 1024:.1f} KiB of K/V + {c.compute_per_token / 1024:.1f} KiB of compute per pool token, "
            f"{c.compute_fixed / 2**20:.0f} MiB compute + {c.state / 2**20:.0f} MiB rings and recurrent state fixed")


def solve(costs: SlotCosts, *, free: int, total: int, n_slots: int, n_ctx: int, min_pool: int,
          draft: Optional[SlotCosts] = None) -> Fit:
    """The largest chunk-aligned pool per session such that n_slots sessions (and as many draft-model sessions
    of the same pool, with costs `draft`), one exact prefill of an n_ctx prompt and the headroom fit in `free`
    bytes; at most the whole context. ValueError below min_pool."""
    C = _core.CHUNK_TOKENS
    headroom = max(MIN_HEADROOM, int(HEADROOM_FRACTION * total))
    sessions = [costs] + ([draft] if draft is not None else [])
    # One exact prefill runs at a time (the server computes one prompt at once; a draft model follows it after).
    prefill = max(_exact_prefill_bytes(c, n_ctx) for c in sessions)
    fixed = n_slots * sum(c.compute_fixed + c.state for c in sessions) + prefill + headroom
    per_token = n_slots * sum(c.kv_per_token + c.compute_per_token for c in sessions)
    fitted = int((free - fixed) / per_token) // C * C
    ceiling = -(-n_ctx // C) * C
    chosen = min(fitted, ceiling)
    parts = [f"{free / 2**30:.2f} GiB free after the weights",
             f"per session {_session_figures(costs)}"]
    if draft is not None:
        parts.append(f"a draft model's session beside each: {_session_figures(draft)}")
    parts += [f"{prefill / 2**20:.0f} MiB for the exact prefill of an n_ctx prompt", f"{headroom / 2**20:.0f} MiB headroom"]
    figures = "; ".join(parts)
    if chosen < min_pool:
        raise ValueError(f"pool_tokens='auto': {n_slots} session(s) do not fit the GPU's free memory ({figures}); "
                         f"each needs a pool of at least {min_pool} tokens. Use fewer slots (--parallel), a smaller "
                         "n_ctx, or a pool size")
    why = "the whole context" if chosen == ceiling else "what the free memory holds"
    return Fit(chosen, f"{chosen} tokens per session x {n_slots} ({why}): {figures}")


def fit_pool_tokens(model: _core.Model, pool: PoolConfig, n_slots: int, *,
                    draft_model: Optional[_core.Model] = None, mtp: bool = False) -> Fit:
    """Pool tokens per session for n_slots sessions of `pool` (whose pool_tokens is 'auto'), each with a session
    of draft_model beside it if one is given (loaded already, so the free memory excludes its weights); mtp: the
    sessions run the model's multi-token-prediction head (loaded already)."""
    auto = pool.resolved_pool_tokens()
    if len(model.devices) > 1 or model.on_rpc:
        # the probes and the free memory below are one local GPU's; a split's devices are not fitted (yet)
        return Fit(auto, f"a model split across devices: min(n_ctx, {auto}) tokens, as on the CPU (the fit "
                         f"measures one local GPU; give a number to fit the split's devices)")
    devices = _core.gpu_devices()
    if not model.on_gpu or not devices:
        return Fit(auto, f"CPU backend: the engine's auto pool, min(n_ctx, {auto}) tokens")
    costs = measure(model, pool, mtp)
    draft = measure(draft_model, pool) if draft_model is not None else None
    device = _core.gpu_devices()[0]   # after the probes are freed
    return solve(costs, free=device["memory_free"], total=device["memory_total"], n_slots=n_slots, n_ctx=pool.n_ctx,
                 min_pool=pool._pager_config(0).min_pool_tokens(), draft=draft)
