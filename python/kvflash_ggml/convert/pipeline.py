"""convert(): a checkpoint directory to a GGUF file, every input checked before the first byte is written
(the command line is kvflash_ggml.commands.convert)."""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Iterator

from .checkpoint import Checkpoint
from .errors import ConversionError, require_gguf
from .hparams import HParams, check_tensor_set, read_hparams
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
