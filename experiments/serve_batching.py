"""What batching the server's rounds buys for the slots that used to step one at a time (issue 38 item 3): qk /
quest slots, and slots that speculate (their verify steps). The scheduler itself (no HTTP), S slots each with a
prompt past the pool and G tokens to generate, every configuration once with the rounds batched and once with
every slot stepping alone, in one process. Each slot's prompt runs once first (one token generated), then comes
back with G tokens to generate: the slot holds it, so all S slots decode from the same round on. Aggregate decode
tok/s over the window in which all S decode (from the last slot's first token to the first slot's last); the
tokens of the two runs compared.

    OMP_WAIT_POLICY=passive python experiments/serve_batching.py --model smollm2 --slots 4 --prompt 1024 --gen 160
    OMP_WAIT_POLICY=passive python experiments/serve_batching.py --configs lru,lru+prompt_lookup --prompt 448 --gen 320
    OMP_WAIT_POLICY=passive python experiments/serve_batching.py --model q35.gguf --configs lru+prompt_lookup,lru+mtp ...
    OMP_WAIT_POLICY=passive python experiments/serve_batching.py --model echo.gguf --configs lru+self ...
    OMP_WAIT_POLICY=passive python experiments/serve_batching.py --model gemma3-270m --configs lru+draft --draft smollm2

--profile: where the second send's time goes, per configuration: wall time inside the core calls the rounds make
(BatchDecoder steps, a session's own steps, scoring, reselects, queries) and the sessions' own timers (compute,
paging, scoring), summed over the slots. --cprofile N: the scheduler thread's rounds under cProfile in the second send,
the N functions with the most own time. --switch-interval S: sys.setswitchinterval(S) first (how long a thread that
wants the GIL waits before the holder is asked to drop it: 5 ms by default). --backend cuda: on the GPU (--model a
GGUF path).

A prompt past the pool comes back as an exact prefill of its last token (one round a layer: 30 for SmolLM2), so the
slots start decoding that many rounds apart; a speculating slot generates its tokens in few rounds, hence the
speculation runs with a prompt the pool holds and more tokens to generate.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import pstats
import sys
import time

from kvflash_ggml import _core, resolve_model_path
from kvflash_ggml.options import PoolConfig, ResidencyConfig, SamplingParams, SpeculativeConfig
from kvflash_ggml.server.scheduler import Request, Scheduler, slot_engines
from kvflash_ggml.tokenizer import Tokenizer

CONFIGS = {"lru": ("lru", None), "qk": ("qk", None), "quest": ("quest", None),
           "lru+prompt_lookup": ("lru", SpeculativeConfig(draft="prompt_lookup")),
           "lru+mtp": ("lru", SpeculativeConfig(draft="mtp")),   # a GGUF with a nextn head (qwen35)
           "lru+self": ("lru", "self"),   # the model drafting for itself as a draft model (a session of its own)
           "lru+draft": ("lru", "draft")}   # --draft MODEL drafting (of the same vocabulary or mapped through text)


# The core calls a round makes, timed by --profile (class, method).
PROFILED = [(_core.BatchDecoder, m) for m in ("step", "step_greedy", "step_rows")] + \
           [(_core.Session, m) for m in ("forward", "forward_greedy", "chunk_scores", "reselect", "queries",
                                         "prefill_exact", "begin_prefill_exact")]


class CallTimes:
    """Wall time and calls per profiled method while on; the methods are put back by off()."""

    def __init__(self) -> None:
        self.ms: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.saved = []

    def on(self) -> None:
        for cls, name in PROFILED:
            orig = getattr(cls, name)
            self.saved.append((cls, name, orig))

            def timed(*a, _orig=orig, _key=f"{cls.__name__}.{name}", **kw):
                t0 = time.perf_counter()
                try:
                    return _orig(*a, **kw)
                finally:
                    self.ms[_key] += (time.perf_counter() - t0) * 1e3
                    self.calls[_key] += 1
            setattr(cls, name, timed)

    def off(self) -> None:
        for cls, name, orig in self.saved:
            setattr(cls, name, orig)
        self.saved.clear()


def session_timers(engines) -> collections.Counter:
    c: collections.Counter = collections.Counter()
    for e in engines:
        t = e.session.timings
        c.update({"t_compute_ms": t.t_compute_ms, "t_paging_ms": t.t_paging_ms, "t_scoring_ms": t.t_scoring_ms,
                  "n_computes": t.n_computes, "n_graph_builds": t.n_graph_builds,
                  "policy_ms": getattr(e, "_t_policy_ms", 0.0)})
    return c


def run(model, tok, args, policy, speculative, batch: bool) -> tuple[float, list[list[int]], int]:
    pool = PoolConfig(n_ctx=args.prompt + args.gen + 256, pool_tokens=args.pool)
    engines = slot_engines(args.slots, model, tok, pool, ResidencyConfig(policy=policy, prefill="exact"),
                           store_each_turn=False, speculative=speculative)
    sched = Scheduler(engines, max_queue=args.slots, batch=batch)
    # a text that repeats (prompt lookup finds drafts), different per slot
    texts = [f"Entry {i}: the ledger lists {i} sacks of grain, then " * 400 for i in range(args.slots)]
    prompts = [(ids * (args.prompt // len(ids) + 1))[:args.prompt] for ids in map(tok.encode, texts)]
    stamps: list[list[float]] = [[] for _ in prompts]

    async def drain(i, r):
        out = []
        while (item := await r.out.get()) is not None:
            stamps[i].append(time.perf_counter())
            out.append(item)
        return out

    async def send(max_tokens):
        loop = asyncio.get_running_loop()
        reqs = [Request(p, SamplingParams(max_tokens=max_tokens, temperature=0), loop) for p in prompts]
        for r in reqs:
            sched.submit(r)
        return await asyncio.gather(*(drain(i, r) for i, r in enumerate(reqs)))

    prof = cProfile.Profile() if args.cprofile else None
    profiling = False   # set from the second send on
    if prof:   # the scheduler thread's rounds only (a profiler is per thread), from the second send on
        round_once = sched._round

        def profiled_round():
            if not profiling:
                return round_once()
            prof.enable()
            try:
                return round_once()
            finally:
                prof.disable()
        sched._round = profiled_round

    async def main():
        nonlocal profiling
        await send(1)   # each slot computes its prompt once (as bench serve fills its slots) ...
        for s in stamps:
            s.clear()
        profiling = True
        if not args.profile:
            return await send(args.gen)   # ... and holds it when the same prompt comes back: every slot decodes at once
        calls, before = CallTimes(), session_timers(engines)
        calls.on()
        t0 = time.perf_counter()
        try:
            return await send(args.gen)
        finally:
            calls.off()
            wall = (time.perf_counter() - t0) * 1e3
            timers = session_timers(engines)
            timers.subtract(before)
            print(f"  {policy} {'batched' if batch else 'alone'}: second send {wall:.0f} ms; " +
                  ", ".join(f"{k} {calls.ms[k]:.0f} ms / {calls.calls[k]}" for k in sorted(calls.ms)) + "; sessions: " +
                  ", ".join(f"{k} {v:.0f}" for k, v in timers.items()), flush=True)

    try:
        records = asyncio.run(main())
    finally:
        sched.stop()
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
    t0 = max(s[0] for s in stamps)     # every slot decodes from here ...
    t1 = min(s[-2] for s in stamps)    # ... to here (the last stamp is the closing record)
    if t1 <= t0:
        raise SystemExit(f"{policy}: the slots never decoded together (more --gen, or a --prompt the pool holds)")
    n = sum(sum(1 for t in s[:-1] if t0 < t <= t1) for s in stamps)
    tokens = [[r.token for r in recs[:-1]] for recs in records]
    return n / (t1 - t0), tokens, sched.n_batched_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=160)
    ap.add_argument("--pool", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--draft", default=None, metavar="MODEL", help="the draft model of the lru+draft configuration")
    ap.add_argument("--profile", action="store_true", help="where the second send's time goes (see above)")
    ap.add_argument("--batched-only", action="store_true", help="skip the slot-by-slot runs")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="the scheduler's rounds under cProfile (above)")
    ap.add_argument("--switch-interval", type=float, default=None, metavar="S", help="sys.setswitchinterval(S) first")
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    path = resolve_model_path(args.model)
    mtp = any(isinstance(CONFIGS[name][1], SpeculativeConfig) and CONFIGS[name][1].draft == "mtp"
              for name in args.configs.split(","))
    model = _core.Model(path, backend=args.backend, n_threads=args.threads, mtp=mtp)
    tok = Tokenizer(path)
    print(f"{args.slots} slots, prompts of {args.prompt} tokens, {args.gen} generated, pool {args.pool}, "
          f"{args.threads} threads")
    print("| configuration | batched tok/s | slot by slot tok/s | batched / alone | batched steps | same tokens |")
    print("|---|---:|---:|---:|---:|---|")
    for name in args.configs.split(","):
        policy, spec = CONFIGS[name]
        if spec in ("self", "draft"):   # one copy of the draft model's weights for every slot
            if spec == "draft" and not args.draft:
                raise SystemExit("the lru+draft configuration needs --draft MODEL")
            draft = model if spec == "self" else _core.Model(resolve_model_path(args.draft), backend=args.backend,
                                                             n_threads=args.threads)
            spec = SpeculativeConfig(draft=draft)
        batched, tok_b, n_batched = run(model, tok, args, policy, spec, batch=True)
        if args.batched_only:
            print(f"| {name} | {batched:.1f} | - | - | {n_batched} | - |", flush=True)
            continue
        alone, tok_a, _ = run(model, tok, args, policy, spec, batch=False)
        print(f"| {name} | {batched:.1f} | {alone:.1f} | {batched / alone:.2f}x | {n_batched} | "
              f"{'yes' if tok_a == tok_b else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
