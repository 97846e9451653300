"""`kvflash convert SRC_DIR OUT.gguf` and `python -m kvflash_ggml.convert SRC_DIR OUT.gguf`."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..convert.errors import ConversionError
from ..convert.hparams import FAMILIES
from ..convert.pipeline import convert
from ..convert.writer import OUTTYPES


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvflash convert",
        description="Convert a Hugging Face checkpoint (config.json, safetensors, tokenizer.json) to a GGUF "
                    "file that both kvflash-ggml and llama.cpp load.")
    ap.add_argument("src", metavar="SRC_DIR", help="checkpoint directory")
    ap.add_argument("out", metavar="OUT.gguf", help="output file")
    ap.add_argument("--outtype", default="f16", choices=list(OUTTYPES),
                    help="type of the weight matrices (norms and biases stay f32; default f16)")
    ap.add_argument("--arch", default="auto", choices=["auto", *FAMILIES],
                    help="architecture (default: from config.json; only needed for an unlisted model_type)")
    ap.add_argument("--force", action="store_true", help="overwrite OUT.gguf if it exists")
    ap.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.quiet:   # our own messages only: the gguf package's INFO logs are noise here
        ours = logging.getLogger("kvflash_ggml.convert")
        ours.setLevel(logging.INFO)
        ours.addHandler(logging.StreamHandler())
    try:
        hp = convert(args.src, args.out, outtype=args.outtype, arch=args.arch, force=args.force,
                     progress=not args.quiet)
    except ConversionError as e:
        print(f"kvflash convert: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:   # the partial output is already removed
        print("\nkvflash convert: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    if not args.quiet:
        size = Path(args.out).stat().st_size
        print(f"wrote {args.out} ({hp.arch}, {args.outtype}, {size / 2**20:.1f} MiB)", file=sys.stderr)
    return 0
