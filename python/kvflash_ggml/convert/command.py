"""`python -m kvflash_ggml.convert SRC_DIR OUT.gguf` / `kvflash convert`, and the convert() it runs."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

from .checkpoint import Checkpoint
from .errors import ConversionError, require_gguf
from .hparams import FAMILIES, HParams, check_tensor_set, read_hparams
from .vocab import read_vocab
from .writer import OUTTYPES, check_output, plan_tensors, write_gguf

log = logging.getLogger(__name__)


def convert(src: os.PathLike | str, out: os.PathLike | str, *, outtype: str = "f16", arch: str = "auto",
            force: bool = False, progress: bool = False) -> HParams:
    """Converts the checkpoint directory `src` to the GGUF file `out`; returns the hyperparameters written.

    Everything is checked (output path, files, architecture, hyperparameters against shapes, tensor
    names, tokenizer) before the first byte is written; non-finite weights are found while writing,
    and then no output is left behind. Raises ConversionError with a message naming the problem."""
    if outtype not in OUTTYPES:
        raise ConversionError(f"unknown outtype {outtype!r} (supported: {', '.join(OUTTYPES)})")
    out = Path(out)
    require_gguf()
    check_output(out, force)
    with reading("the checkpoint's files (config.json, safetensors headers)", src):
        ckpt = Checkpoint(src)
    with reading("config.json", src):
        hp = read_hparams(ckpt, arch)
        pairs = check_tensor_set(ckpt, hp)
    with reading("the tokenizer (tokenizer.json, tokenizer_config.json)", src):
        vocab = read_vocab(ckpt, hp.n_vocab)
    plans = plan_tensors(ckpt, hp, pairs, outtype)
    log.info("converting %s: %s, %d layers, n_embd %d, heads %d/%d x %d, n_ff %d, vocab %d (pre %s), %s",
             ckpt.src, hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff, hp.n_vocab,
             vocab.pre, outtype)
    write_gguf(out, hp, vocab, plans, outtype, progress=progress)
    return hp


@contextlib.contextmanager
def reading(what: str, src: os.PathLike | str) -> Iterator[None]:
    """Every field of a checkpoint is untrusted input: a value of the wrong JSON type or a file that cannot
    be read ends as a ConversionError naming what was being read, not a traceback from deep inside."""
    try:
        yield
    except ConversionError:
        raise
    except OSError as e:
        raise ConversionError(f"cannot read {what} in {src}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise ConversionError(f"malformed {what} in {src}: {type(e).__name__}: {e}") from None


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
