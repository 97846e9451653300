"""kvflash bench serve: our server under load, beside llama-server on the same GGUF, in one run.

  throughput  for each stream count S (--streams 1,4,8): start the server with S slots; fill them (S
              completions of a distinct --context-token prompt at once, one token each: the prompts' time);
              then send the same S prompts again at once, so each continues on the slot that holds it, and
              measure the aggregate decode rate while all S decode (tokens stamped in the window from the last
              stream's first token to the first stream's end). The same load then runs against llama-server
              `-np S -c S*ctx` (its prompt cache reuses a slot's prompt the same way): --llama-server BIN, or by
              default the one built from our tree (KVFLASH_LLAMA_SERVER=ON: installed in the package, or in a
              build/*/bin folder here), if any; --llama-server none: ours only. Each server's cost beside its
              rate: its GPU peak (the driver's view, above what was in use before it started) and, ours, how
              many of its tokens its batched forwards decoded (its /metrics).
  interference (--interference) S - 1 streams of --gen tokens decode (short prompts); once each has its
              first token, one --context-token prompt arrives on the last slot. The decoding streams' inter-token
              latency: its median over the run, and its p99 over the gaps that overlap the long prompt (from its
              arrival to its first token): how much a long prompt stalls the streams already running (issue 38's
              bar: p99 during the prompt <= 3x the median). Ours, then llama-server under the same load; each
              server first runs one prompt of that length alone (a running server has seen long prompts).
  soak        (--soak SECONDS) --requests requests of mixed prompt and output lengths from --concurrency
              clients, streamed and not, some leaving part way; the server's RSS sampled throughout.

Prints a table and writes JSON (--out). The servers are started and stopped here (they bind 127.0.0.1).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

import httpx
import numpy as np

from ..known_models import resolve_model_path
from ..testing.server_process import ServerProcess, free_port
from .budget import PeakSampler, above, gpu_used_by_device
from .reference import find_llama_server


def ours(args, n_slots: int, log: Path) -> ServerProcess:
    return ServerProcess.kvflash("--model", args.model, "--parallel", str(n_slots), "--n-ctx",
                                 str(args.context + args.gen + 64), "--kvflash", args.kvflash, "--prefix-cache", "off",
                                 "--queue", str(max(64, args.requests)), "--log-level", "warning",
                                 *args.ours_flags.split(), log=log, timeout=600)


def llama_server(args, n_slots: int, log: Path) -> ServerProcess:
    per_slot, port = args.context + args.gen + 64, free_port()
    argv = [args.llama_server, "-m", resolve_model_path(args.model), "-np", str(n_slots), "-c",
            str(n_slots * per_slot), "--port", str(port), "--host", "127.0.0.1", "-ngl", "999", "-fa", "on",
            "--no-webui", *args.llama_flags.split()]
    return ServerProcess(argv, port=port, log=log, timeout=600)


def stream_completion(url: str, prompt: list[int], max_tokens: int, *, leave_after: Optional[int] = None,
                      stream: bool = True, stamps: Optional[list] = None) -> dict:
    """One completion; the arrival time of every streamed token (appended to `stamps` as they come, if given)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream, "ignore_eos": True}
    stamps, t0 = [] if stamps is None else stamps, time.perf_counter()
    with httpx.Client(timeout=3600) as client:
        if not stream:
            r = client.post(f"{url}/v1/completions", json=body)
            return {"status": r.status_code, "tokens": r.json().get("usage", {}).get("completion_tokens", 0)
                    if r.status_code == 200 else 0, "t0": t0, "stamps": [time.perf_counter()]}
        with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"status": r.status_code, "tokens": 0, "t0": t0, "stamps": []}
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and (chunk["choices"][0].get("text") or
                                             chunk["choices"][0].get("finish_reason") is None):
                    stamps.append(time.perf_counter())
                if leave_after is not None and len(stamps) >= leave_after:
                    return {"status": 499, "tokens": len(stamps), "t0": t0, "stamps": stamps}
    return {"status": 200, "tokens": len(stamps), "t0": t0, "stamps": stamps}


