#!/usr/bin/env python3
"""Where a long prefill's GPU time goes: ours (full cache, layer-major exact) next to libllama on the same
GGUF in the same process, kernel by kernel, from a CUPTI trace (PyTorch's profiler traces every kernel and
copy in the process, ours included). Also what host memory costs: pinning vs pageable, and the copies.

    python experiments/profile_prefill.py --model M --length 32768 --modes full,exact,llama --host-memory

Prints, per mode: wall time, summed kernel time, copy time by kind, and the kernels that took the most.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

import numpy as np
from kvflash_ggml import _core

CHUNK = 64


def traced(fn):
    """Runs fn under the CUDA activity profiler; returns (wall s, {kernel: (count, us)}, {copy kind: (bytes, us)},
    {CUDA call: (count, us)}: the host's time in each)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    if not torch.cuda.is_available():   # nothing to trace: wall time only
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0, {}, {}, {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    kernels, copies = collections.defaultdict(lambda: [0, 0.0]), collections.defaultdict(lambda: [0, 0.0])
    api = collections.defaultdict(lambda: [0, 0.0])
    spans, copy_spans, api_spans = [], [], []
    for e in json.load(open(path))["traceEvents"]:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "kernel":
            k = kernels[e["name"][:90]]
            k[0] += 1
            k[1] += e["dur"]
            spans.append((e["ts"], e["ts"] + e["dur"]))
        elif e.get("cat") in ("gpu_memcpy", "gpu_memset"):
            c = copies[e["name"]]
            c[0] += int(e.get("args", {}).get("bytes", 0))
            c[1] += e["dur"]
            copy_spans.append((e["ts"], e["ts"] + e["dur"], e["name"], int(e.get("args", {}).get("bytes", 0))))
        elif e.get("cat") in ("cuda_runtime", "cuda_driver"):   # host time in CUDA calls: where the host waits
            a = api[e["name"]]
            a[0] += 1
            a[1] += e["dur"]
            api_spans.append((e["ts"], e["ts"] + e["dur"], e["name"]))
    del torch
    gaps = kernel_gaps(spans)
    kernels[IDLE] = idle_gaps(gaps)
    kernels[GAPS] = largest_gaps(gaps, min(spans)[0] if spans else 0.0, copy_spans, api_spans)
    return wall, kernels, copies, api


IDLE, GAPS = "__idle__", "__gaps__"


def kernel_gaps(spans):
    """Where no kernel ran between the first kernel and the last: (start, end) in us, in order."""
    gaps, end = [], None
    for t0, t1 in sorted(spans):
        if end is not None and t0 > end:
            gaps.append((end, t0))
        end = t1 if end is None else max(end, t1)
    return gaps


def idle_gaps(gaps, long_us: float = 50.0):
    """(count, us) of the gaps longer than long_us (the host between graphs, or waiting on a copy), us of the
    shorter ones (launch latency inside a graph), and (count, us) of those over 1 ms (a layer-major prefill's layer
    ends)."""
    lengths = [g1 - g0 for g0, g1 in gaps]
    long, ms = [g for g in lengths if g > long_us], [g for g in lengths if g > 1000]
    return len(long), sum(long), sum(lengths) - sum(long), len(ms), sum(ms)


def largest_gaps(gaps, origin, copy_spans, api_spans, n: int = 10):
    """The n longest gaps, each as (start ms after origin, ms, what was copied in it, the host's CUDA calls in it):
    what a layer's end waits for."""
    out = []
    for g0, g1 in sorted(gaps, key=lambda g: g[0] - g[1])[:n]:
        overlap = lambda a0, a1: max(0.0, min(a1, g1) - max(a0, g0))
        copied, calls = collections.defaultdict(lambda: [0, 0.0]), collections.defaultdict(lambda: [0, 0.0])
        for a0, a1, name, nbytes in copy_spans:
            if overlap(a0, a1) > 0:
                copied[name][0] += nbytes
                copied[name][1] += overlap(a0, a1)
        for a0, a1, name in api_spans:
            if overlap(a0, a1) > 0:
                calls[name][0] += 1
                calls[name][1] += overlap(a0, a1)
        out.append(((g0 - origin) / 1e3, (g1 - g0) / 1e3, dict(copied), dict(calls)))
    return sorted(out)


def report(label: str, length: int, wall: float, kernels, copies, api, top: int) -> None:
    idle, gaps = kernels.pop(IDLE, None), kernels.pop(GAPS, [])
    total = sum(us for _, us in kernels.values())
    print(f"\n== {label}: {length} tokens, wall {wall:.2f} s ({length / wall:.0f} tok/s), kernels {total / 1e6:.2f} s "
          f"in {sum(n for n, _ in kernels.values())} launches")
    if idle:
        print(f"   no kernel running: {idle[1] / 1e6:.3f} s in {idle[0]} gaps > 50 us, {idle[2] / 1e6:.3f} s in shorter ones; "
              f"{idle[4] / 1e6:.3f} s in {idle[3]} gaps > 1 ms")
    for at_ms, ms, copied, calls in gaps:
        what = ", ".join(f"{k.split('(')[-1].rstrip(')')} {b / 2**20:.0f} MiB {us / 1e3:.1f} ms" for k, (b, us) in copied.items())
        host = ", ".join(f"{k} x{c} {us / 1e3:.1f} ms" for k, (c, us) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:3])
        print(f"   gap at {at_ms:8.1f} ms: {ms:6.2f} ms; copies: {what or '-'}; host: {host or '-'}")
    for kind, (nbytes, us) in sorted(copies.items(), key=lambda kv: -kv[1][1]):
        print(f"   copy {kind}: {nbytes / 2**30:.2f} GiB in {us / 1e6:.3f} s")
    for name, (n, us) in sorted(api.items(), key=lambda kv: -kv[1][1]):
        if us > 20000:   # the CUDA calls the host spent more than 20 ms in, all told: where it waits
            print(f"   host in {name} (x{n}): {us / 1e6:.3f} s")
    for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"   {us / 1e6:7.3f} s {100 * us / total:5.1f}%  x{n:<6} {name}")


