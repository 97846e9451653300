"""llama.cpp's command lines on `kvflash serve` (llama-server's) and `kvflash generate` (llama-cli's).

A script that starts llama-server runs unchanged with `kvflash serve` in its place: every llama.cpp spelling
kvflash has a meaning for is an alias of its own flag (flags.py adds them with llama=True), or is resolved
here (-ngl, -fa, -ctk/-ctv, -c 0, -np -1, --chat-template TEXT); a flag that asks for what kvflash always does
is accepted (--jinja, -cb, --metrics, ...); any other llama.cpp flag is refused by name, with what to use
instead. Nothing is ignored silently. The spellings are those of common/arg.cpp in the pinned tree (0c1e570),
plus a few older ones scripts still carry (--mlock, --no-mmap).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

from .. import _core
from ..options import KV_TYPES

SAMPLING = ("kvflash samples with a temperature, top-k, top-p, min-p and a seed (generate's --temp, --top-k, --top-p, "
            "--min-p, --seed; a server request's fields)")
SERVER_SAMPLING = ("kvflash serve takes sampling per request (temperature, top_p, top_k, min_p, seed, max_tokens in "
                   "the request body)")
LOGS = "kvflash serve logs at --log-level debug|info|warning|error, to stderr"

# (llama.cpp spellings, what to use instead): refused on both commands, each flag by its own name.
REFUSED = (
    ("-hf -hfr --hf-repo -hff --hf-file -hft --hf-token -mu --model-url -dr --docker-repo --offline -cl --cache-list "
     "-hfd -hfrd --hf-repo-draft --spec-draft-hf", "kvflash downloads nothing: fetch the GGUF file, then -m PATH"),
    ("-C --cpu-mask -Cr --cpu-range --cpu-strict --prio --poll -Cb --cpu-mask-batch -Crb --cpu-range-batch "
     "--cpu-strict-batch --prio-batch --poll-batch --numa -tb --threads-batch", "kvflash takes one thread count: -t N"),
    ("--samplers --sampler-seq --sampling-seq --top-nsigma --top-n-sigma --xtc-threshold --repeat-last-n "
     "--dry-base --dry-allowed-length --dry-penalty-last-n --dry-sequence-breaker --adaptive-target --adaptive-decay "
     "--dynatemp-range --dynatemp-exp --mirostat-lr --mirostat-ent -l --logit-bias --ignore-eos -bs "
     "--backend-sampling", SAMPLING),
    ("--grammar --grammar-file -j --json-schema -jf --json-schema-file", "kvflash has no constrained decoding"),
    ("--rope-scaling --rope-scale --rope-freq-base --rope-freq-scale --yarn-orig-ctx --yarn-ext-factor "
     "--yarn-attn-factor --yarn-beta-slow --yarn-beta-fast --override-kv",
     "kvflash takes RoPE and every other setting from the GGUF's metadata (convert the file to change them)"),
    ("-mm --mmproj -mmu --mmproj-url --mmproj-auto --no-mmproj --no-mmproj-auto --mmproj-offload --no-mmproj-offload "
     "-mmdev --mmproj-device --image-min-tokens --image-max-tokens --mtmd-batch-max-tokens --video-fps "
     "--video-timestamp-interval --video-ffmpeg-dir --image --audio --video --media-path",
     "kvflash runs text models only"),
    ("--lora --lora-scaled --lora-init-without-apply --control-vector --control-vector-scaled "
     "--control-vector-layer-range", "kvflash loads no adapters: merge them into the GGUF first"),
    ("--embedding --embeddings --rerank --reranking --pooling --embd-normalize --embd-gemma-default",
     "kvflash serves completions and chats, no embeddings"),
    ("-lm --load-mode -lzm --lazy-mode --mlock --no-mmap --mmap --check-tensors --repack -nr --no-repack --no-host "
     "--op-offload --no-op-offload -ot --override-tensor -cmoe --cpu-moe -ncmoe --n-cpu-moe -ncffn --n-cpu-ffn",
     "kvflash loads every weight into its device's memory; --devices and --tensor-split place layers"),
    ("-fit --fit -fitt --fit-target -fitc --fit-ctx", "kvflash fits the KV pool to free memory with --kvflash auto"),
    ("-dev --device", "name the devices in layer order with --devices cpu,cuda0,rpc:HOST:PORT"),
    ("-mg --main-gpu", "kvflash uses the first GPU; --devices cudaN picks another"),
    ("-nkvo --no-kv-offload", "the KV pool lives on the model's device and what is paged out in host memory; "
                              "-ngl 0 keeps everything on the CPU"),
    ("--swa-full -ctxcp --ctx-checkpoints --swa-checkpoints -cms --checkpoint-min-step -cram --cache-ram "
     "--cache-reuse --kv-unified-per-slot -kvu --kv-unified -no-kvu --no-kv-unified --cache-idle-slots "
     "--no-cache-idle-slots --keep -dt --defrag-thold --context-shift -sps --slot-prompt-similarity "
     "-gan --grp-attn-n -gaw --grp-attn-w --prompt-cache --prompt-cache-all --prompt-cache-ro",
     "kvflash manages each slot's context with its own pool (--kvflash, --n-ctx per slot) and the on-disk prefix "
     "cache (kvflash serve --prefix-cache)"),
    ("--no-cache-prompt", "kvflash always continues a slot from the prefix it holds; --prefix-cache off turns the "
                          "on-disk cache off"),
    ("--draft-min --draft-n-min --spec-draft-n-min --spec-draft-n-max --spec-draft-p-min --draft-p-min "
     "--spec-draft-p-split --draft-p-split --spec-type --spec-default --spec-synth-len --spec-synth-rates "
     "-td --threads-draft --spec-draft-threads -tbd --threads-batch-draft --spec-draft-threads-batch "
     "-ctkd --cache-type-k-draft --spec-draft-type-k -ctvd --cache-type-v-draft --spec-draft-type-v "
     "-ngld --gpu-layers-draft --n-gpu-layers-draft --spec-draft-ngl -devd --device-draft --spec-draft-device "
     "-lcs --lookup-cache-static -lcd --lookup-cache-dynamic --spec-draft-cpu-mask -Cd --cpu-mask-draft "
     "--spec-draft-cpu-range -Crd --cpu-range-draft --spec-draft-cpu-strict --cpu-strict-draft --spec-draft-prio "
     "--prio-draft --spec-draft-poll --poll-draft --spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft "
     "--spec-draft-cpu-strict-batch --cpu-strict-batch-draft --spec-draft-prio-batch --prio-batch-draft "
     "--spec-draft-poll-batch --poll-batch-draft --spec-draft-override-tensor -otd --override-tensor-draft "
     "--spec-draft-cpu-moe -cmoed --cpu-moe-draft --spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft "
     "--spec-draft-backend-sampling --no-spec-draft-backend-sampling --spec-ngram-mod-n-min --spec-ngram-mod-n-max "
     "--spec-ngram-mod-n-match --spec-ngram-simple-size-n --spec-ngram-simple-size-m --spec-ngram-simple-min-hits "
     "--spec-ngram-map-k-size-n --spec-ngram-map-k-size-m --spec-ngram-map-k-min-hits --spec-ngram-map-k4v-size-n "
     "--spec-ngram-map-k4v-size-m --spec-ngram-map-k4v-min-hits --spec-ngram-size-n --spec-ngram-size-m "
     "--spec-ngram-min-hits",
     "speculative decoding takes --draft prompt_lookup|mtp|PATH (prompt lookup is its n-gram drafter) and "
     "--draft-max N"),
    ("-e --escape -r --reverse-prompt", "kvflash serve takes stop strings per request (stop)"),
    ("-np --parallel", "kvflash generate answers one prompt; kvflash serve --parallel N serves N at once"),
    ("--log-disable -v --verbose --log-verbose", "kvflash generate writes only its errors and warnings to stderr"),
    ("--reasoning-format -rea --reasoning --reasoning-effort --reasoning-budget --reasoning-budget-message "
     "--reasoning-preserve --no-reasoning-preserve --chat-template-kwargs --skip-chat-parsing "
     "--no-skip-chat-parsing --prefill-assistant --no-prefill-assistant --tools --tools-runtime "
     "--mcp-servers-config --mcp-servers-json -ag --agent -no-ag --no-agent --spm-infill",
     "kvflash renders the chat template as given and returns the text as generated"),
    ("--fim-qwen-1.5b-default --fim-qwen-3b-default --fim-qwen-7b-default --fim-qwen-7b-spec --fim-qwen-14b-spec "
     "--fim-qwen-30b-default --gpt-oss-20b-default --gpt-oss-120b-default --vision-gemma-4b-default "
     "--vision-gemma-12b-default", "these presets download models: fetch the GGUF, then -m PATH"),
    ("--ssl-key-file --ssl-cert-file", "put a TLS-terminating reverse proxy in front of kvflash serve"),
    ("--path --api-prefix --cors-origins --cors-methods --cors-headers --cors-credentials --no-cors-credentials "
     "--ui --webui --ui-config --webui-config --ui-config-file --webui-config-file --ui-mcp-proxy --webui-mcp-proxy "
     "--no-ui-mcp-proxy --no-webui-mcp-proxy --models-dir --models-preset --models-max --models-autoload "
     "--no-models-autoload --tags --reuse-port -to --timeout --sse-ping-interval --threads-http "
     "--sleep-idle-seconds --no-slots --props --server-base --no-jinja -nocb --no-cont-batching",
     "kvflash serve serves one model at the OpenAI endpoints (/v1/*), /health, /metrics, /slots, /tokenize and "
     "/detokenize, on one event loop, without a web UI"),
    ("--log-file --log-colors --log-prefix --no-log-prefix --log-timestamps --no-log-timestamps --log-jsonl "
     "--no-log-jsonl --log-prompts-dir -lv --verbosity --log-verbosity", LOGS),
    ("-cnv --conversation -i --interactive -if --interactive-first -mli --multiline-input --in-prefix "
     "--in-prefix-bos --in-suffix", "kvflash generate answers one prompt (--chat or -st: one chat turn); kvflash "
                                    "serve holds conversations"),
    ("--verbose-prompt -ptc --print-token-count -sp --special --perf -bf --binary-file -o --output --output-file",
     "kvflash generate writes the prompt and the generated text to stdout, and with --stats its timings and memory"),
    ("--warmup", "kvflash runs no warm-up step"),
    ("--usage --completion-bash", "kvflash <command> --help lists the options"),
    ("--list-devices", "python -c \"import kvflash_ggml; print(kvflash_ggml._core.gpu_devices())\" lists the GPUs"),
)

# llama.cpp flags with a value, accepted at the one value that asks for what kvflash does anyway
# (flag spellings, that value, what to use instead of any other value).
NEUTRAL = (
    ("--repeat-penalty", 1.0, SAMPLING), ("--presence-penalty", 0.0, SAMPLING), ("--frequency-penalty", 0.0, SAMPLING),
    ("--mirostat", 0.0, SAMPLING), ("--typical --typical-p", 1.0, SAMPLING), ("--xtc-probability", 0.0, SAMPLING),
    ("--dry-multiplier", 0.0, SAMPLING), ("-sm --split-mode", "layer", "kvflash splits a model by layers only"),
    ("-co --color", "off", "kvflash prints plain text"),
)

# llama.cpp switches that ask for what kvflash always does: accepted.
ALWAYS = ("--jinja -cb --cont-batching --metrics --slots --no-webui --no-ui --cache-prompt -kvo --kv-offload "
          "--no-context-shift -no-cnv --no-conversation --no-warmup --no-perf --simple-io --no-show-timings "
          "--display-prompt --no-escape -st --single-turn").split()


class Refuse(argparse.Action):
    """A llama.cpp flag kvflash has no meaning for: an error naming it, with what to use instead."""

    def __init__(self, option_strings, dest, *, tool: str, instead: str, neutral=None, **kw) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?" if neutral is None else None,
                         default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kw)
        self.tool, self.instead, self.neutral = tool, instead, neutral

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if self.neutral is not None and is_value(values, self.neutral):
            return
        given = option_string if values is None else f"{option_string} {values}"
        parser.error(f"{given} ({self.tool}'s) is not supported: {self.instead}")


class Accept(argparse.Action):
    """A llama.cpp switch that asks for what kvflash always does."""

    def __init__(self, option_strings, dest, **kw) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        pass


def is_value(given: str, neutral) -> bool:
    if isinstance(neutral, str):
        return given == neutral
    try:
        return float(given) == neutral
    except ValueError:
        return False


def add_llama_flags(ap: argparse.ArgumentParser, tool: str) -> None:
    """Register llama.cpp's other flags on a command whose own flags (llama=True) are already added: the
    switches that ask for what kvflash does are accepted, the rest refused by name. A spelling the command
    already takes keeps its own meaning."""
    taken = set(ap._option_string_actions)   # argparse keeps no public list of the spellings it knows

    def free(spellings: str) -> list[str]:
        return [s for s in spellings.split() if s not in taken]

    for spellings, instead in REFUSED:
        for flag in free(spellings):   # one action per flag: -ctkd and --cache-type-k-draft are both named
            ap.add_argument(flag, action=Refuse, tool=tool, instead=instead)
    for spellings, value, instead in NEUTRAL:
        if names := free(spellings):
            ap.add_argument(*names, action=Refuse, tool=tool, instead=instead, neutral=value)
    for flag in ALWAYS:
        if flag not in taken:
            ap.add_argument(flag, action=Accept)


def epilog(tool: str) -> str:
    own = "-np, -a, --api-key-file" if tool == "llama-server" else "-p, -f, -sys, -r, -e"
    return (f"{tool}'s spellings work too (-m, -c/--ctx-size, -n, -t, -ngl, -fa, -ctk/-ctv, -ub, -s, --temperature, "
            f"--chat-template-file, {own}, ...); "
            f"{tool}'s switches that ask for what kvflash does anyway (--jinja, -cb, --metrics, ...) are accepted, and "
            f"its other flags are refused by name with what to use instead.")


# -- resolving the flags whose meaning differs -----------------------------------------------------------------

def resolve_parsed(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """What can be checked before the model is read: -fa, -ctk/-ctv, -ngl's spelling. Errors exit 2 naming the flag."""
    fa = getattr(args, "flash_attn", None)
    if fa is not None:
        attention = {"on": "flash", "enabled": "flash", "true": "flash", "1": "flash", "off": "matmul",
                     "disabled": "matmul", "false": "matmul", "0": "matmul", "auto": "auto", "-1": "auto"}.get(fa)
        if attention is None:
            ap.error(f"-fa/--flash-attn takes on, off or auto, got {fa!r}")
        if args.attention is not None and args.attention != attention:
            ap.error(f"-fa {fa} (--attention {attention}) contradicts --attention {args.attention}")
        args.attention = attention
    k, v = getattr(args, "kv_type_k", None), getattr(args, "kv_type_v", None)
    if k is not None or v is not None:   # llama.cpp's default for the one not given is f16
        k, v = k or "f16", v or "f16"
        if k != v or k not in KV_TYPES:
            ap.error(f"-ctk {k} -ctv {v}: kvflash keeps K and V in one type, one of {', '.join(KV_TYPES)} "
                     f"(--kv-type); give -ctk and -ctv that type")
        if args.kv_type is not None and args.kv_type != k:
            ap.error(f"-ctk/-ctv {k} contradicts --kv-type {args.kv_type}")
        args.kv_type = k
    ngl = getattr(args, "gpu_layers", None)
    if ngl is not None and ngl not in ("auto", "all"):
        try:
            int(ngl)
        except ValueError:
            ap.error(f"-ngl/--gpu-layers takes a number, 'auto' or 'all', got {ngl!r}")
    if getattr(args, "llama_batch", None) is not None and args.llama_batch < 1:
        ap.error(f"-b/--batch-size must be positive, got {args.llama_batch}")


