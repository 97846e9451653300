"""Passkey recall at one length over policies x pools x post-prompt refresh lengths (x query-aware prefill),
with an oracle policy (the chunks that hold the key score 1) to separate scoring from paging mechanics.

  python experiments/retrieval_sweep.py --model PATH --length 8192 --cases 18 --json out.json
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import kvflash_ggml as kvf
from kvflash_ggml.bench.retrieval import tasks
from kvflash_ggml.bench.retrieval.cases import Renderer
from kvflash_ggml.bench.retrieval.scoring import run_case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--cases", type=int, default=18)
    ap.add_argument("--task", default="passkey")
    ap.add_argument("--policies", default="oracle,qk,quest,drafter")
    ap.add_argument("--pools", default="512,1024")
    ap.add_argument("--refresh", default="8,64,256")
    ap.add_argument("--prefill", default="pooled", help="comma-separated Engine prefill modes (pooled, exact)")
    ap.add_argument("--only", default="", help="comma-separated case indices to run (default: all --cases)")
    ap.add_argument("--n-batch", default="512", help="comma-separated prefill batch sizes (PoolConfig.n_batch)")
    ap.add_argument("--prefill-reselect", default="off", help="off, on or both")
    ap.add_argument("--format", default="chat", choices=["chat", "plain"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    tok = kvf.Tokenizer(args.model)
    r = Renderer(tok, args.format)
    cases = tasks.generate(args.task, r, args.length, args.cases, seed=0)
    prepared = [(c, r.tokens(c)) for c in cases]
    prepared = [(c, p, r.answer_tokens(c, p)) for c, p in prepared]
    if args.only:
        prepared = [prepared[int(i)] for i in args.only.split(",")]
    current = {"answers": []}

    def oracle(view):
        C = view.chunk_tokens
        hist = list(view.tokens)
        s = np.zeros(view.n_chunks, np.float32)
        for c in range(view.n_chunks):
            text = tok.decode(hist[c * C:(c + 1) * C + 8])
            s[c] = float(any(a in text for a in current["answers"]))
        return s

    pf_variants = {"off": [False], "on": [True], "both": [False, True]}[args.prefill_reselect]
    rows = []
    for pool in [int(x) for x in args.pools.split(",")]:
        for pol in args.policies.split(","):
            for pf, n_batch, mode in [(pf, nb, m) for pf in pf_variants for nb in map(int, args.n_batch.split(","))
                                      for m in args.prefill.split(",")]:
                llm = kvf.Model(args.model, n_ctx=args.length, pool_tokens=pool, n_batch=n_batch, prefill=mode,
                                policy=oracle if pol == "oracle" else pol, n_threads=args.threads,
                                prefill_reselect=pf, drafter_model=args.model if pol == "drafter" else None)
                for refresh in [int(x) for x in args.refresh.split(",")]:
                    llm.engine.refresh_tokens = refresh
                    t0 = time.perf_counter()
                    res = []
                    for c, p, a in prepared:
                        current["answers"] = c.answers
                        res.append(run_case(llm.engine, p, a, c))
                    row = {"format": args.format, "policy": pol, "pool": pool, "n_batch": n_batch, "prefill": mode, "prefill_reselect": pf, "refresh": refresh,
                           "recall": float(np.mean([x.score for x in res])), "tf": float(np.mean([x.tf for x in res])),
                           "by_case": [x.score for x in res], "seconds": round(time.perf_counter() - t0, 1)}
                    rows.append(row)
                    print(f"{args.format:>5} {pol:>8} pool {pool:>5} n_batch {n_batch:>4} {mode:>6} pf {int(pf)} refresh {refresh:>4}: recall {row['recall']:.3f} "
                          f"tf {row['tf']:.3f}  {''.join(str(int(s)) for s in row['by_case'])}  {row['seconds']}s",
                          flush=True)
                    if args.json:
                        json.dump(rows, open(args.json, "w"), indent=1)
                llm.close()


if __name__ == "__main__":
    main()
