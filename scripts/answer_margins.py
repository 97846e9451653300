"""How sure is libllama's full cache of a case's answer? For each answer token (teacher-forced), the logit
margin of the right token over the best other one. A case whose margin is a fraction of a logit is a near
tie: any change in numerics (another backend, a pool that drops filler) may flip it, so a pooled miss there
says little about residency.

  python scripts/answer_margins.py --task multikey --n 30 --cases 3,4,14,23
"""
from __future__ import annotations

import argparse

import numpy as np

import kvflash_ggml as kvf
from kvflash_ggml import _core
from kvflash_ggml.bench.retrieval import tasks
from kvflash_ggml.bench.retrieval.cases import Renderer
from kvflash_ggml.model import resolve_model_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--task", default="multikey")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--n", type=int, default=10, help="cases generated (as kvflash bench --cases)")
    ap.add_argument("--cases", required=True, help="comma-separated case indices")
    ap.add_argument("--format", default="chat", choices=["chat", "plain"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    tok = kvf.Tokenizer(path)
    r = Renderer(tok, args.format)
    cases = tasks.generate(args.task, r, args.length, args.n, seed=0)
    ref = _core.LlamaReference(path, n_ctx=args.length, n_threads=args.threads)
    for i in (int(x) for x in args.cases.split(",")):
        prompt = r.tokens(cases[i])
        answer = r.answer_tokens(cases[i], prompt)
        ref.clear()
        logits = np.asarray(ref.decode(prompt)).ravel()
        rows = []
        for j, t in enumerate(answer):
            other = logits.copy()
            other[t] = -np.inf
            rows.append(f"{tok.decode([t])!r} {logits[t] - other.max():+.2f} (vs {tok.decode([int(other.argmax())])!r})")
            if j + 1 < len(answer):
                logits = np.asarray(ref.decode([t])).ravel()
        print(f"case {i} {cases[i].answers}: " + ", ".join(rows), flush=True)


if __name__ == "__main__":
    main()
