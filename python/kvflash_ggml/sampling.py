"""Next-token sampling over a logits vector: greedy, temperature, top-k, top-p, min-p (vectorised)."""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from .options import SamplingParams


Proposal = tuple[list[int], Optional[list[np.ndarray]]]   # a drafter's drafts, and their distributions when sampling


def draft_in_steps(lengths: Sequence[int], samplers: Sequence[Sampler],
                   next_logits: Callable[[int, list[int], list[list[int]]], Sequence[np.ndarray]]) -> list[Proposal]:
    """Drafts of several drafters in shared steps: drafter j drafts lengths[j] tokens; step i asks next_logits(i,
    who, drafts) for the logits of the drafters still drafting (who, in order; drafts: each one's drafts so far),
    and each picks its next draft from its row with its own sampler (Sampler.draft)."""
    drafts: list[list[int]] = [[] for _ in lengths]
    q: list[list[np.ndarray]] = [[] for _ in lengths]
    for i in range(max(lengths, default=0)):
        who = [j for j, k in enumerate(lengths) if k > i]
        for j, row in zip(who, next_logits(i, who, drafts)):
            drafts[j].append(samplers[j].draft(row, q[j]))
    return [(d, None if sampler.greedy else qj) for d, qj, sampler in zip(drafts, q, samplers)]


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    @property
    def greedy(self) -> bool:
        """The choice is the argmax, so the backend may take it (Engine.decode_one_greedy)."""
        return self.params.temperature <= 0.0

    def __call__(self, logits: np.ndarray) -> int:
        if self.greedy:
            return int(np.argmax(logits))
        candidates, probs = self._candidates(logits)
        return int(candidates[self.rng.choice(probs.shape[0], p=probs)])

    def distribution(self, logits: np.ndarray) -> np.ndarray:
        """The probabilities __call__ samples from, over the whole vocabulary (one-hot at the argmax when greedy):
        what speculative decoding accepts drafts against."""
        out = np.zeros(logits.shape[0], dtype=np.float64)
        if self.greedy:
            out[int(np.argmax(logits))] = 1.0
            return out
        candidates, probs = self._candidates(logits)
        out[candidates] = probs
        return out

    def draft(self, logits: np.ndarray, q: list) -> int:
        """A drafter's next token after these logits: the argmax when greedy, else a sample, its distribution
        appended to q (what the acceptance rule weighs the draft by)."""
        if self.greedy:
            return int(np.argmax(logits))
        dist = self.distribution(logits)
        q.append(dist)
        return self.choose_from(dist)

    def choose_from(self, probs: np.ndarray) -> int:
        """A token drawn from a distribution over the vocabulary (this sampler's random stream)."""
        return int(self.rng.choice(probs.shape[0], p=probs / probs.sum()))

    def _candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens that survive temperature, top_k, min_p and top_p, most likely first, and their probabilities."""
        p = self.params
        x = logits.astype(np.float64) / p.temperature
        candidates = np.arange(x.shape[0])
        if 0 < p.top_k < x.shape[0]:
            candidates = np.argpartition(-x, p.top_k - 1)[: p.top_k]
        x = x[candidates]
        order = np.argsort(-x, kind="stable")
        candidates, x = candidates[order], x[order]
        probs = np.exp(x - x[0])
        probs /= probs.sum()
        keep = np.ones_like(probs, dtype=bool)
        if p.min_p > 0.0:
            keep &= probs >= p.min_p * probs[0]
        if p.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep &= np.concatenate(([True], np.cumsum(probs)[:-1] < p.top_p))
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
        return candidates, probs


class TokenLogprobs(NamedTuple):
    logprob: float                    # of the chosen token
    top: list[tuple[int, float]]      # the most likely tokens, most likely first


def token_logprobs(logits: np.ndarray, token: int, top_n: int) -> TokenLogprobs:
    """Log-probabilities under softmax(logits) (the model's distribution, before temperature and truncation)."""
    x = logits.astype(np.float64)
    log_z = x.max() + np.log(np.exp(x - x.max()).sum())
    top = np.argpartition(-x, top_n - 1)[:top_n] if 0 < top_n < x.shape[0] else np.arange(x.shape[0] if top_n else 0)
    top = top[np.argsort(-x[top], kind="stable")]
    return TokenLogprobs(float(x[token] - log_z), [(int(t), float(x[t] - log_z)) for t in top])
