"""kvflash bench prefill: prompt tok/s and device memory vs prompt length, ours next to llama-bench.

For each length, one run on one machine: our full cache, our exact prefill (layer-major: every K/V as a full
cache writes it, device memory of the pool plus one layer's K/V of the prompt) and our pooled prefill (in the
pool) each prefill a prompt of that many random tokens from an empty session, --reps times (median tok/s);
llama-bench runs `-p LENGTH -n 0` on the same GGUF with the same threads (flash attention on and off on the
CPU; on a GPU all layers offloaded, flash attention on). Beside each of ours: the device bytes it held, as
stats() reports them (weights + pool + compute buffers + the prefill workspace), and on a GPU the driver's
free memory sampled every few milliseconds while the prompt ran (the most taken). Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .. import _core
from ..commands.flags import add_model_flags, add_pool_flags, pool_config
from ..engine import Engine
from ..known_models import resolve_model_path
from ..options import PoolConfig, ResidencyConfig
from .reference import (add_reference_flags, gpu_free_bytes, holds_rpc, int_list, llama_bench_results, llama_bench_split,
                        median_ts, open_model, progress, reference_binary)

REPS = 3
WARM_UP_TOKENS = 2048
MODES = ("full", "exact", "sparse", "pooled")
DEFAULT_MODES = ("full", "exact", "pooled")   # sparse needs flash attention (--attention flash, or a GPU)


class FreeMemorySampler:
    """The most device memory taken (driver's free memory below the start) while the block runs."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s, self.taken = interval_s, 0
        self._stop = threading.Event()

    def __enter__(self) -> "FreeMemorySampler":
        self.start_free = gpu_free_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():   # the prefill releases the GIL while it computes
            self.taken = max(self.taken, self.start_free - gpu_free_bytes())
            time.sleep(self.interval_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.taken = max(self.taken, self.start_free - gpu_free_bytes())


def time_prefill(model, tokenizer, length: int, pool: PoolConfig, prefill: str, reps: int, seed: int,
                 reserve_host: bool = True) -> dict:
    """Median prompt tok/s over `reps` prefills of the same `length` random tokens, each from an empty session,
    with the engine's own memory figures and (GPU) the driver's. reserve_host: the host store is pinned before the
    timing, as llama-bench's KV cache is made with its context (timed apart: host_reserve_s)."""
    C = _core.CHUNK_TOKENS
    pool = dataclasses.replace(pool, n_ctx=-(-length // C) * C, allow_beyond_train_ctx=True)
    prompt = np.random.default_rng(seed).integers(100, model.hparams.n_vocab - 100, length, dtype=np.int32).tolist()
    free_before = gpu_free_bytes() if model.on_gpu else None
    engine = Engine(model, tokenizer, pool, ResidencyConfig(prefill=prefill))
    # One short prompt first, untimed: a process's first prefill also loads the device's kernels (a 32K exact prefill
    # run first timed 0.60x llama-bench on the H100, after another mode 0.85x: R87, R88).
    engine.prefill(prompt[:min(length, WARM_UP_TOKENS)])
    host_reserve_s = None
    if reserve_host:
        t0 = time.perf_counter()
        engine.reserve_host(length)
        host_reserve_s = time.perf_counter() - t0
    rates, taken = [], 0
    for _ in range(reps):
        engine.session.reset()
        if free_before is not None:
            with FreeMemorySampler() as sampler:
                t0 = time.perf_counter()
                engine.prefill(prompt)
                elapsed = time.perf_counter() - t0
            taken = max(taken, sampler.taken + (free_before - sampler.start_free))   # + the pool the Engine made
        else:
            t0 = time.perf_counter()
            engine.prefill(prompt)
            elapsed = time.perf_counter() - t0
        rates.append(length / elapsed)
    stats, timings = engine.stats(), engine.session.timings
    out = {"tok_s": float(np.median(rates)), "tok_s_reps": rates, "host_reserve_s": host_reserve_s,
           **{k: v for k, v in stats.items() if k.startswith(("device_", "host_"))},
           "prefill_ms": {"graphs": timings.t_prefill_graph_ms, "io": timings.t_prefill_io_ms,
                          "compute": timings.t_compute_ms, "paging": timings.t_paging_ms},
           # steps whose graph made ggml reserve again (each a wait for the device): should stay 0
           "prefill_graph_changes": timings.n_prefill_graph_changes,
           # blocks of queries attended a pair per call (a sparse dense last step over a quantized pool: no F16 copy)
           "prefill_paired_blocks": timings.n_prefill_paired_blocks,
           # flash attention calls that several blocks of queries shared (F16 K/V, exact: calls of up to 512 queries)
           "prefill_shared_calls": timings.n_prefill_shared_calls}
    if free_before is not None:
        out["device_bytes_taken"] = taken   # by the session (pool, buffers, workspace): weights were loaded before
    engine.close()
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="kvflash bench prefill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap, threads=os.cpu_count())
    add_pool_flags(ap, pool="512", n_ctx=None)
    ap.add_argument("--lengths", default="2048,8192", help="comma-separated prompt lengths")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"which of ours to run (of {','.join(MODES)})")
    ap.add_argument("--reps", type=int, default=REPS, help="prefills per length and mode (llama-bench -r); median")
    ap.add_argument("--cold-host", action="store_true",
                    help="do not pin the host store before timing: the first prompt's pinning is timed with it (by "
                         "default it is pinned first, as llama-bench makes its KV cache before it times)")
    add_reference_flags(ap)
    ap.add_argument("--json", default="bench-out/prefill.json", help="where to write the JSON")
    args = ap.parse_args(argv)
    lengths = int_list(ap, args.lengths, "--lengths")
    modes = [m for m in args.modes.split(",") if m]
    if any(n <= 0 for n in lengths) or args.reps <= 0 or args.kvflash is None or not set(modes) <= set(MODES):
        ap.error(f"lengths and --reps must be positive, --kvflash a pool (not off), --modes of {','.join(MODES)}")
    binary = reference_binary(args, "kvflash bench prefill")
    try:
        pooled = pool_config(args)
    except ValueError as e:
        print(f"kvflash bench prefill: {e}", file=sys.stderr)
        return 2
    def run_reference(on_gpu: bool) -> list:
        return llama_bench_results(binary, resolve_model_path(args.model), ["-p", ",".join(map(str, lengths)), "-n", "0",
                                                                            *llama_bench_split(args)],
                                   args.threads, on_gpu, args.reps)

    # llama-bench first: a broken one fails in seconds, not after our whole run; with RPC devices before our model
    # holds them (an rpc-server serves one client at a time), every layer on the split's devices as on a GPU.
    reference, first = [], binary and holds_rpc(args)
    try:
        if first:
            reference = run_reference(True)
        path, model, tokenizer = open_model(args, "kvflash bench prefill")
        if binary and not first:
            reference = run_reference(model.on_gpu)
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"kvflash bench prefill: {e}", file=sys.stderr)
        return 2
    time_prefill(model, tokenizer, 256, dataclasses.replace(pooled, pool_tokens=None), "exact", 1, seed=0)   # warm-up
    rows = []
    for n in lengths:
        row = {"length": n}
        for mode in modes:
            pool = dataclasses.replace(pooled, pool_tokens=None) if mode == "full" else pooled
            progress(f"length {n}: {mode}: {args.reps} prefills")
            row[mode] = time_prefill(model, tokenizer, n, pool, "exact" if mode == "full" else mode,
                                     args.reps, seed=n, reserve_host=not args.cold_host)
            print(f"length {n}: {mode} {row[mode]['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
        rows.append(row)
    for row in rows:
        for r in reference:
            if int(r["n_prompt"]) == row["length"]:
                row["llama_fa1" if r["flash_attn"] else "llama_fa0"] = median_ts(r)
    gpus = _core.gpu_devices() if model.on_gpu else []
    report = {"model": path, "pool": pooled.pool_tokens, "kv_type": pooled.kv_type, "n_batch": pooled.n_batch,
              "reps": args.reps, "threads": args.threads, "cold_host": args.cold_host, "weight_bytes": model.weight_bytes,
              "device": model.backend_name + (f" ({gpus[0]['description']})" if gpus else ""), "llama_bench": binary,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    print_table(report, modes)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


def print_table(report: dict, modes: Sequence[str]) -> None:
    mib = lambda b: f"{b / 2**20:.0f}"
    print(f"model {Path(report['model']).name} (weights {mib(report['weight_bytes'])} MiB), pool {report['pool']}, "
          f"kv {report['kv_type']}, n_batch {report['n_batch']}, {report['threads']} threads, {report['device']}")
    head = f"{'length':>7} " + " ".join(f"{m + ' tok/s':>13}" for m in modes) + f" {'llama tok/s':>12} " + \
        " ".join(f"{m + '/llama':>13}" for m in modes) + "  device MiB (" + "/".join(modes) + ")"
    print(head)
    for r in report["rows"]:
        best = max([x for x in (r.get("llama_fa0"), r.get("llama_fa1")) if x], default=None)
        ratio = lambda m: f"{r[m]['tok_s'] / best:.2f}x" if best else "-"
        held = "/".join(mib(r[m].get("device_bytes_taken", r[m]["device_peak_bytes"] - report["weight_bytes"]))
                        for m in modes)
        print(f"{r['length']:>7} " + " ".join(f"{r[m]['tok_s']:>13.1f}" for m in modes) +
              f" {best or 0:>12.1f} " + " ".join(f"{ratio(m):>13}" for m in modes) + f"  {held}")
    for m in (m for m in ("exact", "sparse") if m in modes):   # the workspace: one layer's K/V of the prompt + fixed
        for r in report["rows"]:
            e = r[m]
            stage, peak = e.get("device_prefill_staging_bytes", 0), e.get("device_prefill_peak_bytes", 0)
            print(f"{m} prefill workspace at {r['length']}: {mib(peak)} MiB = staging {mib(stage)} MiB (one layer's "
                  f"K/V of the prompt) + {mib(peak - stage)} MiB (step compute buffer, attention blocks' masks of at "
                  f"most {mib(_core.ATTENTION_BLOCK_BYTES)} MiB ({mib(_core.GROUPED_BLOCK_BYTES)} where blocks share "
                  f"calls), hidden-state tiles, the mask table"
                  + (", the chunks' mean keys)" if m == "sparse" else ")"))
            if e.get("prefill_graph_changes") and m == "exact":
                print(f"exact prefill at {r['length']}: {e['prefill_graph_changes']} steps built another graph than "
                      "their layer's first, and each waited for the device (a bug: report it)")
    for r in report["rows"]:
        for m in modes:
            e = r[m]
            if e.get("host_reserve_s") is not None and e.get("host_store_bytes"):
                rows = e.get("host_prefill_rows_bytes", 0) / 2**30
                print(f"host store at {r['length']} ({m}): {e['host_store_bytes'] / 2**30:.2f} GiB (+ {rows:.2f} GiB "
                      f"of the exact prefill's rows) pinned in {e['host_reserve_s']:.2f} s before the timing")
    print(f"tok/s: median of {report['reps']} prefills from an empty session, after one untimed prompt of up to "
          f"{WARM_UP_TOKENS} tokens (llama-bench -p N -n 0, best of flash attention on/off) and "
          + ("no host store made before (--cold-host)" if report.get("cold_host") else
             "the host store and the exact prefill's rows pinned for the prompt (Engine.reserve_host), as "
             "llama-bench makes its KV cache first")
          + "; device MiB besides the weights: on a GPU the driver's free memory sampled while the prompt ran, else "
          "stats()' pool + compute buffers + prefill workspace")


if __name__ == "__main__":
    sys.exit(main())