def resolve_backend(args: argparse.Namespace, n_layer: int) -> None:
    """-ngl N: 0 = the CPU; all, auto, -1 or N >= the model's layer count = every layer where --backend auto puts
    it (the GPU if there is one). Between the two llama.cpp would put the last N layers on the GPU and the rest
    on the CPU: kvflash has no offload by layer count, so that is refused with the split that does it."""
    ngl = getattr(args, "gpu_layers", None)
    if ngl is None:
        return
    n = {"all": n_layer + 1, "auto": -1}.get(ngl, None)
    n = int(ngl) if n is None else n
    backend = "cpu" if n == 0 else "auto" if n < 0 or n >= n_layer else None
    if backend is None:
        raise ValueError(f"-ngl {ngl}: kvflash has no partial offload by layer count (this model has {n_layer} "
                         f"layers): -ngl 0 runs on the CPU, -ngl {n_layer} or all puts every layer on the GPU, and "
                         f"--devices cpu,cuda0 --tensor-split {n_layer - n},{n} splits the layers between them")
    if args.backend is not None and args.backend != backend and not (backend == "auto" and args.backend == "cuda"):
        raise ValueError(f"-ngl {ngl} (--backend {backend}) contradicts --backend {args.backend}")
    args.backend = args.backend or backend
    if n != 0 and not (args.rpc or args.devices or _core.gpu_devices()):   # as llama.cpp warns
        print(f"kvflash: warning: -ngl {ngl}: this build or machine has no GPU; the layers run on the CPU",
              file=sys.stderr)


