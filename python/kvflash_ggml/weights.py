"""A GGUF's weights on the devices a DeviceConfig names, with the thread count resolved as everywhere (threads.py):
the one place that makes a _core.Model, for the Model, the server, the benches, drafters and draft models alike
(issue 38 item 1)."""
from __future__ import annotations

import os
from typing import Union

from . import _core
from .known_models import resolve_model_path
from .options import DeviceConfig
from .threads import cpu_threads

__all__ = ["load_model"]


def load_model(model_path: Union[str, os.PathLike], devices: DeviceConfig, *,
               mtp: bool = False) -> tuple[str, _core.Model]:
    """The GGUF's path and its weights on `devices` (mtp: with its multi-token-prediction head). FileNotFoundError
    for a missing file or package; ValueError for a bad split, ConnectionError for an RPC server that does not
    answer, RuntimeError for a file the core cannot load."""
    path = resolve_model_path(model_path)
    return path, _core.Model(path, n_threads=cpu_threads(devices.n_threads), mtp=mtp, **devices.placement())
