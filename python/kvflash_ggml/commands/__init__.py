"""`kvflash <command>` and `python -m kvflash_ggml <command>`: one module per command, each with main().

    generate  generate.py   complete a prompt
    serve     serve.py      the OpenAI-compatible server (kvflash_ggml/server/)
    convert   convert.py    a Hugging Face checkpoint to GGUF (also `python -m kvflash_ggml.convert`)
    bench     bench.py      benchmarks (decode, restore, niah, ruler) and `bench merge`
    flags.py                the flags every command that loads a model shares, defined once
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Optional, Sequence

INTERRUPTED = "interrupted (Ctrl-C)"
COMMANDS = {
    "generate": ("kvflash_ggml.commands.generate", "generate text from a prompt"),
    "serve": ("kvflash_ggml.commands.serve", "an OpenAI-compatible server: many conversations, each with its own pool"),
    "convert": ("kvflash_ggml.commands.convert", "convert a Hugging Face checkpoint to GGUF"),
    "bench": ("kvflash_ggml.commands.bench", "benchmarks: decode (tok/s vs depth), restore, niah and ruler (recall "
                                             "vs residency); merge reports"),
}


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
