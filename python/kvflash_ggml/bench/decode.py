"""kvflash bench decode: decode tok/s vs context depth, ours (full cache and pooled) next to llama-bench.

All figures come from one run on one machine: for each depth, our full-cache session, our pooled
session and llama-bench (`-d depth`, same GGUF, same threads) decode --n-gen tokens after a depth-token
prefill (and WARMUP untimed steps, as llama-bench warms up too), --reps times, every repetition starting
back at the same depth as llama-bench's do; tok/s is the median over the repetitions for both (llama-bench's per-repetition rates come from its JSON). llama-bench runs with
flash attention on and off on the CPU, and on a GPU with what that backend prefers (flash attention on,
every layer offloaded), like our backend="auto". Prints a table with the ratios, writes JSON (with the
prefill rates and, on a GPU, the device memory each session took) and a PNG plot.

With --max-device-memory SIZE (issue 37 item 4) each depth runs the pool the product's fit sizes within SIZE, its
peak memory measured by the driver beside its rate, and llama-bench runs at the largest depth it fits within SIZE,
found by measuring it (bench/budget.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .. import _core
from ..commands.flags import (add_budget_flag, add_model_flags, add_pool_flags, add_residency_flags, pool_config,
                              residency_config)
from ..engine import Engine
from ..fit import resolve_pool
from ..known_models import resolve_model_path
from ..options import TAU_CONTEXT_DIVISOR, PoolConfig, ResidencyConfig
from .budget import FITS, PeakSampler, llama_in_budget, print_budget_table, verdict
from .reference import (add_reference_flags, gpu_free_by_device, holds_rpc, int_list, llama_bench_results, llama_bench_split,
                        median_ts, open_model, progress, reference_binary)

WARMUP = 2   # untimed decode steps: the first builds the decode graph (and on CUDA captures its graph)
REPS = 5     # default --reps: timed windows of --n-gen tokens per measurement (llama-bench -r); tok/s = their median


def time_decode(model, tokenizer, depth: int, n_gen: int, pool: PoolConfig, residency: ResidencyConfig, seed: int,
                reps: int = REPS, label: str = "") -> dict:
    """Prefill `depth` random tokens, then WARMUP untimed steps, then `reps` timed windows of n_gen decode
    steps through the Engine (so the policy's reselects at its cadence are part of the timed loop, as in
    real use), each window starting from the depth-token prompt again (the Engine truncates to it and
    reruns its last token, untimed); tok/s is the median of the windows' rates. label: what the progress
    lines call this measurement ("" = none)."""
    pool = depth_pool(pool, depth, n_gen)
    free0 = gpu_free_by_device() if model.on_gpu else None
    engine = Engine(model, tokenizer, pool, residency)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(100, model.hparams.n_vocab - 100, depth + 1, dtype=np.int32).tolist()
    if label:
        progress(f"depth {depth}, {label}: prefilling {depth + 1} tokens")
    t0 = time.perf_counter()
    token = int(engine.prefill(prompt).argmax())   # depth tokens of context + the first decode input
    t_prefill = time.perf_counter() - t0
    if label:
        progress(f"depth {depth}, {label}: prefill {(depth + 1) / t_prefill:.1f} tok/s; timing {reps} windows of "
                 f"{n_gen} decode steps")
    for _ in range(WARMUP):
        token = engine.decode_one_greedy(token)
    rates, reselect_ms = [], []
    for _ in range(reps):   # like llama-bench -r: `reps` windows of n_gen tokens; the median of their rates
        token = int(engine.prefill(prompt).argmax())
        t0 = time.perf_counter()
        for _ in range(n_gen):   # greedy, as generate() decodes at temperature 0
            token = engine.decode_one_greedy(token)
        rates.append(n_gen / (time.perf_counter() - t0))
        # A window rarely reaches the cadence (max(tau, context / TAU_CONTEXT_DIVISOR) tokens), so one reselect with the
        # window's last queries is timed apart (scoring and paging): its share of decode time is its cost
        # over the decode time of the tokens between two reselects.
        t0 = time.perf_counter()
        engine.reselect()
        reselect_ms.append((time.perf_counter() - t0) * 1e3)
    after = engine.stats()
    tok_s = float(np.median(rates))
    cadence = residency.reselect_every(depth + n_gen)
    out = {"tok_s": tok_s, "tok_s_reps": rates, "prefill_tok_s": (depth + 1) / t_prefill,
           # every device K/V byte: the pool and the sliding-window layers' rings
           "device_kv_bytes": after["device_kv_bytes"] + after["device_ring_bytes"], "host_kv_bytes": after["host_kv_bytes"],
           "device_peak_bytes": after["device_peak_bytes"],   # the engine's count: weights, pool, buffers, workspace
           "flash_attn": engine.session.flash_attn, "reselect_ms": float(np.median(reselect_ms)),
           "reselect_every": cadence, "page_ins": after["page_ins"], "page_outs": after["page_outs"],
           "reselect_share": float(np.median(reselect_ms)) / (cadence * 1e3 / tok_s)}
    if free0 is not None:   # pool + compute buffers, measured by the driver, per GPU (a split takes some on each)
        free1 = gpu_free_by_device()
        out["device_bytes_taken_by_gpu"] = {name: free0[name] - free1[name] for name in free0}
        out["device_bytes_taken"] = sum(out["device_bytes_taken_by_gpu"].values())
    engine.close()   # now, not when collected: the next depth's memory is measured from here
    return out


def depth_pool(pool: PoolConfig, depth: int, n_gen: int) -> PoolConfig:
    """The pool options of a measurement at `depth`: a context of the depth, the decoded tokens and the next input,
    in whole chunks (the fit under a budget sizes the pool for this same context)."""
    C = _core.CHUNK_TOKENS
    return dataclasses.replace(pool, n_ctx=-(-(depth + max(WARMUP, n_gen) + 1) // C) * C, allow_beyond_train_ctx=True)


def run_llama_bench(binary: str, model_path: str, depths: Sequence[int], n_gen: int, threads: int,
                    on_gpu: bool, reps: int = REPS, split: Sequence[str] = ()) -> dict:
    """{(depth, fa): decode tok/s} from one llama-bench call (split: llama_bench_split's flags)."""
    records = llama_bench_results(binary, model_path, ["-p", "0", "-n", str(n_gen), "-d", ",".join(map(str, depths)),
                                                       *split], threads, on_gpu, reps)
    return {(int(r["n_depth"]), bool(r["flash_attn"])): median_ts(r) for r in records}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvflash bench decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap, threads=os.cpu_count())
    add_pool_flags(ap, pool="512", n_ctx=None)
    add_budget_flag(ap)
    add_residency_flags(ap)
    ap.add_argument("--depths", default="0,2048,8192", help="comma-separated context depths")
    ap.add_argument("--full-up-to", type=int, default=None, metavar="DEPTH",
                    help="run our full cache only at depths up to DEPTH (its prefill is the slowest part at 256K)")
    ap.add_argument("--n-gen", type=int, default=32, help="decode steps timed per window")
    ap.add_argument("--reps", type=int, default=REPS, help="timed windows per depth (llama-bench -r); tok/s = median")
    add_reference_flags(ap)
    ap.add_argument("--llama-fit-steps", type=int, default=0, metavar="N",
                    help="with --max-device-memory: after the largest of --depths that llama-bench runs within the "
                         "budget, N bisection steps towards the next larger depth (each attempt that fits costs "
                         "llama-bench's prefill of its depth; default 0)")
    ap.add_argument("--json", default="bench-out/decode.json", help="where to write the JSON")
    ap.add_argument("--plot", default="bench-out/decode.png", help="where to write the PNG ('' = none)")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    depths = int_list(ap, args.depths, "--depths")
    if not depths or any(d < 0 for d in depths) or args.n_gen <= 0 or args.kvflash is None or args.reps <= 0 or \
            args.llama_fit_steps < 0:
        ap.error("--depths must name depths >= 0, --n-gen and --reps positive, --llama-fit-steps >= 0, --kvflash a "
                 "pool (not off)")
    if args.policy == "drafter" and not args.drafter_model:
        ap.error("--policy drafter needs --drafter-model PATH")
    budget = args.max_device_memory
    if budget is not None and holds_rpc(args):
        ap.error("--max-device-memory: the driver's figures are read for this host's GPUs only, not RPC devices")

    binary = reference_binary(args, "kvflash bench decode")
    try:
        pooled, residency = pool_config(args), residency_config(args)
        split = llama_bench_split(args) if binary else []
    except ValueError as e:
        print(f"kvflash bench decode: {e}", file=sys.stderr)
        return 2
    # An rpc-server serves one client at a time: with RPC devices, llama-bench runs before our model holds them
    # (every layer on the split's devices: -ngl 99, flash attention on, as on a GPU).
    ref = run_llama_bench(binary, resolve_model_path(args.model), depths, args.n_gen, args.threads, True, args.reps,
                          split) if binary and holds_rpc(args) else None
    path, model, tokenizer = open_model(args, "kvflash bench decode")
    full = dataclasses.replace(pooled, pool_tokens=None)
    try:   # under a budget every depth's pool is fitted first: one that cannot fit ends the command before any run
        fitted = fit_depths(model, pooled, depths, args.n_gen) if budget is not None else None
    except ValueError as e:
        print(f"kvflash bench decode: {e}", file=sys.stderr)
        return 2
    rows = run_depths(args, model, tokenizer, depths, pooled, full, residency, fitted)
    gpus = _core.gpu_devices() if model.on_gpu else []
    report = {"model": path, "pool": pooled.pool_tokens, "policy": residency.policy, "tau": residency.tau,
              "kv_type": pooled.kv_type,
              "reps": args.reps,
              "threads": args.threads, "n_gen": args.n_gen,
              "device": "+".join(d["name"] for d in model.devices) + (f" ({gpus[0]['description']})" if gpus else ""),
              "llama_bench": binary,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows,
              "split": [{"name": d["name"], "layers": len(d["layers"]), "weight_bytes": d["weight_bytes"]}
                        for d in model.devices], "llama_bench_split": split}
    on_gpu = model.on_gpu
    if budget is not None:
        report["budget"] = {"max_device_bytes": budget, "peak_source": rows[0]["pooled"]["peak_source"]}
    if binary and budget is not None and on_gpu:
        del model, tokenizer   # llama.cpp gets a GPU that holds none of ours but our process's CUDA context
        gc.collect()
        report["budget"]["llama"] = llama_in_budget(
            binary, path, depths, n_gen=args.n_gen, threads=args.threads, reps=args.reps, split=split, budget=budget,
            bisect_steps=args.llama_fit_steps)
        ref = {(a["depth"], True): a["tok_s"] for a in report["budget"]["llama"]["attempts"] if a["status"] == FITS}
    elif binary:
        if budget is not None:
            progress("kvflash bench decode: no GPU, so no driver to measure llama-bench's footprint under the budget: "
                     "it runs at every depth without one")
        ref = ref or run_llama_bench(binary, path, depths, args.n_gen, args.threads, on_gpu, args.reps, split)
    if ref is not None:
        for row in rows:
            row["llama_fa0"] = ref.get((row["depth"], False))
            row["llama_fa1"] = ref.get((row["depth"], True))
    print_table(report)
    if budget is not None:
        print_budget_table(report)
    write_outputs(report, args.json, args.plot)
    return 0


