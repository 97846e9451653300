"""The flags every command that loads a model shares, defined once: model flags, pool flags (PoolConfig),
residency flags (ResidencyConfig) and sampling flags (SamplingParams), with the builders that turn parsed
flags into those dataclasses. A flag left at None takes the dataclass's own default, so defaults too are
declared once (in options.py).

The pool is `--kvflash` everywhere: one pool (N, 'auto' or 'off'), or, for the retrieval grids that run
several, a comma list of sizes (`--pools` is an alias there)."""
from __future__ import annotations

import argparse
import re
from typing import Optional, Union

from .. import _core
from ..engine_parts import POLICY_NAMES
from ..options import (AUTO_POOL_TOKENS, KV_TYPES, PREFILL_MODES, PROMPT_SCORES, DeviceConfig, PoolConfig,
                       ResidencyConfig, SamplingParams, SpeculativeConfig)
from .gguf_facts import GgufFacts
from .llama_flags import resolve_backend

def parse_pool(value: str) -> Union[None, int, str]:
    if value in ("off", "none", "full"):
        return None
    if value == "auto":
        return "auto"
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N, 'auto' or 'off', got {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"pool must be positive, got {n}")
    return n


SIZE_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
SIZE = re.compile(r"(\d+(?:\.\d+)?)([KMGT])(?:I?B)?|(\d+)B?")


def parse_bytes(value: str) -> int:
    """--max-device-memory 24G: a whole number of bytes, or a number with K, M, G or T (binary: 1K = 1024; 24GiB,
    24GB and 24g read as 24G); positive."""
    m = SIZE.fullmatch(value.strip().upper())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected bytes or a size such as 24G, 512M, 1.5T, got {value!r}")
    n = int(float(m.group(1)) * SIZE_SUFFIXES[m.group(2)]) if m.group(2) else int(m.group(3))
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size such as 24G, got {value!r}")
    return n


def parse_rpc(value: str) -> list[str]:
    """--rpc host:port[,host:port...]: each spelling checked here (reachability when the model loads)."""
    endpoints = [e.strip() for e in value.split(",") if e.strip()]
    if not endpoints:
        raise argparse.ArgumentTypeError("expected host:port[,host:port...]")
    for e in endpoints:
        try:
            _core.parse_rpc_endpoint(e)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return endpoints


def parse_devices(value: str) -> list[str]:
    """--devices cpu,cuda0,rpc:host:port: each spelling checked when the model loads."""
    devices = [d.strip() for d in value.split(",") if d.strip()]
    if not devices:
        raise argparse.ArgumentTypeError("expected a comma list such as rpc:10.0.0.2:50052,cpu")
    return devices


def parse_tensor_split(value: str) -> list[float]:
    """--tensor-split 3,1 (llama.cpp's spelling; '/' separates too): each device's share of the layers."""
    try:
        shares = [float(x) for x in value.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers such as 3,1, got {value!r}") from None
    if not shares or any(not (x >= 0) for x in shares):
        raise argparse.ArgumentTypeError(f"expected non-negative shares such as 3,1, got {value!r}")
    return shares


def add_model_flags(ap: argparse.ArgumentParser, *, threads: Optional[int] = None, llama: bool = False) -> None:
    """llama: also llama.cpp's spellings (-m, -t, -ts, -ngl; see llama_flags.py, which resolves -ngl)."""
    ap.add_argument("--model", *(["-m"] if llama else []), default="smollm2",
                    help="GGUF path or a known short name (default: smollm2)")
    ap.add_argument("--backend", default=None if llama else "auto", choices=["auto", "cpu", "cuda", "rpc"],
                    help="auto (the default): the RPC servers' devices, then this host's GPU if any, else the CPU; "
                         "rpc: the servers alone")
    ap.add_argument("--rpc", type=parse_rpc, default=None, metavar="HOST:PORT[,...]",
                    help="split the layers across the first device of each ggml-rpc-server (and this host's GPU, "
                         "as llama.cpp does). No authentication: trusted networks only (see docs/devices.md)")
    ap.add_argument("--devices", type=parse_devices, default=None, metavar="DEV[,...]",
                    help="the devices in layer order instead: cpu, cudaN, rpc:HOST:PORT")
    ap.add_argument("--tensor-split", *(["-ts"] if llama else []), type=parse_tensor_split, default=None,
                    metavar="N[,...]",
                    help="each device's share of the layers (llama.cpp's -ts; default: by free memory)")
    ap.add_argument("--threads", *(["-t"] if llama else []), type=int, default=threads,
                    help=f"CPU threads (default: {threads or 'all cores'})")
    if llama:
        ap.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="gpu_layers", default=None, metavar="N",
                        help="llama.cpp's layers on the GPU: 0 = --backend cpu; all, auto or at least the model's "
                             "layer count = --backend auto (every layer on the GPU if there is one); a part of the "
                             "layers is refused (no partial offload by count: --devices cpu,cuda0 --tensor-split A,B)")


