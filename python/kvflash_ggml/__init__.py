"""kvflash-ggml: GGUF models on ggml with bounded KV residency (KVFlash).

The K/V cache of the full-attention layers lives in a fixed pool of slots; the context is managed
in 64-token chunks that are paged between the pool and host memory. See README.md.
"""
from __future__ import annotations

import logging
import os

# ggml's CPU threads are OpenMP threads, which meet at a barrier after every graph node. Under OpenMP's default
# wait policy a thread spins up to ~3 ms at each before it sleeps, so on cores that other processes also use, a
# decode with 2 threads ran 30-80x slower than with one (SmolLM2, the shared 2-core dev VM, median tok/s: 3.1
# default, 21.8 passive, 31.0 one thread; beside a busy process 1.2 / 13.7 / 12.0). libgomp reads the variable once,
# when it is loaded, which importing _core below does: so it is set here, first. A user's own OMP_WAIT_POLICY or
# GOMP_SPINCOUNT wins.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "passive"

from . import _core  # noqa: E402  (after the wait policy)
from .engine import Engine, GenerationRecord, StreamSuperseded
from .known_models import resolve_model_path
from .model import Model
from .options import PoolConfig, ResidencyConfig, SamplingParams
from .snapshot import PrefixCache, SnapshotError
from .tokenizer import Tokenizer

Session = _core.Session
SessionConfig = _core.SessionConfig

__version__ = "0.1.0"
__all__ = ["Model", "Engine", "GenerationRecord", "PoolConfig", "PrefixCache", "ResidencyConfig", "SamplingParams",
           "Session", "SessionConfig", "SnapshotError", "StreamSuperseded", "Tokenizer", "resolve_model_path", "__version__"]

logging.getLogger(__name__).addHandler(logging.NullHandler())
