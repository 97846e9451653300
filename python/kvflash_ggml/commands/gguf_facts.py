"""What the command-line flags need from a GGUF before its weights load: the context it was trained for
(--n-ctx 0, llama.cpp's -c 0) and its layer count (-ngl N), read by the core's checked GGUF metadata reads
(`_core.gguf_header`) without libllama's vocabulary load (2.6 s for Gemma 3's 262K tokens on these CPUs)."""
from __future__ import annotations

from dataclasses import dataclass

from .. import _core


@dataclass(frozen=True)
class GgufFacts:
    n_ctx_train: int
    n_layer: int


def read_gguf_facts(path: str) -> GgufFacts:
    """ValueError naming the file and the reason when it is not a GGUF with those two numbers."""
    try:
        header = _core.gguf_header(str(path))
    except RuntimeError as e:
        raise ValueError(f"{path}: not a readable GGUF header ({e})") from None
    return GgufFacts(n_ctx_train=header["context_length"], n_layer=header["block_count"])
