"""kvflash generate: complete a prompt, streaming the text to stdout."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from .cli import INTERRUPTED, add_model_args

# What a user can get wrong (a path, an option, a prompt): one line on stderr and exit code 2, no traceback.
USER_ERRORS = (ValueError, OSError, RuntimeError)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvflash generate", description=__doc__)
    add_model_args(ap)
    ap.add_argument("--prompt", required=True, help="prompt text ('-' reads stdin)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy, the default)")
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--min-p", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--policy", default="lru", choices=["lru", "qk", "quest", "drafter"],
                    help="residency policy when --kvflash pools the KV (default lru)")
    ap.add_argument("--drafter-model", default=None,
                    help="GGUF path or short name of the smaller model that --policy drafter runs beside the model")
    ap.add_argument("--tau", type=int, default=64, help="decode tokens between reselects (default 64)")
    ap.add_argument("--prefill", default="pooled", choices=["pooled", "exact"],
                    help="compute a prompt larger than the pool in the pool (pooled, bounded memory) or in a "
                         "transient full cache whose K/V the pool adopts (exact: better recall, context-sized "
                         "KV memory while the prompt runs)")
    ap.add_argument("--stats", action="store_true", help="print KV figures as JSON to stderr at the end")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:   # Ctrl-C: the engine stops between forward steps, even inside a long prompt
        print(f"\nkvflash generate: {INTERRUPTED}", file=sys.stderr)
        return 130


def run(args: argparse.Namespace) -> int:
    from .model import Model   # after parsing, so --help is instant

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        llm = Model(args.model, n_ctx=args.n_ctx, pool_tokens=args.kvflash, kv_type=args.kv_type,
                    attention=args.attention, backend=args.backend, n_threads=args.threads, policy=args.policy,
                    drafter_model=args.drafter_model, tau=args.tau, prefill=args.prefill)
    except USER_ERRORS as e:
        print(f"kvflash generate: {e}", file=sys.stderr)
        return 2
    with llm:
        opts = dict(max_tokens=args.max_tokens, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                    min_p=args.min_p, seed=args.seed, stream=True)
        try:
            if args.chat:
                chunks = llm.create_chat_completion([{"role": "user", "content": prompt}], **opts)
                texts = (c["choices"][0]["delta"].get("content", "") for c in chunks)
            else:
                chunks = llm.create_completion(prompt, **opts)
                sys.stdout.write(prompt)
                sys.stdout.flush()   # the prompt shows while it is computed
                texts = (c["choices"][0]["text"] for c in chunks)
            for text in texts:
                sys.stdout.write(text)
                sys.stdout.flush()
        except USER_ERRORS as e:
            print(f"\nkvflash generate: {e}", file=sys.stderr)
            return 2
        sys.stdout.write("\n")
        if args.stats:
            print(json.dumps(llm.stats(), indent=2), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
