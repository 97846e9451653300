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
from ..commands.flags import device_config
from ..loading import load
from ..tokenizer import Tokenizer


def _is_executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


# The same variables switch the tools on in a build (KVFLASH_LLAMA_BENCH=ON pip install .): such a value is not a path.
BUILD_SWITCHES = {"on", "off", "1", "0", "true", "false", "yes", "no", ""}


def _path_from_env(name: str) -> Optional[str]:
    """$name as a tool's path (None when unset or a build switch); a path that is not an executable is an error,
    never a reason to look elsewhere."""
    value = os.environ.get(name)
    if value is None or value.strip().lower() in BUILD_SWITCHES:
        return None
    if not _is_executable(value):
        raise FileNotFoundError(f"${name} {value} is not an executable file")
    return value


def source_trees() -> list[Path]:
    """The checkouts whose build/ folder may hold tools built for this package, wherever the command runs: the
    tree this package's sources sit in (PYTHONPATH=python, an editable install), the folder `pip install .` was
    run in (the distribution's direct_url.json), then the working directory."""
    trees = [Path(__file__).resolve().parents[3]]
    try:
        from importlib.metadata import distribution
        url = json.loads(distribution("kvflash-ggml").read_text("direct_url.json") or "{}").get("url", "")
        if url.startswith("file://"):
            trees.append(Path(url[len("file://"):]))
    except Exception:   # not installed, or installed from an index: nothing recorded
        pass
    trees.append(Path.cwd())
    out: list[Path] = []
    for t in trees:
        if (t / "build").is_dir() and t.resolve() not in out:
            out.append(t.resolve())
    return out


def locate_llama_bench(explicit: Optional[str]) -> Optional[tuple[str, str]]:
    """(path, where it was found): --llama-bench, $KVFLASH_LLAMA_BENCH (either must be an executable: a wrong
    path is an error, not a reason to look elsewhere; ON/OFF is the build switch), the one installed beside the package's libraries
    (KVFLASH_LLAMA_BENCH=ON builds), the one scripts/build_llama_bench.sh built in a source tree's build folder
    (source_trees), or llama-bench on PATH. None when there is none."""
    if explicit:
        if not _is_executable(explicit):
            raise FileNotFoundError(f"--llama-bench {explicit} is not an executable file")
        return explicit, "--llama-bench"
    from_env = _path_from_env("KVFLASH_LLAMA_BENCH")
    if from_env:
        return from_env, "$KVFLASH_LLAMA_BENCH"
    candidates = [(Path(__file__).resolve().parent.parent / "llama-bench", "installed beside the package")]
    for tree in source_trees():
        candidates += [(p, f"built in {tree / 'build'}") for p in sorted(tree.glob("build/llama-bench/**/llama-bench"))]
    on_path = shutil.which("llama-bench")
    if on_path:
        candidates.append((Path(on_path), "on PATH"))
    for path, where in candidates:
        if _is_executable(str(path)):
            return str(path), where
    return None


def find_llama_bench(explicit: Optional[str]) -> Optional[str]:
    """The path locate_llama_bench finds, or None."""
    found = locate_llama_bench(explicit)
    return found[0] if found else None


def find_llama_server() -> Optional[str]:
    """$KVFLASH_LLAMA_SERVER, the llama-server installed in the package (KVFLASH_LLAMA_SERVER=ON builds), or one
    in a source tree's build folder (build/*/bin/llama-server, see source_trees). Not PATH: `kvflash bench serve`
    runs what this finds without being asked, and only one from our tree and ggml build compares like with like."""
    given = _path_from_env("KVFLASH_LLAMA_SERVER")
    if given:
        return given
    candidates = [Path(__file__).resolve().parent.parent / "llama-server"]
    for tree in source_trees():
        candidates += sorted(tree.glob("build/*/bin/llama-server"))
    return next((str(c) for c in candidates if _is_executable(str(c))), None)


def progress(message: str) -> None:
    """A bench's progress: on stderr, so stdout stays the report."""
    print(message, file=sys.stderr, flush=True)


def gpu_free_by_device() -> dict:
    """{GPU name: free bytes now}, the driver's view, for every local GPU."""
    return {d["name"]: d["memory_free"] for d in _core.gpu_devices()}


def gpu_free_bytes() -> Optional[int]:
    """Free bytes over every local GPU (a model split over several takes memory on each)."""
    free = gpu_free_by_device()
    return sum(free.values()) if free else None


