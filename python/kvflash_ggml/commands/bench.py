"""kvflash bench <name>: one module of kvflash_ggml.bench per benchmark (and `merge`), each with main()."""
from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

# name -> (module, what it measures): the one list `kvflash --help` and `kvflash bench --help` print
BENCHES = {
    "decode": ("kvflash_ggml.bench.decode", "decode tok/s vs context depth, full cache and pooled, beside llama-bench"),
    "prefill": ("kvflash_ggml.bench.prefill", "prompt tok/s and device memory vs prompt length, beside llama-bench"),
    "restore": ("kvflash_ggml.bench.restore", "restoring a snapshot vs computing the prompt again"),
    "niah": ("kvflash_ggml.bench.niah", "needle-in-a-haystack recall vs residency (pool size, policy)"),
    "ruler": ("kvflash_ggml.bench.ruler", "RULER-style recall vs residency (multi-key, multi-value, variable "
                                          "tracking)"),
    "serve": ("kvflash_ggml.bench.serve", "the server under load (streams, soak), beside llama-server"),
    "spec": ("kvflash_ggml.bench.spec", "speculative decoding vs plain decoding: tok/s and acceptance"),
    "merge": ("kvflash_ggml.bench.merge", "merge the JSON reports of niah / ruler runs into one table"),
}


def usage() -> str:
    lines = "\n".join(f"  {name:<9} {helptext}" for name, (_, helptext) in BENCHES.items())
    return (f"usage: kvflash bench <name> [options]\n\nbenchmarks:\n{lines}\n\n"
            f"`kvflash bench <name> --help` lists its options.")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in BENCHES:
        print(usage(), file=sys.stderr)
        print(f"\nkvflash bench: {'unknown benchmark ' + repr(argv[0]) if argv else 'a benchmark name is required'}",
              file=sys.stderr)
        return 2
    return importlib.import_module(BENCHES[argv[0]][0]).main(argv[1:])
