"""kvflash generate: complete a prompt, or answer it as one chat turn (--chat), streaming the text to stdout.
The KV cache is a pool of --kvflash tokens (auto by default) for a context of --n-ctx (the model's trained
context by default): what does not fit is paged out to host memory and back in when it matters."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Optional, Sequence

from ..known_models import resolve_model_path
from ..model import Model
from . import INTERRUPTED
from .flags import (add_budget_flag, add_chat_flags, add_model_flags, add_pool_flags, add_residency_flags,
                    add_sampling_flags, add_speculative_flags, model_keywords, resolve_model_flags, sampling_params)
from .gguf_facts import read_gguf_facts
from .llama_flags import add_llama_flags, chat_template_source, epilog, resolve_parsed, unescape, warn_llama_env
from .stats import Timing, json_stats, summary

# What a user can get wrong (a path, an option, a prompt): one line on stderr and exit code 2, no traceback.
# (A BrokenPipeError is an OSError too: it goes on up, where the command ends as a reader that left.)
USER_ERRORS = (ValueError, OSError, RuntimeError)
# Known short names of base models: they complete text and do not follow chat turns (their GGUFs may still
# carry a template, or libllama may have one of their family).
BASE_MODELS = {"gemma3-270m": "Gemma 3 270M (the PyPI package) is a base model"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvflash generate", description=__doc__, epilog=epilog("llama-cli"),
                                 allow_abbrev=False)
    add_model_flags(ap, llama=True)
    add_pool_flags(ap, pool="auto", n_ctx=0, llama=True)
    add_budget_flag(ap)
    add_residency_flags(ap)
    add_speculative_flags(ap, llama=True)
    add_sampling_flags(ap, llama=True)
    add_prompt_flags(ap)
    ap.add_argument("--stats", "--show-timings", action="store_true",
                    help="print a summary to stderr at the end: tok/s of the prompt and of decoding, memory by kind, "
                         "the pool and its paging")
    ap.add_argument("--json", action="store_true", help="the --stats figures as one JSON object (implies --stats)")
    add_llama_flags(ap, "llama-cli")
    return ap


def add_prompt_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--prompt", "-p", default=None, help="prompt text ('-' reads stdin)")
    ap.add_argument("-f", "--file", dest="prompt_file", default=None, metavar="FNAME",
                    help="read the prompt from a file")
    ap.add_argument("--chat", "-st", "--single-turn", dest="chat", action="store_true",
                    help="wrap the prompt as a user message in the chat template (-st: llama-cli's one chat turn)")
    ap.add_argument("-sys", "--system-prompt", default=None, metavar="TEXT",
                    help="a system message before the prompt (implies --chat)")
    ap.add_argument("-sysf", "--system-prompt-file", default=None, metavar="FNAME",
                    help="read the system message from a file (implies --chat)")
    add_chat_flags(ap)
    ap.add_argument("--stop", "-r", "--reverse-prompt", dest="stop", action="append", default=None, metavar="TEXT",
                    help="stop before this text (repeatable)")
    ap.add_argument("-e", "--escape", action="store_true",
                    help="turn \\n, \\r, \\t, \\', \\\", \\\\ and \\xHH in the prompt into the characters "
                         "(llama.cpp's -e)")
    ap.add_argument("--no-display-prompt", dest="display_prompt", action="store_false",
                    help="write only the generated text (a completion writes its prompt first by default)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    resolve_parsed(args, ap)
    warn_llama_env("generate")
    try:
        return run(args)
    except KeyboardInterrupt:   # Ctrl-C: the engine stops between forward steps, even inside a long prompt
        print(f"\nkvflash generate: {INTERRUPTED}", file=sys.stderr)
        return 130


def read_prompt(args: argparse.Namespace) -> tuple[str, Optional[str]]:
    """The prompt and the system message (None: none)."""
    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give the prompt with --prompt TEXT (-p; '-' reads stdin) or -f FILE, one of them")
    if args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompt = f.read()
    else:
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.system_prompt is not None and args.system_prompt_file is not None:
        raise ValueError("give -sys TEXT or -sysf FILE, not both")
    system = args.system_prompt
    if args.system_prompt_file is not None:
        with open(args.system_prompt_file, encoding="utf-8") as f:
            system = f.read()
    if args.escape:
        prompt, system = unescape(prompt), None if system is None else unescape(system)
    return prompt, system


def run(args: argparse.Namespace) -> int:
    try:
        prompt, system = read_prompt(args)
        template = chat_template_source(args.chat_template, args.chat_template_file)
        params = sampling_params(args)   # checked before any weight loads
        llm = load(args, template)
    except BrokenPipeError:
        raise
    except USER_ERRORS as e:
        print(f"kvflash generate: {e}", file=sys.stderr)
        return 2
    with llm:
        chat = args.chat or system is not None
        problem = chat_problem(args.model, llm, template) if chat else None
        if problem:
            print(f"kvflash generate: {problem}", file=sys.stderr)
            return 2
        try:
            timing = stream(llm, prompt, system, chat, params, args.display_prompt)
        except BrokenPipeError:
            raise
        except USER_ERRORS as e:
            print(f"\nkvflash generate: {e}", file=sys.stderr)
            return 2
        if args.stats or args.json:
            stats = llm.stats()
            text = json.dumps(json_stats(stats, timing)) if args.json else summary(stats, timing, args.kvflash)
            print(text, file=sys.stderr)
    return 0


def load(args: argparse.Namespace, template: Optional[str]) -> Model:
    """The model with the flags resolved against its GGUF (--n-ctx 0, -ngl N)."""
    path = resolve_model_path(args.model)
    resolve_model_flags(args, read_gguf_facts(path))
    return Model(path, chat_template=template, chat_special=args.parse_special_content, **model_keywords(args))


def chat_problem(name: str, llm: Model, template: Optional[str]) -> Optional[str]:
    """Why a chat with this model would not work (None: it may). A GGUF without a chat template is almost always
    a base model: its chat 'answer' is noise (Gemma 3 270M's was newlines), so that is an error unless a template
    is given; a known base model with a template gets a warning."""
    if template is None and not llm.tokenizer.chat_template:
        return ("--chat: this GGUF has no chat template (tokenizer.chat_template), which usually means a base model: "
                "it completes text but does not follow chat turns. Run without --chat, or give a template with "
                "--chat-template-file FILE")
    base = BASE_MODELS.get(str(name).lower())
    if base:
        print(f"kvflash generate: warning: {base}: it completes text and does not follow chat turns", file=sys.stderr)
    return None


def stream(llm: Model, prompt: str, system: Optional[str], chat: bool, params, display_prompt: bool) -> Timing:
    """Generate, writing the text to stdout as it comes; the prompt's and the decoding's times and token counts."""
    opts = dict(dataclasses.asdict(params), stream=True)
    t0 = time.perf_counter()
    if chat:
        messages = ([{"role": "system", "content": system}] if system is not None else []) + \
                   [{"role": "user", "content": prompt}]
        chunks = llm.create_chat_completion(messages, **opts)
    else:
        chunks = llm.create_completion(prompt, **opts)
        if display_prompt:
            sys.stdout.write(prompt)
            sys.stdout.flush()   # the prompt shows while it is computed
    timing = Timing()
    for chunk in chunks:
        if timing.t_first is None:
            timing.t_first = time.perf_counter() - t0   # the prompt and the first token
        choice = chunk["choices"][0]
        sys.stdout.write(choice["delta"].get("content", "") if chat else choice["text"])
        sys.stdout.flush()
        if "usage" in chunk:
            timing.n_prompt, timing.n_generated = chunk["usage"]["prompt_tokens"], chunk["usage"]["completion_tokens"]
    timing.t_total = time.perf_counter() - t0
    sys.stdout.write("\n")
    sys.stdout.flush()
    return timing


if __name__ == "__main__":
    sys.exit(main())
