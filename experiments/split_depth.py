"""Pooled decode of a split model at depths its CPU half cannot prefill in a device session (issue 24's "pooled flat
to 128K"): the prompt runs on the GPU alone (exact prefill into the same pool), the session is saved, and the
snapshot, which does not depend on the split, is restored on the split (GPU + ggml-rpc-server) and decodes there.
Prints decode tok/s of the split at each depth (median of --reps windows of --n-gen greedy tokens) and the GPU
memory the split model and its session took (driver's figure).

    ggml-rpc-server -H 127.0.0.1 -p PORT -d CPU &
    python experiments/split_depth.py --model l8b.gguf --rpc 127.0.0.1:PORT --depths 0,8192,131008 --pool 1024
"""
import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from kvflash_ggml import _core

C = _core.CHUNK_TOKENS


def gpu_free():
    devices = _core.gpu_devices()
    return devices[0]["memory_free"] if devices else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rpc", required=True)
    ap.add_argument("--tensor-split", default="1,1")
    ap.add_argument("--depths", default="0,8192,131008")
    ap.add_argument("--pool", type=int, default=1024)
    ap.add_argument("--n-gen", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the snapshots go")
    ap.add_argument("--backend", default="cuda", help="where the prompt runs alone (cpu: a dry run)")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    split_shares = [float(x) for x in args.tensor_split.split(",")]

    gpu = _core.Model(args.model, backend=args.backend)
    free0 = gpu_free()
    split = _core.Model(args.model, rpc=[args.rpc], tensor_split=split_shares)
    print("split:", [(d["name"], d["layers"][0], d["layers"][-1]) for d in split.devices], flush=True)
    rng = np.random.default_rng(0)
    for depth in depths:
        n = depth + 1   # depth tokens of context, then the first decode input
        max_tokens = max(args.pool, -(-(n + args.n_gen * (args.reps + 1) + 1) // C) * C)
        cfg = _core.SessionConfig(max_tokens=max_tokens, pool_tokens=args.pool, allow_beyond_train_ctx=True)
        prompt = rng.integers(100, gpu.hparams.n_vocab - 100, n, dtype=np.int32)
        t0 = time.perf_counter()
        s = _core.Session(gpu, cfg)
        logits = s.prefill_exact(prompt, 0)[0] if n > args.pool else s.forward(prompt, 0)
        t_prefill = time.perf_counter() - t0
        path = os.path.join(args.dir, f"split-depth-{depth}.kvf")
        t0 = time.perf_counter()
        s.save(path)
        t_save = time.perf_counter() - t0
        del s
        t0 = time.perf_counter()
        r = _core.Session.restore(split, path, max_tokens=max_tokens)
        t_restore = time.perf_counter() - t0
        token = int(np.argmax(logits))
        token = int(np.argmax(r.forward(np.array([token], np.int32), r.n_tokens)))   # warm-up (graph build)
        rates = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            for _ in range(args.n_gen):
                token = int(np.argmax(r.forward(np.array([token], np.int32), r.n_tokens)))
            rates.append(args.n_gen / (time.perf_counter() - t0))
        taken = (free0 - gpu_free()) / 2**20
        mem = r.memory()
        print(f"depth {depth}: split pooled decode {statistics.median(rates):.1f} tok/s (windows "
              f"{', '.join(f'{x:.1f}' for x in rates)}); GPU MiB taken by the split model + session {taken:.0f}; "
              f"pool per device MiB {[round(d['pool_bytes'] / 2**20) for d in mem['devices']]}; host KV MiB "
              f"{r.kv.host_bytes / 2**20:.0f}; prefill on the GPU alone {n / t_prefill:.0f} tok/s, save {t_save:.1f} s, "
              f"restore on the split {t_restore:.1f} s", flush=True)
        del r
        os.remove(path)


if __name__ == "__main__":
    main()
