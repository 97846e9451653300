"""kvflash bench restore: restore-consume vs cold re-prefill of a long prompt.

A prompt of about --n-ctx tokens (templated prose, or random ids) is split into a chunk-aligned prefix and a short suffix (--suffix).
The prefix is prefilled once and saved as a snapshot file. Then, each from a new session:
  cold  prefill the whole prompt;
  warm  Session.restore(model, snapshot) + prefill only the suffix.
Both then decode --n-gen greedy tokens. Prints both times, the warm/cold speedup and how many greedy
tokens agree (they need not all: the cold run splits the prompt into other batches, so with a pool
smaller than the context it evicts at other moments), and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .. import _core
from ..commands.flags import add_model_flags, add_pool_flags, device_config, pool_config
from ..weights import load_model
from ..testing.prose import prose

CHUNK = _core.CHUNK_TOKENS


def greedy(session, logits, n_gen: int) -> list[int]:
    out = []
    for _ in range(n_gen):
        out.append(int(logits.argmax()))
        logits = session.forward(np.array([out[-1]], np.int32), session.n_tokens)
    return out


def make_prompt(model, args, n: int) -> np.ndarray:
    """n tokens of templated prose (the model can predict it, so greedy agreement means something), or
    of uniformly random ids with --prompt random."""
    if args.prompt == "random":
        rng = np.random.default_rng(args.seed)
        return rng.integers(100, model.hparams.n_vocab - 100, n, dtype=np.int32)
    vocab = _core.Vocab(model.path)
    n_sentences = n // 10 + 8   # a sentence is ~15 tokens
    while len(tokens := vocab.tokenize(prose(n_sentences, seed=args.seed), add_special=True)) < n:
        n_sentences *= 2
    return np.array(tokens[:n], np.int32)


def run(model, args, snapshot: Path) -> dict:
    cfg = _core.SessionConfig(max_tokens=args.n_ctx, pool_tokens=pool_config(args).resolved_pool_tokens(),
                              kv_type=args.kv_type, attention=args.attention, allow_beyond_train_ctx=True)
    n_prompt = args.n_ctx - args.n_gen - 1
    n_prefix = (n_prompt - args.suffix) // CHUNK * CHUNK
    prompt = make_prompt(model, args, n_prompt)

    t0 = time.perf_counter()
    saver = _core.Session(model, cfg)
    saver.forward(prompt[:n_prefix], 0)
    t_prefix = time.perf_counter() - t0
    t0 = time.perf_counter()
    saver.save(snapshot)
    t_save = time.perf_counter() - t0
    host_bytes = saver.pager.host_bytes()
    del saver

    t0 = time.perf_counter()
    cold = _core.Session(model, cfg)
    cold_logits = cold.forward(prompt, 0)
    t_cold = time.perf_counter() - t0
    cold_tokens = greedy(cold, cold_logits, args.n_gen)
    del cold

    t0 = time.perf_counter()
    warm = _core.Session.restore(model, snapshot, max_tokens=args.n_ctx)   # may exceed the trained context, as saved
    t_restore = time.perf_counter() - t0
    warm_logits = warm.forward(prompt[n_prefix:], n_prefix)
    t_warm = time.perf_counter() - t0
    warm_tokens = greedy(warm, warm_logits, args.n_gen)

    agree = next((i for i, (a, b) in enumerate(zip(cold_tokens, warm_tokens)) if a != b), args.n_gen)
    return {"n_prompt": n_prompt, "n_prefix": n_prefix, "n_suffix": n_prompt - n_prefix,
            "snapshot_bytes": snapshot.stat().st_size, "host_kv_bytes": host_bytes,
            "t_prefix_s": t_prefix, "t_save_s": t_save, "t_cold_s": t_cold, "t_restore_s": t_restore,
            "t_warm_s": t_warm, "speedup": t_cold / t_warm,
            "first_logits_max_diff": float(np.abs(cold_logits - warm_logits).max()),
            "greedy_agree_prefix": agree, "greedy_same": int(sum(a == b for a, b in zip(cold_tokens, warm_tokens))),
            "n_gen": args.n_gen}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="kvflash bench restore", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(ap, threads=os.cpu_count())
    add_pool_flags(ap, pool="512", n_ctx=8192)
    ap.add_argument("--suffix", type=int, default=CHUNK, help="tokens after the saved prefix (at least)")
    ap.add_argument("--n-gen", type=int, default=32, help="greedy tokens compared after the prompt")
    ap.add_argument("--prompt", default="prose", choices=["prose", "random"], help="prompt text (default prose)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="where the snapshot is written (default: a temporary folder)")
    ap.add_argument("--json", default="bench-out/restore.json", help="where to write the JSON ('' = none)")
    args = ap.parse_args(argv)
    if args.n_ctx < 4 * CHUNK or args.suffix <= 0 or args.n_gen <= 0:
        ap.error(f"--n-ctx must be >= {4 * CHUNK}, --suffix and --n-gen positive")
    if args.n_ctx - args.n_gen - 1 - args.suffix < CHUNK:
        ap.error("--n-ctx leaves no whole chunk before the suffix")

    try:
        path, model = load_model(args.model, device_config(args))
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"kvflash bench restore: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        r = run(model, args, Path(tmp) / "prefix.kvf")
    report = {"model": path, "n_ctx": args.n_ctx, "pool": args.kvflash, "kv_type": args.kv_type, "prompt": args.prompt,
              "threads": args.threads, "device": model.backend_name, "date": time.strftime("%Y-%m-%d %H:%M:%S"), **r}
    print(f"model {Path(path).name}, n_ctx {args.n_ctx}, pool {args.kvflash or 'full'}, kv {args.kv_type}, "
          f"{args.threads} threads, {model.backend_name}")
    print(f"prompt {r['n_prompt']} tokens = saved prefix {r['n_prefix']} + suffix {r['n_suffix']}; snapshot "
          f"{r['snapshot_bytes'] / 2**20:.1f} MiB written in {r['t_save_s']:.3f} s")
    print(f"cold prefill of the whole prompt  {r['t_cold_s']:8.3f} s")
    print(f"warm restore + suffix prefill     {r['t_warm_s']:8.3f} s  (restore alone {r['t_restore_s']:.3f} s)")
    print(f"warm/cold speedup                 {r['speedup']:8.1f}x")
    print(f"greedy agreement: {r['greedy_same']}/{r['n_gen']} tokens equal, identical for the first "
          f"{r['greedy_agree_prefix']}; first-step logits max |diff| {r['first_logits_max_diff']:.3g}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