def fit_depths(model, pool: PoolConfig, depths: Sequence[int], n_gen: int) -> dict:
    """{depth: (pool options, why)}: the pool each depth's context runs with under pool.max_device_bytes, as a Model
    would size it (fit.resolve_pool: 'auto' fitted, a number checked); ValueError where even the minimum does not
    fit."""
    return {d: resolve_pool(model, depth_pool(pool, d, n_gen), 1) for d in depths}


def full_refusal(model, full: PoolConfig, depth: int, n_gen: int) -> Optional[str]:
    """Why the full cache at `depth` does not fit its max_device_bytes (None: it fits, or there is no budget)."""
    if full.max_device_bytes is None:
        return None
    try:
        resolve_pool(model, depth_pool(full, depth, n_gen), 1)
        return None
    except ValueError as e:
        return str(e)


def measured(run, budget: Optional[int], on_gpu: bool) -> dict:
    """run()'s result, and under a budget its peak: on a GPU the driver's memory in use, sampled while it runs;
    on the CPU backend the engine's own count (no driver to ask)."""
    if budget is None:
        return run()
    if on_gpu:
        with PeakSampler() as sampler:
            out = run()
        return {**out, **verdict(sampler.peak, budget, "memory in use on the whole GPU (driver), sampled")}
    out = run()
    return {**out, **verdict({"CPU": out["device_peak_bytes"]}, budget, "the engine's count (CPU backend: no driver)")}


