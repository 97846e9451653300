"""kvflash serve: an OpenAI-compatible HTTP server; every slot (--parallel) is a session with its own pool."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..engine import Engine
from ..server.scheduler import slot_engines
from ..known_models import resolve_model_path
from ..loading import load, load_for_slots
from ..mtp import wants_mtp
from ..snapshot import DEFAULT_PREFIX_CACHE_BYTES
from ..tokenizer import Tokenizer
from ..options import SamplingParams
from .flags import (add_budget_flag, add_chat_flags, add_model_flags, add_pool_flags, add_residency_flags,
                    add_speculative_flags, device_config, pool_config, resolve_model_flags, residency_config,
                    speculative_config)
from .gguf_facts import read_gguf_facts
from .generate import BASE_MODELS, USER_ERRORS
from .llama_flags import (SERVER_SAMPLING, Refuse, add_llama_flags, chat_template_source, epilog, read_api_key_file,
                          resolve_parsed, warn_llama_env)

log = logging.getLogger("kvflash_ggml.server")
DEFAULT_PREFIX_CACHE = "~/.cache/kvflash_ggml/prefix-cache"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvflash serve", description=__doc__, epilog=epilog("llama-server"),
                                 allow_abbrev=False)
    add_model_flags(ap, llama=True)
    add_pool_flags(ap, pool="auto", llama=True)
    add_budget_flag(ap)
    add_residency_flags(ap)
    add_speculative_flags(ap, llama=True)
    ap.add_argument("--parallel", "-np", type=int, default=4,
                    help="slots: conversations computed at once (default 4; -1: llama-server's auto, 4)")
    ap.add_argument("--queue", type=int, default=64,
                    help="requests that may wait for a free slot; more get HTTP 503 with Retry-After (default 64)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' (default: $KVFLASH_API_KEY, else none)")
    ap.add_argument("--api-key-file", default=None, metavar="FNAME", help="read the API key from a file (one key)")
    ap.add_argument("--alias", "-a", default=None,
                    help="the model's name in the API (default: the GGUF's file name stem)")
    add_chat_flags(ap)
    ap.add_argument("--prefix-cache", default=DEFAULT_PREFIX_CACHE,
                    help=f"folder of the on-disk prefix cache that slots store to when taken over and at shutdown, "
                         f"and resume conversations from ('off': none; default {DEFAULT_PREFIX_CACHE})")
    ap.add_argument("--prefix-cache-bytes", type=int, default=DEFAULT_PREFIX_CACHE_BYTES,
                    help=f"the prefix cache's cap in bytes (default {DEFAULT_PREFIX_CACHE_BYTES})")
    ap.add_argument("--slot-save-path", default=None, help="folder for POST /slots/ID?action=save|restore (default: off)")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    ap.add_argument("-v", "--verbose", "--log-verbose", dest="log_level", action="store_const", const="debug",
                    help="llama-server's verbose logs: --log-level debug")
    ap.add_argument("--log-disable", dest="log_level", action="store_const", const="error",
                    help="llama-server's quiet logs: --log-level error")
    add_server_sampling_flags(ap)
    add_llama_flags(ap, "llama-server")
    return ap


def add_server_sampling_flags(ap: argparse.ArgumentParser) -> None:
    """llama-server's server-wide sampling defaults: a request here takes its own (OpenAI's fields), and one
    that gives none gets SamplingParams' defaults, which are llama-server's. So these are accepted at those
    values (and -n at -1, no server-wide limit), and refused at any other."""
    p = SamplingParams
    for names, value, what in (("--temp --temperature", p.temperature, f"temperature {p.temperature}"),
                               ("--top-k", p.top_k, f"top_k {p.top_k}"), ("--top-p", p.top_p, f"top_p {p.top_p}"),
                               ("--min-p", p.min_p, f"min_p {p.min_p}"), ("-s --seed", -1, "a random seed"),
                               ("-n --predict --n-predict", -1,
                                "OpenAI's max_tokens default (completions) or no limit (chats)")):
        ap.add_argument(*names.split(), action=Refuse, tool="llama-server", neutral=float(value),
                        instead=f"{SERVER_SAMPLING}; a request that gives none gets {what}")


def build_engines(args: argparse.Namespace) -> tuple[list[Engine], str, str]:
    """The slots' engines over one copy of the weights (and of a drafter's), the model's name in the API, and
    why the pool has its size."""
    if args.parallel == -1:   # llama-server's auto: 4 slots
        args.parallel = 4
    if args.parallel < 1:
        raise ValueError(f"--parallel must be at least 1 (or -1: 4), got {args.parallel}")
    path = resolve_model_path(args.model)
    if args.n_ctx == 0 or args.gpu_layers is not None:
        resolve_model_flags(args, read_gguf_facts(path))
    pool, residency, devices = pool_config(args), residency_config(args), device_config(args)   # before any weight loads
    speculative = speculative_config(args)
    template = chat_template_source(args.chat_template, args.chat_template_file)
    loaded = load(path, devices, mtp=wants_mtp(speculative), chat_special=args.parse_special_content)
    warn_chat(args.model, loaded.tokenizer, template)
    given = "off" if pool.pool_tokens is None else pool.pool_tokens
    # the drafter's and a draft model's weights once for all slots; 'auto' sized for --parallel sessions
    slots = load_for_slots(loaded.model, pool, args.parallel, residency=residency, speculative=speculative)
    why = f"--kvflash {given}: {slots.why}"
    cache = None if args.prefix_cache in ("off", "none", "") else args.prefix_cache
    engines = slot_engines(args.parallel, loaded.model, loaded.tokenizer, slots.pool, slots.residency,
                           prefix_cache_dir=cache, prefix_cache_bytes=args.prefix_cache_bytes, chat_template=template,
                           store_each_turn=False, speculative=slots.speculative)
    return engines, args.alias or Path(path).stem, why


def api_key(args: argparse.Namespace) -> Optional[str]:
    if args.api_key is not None and args.api_key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        return read_api_key_file(args.api_key_file)
    return args.api_key if args.api_key is not None else os.environ.get("KVFLASH_API_KEY")


def warn_chat(name: str, tokenizer: Tokenizer, template: Optional[str]) -> None:
    """/v1/chat/completions on a model without a chat template, or on a known base model, answers noise: say so
    at startup (completions are fine)."""
    if template is None and not tokenizer.chat_template:
        fallback = getattr(tokenizer, "builtin_template", None)
        log.warning("the GGUF has no chat template (tokenizer.chat_template), which usually means a base model: "
                    "/v1/chat/completions %s; give one with --chat-template-file FILE",
                    f"renders chats with libllama's built-in {fallback!r} template" if fallback else "answers 400")
    if str(name).lower() in BASE_MODELS:
        log.warning("%s: it completes text and does not follow chat turns", BASE_MODELS[str(name).lower()])


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    resolve_parsed(args, ap)
    warn_llama_env("serve")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvicorn

        from ..server.app import ServerState, create_app
        from ..server.scheduler import Scheduler
    except ImportError as e:
        print(f"kvflash serve: {e}; install the server's libraries with: pip install 'kvflash-ggml[server]'",
              file=sys.stderr)
        return 2
    try:
        if args.queue < 0:
            raise ValueError(f"--queue must be >= 0, got {args.queue}")
        args.api_key = api_key(args)
        slot_dir = Path(args.slot_save_path).expanduser() if args.slot_save_path else None
        if slot_dir is not None:
            slot_dir.mkdir(mode=0o700, parents=True, exist_ok=True)   # slot files hold conversations
        engines, name, why = build_engines(args)
    except USER_ERRORS as e:
        print(f"kvflash serve: {e}", file=sys.stderr)
        return 2
    log.info("%s: %d slots; pool %s", name, len(engines), why)
    state = ServerState(scheduler=Scheduler(engines, max_queue=args.queue), model_name=name, api_key=args.api_key,
                        slot_save_path=slot_dir)
    uvicorn.run(create_app(state), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
