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
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np

from . import _core
from .companion import Companion, same_vocabulary
from .drafter import DrafterPolicy, prompt_attention_scores
from .known_models import resolve_model_path
from .mtp import MtpDraft, check_mtp, wants_mtp
from .options import SPECULATIVE_MODES, PoolConfig, ResidencyConfig, SamplingParams, SpeculativeConfig
from .policy import LRU, BuiltinScorer, CallablePolicy, Policy, SessionView
from .sampling import Sampler, TokenLogprobs, token_logprobs
from .snapshot import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache, SnapshotError, session_key
from .speculative import DraftModel, PromptLookup, Speculator, TextMappedDraft, accept
from .tokenizer import TextStream, Tokenizer, check_messages
from .tokens import chunk_aligned_batches, common_prefix, forward_in_steps, rewind, text_if_bytes, token_ids

log = logging.getLogger(__name__)

CLOSED = "Model is closed: close() was called on it (or on its Engine)"


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


def make_session(model: _core.Model, pool: PoolConfig, *, track_summaries: bool = False,
                 n_batch: Optional[int] = None, arena: Optional[_core.PoolArena] = None,
                 mtp: bool = False) -> _core.Session:
    """n_batch: tokens per forward step (default: the pool's own, PoolConfig.prefill_batch). arena: keep the
    pool in a lane of it (a server's slots: their batched decode steps then attend all pools at once). mtp: run
    the model's multi-token-prediction head too (its K/V in the pool; the drafter of draft="mtp")."""
    config = _core.SessionConfig(
        max_tokens=pool.n_ctx, pool_tokens=pool.resolved_pool_tokens(), kv_type=pool.kv_type,
        attention=pool.attention, n_batch=n_batch or pool.prefill_batch(), sink_chunks=pool.sink_chunks,
        tail_chunks=pool.tail_chunks, allow_beyond_train_ctx=pool.allow_beyond_train_ctx,
        track_summaries=track_summaries, mtp=mtp)
    return _core.Session(model, config, arena=arena)


POLICY_NAMES = ("lru", "qk", "quest", "drafter")


def session_device_bytes(session: _core.Session) -> int:
    """A session's device bytes besides the weights: pool, rings, recurrent state, compute buffer."""
    m = session.memory()
    return m["pool_bytes"] + m["ring_bytes"] + m["recurrent_bytes"] + m["compute_bytes"]


def make_policy(spec: Union[str, Policy, Callable], *, companion: Optional[Companion] = None) -> Policy:
    """companion: the drafter's full-cache session, for spec="drafter" (unused by the others)."""
    if spec == "drafter":
        if companion is None:
            raise ValueError("policy 'drafter' needs a drafter model: pass drafter_model=PATH (a smaller GGUF "
                             "with the same tokenizer, or the model itself)")
        return DrafterPolicy(companion)
    if isinstance(spec, Policy):
        return spec
    if callable(spec):
        return CallablePolicy(spec)
    if spec == "lru":
        return LRU()
    if spec in ("qk", "quest"):
        return BuiltinScorer(spec)
    raise ValueError(f"policy {spec!r} is not available (available: {', '.join(POLICY_NAMES)}, or a callable "
                     "view -> scores per chunk)")


def load_like(spec: Union[str, os.PathLike, _core.Model], model: _core.Model) -> _core.Model:
    """A second model (a drafter's, a draft model) on the same backend and threads as `model`; `model` itself
    when spec names its GGUF, and spec itself when it is loaded already."""
    if isinstance(spec, _core.Model):
        return spec
    path = resolve_model_path(spec)
    return model if path == model.path else \
        _core.Model(path, backend="auto" if model.on_gpu else "cpu", n_threads=model.n_threads)


def with_loaded_draft(speculative: Optional[SpeculativeConfig], model: _core.Model) -> Optional[SpeculativeConfig]:
    """The configuration with its draft model loaded (as make_speculator would load it): Engines built from the
    result share its weights (the server's slots), and pool_tokens="auto" sees them loaded."""
    if speculative is None or speculative.draft in SPECULATIVE_MODES:
        return speculative
    return dataclasses.replace(speculative, draft=load_like(speculative.draft, model))


def draft_model_of(speculative: Optional[SpeculativeConfig]) -> Optional[_core.Model]:
    """The draft model a speculative configuration holds loaded (None: none, or not loaded yet)."""
    draft = speculative.draft if speculative is not None else None
    return draft if isinstance(draft, _core.Model) else None


def with_loaded_drafter(residency: ResidencyConfig, model: _core.Model) -> ResidencyConfig:
    """The residency with its drafter model loaded (as make_companion would load it), or the model itself when
    it names the same GGUF: Engines built from the result share those weights (a Model's own drafter, the
    server's slots)."""
    if residency.drafter_model is None:
        return residency
    return dataclasses.replace(residency, drafter_model=load_like(residency.drafter_model, model))


