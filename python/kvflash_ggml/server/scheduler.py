"""The server's slots and the one thread that computes for all of them.

A slot is an Engine (its own session and pool) over the shared weights. Requests wait in a bounded FIFO
until a slot is free; a request goes to the free slot whose held tokens share the longest prefix with its
prompt (ties: the least recently used), and a slot taken over for another conversation first stores its
chunk-aligned prefix in the prefix cache, so a conversation that comes back resumes from it.

All computing happens on the scheduler thread, as in llama-server's main loop: each round steps every
decoding slot once (a token each), then runs one step of at most one prompt (a forward step, or one step of
an exact prefill's layer: the prompt is a resumable state, Generation.step_prompt; its last step picks the first
token): chunked prefill interleaved by the scheduler, as nano-vllm's and vLLM's rounds, with no callback into the
scheduler from inside a prompt. The decode steps of a round run as one batched forward (_core.BatchDecoder: the weights are
read once for all slots, and the slots' pools are lanes of one arena (slot_engines), so one attention call
per layer covers every slot, each over its own pool; the argmax on the backend when every slot decodes
greedily, else the logits come back) under every policy (a qk / quest slot keeps its own token's queries for
its scorer; the drafter's companion follows the history only when it scores), and so do slots that speculate: a
round's verify steps (each slot's pending token and drafts) run in the same forward (BatchDecoder.step_rows), the
kept tokens going out at the start of the next round (a hybrid's state stashed first, as alone; slots drafting with
the model's MTP head run the head's draft steps together too, and so do slots drafting with one draft model:
generation.verify_rows_together); sliding-window layers
attend each slot's own ring, a hybrid's linear-attention layers step each slot's own recurrent state in the same
forward. A long prompt does not stall
the others: each of its steps is one round's prompt work, and while slots decode an exact prefill's steps are
sized to about one decode round (_prompt_step_cap). Records go to the request's asyncio queue on the event loop
that submitted it, all at once right before the scheduler's next step (Outbox). A cancelled request (the client
went away) ends at its slot's next step, prompt steps included (the prompt is dropped: the session rolls back).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from .. import _core
from ..engine import Engine
from ..generation import Generation, GenerationRecord, verify_rows_together
from ..host_store import check_host_store
from ..options import SamplingParams

log = logging.getLogger(__name__)


def slot_engines(n_slots: int, *args: Any, **kwargs: Any) -> list[Engine]:
    """n_slots Engines (args as Engine's) whose pools are lanes of one _core.PoolArena; refused if their host stores
    together could outgrow the host (host_store.py)."""
    arena = _core.PoolArena(n_slots) if n_slots > 1 else None
    engines = [Engine(*args, arena=arena, **kwargs) for _ in range(n_slots)]
    pool = engines[0].pool
    try:
        check_host_store([e.session for e in engines], pool.n_ctx, pool.kv_type, pool.max_host_bytes)
    except ValueError:
        for e in engines:
            e.close()
        raise
    return engines


class QueueFull(RuntimeError):
    """Every slot is busy and the wait queue holds its maximum."""


class SlotBusy(RuntimeError):
    """A slot command (save, restore, erase) on a slot that is serving a request."""


class RequestCancelled(Exception):
    """A request whose client went away (or the server stopping): its slot finishes it at its next step."""


@dataclass
class Request:
    tokens: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    logprobs: Optional[int] = None
    out: asyncio.Queue = field(default_factory=asyncio.Queue)   # GenerationRecord, then None; or an Exception
    cancelled: bool = False
    slot_id: Optional[int] = None
    t_submit: float = field(default_factory=time.perf_counter)
    t_start: Optional[float] = None      # taken by a slot
    t_first: Optional[float] = None      # first token out (prompt done)


class Outbox:
    """What the scheduler thread hands the requests (records, errors, the closing None), sent to their event loops
    when flushed: one call_soon_threadsafe per loop however many items, so a round of S streams wakes the loop
    once, not S times (each wake is a write to the loop's self-pipe and a thread that wants the GIL back from
    the scheduler). The scheduler flushes right before its next step, whose core call releases the GIL for its
    whole length, so the loops' work on the records (a server's SSE chunks) runs beside the step. Flushed at a
    round's end instead, the first short call that releases the GIL (Session.n_tokens) hands it to the woken loop
    and the scheduler waits out the loop's work before stepping (2-core VM, 8 slots of a tiny model, 100 us of a
    consumer's Python per record: 1.1 ms a round against 0.93, experiments/round_overlap.py)."""

    def __init__(self) -> None:
        self._items: list[tuple[Request, Any]] = []

    def put(self, request: Request, item: Any) -> None:
        self._items.append((request, item))

    def flush(self) -> None:
        if not self._items:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Request, Any]]] = {}
        for request, item in self._items:
            by_loop.setdefault(request.loop, []).append((request, item))
        self._items = []
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_each, items)


