"""The source directory of a conversion: config.json plus one or more safetensors files.

Tensors are read lazily, one at a time, through a memory map of the file: only the tensor being
converted (and its float32 copy) is in memory, so a model larger than RAM still converts. The
safetensors layout is read directly (an 8-byte header length, a JSON header, raw little-endian data)
because the numpy path of the `safetensors` package cannot return bfloat16, the dtype most
checkpoints ship in, and its torch path would make torch a dependency of converting.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .errors import ConversionError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# safetensors dtype -> numpy dtype of the stored bytes (BF16 is widened to float32 by hand).
_STORED = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    path: Path          # the safetensors file holding it
    dtype: str          # safetensors dtype string, e.g. "BF16"
    shape: tuple        # numpy (row-major) order, as Hugging Face stores it
    begin: int          # absolute byte offset of the data in the file
    end: int


def read_json(path: Path, what: str) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConversionError(f"missing file: {path} ({what})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def read_header(path: Path) -> List[TensorEntry]:
    """The tensor table of one safetensors file, with every offset checked against the file size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ConversionError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n_header,) = struct.unpack("<Q", raw_len)
        if n_header > size - 8:
            raise ConversionError(f"{path} is not a safetensors file (header length {n_header} > file size {size})")
        try:
            header = json.loads(f.read(n_header))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConversionError(f"{path} has a corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path} has a corrupt safetensors header: a JSON {type(header).__name__}, "
                              f"not an object")
    header.pop("__metadata__", None)
    base = 8 + n_header
    return [_entry(path, name, info, base, size) for name, info in header.items()]


def _entry(path: Path, name: str, info: Any, base: int, size: int) -> TensorEntry:
    """One tensor of a safetensors header, every field checked (a header is untrusted input)."""
    def bad(what: str) -> ConversionError:
        return ConversionError(f"{path} has a corrupt safetensors header: tensor {name} {what}")

    if not isinstance(info, dict):
        raise bad(f"is described by a JSON {type(info).__name__}, not an object")
    offsets, shape, dtype = info.get("data_offsets"), info.get("shape"), info.get("dtype")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise bad(f"has data_offsets {offsets!r} (expected [begin, end], 0 <= begin <= end)")
    if not (isinstance(shape, list) and all(_natural(d) for d in shape)):
        raise bad(f"has shape {shape!r} (expected a list of sizes)")
    if not isinstance(dtype, str):
        raise bad(f"has dtype {dtype!r}")
    begin, end = base + offsets[0], base + offsets[1]
    if end > size:
        raise ConversionError(f"{path} is truncated: tensor {name} ends at byte {end}, the file has {size}")
    return TensorEntry(name, path, dtype, tuple(shape), begin, end)


def _natural(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _shard_files(src: Path) -> List[Path]:
    """The safetensors files of a checkpoint: those its index names, else the single or all *.safetensors."""
    index_path = src / INDEX_NAME
    if index_path.exists():
        weight_map = read_json(index_path, "the shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConversionError(f"{index_path} has no weight_map")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (src / f).is_file()]
        if missing:
            raise ConversionError(f"missing file: {src / missing[0]} (a shard named by {INDEX_NAME}; "
                                  f"{len(missing)} of {len(files)} shards are missing)")
        return [src / f for f in files]
    files = sorted(src.glob("*.safetensors"))
    if not files:
        extra = " (only PyTorch .bin weights found: re-save with safe_serialization=True)" \
            if any(src.glob("*.bin")) else ""
        raise ConversionError(f"missing file: no {SINGLE_NAME}, {INDEX_NAME} or *.safetensors in {src}{extra}")
    return files


class Checkpoint:
    """A Hugging Face checkpoint directory, its config and its tensors (read on demand)."""

    def __init__(self, src: os.PathLike | str) -> None:
        self.src = Path(src)
        if not self.src.is_dir():
            raise ConversionError(f"missing file: source directory {self.src} does not exist or is not a directory")
        self.config = read_json(self.src / "config.json", "the model configuration")
        self.tensors: Dict[str, TensorEntry] = {}
        for path in _shard_files(self.src):
            for e in read_header(path):
                if e.name in self.tensors:
                    raise ConversionError(f"tensor {e.name} appears in both {self.tensors[e.name].path.name} "
                                          f"and {path.name}")
                self.tensors[e.name] = e

    def optional_json(self, name: str) -> Optional[Dict[str, Any]]:
        path = self.src / name
        return read_json(path, name) if path.is_file() else None

    def shape(self, name: str) -> Optional[tuple]:
        e = self.tensors.get(name)
        return e.shape if e else None

    def read(self, name: str) -> np.ndarray:
        """The tensor as a float32 array in Hugging Face's shape; raises on non-finite values."""
        e = self.tensors[name]
        stored = _STORED.get(e.dtype)
        if stored is None:
            raise ConversionError(f"tensor {name} in {e.path.name} has dtype {e.dtype}; only F32, F16 and BF16 "
                                  f"checkpoints can be converted (dequantize the checkpoint first)")
        n = int(np.prod(e.shape, dtype=np.int64))
        if n * np.dtype(stored).itemsize != e.end - e.begin:
            raise ConversionError(f"tensor {name} in {e.path.name}: {e.end - e.begin} bytes do not fit "
                                  f"shape {list(e.shape)} of {e.dtype}")
        mm = np.memmap(e.path, dtype=stored, mode="r", offset=e.begin, shape=(n,))
        if e.dtype == "BF16":
            out = (mm.astype(np.uint32) << 16).view(np.float32)
        else:
            out = mm.astype(np.float32)
        del mm
        check_finite(name, out)
        return out.reshape(e.shape)


def check_finite(name: str, data: np.ndarray) -> None:
    finite = np.isfinite(data)
    if not finite.all():
        bad = int(data.size - np.count_nonzero(finite))
        first = int(np.argmin(finite.reshape(-1)))
        raise ConversionError(f"non-finite weights: tensor {name} has {bad} NaN/inf value(s) "
                              f"(first at flat index {first}: {data.reshape(-1)[first]})")


def layer_indices(names: Sequence[str], prefix: str = "model.layers.") -> List[int]:
    """Sorted block indices that have at least one tensor."""
    out = set()
    for n in names:
        if n.startswith(prefix):
            head = n[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                out.add(int(head))
    return sorted(out)
