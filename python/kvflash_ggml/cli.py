"""`kvflash <command>` and `python -m kvflash_ggml <command>`: one module per command, each with main()."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional, Sequence, Union

INTERRUPTED = "interrupted (Ctrl-C)"
COMMANDS = {
    "generate": ("kvflash_ggml.generate", "generate text from a prompt"),
    "convert": ("kvflash_ggml.convert", "convert a Hugging Face checkpoint to GGUF"),
    "bench": ("kvflash_ggml.bench.command", "benchmarks: decode (tok/s vs depth), niah and ruler (recall vs residency)"),
}


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """Flags every command that loads a model shares (so they are spelled once)."""
    ap.add_argument("--model", default="smollm2", help="GGUF path or a known short name (default: smollm2)")
    ap.add_argument("--n-ctx", type=int, default=4096, help="logical context in tokens (default 4096)")
    ap.add_argument("--kvflash", default="off", type=parse_pool,
                    help="KV pool in tokens: N (a multiple of 64), 'auto', or 'off' for full cache (default off)")
    ap.add_argument("--kv-type", default="f16", choices=["f16", "q8_0", "q4_0"], help="KV cache type")
    ap.add_argument("--attention", default="auto", choices=["auto", "flash", "matmul"], help="attention path")
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")


def parse_pool(value: str) -> Union[None, int, str]:
    if value in ("off", "none", "full"):
        return None
    if value == "auto":
        return "auto"
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N, 'auto' or 'off', got {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"pool must be positive, got {n}")
    return n


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = "\n".join(f"  {name:<10} {helptext}" for name, (_, helptext) in COMMANDS.items())
        print(f"usage: kvflash <command> [options]\n\ncommands:\n{lines}", file=sys.stderr if argv else sys.stdout)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nkvflash: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    try:
        module = importlib.import_module(COMMANDS[argv[0]][0])
        return module.main(argv[1:])
    except KeyboardInterrupt:
        print(f"\nkvflash {argv[0]}: {INTERRUPTED}", file=sys.stderr)
        return 130
    except BrokenPipeError:   # `kvflash generate ... | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
