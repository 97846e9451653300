"""Speculative decoding verified on the pool.

A drafter proposes k tokens after the held history; the model runs the pending token and the k drafts as one
step through its pooled session (slot-mapped writes, the slot mask's causal order among the drafts), which
gives k + 1 rows of logits at the price of about one weight read. The model keeps the drafts its own choice
agrees with and one token of its own after them; the rejected positions are truncated from the session (the
pager forgets them, their slots go back to the pool). A linear-attention state (qwen35) cannot forget: the engine
stashes it on the device before the step and, when a draft is rejected, goes back there and runs the kept tokens
again (Generation._verify_drafts).

- Greedy: draft i is kept while it equals the argmax of row i; the next token is the argmax after the last
  kept one. The tokens are exactly plain greedy decoding's (up to the float summation order of a batched step).
- Sampled (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"): draft i, drawn
  from the drafter's distribution q, is kept with probability min(1, p(d) / q(d)) under the model's sampling
  distribution p (temperature, top-k, top-p, min-p); at the first rejection the next token is drawn from
  normalize(max(p - q, 0)), and after k kept drafts from p. Prompt lookup proposes deterministically (q is one-hot).
  Every emitted token is then distributed as plain sampling's.

Drafters: PromptLookup (n-gram lookup in the history: no second model), DraftModel (a smaller GGUF of the
same vocabulary, its own pooled session that follows the history) and TextMappedDraft (a DraftModel of another
vocabulary, mapped through text); MtpDraft (mtp.py) drafts with the model's own multi-token-prediction head.
Speculator holds the drafter, the adaptive draft length and the counters stats() reports.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import numpy as np

from . import _core
from .companion import retokenise
from .drafter import prompt_attention_scores
from .options import PoolConfig, SamplingParams, SpeculativeConfig
from .sampling import Proposal, Sampler, draft_in_steps
from .tokenizer import Tokenizer
from .tokens import common_prefix, forward_in_steps, keep_prefix

log = logging.getLogger(__name__)


class PromptLookup:
    """Proposes what followed the latest earlier occurrence of the history's last n tokens (n = ngram, then
    fewer, down to 1), as llama.cpp's prompt-lookup decoding does. The index (n-gram -> the positions after its
    occurrences, in order) follows the history: it grows with the tokens picked, and a prompt (follow) or a
    history that shares only a prefix with the indexed one (the next generation from the same prompt, a rewind)
    drops the positions past that prefix instead of indexing everything again (4 ms for a 4K-token prompt)."""

    def __init__(self, ngram: int) -> None:
        self.ngram = ngram
        self._seen: list[int] = []
        self._index: list[dict[tuple, list[int]]] = [{} for _ in range(ngram + 1)]

    def propose(self, history: Sequence[int], k: int, sampler: Sampler) -> tuple[list[int], None]:
        self._sync(history)
        h = self._seen
        for n in range(min(self.ngram, len(h) - 1), 0, -1):
            at = self._index[n].get(tuple(h[-n:]))
            if at:
                return list(h[at[-1]:at[-1] + k]), None
        return [], None

    def follow(self, history: Sequence[int]) -> None:
        """After a prompt: index it now (part of the prompt's time, not of the first step's). The history of a
        later propose() extends this one (a generation's tokens)."""
        self._sync(history, compare=True)

    def _sync(self, history: Sequence[int], compare: bool = False) -> None:
        h, m = self._seen, len(self._seen)
        # Within a generation the history extends the indexed one (only its last indexed token is checked);
        # a new prompt (compare) or a history that does not extend it keeps what the two share.
        if compare or len(history) < m or list(history[max(0, m - 1):m]) != h[max(0, m - 1):m]:
            self._truncate(common_prefix(h, history))
            m = len(h)
        h.extend(history[m:])
        # n-grams ending before the last token: each has at least one token after it to propose
        for end in range(max(m, 1), len(h)):
            for n in range(1, min(self.ngram, end) + 1):
                self._index[n].setdefault(tuple(h[end - n:end]), []).append(end)

    def _truncate(self, keep: int) -> None:
        h = self._seen
        for end in range(len(h) - 1, max(keep, 1) - 1, -1):   # each n-gram's latest position is its last
            for n in range(1, min(self.ngram, end) + 1):
                key = tuple(h[end - n:end])
                at = self._index[n][key]
                at.pop()
                if not at:
                    del self._index[n][key]
        del h[keep:]


class DraftModel:
    """A smaller model of the same vocabulary in a pooled session of its own (the same pool size as the
    model's, so its memory is bounded too) that follows the history and proposes its own next tokens: its
    greedy choices when the model decodes greedily, samples from its sampling distribution otherwise (returned
    with their probabilities, for the acceptance rule). A prompt larger than the pool runs layer-major, as the
    model's does, so both see the same context."""

    def __init__(self, model: _core.Model, session: _core.Session, pool: PoolConfig) -> None:
        self.model = model
        self.pool = pool
        self.session = session
        self._synced = 0   # history[:_synced] is what the last call saw, and the session holds it

    def follow(self, history: Sequence[int], *, unchanged: int = 0) -> np.ndarray:
        """Make the draft session hold `history` (computing only what differs); its logits after the last token.
        unchanged: its first tokens that are the last call's too (within a generation: all that call saw), so
        only what follows them is compared."""
        logits = self.run_caught_up(self.catch_up(history, unchanged=unchanged))
        self._synced = len(history)
        return logits

    def catch_up(self, history: Sequence[int], *, unchanged: Optional[int] = None) -> np.ndarray:
        """follow's first half: the session goes back to what it shares with `history`; the tokens of history it
        must still run, from its n_tokens on (at least the last one: its logits are wanted). Call synced(history)
        once they ran. unchanged: as for follow; None: history extends the last call's."""
        s = self.session
        start = min(self._synced if unchanged is None else unchanged, self._synced, s.n_tokens)
        n_keep = s.shared_prefix(np.asarray(history[start:], dtype=np.int32), start)
        n_keep = keep_prefix(s, min(n_keep, len(history) - 1))   # the last token runs for its logits
        return np.asarray(history[n_keep:], dtype=np.int32)

    def synced(self, history: Sequence[int]) -> None:
        """The session ran catch_up(history)'s tokens (elsewhere: a batched step): the next call compares from there."""
        self._synced = len(history)

    def runs_in_one_step(self, new: np.ndarray) -> bool:
        """Whether catch_up's tokens can run as one decode or verify step (a batched step's rows): a few tokens
        the pool places at once, not a prompt."""
        return len(new) <= _core.BatchDecoder.max_session_rows and self.session.step_tokens(len(new)) >= len(new)

    def run_caught_up(self, new: np.ndarray) -> np.ndarray:
        """follow's second half, alone: catch_up's tokens from the session's n_tokens on; the logits after them."""
        s = self.session
        n_keep = s.n_tokens
        # Layer-major for new tokens the pool cannot hold (a prompt), never for a generation's few: it copies
        # every held position's K/V through the staging layer, a cost that grows with the context (at 128K on
        # the H100 it made speculation 25x slower than plain decoding), and the draft's own steps attend the
        # pool anyway.
        if not s.full_cache and len(new) > s.pager.config().pool_tokens:
            step = self.pool.exact_prefill_batch(s.flash_attn)
            logits, attention = s.prefill_exact(new, n_keep, n_batch=step)
            if s.pager.n_chunks() > s.pager.n_blocks():   # what the model's post-prompt reselect pages in, too
                s.reselect(prompt_attention_scores(attention, s.pager.n_chunks()))
            return logits
        return forward_in_steps(s, new, n_keep)

    def propose(self, history: Sequence[int], k: int, sampler: Sampler, *,
                unchanged: Optional[int] = None) -> tuple[list[int], Optional[list[np.ndarray]]]:
        """unchanged: as for follow; None: history extends the last call's (a generation's next step)."""
        s = self.session
        logits = self.follow(history, unchanged=self._synced if unchanged is None else unchanged)
        drafts: list[int] = []
        q: list[np.ndarray] = []
        for i in range(k):
            if i > 0:
                logits = s.forward(np.asarray(drafts[-1:], dtype=np.int32), s.n_tokens)
            drafts.append(sampler.draft(logits, q))
        return drafts, (None if sampler.greedy else q)


def propose_with_draft_model_together(decoder: _core.BatchDecoder,
                                      drafters: Sequence[Union[DraftModel, TextMappedDraft]],
                                      histories: Sequence[Sequence[int]], lengths: Sequence[int],
                                      samplers: Sequence[Sampler]) -> list[Proposal]:
    """The proposals of several slots whose draft sessions share one draft model (decoder's), each as its drafter's
    own propose would make it: each catches up with its own history (what differs: usually the tokens its last
    verify step kept, and those of every slot in one batched step; a prompt alone), then draft step i runs every
    slot still drafting as one batched step, the draft model's weights read once for all of them. A TextMappedDraft
    drafts so in its own vocabulary (its mapped history, its greedy choices) and maps the drafts back. The drafts
    are each slot's own, but where two logits tie within float summation order (several columns of a product may
    sum in another order than one on the CPU); drafts only ever cost or save time, the model's verify step decides
    every token."""
    models, own, lengths, samplers, unchanged = zip(*map(_in_own_terms, drafters, histories, lengths, samplers))
    first = _caught_up(decoder, models, own, lengths, unchanged)

    def next_logits(i: int, who: list[int], drafts: list[list[int]]) -> Sequence[np.ndarray]:
        if i == 0:
            return [first[j] for j in who]
        return decoder.step([models[j].session for j in who], [drafts[j][-1] for j in who])

    proposals = draft_in_steps(lengths, samplers, next_logits)
    return [d.mapped_back(p[0], k) if isinstance(d, TextMappedDraft) and k > 0 else p
            for d, p, k in zip(drafters, proposals, lengths)]


def _in_own_terms(d: Union[DraftModel, TextMappedDraft], history: Sequence[int], k: int, sampler: Sampler) -> tuple:
    """What a drafter's draft model drafts from: (the model, its history, its draft length, its sampler, its unchanged
    prefix as DraftModel.follow takes it). A TextMappedDraft's in its own tokens (no drafts when they would not fit
    its session), greedily."""
    if not isinstance(d, TextMappedDraft):
        return d, history, k, sampler, None
    own = d.own_history(history, k) if k > 0 else None
    return d.draft, own, k if own is not None else 0, d.greedy, d.unchanged


def _caught_up(decoder: _core.BatchDecoder, drafters: Sequence[DraftModel], histories: Sequence[Sequence[int]],
               lengths: Sequence[int], unchanged: Sequence[Optional[int]]) -> list[Optional[np.ndarray]]:
    """Each drafter that drafts (lengths[j] > 0) made to hold its history (DraftModel.follow; unchanged[j]: as
    there), its logits after it. Those whose catch-up is one step's few tokens (as usual: the model's token after
    a verify step, and its last draft if it kept them all) run it as one batched step (step_rows: each one's rows;
    its last row's logits); a prompt runs alone."""
    out: list[Optional[np.ndarray]] = [None] * len(drafters)
    together: list[tuple[int, np.ndarray]] = []
    for j, (d, h, k, u) in enumerate(zip(drafters, histories, lengths, unchanged)):
        if k <= 0:
            continue
        new = d.catch_up(h, unchanged=u)
        if d.runs_in_one_step(new) and sum(len(n) for _, n in together) + len(new) <= _core.BatchDecoder.max_step_rows:
            together.append((j, new))
        else:
            out[j] = d.run_caught_up(new)
            d.synced(h)
    if len(together) == 1:   # alone: the session's own step
        j, new = together[0]
        out[j] = drafters[j].run_caught_up(new)
    elif together:
        rows = decoder.step_rows([drafters[j].session for j, _ in together], [n.tolist() for _, n in together])
        for (j, _), r in zip(together, rows):
            out[j] = r[-1]
    for j, _ in together:
        drafters[j].synced(histories[j])
    return out


class TextMappedDraft:
    """A draft model of another vocabulary (mapped as the drafter policy maps it): its session holds its own
    tokens for the text of the model's history, and a proposal is the model's tokens for the text of its own
    greedy continuation, less the last one (the text after it may go on with the same word). A proposal is
    then a function of the history alone (a one-hot q), so the acceptance rule keeps the model's distribution
    whatever the sampling. A history whose text takes more of its tokens than its session holds stops the
    drafting (logged once): the generation goes on one token per step.

    The mapping grows with the history: only the text from a little before the end of the last mapping is
    tokenized again (its own tokens there may merge with what follows), unless that piece does not read back
    as its text, or the history is not an extension of the last one; then the whole history is mapped. Within a
    generation (propose) the history extends the last one, so only its last mapped token is compared (as
    PromptLookup does); a prompt (follow) is compared whole."""

    MARGIN = 32   # bytes of the mapped text tokenized again with the new text

    def __init__(self, draft: DraftModel, own: Tokenizer, target: Tokenizer) -> None:
        self.draft = draft
        self.own = own
        self.target = target
        self.greedy = Sampler(SamplingParams(temperature=0.0))   # how it drafts, whatever the model samples
        self._full = False
        self._history: list[int] = []   # the model's tokens mapped so far
        self._text = b""                # their text
        self._tokens: list[int] = []    # its own tokens for that text
        self._starts: list[int] = []    # where each of them starts in the text (a BOS: at 0, no text)
        # its first tokens that every mapping since the draft session last followed one has kept
        self._unchanged = 0
        self._followed = True

    def _map(self, history: Sequence[int], compare: bool) -> list[int]:
        m = len(self._history)
        if m and len(history) >= m and (list(history[:m]) == self._history if compare else
                                        history[m - 1] == self._history[-1]):
            new_text, _ = self.target.pieces(history[m:])
            text = self._text + new_text
            # the last of its own tokens that starts MARGIN bytes or more before the old end (never a BOS)
            first = 1 if self._starts and self._tokens[0] == self.own.bos and self.own.add_bos else 0
            j = max(first, int(np.searchsorted(self._starts, len(self._text) - self.MARGIN, side="right")) - 1)
            cut = self._starts[j] if j < len(self._starts) else len(self._text)
            tail = self.own.encode(text[cut:], add_special=False, parse_special=True)
            tail_text, tail_off = self.own.pieces(tail)
            if tail_text == text[cut:]:
                self._history.extend(history[m:])
                self._text = text
                del self._tokens[j:], self._starts[j:]
                self._tokens.extend(tail)
                self._starts.extend((cut + tail_off[:-1]).tolist())
                self._unchanged = j if self._followed else min(j, self._unchanged)
                self._followed = False
                return self._tokens
        tokens, _, d_off = retokenise(np.asarray(history, dtype=np.int32), self.target, self.own)
        self._history = list(history)
        self._text, _ = self.target.pieces(history)
        self._tokens = tokens.tolist()
        self._starts = d_off[:-1].tolist()
        self._unchanged, self._followed = 0, False
        return self._tokens

    def _room_for(self, tokens: list[int], room: int) -> bool:
        limit = self.draft.session.pager.config().max_tokens
        if len(tokens) + room <= limit:
            return True
        if not self._full:
            log.warning("the history is %d tokens of the draft model's vocabulary, more than its session holds "
                        "(%d): no more drafts for it", len(tokens), limit)
        self._full = True
        return False

    def follow(self, history: Sequence[int]) -> None:
        tokens = self._map(history, compare=True)
        if self._room_for(tokens, 0):
            self.draft.follow(tokens, unchanged=self._unchanged)
            self._followed = True

    def propose(self, history: Sequence[int], k: int, sampler: Sampler) -> tuple[list[int], None]:
        tokens = self.own_history(history, k)
        if tokens is None:
            return [], None
        own, _ = self.draft.propose(tokens, k, self.greedy, unchanged=self.unchanged)
        return self.mapped_back(own, k)

    def own_history(self, history: Sequence[int], k: int) -> Optional[list[int]]:
        """propose's first part: its own tokens for the history's text, which its draft session is to hold and
        draft k tokens after (from its first `unchanged` on, as DraftModel.propose compares); None when they
        and k drafts would not fit the session."""
        tokens = self._map(history, compare=False)
        return tokens if self._room_for(tokens, k) else None

    @property
    def unchanged(self) -> int:
        """Its first tokens that every mapping since the draft session last followed one kept (what follows them
        may have changed with the new text: compared from there)."""
        return self._unchanged

    def mapped_back(self, own: list[int], k: int) -> tuple[list[int], None]:
        """propose's last part: its own drafts `own` (its draft session followed the mapped history) as at most k
        of the model's tokens."""
        self._followed = True
        text, _ = self.own.pieces(own, special=False)
        mapped = self.target.encode(text, add_special=False)
        return mapped[:max(1, len(mapped) - 1)][:k], None


def accept(drafts: Sequence[int], rows: np.ndarray, q: Optional[Sequence[np.ndarray]],
           sampler: Sampler) -> tuple[list[int], int]:
    """The drafts kept and the model's own next token, from rows [len(drafts) + 1, n_vocab]: row i is the
    model's logits before draft i (row len(drafts): after the last). q: the drafter's distribution of each
    draft (None: each draft was certain)."""
    kept: list[int] = []
    for i, d in enumerate(drafts):
        if sampler.greedy:
            choice = int(np.argmax(rows[i]))
            if choice != d:
                return kept, choice
            kept.append(d)
            continue
        p = sampler.distribution(rows[i])
        q_d = 1.0 if q is None else float(q[i][d])
        if sampler.rng.random() < min(1.0, p[d] / q_d):
            kept.append(d)
            continue
        residual = np.maximum(p - (_one_hot(d, p.shape[0]) if q is None else q[i]), 0.0)
        if residual.sum() <= 0.0:   # p and q agree everywhere but at d: p itself (happens only in float ties)
            residual = p
        return kept, sampler.choose_from(residual)
    return kept, sampler(rows[len(drafts)])


def _one_hot(i: int, n: int) -> np.ndarray:
    v = np.zeros(n, dtype=np.float64)
    v[i] = 1.0
    return v


# On the CPU a verify step of at most this many tokens computes each row with plain decoding's kernels (the
# session's one-token kernels for a step that reads every row's logits: cpp/runtime/session.cpp,
# k_one_token_kernels_max_tokens), so greedy speculation returns plain greedy decoding's tokens bit for bit; a
# longer step's rows differed by up to ~0.9 in a SmolLM2 logit and flipped near-ties. So at most 31 drafts there.
CPU_VERIFY_TOKENS = 32


class Speculator:
    """The drafter of a SpeculativeConfig, the draft length and what it achieved. The length adapts: after a
    step that kept every draft it grows by 2 (up to max_draft, and on the CPU CPU_VERIFY_TOKENS - 1); otherwise
    it becomes what was kept plus one (at least 1), so a drafter that misses costs one wasted draft per step."""

    def __init__(self, config: SpeculativeConfig, drafter: Union[PromptLookup, DraftModel, TextMappedDraft], *,
                 on_cpu: bool = False) -> None:
        self.config = config
        self.drafter = drafter
        self.max_draft = min(config.max_draft, CPU_VERIFY_TOKENS - 1) if on_cpu else config.max_draft
        self.k = max(1, self.max_draft // 2)
        self.drafted = self.accepted = self.steps = 0

    @property
    def draft_model(self) -> Optional[DraftModel]:
        """The second model's session and weights, if the drafter has one (what stats() counts)."""
        if isinstance(self.drafter, TextMappedDraft):
            return self.drafter.draft
        return self.drafter if isinstance(self.drafter, DraftModel) else None

    def follow(self, history: Sequence[int]) -> None:
        """After a prompt: a draft model computes it now, prompt lookup indexes it (part of the prompt's time,
        not of the first step's)."""
        if isinstance(self.drafter, (DraftModel, TextMappedDraft, PromptLookup)):
            self.drafter.follow(history)

    def propose(self, history: Sequence[int], room: int, sampler: Sampler):
        """Up to min(k, room) drafts (room: tokens the generation may still take, less the model's own)."""
        k = self.draft_length(room)
        return self.drafter.propose(history, k, sampler) if k > 0 else ([], None)

    def draft_length(self, room: int) -> int:
        """How many drafts the next verify step asks for (the adapted length, within room)."""
        return max(0, min(self.k, room))

    def record(self, n_drafted: int, n_kept: int) -> None:
        self.drafted += n_drafted
        self.accepted += n_kept
        self.steps += 1
        self.k = min(self.max_draft, self.k + 2) if n_kept == n_drafted else max(1, n_kept + 1)

    def stats(self) -> dict:
        mode = getattr(self.drafter, "mode", None) or \
            ("prompt_lookup" if isinstance(self.drafter, PromptLookup) else "draft_model")
        return {"spec_mode": mode,
                "spec_vocab": "mapped through text" if isinstance(self.drafter, TextMappedDraft) else "shared",
                "spec_drafted": self.drafted, "spec_accepted": self.accepted, "spec_steps": self.steps,
                "spec_acceptance": self.accepted / self.drafted if self.drafted else 0.0}
