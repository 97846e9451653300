"""Which part of the pooled state loses a passkey? libllama computes the whole prompt with a full cache (every
K/V sees its full context, original positions), then forgets every chunk but the ones a pool would hold
(sink + the key's chunk + the tail + `extra` recent chunks) and generates. If libllama then finds the key
where our pooled run with an oracle policy does not, the loss comes from K/V computed under the streaming
window of pooled prefill, not from the sparse positions or the choice of chunks.

  python experiments/residency_reference_check.py --cases 0,6 [--extra 9,1] [--format chat]

--extra lists, largest first, how many recent chunks besides sink, key and tail stay (9 fills a pool of 1024
tokens, 1 a pool of 512); each smaller set is cut from the previous one, so one full prefill serves all.
"""
from __future__ import annotations

import argparse

import numpy as np

import reference_cases

C = 64
TAIL_CHUNKS = 5   # the engine's 4 protected tail chunks plus the partial last one


def greedy(ref, first: int, n: int) -> list[int]:
    out, tok = [], first
    for _ in range(n):
        tok = int(np.asarray(ref.decode([tok])).argmax())
        out.append(tok)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    reference_cases.add_arguments(ap, task="passkey", n=18)
    ap.add_argument("--extra", default="9,1", help="recent chunks kept besides sink, key and tail, largest first")
    args = ap.parse_args()
    rc = reference_cases.load(args)
    tok, r, cases, ref, picked = rc.tokenizer, rc.renderer, rc.cases, rc.llama, rc.picked
    extras = sorted((int(x) for x in args.extra.split(",")), reverse=True)
    hits = {"full": 0, **{e: 0 for e in extras}}
    for i in picked:
        case, prompt, key = cases[i], r.tokens(cases[i]), cases[i].answers[0]
        n = len(prompt)
        ref.clear()
        ref.decode(prompt[:-1])
        first = int(np.asarray(ref.decode(prompt[-1:])).argmax())
        full = tok.decode([first] + greedy(ref, first, 7))
        hits["full"] += key in full
        line = f"case {i} depth {case.meta['depth']} {case.meta['filler']:<6} key {key}: full {key in full} {full!r}"
        n_chunks = -(-n // C)
        needle = [k for k in range(n_chunks) if key in tok.decode(prompt[k * C:(k + 1) * C + 8])]
        for extra in extras:
            ref.remove(n - 1, ref.n_past)   # back to the prompt without its last token
            keep = {0, *needle, *range(n_chunks - TAIL_CHUNKS - extra, n_chunks)}
            for k in range(n_chunks - TAIL_CHUNKS):
                if k not in keep:
                    ref.remove(k * C, (k + 1) * C)
            first = int(np.asarray(ref.decode(prompt[-1:])).argmax())
            pooled = tok.decode([first] + greedy(ref, first, 7))
            hits[extra] += key in pooled
            line += f"; {len(keep)} chunks {key in pooled} {pooled!r}"
        print(line, flush=True)
    print("recall", {k: round(v / len(picked), 3) for k, v in hits.items()})


if __name__ == "__main__":
    main()