def chat_template_source(value: Optional[str], file: Optional[str]) -> Optional[str]:
    """--chat-template is llama-server's Jinja text (a file path works too, as kvflash serve took one before);
    --chat-template-file FILE. A built-in template's name (chatml, llama3, ...) is refused: kvflash takes Jinja."""
    if value is not None and file is not None:
        raise ValueError("give --chat-template or --chat-template-file, not both")
    if file is not None:
        return Path(file).expanduser().read_text()
    if value is None:
        return None
    if Path(value).expanduser().is_file():
        return Path(value).expanduser().read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a Jinja template nor a file; llama.cpp's built-in "
                     f"template names are not supported: pass the template's Jinja text or --chat-template-file FILE")


def warn_llama_env(command: str, environ=os.environ) -> None:
    """llama.cpp reads LLAMA_ARG_* variables as flags; kvflash does not: say so rather than ignore them."""
    names = sorted(k for k in environ if k.startswith("LLAMA_ARG_"))
    if names:
        print(f"kvflash {command}: warning: {', '.join(names)} set: llama.cpp's environment variables are not read "
              f"here; pass the flags on the command line", file=sys.stderr)


def read_api_key_file(path: str) -> str:
    """--api-key-file: llama-server's file of keys, one a line; kvflash serve takes one key."""
    keys = [line.strip() for line in Path(path).expanduser().read_text().splitlines() if line.strip()]
    if len(keys) != 1:
        raise ValueError(f"--api-key-file {path}: kvflash serve takes one API key, the file holds {len(keys)}")
    return keys[0]


def unescape(text: str) -> str:
    """llama.cpp's -e/--escape: \\n, \\r, \\t, \\', \\", \\\\ and \\xHH in the prompt become the characters."""
    out, i = [], 0
    simple = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt in simple:
                out.append(simple[nxt])
                i += 2
                continue
            if nxt == "x" and _is_hex(text[i + 2:i + 4]):
                out.append(chr(int(text[i + 2:i + 4], 16)))
                i += 4
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _is_hex(s: str) -> bool:
    return len(s) == 2 and all(ch in "0123456789abcdefABCDEF" for ch in s)
