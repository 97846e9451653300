"""What the command-line flags need from a GGUF before its weights load: the context it was trained for
(--n-ctx 0, llama.cpp's -c 0) and its layer count (-ngl N).

Read from the file's header with the GGUF layout (gguf.md in ggml): libllama reads metadata only together with
the vocabulary (`_core.Vocab`: 2.6 s for Gemma 3's 262K tokens on these CPUs, longer than loading its weights),
and the `gguf` package is an optional dependency. The two numbers come before the tokenizer's arrays in every
converter's output, so the read stops early; anything unexpected is a ValueError naming the file."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO

# GGUF value types: the fixed sizes, and the two of variable size
SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
INTEGERS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


@dataclass(frozen=True)
class GgufFacts:
    n_ctx_train: int
    n_layer: int


def read_gguf_facts(path: str) -> GgufFacts:
    try:
        with open(path, "rb") as f:
            meta = read_numbers(f)
    except (struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a readable GGUF header ({e})") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    arch = meta.get("general.architecture")
    try:
        return GgufFacts(n_ctx_train=int(meta[f"{arch}.context_length"]), n_layer=int(meta[f"{arch}.block_count"]))
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: the GGUF has no integer {arch}.context_length and {arch}.block_count") from None


def read_numbers(f: BinaryIO) -> dict:
    """general.architecture and every *.context_length and *.block_count, read key by key until the
    architecture's own two are found (the rest of the header is skipped over)."""
    magic, version = f.read(4), unpack(f, "<I")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"not a GGUF file of version 2 or 3 (magic {magic!r}, version {version})")
    _, n_kv = unpack(f, "<Q"), unpack(f, "<Q")
    found: dict = {}
    for _ in range(n_kv):
        key = read_string(f)
        kind = unpack(f, "<I")
        if key == "general.architecture" and kind == STRING:
            found[key] = read_string(f)
        elif key.endswith((".context_length", ".block_count")) and kind in INTEGERS:
            found[key] = unpack(f, INTEGERS[kind])
        else:
            skip_value(f, kind)
        arch = found.get("general.architecture")
        if arch and f"{arch}.context_length" in found and f"{arch}.block_count" in found:
            break
    return found


def unpack(f: BinaryIO, fmt: str):
    size = struct.calcsize(fmt)
    return struct.unpack(fmt, f.read(size))[0]


def read_string(f: BinaryIO) -> str:
    return f.read(unpack(f, "<Q")).decode("utf-8")


def skip_value(f: BinaryIO, kind: int) -> None:
    if kind in SIZES:
        f.seek(SIZES[kind], 1)
    elif kind == STRING:
        f.seek(unpack(f, "<Q"), 1)
    elif kind == ARRAY:
        item, count = unpack(f, "<I"), unpack(f, "<Q")
        if item in SIZES:
            f.seek(SIZES[item] * count, 1)
        else:
            for _ in range(count):
                skip_value(f, item)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")
