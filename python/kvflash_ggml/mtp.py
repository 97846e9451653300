"""Speculative decoding with the model's own multi-token-prediction (nextn) head as the drafter (draft="mtp").

A Qwen3.5 GGUF (qwen35, qwen35moe) may carry a nextn layer after its trunk: a full-attention block that takes the
token at position p and the trunk's output-normed hidden state at p - 1 and predicts the token at p + 1, one
further than the trunk itself. The model is loaded with it (_core.Model(mtp=True)) and the engine's own session
runs it (SessionConfig(mtp=True), cpp model/mtp.h): every forward step also writes the head's K/V, one more pooled
layer under the same pager (so paging, truncation and snapshots cover them), and keeps the trunk's last state (the
carry, beside the linear-attention state, so the stash before a verify step takes it back too). There is no second
session to keep in step: a draft is Session.mtp_draft, one step of the head per token, the first from the pending
token and the carry, each next one from the draft before it and the head's own output (llama.cpp's MTP drafter).
Verification, the acceptance rule and rollback are speculative.py's and engine.py's, as for every drafter.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from . import _core
from .options import SpeculativeConfig
from .sampling import Proposal, Sampler, draft_in_steps

HEAD_ARCHS = ("qwen35", "qwen35moe")   # families whose nextn layer the core runs


def wants_mtp(config: Optional[SpeculativeConfig]) -> bool:
    """The configuration drafts with the model's own head (the model must be loaded with mtp=True)."""
    return config is not None and isinstance(config.draft, str) and config.draft == "mtp"


def check_mtp(model: _core.Model) -> None:
    """ValueError naming what is missing unless the model can draft with its own head."""
    hp = model.hparams
    if hp.arch not in HEAD_ARCHS or hp.n_layer_nextn == 0:
        where = f"this {hp.arch} GGUF has none" if hp.arch in HEAD_ARCHS else \
            f"the {hp.arch} family has none here (only {', '.join(HEAD_ARCHS)})"
        raise ValueError(f"speculative draft 'mtp' needs the GGUF's multi-token-prediction (nextn) layers; {where}")
    if not model.has_mtp:
        raise ValueError("speculative draft 'mtp': the model was loaded without its multi-token-prediction (nextn) "
                         "head; load it with _core.Model(path, mtp=True) (kvflash_ggml.Model(speculative='mtp') does)")


class MtpDraft:
    """Drafts with the head of the session that verifies them (made with mtp=True): the head's greedy choices when
    the model decodes greedily, samples from its sampling distribution otherwise (returned with their
    probabilities, for the acceptance rule). A pool with no free slot (full, at a chunk boundary) drafts nothing
    for that step."""

    mode = "mtp"

    def __init__(self, session: _core.Session) -> None:
        if not session.mtp:
            raise ValueError("the MTP drafter needs a session made with mtp=True")
        self.session = session

    def propose(self, history: Sequence[int], k: int, sampler: Sampler) -> tuple[list[int], Optional[list[np.ndarray]]]:
        """Up to k drafts after history, whose last token is the one the session is fed next."""
        s = self.session
        if len(history) != s.n_tokens + 1:
            raise RuntimeError(f"the MTP drafter drafts after the session's {s.n_tokens} tokens and the pending one; "
                               f"got a history of {len(history)}")
        drafts: list[int] = []
        q: list[np.ndarray] = []
        token = int(history[-1])
        for i in range(min(k, s.mtp_room())):
            token = sampler.draft(s.mtp_draft(token, i), q)
            drafts.append(token)
        return drafts, (None if sampler.greedy else q)


def propose_together(decoder: _core.BatchDecoder, sessions: Sequence[_core.Session], tokens: Sequence[int],
                     lengths: Sequence[int], samplers: Sequence[Sampler]) -> list[Proposal]:
    """MtpDraft.propose for several sessions at once: session j drafts up to lengths[j] tokens after tokens[j] (its
    pending token), and each draft step runs the head for every session still drafting in one graph
    (BatchDecoder.mtp_draft). The same drafts as each session's own propose: the logits are its mtp_draft's."""
    def next_logits(i: int, who: list[int], drafts: list[list[int]]) -> np.ndarray:
        return decoder.mtp_draft([sessions[j] for j in who], [drafts[j][-1] if i else int(tokens[j]) for j in who], i)

    return draft_in_steps([min(k, s.mtp_room()) for k, s in zip(lengths, sessions)], samplers, next_logits)
