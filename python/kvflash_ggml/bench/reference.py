"""What the speed benches share: llama-bench, the reference every figure of ours is printed beside (found,
run, read), where llama-server is found, the driver's free device memory, and the command-line plumbing
before a run (the flags for the reference, comma-separated integer lists, the model)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .. import _core
from ..commands.flags import device_keywords
from ..known_models import resolve_model_path
from ..tokenizer import Tokenizer


def _first_executable(candidates: Sequence[Optional[str]]) -> Optional[str]:
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def find_llama_bench(explicit: Optional[str]) -> Optional[str]:
    """--llama-bench, $KVFLASH_LLAMA_BENCH, the one installed in the package beside its libraries and CPU
    variants (KVFLASH_LLAMA_BENCH=ON builds), a build made by scripts/build_llama_bench.sh, or llama-bench on
    PATH."""
    candidates = [explicit, os.environ.get("KVFLASH_LLAMA_BENCH"),
                  str(Path(__file__).resolve().parent.parent / "llama-bench")]
    candidates += [str(p) for p in sorted(Path.cwd().glob("build/llama-bench/**/llama-bench"))]
    candidates.append(shutil.which("llama-bench"))
    return _first_executable(candidates)


def find_llama_server() -> Optional[str]:
    """The llama-server installed in the package (KVFLASH_LLAMA_SERVER=ON builds), or one in a build folder
    under the working directory (build/*/bin/llama-server). Not PATH: `kvflash bench serve` runs what this
    finds without being asked, and only one from our tree and ggml build compares like with like."""
    candidates = [str(Path(__file__).resolve().parent.parent / "llama-server")]
    candidates += [str(p) for p in sorted(Path.cwd().glob("build/*/bin/llama-server"))]
    return _first_executable(candidates)


def gpu_free_bytes() -> Optional[int]:
    devices = _core.gpu_devices()
    return devices[0]["memory_free"] if devices else None


def llama_bench_results(binary: str, model_path: str, test: Sequence[str], threads: int, on_gpu: bool,
                        reps: int) -> list[dict]:
    """llama-bench's JSON records for one call with the test flags `test` (e.g. -p 0 -n 32 -d 0,2048). CPU: both
    attention paths (the faster one differs with depth). GPU: all layers offloaded and flash attention on, what
    the CUDA backend prefers and what our backend="auto" runs. A record's tok/s: median_ts(record)."""
    cmd = [binary, "-m", model_path, *test, "-t", str(threads), "-r", str(reps), "-o", "json"]
    cmd += ["-ngl", "99", "-fa", "1"] if on_gpu else ["-ngl", "0", "-fa", "0,1"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {proc.stderr.strip()[-1000:]}")
    return json.loads(proc.stdout)


def llama_bench_split(args: argparse.Namespace) -> list[str]:
    """llama-bench's flags for the split the model flags name: --rpc, then -ts. llama-bench puts the RPC servers'
    devices before this host's GPU, as our default order does; a --devices list has no llama-bench spelling here."""
    if getattr(args, "devices", None):
        raise ValueError("the llama-bench comparison takes a split from --rpc and --tensor-split (RPC servers first, "
                         "then this host's GPU), not --devices")
    flags = ["--rpc", ",".join(args.rpc)] if getattr(args, "rpc", None) else []
    if getattr(args, "tensor_split", None):
        flags += ["-ts", "/".join(f"{x:g}" for x in args.tensor_split)]
    return flags


def median_ts(record: dict) -> float:
    """The median of the repetitions, as for ours (a single slow window moved a mean by up to 10% on the H100)."""
    return float(np.median(record["samples_ts"])) if record.get("samples_ts") else float(record["avg_ts"])


# ---- before a run: errors here end the command with status 2, before anything is measured ----

def add_reference_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--llama-bench", default=None, help="path to llama-bench (default: search, see docs)")
    ap.add_argument("--no-llama-bench", action="store_true", help="only our figures")


def int_list(ap: argparse.ArgumentParser, text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{flag} must be comma-separated integers, got {text!r}")


def reference_binary(args: argparse.Namespace, prog: str) -> Optional[str]:
    """llama-bench, or None with --no-llama-bench; a missing one ends the command."""
    if args.no_llama_bench:
        return None
    binary = find_llama_bench(args.llama_bench)
    if binary is None:
        print(f"{prog}: llama-bench not found; build it with scripts/build_llama_bench.sh, pass --llama-bench PATH, "
              "or run with --no-llama-bench", file=sys.stderr)
        raise SystemExit(2)
    return binary


def open_model(args: argparse.Namespace, prog: str, *, mtp: bool = False) -> tuple[str, _core.Model, Tokenizer]:
    """The model flags' GGUF path, model and tokenizer (mtp: with its multi-token-prediction head); a file that
    cannot be loaded ends the command."""
    try:
        path = resolve_model_path(args.model)
        return path, _core.Model(path, n_threads=args.threads, mtp=mtp, **device_keywords(args)), Tokenizer(path)
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2)
