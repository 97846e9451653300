"""One place that loads a model and resolves its options (issue 38 item 1; docs/DESIGN.md § Where each rule lives):
the Model, `kvflash serve` and the benches call it, so a GGUF, a split and pool_tokens="auto" mean the same in each.

load(): the GGUF (a path or a short name), its weights where DeviceConfig puts them with the thread count resolved
(weights.py, which drafters and draft models load through too), and its tokenizer. load_for_slots(): what n_slots sessions of that model run with: the trained
context checked, a drafter's and a draft model's weights loaded once (every slot shares them) and before the pool
is fitted (their weights take device memory too), and the pool resolved by fit.resolve_pool ('auto' sized on
every device of a split, a number checked against max_device_bytes). Building the engines stays with the caller
(one Engine for a Model, slot_engines for the server, sessions for a bench)."""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Union

from . import _core
from .engine_parts import draft_model_of, with_loaded_draft, with_loaded_drafter
from .fit import resolve_pool
from .mtp import wants_mtp
from .options import DeviceConfig, PoolConfig, ResidencyConfig, SpeculativeConfig
from .tokenizer import Tokenizer
from .weights import load_model

__all__ = ["Loaded", "SlotOptions", "check_train_ctx", "load", "load_for_slots"]


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A GGUF loaded once: its resolved path, the core model and its tokenizer."""
    path: str
    model: _core.Model
    tokenizer: Tokenizer


@dataclasses.dataclass(frozen=True)
class SlotOptions:
    """What the sessions of a loaded model run with: the pool resolved (a number, or None for the full cache) and
    why it has its size; the residency and speculation with their models loaded."""
    pool: PoolConfig
    why: str
    residency: ResidencyConfig
    speculative: Optional[SpeculativeConfig]


def load(model_path: Union[str, os.PathLike], devices: DeviceConfig, *, mtp: bool = False,
         chat_special: bool = False) -> Loaded:
    """load_model and the GGUF's tokenizer (chat_special: chat messages may write control tokens)."""
    path, model = load_model(model_path, devices, mtp=mtp)
    return Loaded(path, model, Tokenizer(path, chat_special=chat_special))


def check_train_ctx(model: _core.Model, pool: PoolConfig) -> None:
    """n_ctx past the context the GGUF was trained for, in the options' own words (the core names max_tokens)."""
    n_ctx_train = model.hparams.n_ctx_train
    if pool.n_ctx > n_ctx_train and not pool.allow_beyond_train_ctx:
        raise ValueError(f"n_ctx={pool.n_ctx} exceeds the model's trained context {n_ctx_train}; pass "
                         f"allow_beyond_train_ctx=True to run past it (positions the model never saw in training)")


def load_for_slots(model: _core.Model, pool: PoolConfig, n_slots: int, *,
                   residency: ResidencyConfig = ResidencyConfig(),
                   speculative: Optional[SpeculativeConfig] = None) -> SlotOptions:
    """The options n_slots sessions of `model` run with (a Model: 1; the server: --parallel). The drafter and the
    draft model are loaded before the fit, so that their weights are on the devices when 'auto' measures them."""
    check_train_ctx(model, pool)
    residency = with_loaded_drafter(residency, model)   # one copy of a drafter's weights for every session
    speculative = with_loaded_draft(speculative, model)   # one draft model for every session
    resolved, why = resolve_pool(model, pool, n_slots, draft_model=draft_model_of(speculative),
                                 mtp=wants_mtp(speculative))
    return SlotOptions(resolved, why, residency, speculative)