def add_pool_flags(ap: argparse.ArgumentParser, *, pool: str = "off", n_ctx: Optional[int] = 4096,
                   several: bool = False, llama: bool = False) -> None:
    """pool: the --kvflash default; n_ctx None: the command sets the context itself (no --n-ctx), 0: the model's
    trained context by default (resolve_model_flags); several: --kvflash is a comma list of pool sizes (a grid), --pools
    its alias; llama: also llama.cpp's spellings (-c, -ub, -b, -fa, -ctk, -ctv; see llama_flags.py)."""
    if n_ctx is not None:
        ap.add_argument("--n-ctx", *(["-c", "--ctx-size"] if llama else []), type=int, default=n_ctx, metavar="N",
                        help=f"logical context in tokens; 0: the context the model was trained for (default: "
                             f"{n_ctx or 'the trained context'})")
    if several:
        ap.add_argument("--kvflash", "--pools", dest="pools", default=pool,
                        help=f"comma-separated KV pool sizes in tokens, one grid column each ('' = none; --pools "
                             f"is an alias; default {pool})")
    else:
        ap.add_argument("--kvflash", default=pool, type=parse_pool,
                        help=f"KV pool in tokens: N (a multiple of {_core.CHUNK_TOKENS}), 'auto' (on a GPU or a split "
                             f"what every device's free memory holds, else min(n_ctx, {AUTO_POOL_TOKENS}); within "
                             f"--max-device-memory where given), or 'off' for the full cache (default {pool})")
    ap.add_argument("--kv-type", default=None if llama else PoolConfig.kv_type, choices=list(KV_TYPES),
                    help=f"KV cache type (default {PoolConfig.kv_type})")
    ap.add_argument("--attention", default=None if llama else PoolConfig.attention, choices=["auto", "flash", "matmul"],
                    help=f"attention path (default {PoolConfig.attention})")
    if llama:
        ap.add_argument("--allow-beyond-train-ctx", action="store_const", const=True, default=None,
                        help="allow --n-ctx past the context the model was trained for (positions it never saw in "
                             "training; llama.cpp warns, kvflash refuses unless this is given)")
        ap.add_argument("-ctk", "--cache-type-k", dest="kv_type_k", default=None, metavar="TYPE",
                        help="llama.cpp's K cache type: kvflash keeps K and V in one type (--kv-type), so -ctk and "
                             "-ctv must be equal")
        ap.add_argument("-ctv", "--cache-type-v", dest="kv_type_v", default=None, metavar="TYPE",
                        help="llama.cpp's V cache type (see -ctk)")
        ap.add_argument("-fa", "--flash-attn", dest="flash_attn", default=None, metavar="on|off|auto",
                        help="llama.cpp's flash attention switch: on = --attention flash, off = matmul, auto = auto")
        ap.add_argument("--n-batch", "-ub", "--ubatch-size", dest="n_batch", type=int, default=None, metavar="N",
                        help=f"tokens per forward step of a prompt (default {PoolConfig.n_batch})")
        ap.add_argument("-b", "--batch-size", dest="llama_batch", type=int, default=None, metavar="N",
                        help="llama.cpp's logical batch (tokens handed to one llama_decode): accepted; kvflash hands "
                             "a prompt over whole and steps it by --n-batch (-ub)")


def add_budget_flag(ap: argparse.ArgumentParser) -> None:
    """--max-device-memory: PoolConfig.max_device_bytes; --max-host-memory: PoolConfig.max_host_bytes (generate,
    serve, bench decode)."""
    ap.add_argument("--max-device-memory", dest="max_device_memory", type=parse_bytes, default=None, metavar="SIZE",
                    help="cap each device's whole footprint (weights, pools, buffers, headroom; the CPU's too) at "
                         "SIZE (bytes, or 24G, 512M: K/M/G/T = 1024^n): --kvflash auto is sized within it, a pool "
                         "size given is refused if it does not fit (default: no cap)")
    ap.add_argument("--max-host-memory", dest="max_host_memory", type=parse_bytes, default=None, metavar="SIZE",
                    help="cap the K/V the pools send to host memory (at most an image per chunk of --n-ctx): a "
                         "context that could outgrow SIZE is refused at start (default: the memory the host has "
                         "available then)")


