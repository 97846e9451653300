"""The user-facing model: llama-cpp-python's surface (create_completion / __call__, create_chat_completion,
tokenize/detokenize, close/with) over an Engine, with KVFlash options and figures added.

A Model serialises its calls (see engine.py): use it from any thread; a call made while a stream of it is
unfinished supersedes that stream (its next step raises StreamSuperseded). After close() every call raises
ValueError."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

from .engine import CLOSED, Engine
from .known_models import resolve_model_path
from .loading import load, load_for_slots
from .mtp import wants_mtp
from .options import DeviceConfig, PoolConfig, ResidencyConfig, SamplingParams, SpeculativeConfig
from .responses import Responses
from .snapshot import DEFAULT_PREFIX_CACHE_BYTES
from .tokenizer import check_messages
from .tokens import text_if_bytes

log = logging.getLogger(__name__)


def check_pool_tokens(pool_tokens: Union[None, int, str]) -> Union[None, int, str]:
    """One rule with the CLI's --kvflash: a pool is a positive size, 'auto', or None / 'off' for the full cache.
    0 is refused (it used to mean the full cache here while the CLI refused it)."""
    if isinstance(pool_tokens, int) and not isinstance(pool_tokens, bool) and pool_tokens <= 0:
        raise ValueError(f"pool_tokens must be a positive number of tokens, 'auto', or None / 'off' for the full "
                         f"cache; got {pool_tokens}")
    return pool_tokens


class Model:
    # The pool and residency keywords take their defaults from PoolConfig and ResidencyConfig (declared there).
    def __init__(self, model_path: Union[str, os.PathLike] = "smollm2", *, n_ctx: int = PoolConfig.n_ctx,
                 pool_tokens: Union[None, int, str] = PoolConfig.pool_tokens,
                 policy: Union[str, Callable] = ResidencyConfig.policy, tau: int = ResidencyConfig.tau,
                 prefill_reselect: bool = ResidencyConfig.prefill_reselect, kv_type: str = PoolConfig.kv_type,
                 backend: str = "auto", rpc: Optional[Sequence[str]] = None,
                 devices: Optional[Sequence[str]] = None, tensor_split: Optional[Sequence[float]] = None,
                 n_threads: Optional[int] = None, allow_beyond_train_ctx: bool = PoolConfig.allow_beyond_train_ctx,
                 attention: str = PoolConfig.attention,
                 n_batch: int = PoolConfig.n_batch, chat_template: Optional[str] = None, chat_special: bool = False,
                 prefix_cache_dir: Union[None, str, os.PathLike] = None,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
                 drafter_model: Union[None, str, os.PathLike] = ResidencyConfig.drafter_model,
                 refresh_tokens: int = ResidencyConfig.refresh_tokens, prefill: str = ResidencyConfig.prefill,
                 prompt_scores: str = ResidencyConfig.prompt_scores,
                 speculative: Union[None, str, os.PathLike, SpeculativeConfig] = None,
                 draft_max: int = SpeculativeConfig.max_draft,
                 max_device_bytes: Optional[int] = PoolConfig.max_device_bytes,
                 max_host_bytes: Optional[int] = PoolConfig.max_host_bytes) -> None:
        self.engine: Optional[Engine] = None   # so that close() works on a half-built Model
        self.model_path = resolve_model_path(model_path)
        # Both checked here (pool_tokens by the core's own rules), before any weight is loaded. max_device_bytes:
        # each device's whole footprint (weights, pool, buffers, headroom) stays within it; max_host_bytes: the K/V
        # the pool sends to host memory at n_ctx (PoolConfig).
        self.pool = PoolConfig(n_ctx=n_ctx, pool_tokens=check_pool_tokens(pool_tokens), kv_type=kv_type,
                               attention=attention, n_batch=n_batch, allow_beyond_train_ctx=allow_beyond_train_ctx,
                               max_device_bytes=max_device_bytes, max_host_bytes=max_host_bytes)
        self.residency = ResidencyConfig(policy=policy, tau=tau, prefill_reselect=prefill_reselect,
                                         refresh_tokens=refresh_tokens, prefill=prefill, prompt_scores=prompt_scores,
                                         drafter_model=drafter_model)
        # speculative: "prompt_lookup", "mtp", a draft GGUF, or a SpeculativeConfig (checked before loading).
        self.speculative = speculative if isinstance(speculative, SpeculativeConfig) or speculative is None else \
            SpeculativeConfig(draft=speculative, max_draft=draft_max)
        # Where the layers go, as llama.cpp splits them, and the CPU threads (DeviceConfig); checked before loading.
        self.device_config = DeviceConfig(backend=backend, rpc=rpc, devices=devices, tensor_split=tensor_split,
                                          n_threads=n_threads)
        # speculative="mtp": the weights of the GGUF's multi-token-prediction head too (else they are not loaded).
        # chat_special: chat messages may write control tokens, as llama-server lets them (default: text, as OpenAI)
        loaded = load(self.model_path, self.device_config, mtp=wants_mtp(self.speculative), chat_special=chat_special)
        self._core_model, self.tokenizer = loaded.model, loaded.tokenizer
        # 'auto': what every device's free memory (and max_device_bytes) holds; a number: checked against
        # max_device_bytes if one is given (fit.py); the drafter and a draft model loaded once, before the fit
        slots = load_for_slots(self._core_model, self.pool, 1, residency=self.residency, speculative=self.speculative)
        self.pool, self.residency, self.speculative = slots.pool, slots.residency, slots.speculative
        log.info("pool_tokens=%r: %s", pool_tokens, slots.why)
        self.engine = Engine(self._core_model, self.tokenizer, self.pool, self.residency,
                             prefix_cache_dir=prefix_cache_dir, prefix_cache_bytes=prefix_cache_bytes,
                             chat_template=chat_template, speculative=self.speculative)
        self.model_name = Path(self.model_path).stem

    def _open_engine(self) -> Engine:
        if self.engine is None or self.engine.closed:
            raise ValueError(CLOSED)
        return self.engine

    # -- tokens ----------------------------------------------------------------------------------
    def tokenize(self, text: Union[str, bytes], add_bos: bool = True, special: bool = False) -> list[int]:
        self._open_engine()
        return self.tokenizer.encode(text, add_special=add_bos, parse_special=special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        self._open_engine()
        return self.tokenizer.decode(tokens)

    # -- completions -----------------------------------------------------------------------------
    def create_completion(self, prompt: Union[str, bytes, Sequence[int]], *, max_tokens: Optional[int] = 16,
                          stream: bool = False, logprobs: Optional[int] = None,
                          **sampling: Any) -> Union[dict, Iterator[dict]]:
        """prompt: text (bytes, bytearray, memoryview: UTF-8 text) or token ids. max_tokens None: until EOS or a
        full context.
        sampling: temperature (0.8), top_k (40), top_p (0.95), min_p (0.05), seed (None or -1: random), stop
        (see SamplingParams). logprobs=N: each token's log-probability and the N most likely (OpenAI's
        completions shape). A stream's chunks come as it is iterated (see the module docstring)."""
        return self._respond(prompt, SamplingParams(max_tokens=max_tokens, **sampling), False, stream, logprobs)

    __call__ = create_completion

    def create_chat_completion(self, messages: Sequence[Mapping[str, str]], *, max_tokens: Optional[int] = 256,
                               stream: bool = False, logprobs: bool = False, top_logprobs: Optional[int] = None,
                               **sampling: Any) -> Union[dict, Iterator[dict]]:
        """messages: rendered with the chat_template given to the Model, else the GGUF's own. Sampling options
        as for create_completion; logprobs=True (with top_logprobs=N) as OpenAI's chat shape."""
        return self._respond(check_messages(messages), SamplingParams(max_tokens=max_tokens, **sampling), True, stream,
                             (top_logprobs or 0) if logprobs else None)

    def _respond(self, prompt: Union[str, bytes, Sequence], params: SamplingParams, chat: bool,
                 stream: bool, logprobs: Optional[int] = None) -> Union[dict, Iterator[dict]]:
        engine = self._open_engine()
        tokens = engine.prompt_tokens(text_if_bytes(prompt))   # a memoryview is text too, not a list of ids
        shape = Responses(chat=chat, model=self.model_name, n_prompt=len(tokens), tokenizer=self.tokenizer)
        # The engine's lock for the whole of a non-streamed call: no other call can supersede it halfway.
        with engine._lock:
            # checks and takes the session now, not at the first next()
            records = engine.generate(tokens, params, logprobs=logprobs)
            chunks = (shape.chunk(rec) for rec in records)
            return chunks if stream else shape.collect(chunks)

    # -- snapshots -------------------------------------------------------------------------------
    def save_state(self, path: Union[str, os.PathLike], *, prefix_chunks: Optional[int] = None) -> None:
        """Save what the model holds (K/V of every chunk, pager ledger, tokens) to `path`, atomically."""
        self._open_engine().save_state(path, prefix_chunks=prefix_chunks)

    def load_state(self, path: Union[str, os.PathLike]) -> None:
        """Hold a saved state again; a later prompt that extends its tokens prefills only the new suffix.
        Raises SnapshotError (a ValueError naming the reason) or OSError; nothing changes then."""
        self._open_engine().load_state(path)

    # -- figures and lifetime --------------------------------------------------------------------
    def stats(self) -> dict:
        return self._open_engine().stats()

    @property
    def devices(self) -> list[dict]:
        """The layer split: per device in layer order, its name, the layers it holds (n_layer: the output layer)
        and its weight bytes (_core.Model.devices)."""
        self._open_engine()
        return self._core_model.devices

    def close(self) -> None:
        """Free the weights, the KV and the drafter; any later call raises ValueError. Idempotent."""
        if self.engine is not None:
            self.engine.close()
        self._core_model = None

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