def concurrent(url: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    results: list = [None] * len(prompts)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, stream_completion(url, prompts[i], max_tokens)))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def aggregate_decode(name: str, results: list[dict]) -> dict:
    """Tokens per second while every stream decodes: from the last stream's first token to the first end. A warning
    names the server (`name`): the two servers' rows are printed one after the other."""
    firsts = [r["stamps"][0] for r in results if r["stamps"]]
    lasts = [r["stamps"][-1] for r in results if r["stamps"]]
    t0, t1 = max(firsts), min(lasts)
    n = sum(sum(t0 < s <= t1 for s in r["stamps"]) for r in results)
    ttft = [r["stamps"][0] - r["t0"] for r in results if r["stamps"]]
    if t1 <= t0:
        print(f"  {name}: the streams never all decoded at once (the first ended {t0 - t1:.2f} s before the last "
              "began): raise --gen", flush=True)
    generated = sum(r["tokens"] for r in results)
    if t1 > t0 and n < generated / 4:   # the streams started far apart (their continuations ran one after another)
        print(f"  {name}: only {n} of the {generated} tokens fell in the window where every stream decodes "
              f"({t1 - t0:.2f} s; the last first token came after {max(ttft):.1f} s): the rate is a short sample; "
              "raise --gen", flush=True)
    return {"tok_s": n / (t1 - t0) if t1 > t0 else None, "window_s": t1 - t0, "tokens_in_window": n,
            "ttft_max_s": max(ttft), "generated": generated}


def prompt_ids(n: int, seed: int, n_vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, n_vocab - 100, n).tolist()


def model_vocab_size(model: str) -> int:
    """The GGUF's token count: random prompts stay inside any model's vocabulary (a tiny test model's too)."""
    from gguf import GGUFReader
    return len(GGUFReader(resolve_model_path(model)).fields["tokenizer.ggml.tokens"].data)


def all_answered(name: str, results: list[dict]) -> list[dict]:
    """The results, or a RuntimeError naming the statuses when a server refused any request."""
    refused = [r["status"] for r in results if r["status"] != 200]
    if refused:
        raise RuntimeError(f"{name} answered {len(refused)} of {len(results)} requests with HTTP "
                           f"{', '.join(map(str, sorted(set(refused))))} (its log says why)")
    return results


def batched_counts(url: str) -> dict:
    """Our server's own count of the tokens its batched forwards decoded (its /metrics), read after the run: a
    throughput figure says whether the slots' steps shared one forward or ran one by one."""
    from prometheus_client.parser import text_string_to_metric_families
    values = {s.name: s.value for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text)
              for s in family.samples}
    return {"batched_steps": int(values.get("kvflash_batched_steps_total", 0)),
            "batched_tokens": int(values.get("kvflash_batched_tokens_total", 0)),
            "server_generated": int(values.get("kvflash_generated_tokens_total", 0))}


def describe_cost(r: dict) -> str:
    parts = [f"GPU peak {r['gpu_peak_bytes'] / 2**30:.2f} GiB"] if r.get("gpu_peak_bytes") is not None else []
    if "batched_tokens" in r:
        parts.append(f"{r['batched_tokens']} of {r['server_generated']} tokens in {r['batched_steps']} batched steps")
    return f"; {', '.join(parts)}" if parts else ""


def servers_to_run(args) -> list:
    """(name, start) of ours, then llama-server's when one runs beside it."""
    return [("kvflash", ours)] + ([("llama-server", llama_server)] if args.llama_server else [])


def throughput(args) -> dict:
    rows, n_vocab = [], model_vocab_size(args.model)
    for n_streams in (int(x) for x in args.streams.split(",")):
        prompts = [prompt_ids(args.context, seed=i, n_vocab=n_vocab) for i in range(n_streams)]
        row = {"streams": n_streams, "context": args.context}
        for name, start in servers_to_run(args):
            used_before = gpu_used_by_device()
            with PeakSampler(interval_s=0.02) as peak:
                server = start(args, n_streams, Path(args.logs) / f"{name}-{n_streams}.log")
                try:
                    all_answered(name, [stream_completion(server.url, prompt_ids(64, 999, n_vocab), 4)])   # warm up
                    t0 = time.perf_counter()
                    all_answered(name, concurrent(server.url, prompts, 1))
                    fill_s = time.perf_counter() - t0
                    answered = all_answered(name, concurrent(server.url, prompts, args.gen))
                    row[name] = {**aggregate_decode(name, answered),
                                 "fill_s": fill_s, **(batched_counts(server.url) if name == "kvflash" else {})}
                finally:
                    server.stop()
            row[name]["gpu_peak_bytes"] = above(used_before, peak.peak)
            print(f"{name:>12}  {n_streams} x {args.context}: {row[name]['tok_s'] or 0:.1f} tok/s aggregate decode "
                  f"(the {n_streams} prompts took {fill_s:.1f} s; then first tokens within "
                  f"{row[name]['ttft_max_s']:.2f} s){describe_cost(row[name])}", flush=True)
        if "llama-server" in row and row["llama-server"]["tok_s"] and row["kvflash"]["tok_s"]:
            row["ratio"] = row["kvflash"]["tok_s"] / row["llama-server"]["tok_s"]
            print(f"{'ratio':>12}  {row['ratio']:.2f}x", flush=True)
        rows.append(row)
    return {"mode": "throughput", "llama_server": args.llama_server, "rows": rows}