def add_residency_flags(ap: argparse.ArgumentParser, *, grid: bool = False) -> None:
    """grid: --policies, --prefill and --prefill-reselect name the variants a retrieval grid runs side by side."""
    if not grid:
        ap.add_argument("--policy", default=None, choices=POLICY_NAMES,
                        help=f"residency policy when --kvflash pools the KV (default {ResidencyConfig.policy})")
    ap.add_argument("--drafter-model", default=None,
                    help="GGUF path or short name of the smaller model that the drafter policy runs beside the "
                         "model (the model itself works too)")
    ap.add_argument("--tau", type=int, default=None,
                    help=f"decode tokens between reselects (default {ResidencyConfig.tau}; adaptive)")
    if grid:
        ap.add_argument("--prefill", default="default", choices=["default", *PREFILL_MODES, "both", "exact+sparse"],
                        help="prompt computation: the engine's default (auto: exact up to 64K tokens), layer-major "
                             "with full-cache K/V (exact), "
                             "layer-major with sparse attention (sparse, labelled +sparse: needs --attention flash), in "
                             "the pool (pooled, labelled +pooled), the default, both exact and pooled side by side, or "
                             "exact+sparse")
        ap.add_argument("--prefill-reselect", default="default", choices=["default", "on", "off", "both"],
                        help="query-aware prefill (reselect before each prefill batch) for policies that "
                             "reselect: the engine's default, on, off, or both side by side (labelled +pf)")
        return
    ap.add_argument("--prefill", default=None, choices=PREFILL_MODES,
                    help="compute a prompt larger than the pool layer-major, every K/V as a full cache writes it "
                         "(exact; device memory: the pool + one layer's K/V of the prompt), layer-major with each "
                         "block of queries attending a window, the sink and the chunks it scores highest (sparse: "
                         "about the same cost per token at any length; needs flash attention), sparse past "
                         "64K tokens of context with flash attention and exact below (auto, the default), or in the "
                         "pool (pooled: cheaper, but K/V written after their evidence was paged out never saw it)")
    ap.add_argument("--prompt-scores", default=None, choices=PROMPT_SCORES,
                    help="after an exact prefill, page in what the prompt's last tokens attended to (attention; "
                         "auto, the default, uses it) or what the policy scores (policy)")
    ap.add_argument("--prefill-reselect", action="store_const", const=True, default=None,
                    help="reselect before each prefill batch (query-aware prefill)")
    ap.add_argument("--refresh-tokens", type=int, default=None,
                    help="prompt tokens run again after the post-prompt reselect paged anything in (default "
                         f"{ResidencyConfig.refresh_tokens})")


def add_chat_flags(ap: argparse.ArgumentParser) -> None:
    """How a chat is rendered: the template, and whether its messages may write control tokens."""
    ap.add_argument("--chat-template", default=None, metavar="JINJA",
                    help="a Jinja chat template (its text, or a file) instead of the GGUF's own")
    ap.add_argument("--chat-template-file", default=None, metavar="FNAME", help="a Jinja chat template file")
    ap.add_argument("--parse-special-content", action="store_true",
                    help="parse control-token text in chat messages into the control tokens, as llama-server does "
                         "(a user can then write a turn of another role); by default a message's content is text, as "
                         "OpenAI's API reads it")


def add_speculative_flags(ap: argparse.ArgumentParser, *, llama: bool = False) -> None:
    """llama: llama-server's -md/--model-draft (the draft model) and --draft N / --draft-n N (its draft count)."""
    ap.add_argument("--draft", default=None,
                    help="speculative decoding: 'prompt_lookup' (n-gram lookup in the context), 'mtp' (the GGUF's own "
                         "multi-token-prediction layers), or a smaller GGUF of the same vocabulary (path or short name)"
                         + ("; a number N is llama-server's --draft N: --draft-max N" if llama else ""))
    ap.add_argument("--draft-max", *(["--draft-n"] if llama else []), type=int, default=None,
                    help=f"most tokens drafted per step (default {SpeculativeConfig.max_draft}; adapts to the acceptance)")
    if llama:
        ap.add_argument("-md", "--model-draft", "--spec-draft-model", dest="model_draft", default=None, metavar="FNAME",
                        help="llama-server's draft model: --draft FNAME")


def speculative_config(args: argparse.Namespace, **overrides: object) -> Optional[SpeculativeConfig]:
    draft, max_draft = args.draft, args.draft_max
    if hasattr(args, "model_draft"):   # llama.cpp's spellings: --draft N is a count, -md FNAME the draft model
        if draft is not None and draft.lstrip("-").isdigit():
            if max_draft is not None and max_draft != int(draft):
                raise ValueError(f"--draft {draft} and --draft-max {max_draft} give two draft counts")
            draft, max_draft = None, int(draft)
        if args.model_draft is not None:
            if draft is not None and draft != args.model_draft:
                raise ValueError(f"-md {args.model_draft} and --draft {draft} name two drafters")
            draft = args.model_draft
    if draft is None:
        return None
    return SpeculativeConfig(**{**given(draft=draft, max_draft=max_draft), **overrides})


