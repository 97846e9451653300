"""The host store's bound: whether this host holds the K/V that a context sends out of the pool.

A pooled session keeps an image per chunk that left the pool (page-outs, and the clean copy a paged-in chunk keeps:
PooledKV's host store), so n_ctx positions come to at most ceil(n_ctx / 64) images of chunk_bytes each: 128 GiB
for an 8B model's f16 K/V at 1M tokens, 68 GiB in q8_0. llama.cpp makes its whole KV cache when a context is created
and fails there if it does not fit; ours grows with the context, so a context the host cannot hold would run until
the kernel's OOM killer ends the process, part way into a long conversation. check_host_store refuses it when the
sessions are made, naming the figures and what would fit (a smaller KV type, a shorter n_ctx). The cap is
PoolConfig.max_host_bytes, else the memory the host has available then (MemAvailable); a full cache pages nothing.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

from . import _core

__all__ = ["available_host_bytes", "host_store_bound", "check_host_store"]

GIB, MIB = float(1 << 30), float(1 << 20)
# bytes per element of each KV type (ggml's block sizes: q8_0 34 bytes per 32 values, q4_0 18)
_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


def _size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def available_host_bytes() -> Optional[int]:
    """What the kernel says new allocations can take without swapping (MemAvailable); None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def host_store_bound(session: _core.Session, n_ctx: int) -> int:
    """The most host memory the session's store takes for a context of n_ctx positions: an image per chunk."""
    if session.full_cache:
        return 0
    n_chunks = -(-n_ctx // _core.CHUNK_TOKENS)
    return n_chunks * session.kv.chunk_bytes


def check_host_store(sessions: Sequence[_core.Session], n_ctx: int, kv_type: str,
                     max_host_bytes: Optional[int]) -> None:
    """ValueError when the sessions' stores at n_ctx would outgrow max_host_bytes (None: the host's available
    memory now), with the figures and the KV types and n_ctx that would fit."""
    need = sum(host_store_bound(s, n_ctx) for s in sessions)
    cap = max_host_bytes if max_host_bytes is not None else available_host_bytes()
    if cap is None or need <= cap:
        return
    where = f"max_host_bytes={cap}" if max_host_bytes is not None else "the memory this host has available"
    per_chunk = need / -(-n_ctx // _core.CHUNK_TOKENS)
    fits_ctx = int(cap // per_chunk) * _core.CHUNK_TOKENS if per_chunk else 0
    own = _TYPE_BYTES.get(kv_type)
    smaller = [f"kv_type='{t}' ({_size(need * b / own)})" for t, b in _TYPE_BYTES.items()
               if own and b < own and need * b / own <= cap]
    options = smaller + ([f"n_ctx <= {fits_ctx}"] if fits_ctx >= _core.CHUNK_TOKENS else []) + \
        ["max_host_bytes set above it to accept the risk"]
    raise ValueError(f"n_ctx={n_ctx} with {len(sessions)} pooled session(s) can send up to {_size(need)} of "
                     f"{kv_type} K/V out of the pool(s) into host memory, more than {where} ({_size(cap)}); "
                     f"use " + ", or ".join(options))