def stall(streams: list[dict], t_from: float, t_to: float) -> dict:
    """The streams' inter-token gaps: their median over the whole run and their p99 (and largest) among the gaps
    that overlap [t_from, t_to]."""
    gaps = [(a, b) for r in streams for a, b in zip(r["stamps"], r["stamps"][1:])]
    during = [b - a for a, b in gaps if b > t_from and a < t_to]
    median = float(np.median([b - a for a, b in gaps])) if gaps else float("nan")
    p99 = float(np.percentile(during, 99)) if during else float("nan")
    return {"itl_median_ms": median * 1e3, "itl_p99_during_ms": p99 * 1e3,
            "itl_max_during_ms": max(during, default=float("nan")) * 1e3, "gaps_during": len(during),
            "p99_over_median": p99 / median if during and median > 0 else None}


def interference(args) -> dict:
    n_streams = max(int(x) for x in args.streams.split(","))
    if n_streams < 2:
        raise SystemExit("--interference needs --streams of at least 2 (S - 1 decode, one brings the long prompt)")
    n_vocab, rows = model_vocab_size(args.model), {}
    for name, start in servers_to_run(args):
        server = start(args, n_streams, Path(args.logs) / f"{name}-interference.log")
        try:
            # warm up with a prompt of the same length alone: a running server has seen long prompts (ours sizes
            # a prompt's steps while others decode from the last one's rate: Scheduler._prompt_step_cap)
            all_answered(name, [stream_completion(server.url, prompt_ids(args.context, 999, n_vocab), 4)])
            results: list = [None] * (n_streams - 1)
            live: list[list] = [[] for _ in results]
            threads = [threading.Thread(target=lambda i=i: results.__setitem__(
                i, stream_completion(server.url, prompt_ids(64, i, n_vocab), args.gen, stamps=live[i])))
                for i in range(n_streams - 1)]
            for t in threads:
                t.start()
            deadline = time.perf_counter() + 600
            while not all(len(s) >= 2 for s in live) and time.perf_counter() < deadline:
                time.sleep(0.02)   # every stream past its prompt and decoding
            long = stream_completion(server.url, prompt_ids(args.context, 12345, n_vocab), 4)
            for t in threads:
                t.join()
            all_answered(name, results + [long])
            t_from, t_to = long["t0"], long["stamps"][0]
            rows[name] = {**stall(results, t_from, t_to), "long_prompt_s": t_to - t_from,
                          "decoding_at_arrival": sum(r["stamps"][0] < t_from < r["stamps"][-1] for r in results)}
        finally:
            server.stop()
        r = rows[name]
        print(f"{name:>12}  {n_streams - 1} streams decoding, a {args.context}-token prompt arrives "
              f"({r['decoding_at_arrival']} still decoding then; its first token after {r['long_prompt_s']:.1f} s): "
              f"inter-token median {r['itl_median_ms']:.1f} ms, p99 during the prompt {r['itl_p99_during_ms']:.1f} ms "
              f"(max {r['itl_max_during_ms']:.1f}), p99 / median {r['p99_over_median'] or float('nan'):.2f}", flush=True)
    return {"mode": "interference", "streams": n_streams, "context": args.context, "gen": args.gen, "rows": rows}


