"""kvflash-ggml: GGUF models on ggml with bounded KV residency (KVFlash).

The K/V cache of the full-attention layers lives in a fixed pool of slots; the context is managed
in 64-token chunks that are paged between the pool and host memory. See README.md.
"""
from __future__ import annotations

import logging

from . import _core
from .engine import Engine, StreamSuperseded
from .generation import GenerationRecord
from .known_models import resolve_model_path
from .model import Model
from .options import DeviceConfig, PoolConfig, ResidencyConfig, SamplingParams
from .snapshot import PrefixCache, SnapshotError
from .tokenizer import Tokenizer

Session = _core.Session
SessionConfig = _core.SessionConfig

__version__ = "0.1.0"
__all__ = ["Model", "Engine", "GenerationRecord", "DeviceConfig", "PoolConfig", "PrefixCache", "ResidencyConfig",
           "SamplingParams", "Session", "SessionConfig", "SnapshotError", "StreamSuperseded", "Tokenizer",
           "resolve_model_path", "__version__"]

logging.getLogger(__name__).addHandler(logging.NullHandler())
