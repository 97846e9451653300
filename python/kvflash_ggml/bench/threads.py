"""Decode tok/s by CPU thread count and OpenMP wait policy, on free cores and beside a busy process
(python -m kvflash_ggml.bench.threads; issue 39 item 14, see kvflash_ggml/threads.py for the figures).

Each configuration runs in a fresh process (libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT once, when it loads),
one after another in rotated order for --rounds rounds (paired runs: load that comes and goes touches every
configuration alike), first as they are ("quiet"), then beside `python -c "while True: pass"` ("busy"). Prints
each run and min / median / max tok/s per configuration. Run it as root under `chrt -f 50` for free cores on a
machine other work shares (the run then goes first; the busy phase is skipped there: --busy-rounds 0)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Optional, Sequence

# name: (threads, the OpenMP variables); "auto" is the default thread count (kvflash_ggml.threads)
CONFIGS = {
    "auto threads": ("auto", {}),
    "2 threads": ("2", {}),
    "2 threads passive": ("2", {"OMP_WAIT_POLICY": "passive"}),
    "1 thread": ("1", {}),
}


def one_run(model: str, threads: str, n_gen: int) -> dict:
    """Decode tok/s of the full cache after a 64-token prompt (greedy, n_gen tokens after 4 untimed)."""
    import numpy as np
    from ..engine import Engine
    from ..options import DeviceConfig, PoolConfig, ResidencyConfig
    from ..tokenizer import Tokenizer
    from ..weights import load_model
    path, weights = load_model(model, DeviceConfig(backend="cpu", n_threads=None if threads == "auto" else int(threads)))
    engine = Engine(weights, Tokenizer(path), PoolConfig(n_ctx=1024), ResidencyConfig())
    token = int(engine.prefill(np.random.default_rng(0).integers(100, 10000, 64).tolist()).argmax())
    for _ in range(4):
        token = engine.decode_one_greedy(token)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n_gen):
        token = engine.decode_one_greedy(token)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"threads": weights.n_threads, "tok_s": n_gen / wall, "cpu_ms_per_token": 1e3 * cpu / n_gen}


def run_config(name: str, model: str, n_gen: int) -> dict:
    threads, openmp = CONFIGS[name]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(openmp)
    proc = subprocess.run([sys.executable, "-m", "kvflash_ggml.bench.threads", "--one", threads, "--model", model,
                           "--n-gen", str(n_gen)], env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvflash_ggml.bench.threads", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="rounds on the machine as it is")
    ap.add_argument("--busy-rounds", type=int, default=2, help="rounds beside a busy process")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)   # a single run, in its own process
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one_run(args.model, args.one, args.n_gen)))
        return 0
    names, results = list(CONFIGS), {}
    for load, rounds in (("quiet", args.rounds), ("busy", args.busy_rounds)):
        for r in range(rounds):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
            try:
                for i in range(len(names)):
                    name = names[(i + r) % len(names)]
                    m = run_config(name, args.model, args.n_gen)
                    results.setdefault((load, name), []).append(m["tok_s"])
                    print(f"{load} {name}: {m['threads']} threads, {m['tok_s']:.2f} tok/s, "
                          f"{m['cpu_ms_per_token']:.1f} CPU ms/token, load {os.getloadavg()[0]:.1f}", flush=True)
            finally:
                if hog:
                    hog.kill()
                    hog.wait()
    for (load, name), v in results.items():
        print(f"{load:5} {name:18} tok/s min {min(v):7.2f} median {statistics.median(v):7.2f} max {max(v):7.2f} "
              f"(n={len(v)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
