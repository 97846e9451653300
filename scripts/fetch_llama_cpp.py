#!/usr/bin/env python3
"""Fetch the pinned llama.cpp tree into third_party/llama.cpp.

The tree comes from the PyPI sdist of llama-cpp-python (which vendors llama.cpp
and ggml), so the only network access is pip talking to PyPI. The sdist is
sha256-checked before anything is unpacked. Running it again is a no-op.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP_COMMIT = "0c1e570"
ROOT = Path(__file__).resolve().parent.parent
DEST = ROOT / "third_party" / "llama.cpp"
STAMP = ".kvflash-source"


def fail(msg: str) -> None:
    print(f"fetch_llama_cpp: error: {msg}", file=sys.stderr)
    sys.exit(1)


def download_sdist(workdir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", "-d", str(workdir), f"{SDIST_NAME}=={SDIST_VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        fail(f"pip download failed (exit {proc.returncode}):\n{proc.stderr.strip()[-2000:]}")
    found = sorted(workdir.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        fail(f"pip download produced no sdist in {workdir}")
    return found[0]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def unpack_vendor_tree(sdist: Path, dest: Path) -> None:
    prefix = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(prefix) or not (m.isfile() or m.isdir()) or m.name.endswith("/.git"):
                continue
            m.name = m.name[len(prefix):]
            if m.name:
                members.append(m)
        if not members:
            fail(f"{sdist.name} holds no {prefix}")
        tar.extractall(staging, members=members, filter="data")
    (staging / STAMP).write_text(f"{SDIST_NAME}=={SDIST_VERSION} sha256={SDIST_SHA256} "
                                 f"llama.cpp={LLAMA_CPP_COMMIT}\n")
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)  # atomic: a half-unpacked tree never looks complete


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sdist", type=Path, help="use this already-downloaded sdist instead of pip")
    ap.add_argument("--force", action="store_true", help="re-fetch even if the tree is present")
    args = ap.parse_args()
    if (DEST / STAMP).exists() and not args.force:
        print(f"fetch_llama_cpp: {DEST} already present")
        return
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or download_sdist(Path(tmp))
        got = sha256(sdist)
        if got != SDIST_SHA256:
            fail(f"sha256 mismatch for {sdist.name}: got {got}, expected {SDIST_SHA256}")
        unpack_vendor_tree(sdist, DEST)
    print(f"fetch_llama_cpp: unpacked llama.cpp {LLAMA_CPP_COMMIT} into {DEST}")


if __name__ == "__main__":
    main()