def host_memory(gib: float) -> None:
    """Pinning vs pageable host memory on this machine: allocation, first touch, registration, D2H copies."""
    import torch
    n = int(gib * 2**30)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.fill_(1)
    torch.cuda.synchronize()

    def timed(what, fn):
        t0 = time.perf_counter()
        r = fn()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(f"   {what}: {dt:.3f} s ({gib / dt:.2f} GiB/s)")
        return r

    print(f"\n== host memory, {gib:g} GiB")
    pinned = timed("cudaHostAlloc (torch pin_memory)", lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True))
    timed("D2H into pinned", lambda: pinned.copy_(dev, non_blocking=True))
    del pinned
    pageable = timed("malloc + first touch", lambda: torch.empty(n, dtype=torch.uint8).fill_(0))
    timed("D2H into pageable", lambda: pageable.copy_(dev))
    timed("H2D from pageable", lambda: dev.copy_(pageable))
    cudart = torch.cuda.cudart()
    timed("cudaHostRegister of touched pageable", lambda: cudart.cudaHostRegister(pageable.data_ptr(), n, 0))
    timed("D2H into registered", lambda: pageable.copy_(dev, non_blocking=True))
    cudart.cudaHostUnregister(pageable.data_ptr())
    fresh = torch.empty(n, dtype=torch.uint8)
    timed("D2H into fresh (untouched) pageable", lambda: fresh.copy_(dev))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--modes", default="full,exact,llama")
    ap.add_argument("--pool", type=int, default=4096)
    ap.add_argument("--n-batch", type=int, default=512, help="our step (libllama: ubatch 512)")
    ap.add_argument("--exact-batch", type=int, default=0, help="the exact prefill's step (0: --n-batch)")
    ap.add_argument("--blocks-per-call", type=int, default=0,
                    help="exact: blocks of queries per flash attention call, as its sequences (0: the default, calls "
                         "of up to 512 queries over F16 K/V; 1: a call per block)")
    ap.add_argument("--attention-block-mib", type=int, default=0,
                    help="the exact prefill's attention block (0: the default); at 32K keys 64 MiB = 1024 queries")
    ap.add_argument("--ffn-part-rows", type=int, default=0,
                    help="exact: most rows of a step its FFN takes at once (0: the default, 1024: a step's whole, "
                         "SiLU and the product in place; 512: parts)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--cold-host", action="store_true",
                    help="do not pin the host store before the traced prompt (as kvflash bench prefill --cold-host)")
    ap.add_argument("--host-memory", type=float, default=0, help="GiB for the host-memory timings (0: skip)")
    args = ap.parse_args()
    if args.host_memory:
        host_memory(args.host_memory)
    model = _core.Model(args.model)
    n = args.length
    n_ctx = -(-(n + CHUNK) // CHUNK) * CHUNK
    prompt = np.random.default_rng(0).integers(100, model.hparams.n_vocab - 100, n, dtype=np.int32)
    for mode in args.modes.split(","):
        if mode == "llama":
            ref = _core.testing.LlamaReference(args.model, n_ctx=n_ctx, n_threads=8, flash_attn=True, n_gpu_layers=99)
            ref.decode(prompt[:256].tolist())
            ref.clear()
            run = lambda: ref.decode(prompt.tolist())
        else:
            pool = 0 if mode == "full" else args.pool
            cfg = _core.SessionConfig(max_tokens=n_ctx, pool_tokens=pool, allow_beyond_train_ctx=True,
                                      n_batch=args.n_batch)
            sess = _core.Session(model, cfg)
            step = sess.forward if mode == "full" else (lambda t, s: sess.prefill_exact(
                t, s, n_batch=args.exact_batch, attention_block_bytes=args.attention_block_mib << 20,
                blocks_per_call=args.blocks_per_call, ffn_part_rows=args.ffn_part_rows))
            step(prompt[:256], 0)
            sess.reset()
            if not args.cold_host:
                sess.reserve_host(n)
            run = lambda: step(prompt, 0)
        wall, kernels, copies, api = traced(run)
        report(mode, n, wall, kernels, copies, api, args.top)
        if mode != "llama":
            t = sess.timings
            print(f"   timings: compute {t.t_compute_ms / 1e3:.2f} s, paging {t.t_paging_ms / 1e3:.2f} s, "
                  f"graphs {t.t_prefill_graph_ms / 1e3:.2f} s, io {t.t_prefill_io_ms / 1e3:.2f} s")
            mem = sess.memory()
            print(f"   workspace (our counters): {mem['prefill_peak_bytes'] / 2**20:.0f} MiB, of which staging "
                  f"{mem['prefill_staging_bytes'] / 2**20:.0f}; compute buffer {mem['compute_bytes'] / 2**20:.0f} MiB")
            del sess
        else:
            del ref
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
