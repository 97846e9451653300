"""The generation loop, top to bottom: sampling -> prefill -> decode one -> a generator of token
records. Residency is the session's business (the pager evicts the oldest chunks when the pool is
full); this module decides only what to feed and when to stop, and when to save or restore a snapshot.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence, Union

import numpy as np

from . import _core
from .options import PoolConfig, SamplingParams
from .sampling import Sampler
from .snapshot import DEFAULT_PREFIX_CACHE_BYTES, PrefixCache, SnapshotError, session_key
from .tokenizer import TextStream, Tokenizer

POLICIES = ("lru",)
log = logging.getLogger(__name__)


@dataclass
class GenerationRecord:
    token: Optional[int]          # None on the closing record
    text: str                     # text this record makes visible ("" while bytes are incomplete)
    finish_reason: Optional[str]  # None while generating; "stop" or "length" on the closing record


def make_session(model: _core.Model, pool: PoolConfig) -> _core.Session:
    config = _core.SessionConfig(
        max_tokens=pool.n_ctx, pool_tokens=pool.resolved_pool_tokens(), kv_type=pool.kv_type,
        attention=pool.attention, n_batch=pool.n_batch, sink_chunks=pool.sink_chunks,
        tail_chunks=pool.tail_chunks, allow_beyond_train_ctx=pool.allow_beyond_train_ctx)
    return _core.Session(model, config)


class Engine:
    """prefix_cache_dir: keep the chunk-aligned prefix of every turn on disk (at most prefix_cache_bytes,
    least recently used out first) and start a prompt from the longest cached prefix of it."""

    def __init__(self, model: _core.Model, tokenizer: Tokenizer, pool: PoolConfig, *, policy: str = "lru",
                 prefix_cache_dir: Union[None, str, os.PathLike] = None,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not available (available: {', '.join(POLICIES)})")
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.policy = policy
        self.session = make_session(model, pool)
        self.history: list[int] = []   # the tokens whose K/V the session holds, in order
        self.prefix_cache = PrefixCache(prefix_cache_dir, prefix_cache_bytes) if prefix_cache_dir else None
        self._cache_key = session_key(self.session, model) if self.prefix_cache else ""
        self.n_reused = 0              # of the last prompt: tokens whose K/V were already held or restored
        self.n_computed = 0            # ... and tokens run through the model

    # -- snapshots -------------------------------------------------------------------------------
    def save_state(self, path: Union[str, os.PathLike], *, prefix_chunks: Optional[int] = None) -> None:
        """Snapshot the session (atomically; prefix_chunks=k keeps only the first k chunks)."""
        self.session.save(path, prefix_chunks=prefix_chunks)

    def load_state(self, path: Union[str, os.PathLike]) -> None:
        """Make the session hold a snapshot's state; a prompt extending its tokens then prefills only
        the new suffix. On error (SnapshotError, OSError) nothing changes."""
        self.session.load(path)
        self.history = self.session.tokens.tolist()

    def _restore_cached_prefix(self, tokens: list[int], n_keep: int) -> int:
        """Load the longest cached prefix of `tokens` if it beats the n_keep tokens already held."""
        hit = self.prefix_cache.lookup(self._cache_key, tokens, longer_than=n_keep)
        if hit is None:
            return n_keep
        try:
            self.load_state(hit.path)
        except (SnapshotError, OSError) as e:
            log.warning("prefix cache: dropping %s: %s", hit.path.name, e)
            self.prefix_cache.discard(hit.path)
            return n_keep
        return common_prefix(self.history, tokens)

    # -- prefill ---------------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """Make the session hold exactly `tokens`, computing only the part that differs from what it
        holds already; returns the logits after the last token."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("cannot generate from an empty prompt")
        if len(tokens) > self.pool.n_ctx:
            raise ValueError(f"prompt of {len(tokens)} tokens exceeds n_ctx={self.pool.n_ctx}")
        n_keep = common_prefix(self.history, tokens)
        if self.prefix_cache is not None:
            n_keep = self._restore_cached_prefix(tokens, n_keep)
        n_keep = min(n_keep, len(tokens) - 1)   # the last prompt token is always run, for its logits
        if n_keep < len(self.history):
            self.session.truncate(n_keep)
            del self.history[n_keep:]
        suffix = np.asarray(tokens[n_keep:], dtype=np.int32)
        logits = self.session.forward(suffix, n_keep)   # the session splits it into pool-sized batches
        self.history.extend(tokens[n_keep:])
        self.n_reused, self.n_computed = n_keep, len(suffix)
        return logits

    # -- decode ----------------------------------------------------------------------------------
    def decode_one(self, token: int) -> np.ndarray:
        logits = self.session.forward(np.asarray([token], dtype=np.int32), len(self.history))
        self.history.append(int(token))
        return logits

    def generate(self, prompt: Union[str, Sequence[int], Sequence[Mapping[str, str]]],
                 params: Optional[SamplingParams] = None, **sampling) -> Iterator[GenerationRecord]:
        """Stream records for a prompt given as text, token ids, or chat messages (rendered with the
        GGUF's template). Sampling options come as a SamplingParams or as keywords (max_tokens,
        temperature, top_k, top_p, min_p, seed, stop); temperature 0 is greedy and deterministic."""
        params = params or SamplingParams(**sampling)
        logits = self.prefill(self.prompt_tokens(prompt))
        sampler = Sampler(params)
        stream = TextStream(params.stop)
        finish = "length"
        for i in range(params.max_tokens):
            token = sampler(logits)
            if self.tokenizer.is_eog(token):
                finish = "stop"
                break
            text = stream.push(self.tokenizer.piece(token))
            if stream.stopped:
                yield GenerationRecord(token, text, None)
                finish = "stop"
                break
            yield GenerationRecord(token, text, None)
            if i + 1 == params.max_tokens or len(self.history) >= self.pool.n_ctx:
                break
            logits = self.decode_one(token)
        if self.prefix_cache is not None:   # before the last yield: a consumer may stop after it
            self.prefix_cache.store(self._cache_key, self.session)
        yield GenerationRecord(None, stream.flush(), finish)

    def prompt_tokens(self, prompt: Union[str, Sequence[int], Sequence[Mapping[str, str]]]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, parse_special=True)
        prompt = list(prompt)
        if prompt and isinstance(prompt[0], Mapping):
            text = self.tokenizer.apply_chat_template(prompt)
            return self.tokenizer.encode(text, add_special=False, parse_special=True)   # BOS is in the template
        return [int(t) for t in prompt]

    # -- figures ---------------------------------------------------------------------------------
    def stats(self) -> dict:
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
            "host_kv_bytes": pager.host_bytes(),
            "page_outs": ps.page_outs,
            "page_ins": ps.page_ins,
            "bytes_moved": ps.bytes_out + ps.bytes_in,
            "reselects": ps.reselects,
            "prompt_tokens_reused": self.n_reused,
            "prompt_tokens_computed": self.n_computed,
            "time_paging_ms": round(t.t_paging_ms, 3),
            "time_compute_ms": round(t.t_compute_ms, 3),
            "time_scoring_ms": 0.0,
        }


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n