def add_sampling_flags(ap: argparse.ArgumentParser, *, max_tokens: int = 64, llama: bool = False) -> None:
    """llama: also llama-cli's spellings (-n/--predict with -1 = no limit, --temperature, -s)."""
    no_limit = "; -1 or -2: until an end-of-generation token or a full context" if llama else ""
    ap.add_argument("--max-tokens", *(["-n", "--predict", "--n-predict"] if llama else []), type=int,
                    default=max_tokens, metavar="N", help=f"most tokens to generate (default {max_tokens}{no_limit})")
    ap.add_argument("--temp", *(["--temperature"] if llama else []), type=float, default=0.0,
                    help="temperature (0 = greedy, the default)")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--min-p", type=float, default=None)
    ap.add_argument("--seed", *(["-s"] if llama else []), type=int, default=None, help="-1 or none: a random seed")


def given(**options: object) -> dict:
    """The options a command was given (None: the dataclass's default)."""
    return {k: v for k, v in options.items() if v is not None}


def pool_config(args: argparse.Namespace, **overrides: object) -> PoolConfig:
    options = given(n_ctx=getattr(args, "n_ctx", None), kv_type=args.kv_type, attention=args.attention,
                    n_batch=getattr(args, "n_batch", None),
                    allow_beyond_train_ctx=getattr(args, "allow_beyond_train_ctx", None),
                    max_device_bytes=getattr(args, "max_device_memory", None),
                    max_host_bytes=getattr(args, "max_host_memory", None))
    if hasattr(args, "kvflash"):   # --kvflash off is None: the full cache, not the dataclass's default
        options["pool_tokens"] = args.kvflash
    return PoolConfig(**{**options, **overrides})


def residency_config(args: argparse.Namespace, **overrides: object) -> ResidencyConfig:
    options = given(policy=getattr(args, "policy", None), tau=args.tau, drafter_model=args.drafter_model,
                    prefill=getattr(args, "prefill", None), prefill_reselect=getattr(args, "prefill_reselect", None),
                    refresh_tokens=getattr(args, "refresh_tokens", None),
                    prompt_scores=getattr(args, "prompt_scores", None))
    return ResidencyConfig(**{**options, **overrides})


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    # -1 / -2 are llama.cpp's "no limit" / "until the context is full": both end at a full context here
    max_tokens = None if args.max_tokens in (-1, -2) else args.max_tokens
    return SamplingParams(**given(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                  seed=args.seed, stop=getattr(args, "stop", None) or None), max_tokens=max_tokens)


def device_config(args: argparse.Namespace) -> DeviceConfig:
    """Where the layers go and the CPU threads (--backend, --rpc, --devices, --tensor-split, --threads)."""
    return DeviceConfig(**given(backend=args.backend, rpc=getattr(args, "rpc", None),
                                devices=getattr(args, "devices", None),
                                tensor_split=getattr(args, "tensor_split", None), n_threads=args.threads))


def device_keywords(args: argparse.Namespace) -> dict:
    """_core.Model(...) keywords for where the layers go (DeviceConfig.placement)."""
    return device_config(args).placement()


def model_keywords(args: argparse.Namespace) -> dict:
    """Model(...) keywords for the parsed model, pool and residency flags (Model builds the dataclasses)."""
    return dict(given(n_ctx=args.n_ctx, kv_type=args.kv_type, attention=args.attention, **device_keywords(args),
                      n_batch=getattr(args, "n_batch", None),
                      allow_beyond_train_ctx=getattr(args, "allow_beyond_train_ctx", None),
                      n_threads=args.threads, policy=args.policy, tau=args.tau, drafter_model=args.drafter_model,
                      prefill=args.prefill, prefill_reselect=args.prefill_reselect,
                      refresh_tokens=args.refresh_tokens, prompt_scores=args.prompt_scores,
                      max_device_bytes=getattr(args, "max_device_memory", None),
                      max_host_bytes=getattr(args, "max_host_memory", None)),
                pool_tokens=args.kvflash, speculative=speculative_config(args))


def resolve_model_flags(args: argparse.Namespace, facts: GgufFacts) -> None:
    """The flags whose value depends on the model: --n-ctx 0 (llama.cpp's -c 0) is the trained context, and
    llama.cpp's -ngl N picks the backend (llama_flags.resolve_backend)."""
    if getattr(args, "n_ctx", None) is not None:
        if args.n_ctx < 0:
            raise ValueError(f"--n-ctx must be positive, or 0 for the model's trained context; got {args.n_ctx}")
        args.n_ctx = args.n_ctx or facts.n_ctx_train
    resolve_backend(args, facts.n_layer)
