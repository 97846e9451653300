"""One generate() call as an iterator of GenerationRecords (Generation): the prompt, then a decode step per
record, or a speculative verify step whose kept tokens the next records give; a server may run its decode step
batched with other sessions' and hand the result back (advance). The Engine owns the session and the loop's
state; a Generation only steps it."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import _core
from .options import SamplingParams
from .mtp import MtpDraft, propose_together
from .sampling import Sampler, TokenLogprobs, token_logprobs
from .speculative import accept, propose_with_draft_model_together
from .tokenizer import TextStream
from .tokens import HeldHistory


class StreamSuperseded(RuntimeError):
    """The next step of a stream after a later call on the same Model / Engine took its session."""

    def __init__(self) -> None:
        super().__init__("this stream was superseded by a later call on the same Model; streams on one Model "
                         "cannot interleave (finish a stream before the next call, or use one Model per stream)")


@dataclass
class GenerationRecord:
    token: Optional[int]          # None on the closing record
    text: str                     # text this record makes visible ("" while bytes are incomplete)
    finish_reason: Optional[str]  # None while generating; "stop" or "length" on the closing record
    stats: Optional[dict] = None  # the closing record: stats() as the stream left them
    logprobs: Optional[TokenLogprobs] = None   # generate(..., logprobs=N): the token's and the top N's


class Generation:
    """One generate() call, an iterator of records: the first next() runs the prompt and picks the first
    token; each later one feeds the last token and picks the next (a decode step), until an end-of-generation
    token, a stop string, max_tokens or a full context; then a closing record with the stats.

    A server steps many at once: while needs_decode_step(), its decode step is feeding `token` and reading the
    argmax (or the logits, if wants_logits), which the caller may run for several sessions in one batched
    forward (_core.BatchDecoder) and hand back with advance(...), in place of next().

    With an engine that speculates, a decode step verifies drafts and yields several tokens: the records after it
    come from the queue of kept tokens (with their logprobs, from the verify step's rows), without a step. A
    server batches that step too, while needs_verify_step(): verify_rows() gives its tokens (the pending one and
    the drafts), the caller runs them with other sessions' (BatchDecoder.step_rows) and hands every row's logits
    back with advance_verify(...)."""

    def __init__(self, engine, tokens: list[int], params: SamplingParams, owner: int,
                 n_logprobs: Optional[int]) -> None:
        # engine: the Engine that made this generation (untyped here: engine.py imports this module)
        self.engine, self.tokens, self.params, self.owner, self.n_logprobs = engine, tokens, params, owner, n_logprobs
        self.sampler, self.stream = Sampler(params), TextStream(params.stop)
        self.token: Optional[int] = None   # the last token picked (fed by the next decode step)
        self.n_generated = 0               # token records given
        self._state = "prompt"             # prompt -> decoding -> (stopped) -> closed
        self._speculate = engine.speculator is not None
        # speculation: tokens verified, not yet given, with their logprobs (if asked)
        self._queue: list[tuple[int, Optional[TokenLogprobs]]] = []
        self._pending: Optional[tuple] = None   # verify_rows() given, its rows not yet back: (drafts, q, n0)
        self._judged: Optional[tuple] = None    # judge_verify() ran: (drafts or None, the records to give)

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> GenerationRecord:
        if self._state == "closed":
            raise StopIteration
        e = self.engine
        with e._turn(self.owner):
            if self._state == "prompt":
                self._state = "decoding"
                return self._first(e._prefill(self.tokens))
            if self._state == "stopped" or self._at_limit():
                return self._close("stop" if self._state == "stopped" else "length")
            if self._speculate:
                if not self._queue:
                    self._queue = self._verify_drafts()
                return self._emit(*self._queue.pop(0))
            if not self.wants_logits:
                return self._emit(e._decode_one_greedy(self.token), None)
            return self._emit(*self._choose(e._decode_one(self.token)))

    def step_prompt(self) -> Optional[GenerationRecord]:
        """One step of the prompt (a forward step, or one step of an exact prefill's layer), for a caller that runs
        other work between them (a server's round): None while steps are left, then the first record, as next()
        would give it. If a step raises, the session is rolled back and the generation is over."""
        e = self.engine
        with e._turn(self.owner):
            if self._state != "prompt":
                raise RuntimeError("step_prompt() after the prompt ran")
            try:
                logits = e._prompt_step(self.tokens)
            except BaseException:
                self._state = "closed"
                raise
            if logits is None:
                return None
            self._state = "decoding"
            return self._first(logits)

    def _first(self, logits: np.ndarray) -> GenerationRecord:
        token, logprobs = self._choose(logits)
        if self._speculate:
            self.engine.speculator.follow(self.tokens)
        return self._close("length") if self.params.max_tokens == 0 else self._emit(token, logprobs)

    @property
    def started(self) -> bool:
        """The prompt has run (the first record was given)."""
        return self._state != "prompt"

    def needs_decode_step(self) -> bool:
        """The next record needs a decode step: `token` fed to the session at its n_tokens (one the caller may
        batch: never a speculative one)."""
        return self._state == "decoding" and not self._at_limit() and not self._speculate

    @property
    def wants_logits(self) -> bool:
        """Its decode step must read the logits back (sampling, logprobs); else the argmax is enough."""
        return not (self.sampler.greedy and self.n_logprobs is None)

    def advance(self, next_token: Optional[int] = None, logits: Optional[np.ndarray] = None) -> GenerationRecord:
        """The next record, its decode step run by the caller: `token` was fed to the session, and next_token
        is the argmax after it, or logits are the logits after it (needed when wants_logits)."""
        e = self.engine
        with e._turn(self.owner):
            if not self.needs_decode_step():
                raise RuntimeError("advance() without a pending decode step")
            if logits is None and self.wants_logits:
                raise ValueError("this generation samples or reports logprobs: advance() needs the logits")
            e._after_decode()
            if logits is not None:
                return self._emit(*self._choose(logits))
            return self._emit(int(next_token), None)

    def close(self) -> None:
        """Stop here; a prompt left part way (step_prompt) is dropped and the session rolled back."""
        if self._state == "prompt":
            try:
                with self.engine._turn(self.owner):
                    self.engine._drop_prompt()
            except (StreamSuperseded, ValueError):   # another call took the engine (it dropped the prompt), or closed it
                pass
        self._state = "closed"

    def _at_limit(self) -> bool:
        p = self.params
        return (p.max_tokens is not None and self.n_generated >= p.max_tokens) or \
            (not self._queue and self.engine.session.n_tokens >= self.engine.pool.n_ctx)

    def needs_verify_step(self) -> bool:
        """The next record needs a speculative verify step (no kept token queued): one the caller may batch, as
        verify_rows(), the rows through the session, then advance_verify(logits)."""
        return self._speculate and self._state == "decoding" and not self._queue and not self._at_limit()

    @property
    def has_queued(self) -> bool:
        """Tokens a verify step kept are waiting: the next records need no step."""
        return bool(self._queue) and self._state == "decoding"

    def verify_rows(self) -> list[int]:
        """The verify step's tokens, fed to the session at its n_tokens: `token` and the drafts proposed after it
        (the drafter runs here), or [token] alone when it proposes none."""
        with self.engine._turn(self.owner):
            return self._propose()

    @property
    def drafts_with_head(self) -> bool:
        """Its drafts come from the model's own multi-token-prediction head, whose draft steps a server may run
        with other sessions' (verify_rows_together)."""
        return self._speculate and isinstance(self.engine.speculator.drafter, MtpDraft)

    @property
    def drafts_with_model(self) -> bool:
        """Its drafts come from a draft model (of the same vocabulary or mapped through text), whose draft steps a
        server may run with other slots' draft sessions (verify_rows_together)."""
        return self._speculate and self.engine.speculator.draft_model is not None

    def _propose(self) -> list[int]:
        """The verify step's tokens (see verify_rows); with drafts, a linear-attention state is stashed first."""
        s = self.engine.session
        # the prompt and every token picked: the session holds them but the last (drafts follow it)
        return self._with_drafts(*self.engine.speculator.propose(HeldHistory(s, self.token), self._draft_room(),
                                                                 self.sampler))

    def _draft_room(self) -> int:
        """How many drafts the verify step may carry after the pending token."""
        e, s = self.engine, self.engine.session
        p = self.params
        left = (p.max_tokens - self.n_generated if p.max_tokens is not None else e.pool.n_ctx)
        room = min(left, e.pool.n_ctx - s.n_tokens) - 1   # the pending token and the model's own take one each
        if not s.full_cache:
            # Plain decoding pages once per token; a verify step places all its tokens first. So that every
            # kept token sees the pool it would have seen, a step ends before a chunk boundary (a new chunk
            # may evict one) and, with a policy that reselects, where a reselect falls due (it then runs after
            # the same token; lru never reselects).
            C = _core.CHUNK_TOKENS
            room = min(room, C - 1 - s.n_tokens % C if s.n_tokens % C else C - 1)
            if e.policy.reselects:
                room = min(room, e.residency.reselect_every(s.n_tokens) - e._since_reselect - 1)
        return room

    def _with_drafts(self, drafts: list[int], q: Optional[list[np.ndarray]]) -> list[int]:
        """The verify step's tokens once the drafter proposed `drafts` (q: their probabilities, when sampling)."""
        s = self.engine.session
        self._pending = (list(drafts), q, s.n_tokens)
        if drafts and s.has_recurrent_state:
            s.stash()   # a linear-attention state cannot drop the rejected drafts: come back here instead
        return [self.token, *drafts]

    def advance_verify(self, rows: Optional[np.ndarray]) -> GenerationRecord:
        """The next record, the caller having fed verify_rows() to the session: rows are their logits [n, n_vocab].
        None: judge_verify(rows) ran, and the tokens it asked to run again ran."""
        with self.engine._turn(self.owner):
            if rows is not None:
                self._queue = self._verified(rows)
            elif self._judged is None:
                raise RuntimeError("advance_verify(None) without judge_verify()")
            else:
                self._queue = self._settled()
            return self._emit(*self._queue.pop(0))

    def judge_verify(self, rows: np.ndarray) -> list[int]:
        """advance_verify's first half, for a caller that runs several sessions' second steps together: the drafts
        the model keeps (the rejected positions truncated). A linear-attention state that rejected drafts went back
        to its stash: the tokens it must run again from there are returned (feed them at the session's n_tokens, every
        row's logits: plain decoding's kernels, as run_again does), else []. Then advance_verify(None)."""
        with self.engine._turn(self.owner):
            return self._judge(rows)

    def run_again(self, tokens: list[int]) -> None:
        """Run judge_verify's tokens alone."""
        with self.engine._turn(self.owner):
            self._run_again(tokens)

    def _run_again(self, tokens: list[int]) -> None:
        s = self.engine.session
        # every row's logits: a step that computes them runs plain decoding's kernels (Session: one-token kernels),
        # so the K/V and state it writes are the one-token steps' too
        s.forward(np.asarray(tokens, dtype=np.int32), s.n_tokens, all_logits=True)

    def _verified(self, rows: np.ndarray) -> list[tuple[int, Optional[TokenLogprobs]]]:
        """The drafts the model keeps and its own next token (each with its logprobs from its row, if asked), the
        rejected positions truncated."""
        again = self._judge(rows)
        if again:
            self._run_again(again)
        return self._settled()

    def _judge(self, rows: np.ndarray) -> list[int]:
        s = self.engine.session
        if self._pending is None:
            raise RuntimeError("a verify step's rows (advance_verify or judge_verify) without verify_rows()")
        (drafts, q, n0), self._pending = self._pending, None
        if not drafts:   # a plain decode step
            self._judged = (None, [self._choose(rows[0])])
            return []
        kept, own = accept(drafts, rows, q, self.sampler)
        chosen = [*kept, own]   # token i was chosen from row i
        self._judged = (len(drafts), [(t, None if self.n_logprobs is None else
                                       token_logprobs(rows[i], t, self.n_logprobs)) for i, t in enumerate(chosen)])
        if len(kept) < len(drafts) and s.has_recurrent_state:
            s.truncate(n0)   # the stash, then the kept tokens again (their K/V rewritten as they were)
            return [self.token, *kept]
        if len(kept) < len(drafts):
            s.truncate(n0 + 1 + len(kept))
        return []

    def _settled(self) -> list[tuple[int, Optional[TokenLogprobs]]]:
        """The records of the judged verify step, the session holding its kept tokens now."""
        (n_drafted, chosen), self._judged = self._judged, None
        e = self.engine
        if n_drafted is None:
            e._after_decode()
        else:
            e.speculator.record(n_drafted, len(chosen) - 1)
            e._after_decode(len(chosen))
        return chosen

    def _verify_drafts(self) -> list[tuple[int, Optional[TokenLogprobs]]]:
        """One speculative step run here: verify_rows() through the session at once, then what it kept. Falls back
        to a plain step when the drafter has nothing to propose."""
        e, s = self.engine, self.engine.session
        tokens = self._propose()   # under next()'s turn already
        if len(tokens) == 1:
            self._pending = None
            return [self._choose(e._decode_one(self.token))] if self.wants_logits else \
                [(e._decode_one_greedy(self.token), None)]
        rows = s.forward(np.asarray(tokens, dtype=np.int32), s.n_tokens, all_logits=True)
        return self._verified(rows)

    def _choose(self, logits: np.ndarray) -> tuple[int, Optional[TokenLogprobs]]:
        token = self.sampler(logits)
        return token, (None if self.n_logprobs is None else token_logprobs(logits, token, self.n_logprobs))

    def _emit(self, token: int, logprobs: Optional[TokenLogprobs]) -> GenerationRecord:
        self.token = token
        if self.engine.tokenizer.is_eog(token):
            return self._close("stop")
        text = self.stream.push(self.engine.tokenizer.piece(token))
        self.n_generated += 1
        if self.stream.stopped:
            self._state = "stopped"
        return GenerationRecord(token, text, None, logprobs=logprobs)

    def _close(self, finish: str) -> GenerationRecord:
        e = self.engine
        self._state = "closed"
        if e.store_each_turn:   # before the closing record: a consumer may stop after it
            e._store_prefix()
        return GenerationRecord(None, self.stream.flush(), finish, e._stats())


def verify_rows_together(gens: list[Generation], decoder: _core.BatchDecoder,
                         draft_decoder: Optional[_core.BatchDecoder] = None) -> list[list[int]]:
    """verify_rows() of each generation (each needs_verify_step()); the drafts of those that draft with the model's
    own head are proposed in draft steps they share (BatchDecoder.mtp_draft: the head's layer once for all), and so
    are those of the ones whose draft sessions run draft_decoder's model (propose_with_draft_model_together)."""
    heads = [g for g in gens if g.drafts_with_head]
    drafting = [g for g in gens if draft_decoder is not None and g.drafts_with_model]
    rows = _proposed_together(heads, lambda lengths: propose_together(
        decoder, [g.engine.session for g in heads], [g.token for g in heads], lengths, [g.sampler for g in heads]))
    rows.update(_proposed_together(drafting, lambda lengths: propose_with_draft_model_together(
        draft_decoder, [g.engine.speculator.drafter for g in drafting],
        [HeldHistory(g.engine.session, g.token) for g in drafting], lengths, [g.sampler for g in drafting])))
    return [rows[id(g)] if id(g) in rows else g.verify_rows() for g in gens]


def _proposed_together(group: list[Generation], propose) -> dict[int, list[int]]:
    """The verify rows of each generation of the group (by id), their drafts proposed for all at once by
    propose(lengths) (each one's draft length); none for a group of fewer than two."""
    if len(group) < 2:
        return {}
    with contextlib.ExitStack() as turns:
        for g in group:
            turns.enter_context(g.engine._turn(g.owner))
        lengths = [g.engine.speculator.draft_length(g._draft_room()) for g in group]
        return {id(g): g._with_drafts(*p) for g, p in zip(group, propose(lengths))}
