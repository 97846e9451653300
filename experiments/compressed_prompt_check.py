"""Is a pooled failure inherent to seeing only the resident chunks? Runs the full cache on a prompt made of
just the chunks an oracle would keep (sink + the passkey's chunk + the tail + `extra` other chunks), laid
out contiguously, and says whether the key is found. Compare with the oracle rows of
experiments/retrieval_sweep.py on the same cases (same seed, length and format).

  python experiments/compressed_prompt_check.py --cases 0,1,2,6 [--others recent|early] [--format chat]
"""
from __future__ import annotations

import argparse

import kvflash_ggml as kvf
from kvflash_ggml.bench.retrieval import tasks
from kvflash_ggml.bench.retrieval.cases import Renderer
from kvflash_ggml.known_models import resolve_model_path

C = 64
TAIL_CHUNKS = 5   # the engine's 4 protected tail chunks plus the partial last one


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--n", type=int, default=18, help="cases generated (as retrieval_sweep.py --cases)")
    ap.add_argument("--cases", default="0,1,2,6", help="indices of the cases to check")
    ap.add_argument("--extra", default="0,4,11", help="numbers of other chunks kept besides sink, key, tail")
    ap.add_argument("--others", default="recent", choices=["recent", "early"])
    ap.add_argument("--format", default="chat", choices=["chat", "plain"])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    path = resolve_model_path(args.model)
    tok = kvf.Tokenizer(path)
    r = Renderer(tok, args.format)
    cases = tasks.generate("passkey", r, args.length, args.n, seed=0)
    llm = kvf.Model(path, n_ctx=args.length, n_threads=args.threads)
    for i in (int(x) for x in args.cases.split(",")):
        case, prompt, key = cases[i], r.tokens(cases[i]), cases[i].answers[0]
        n = -(-len(prompt) // C)
        needle = [k for k in range(n) if key in tok.decode(prompt[k * C:(k + 1) * C + 8])]
        tail = list(range(n - TAIL_CHUNKS, n))
        for extra in (int(x) for x in args.extra.split(",")):
            others = (list(range(1, 1 + extra)) if args.others == "early"
                      else list(range(n - TAIL_CHUNKS - extra, n - TAIL_CHUNKS)))
            keep = sorted({0, *needle, *others, *tail})
            short = [t for k in keep for t in prompt[k * C:(k + 1) * C]]
            out = "".join(rec.text for rec in llm.engine.generate(short, max_tokens=12, temperature=0.0))
            print(f"case {i} depth {case.meta['depth']} {case.meta['filler']:<6} chunks {len(keep):>3} "
                  f"key chunk {needle} found {key in out}  {out[:40]!r}", flush=True)


if __name__ == "__main__":
    main()
