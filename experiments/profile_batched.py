#!/usr/bin/env python3
"""Where a batched decode step's time goes (the server's round, issue 38's throughput bars): S slots of one model,
each holding a context past its pool, stepped together by BatchDecoder.step_greedy as the scheduler steps them;
the step's wall time untraced, then a few steps under the CUDA activity profiler (profile_prefill.traced): kernel
launches per step, GPU busy time, the gaps where no kernel ran, the kernels that took the most.

    python experiments/profile_batched.py --model /tmp/l8b.gguf --slots 4,8 --context 8192 --pool 4096
    python experiments/profile_batched.py --model /tmp/q35-27b.gguf --slots 8 --context 8192 --pool 4096

Each slot count (steps of the first N filled slots) is timed; the last one is traced.

The contexts are filled by pooled prefill (a decode step's cost depends on the pool, not on how it was filled).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from kvflash_ggml import _core
from kvflash_ggml.options import PoolConfig, ResidencyConfig, SamplingParams
from kvflash_ggml.server.scheduler import slot_engines
from kvflash_ggml.tokenizer import Tokenizer

from profile_prefill import report, traced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--slots", default="8", help="comma-separated: steps of the first N of the filled slots")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--pool", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=64, help="untimed warm-up, then as many timed, then 8 traced")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    slot_counts = [int(x) for x in args.slots.split(",")]
    n_slots = max(slot_counts)
    model = _core.Model(args.model, backend=args.backend)
    tok = Tokenizer(args.model)
    pool = PoolConfig(n_ctx=args.context + (2 * len(slot_counts) + 1) * args.steps + 256, pool_tokens=args.pool)
    engines = slot_engines(n_slots, model, tok, pool, ResidencyConfig(policy="lru", prefill="pooled"),
                           store_each_turn=False)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    tokens = []
    for e in engines:
        records = list(e.generate(rng.integers(1, model.hparams.n_vocab, args.context).tolist(),
                                  SamplingParams(max_tokens=1, temperature=0)))
        tokens.append(records[0].token)
    print(f"{n_slots} slots filled with {args.context} tokens each in {time.perf_counter() - t0:.1f} s")
    decoder = _core.BatchDecoder(model)
    sessions = [e.session for e in engines]

    def step(n_sessions: int, n: int) -> None:
        for _ in range(n):
            tokens[:n_sessions] = [int(t) for t in decoder.step_greedy(sessions[:n_sessions], tokens[:n_sessions],
                                                                      [False] * n_sessions)]

    for n_sessions in slot_counts:
        step(n_sessions, args.steps)
        t0 = time.perf_counter()
        step(n_sessions, args.steps)
        ms = (time.perf_counter() - t0) * 1e3 / args.steps
        print(f"batched step of {n_sessions} slots (pool {args.pool}): {ms:.2f} ms untraced "
              f"({n_sessions * 1e3 / ms:.0f} tok/s); {decoder.graph_nodes} graph nodes in {decoder.graph_splits} "
              f"splits, compute buffer {decoder.compute_bytes / 2**20:.0f} MiB", flush=True)
    n_sessions, n_traced = slot_counts[-1], 8
    step(n_sessions, 4)
    wall, kernels, copies, api = traced(lambda: step(n_sessions, n_traced))
    launches = sum(v[0] for k, v in kernels.items() if not k.startswith("__"))
    calls = ", ".join(f"{name} {n / n_traced:.0f}" for name, (n, _) in sorted(api.items(), key=lambda kv: -kv[1][0])[:8])
    print(f"traced: {n_traced} steps of {n_sessions} slots: "
          f"{launches / n_traced:.0f} kernel launches a step; CUDA calls a step: {calls}")
    report(f"{n_traced} batched steps", n_traced * n_sessions, wall, kernels, copies, api, args.top)
    for e in engines:
        e.close()


if __name__ == "__main__":
    main()
