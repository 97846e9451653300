"""kvflash bench decode: decode tok/s vs context depth, ours (full cache and pooled) next to llama-bench.

All figures come from one run on one machine: for each depth, our full-cache session, our pooled
session and llama-bench (`-d depth`, same GGUF, same threads) decode --n-gen tokens after a depth-token
prefill (and WARMUP untimed steps, as llama-bench warms up too), --reps times, every repetition starting
back at the same depth as llama-bench's do; tok/s is the median over the repetitions for both (llama-bench's per-repetition rates come from its JSON). llama-bench runs with
flash attention on and off on the CPU, and on a GPU with what that backend prefers (flash attention on,
every layer offloaded), like our backend="auto". Prints a table with the ratios, writes JSON (with the
prefill rates and, on a GPU, the device memory each session took) and a PNG plot.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .. import _core
from ..commands.flags import add_model_flags, add_pool_flags, add_residency_flags, pool_config, residency_config
from ..engine import Engine
from ..known_models import resolve_model_path
from ..options import TAU_CONTEXT_DIVISOR, PoolConfig, ResidencyConfig
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
    C = _core.CHUNK_TOKENS
    pool = dataclasses.replace(pool, n_ctx=-(-(depth + max(WARMUP, n_gen) + 1) // C) * C, allow_beyond_train_ctx=True)
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
           "flash_attn": engine.session.flash_attn, "reselect_ms": float(np.median(reselect_ms)),
           "reselect_every": cadence, "page_ins": after["page_ins"], "page_outs": after["page_outs"],
           "reselect_share": float(np.median(reselect_ms)) / (cadence * 1e3 / tok_s)}
    if free0 is not None:   # pool + compute buffers, measured by the driver, per GPU (a split takes some on each)
        free1 = gpu_free_by_device()
        out["device_bytes_taken_by_gpu"] = {name: free0[name] - free1[name] for name in free0}
        out["device_bytes_taken"] = sum(out["device_bytes_taken_by_gpu"].values())
    return out


def run_llama_bench(binary: str, model_path: str, depths: Sequence[int], n_gen: int, threads: int,
                    on_gpu: bool, reps: int = REPS, split: Sequence[str] = ()) -> dict:
    """{(depth, fa): decode tok/s} from one llama-bench call (split: llama_bench_split's flags)."""
    records = llama_bench_results(binary, model_path, ["-p", "0", "-n", str(n_gen), "-d", ",".join(map(str, depths)),
                                                       *split], threads, on_gpu, reps)
    return {(int(r["n_depth"]), bool(r["flash_attn"])): median_ts(r) for r in records}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="kvflash bench decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap, threads=os.cpu_count())
    add_pool_flags(ap, pool="512", n_ctx=None)
    add_residency_flags(ap)
    ap.add_argument("--depths", default="0,2048,8192", help="comma-separated context depths")
    ap.add_argument("--full-up-to", type=int, default=None, metavar="DEPTH",
                    help="run our full cache only at depths up to DEPTH (its prefill is the slowest part at 256K)")
    ap.add_argument("--n-gen", type=int, default=32, help="decode steps timed per window")
    ap.add_argument("--reps", type=int, default=REPS, help="timed windows per depth (llama-bench -r); tok/s = median")
    add_reference_flags(ap)
    ap.add_argument("--json", default="bench-out/decode.json", help="where to write the JSON")
    ap.add_argument("--plot", default="bench-out/decode.png", help="where to write the PNG ('' = none)")
    args = ap.parse_args(argv)
    depths = int_list(ap, args.depths, "--depths")
    if any(d < 0 for d in depths) or args.n_gen <= 0 or args.kvflash is None or args.reps <= 0:
        ap.error("depths must be >= 0, --n-gen and --reps positive, --kvflash a pool (not off)")
    if args.policy == "drafter" and not args.drafter_model:
        ap.error("--policy drafter needs --drafter-model PATH")

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

    # One untimed short decode first, so the first depth does not pay for clocks ramping up or one-time
    # initialisation (llama-bench warms up before each test too).
    full, full_residency = dataclasses.replace(pooled, pool_tokens=None), ResidencyConfig(tau=residency.tau)
    progress(f"kvflash bench decode: depths {','.join(map(str, depths))}, {args.reps} windows of {args.n_gen} "
             f"tokens each, full cache and pooled; progress on stderr, the report on stdout")
    time_decode(model, tokenizer, 0, 8, full, full_residency, seed=0)
    rows = []
    for d in depths:
        row = {"depth": d}
        skip_full = args.full_up_to is not None and d > args.full_up_to
        row["full"] = None if skip_full else time_decode(model, tokenizer, d, args.n_gen, full, full_residency,
                                                          seed=d, reps=args.reps, label="full cache")
        row["pooled"] = time_decode(model, tokenizer, d, args.n_gen, pooled, residency, seed=d, reps=args.reps,
                                    label=f"pool {pooled.resolved_pool_tokens()}")
        rows.append(row)
        print(f"depth {d}: full {_tok_s(row['full'])} tok/s, pooled {row['pooled']['tok_s']:.1f} tok/s",
              file=sys.stderr, flush=True)
    if binary:
        ref = ref or run_llama_bench(binary, path, depths, args.n_gen, args.threads, model.on_gpu, args.reps, split)
        for row in rows:
            row["llama_fa0"] = ref.get((row["depth"], False))
            row["llama_fa1"] = ref.get((row["depth"], True))
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
    print_table(report)
    write_outputs(report, args.json, args.plot)
    return 0


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
