"""Does pool_tokens="auto" for P slots fit the devices? Size the pool with kvflash_ggml.fit, build P engines with
it (the server's slots), run a whole-context exact prefill on one slot while the others hold prompts, and
print each device's free memory at each stage (ggml's device query: Model.device_memory) beside what stats()
reports. One local GPU by default; --devices / --tensor-split for a split (a CPU rpc-server's figure does not
drop as we allocate: watch its process instead), --max-device-memory for a budget.

    python experiments/fit_check.py MODEL.gguf --n-ctx 32768 --slots 1,8
    python experiments/fit_check.py MODEL.gguf --devices cuda0,rpc:127.0.0.1:50052 --tensor-split 1,1 --slots 1,4
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from kvflash_ggml import _core
from kvflash_ggml.engine import Engine
from kvflash_ggml.fit import fit_pool_tokens
from kvflash_ggml.commands.flags import parse_bytes, parse_devices, parse_tensor_split
from kvflash_ggml.options import PoolConfig, ResidencyConfig
from kvflash_ggml.tokenizer import Tokenizer

GIB = 2 ** 30


def free(model: _core.Model) -> str:
    return ", ".join(f"{d['name']} {d['memory_free'] / GIB:.2f}" for d in model.device_memory()) + " GiB free"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--n-ctx", type=int, default=32768)
    ap.add_argument("--slots", default="1,8")
    ap.add_argument("--devices", type=parse_devices, default=None)
    ap.add_argument("--tensor-split", type=parse_tensor_split, default=None)
    ap.add_argument("--max-device-memory", type=parse_bytes, default=None)
    args = ap.parse_args()
    model = _core.Model(args.model, **(dict(devices=args.devices, tensor_split=args.tensor_split or [])
                                       if args.devices else dict(backend="cuda")))
    tok = Tokenizer(args.model)
    totals = ", ".join(f"{d['name']} {d['memory_total'] / GIB:.2f}" for d in model.device_memory())
    print(f"weights {model.weight_bytes / GIB:.2f} GiB; after loading: {free(model)} (of {totals} GiB)", flush=True)
    rng = np.random.default_rng(0)
    for n_slots in (int(x) for x in args.slots.split(",")):
        pool = PoolConfig(n_ctx=args.n_ctx, pool_tokens="auto", max_device_bytes=args.max_device_memory)
        t0 = time.perf_counter()
        fit = fit_pool_tokens(model, pool, n_slots)
        print(f"\n{n_slots} slots: {fit.reason} ({time.perf_counter() - t0:.1f} s to fit)", flush=True)
        pool = PoolConfig(n_ctx=args.n_ctx, pool_tokens=fit.pool_tokens)
        engines = [Engine(model, tok, pool, ResidencyConfig()) for _ in range(n_slots)]
        print(f"  engines built: {free(model)}", flush=True)
        long = rng.integers(100, 30000, args.n_ctx - 64).tolist()
        for i, e in enumerate(engines):
            prompt = long if i == 0 else rng.integers(100, 30000, 2048).tolist()
            t0 = time.perf_counter()
            records = list(e.generate(prompt, max_tokens=16, temperature=0))
            s = records[-1].stats
            print(f"  slot {i}: {len(prompt)} prompt tokens in {time.perf_counter() - t0:.1f} s; device peak "
                  f"{s['device_peak_bytes'] / GIB:.2f} GiB (pool {s['device_kv_bytes'] / GIB:.2f}, compute "
                  f"{s['device_compute_bytes'] / GIB:.2f}, prefill peak {s['device_prefill_peak_bytes'] / GIB:.2f});"
                  f" now {free(model)}", flush=True)
        del engines, records, e   # every session freed before the next fit reads the free memory


if __name__ == "__main__":
    main()
