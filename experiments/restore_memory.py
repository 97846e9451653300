"""What a snapshot restore holds in memory besides the session it fills: the process's anonymous memory (RssAnon)
and its file-backed pages (RssFile), sampled every 2 ms while `Session.restore(model, path)` runs, against reading
the file into memory and restoring from the bytes (`Session.from_bytes`), which is what `restore` did before. A restore that reads the file into a buffer holds the file's
size in anonymous memory on top of the host store; one that maps it holds those pages in the page cache instead.

    python experiments/restore_memory.py --model smollm2 --tokens 16384 --pool 512
"""
from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import numpy as np

import kvflash_ggml as kvf
from kvflash_ggml import _core


def rss_kib() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0])
    return out


def peak_during(fn):
    """Runs fn() while a thread samples RSS; returns (result, the peaks above the start, in MiB)."""
    start, peak, done = rss_kib(), dict(rss_kib()), threading.Event()

    def sample():
        while not done.is_set():
            for k, v in rss_kib().items():
                peak[k] = max(peak[k], v)
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    try:
        result = fn()
    finally:
        done.set()
        t.join()
    return result, {k: (peak[k] - start[k]) / 1024 for k in peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--pool", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    n_ctx = args.tokens + 64
    with kvf.Model(model_path=args.model, n_ctx=n_ctx, pool_tokens=args.pool, n_threads=args.threads,
                   prefill="pooled", allow_beyond_train_ctx=True) as llm:   # only bytes are measured
        core_model = llm.engine.model
        llm.engine.prefill(np.random.default_rng(0).integers(100, 20000, args.tokens).tolist())
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "s.kvf")
            llm.engine.session.save(path)
            size = os.path.getsize(path) / 2**20
            print(f"snapshot: {size:.0f} MiB, {llm.engine.session.n_tokens} tokens, pool {args.pool}")
            restored, from_file = peak_during(lambda: _core.Session.restore(core_model, path, max_tokens=n_ctx))
            store = restored.memory()["host_store_bytes"] / 2**20
            del restored
            # what restore(path) did before it mapped the file: the whole file read into memory, then restored from it
            def read_then_restore():
                with open(path, "rb") as f:
                    return _core.Session.from_bytes(core_model, f.read(), max_tokens=n_ctx)
            restored, from_bytes = peak_during(read_then_restore)
            del restored
    print(f"host store of the restored session: {store:.0f} MiB")
    print("| restore | RssAnon peak MiB | RssFile peak MiB |\n|---|---:|---:|")
    print(f"| Session.restore(path) | {from_file['RssAnon']:.0f} | {from_file['RssFile']:.0f} |")
    print(f"| the file read, then Session.from_bytes | {from_bytes['RssAnon']:.0f} | {from_bytes['RssFile']:.0f} |")


if __name__ == "__main__":
    main()