def soak(args) -> dict:
    rng = random.Random(args.seed)
    server = ours(args, args.parallel, Path(args.logs) / "kvflash-soak.log")
    samples, outcomes, lock = [], {"ok": 0, "left": 0, "busy": 0, "failed": 0}, threading.Lock()
    jobs, n_vocab = [], model_vocab_size(args.model)
    for i in range(args.requests):
        n_prompt = rng.randint(8, args.context)
        jobs.append((prompt_ids(n_prompt, seed=i, n_vocab=n_vocab), rng.randint(1, args.gen), rng.random() < 0.7,
                     rng.randint(1, 4) if rng.random() < 0.15 else None))
    interval = args.soak / max(1, args.requests)
    stop_sampling = threading.Event()

    def sample():
        while not stop_sampling.wait(2.0):
            samples.append((time.perf_counter(), server.rss_bytes()))

    def worker(k):
        for j in range(k, len(jobs), args.concurrency):
            time.sleep(rng.random() * 2 * interval * args.concurrency / 2)
            prompt, max_tokens, streamed, leave = jobs[j]
            try:
                r = stream_completion(server.url, prompt, max_tokens, leave_after=leave if streamed else None,
                                      stream=streamed)
                key = {200: "ok", 499: "left", 503: "busy"}.get(r["status"], "failed")
            except httpx.HTTPError:
                key = "failed"
            with lock:
                outcomes[key] += 1

    try:
        rss_start = server.rss_bytes()
        t0 = time.perf_counter()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        workers = [threading.Thread(target=worker, args=(k,)) for k in range(args.concurrency)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - t0
        time.sleep(2)
        rss_end = server.rss_bytes()
        alive = server.proc.poll() is None
    finally:
        stop_sampling.set()
        server.stop()
    peak = max([rss for _, rss in samples] + [rss_end])
    result = {"mode": "soak", "requests": args.requests, "seconds": elapsed, "outcomes": outcomes, "alive": alive,
              "rss_start_mib": rss_start / 2**20, "rss_peak_mib": peak / 2**20, "rss_end_mib": rss_end / 2**20,
              "rss_samples": [(round(t - t0, 1), round(r / 2**20, 1)) for t, r in samples]}
    print(f"soak: {args.requests} requests in {elapsed:.0f} s: {outcomes}; server alive: {alive}; RSS "
          f"{result['rss_start_mib']:.0f} MiB at start, {result['rss_peak_mib']:.0f} peak, "
          f"{result['rss_end_mib']:.0f} at the end", flush=True)
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="kvflash bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--kvflash", default="auto", help="our server's --kvflash (default auto)")
    ap.add_argument("--streams", default="1,4,8", help="concurrent streams, one server start each (throughput)")
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens per stream (soak: the largest)")
    ap.add_argument("--gen", type=int, default=512,
                    help="tokens generated per stream (soak: the largest); enough that all streams decode at once")
    ap.add_argument("--llama-server", default=None,
                    help="llama-server to run beside ours, or none (default: the one built from our tree, if any)")
    ap.add_argument("--ours-flags", default="", help="more flags for kvflash serve (e.g. '--backend cuda')")
    ap.add_argument("--llama-flags", default="", help="more flags for llama-server")
    ap.add_argument("--interference", action="store_true",
                    help="measure how a long prompt (--context) stalls --streams - 1 decoding streams instead")
    ap.add_argument("--soak", type=float, default=None, help="run the soak for about this many seconds instead")
    ap.add_argument("--requests", type=int, default=500, help="soak: requests in all")
    ap.add_argument("--concurrency", type=int, default=8, help="soak: clients at once")
    ap.add_argument("--parallel", type=int, default=4, help="soak: our server's slots")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logs", default=None, help="folder for the servers' logs (default: a new temporary folder)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    # Not the current folder: a run from a checkout would leave its logs among the sources.
    args.logs = args.logs or tempfile.mkdtemp(prefix="kvflash-bench-serve-")
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    print(f"servers' logs: {args.logs}", flush=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.llama_server == "none":
        args.llama_server = None
    elif args.llama_server is None and not args.soak:
        try:
            args.llama_server = find_llama_server()
        except FileNotFoundError as e:
            ap.error(str(e))
        print(f"llama-server: {args.llama_server or 'none built (KVFLASH_LLAMA_SERVER=ON builds one); ours only'}",
              flush=True)
    result = soak(args) if args.soak else interference(args) if args.interference else throughput(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0
