"""Hugging Face checkpoint -> GGUF for the families this engine runs (Qwen3, Qwen2, Llama/Mistral).

`python -m kvflash_ggml.convert SRC_DIR OUT.gguf [--outtype f32|f16|bf16|q8_0] [--arch auto|qwen3|qwen2|llama]`
(also `kvflash convert ...`). The architecture and every hyperparameter come from the checkpoint itself
and are cross-checked against the tensor shapes; the tokenizer and chat template are embedded so that
libllama tokenizes as the Hugging Face tokenizer does.

    checkpoint.py  the source directory: config.json, lazily read safetensors (sharded or not)
    hparams.py     architecture detection, hyperparameters and their cross-checks, tensor names
    vocab.py       tokenizer.json / tokenizer_config.json -> tokenizer.ggml.* keys, chat template
    writer.py      output types, the GGUF itself (two passes: metadata, then one tensor at a time)
    pipeline.py    convert(): every check, then the writer

The command line is kvflash_ggml.commands.convert.
"""
from __future__ import annotations

from .errors import ConversionError
from .pipeline import convert

__all__ = ["convert", "ConversionError"]
