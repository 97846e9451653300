"""Shared command line of `kvflash bench niah` and `kvflash bench ruler` (they differ only in
their default tasks, case count and table grouping)."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional, Sequence

from ...commands.flags import add_model_flags, add_pool_flags, add_residency_flags
from ...known_models import resolve_model_path
from ...tokenizer import Tokenizer
from . import filler, tasks
from .cases import FORMATS, Renderer, load_jsonl
from .grid import Policy, format_paired, format_table, make_configs, run_grid, write_json, write_plot

SUITES = {
    # bench -> (default tasks, default cases per task and length, table grouping)
    "niah": (("passkey",), 20, "by_depth"),
    "ruler": (tasks.RULER_TASKS, 10, "by_task"),
}


def build_parser(bench: str) -> argparse.ArgumentParser:
    default_tasks, default_cases, _ = SUITES[bench]
    ap = argparse.ArgumentParser(
        prog=f"kvflash bench {bench}",
        description=f"Retrieval recall ({bench}) over context lengths x pool sizes x policies, against the "
                    "full-cache control. Prints a table, writes JSON and a PNG plot of recall vs residency.")
    add_model_flags(ap, threads=os.cpu_count())
    add_pool_flags(ap, pool="512,1024", n_ctx=None, several=True)
    ap.add_argument("--lengths", default="8192", help="comma-separated context lengths in tokens (default 8192)")
    ap.add_argument("--policies", default="lru",
                    help="comma-separated policies passed to Model(policy=...): names (lru, qk, quest, drafter, ...) "
                         "or module:function for a Python callable; 'full' adds the control (default lru)")
    add_residency_flags(ap, grid=True)
    ap.add_argument("--no-full", action="store_true", help="skip the full-cache control")
    ap.add_argument("--tasks", default=",".join(default_tasks),
                    help=f"comma-separated tasks from {', '.join(tasks.TASKS)} (default {','.join(default_tasks)})")
    ap.add_argument("--cases", type=int, default=default_cases, help=f"cases per task and length ({default_cases})")
    ap.add_argument("--depths", default="", help="comma-separated needle depths in [0, 1] (default: evenly "
                                                  "spaced over 0.1..0.9 across the cases)")
    ap.add_argument("--fillers", default=",".join(filler.KINDS),
                    help=f"haystack kinds taken in turn ({','.join(filler.KINDS)})")
    ap.add_argument("--jsonl", default=None, help="user cases {context, question, answer} per line instead of "
                                                  "generated ones (--lengths, --tasks, --depths are then unused)")
    ap.add_argument("--format", default="chat", choices=FORMATS,
                    help="prompt through the GGUF's chat template (chat) or as plain text (default chat)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=f"bench-out/{bench}.json", help="where to write the JSON ('' = none)")
    ap.add_argument("--plot", default=f"bench-out/{bench}.png", help="where to write the PNG ('' = none)")
    ap.add_argument("--quiet", action="store_true", help="no per-case progress lines")
    return ap


def parse_ints(ap: argparse.ArgumentParser, flag: str, value: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        ap.error(f"{flag} must be comma-separated integers, got {value!r}")
    if not out or any(v <= 0 for v in out):
        ap.error(f"{flag} must list positive integers, got {value!r}")
    return out


def parse_policies(ap: argparse.ArgumentParser, value: str) -> tuple[list[Policy], bool]:
    """Policy names pass through as strings; module:function is imported as a callable. Returns
    the policies and whether 'full' was named among them."""
    out: list[Policy] = []
    full = False
    for name in (v.strip() for v in value.split(",")):
        if not name:
            continue
        if name in ("full", "off"):
            full = True
        elif ":" in name:
            mod, _, attr = name.partition(":")
            try:
                out.append(getattr(importlib.import_module(mod), attr))
            except (ImportError, AttributeError) as e:
                ap.error(f"--policies: cannot load the callable {name!r}: {e}")
        else:
            out.append(name)
    return out, full


def make_cases(args, ap: argparse.ArgumentParser, renderer: Renderer, lengths: list[int]) -> dict:
    if args.jsonl:
        try:
            cases = load_jsonl(args.jsonl)
        except ValueError as e:
            ap.error(f"--jsonl: {e}")
        # user cases are not fitted to a length: they form one bucket named by the longest prompt
        longest = max(len(renderer.tokens(c)) for c in cases)
        return {longest: cases}
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    fillers = [f.strip() for f in args.fillers.split(",") if f.strip()]
    try:
        depths = [float(d) for d in args.depths.split(",") if d.strip()] or None
    except ValueError:
        ap.error(f"--depths must be comma-separated numbers, got {args.depths!r}")
    try:
        return {length: [c for t in names for c in tasks.generate(t, renderer, length, args.cases, seed=args.seed,
                                                                   depths=depths, fillers=fillers)]
                for length in lengths}
    except ValueError as e:
        ap.error(str(e))


def main(bench: str, argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser(bench)
    args = ap.parse_args(argv)
    lengths = parse_ints(ap, "--lengths", args.lengths)
    pools = parse_ints(ap, "--kvflash", args.pools) if args.pools.strip() else []
    policies, full_named = parse_policies(ap, args.policies)
    if "drafter" in policies and not args.drafter_model:
        ap.error("--policies drafter needs --drafter-model PATH")
    if args.cases <= 0:
        ap.error("--cases must be positive")
    include_full = full_named or not args.no_full
    if not policies and not include_full:
        ap.error("nothing to run: no policies and --no-full")

    try:
        path = resolve_model_path(args.model)
        renderer = Renderer(Tokenizer(path), args.format)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"kvflash bench {bench}: {e}", file=sys.stderr)
        return 2
    cases = make_cases(args, ap, renderer, lengths)
    if args.tau is not None and args.tau <= 0:
        ap.error("--tau must be positive")
    variants = {"default": (None,), "on": (True,), "off": (False,), "both": (False, True)}[args.prefill_reselect]
    cfgs = make_configs(pools if policies else [], policies, include_full=include_full,
                        prefill_reselect=variants, tau=args.tau, drafter_model=args.drafter_model,
                        prefill={"default": (None,), "pooled": ("pooled",), "exact": ("exact",), "sparse": ("sparse",),
                                 "both": ("pooled", "exact"), "exact+sparse": ("exact", "sparse")}[args.prefill],
                        kv_type=args.kv_type, attention=args.attention)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    given = list(argv) if argv is not None else sys.argv[1:]
    meta = {"bench": bench, "command": " ".join(["kvflash", "bench", bench, *given]), "seed": args.seed}
    try:
        report = run_grid(path, cases, renderer, cfgs, n_threads=args.threads, backend=args.backend, log=log, meta=meta,
                          on_cell=(lambda r: write_json(r, args.json)) if args.json else None)
    except ValueError as e:   # an unknown policy or a pool the engine refuses, found before any cell ran
        print(f"kvflash bench {bench}: {e}", file=sys.stderr)
        return 2
    print(f"{bench}: {os.path.basename(path)}, {args.format} prompts, {args.threads} threads")
    print(format_table(report, SUITES[bench][2]))
    paired = format_paired(report, SUITES[bench][2].removeprefix("by_"))
    if paired:
        print(paired)
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        if write_plot(report, args.plot):
            print(f"wrote {args.plot}")
        else:
            print("matplotlib is not installed (pip install '.[bench]'): no plot written", file=sys.stderr)
    return 0
