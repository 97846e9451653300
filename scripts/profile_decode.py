#!/usr/bin/env python3
"""Where a decode step's time goes: wall time per token vs the session's own compute/paging timers, and
(optionally) a window for a GPU profiler.

    python scripts/profile_decode.py --model M --depth 4096 --pool 4096 --mode pooled --steps 64
    python scripts/profile_decode.py --model M --depth 8192 --pool 4096 --compare-order
    ncu --profile-from-start off --print-summary per-kernel --metrics gpu__time_duration.sum \\
        python scripts/profile_decode.py ... --cuda-profiler --steps 4

--cuda-profiler brackets only the timed decode steps with cudaProfilerStart/Stop, so ncu skips loading
and prefill. --compare-order times pooled decode with the position-ordered K/V copy on and off.
"""
from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
from kvflash_ggml import _core

CHUNK = 64


def cuda_profiler(on: bool) -> None:
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        (lib.cudaProfilerStart if on else lib.cudaProfilerStop)()
        return
    raise OSError("libcudart not found")


def run(model, depth: int, pool: int, steps: int, ordered: bool, profile: bool) -> dict:
    n_ctx = -(-(depth + steps + 8) // CHUNK) * CHUNK
    cfg = _core.SessionConfig(max_tokens=n_ctx, pool_tokens=pool, allow_beyond_train_ctx=True,
                              ordered_attention=ordered)
    sess = _core.Session(model, cfg)
    prompt = np.random.default_rng(0).integers(100, model.hparams.n_vocab - 100, depth + 1, dtype=np.int32)
    logits = sess.forward(prompt, 0)
    for _ in range(4):
        logits = sess.forward(np.array([int(logits.argmax())], np.int32), sess.n_tokens)
    t = sess.timings
    c0, p0, n0 = t.t_compute_ms, t.t_paging_ms, t.n_computes
    if profile:
        cuda_profiler(True)
    w0 = time.perf_counter()
    for _ in range(steps):
        logits = sess.forward(np.array([int(logits.argmax())], np.int32), sess.n_tokens)
    wall = (time.perf_counter() - w0) * 1e3
    if profile:
        cuda_profiler(False)
    t = sess.timings
    return {"tok_s": steps / wall * 1e3, "wall_ms": wall / steps, "compute_ms": (t.t_compute_ms - c0) / steps,
            "paging_ms": (t.t_paging_ms - p0) / steps, "computes": t.n_computes - n0,
            "gathered": not sess.pager.is_identity() and ordered}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--pool", type=int, default=4096)
    ap.add_argument("--mode", choices=["full", "pooled"], default="pooled")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--compare-order", action="store_true")
    ap.add_argument("--cuda-profiler", action="store_true")
    args = ap.parse_args()
    model = _core.Model(args.model, backend=args.backend)
    print(f"model {args.model} on {model.backend_name}, depth {args.depth}")
    if args.compare_order:
        for ordered in (True, False, True, False):
            r = run(model, args.depth, args.pool, args.steps, ordered, False)
            print(f"pooled {args.pool} ordered={ordered}: {r}")
        return 0
    pool = 0 if args.mode == "full" else args.pool
    r = run(model, args.depth, pool, args.steps, True, args.cuda_profiler)
    print(f"{args.mode}: {r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