def run_depths(args, model, tokenizer, depths: Sequence[int], pooled: PoolConfig, full: PoolConfig,
               residency: ResidencyConfig, fitted: Optional[dict]) -> list[dict]:
    """Our rows: at each depth the full cache (unless past --full-up-to, or refused by the budget) and the pool
    (under a budget: the depth's fitted pool, with its peak)."""
    # One untimed short decode first, so the first depth does not pay for clocks ramping up or one-time
    # initialisation (llama-bench warms up before each test too).
    full_residency = ResidencyConfig(tau=residency.tau)
    progress(f"kvflash bench decode: depths {','.join(map(str, depths))}, {args.reps} windows of {args.n_gen} "
             f"tokens each, full cache and pooled; progress on stderr, the report on stdout")
    time_decode(model, tokenizer, 0, 8, full, full_residency, seed=0)
    budget, rows = full.max_device_bytes, []
    for d in depths:
        row = {"depth": d}
        pool, why = fitted[d] if fitted is not None else (pooled, None)
        if fitted is not None:
            row["pool_tokens"], row["pool_reason"] = pool.pool_tokens, why
            progress(f"depth {d}: pool {pool.pool_tokens} ({why})")
        past = args.full_up_to is not None and d > args.full_up_to
        refused = None if past else full_refusal(model, full, d, args.n_gen)
        if refused:
            row["full_refused"] = refused
        row["full"] = None if past or refused else measured(
            lambda: time_decode(model, tokenizer, d, args.n_gen, full, full_residency, seed=d, reps=args.reps,
                                label="full cache"), budget, model.on_gpu)
        row["pooled"] = measured(
            lambda: time_decode(model, tokenizer, d, args.n_gen, pool, residency, seed=d, reps=args.reps,
                                label=f"pool {pool.resolved_pool_tokens()}"), budget, model.on_gpu)
        rows.append(row)
        print(f"depth {d}: full {_tok_s(row['full'])} tok/s, pooled {row['pooled']['tok_s']:.1f} tok/s",
              file=sys.stderr, flush=True)
    return rows


