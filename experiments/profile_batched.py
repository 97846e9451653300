#!/usr/bin/env python3
"""Where a batched decode step's time goes (the server's round, issue 38's throughput bars): S slots of one model,
each holding a context past its pool, stepped together by BatchDecoder.step_greedy as the scheduler steps them;
the step's wall time untraced, then a few steps under the CUDA activity profiler (profile_prefill.traced): kernel
launches per step, GPU busy time, the gaps where no kernel ran, the kernels that took the most.

    python experiments/profile_batched.py --model /tmp/l8b.gguf --slots 8 --context 8192 --pool 4096
    python experiments/profile_batched.py --model /tmp/q35-27b.gguf --slots 8 --context 8192 --pool 4096

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
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--pool", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=64, help="untimed warm-up, then as many timed, then 8 traced")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    model = _core.Model(args.model, backend=args.backend)
    tok = Tokenizer(args.model)
    pool = PoolConfig(n_ctx=args.context + 4 * args.steps + 256, pool_tokens=args.pool)
    engines = slot_engines(args.slots, model, tok, pool, ResidencyConfig(policy="lru", prefill="pooled"),
                           store_each_turn=False)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    tokens = []
    for e in engines:
        records = list(e.generate(rng.integers(1, model.hparams.n_vocab, args.context).tolist(),
                                  SamplingParams(max_tokens=1, temperature=0)))
        tokens.append(records[0].token)
    print(f"{args.slots} slots filled with {args.context} tokens each in {time.perf_counter() - t0:.1f} s")
    decoder = _core.BatchDecoder(model)
    sessions = [e.session for e in engines]
    keep = [False] * args.slots

    def step(n: int) -> None:
        nonlocal tokens
        for _ in range(n):
            tokens = [int(t) for t in decoder.step_greedy(sessions, tokens, keep)]

    step(args.steps)
    t0 = time.perf_counter()
    step(args.steps)
    ms = (time.perf_counter() - t0) * 1e3 / args.steps
    print(f"batched step of {args.slots} slots (pool {args.pool}): {ms:.2f} ms untraced "
          f"({args.slots * 1e3 / ms:.0f} tok/s); the batched graph's compute buffer {decoder.compute_bytes / 2**20:.0f} MiB")
    n_traced = 8
    wall, kernels, copies, api = traced(lambda: step(n_traced))
    launches = sum(n for k, (n, _) in kernels.items() if not k.startswith("__"))
    print(f"traced: {n_traced} steps, {launches / n_traced:.0f} kernel launches a step")
    report(f"{n_traced} batched steps", n_traced * args.slots, wall, kernels, copies, api, args.top)
    for e in engines:
        e.close()


if __name__ == "__main__":
    main()
