"""`kvflash <command>` and `python -m kvflash_ggml <command>`: one module per command, each with main().

    generate  generate.py   complete a prompt
    serve     serve.py      the OpenAI-compatible server (kvflash_ggml/server/)
    convert   convert.py    a Hugging Face checkpoint to GGUF (also `python -m kvflash_ggml.convert`)
    bench     bench.py      benchmarks (one module of kvflash_ggml.bench each) and `bench merge`
    flags.py                the flags every command that loads a model shares, defined once
    llama_flags.py          llama.cpp's spellings of them (llama-server's and llama-cli's command lines)
    stats.py                the --stats summary of generate

Help goes to stdout with exit 0 (`--help`); a usage error (no command, an unknown one) to stderr with exit 2,
as argparse does for every command below."""
from __future__ import annotations

import importlib
import os
import signal
import sys
from typing import Optional, Sequence

from .bench import BENCHES

INTERRUPTED = "interrupted (Ctrl-C)"
# A reader that left (`kvflash generate ... | head`): end silently with the status a process killed by SIGPIPE
# shows in a shell (`seq 1e9 | head`: 141 in ${PIPESTATUS[0]}), as every Unix filter does.
BROKEN_PIPE_STATUS = 128 + signal.SIGPIPE
COMMANDS = {
    "generate": ("kvflash_ggml.commands.generate", "generate text from a prompt (or one chat turn)"),
    "serve": ("kvflash_ggml.commands.serve", "an OpenAI-compatible server: many conversations, each with its own pool"),
    "convert": ("kvflash_ggml.commands.convert", "convert a Hugging Face checkpoint to GGUF"),
    "bench": ("kvflash_ggml.commands.bench", f"benchmarks: {', '.join(BENCHES)} (kvflash bench --help)"),
}


def usage() -> str:
    lines = "\n".join(f"  {name:<10} {helptext}" for name, (_, helptext) in COMMANDS.items())
    return (f"usage: kvflash <command> [options]\n\ncommands:\n{lines}\n\n"
            f"`kvflash <command> --help` lists a command's options; generate and serve also take llama-cli's and "
            f"llama-server's spellings (-m, -c, -n, -np, -ngl, -fa, -ctk/-ctv, ...).")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv and argv[0] == "--version":
        from importlib.metadata import PackageNotFoundError, version
        try:
            print(f"kvflash {version('kvflash-ggml')}")
        except PackageNotFoundError:   # run from a source tree that was never installed
            print("kvflash (not installed)")
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        print(f"\nkvflash: {'unknown command ' + repr(argv[0]) if argv else 'a command is required'}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[argv[0]][0])
        return module.main(argv[1:])
    except KeyboardInterrupt:
        print(f"\nkvflash {argv[0]}: {INTERRUPTED}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return reader_left()


def reader_left() -> int:
    """stdout's reader left: nothing more can be written there, and Python would report the failed flush of what
    is still buffered at exit. Point stdout at /dev/null (the buffer goes nowhere) and say nothing."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):   # stdout already closed or replaced: nothing to flush
        pass
    return BROKEN_PIPE_STATUS
