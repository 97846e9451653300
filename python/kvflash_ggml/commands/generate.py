"""kvflash generate: complete a prompt, streaming the text to stdout."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Optional, Sequence

from ..model import Model
from . import INTERRUPTED
from .flags import (add_model_flags, add_pool_flags, add_residency_flags, add_sampling_flags, add_speculative_flags,
                    model_keywords,
                    sampling_params)

# What a user can get wrong (a path, an option, a prompt): one line on stderr and exit code 2, no traceback.
USER_ERRORS = (ValueError, OSError, RuntimeError)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvflash generate", description=__doc__)
    add_model_flags(ap)
    add_pool_flags(ap)
    add_residency_flags(ap)
    add_speculative_flags(ap)
    add_sampling_flags(ap)
    ap.add_argument("--prompt", required=True, help="prompt text ('-' reads stdin)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
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
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        params = sampling_params(args)
        llm = Model(args.model, **model_keywords(args))
    except USER_ERRORS as e:
        print(f"kvflash generate: {e}", file=sys.stderr)
        return 2
    with llm:
        opts = dict(dataclasses.asdict(params), stream=True)
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
