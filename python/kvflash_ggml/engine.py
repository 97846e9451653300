"""The generation loop, top to bottom: sampling -> prefill -> decode one -> a generator of token
records. Residency is the session's business (the pager evicts the oldest chunks when the pool is
full); this module decides only what to feed and when to stop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence, Union

import numpy as np

from . import _core
from .options import PoolConfig, SamplingParams
from .sampling import Sampler
from .tokenizer import TextStream, Tokenizer

POLICIES = ("lru",)


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
    def __init__(self, model: _core.Model, tokenizer: Tokenizer, pool: PoolConfig, *, policy: str = "lru") -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not available (available: {', '.join(POLICIES)})")
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.policy = policy
        self.session = make_session(model, pool)
        self.history: list[int] = []   # the tokens whose K/V the session holds, in order

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
        n_keep = min(n_keep, len(tokens) - 1)   # the last prompt token is always run, for its logits
        if n_keep < len(self.history):
            self.session.truncate(n_keep)
            del self.history[n_keep:]
        suffix = np.asarray(tokens[n_keep:], dtype=np.int32)
        logits = self.session.forward(suffix, n_keep)   # the session splits it into pool-sized batches
        self.history.extend(tokens[n_keep:])
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
