"""Scoring one case on one engine: free greedy generation, then teacher forcing.

Order matters. Free generation goes first and through Engine.generate, the path users take (so any
reselect the engine does after the prompt or every tau tokens is exercised). Teacher forcing then
rewinds to the prompt (Engine.prefill keeps the common prefix and re-runs only the last prompt
token) and feeds the answer tokens in one all-logits forward; it sees the residency that generation
left, which differs from the post-prompt one by at most the few chunks that <= max_new_tokens of
decode could push out.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .cases import Case


@dataclass
class CaseResult:
    score: float        # fraction of the answers found in the generated text (case-insensitive)
    tf: float           # fraction of answer tokens that are the argmax under teacher forcing
    output: str
    n_prompt: int
    seconds: float

    def to_json(self) -> dict:
        return {"score": self.score, "tf": round(self.tf, 4), "output": self.output, "n_prompt": self.n_prompt,
                "seconds": round(self.seconds, 2)}


def found_fraction(output: str, answers: Sequence[str]) -> float:
    low = output.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


def reset(engine) -> None:
    """Forget every token, so a case never shares KV (or residency) with the one before it.
    An engine that knows how to reset itself (policy state too) is asked to."""
    if hasattr(engine, "reset"):
        engine.reset()
        return
    engine.session.truncate(0)


def generate_free(engine, prompt: Sequence[int], case: Case) -> str:
    """Greedy output, stopped early once every answer is in it (a found answer stays found)."""
    text = ""
    for rec in engine.generate(list(prompt), max_tokens=case.max_new_tokens, temperature=0.0):
        text += rec.text
        if found_fraction(text, case.answers) == 1.0:
            break
    return text


def teacher_forced(engine, prompt: Sequence[int], answer: Sequence[int]) -> float:
    """Fraction of answer tokens predicted (argmax) when the true answer is fed after the prompt."""
    logits = engine.prefill(prompt)
    preds = [int(np.argmax(logits))]
    if len(answer) > 1:
        fed = np.asarray(answer[:-1], dtype=np.int32)
        rows = engine.session.forward(fed, engine.session.n_tokens, all_logits=True)
        preds += [int(i) for i in np.asarray(rows).reshape(len(fed), -1).argmax(axis=1)]
    return float(np.mean(np.asarray(preds) == np.asarray(answer)))


def run_case(engine, prompt: Sequence[int], answer: Sequence[int], case: Case) -> CaseResult:
    reset(engine)
    t0 = time.perf_counter()
    output = generate_free(engine, prompt, case)
    tf = teacher_forced(engine, prompt, answer)
    return CaseResult(score=found_fraction(output, case.answers), tf=tf, output=output, n_prompt=len(prompt),
                      seconds=time.perf_counter() - t0)
