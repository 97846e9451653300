#!/usr/bin/env python3
"""Where the exact prefill's device memory goes, stage by stage, in the driver's view beside our own counters: after
the Engine is made (the pool), after `kvflash bench prefill`'s untimed warm-up prompt, and the most taken while an
exact prefill of --length tokens runs (sampled). Each configuration runs in a process of its own, so no CUDA memory
pool that ggml grew in one is counted in another: `--warm-up 0` against the bench's 2048 tokens says what the
warm-up adds to the bench's figure (RESULTS.md: the ~104 MiB that our counters do not hold).

    python experiments/prefill_memory.py --model /tmp/l8b.gguf --length 32768 --pool 4096 --warm-up 2048,0
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

MIB = 2**20


def measure(model_path: str, length: int, pool: int, warm_up: int) -> dict:
    import numpy as np
    from kvflash_ggml.bench.prefill import FreeMemorySampler
    from kvflash_ggml.bench.reference import gpu_free_bytes
    from kvflash_ggml.engine import Engine
    from kvflash_ggml.loading import load
    from kvflash_ggml.options import DeviceConfig, PoolConfig, ResidencyConfig

    loaded = load(model_path, DeviceConfig())
    free0 = gpu_free_bytes()
    if free0 is None:
        raise SystemExit("prefill_memory.py: no GPU (the driver's view is what it measures)")
    taken = lambda: free0 - gpu_free_bytes()
    prompt = np.random.default_rng(length).integers(100, loaded.model.hparams.n_vocab - 100, length).tolist()
    engine = Engine(loaded.model, loaded.tokenizer,
                    PoolConfig(n_ctx=-(-length // 64) * 64, pool_tokens=pool, allow_beyond_train_ctx=True),
                    ResidencyConfig(prefill="exact"))
    out = {"warm_up": warm_up, "engine": taken()}
    if warm_up:
        engine.prefill(prompt[:warm_up])
        engine.session.reset()
    out["after_warm_up"] = taken()
    engine.reserve_host(length)
    with FreeMemorySampler() as sampler:
        engine.prefill(prompt)
    out["prefill_peak"] = sampler.taken + (free0 - sampler.start_free)
    out["after_prefill"] = taken()
    mem = engine.session.memory()
    out["ours"] = {k: mem[k] for k in ("pool_bytes", "compute_bytes", "prefill_peak_bytes", "prefill_staging_bytes")}
    engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--pool", type=int, default=4096)
    ap.add_argument("--warm-up", default="2048,0", help="warm-up prompt lengths, one process each (0: none)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)   # a child: one warm-up length
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.model, args.length, args.pool, args.one)))
        return
    print(f"length {args.length}, pool {args.pool}: MiB the driver saw taken after the model was loaded")
    print(f"{'warm-up':>8} {'engine':>8} {'warm-up':>8} {'prefill peak':>13} {'after':>8} | ours: pool compute "
          "prefill-peak staging")
    for w in map(int, args.warm_up.split(",")):
        child = subprocess.run([sys.executable, __file__, "--model", args.model, "--length", str(args.length),
                                "--pool", str(args.pool), "--one", str(w)], capture_output=True, text=True)
        if child.returncode:
            print(child.stderr[-2000:], file=sys.stderr)
            raise SystemExit(child.returncode)
        r = json.loads(child.stdout.strip().splitlines()[-1])
        ours = " ".join(f"{v / MIB:.0f}" for v in r["ours"].values())
        print(f"{w:>8} {r['engine'] / MIB:>8.0f} {r['after_warm_up'] / MIB:>8.0f} {r['prefill_peak'] / MIB:>13.0f} "
              f"{r['after_prefill'] / MIB:>8.0f} | {ours}")


if __name__ == "__main__":
    main()
