"""How sure is libllama's full cache of a case's answer? For each answer token (teacher-forced), the logit
margin of the right token over the best other one. A case whose margin is a fraction of a logit is a near
tie: any change in numerics (another backend, a pool that drops filler) may flip it, so a pooled miss there
says little about residency.

  python experiments/answer_margins.py --task multikey --n 30 --cases 3,4,14,23
"""
from __future__ import annotations

import argparse

import numpy as np

import reference_cases


def main() -> None:
    ap = argparse.ArgumentParser()
    reference_cases.add_arguments(ap, task="multikey", n=10)
    rc = reference_cases.load(ap.parse_args())
    tok, r, cases, ref = rc.tokenizer, rc.renderer, rc.cases, rc.llama
    for i in rc.picked:
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
