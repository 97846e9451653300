"""kvflash bench spec: plain vs speculative decode on the same model and pool, in one run.

For each --draft (prompt_lookup, mtp, or a draft GGUF), the same prompt runs through a plain Engine and a speculative
one (the same pool); after the prompt (untimed) --n-gen greedy tokens are timed, --reps times (each rep rewinds to
the prompt), and the median tok/s of each is printed with the ratio, the acceptance (drafts kept / drafted), and
whether the speculative tokens equal plain decoding's (they do up to the float summation order of a batched step;
with bit-identical kernels, e.g. the CPU's flash attention on one thread, always).

Tasks: `copy` (default): a prose document of --context tokens, then the request to write it again and its first
words, as a plain completion: the model copies, which is what prompt lookup is for (editing, rewriting a file).
`random`: --context random tokens (random-weight models: the measure of the machinery, with the model itself
as the draft for acceptance 1.0, or a small random draft for acceptance near 0; mtp on a random model's own head:
near 0, or 1.0 with random_gguf's --echo --mtp)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..engine import Engine
from ..engine_parts import with_loaded_draft
from ..mtp import wants_mtp
from ..options import SpeculativeConfig
from ..testing.prose import prose
from ..tokenizer import Tokenizer
from .reference import open_model
from ..commands.flags import add_model_flags, add_pool_flags, add_residency_flags, pool_config, residency_config


def copy_prompt(tokenizer: Tokenizer, n_tokens: int) -> list[int]:
    """A document of about n_tokens tokens, then the request to write it again and its first sentence."""
    doc, n = "", 40
    while len(tokenizer.encode(doc)) < n_tokens:
        doc = prose(n, seed=7)
        n *= 2
    doc = tokenizer.decode(tokenizer.encode(doc, add_special=False)[:n_tokens])
    first = doc.split(". ")[0] + "."
    return tokenizer.encode(f"{doc}\n\nThe same text once more, word for word:\n\n{first}")


def time_decode(engine: Engine, prompt: list[int], n_gen: int, reps: int) -> dict:
    rates, tokens = [], []
    before = dict(engine.stats())
    for _ in range(reps):
        gen = engine.generate(prompt, max_tokens=n_gen, temperature=0.0)
        first = next(gen)   # the prompt (reused after the first rep) and the first token: untimed
        out = [first.token]
        t0 = time.perf_counter()
        out += [r.token for r in gen if r.token is not None]
        rates.append((len(out) - 1) / (time.perf_counter() - t0))
        tokens = out
    after = engine.stats()
    drafted = after.get("spec_drafted", 0) - before.get("spec_drafted", 0)
    accepted = after.get("spec_accepted", 0) - before.get("spec_accepted", 0)
    steps = after.get("spec_steps", 0) - before.get("spec_steps", 0)
    return {"tok_s": float(np.median(rates)), "tok_s_reps": rates, "tokens": tokens, "drafted": drafted,
            "accepted": accepted, "acceptance": accepted / drafted if drafted else None,
            "tokens_per_step": (accepted + steps) / steps if steps else None,
            "device_peak_bytes": after["device_peak_bytes"], "device_drafter_bytes": after["device_drafter_bytes"]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="kvflash bench spec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap, threads=os.cpu_count())
    add_pool_flags(ap, pool="512", n_ctx=None)
    add_residency_flags(ap)
    ap.add_argument("--draft", default="prompt_lookup",
                    help="comma-separated drafters, each a column: prompt_lookup, mtp (the model's own multi-token-"
                         "prediction head), or a draft GGUF (path or short name)")
    ap.add_argument("--draft-max", type=int, default=SpeculativeConfig.max_draft, help="most tokens drafted per step")
    ap.add_argument("--ngram", type=int, default=SpeculativeConfig.ngram, help="prompt lookup: longest n-gram matched")
    ap.add_argument("--task", default="copy", choices=["copy", "random"])
    ap.add_argument("--contexts", default="4096", help="comma-separated prompt lengths in tokens")
    ap.add_argument("--n-gen", type=int, default=128, help="tokens timed per rep")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default="bench-out/spec.json", help="where to write the JSON ('' = none)")
    args = ap.parse_args(argv)
    try:
        contexts = [int(x) for x in args.contexts.split(",") if x.strip()]
        drafts = [d for d in args.draft.split(",") if d.strip()]
        pool, residency = pool_config(args, n_ctx=max(contexts) + args.n_gen + 64), residency_config(args)
        configs = [SpeculativeConfig(draft=d, max_draft=args.draft_max, ngram=args.ngram) for d in drafts]
    except ValueError as e:
        print(f"kvflash bench spec: {e}", file=sys.stderr)
        return 2
    if args.n_gen <= 0 or args.reps <= 0 or not contexts or min(contexts) <= 0:
        ap.error("--n-gen, --reps and every context must be positive")
    path, model, tokenizer = open_model(args, "kvflash bench spec", mtp=any(wants_mtp(c) for c in configs))
    configs = [with_loaded_draft(c, model) for c in configs]

    rows = []
    rng = np.random.default_rng(0)
    for n in contexts:
        prompt = copy_prompt(tokenizer, n) if args.task == "copy" else \
            rng.integers(100, model.hparams.n_vocab - 100, n).tolist()
        plain = time_decode(Engine(model, tokenizer, pool, residency), prompt, args.n_gen, args.reps)
        row = {"context": len(prompt), "plain": plain, "spec": {}}
        for d, cfg in zip(drafts, configs):
            try:
                engine = Engine(model, tokenizer, pool, residency, speculative=cfg)
            except ValueError as e:
                print(f"kvflash bench spec: {e}", file=sys.stderr)
                return 2
            r = time_decode(engine, prompt, args.n_gen, args.reps)
            r["same_tokens"] = r["tokens"] == plain["tokens"]
            row["spec"][d] = r
            engine.close()
        rows.append(row)
        print_row(row)
    report = {"model": path, "pool": pool.pool_tokens, "task": args.task, "n_gen": args.n_gen, "reps": args.reps,
              "draft_max": args.draft_max, "threads": args.threads, "device": model.backend_name,
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    print(f"model {Path(path).name}, pool {pool.pool_tokens}, task {args.task}, {args.threads} threads, "
          f"{model.backend_name}; tok/s: median of {args.reps} reps of {args.n_gen} greedy tokens after the prompt")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


def print_row(row: dict) -> None:
    p = row["plain"]
    print(f"context {row['context']}: plain {p['tok_s']:.1f} tok/s")
    for d, r in row["spec"].items():
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        per = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] is not None else "-"
        print(f"  {Path(d).name:>16}: {r['tok_s']:.1f} tok/s = {r['tok_s'] / p['tok_s']:.2f}x plain, acceptance {acc}, "
              f"{per} tokens per verify step, same tokens as plain: {'yes' if r['same_tokens'] else 'no'}, "
              f"device peak {r['device_peak_bytes'] / 2**20:.0f} MiB (draft model {r['device_drafter_bytes'] / 2**20:.0f})")