def make_speculator(config: SpeculativeConfig, model: _core.Model, tokenizer: Tokenizer,
                    pool: PoolConfig, session: Optional[_core.Session] = None) -> Speculator:
    """The drafter a SpeculativeConfig names, checked against the model (clear errors for what is not built);
    a draft model of another vocabulary is mapped through text. "mtp" drafts with the head of `session`, the
    session that verifies (made with mtp=True)."""
    on_cpu = not model.on_gpu   # verify steps short enough to run plain decoding's kernels (CPU_VERIFY_TOKENS)
    if wants_mtp(config):
        check_mtp(model)
        if session is None:
            raise ValueError("speculative draft 'mtp' drafts in the verifying session: pass session=")
        return Speculator(config, MtpDraft(session), on_cpu=on_cpu)
    if config.draft == "prompt_lookup":
        return Speculator(config, PromptLookup(config.ngram), on_cpu=on_cpu)
    draft_model = load_like(config.draft, model)
    own = tokenizer if draft_model is model else Tokenizer(draft_model.path)
    if same_vocabulary(tokenizer, own):
        return Speculator(config, DraftModel(draft_model, make_session(draft_model, pool), pool), on_cpu=on_cpu)
    # Its vocabulary may split the same text into more tokens: room for half as many again, as trained for.
    C = _core.CHUNK_TOKENS
    room = max(pool.n_ctx, min(-(-pool.n_ctx * 3 // 2 // C) * C, draft_model.hparams.n_ctx_train))
    draft_pool = dataclasses.replace(pool, n_ctx=room)
    drafter = DraftModel(draft_model, make_session(draft_model, draft_pool), draft_pool)
    return Speculator(config, TextMappedDraft(drafter, own, tokenizer), on_cpu=on_cpu)


def make_companion(model: _core.Model, tokenizer: Tokenizer, pool: PoolConfig,
                   residency: ResidencyConfig) -> Optional[Companion]:
    """The full-cache session of the drafter model that policy="drafter" scores from (None for the others)."""
    if residency.policy != "drafter" or residency.drafter_model is None:
        return None
    return Companion(residency.drafter_model, tokenizer, n_ctx=pool.n_ctx,
                     backend="auto" if model.on_gpu else "cpu", n_threads=model.n_threads)


class Engine:
    """pool: where the KV cache lives; residency: which chunks stay in the pool and how a prompt is computed
    (see ResidencyConfig).
    prefix_cache_dir: keep the chunk-aligned prefix of every turn on disk (at most prefix_cache_bytes,
    least recently used out first) and start a prompt from the longest cached prefix of it; a folder that
    cannot be read or written is a logged warning, never an error. store_each_turn=False stores only when
    store_prefix() is called (the server: when a slot is taken over, and at shutdown).
    between_prefill_steps: called between the forward steps of a prompt (the server runs the other slots'
    decode steps there); it may raise to abandon the prompt (the session is rolled back).
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
        self.speculator = make_speculator(speculative, model, tokenizer, pool, self.session) if speculative else None
        self.prefix_cache = PrefixCache(prefix_cache_dir, prefix_cache_bytes) if prefix_cache_dir else None
        self._cache_key = session_key(self.session, model) if self.prefix_cache else ""
        self.store_each_turn = store_each_turn
        self.between_prefill_steps = between_prefill_steps
        self.n_reused = 0              # of the last prompt: tokens whose K/V were already held or restored
        self.n_computed = 0            # ... and tokens run through the model
        self._since_reselect = 0
        self._t_policy_ms = 0.0
        self._lock = threading.RLock()   # reentrant: a step calls stats() and reselect() under it
        self._owner = 0                  # the call that owns the session; older streams are superseded
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
        """A new call takes the session: streams begun before it are superseded."""
        self._owner += 1
        return self._owner

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the session, the policy and the companion (a drafter's model and session); later calls raise
        ValueError. Waits for a step running in another thread."""
        with self._lock:
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
        if self.companion is not None:   # a drafter that cannot hold the prompt: before any state changes
            self.companion.check(tokens)
        n_keep = common_prefix(self.session.tokens, tokens)
        if self.prefix_cache is not None:
            n_keep = self._restore_cached_prefix(tokens, n_keep)
        n_keep = min(n_keep, len(tokens) - 1)   # the last prompt token is always run, for its logits
        if n_keep < self.session.n_tokens:
            n_keep = rewind(self.session, n_keep)
        try:
            logits = self._run_prompt(tokens, n_keep)
        except BaseException:
            self._roll_back(n_keep)
            raise
        self.n_reused, self.n_computed = n_keep, len(tokens) - n_keep
        return logits

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
        return common_prefix(self.session.tokens, tokens)

    def _run_prompt(self, tokens: list[int], n_keep: int) -> np.ndarray:
        if not self.session.has_recurrent_state or len(tokens) - n_keep < 2:
            return self._compute_prompt(tokens, n_keep)
        # A linear-attention state cannot go back: keep it before the prompt's last token, which every later
        # prompt sharing this one (the next chat turn, a rerun) reruns for its logits anyway, so it restarts
        # there instead of at 0. Costs one more one-token step per prompt and a host copy of the state.
        self._compute_prompt(tokens[:-1], n_keep)
        self.session.checkpoint()
        return self._forward_prompt(self.session, tokens[-1:], len(tokens) - 1)

    def _compute_prompt(self, tokens: list[int], n_keep: int) -> np.ndarray:
        if self._layer_major(tokens):
            return self._exact_prefill(tokens, n_keep)
        logits = None
        for lo, hi in self._prefill_batches(n_keep, len(tokens)):
            if lo > n_keep and self.residency.prefill_reselect:
                self.reselect()   # query-aware prefill: the previous batch's queries pick what stays
            logits = self._forward_prompt(self.session, tokens[lo:hi], lo)
        page_ins = self.session.pager.stats().page_ins
        self.reselect()   # the prompt's last queries pull their evidence back before the first token
        if self.session.pager.stats().page_ins > page_ins and self.residency.refresh_tokens:
            logits = self._recompute_tail(tokens, n_keep, logits)
        return logits

    def _layer_major(self, tokens: list[int]) -> bool:
        """Exact prefill of a prompt the pool cannot hold whole (one it holds runs as ordinary forward steps,
        which then see every earlier position anyway)."""
        return self.residency.prefill == "exact" and not self.session.full_cache and \
            len(tokens) > self.session.pager.config().pool_tokens

    def _exact_prefill(self, tokens: list[int], n_keep: int) -> np.ndarray:
        """Run tokens[n_keep:] layer-major: every position gets the K/V a full cache writes, and the pager ends
        as a pooled prefill leaves it. The post-prompt reselect then pages in what the prompt's last tokens
        attended to (prompt_scores="attention"), or what the policy scores. The logits already saw every
        position: nothing is recomputed."""
        logits, attention = self.session.prefill_exact(np.asarray(tokens[n_keep:], dtype=np.int32), n_keep,
                                                       n_batch=self._exact_prefill_step(),
                                                       between=self._between_prefill_steps)
        by_policy = self.residency.prompt_scores == "policy" or \
            (self.residency.prompt_scores == "auto" and self.residency.policy not in POLICY_NAMES)
        if by_policy:
            self.reselect()
        else:
            self._reselect_by(lambda: prompt_attention_scores(attention, self.session.pager.n_chunks()))
        return logits

    def _exact_prefill_step(self) -> int:
        return self.pool.exact_prefill_batch(self.session.flash_attn)

    def _forward_prompt(self, session: _core.Session, tokens: Sequence[int], start: int) -> np.ndarray:
        return forward_in_steps(session, np.asarray(tokens, dtype=np.int32), start,
                                between=self._between_prefill_steps)

    def _between_prefill_steps(self) -> None:
        """Called between the forward steps of a prompt (Python's signal handlers run around it; tests
        raise here to check the roll back)."""
        if self.between_prefill_steps is not None:
            self.between_prefill_steps()

    def _roll_back(self, n_keep: int) -> None:
        """After a prompt failed part way: hold only the first n_keep tokens (what the call began from, less
        any part it had to drop), so a retry starts clean."""
        try:
            if self.session.n_tokens > n_keep:
                rewind(self.session, n_keep)
        except Exception:   # noqa: BLE001 - the core could not truncate: start over from nothing held
            log.exception("prefill roll back failed; resetting the session")
            self.session.reset()

    def _recompute_tail(self, tokens: list[int], floor: int, logits: np.ndarray) -> np.ndarray:
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
        return self._forward_prompt(self.session, tokens[lo:], lo)

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

    def _after_decode(self, n_fed: int = 1) -> None:
        self._since_reselect += n_fed
        if self._since_reselect >= self.residency.reselect_every(self.session.n_tokens):
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
        chosen = scores()
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
        policy's full-cache session (not bounded by the pool), or a speculative draft model's pooled one. device_peak_bytes: all of them at once (the prefill workspace lives beside the step graphs'
        buffer)."""
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
            "device_peak_bytes": weights + mem["pool_bytes"] + mem["ring_bytes"] + mem["recurrent_bytes"] + mem["compute_bytes"] +
            mem["prefill_peak_bytes"] + drafter,
            "host_prefill_peak_bytes": mem["prefill_host_bytes"],
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


class Generation:
    """One generate() call, an iterator of records: the first next() runs the prompt and picks the first
    token; each later one feeds the last token and picks the next (a decode step), until an end-of-generation
    token, a stop string, max_tokens or a full context; then a closing record with the stats.

    A server steps many at once: while needs_decode_step(), its decode step is feeding `token` and reading the
    argmax (or the logits, if wants_logits), which the caller may run for several sessions in one batched
    forward (_core.BatchDecoder) and hand back with advance(...), in place of next().

    With an engine that speculates, a decode step verifies drafts and yields several tokens: the records after it
    come from the queue of kept tokens (with their logprobs, from the verify step's rows), without a step; such a
    generation steps alone (needs_decode_step() is False)."""

    def __init__(self, engine: Engine, tokens: list[int], params: SamplingParams, owner: int,
                 n_logprobs: Optional[int]) -> None:
        self.engine, self.tokens, self.params, self.owner, self.n_logprobs = engine, tokens, params, owner, n_logprobs
        self.sampler, self.stream = Sampler(params), TextStream(params.stop)
        self.token: Optional[int] = None   # the last token picked (fed by the next decode step)
        self.n_generated = 0               # token records given
        self._state = "prompt"             # prompt -> decoding -> (stopped) -> closed
        self._speculate = engine.speculator is not None
        self._history = list(tokens)       # speculation: the prompt and every token picked (drafts follow it)
        # speculation: tokens verified, not yet given, with their logprobs (if asked)
        self._queue: list[tuple[int, Optional[TokenLogprobs]]] = []

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> GenerationRecord:
        if self._state == "closed":
            raise StopIteration
        e = self.engine
        with e._turn(self.owner):
            if self._state == "prompt":
                self._state = "decoding"
                token, logprobs = self._choose(e._prefill(self.tokens))
                if self._speculate:
                    e.speculator.follow(self.tokens)
                return self._close("length") if self.params.max_tokens == 0 else self._emit(token, logprobs)
            if self._state == "stopped" or self._at_limit():
                return self._close("stop" if self._state == "stopped" else "length")
            if self._speculate:
                if not self._queue:
                    self._queue = self._verify_drafts()
                return self._emit(*self._queue.pop(0))
            if not self.wants_logits:
                return self._emit(e._decode_one_greedy(self.token), None)
            return self._emit(*self._choose(e._decode_one(self.token)))

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
        self._state = "closed"

    def _at_limit(self) -> bool:
        p = self.params
        return (p.max_tokens is not None and self.n_generated >= p.max_tokens) or \
            (not self._queue and self.engine.session.n_tokens >= self.engine.pool.n_ctx)

    def _verify_drafts(self) -> list[tuple[int, Optional[TokenLogprobs]]]:
        """One speculative step: `token` and the drafts after it through the session at once; the drafts the
        model keeps and its own next token (each with its logprobs from its row, if asked), the rejected
        positions truncated. Falls back to a plain step when the drafter has nothing to propose."""
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
        drafts, q = e.speculator.propose(self._history, room, self.sampler)
        if not drafts:
            return [self._choose(e._decode_one(self.token))] if self.wants_logits else \
                [(e._decode_one_greedy(self.token), None)]
        n0 = s.n_tokens
        if s.has_recurrent_state:
            s.stash()   # a linear-attention state cannot drop the rejected drafts: come back here instead
        rows = s.forward(np.asarray([self.token, *drafts], dtype=np.int32), n0, all_logits=True)
        kept, own = accept(drafts, rows, q, self.sampler)
        if len(kept) < len(drafts) and s.has_recurrent_state:
            s.truncate(n0)   # the stash, then the kept tokens again (their K/V rewritten as they were)
            # every row's logits: a step that computes them runs plain decoding's kernels (Session: one-token
            # kernels), so the K/V and state it writes are the one-token steps' too
            s.forward(np.asarray([self.token, *kept], dtype=np.int32), n0, all_logits=True)
        elif len(kept) < len(drafts):
            s.truncate(n0 + 1 + len(kept))
        e.speculator.record(len(drafts), len(kept))
        e._after_decode(1 + len(kept))
        chosen = [*kept, own]   # token i was chosen from row i
        if self.n_logprobs is None:
            return [(t, None) for t in chosen]
        return [(t, token_logprobs(rows[i], t, self.n_logprobs)) for i, t in enumerate(chosen)]

    def _choose(self, logits: np.ndarray) -> tuple[int, Optional[TokenLogprobs]]:
        token = self.sampler(logits)
        return token, (None if self.n_logprobs is None else token_logprobs(logits, token, self.n_logprobs))

    def _emit(self, token: int, logprobs: Optional[TokenLogprobs]) -> GenerationRecord:
        self.token = token
        self._history.append(token)
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
