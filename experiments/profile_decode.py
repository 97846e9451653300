#!/usr/bin/env python3
"""Where a decode step's time goes: wall time per token vs the session's own compute/paging timers, and
(optionally) a window for a GPU profiler.

    python experiments/profile_decode.py --model M --runs full:0,pooled:0,pooled:8192 --pool 4096 --steps 64
    python experiments/profile_decode.py --model M --runs pooled:8192 --pool 4096 --compare-order
    ncu --profile-from-start off --print-summary per-kernel --metrics gpu__time_duration.sum \\
        python experiments/profile_decode.py ... --cuda-profiler --steps 4

--cuda-profiler brackets only the timed decode steps with cudaProfilerStart/Stop, so ncu skips loading
and prefill. --compare-order times pooled decode with the position-ordered K/V copy on and off.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import logging
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


class LogCounter(logging.Handler):
    """Counts ggml's debug lines by their first words (e.g. how often ggml-cuda reused its CUDA graph)."""
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: collections.Counter = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        self.counts[" ".join(record.getMessage().split()[:4])] += 1


def run(model, depth: int, pool: int, steps: int, ordered, profile: bool, log_counter=None) -> dict:
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
    if log_counter is not None:
        _core.set_log_level(10)
    w0 = time.perf_counter()
    for _ in range(steps):
        logits = sess.forward(np.array([int(logits.argmax())], np.int32), sess.n_tokens)
    wall = (time.perf_counter() - w0) * 1e3
    if log_counter is not None:
        _core.set_log_level(30)
    if profile:
        cuda_profiler(False)
    t = sess.timings
    return {"tok_s": steps / wall * 1e3, "wall_ms": wall / steps, "compute_ms": (t.t_compute_ms - c0) / steps,
            "paging_ms": (t.t_paging_ms - p0) / steps, "computes": t.n_computes - n0,
            "ordered": sess.ordered_attention, "identity": sess.pager.is_identity()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--runs", default="pooled:4096",
                    help="comma-separated MODE:DEPTH (MODE full or pooled), each timed in this one process")
    ap.add_argument("--pool", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--compare-order", action="store_true",
                    help="pooled at the first run's depth with the ordered copy on, off, on, off")
    ap.add_argument("--cuda-profiler", action="store_true")
    ap.add_argument("--count-logs", action="store_true", help="count ggml debug lines during the timed steps")
    args = ap.parse_args()
    model = _core.Model(args.model, backend=args.backend)
    runs = [(m, int(d)) for m, d in (r.split(":") for r in args.runs.split(","))]
    print(f"model {args.model} on {model.backend_name}, pool {args.pool}, {args.steps} steps")
    if args.compare_order:
        for ordered in (True, False, True, False):
            r = run(model, runs[0][1], args.pool, args.steps, ordered, False)
            print(f"pooled depth {runs[0][1]} ordered={ordered}: {r}")
        return 0
    counter = None
    if args.count_logs:
        counter = LogCounter()
        logger = logging.getLogger("kvflash_ggml.ggml")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(counter)
        logger.propagate = False
    for mode, depth in runs:
        pool = 0 if mode == "full" else args.pool
        r = run(model, depth, pool, args.steps, None, args.cuda_profiler, counter)
        print(f"{mode} depth {depth}: {r}")
        if counter is not None:
            print(f"  ggml debug lines during the timed steps: {dict(counter.counts.most_common(6))}")
            counter.counts.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