def holds_rpc(args: argparse.Namespace) -> bool:
    """Whether the model flags name an RPC device (an rpc-server serves one client at a time, so llama-bench must
    run before our model holds it)."""
    return bool(getattr(args, "rpc", None)) or any(d.lower().startswith("rpc:") for d in getattr(args, "devices", None) or [])


def llama_bench_command(binary: str, model_path: str, test: Sequence[str], threads: int, on_gpu: bool,
                        reps: int) -> list[str]:
    """llama-bench's command line for the test flags `test` (e.g. -p 0 -n 32 -d 0,2048), JSON on stdout. CPU: both
    attention paths (the faster one differs with depth). GPU: all layers offloaded and flash attention on, what
    the CUDA backend prefers and what our backend="auto" runs."""
    cmd = [binary, "-m", model_path, *test, "-t", str(threads), "-r", str(reps), "-o", "json"]
    return cmd + (["-ngl", "99", "-fa", "1"] if on_gpu else ["-ngl", "0", "-fa", "0,1"])


def llama_bench_results(binary: str, model_path: str, test: Sequence[str], threads: int, on_gpu: bool,
                        reps: int) -> list[dict]:
    """llama-bench's JSON records for one call of llama_bench_command. A record's tok/s: median_ts(record)."""
    cmd = llama_bench_command(binary, model_path, test, threads, on_gpu, reps)
    progress(f"llama-bench {' '.join(test)} -r {reps} ({'-fa 1' if on_gpu else '-fa 0,1'}): running, no output "
             "until it ends")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {proc.stderr.strip()[-1000:]}")
    return json.loads(proc.stdout)


def llama_bench_split(args: argparse.Namespace) -> list[str]:
    """llama-bench's flags for the split the model flags name. --rpc: llama-bench puts the RPC servers' devices
    before this host's GPU, as our default order does. --devices: the same devices in the same order (-dev, with
    --rpc first so that llama-bench knows the RPC devices); the local CPU cannot be named there (llama-bench runs on
    the CPU only the layers it does not offload), so a list with 'cpu' is refused. Then -sm layer and -ts.
    ggml-rpc names devices RPC0, RPC1, ... in the order servers register, every device of each server (ours takes
    a server's first): the names below assume one device per server (`ggml-rpc-server -d DEVICE`)."""
    flags = []
    devices = getattr(args, "devices", None) or []
    rpc = list(getattr(args, "rpc", None) or [])
    names = []
    for spelling in devices:
        low = spelling.lower()
        if low.startswith("rpc:"):
            if spelling[4:] not in rpc:
                rpc.append(spelling[4:])
            names.append(f"RPC{rpc.index(spelling[4:])}")
        elif low.startswith("cuda"):
            names.append(f"CUDA{low[4:] or '0'}")
        else:
            raise ValueError(f"the llama-bench comparison cannot place layers on {spelling!r} (llama-bench's -dev "
                             "names GPUs and RPC devices only); run with --no-llama-bench or without it")
    if rpc:
        flags += ["--rpc", ",".join(rpc)]
    if names:
        flags += ["-dev", "/".join(names), "-sm", "layer"]
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
    """llama-bench, or None with --no-llama-bench; a missing one ends the command. Says on stderr which one runs
    and where it was found."""
    if args.no_llama_bench:
        return None
    try:
        found = locate_llama_bench(args.llama_bench)
    except FileNotFoundError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2)
    if found is None:
        print(f"{prog}: llama-bench not found; build it with scripts/build_llama_bench.sh (in the source tree), "
              "set KVFLASH_LLAMA_BENCH or pass --llama-bench PATH, or run with --no-llama-bench", file=sys.stderr)
        raise SystemExit(2)
    print(f"{prog}: llama-bench {found[0]} ({found[1]})", file=sys.stderr, flush=True)
    return found[0]


def open_model(args: argparse.Namespace, prog: str, *, mtp: bool = False) -> tuple[str, _core.Model, Tokenizer]:
    """The model flags' GGUF path, model and tokenizer (mtp: with its multi-token-prediction head); a file that
    cannot be loaded ends the command."""
    try:
        loaded = load(args.model, device_config(args), mtp=mtp)
        return loaded.path, loaded.model, loaded.tokenizer
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2)
