"""The parts an Engine is built from, each made or loaded once: its session, its residency policy, a second
model beside it (load_like: the model itself when the path names its GGUF), the speculator of a
SpeculativeConfig and the drafter policy's companion. Model, the server and the benches load with these too,
so that engines built from one configuration share the weights they load."""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable, Optional, Union


from . import _core
from .companion import Companion, same_vocabulary
from .drafter import DrafterPolicy
from .known_models import resolve_model_path
from .mtp import MtpDraft, check_mtp, wants_mtp
from .options import GPU_POOL_ALIGN, SPECULATIVE_MODES, DeviceConfig, PoolConfig, ResidencyConfig, SpeculativeConfig
from .policy import LRU, BuiltinScorer, CallablePolicy, Policy
from .speculative import DraftModel, PromptLookup, Speculator, TextMappedDraft
from .tokenizer import Tokenizer
from .weights import load_model


def make_session(model: _core.Model, pool: PoolConfig, *, track_summaries: bool = False,
                 n_batch: Optional[int] = None, arena: Optional[_core.PoolArena] = None,
                 mtp: bool = False) -> _core.Session:
    """n_batch: tokens per forward step (default: the pool's own, PoolConfig.prefill_batch). arena: keep the
    pool in a lane of it (a server's slots: their batched decode steps then attend all pools at once). mtp: run
    the model's multi-token-prediction head too (its K/V in the pool; the drafter of draft="mtp")."""
    pool_tokens = pool.resolved_pool_tokens()
    config = _core.SessionConfig(
        max_tokens=pool.n_ctx, pool_tokens=pool_tokens, kv_type=pool.kv_type,
        attention=pool.attention, n_batch=n_batch or pool.prefill_batch(), sink_chunks=pool.sink_chunks,
        tail_chunks=pool.resolved_tail_chunks(pool_tokens), allow_beyond_train_ctx=pool.allow_beyond_train_ctx,
        track_summaries=track_summaries, mtp=mtp)
    session = _core.Session(model, config, arena=arena)
    warning = pool_alignment_warning(model.backend_name, session.flash_attn, session.pager.config().pool_tokens)
    if warning:
        log.warning(warning)
    return session


def pool_alignment_warning(backend_name: str, flash_attn: bool, pool_slots: int) -> Optional[str]:
    """What a CUDA pool that is not a multiple of GPU_POOL_ALIGN slots costs (None: nothing): once full (a whole-context
    pool too, near the context's end), each decode step attends all of its slots, and ggml-cuda's flash attention
    leaves its grouped-query kernels for that n_kv."""
    if "CUDA" not in backend_name or not flash_attn or pool_slots % GPU_POOL_ALIGN == 0:
        return None
    better = -(-pool_slots // GPU_POOL_ALIGN) * GPU_POOL_ALIGN
    return (f"a pool of {pool_slots} slots, not a multiple of {GPU_POOL_ALIGN}: once full, CUDA's flash attention reads "
            f"it without its grouped-query kernels and decode is slower (docs/RESULTS.md, R81); {better} slots would not be")


POLICY_NAMES = ("lru", "qk", "quest", "drafter")
log = logging.getLogger(__name__)


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
        load_model(path, DeviceConfig(backend="auto" if model.on_gpu else "cpu", n_threads=model.n_threads))[1]


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
