#!/usr/bin/env python3
"""What a resend of a long prompt costs before its first token: answered from the held prompt (Engine._answer_again)
against running its last token again (what every resend did before: a one-token layer-major prefill, which stages
every position of the history). One process, one model; the second way is forced by dropping the kept answer.

    python experiments/resend_latency.py --model /tmp/l8b.gguf --lengths 32768,131072 --pool 4096
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import kvflash_ggml as kvf


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="32768")
    ap.add_argument("--pool", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    for n in map(int, args.lengths.split(",")):
        # room for the answers past the prompt, which may pass a random shape's trained context
        with kvf.Model(model_path=args.model, n_ctx=n + 256, pool_tokens=args.pool, prefill="exact",
                       backend=args.backend, allow_beyond_train_ctx=True) as llm:
            e = llm.engine
            p = np.random.default_rng(0).integers(100, 30000, n).tolist()
            first = timed(lambda: e.prefill(p))
            kept, rerun = [], []
            for _ in range(args.reps):
                llm.create_completion(p, max_tokens=16, temperature=0.0)   # the session moves past the prompt
                kept.append(timed(lambda: e.prefill(p)))
                assert e.n_computed == 0
                llm.create_completion(p, max_tokens=16, temperature=0.0)
                e._answer = None                                           # as before: the last token runs again
                rerun.append(timed(lambda: e.prefill(p)))
                assert e.n_computed == 1
            print(f"{n} tokens, pool {args.pool}: first send {first:.2f} s; resend answered from the held prompt "
                  f"{1e3 * np.median(kept):.2f} ms (runs {', '.join(f'{1e3 * t:.2f}' for t in kept)}); last token run "
                  f"again {1e3 * np.median(rerun):.1f} ms (runs {', '.join(f'{1e3 * t:.1f}' for t in rerun)})", flush=True)


if __name__ == "__main__":
    main()
