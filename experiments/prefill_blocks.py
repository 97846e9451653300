"""Exact (layer-major) prefill speed and workspace against the attention block budget (Session.prefill_exact's
attention_block_bytes): what blocking a step's queries costs in speed and saves in memory, one prefill per cell,
each from an empty session, on the model given (the H100 runs used the 8B shape, random Q4_0 weights).

    python experiments/prefill_blocks.py MODEL --lengths 32768,131072 --budgets 32,64,128,4096 [--pool 4096]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from kvflash_ggml import _core
from kvflash_ggml.options import PoolConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--budgets", default="32,64,128,4096", help="attention_block_bytes in MiB")
    ap.add_argument("--pool", type=int, default=4096)
    args = ap.parse_args()
    model = _core.Model(args.model, backend="auto")
    mib = 1 << 20
    print(f"{'length':>7} {'budget MiB':>10} {'tok/s':>8} {'workspace MiB':>13} {'staging MiB':>11} {'rest MiB':>8}")
    for n in (int(x) for x in args.lengths.split(",")):
        toks = np.random.default_rng(0).integers(100, model.hparams.n_vocab - 100, n).astype(np.int32)
        n_ctx = -(-n // _core.CHUNK_TOKENS) * _core.CHUNK_TOKENS
        step = PoolConfig(n_ctx=n_ctx, pool_tokens=args.pool).exact_prefill_batch(True)
        for budget in (int(x) for x in args.budgets.split(",")):
            sess = _core.Session(model, _core.SessionConfig(max_tokens=n_ctx, pool_tokens=args.pool, attention="flash",
                                                            allow_beyond_train_ctx=True))
            t0 = time.perf_counter()
            sess.prefill_exact(toks, 0, n_batch=step, attention_block_bytes=budget * mib)
            dt = time.perf_counter() - t0
            mem = sess.memory()
            peak, stage = mem["prefill_peak_bytes"], mem["prefill_staging_bytes"]
            print(f"{n:>7} {budget:>10} {n / dt:>8.0f} {peak / mib:>13.0f} {stage / mib:>11.0f} {(peak - stage) / mib:>8.0f}",
                  flush=True)
            del sess


if __name__ == "__main__":
    main()
