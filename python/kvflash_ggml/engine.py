"""The generation loop, top to bottom: sampling -> prefill -> decode one -> maybe reselect -> a
generator of token records. The pager evicts by itself when the pool is full (oldest first, or lowest
score once a policy has scored); this module decides what to feed, when to ask the policy for scores
(after the prompt, every tau generated tokens, optionally before each prefill batch), when to stop,
and when to save or restore a snapshot (the prefix cache).

Threads and streams: an Engine (and the Model around it) serialises its calls with one lock, held for
a whole call and for each step of a stream, never across a yield. A stream owns the session only until
the next call: every call that changes what the session holds (generate, prefill, decode_one, load_state)
supersedes the unfinished streams before it, whose next step raises StreamSuperseded instead of going on
from another prompt's context. Streams on one Engine therefore cannot interleave; use one per stream.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Callable, Generator, Iterator, Mapping, Optional, Sequence, Union

import numpy as np

from . import _core
from .drafter import prompt_attention_scores
from .engine_parts import (POLICY_NAMES, make_companion, make_policy, make_session, make_speculator,
                           session_device_bytes)
from .generation import Generation, StreamSuperseded
from .host_store import check_host_store, host_store_bound
from .mtp import check_mtp, wants_mtp
from .options import SPARSE_FROM_TOKENS, SPARSE_LOCAL_CHUNKS, PoolConfig, ResidencyConfig, SamplingParams, SpeculativeConfig
from .policy import SessionView
from .snapshot import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache, SnapshotError, session_key
from .tokenizer import Tokenizer, check_messages
from .tokens import chunk_aligned_batches, drive, forward_steps, keep_prefix, text_if_bytes, token_ids

log = logging.getLogger(__name__)

CLOSED = "Model is closed: close() was called on it (or on its Engine)"


@dataclasses.dataclass(frozen=True)
class PromptAnswer:
    """What the last prompt computed, good while the session holds its positions unchanged (Session.n_unchanged)."""
    n_tokens: int
    logits: np.ndarray               # after its last token
    scores: Optional[np.ndarray]     # the post-prompt reselect's chunk scores (None: none ran)


class Engine:
    """pool: where the KV cache lives; residency: which chunks stay in the pool and how a prompt is computed
    (see ResidencyConfig).
    prefix_cache_dir: keep the chunk-aligned prefix of every turn on disk (at most prefix_cache_bytes,
    least recently used out first) and start a prompt from the longest cached prefix of it; a folder that
    cannot be read or written is a logged warning, never an error. store_each_turn=False stores only when
    store_prefix() is called (the server: when a slot is taken over, and at shutdown).
    between_prefill_steps: called between the steps of a prompt run whole (prefill(), a Generation's first next());
    it may raise to abandon the prompt (the session is rolled back). A server runs a prompt a step per round
    instead (Generation.step_prompt), the other slots' decode steps between.
    prompt_step_cap: asked when an exact (layer-major) prefill starts; a number caps its tokens per step (the
    server: so that each step, a gap in the decoding slots' streams, lasts about one decode round), None keeps
    the pool's step. On the CPU's mul_mat path (its default) the step's size changes no byte of the result
    (tests/test_exact_prefill.py); flash attention's sums move within rounding.
    speculative: decode by drafting and verifying on the pool (speculative.py); None: one token per step.
    arena: keep the pool in a lane of this _core.PoolArena (a server's slots: a batched decode step writes and
    attends all their pools at once).
    chat_template: renders chat messages instead of the GGUF's own template.
    See the module docstring for threads and streams."""

    def __init__(self, model: _core.Model, tokenizer: Tokenizer, pool: PoolConfig,
                 residency: Optional[ResidencyConfig] = None, *,
                 prefix_cache_dir: Union[None, str, os.PathLike] = None,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES, chat_template: Optional[str] = None,
                 store_each_turn: bool = True, between_prefill_steps: Optional[Callable[[], None]] = None,
                 speculative: Optional[SpeculativeConfig] = None, arena: Optional[_core.PoolArena] = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.residency = residency = residency or ResidencyConfig()
        self.chat_template = chat_template
        self.companion = make_companion(model, tokenizer, pool, residency)
        self.policy = make_policy(residency.policy, companion=self.companion)
        if wants_mtp(speculative):
            check_mtp(model)   # before any session: its pool would hold the head's K/V
        self.session = make_session(model, pool, track_summaries=self.policy.needs_summaries, arena=arena,
                                    mtp=wants_mtp(speculative))
        # the K/V this context can send to host memory must fit the host (or max_host_bytes): refused here, not
        # ended by the OOM killer part way (host_store.py; slot_engines checks a server's slots together)
        check_host_store([self.session], pool.n_ctx, pool.kv_type, pool.max_host_bytes)
        if residency.prefill == "sparse" and not self.session.flash_attn:
            raise ValueError("prefill='sparse' needs flash attention: PoolConfig(attention='flash') (or 'auto' on a GPU)")
        self.speculator = make_speculator(speculative, model, tokenizer, pool, self.session) if speculative else None
        self.prefix_cache = PrefixCache(prefix_cache_dir, prefix_cache_bytes) if prefix_cache_dir else None
        self._cache_key = session_key(self.session, model) if self.prefix_cache else ""
        self.store_each_turn = store_each_turn
        self.between_prefill_steps = between_prefill_steps
        self.prompt_step_cap: Optional[Callable[[], Optional[int]]] = None
        self.exact_prefill_tok_s: Optional[float] = None   # the last exact prefill's, in its own calls' time
        self.n_reused = 0              # of the last prompt: tokens whose K/V were already held or restored
        self.n_computed = 0            # ... and tokens run through the model
        self._since_reselect = 0
        self._answer: Optional[PromptAnswer] = None   # the last prompt's, for a resend of it (_answer_again)
        self._last_scores: Optional[np.ndarray] = None   # the latest reselect's scores
        self._t_policy_ms = 0.0
        self._lock = threading.RLock()   # reentrant: a step calls stats() and reselect() under it
        self._owner = 0                  # the call that owns the session; older streams are superseded
        self._prompt: Optional[Generator[None, None, np.ndarray]] = None   # a prompt run part way (_prompt_step)
        self._closed = False

    # -- threads, streams, lifetime -----------------------------------------------------------------
    @contextlib.contextmanager
    def _turn(self, stream: Optional[int] = None) -> Iterator[None]:
        """Hold the engine for one call, or one step of the stream that took it as `stream`."""
        with self._lock:
            if self._closed:
                raise ValueError(CLOSED)
            if stream is not None and stream != self._owner:
                raise StreamSuperseded()
            yield

    def _take(self) -> int:
        """A new call takes the session: streams begun before it are superseded (a prompt one of them left part
        way is dropped first: the session holds what it held before that prompt)."""
        self._drop_prompt()
        self._owner += 1
        return self._owner

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the session, the policy and the companion (a drafter's model and session); later calls raise
        ValueError. Waits for a step running in another thread."""
        with self._lock:
            self._drop_prompt()
            self._closed = True
            self.session = self.policy = self.companion = self.prefix_cache = self.model = self.speculator = None

    # -- prefill ---------------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """Make the session hold exactly `tokens`, computing only the part that differs from what it
        holds already; returns the logits after the last token. The prompt runs as many forward steps
        (see forward_in_steps), so Ctrl-C (KeyboardInterrupt) takes effect between steps. If anything
        raises while the prompt runs, the session is rolled back to the prefix it shared with what the
        session held (the K/V of tokens that prefix does not cover are gone: the shared part is kept)."""
        with self._turn():
            self._take()
            return self._prefill(self.check_prompt(tokens))

    def reserve_host(self, n_tokens: Optional[int] = None) -> int:
        """Pin the host store for a context of `n_tokens` positions (default n_ctx) now, as llama.cpp makes its
        KV cache with its context: an image per chunk (evicted chunks have one, paged-in ones keep theirs), and the
        exact prefill's hidden-state rows for a prompt that long (stats()["host_prefill_rows_bytes"]), so a long
        prompt pins nothing on its critical path (about 8 GiB/s on the H100 machines). Returns the store's bytes
        (stats()["host_store_bytes"]). Both stay until close(); on the CPU they are plain memory."""
        n_tokens = self.pool.n_ctx if n_tokens is None else n_tokens
        if not 0 <= n_tokens <= self.pool.n_ctx:
            raise ValueError(f"reserve_host: {n_tokens} positions, outside 0..n_ctx={self.pool.n_ctx}")
        with self._turn():
            return self.session.reserve_host(n_tokens)

    def check_prompt(self, tokens: Sequence[int]) -> list[int]:
        """The prompt as a list of ints, checked (non-empty, within n_ctx, every id in the vocabulary)
        before anything changes."""
        tokens = token_ids(tokens, self.tokenizer.n_vocab)
        if not tokens:
            raise ValueError("cannot generate from an empty prompt")
        if len(tokens) > self.pool.n_ctx:
            raise ValueError(f"prompt of {len(tokens)} tokens exceeds n_ctx={self.pool.n_ctx}")
        return tokens

    def _prefill(self, tokens: list[int]) -> np.ndarray:
        """The prompt run whole: the rest of one that prompt_step() began, or all of it."""
        steps, self._prompt = self._prompt or self._prefill_steps(tokens), None
        return drive(steps, self._between_prefill_steps)

    def _prompt_step(self, tokens: list[int]) -> Optional[np.ndarray]:
        """One step of the prompt (begun at the first call): None while steps are left, then the logits. A step
        that raises has rolled the session back."""
        if self._prompt is None:
            self._prompt = self._prefill_steps(tokens)
        try:
            next(self._prompt)
            return None
        except StopIteration as done:
            self._prompt = None
            return done.value
        except BaseException:
            self._prompt = None
            raise

    def _drop_prompt(self) -> None:
        """A prompt left part way is closed: its steps roll the session back."""
        if self._prompt is not None:
            steps, self._prompt = self._prompt, None
            steps.close()

    def _prefill_steps(self, tokens: list[int]) -> Generator[None, None, np.ndarray]:
        """The prompt as a generator of its steps (a forward step, or one step of an exact prefill's layer): it
        yields between them and returns the logits; closed (or failing) part way, the session rolls back to
        what the call began from. _prefill runs it whole; a server's rounds run one step each."""
        if self.companion is not None:   # a drafter that cannot hold the prompt: before any state changes
            self.companion.check(tokens)
        n_keep = self.session.shared_prefix(tokens)
        logits = self._answer_again(tokens, n_keep)
        if logits is not None:
            return logits
        if self.prefix_cache is not None:
            n_keep = self._restore_cached_prefix(tokens, n_keep)
        n_keep = keep_prefix(self.session, min(n_keep, len(tokens) - 1))   # the last token runs, for its logits
        self._answer = self._last_scores = None
        try:
            logits = yield from self._run_prompt(tokens, n_keep)
        except BaseException:
            self._roll_back(n_keep)
            raise
        self.n_reused, self.n_computed = n_keep, len(tokens) - n_keep
        self._keep_answer(tokens, logits)
        return logits

    def _keep_answer(self, tokens: list[int], logits: np.ndarray) -> None:
        """Keep the prompt's logits (and the scores its reselect used) for a resend of it. A linear-attention state
        cannot go back to the prompt's end once decoding moved it on: after a layer-major prompt, whose last token
        would otherwise run again over every position, the state there is kept too (a host copy)."""
        if self.session.has_recurrent_state and self._layer_major(tokens):
            self.session.checkpoint()
        self.session.mark_unchanged()
        self._answer = PromptAnswer(len(tokens), logits.copy(), self._last_scores)

    def _answer_again(self, tokens: list[int], n_shared: int) -> Optional[np.ndarray]:
        """The logits of the prompt the session ran last, if it is `tokens` and its positions are still held as
        they were (a resend, a regenerate), without running its last token again: a layer-major prompt's last
        token stages every position of the history (~1.4 s at 32K on the 27B shape, R112). The session goes back
        to the prompt's end and the post-prompt reselect runs again with the same scores, so the pool holds what
        the first send left it; None if any of that cannot be (then the prompt runs as any other)."""
        a, s, n = self._answer, self.session, len(tokens)
        if a is None or a.n_tokens != n or n_shared < n or s.n_unchanged < n:
            return None
        if s.n_tokens > n:
            if s.rewind_point(n) != n:   # rings or a linear-attention state that cannot go back there
                return None
            s.truncate(n)
        self._since_reselect = 0
        if a.scores is not None:
            self._reselect_by(lambda: a.scores)
        self.n_reused, self.n_computed = n, 0
        return a.logits.copy()

    def _restore_cached_prefix(self, tokens: list[int], n_keep: int) -> int:
        """Load the longest cached prefix of `tokens` if it beats the n_keep tokens already held."""
        hit = self.prefix_cache.lookup(self._cache_key, tokens, longer_than=n_keep)
        if hit is None:
            return n_keep
        try:
            self._load_state(hit.path)
        except (SnapshotError, OSError) as e:
            log.warning("prefix cache: dropping %s: %s", hit.path.name, e)
            self.prefix_cache.discard(hit.path)
            return n_keep
        return self.session.shared_prefix(tokens)

    def _run_prompt(self, tokens: list[int], n_keep: int) -> Generator[None, None, np.ndarray]:
        if not self.session.has_recurrent_state or len(tokens) - n_keep < 2:
            return (yield from self._compute_prompt(tokens, n_keep))
        # A linear-attention state cannot go back: keep it before the prompt's last token, which every later
        # prompt sharing this one (the next chat turn, a rerun) reruns for its logits anyway, so it restarts
        # there instead of at 0. Costs one more one-token step per prompt and a host copy of the state. A
        # layer-major prompt keeps it inside its pass, where the last token still attends every position.
        if self._layer_major(tokens):
            return (yield from self._exact_prefill(tokens, n_keep, checkpoint_before_last=True))
        yield from self._compute_prompt(tokens[:-1], n_keep)
        self.session.checkpoint()
        return (yield from self._forward_prompt(self.session, tokens[-1:], len(tokens) - 1))

    def _compute_prompt(self, tokens: list[int], n_keep: int) -> Generator[None, None, np.ndarray]:
        if self._layer_major(tokens):
            return (yield from self._exact_prefill(tokens, n_keep))
        logits = None
        for lo, hi in self._prefill_batches(n_keep, len(tokens)):
            if lo > n_keep and self.residency.prefill_reselect:
                self.reselect()   # query-aware prefill: the previous batch's queries pick what stays
            logits = yield from self._forward_prompt(self.session, tokens[lo:hi], lo)
        page_ins = self.session.pager.stats().page_ins
        self.reselect()   # the prompt's last queries pull their evidence back before the first token
        if self.session.pager.stats().page_ins > page_ins and self.residency.refresh_tokens:
            logits = yield from self._recompute_tail(tokens, n_keep, logits)
        return logits

    def _layer_major(self, tokens: list[int]) -> bool:
        """Exact prefill of a prompt the pool cannot hold whole (one it holds runs as ordinary forward steps,
        which then see every earlier position anyway)."""
        return self.residency.prefill != "pooled" and not self.session.full_cache and \
            len(tokens) > self.session.pager.config().pool_tokens

    def _exact_prefill(self, tokens: list[int], n_keep: int,
                       checkpoint_before_last: bool = False) -> Generator[None, None, np.ndarray]:
        """Run tokens[n_keep:] layer-major: every position gets the K/V a full cache writes, and the pager ends
        as a pooled prefill leaves it. The post-prompt reselect then pages in what the prompt's last tokens
        attended to (prompt_scores="attention"), or what the policy scores. The logits already saw every
        position: nothing is recomputed."""
        own_s = 0.0   # in the run's own calls: not the other slots' steps a server runs between them
        sparse = self._sparse_prefill(len(tokens))
        with self.session.begin_prefill_exact(np.asarray(tokens[n_keep:], dtype=np.int32), n_keep,
                                              n_batch=self._exact_prefill_step(),
                                              sparse_top_chunks=self.residency.sparse_top_chunks if sparse else 0,
                                              sparse_local_chunks=SPARSE_LOCAL_CHUNKS,
                                              checkpoint_before_last=checkpoint_before_last) as run:
            while True:
                t0 = time.perf_counter()
                done = run.advance(1)
                own_s += time.perf_counter() - t0
                if done:
                    break
                yield
            t0 = time.perf_counter()
            logits, attention = run.finish()
            own_s += time.perf_counter() - t0
        if own_s > 0:
            self.exact_prefill_tok_s = (len(tokens) - n_keep) / own_s
        by_policy = self.residency.prompt_scores == "policy" or \
            (self.residency.prompt_scores == "auto" and self.residency.policy not in POLICY_NAMES)
        if by_policy:
            self.reselect()
        else:
            self._reselect_by(lambda: prompt_attention_scores(attention, self.session.pager.n_chunks()))
        return logits

    def _sparse_prefill(self, n_context: int) -> bool:
        """Whether a layer-major prompt ending at n_context runs sparse (prefill="sparse", or "auto" past
        SPARSE_FROM_TOKENS where flash attention makes it possible)."""
        mode = self.residency.prefill
        return mode == "sparse" or (mode == "auto" and self.session.flash_attn and n_context > SPARSE_FROM_TOKENS)

    def _exact_prefill_step(self) -> int:
        step = self.pool.exact_prefill_batch(self.session.flash_attn)
        cap = self.prompt_step_cap() if self.prompt_step_cap is not None else None
        return step if cap is None else max(1, min(step, cap))

    def _forward_prompt(self, session: _core.Session, tokens: Sequence[int], start: int) -> Generator[None, None, np.ndarray]:
        return (yield from forward_steps(session, np.asarray(tokens, dtype=np.int32), start))

    def _between_prefill_steps(self) -> None:
        """Called between the steps of a prompt run whole (Python's signal handlers run around it; tests
        raise here to check the roll back)."""
        if self.between_prefill_steps is not None:
            self.between_prefill_steps()

    def _roll_back(self, n_keep: int) -> None:
        """After a prompt failed part way: hold only the first n_keep tokens (what the call began from, less
        any part it had to drop), so a retry starts clean."""
        try:
            keep_prefix(self.session, n_keep)
        except Exception:   # noqa: BLE001 - the core could not truncate: start over from nothing held
            log.exception("prefill roll back failed; resetting the session")
            self.session.reset()

    def _recompute_tail(self, tokens: list[int], floor: int, logits: np.ndarray) -> Generator[None, None, np.ndarray]:
        """The logits of the last prompt token were computed before the reselect brought the evidence in:
        run the last refresh_tokens prompt tokens again (the question, at the end of a long document), so the
        first generated token and the K/V of the question, which later tokens attend to, see the chunks the
        reselect paged in. At most the protected tail, so the recompute cannot push the evidence out, and
        nothing before `floor` (what this prompt reused)."""
        tail = self.session.pager.config().tail_chunks * self.session.pager.config().chunk_tokens
        lo = max(len(tokens) - min(self.residency.refresh_tokens, tail), floor, 1)
        if not self.session.can_truncate(lo):   # sliding-window rings smaller than the tail: keep the logits
            log.info("refresh skipped: the sliding-window rings cannot rewind %d tokens", len(tokens) - lo)
            return logits
        self.session.truncate(lo)
        return (yield from self._forward_prompt(self.session, tokens[lo:], lo))

    def _prefill_batches(self, start: int, end: int) -> list[tuple[int, int]]:
        """One batch (run in steps) unless reselecting between pool-sized batches."""
        if not (self.residency.prefill_reselect and self.policy.reselects and not self.session.full_cache):
            return [(start, end)]
        C = _core.CHUNK_TOKENS
        step = max(C, min(self.pool.prefill_batch(), self.session.pager.max_span_tokens()) // C * C)
        return chunk_aligned_batches(start, end, step)

    # -- decode ----------------------------------------------------------------------------------
    def decode_one(self, token: int) -> np.ndarray:
        """Feed one token; the logits after it."""
        with self._turn():
            self._take()
            return self._decode_one(token)

    def decode_one_greedy(self, token: int) -> int:
        """Feed one token; the greedy choice after it (argmax on the backend: no logits read back)."""
        with self._turn():
            self._take()
            return self._decode_one_greedy(token)

    def _decode_one(self, token: int) -> np.ndarray:
        logits = self.session.forward(np.asarray([token], dtype=np.int32), self.session.n_tokens)
        self._after_decode()
        return logits

    def _decode_one_greedy(self, token: int) -> int:
        next_token = self.session.forward_greedy(np.asarray([token], dtype=np.int32), self.session.n_tokens)
        self._after_decode()
        return next_token

    def reselects_after(self, n_fed: int = 1) -> bool:
        """Whether feeding n_fed more tokens makes a reselect fall due (it reads the queries of that step: a batched
        step keeps them for this session only then, BatchDecoder's keep_queries)."""
        return self.policy.reselects and self._reselect_due(self._since_reselect + n_fed, self.session.n_tokens + n_fed)

    def _reselect_due(self, since: int, n_tokens: int) -> bool:
        return since >= self.residency.reselect_every(n_tokens)

    def _after_decode(self, n_fed: int = 1) -> None:
        self._since_reselect += n_fed
        if self._reselect_due(self._since_reselect, self.session.n_tokens):
            self.reselect()

    # -- reselect --------------------------------------------------------------------------------
    def reselect(self) -> None:
        """Resident set := protected chunks + the policy's top-scored chunks that fit."""
        with self._turn():
            if self.policy.reselects:
                self._reselect_by(lambda: self.policy.scores(SessionView(self.session)))
            else:
                self._since_reselect = 0

    def _reselect_by(self, scores: Callable[[], Optional[np.ndarray]]) -> None:
        self._since_reselect = 0
        s = self.session
        if s.full_cache or s.pager.n_chunks() <= s.pager.n_blocks():
            return
        t0 = time.perf_counter()
        chosen = self._last_scores = scores()
        self._t_policy_ms += (time.perf_counter() - t0) * 1e3
        if chosen is not None:
            s.reselect(chosen)

    # -- generate --------------------------------------------------------------------------------
    def generate(self, prompt: Union[str, bytes, Sequence[int], Sequence[Mapping[str, str]]],
                 params: Optional[SamplingParams] = None, *, logprobs: Optional[int] = None,
                 **sampling) -> "Generation":
        """Stream records for a prompt given as text (str, or UTF-8 bytes), token ids, or chat messages
        (rendered with the GGUF's template). Sampling options come as a SamplingParams or as keywords
        (max_tokens, temperature, top_k, top_p, min_p, seed, stop); temperature 0 is greedy and
        deterministic. logprobs=N: each record carries its token's log-probability and the N most likely
        tokens' (from the model's logits, before temperature; greedy decoding then reads the logits back
        instead of taking the argmax on the backend). The prompt and options are checked now; the call takes
        the session now (superseding any unfinished stream) and computes the prompt at the first next().
        Returns a Generation: an iterator of records."""
        params = params or SamplingParams(**sampling)
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise ValueError(f"logprobs must be an integer >= 0 or None, got {logprobs!r}")
        tokens = self.check_prompt(self.prompt_tokens(prompt))
        with self._turn():
            owner = self._take()
        return Generation(self, tokens, params, owner, logprobs)

    def store_prefix(self) -> None:
        """Store the session's chunk-aligned prefix in the prefix cache now (nothing without one; a prefix
        already stored is only marked as used)."""
        with self._turn():
            self._store_prefix()

    def _store_prefix(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.store(self._cache_key, self.session)

    def prompt_tokens(self, prompt: Union[str, bytes, Sequence[int], Sequence[Mapping[str, str]]]) -> list[int]:
        """Token ids for a prompt: text (str; bytes-like objects are UTF-8 text), chat messages, or token ids."""
        prompt = text_if_bytes(prompt)   # a memoryview too: it was read as token ids (issue 39 item 6)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, parse_special=True)
        prompt = list(prompt)
        if any(isinstance(m, Mapping) for m in prompt):
            text = self.tokenizer.apply_chat_template(check_messages(prompt), template=self.chat_template)
            return self.tokenizer.encode(text, add_special=False, parse_special=True)   # BOS is in the template
        return token_ids(prompt, self.tokenizer.n_vocab)

    # -- snapshots -------------------------------------------------------------------------------
    def save_state(self, path: Union[str, os.PathLike], *, prefix_chunks: Optional[int] = None) -> None:
        """Snapshot the session (atomically; prefix_chunks=k keeps only the first k chunks)."""
        with self._turn():
            self.session.save(path, prefix_chunks=prefix_chunks)

    def load_state(self, path: Union[str, os.PathLike]) -> None:
        """Make the session hold a snapshot's state; a prompt extending its tokens then prefills only
        the new suffix. On error (SnapshotError, OSError) nothing changes."""
        with self._turn():
            self._take()
            self._load_state(path)

    def _load_state(self, path: Union[str, os.PathLike]) -> None:
        self.session.load(path)
        self._since_reselect = 0   # the prefill that follows reselects, as an uninterrupted one does

    # -- figures ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._turn():
            return self._stats()

    def _device_bytes(self) -> dict:
        """Every device byte the configuration holds besides the pool (on the CPU backend, host RAM): weights,
        the sliding-window layers' rings and the linear-attention layers' state (fixed, never paged), the step
        graphs' compute buffer, the largest exact-prefill workspace so far (freed after each prompt:
        one layer's staging K/V + its compute buffer), and a second model's session and weights: the drafter
        policy's full-cache session (not bounded by the pool), or a speculative draft model's pooled one.
        device_peak_bytes: all of them at once, but the step graphs' buffer and the prefill workspace, of which
        the larger (a layer-major prompt gives the step buffer back while it runs: Session::release_step_buffer)."""
        mem = self.session.memory()
        # a second model beside this one: the drafter policy's companion, a draft model (its session, its weights)
        seconds = [self.companion] if self.companion is not None else []
        if self.speculator is not None and self.speculator.draft_model is not None:
            seconds.append(self.speculator.draft_model)
        drafter = sum(session_device_bytes(x.session) + (x.model.weight_bytes if x.model is not self.model else 0)
                      for x in seconds)
        weights = self.model.weight_bytes
        taken = _core.device_bytes_taken()   # {} unless a Model of this process opened a GPU
        return {
            "device_weight_bytes": weights,
            "device_compute_bytes": mem["compute_bytes"],
            "device_prefill_peak_bytes": mem["prefill_peak_bytes"],
            "device_prefill_staging_bytes": mem["prefill_staging_bytes"],
            "device_drafter_bytes": drafter,
            "device_ring_bytes": mem["ring_bytes"],
            "device_recurrent_bytes": mem["recurrent_bytes"],
            "host_checkpoint_bytes": mem["recurrent_checkpoint_bytes"],
            "device_peak_bytes": weights + mem["pool_bytes"] + mem["ring_bytes"] + mem["recurrent_bytes"] +
            max(mem["compute_bytes"], mem["prefill_peak_bytes"]) + drafter,
            "host_prefill_peak_bytes": mem["prefill_host_bytes"],
            "host_store_bytes": mem["host_store_bytes"],   # the host store's capacity (host_kv_bytes: what it holds)
            "host_prefill_rows_bytes": mem["prefill_rows_bytes"],   # the exact prefill's rows kept (reserve_host)
            # per device of the model's split: its weights and this session's pool, rings, state and compute buffers
            # (the exact prefill's workspace and a second model's bytes are in the sums above, not here)
            "devices": mem["devices"],
            # the driver's view beside ours: what this process holds on its GPUs above their CUDA contexts (ggml's
            # CUDA pool and cuBLAS workspace included, every Model of the process together); None without a GPU
            "device_driver_bytes": sum(taken.values()) if taken else None,
        }

    def _stats(self) -> dict:
        s = self.session
        pager, kv, t = s.pager, s.kv, s.timings
        ps = pager.stats()
        return {
            "mode": "full" if s.full_cache else "kvflash",
            "n_ctx": self.pool.n_ctx,
            "pool_tokens": pager.config().pool_tokens,
            "tokens": s.n_tokens,
            "resident_chunks": pager.n_resident(),
            "device_kv_bytes": kv.device_bytes,
            **self._device_bytes(),
            "host_kv_bytes": pager.host_bytes(),
            "host_kv_max_bytes": host_store_bound(s, self.pool.n_ctx),   # an image per chunk of n_ctx
            "page_outs": ps.page_outs,
            "page_ins": ps.page_ins,
            "bytes_moved": ps.bytes_out + ps.bytes_in,
            "reselects": ps.reselects,
            "prompt_tokens_reused": self.n_reused,
            "prompt_tokens_computed": self.n_computed,
            "time_paging_ms": round(t.t_paging_ms, 3),
            "time_compute_ms": round(t.t_compute_ms, 3),
            "time_scoring_ms": round(t.t_scoring_ms + self._t_policy_ms, 3),
            "policy": self.policy.name,
            **(self.speculator.stats() if self.speculator else {}),
        }