def _tok_s(result: Optional[dict]) -> str:
    return f"{result['tok_s']:.1f}" if result else "-"


def print_table(report: dict) -> None:
    print(f"model {Path(report['model']).name}, pool {report['pool']} ({report['policy']}, tau {report['tau']}), "
          f"kv {report['kv_type']}, "
          f"{report['threads']} threads, {report['device']}, n_gen {report['n_gen']}")
    head = f"{'depth':>7} {'full':>8} {'pooled':>8} {'llama fa0':>10} {'llama fa1':>10} {'pooled/llama':>13} " \
           f"{'full/llama':>11} {'dev KV MiB full/pooled':>23} {'host MiB':>9} {'reselect %':>10}"
    print(head)
    for r in report["rows"]:
        best = max([x for x in (r.get("llama_fa0"), r.get("llama_fa1")) if x], default=None)
        fmt = lambda x: f"{x:.1f}" if x else "-"
        ratio = lambda a: f"{a / best:.2f}x" if best else "-"
        full = r["full"]
        full_ratio = ratio(full["tok_s"]) if full else "-"
        full_kv = f"{full['device_kv_bytes'] / 2**20:.1f}" if full else "-"
        print(f"{r['depth']:>7} {_tok_s(full):>8} {r['pooled']['tok_s']:>8.1f} {fmt(r.get('llama_fa0')):>10} "
              f"{fmt(r.get('llama_fa1')):>10} {ratio(r['pooled']['tok_s']):>13} {full_ratio:>11} "
              f"{full_kv:>11}/{r['pooled']['device_kv_bytes'] / 2**20:<11.1f} "
              f"{r['pooled']['host_kv_bytes'] / 2**20:>9.1f} {100 * r['pooled']['reselect_share']:>9.1f}%")
    if len(report.get("split", [])) > 1:
        print("split: " + ", ".join(f"{d['name']} {d['layers']} layers {d['weight_bytes'] / 2**20:.0f} MiB weights"
                                    for d in report["split"]) + f"; llama-bench {' '.join(report['llama_bench_split'])}")
        for r in report["rows"]:
            by_gpu = r["pooled"].get("device_bytes_taken_by_gpu")
            if by_gpu:
                print(f"depth {r['depth']} pooled, GPU memory the session took (driver): " +
                      ", ".join(f"{name} {b / 2**20:.0f} MiB" for name, b in by_gpu.items()))
    print(f"tok/s: median of {report['reps']} timed windows of n_gen tokens (llama-bench: of -r {report['reps']}); ratios are against "
          "llama-bench's best (flash attention on or off) at the same depth; reselect % is one reselect (scoring "
          f"and paging) over the pooled decode time between two, at the cadence max(tau, context / "
          f"{TAU_CONTEXT_DIVISOR})")


def write_outputs(report: dict, json_path: str, plot_path: str) -> None:
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}")
    if not plot_path:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'): no plot written", file=sys.stderr)
        return
    depths = [r["depth"] for r in report["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(depths, [r["full"]["tok_s"] if r["full"] else None for r in report["rows"]], "o-", label="kvflash full cache")
    ax.plot(depths, [r["pooled"]["tok_s"] for r in report["rows"]], "o-", label=f"kvflash pool {report['pool']}")
    for key, label in (("llama_fa0", "llama-bench fa off"), ("llama_fa1", "llama-bench fa on")):
        if any(r.get(key) for r in report["rows"]):
            ax.plot(depths, [r.get(key) for r in report["rows"]], "s--", label=label)
    ax.set_xlabel("context depth (tokens)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"{Path(report['model']).name} on {report['device']}, {report['threads']} threads")
    ax.grid(alpha=0.3)
    ax.legend()
    Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(plot_path, dpi=120, bbox_inches="tight")
    print(f"wrote {plot_path}")


if __name__ == "__main__":
    sys.exit(main())
