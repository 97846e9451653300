"""kvflash bench <name>: one module of kvflash_ggml.bench per benchmark (and `merge`), each with main()."""
from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

BENCHES = {
    "decode": "kvflash_ggml.bench.decode",
    "prefill": "kvflash_ggml.bench.prefill",
    "restore": "kvflash_ggml.bench.restore",
    "niah": "kvflash_ggml.bench.niah",
    "ruler": "kvflash_ggml.bench.ruler",
    "serve": "kvflash_ggml.bench.serve",
    "spec": "kvflash_ggml.bench.spec",
    "merge": "kvflash_ggml.bench.merge",
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHES:
        print(f"usage: kvflash bench {{{','.join(BENCHES)}}} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return importlib.import_module(BENCHES[argv[0]]).main(argv[1:])