def _put_each(items: list[tuple[Request, Any]]) -> None:   # on the requests' event loop, in the order handed
    for request, item in items:
        request.out.put_nowait(item)


class Slot:
    def __init__(self, slot_id: int, engine: Engine) -> None:
        self.id = slot_id
        self.engine = engine
        self.request: Optional[Request] = None
        self.records: Optional[Generation] = None
        self.last_used = 0.0
        # How many tokens the session held after its last request: what GET /slots shows without waiting for a
        # step. The tokens themselves are the session's alone (Session.shared_prefix compares with them).
        self.n_held = 0
        self.stats: dict = {}                # the engine's stats() after its last request
        self.n_requests = 0
        self.batchable = False               # its greedy decode steps may join a batched forward

    @property
    def busy(self) -> bool:
        return self.request is not None

    @property
    def decoding(self) -> bool:
        """Serving a request whose prompt has run."""
        return self.records is not None and self.records.started


class Scheduler:
    """batch: run the slots' greedy decode steps as one forward (off: each slot steps alone)."""

    def __init__(self, engines: list[Engine], *, max_queue: int, batch: bool = True) -> None:
        if max_queue < 0:
            raise ValueError(f"the queue length must be >= 0, got {max_queue}")
        self.slots = [Slot(i, e) for i, e in enumerate(engines)]
        self.decoder = _core.BatchDecoder(engines[0].model) if batch and len(engines) > 1 else None
        for slot in self.slots:   # a slot's session never changes kind, so this is asked once
            why = self.decoder.ineligible(slot.engine.session) if self.decoder else "batching is off"
            slot.batchable = why is None
            if why and self.decoder:
                log.info("slot %d decodes alone: %s", slot.id, why)
            slot.engine.prompt_step_cap = self._prompt_step_cap
            slot.stats = slot.engine.stats()
        self.draft_decoder = self._draft_decoder(engines) if self.decoder else None
        self.decode_round_s: Optional[float] = None   # a round of decode steps only (moving average)
        self.n_batched_steps = 0   # batched forwards run, and the tokens they decoded
        self.n_batched_tokens = 0
        self.batch_compute_bytes = 0   # the batched graphs' compute buffer (device bytes beside the slots')
        self.max_queue = max_queue
        self._pending: collections.deque[Request] = collections.deque()
        self._commands: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = collections.deque()
        self._outbox = Outbox()
        self._wake = threading.Condition()
        self._stopping = False
        self.on_finish: Callable[[Slot, Request, Optional[GenerationRecord], Optional[BaseException]], None] = \
            lambda *a: None
        self._thread = threading.Thread(target=self._loop, name="kvflash-scheduler", daemon=True)
        self._thread.start()

    @staticmethod
    def _draft_decoder(engines: list[Engine]) -> Optional[_core.BatchDecoder]:
        """A batched decoder over the slots' draft model, when each slot drafts with a draft session of that one
        model (the slots share its weights; its vocabulary the model's or mapped through text): their draft steps
        then run together. None otherwise."""
        drafters = [e.speculator.draft_model if e.speculator else None for e in engines]
        if any(d is None for d in drafters) or len({id(d.model) for d in drafters}) != 1:
            return None
        decoder = _core.BatchDecoder(drafters[0].model)
        why = [decoder.ineligible(d.session) for d in drafters]
        if any(why):
            log.info("the slots' draft steps run one by one: %s", next(w for w in why if w))
            return None
        return decoder

    # -- from the event loop ---------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        with self._wake:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            idle = sum(not s.busy for s in self.slots) - len(self._pending)
            if idle <= 0 and len(self._pending) >= self.max_queue:
                raise QueueFull(f"all {len(self.slots)} slots are busy and {len(self._pending)} requests wait")
            self._pending.append(request)
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        with self._wake:
            request.cancelled = True
            if request in self._pending:
                self._pending.remove(request)
            self._wake.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the scheduler thread between rounds (slot commands: save, restore, erase)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            self._commands.append((fn, future))
            self._wake.notify()
        return future

    @property
    def queue_length(self) -> int:
        return len(self._pending)

    def stop(self) -> None:
        """Finish: cancel what waits or runs, store every slot's prefix, join the thread."""
        with self._wake:
            self._stopping = True
            for r in list(self._pending):
                r.cancelled = True
            self._wake.notify()
        self._thread.join()

    # -- the scheduler thread --------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._pending or self._commands or any(s.busy for s in self.slots)):
                    self._outbox.flush()   # no step comes: what the last one made goes now
                    self._wake.wait()
                if self._stopping:
                    break
                commands = list(self._commands)
                self._commands.clear()
            if commands or self._pending:   # a command, or a slot taken over, may write a snapshot first
                self._outbox.flush()
            for fn, future in commands:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as e:   # noqa: BLE001 - handed to the caller
                        future.set_exception(e)
            self._admit()
            self._round()
        self._shutdown()
        self._outbox.flush()

    def _round(self) -> None:
        """Every decoding slot takes one step, the decode and verify steps that can share one batched forward
        together and the others alone; then the prompt that arrived first takes one step (at most one prompt step
        a round). A verify step's kept tokens are given at the start of the next round, all of them."""
        for slot in self.slots:   # what earlier verify steps kept goes out first: every speculating slot then verifies
            while slot.busy and slot.decoding and slot.records.has_queued:   # in this round, beside the others
                self._step(slot)
        decoding = [s for s in self.slots if s.busy and s.decoding]
        batch = [s for s in decoding if s.batchable and not s.request.cancelled and
                 (s.records.needs_decode_step() or s.records.needs_verify_step())]
        t0 = time.perf_counter()
        if len(batch) > 1 and self._batched_step(batch):
            decoding = [s for s in decoding if s not in batch]
        for slot in decoding:
            if slot.busy:   # a batched step may have finished it
                self._step(slot)
        if decoding or batch:
            took = time.perf_counter() - t0
            self.decode_round_s = took if self.decode_round_s is None else 0.8 * self.decode_round_s + 0.2 * took
        prompts = [s for s in self.slots if s.busy and not s.decoding]
        if prompts:
            self._step(min(prompts, key=lambda s: s.request.t_start))

    def _prompt_step_cap(self) -> Optional[int]:
        """Tokens per step for an exact prefill starting now: while other slots decode, each of its steps is a gap
        in their streams, so a step should take about one decode round. A layer-major step of T tokens takes about
        T / (rate x n_layer) seconds (rate: the last exact prefill's tokens per second on its own), so T = round x
        rate x n_layer, in whole chunks (the budget a round gives prompt tokens in nano-vllm's and vLLM's
        schedulers). None (the pool's step) when no other slot decodes or nothing is measured yet; on a GPU the
        answer is usually above the step anyway. On the CPU's mul_mat path the step's size changes no byte."""
        if self.decode_round_s is None or not any(s.busy and s.decoding for s in self.slots):
            return None
        rates = [s.engine.exact_prefill_tok_s for s in self.slots if s.engine.exact_prefill_tok_s]
        if not rates:
            return None
        n_layer = self.slots[0].engine.model.hparams.n_layer
        chunk = _core.CHUNK_TOKENS
        return max(chunk, int(self.decode_round_s * max(rates) * n_layer) // chunk * chunk)

    def _batched_step(self, batch: list[Slot]) -> bool:
        """One forward for the slots' decode and verify steps; False (nothing changed) if it failed, so that each
        slot steps alone and a fault stays with its own request. With a verify step among them every slot's rows
        come back as logits (BatchDecoder.step_rows: a speculating slot's pending token and drafts, another's one
        token); else the argmax, or the logits when a slot samples. The greedy token of a slot whose logits come
        back is their argmax (NumPy's, the first maximum, as the backend's)."""
        verifies = [s.records.needs_verify_step() for s in batch]
        sessions, tokens = [s.engine.session for s in batch], [s.records.token for s in batch]
        greedy = not any(verifies) and not any(s.records.wants_logits for s in batch)
        try:
            if any(verifies):   # the drafters propose here (the MTP head's steps shared); rows: [n_i, n_vocab] a slot
                proposed = iter(verify_rows_together([s.records for s, v in zip(batch, verifies) if v], self.decoder,
                                                     self.draft_decoder))
                rows = [next(proposed) if v else [t] for v, t in zip(verifies, tokens)]
            else:
                rows = [[t] for t in tokens]
            # a slot's queries come back from the device only for the reselect that reads them
            keep = [s.engine.reselects_after(len(r)) for s, r in zip(batch, rows)]
            self._outbox.flush()
            if any(verifies):
                out = self.decoder.step_rows(sessions, rows, keep)
            else:
                out = self.decoder.step_greedy(sessions, tokens, keep) if greedy else \
                    self.decoder.step(sessions, tokens, keep)[:, None]   # one row a slot
        except Exception:   # noqa: BLE001 - each slot then steps alone and meets its own error
            log.exception("a batched step of slots %s failed; stepping them one by one", [s.id for s in batch])
            return False
        self.n_batched_steps += 1
        self.n_batched_tokens += sum(len(r) for r in rows)
        self.batch_compute_bytes = self.decoder.compute_bytes + \
            (self.draft_decoder.compute_bytes if self.draft_decoder else 0)
        judged = self._judged_together([(s, r) for s, v, r in zip(batch, verifies, out) if v])
        for slot, verify, result in zip(batch, verifies, out):
            gen = slot.records
            if slot.id in judged:
                step = judged[slot.id]
            elif verify:
                step = lambda gen=gen, rows=result: gen.advance_verify(rows)
            elif greedy:
                step = lambda gen=gen, token=result: gen.advance(token)
            elif gen.wants_logits:
                step = lambda gen=gen, rows=result: gen.advance(logits=rows[0])
            else:
                step = lambda gen=gen, rows=result: gen.advance(int(np.argmax(rows[0])))
            self._deliver(slot, step)
        return True

    def _judged_together(self, verified: list[tuple[Slot, np.ndarray]]) -> dict[int, Callable[[], GenerationRecord]]:
        """The drafts each hybrid slot of a batched verify step keeps (Generation.judge_verify); those that rejected
        drafts went back to their stash and run their kept tokens again as one batched step (alone, if that fails).
        By slot id: the step that gives each one's next record (or raises its error)."""
        steps: dict[int, Callable[[], GenerationRecord]] = {}
        again: list[tuple[Slot, list[int]]] = []
        for slot, rows in verified:
            if not slot.engine.session.has_recurrent_state:
                continue   # drops its rejected drafts itself (advance_verify)
            try:
                tokens = slot.records.judge_verify(rows)
            except Exception as e:   # noqa: BLE001 - its own request fails, in _deliver
                steps[slot.id] = functools.partial(_raise, e)
                continue
            steps[slot.id] = functools.partial(slot.records.advance_verify, None)
            if tokens:
                again.append((slot, tokens))
        if len(again) > 1:
            try:
                self.decoder.step_rows([slot.engine.session for slot, _ in again], [t for _, t in again])
                return steps
            except Exception:   # noqa: BLE001 - nothing changed: each runs alone and meets its own error
                log.exception("slots %s: running their kept tokens again together failed; one by one",
                              [slot.id for slot, _ in again])
        for slot, tokens in again:
            try:
                slot.records.run_again(tokens)
            except Exception as e:   # noqa: BLE001
                steps[slot.id] = functools.partial(_raise, e)
        return steps

    def _admit(self) -> None:
        while True:
            with self._wake:   # only to take the request: assigning may write a snapshot, and submit() waits
                idle = [s for s in self.slots if not s.busy]
                if not idle or not self._pending:
                    return
                request = self._pending.popleft()
            # the longest shared prefix, then the least recently used (then the lowest id: no tie reaches the slot);
            # the prompt converted once, not once a slot
            prompt = np.asarray(request.tokens, dtype=np.int32)
            shared, _, _, slot = max((s.engine.session.shared_prefix(prompt), -s.last_used, -s.id, s) for s in idle)
            self._assign(slot, request, shared)

    def _assign(self, slot: Slot, request: Request, shared: int) -> None:
        """shared: how many leading tokens the request's prompt shares with what the slot holds."""
        engine = slot.engine
        chunk = engine.session.pager.config().chunk_tokens
        if shared < engine.session.n_tokens // chunk * chunk:
            engine.store_prefix()   # taken over: the conversation it held can come back from the cache
        slot.request = request
        request.slot_id, request.t_start = slot.id, time.perf_counter()
        try:
            slot.records = engine.generate(request.tokens, request.params, logprobs=request.logprobs)
        except Exception as e:   # noqa: BLE001 - the request's own fault (checked again by the engine)
            self._finish(slot, None, e)

    def _step(self, slot: Slot) -> None:
        """One step of the slot's request: a prompt step (no record until its last) or a decode step."""
        if slot.request.cancelled or self._stopping:
            self._finish(slot, None, RequestCancelled())
            return
        if not (slot.decoding and slot.records.has_queued):   # a kept token to give computes nothing
            self._outbox.flush()
        self._deliver(slot, (lambda: next(slot.records)) if slot.decoding else slot.records.step_prompt)

    def _deliver(self, slot: Slot, step: Callable[[], Optional[GenerationRecord]]) -> None:
        """Run one step of the slot's generation and hand its record (if it made one) to the request."""
        request = slot.request
        try:
            record = step()
        except Exception as e:   # noqa: BLE001 - a failed request must not stop the others
            log.exception("slot %d: request failed", slot.id)
            self._finish(slot, None, e)
            return
        if record is None:   # a prompt step with steps left
            return
        if request.t_first is None:
            request.t_first = time.perf_counter()
        self._outbox.put(request, record)
        if record.finish_reason is not None:
            self._finish(slot, record, None)

    def _finish(self, slot: Slot, record: Optional[GenerationRecord], error: Optional[BaseException]) -> None:
        request = slot.request
        if slot.records is not None:
            slot.records.close()
        slot.request, slot.records = None, None
        slot.last_used = time.perf_counter()
        slot.n_requests += 1
        try:
            slot.n_held = slot.engine.session.n_tokens
            slot.stats = record.stats if record is not None and record.stats else slot.engine.stats()
        except Exception:   # noqa: BLE001
            log.exception("slot %d: reading its state failed", slot.id)
        if error is not None and not isinstance(error, RequestCancelled):
            self._outbox.put(request, error)
        self._outbox.put(request, None)
        self.on_finish(slot, request, record, error)

    def _shutdown(self) -> None:
        for slot in self.slots:
            if slot.busy:
                slot.request.cancelled = True
                self._finish(slot, None, RequestCancelled())
            try:
                slot.engine.store_prefix()
            except Exception:   # noqa: BLE001 - shutting down: log and go on with the next slot
                log.exception("slot %d: storing its prefix at shutdown failed", slot.id)
        for r in self._pending:
            self._outbox.put(r, None)
        self._pending.clear()


def _raise(error: BaseException) -> None:
    raise error
