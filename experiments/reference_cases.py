"""What the libllama-reference scripts share: generated retrieval cases and libllama on the same GGUF.
Imported by residency_reference_check.py and answer_margins.py (run from experiments/, so it is on sys.path)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import kvflash_ggml as kvf
from kvflash_ggml import _core
from kvflash_ggml.bench.retrieval import Case, tasks
from kvflash_ggml.bench.retrieval.cases import Renderer
from kvflash_ggml.known_models import resolve_model_path


def add_arguments(ap: argparse.ArgumentParser, *, task: str, n: int, cases: str = "all") -> None:
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--task", default=task)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--n", type=int, default=n, help="cases generated (as kvflash bench --cases)")
    ap.add_argument("--cases", default=cases, help="comma-separated case indices, or all")
    ap.add_argument("--format", default="chat", choices=["chat", "plain"])
    ap.add_argument("--threads", type=int, default=2)


@dataclass
class Reference:
    tokenizer: kvf.Tokenizer
    renderer: Renderer
    cases: list[Case]
    picked: list[int]              # the indices --cases chose
    llama: _core.testing.LlamaReference    # libllama, context --length


def load(args: argparse.Namespace) -> Reference:
    path = resolve_model_path(args.model)
    tok = kvf.Tokenizer(path)
    r = Renderer(tok, args.format)
    cases = tasks.generate(args.task, r, args.length, args.n, seed=0)
    picked = list(range(args.n)) if args.cases == "all" else [int(x) for x in args.cases.split(",")]
    return Reference(tok, r, cases, picked, _core.testing.LlamaReference(path, n_ctx=args.length, n_threads=args.threads))
