"""Where the exact prefill's time goes between the core and `kvflash bench prefill`: the same random prompt, in one
process, through Session.prefill_exact (C++ runs every step, as experiments/profile_prefill.py does), through
Engine.prefill (a Python generator steps the run one step at a time, then the post-prompt reselect), and through
Engine.prefill while the bench's driver-memory sampler runs. The host store is pinned first in each (reserve_host).

    python experiments/prefill_overhead.py --model /tmp/l8b.gguf --length 131072 --pool 4096 --reps 2
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from kvflash_ggml import _core
from kvflash_ggml.bench.prefill import FreeMemorySampler
from kvflash_ggml.engine import Engine
from kvflash_ggml.loading import load
from kvflash_ggml.options import DeviceConfig, PoolConfig, ResidencyConfig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--pool", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    C, n = _core.CHUNK_TOKENS, args.length
    loaded = load(args.model, DeviceConfig())
    model, tokenizer = loaded.model, loaded.tokenizer
    prompt = np.random.default_rng(0).integers(100, model.hparams.n_vocab - 100, n, dtype=np.int32)
    pool = PoolConfig(n_ctx=-(-n // C) * C, pool_tokens=args.pool, allow_beyond_train_ctx=True)
    engine = Engine(model, tokenizer, pool, ResidencyConfig(prefill="exact"))
    engine.prefill(prompt[:2048].tolist())
    engine.reserve_host(n)
    step = pool.exact_prefill_batch(engine.session.flash_attn)

    def core() -> None:
        engine.session.prefill_exact(prompt, 0, n_batch=step)

    def engine_prefill() -> None:
        engine.prefill(prompt.tolist())

    def sampled() -> None:
        with FreeMemorySampler():
            engine.prefill(prompt.tolist())

    runs = {"core": core, "engine": engine_prefill, **({"engine+sampler": sampled} if model.on_gpu else {})}
    times = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, run in runs.items():
            engine.session.reset()
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    print(f"{n} tokens, step {step}, pool {args.pool}, {args.reps} reps each, interleaved:")
    for name, ts in times.items():
        print(f"  {name:>15}: {n / min(ts):8.1f} tok/s best, {n / np.median(ts):8.1f} median  ({', '.join(f'{t:.2f}' for t in ts)} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
