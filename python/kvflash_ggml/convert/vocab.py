"""The Hugging Face tokenizer as GGUF tokenizer.ggml.* keys, plus the chat template.

Only byte-level BPE tokenizers (GPT-2 style: Qwen, Llama 3, SmolLM, ...) are embedded, as libllama's
"gpt2" model. libllama does not run tokenizer.json's pre-tokenizer; it picks a built-in one by the
name in tokenizer.ggml.pre. So the pre-tokenizer of tokenizer.json is matched, part by part, against
the ones libllama reproduces exactly (regex, and whether whole-word vocabulary hits skip the merges),
and anything else is an error rather than a file that tokenizes differently.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from .checkpoint import Checkpoint
from .errors import ConversionError, require_gguf

_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
LLAMA3_REGEX = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
QWEN2_REGEX = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35_REGEX = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")

# (pre-tokenizer signature, tokenizer.json model.ignore_merges) -> libllama's tokenizer.ggml.pre
KNOWN_PRE = {
    (("bytelevel-regex",), False): "gpt-2",
    (("digits-individual", "bytelevel-regex"), False): "smollm",
    (("split:" + LLAMA3_REGEX, "bytelevel"), True): "llama-bpe",
    (("split:" + LLAMA3_REGEX, "bytelevel"), False): "smaug-bpe",
    (("split:" + QWEN2_REGEX, "bytelevel"), False): "qwen2",
    (("split:" + QWEN35_REGEX, "bytelevel"), False): "qwen35",
}
_PRE_HELP = "GPT-2 ByteLevel, SmolLM (Digits + ByteLevel), Llama 3, Qwen2 and Qwen3.5 split regexes"


@dataclass
class VocabSpec:
    tokens: List[str]
    types: List[int]
    merges: List[str]
    pre: str
    special_ids: Dict[str, int] = field(default_factory=dict)   # bos / eos / unk / pad -> id
    add_bos: bool = False
    add_eos: bool = False
    chat_template: Union[str, List[Dict[str, str]], None] = None

    def write(self, w: "gguf.GGUFWriter") -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        w.add_token_types(self.types)
        w.add_token_merges(self.merges)
        adders = {"bos": w.add_bos_token_id, "eos": w.add_eos_token_id, "unk": w.add_unk_token_id,
                  "pad": w.add_pad_token_id}
        for kind, token_id in self.special_ids.items():
            adders[kind](token_id)
        w.add_add_bos_token(self.add_bos)
        w.add_add_eos_token(self.add_eos)
        if self.chat_template:
            w.add_chat_template(self.chat_template)


def _pre_signature(pre: Optional[Dict[str, Any]]) -> Tuple[str, ...]:
    if pre is None:
        return ()
    parts = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
    sig = []
    for p in parts:
        kind = p.get("type")
        if kind == "ByteLevel":
            if p.get("add_prefix_space"):
                sig.append("bytelevel-prefix-space")   # libllama never adds the prefix space for BPE
            else:
                sig.append("bytelevel-regex" if p.get("use_regex", True) else "bytelevel")
        elif kind == "Split" and "Regex" in p.get("pattern", {}) and not p.get("invert") \
                and p.get("behavior", "").lower() == "isolated":
            sig.append("split:" + p["pattern"]["Regex"])
        elif kind == "Digits":
            sig.append("digits-individual" if p.get("individual_digits") else "digits")
        else:
            sig.append(json.dumps(p, sort_keys=True))
    return tuple(sig)


def detect_pre(tok_json: Dict[str, Any]) -> str:
    model = tok_json.get("model") or {}
    sig = _pre_signature(tok_json.get("pre_tokenizer"))
    pre = KNOWN_PRE.get((sig, bool(model.get("ignore_merges", False))))
    if pre is None:
        raise ConversionError(f"tokenizer.json pre-tokenizer is not one libllama reproduces exactly "
                              f"(found {json.dumps(tok_json.get('pre_tokenizer'))[:300]}, ignore_merges="
                              f"{model.get('ignore_merges', False)}); supported: {_PRE_HELP}")
    normalizer = tok_json.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        raise ConversionError(f"tokenizer.json normalizer {normalizer.get('type')!r} is not supported "
                              f"(libllama applies none; only none or NFC is accepted)")
    return pre


def _check_model(tok_json: Dict[str, Any]) -> Dict[str, Any]:
    model = tok_json.get("model") or {}
    if model.get("type") != "BPE":
        raise ConversionError(f"tokenizer.json model type {model.get('type')!r} is not supported "
                              f"(only byte-level BPE)")
    if model.get("byte_fallback") or (tok_json.get("pre_tokenizer") or {}).get("type") == "Metaspace":
        raise ConversionError("tokenizer.json is a SentencePiece-style BPE (byte_fallback / Metaspace, e.g. "
                              "Llama 2, Mistral v0.1-v0.3); only byte-level BPE tokenizers are supported")
    return model


def _token_table(tok_json: Dict[str, Any], n_vocab: int) -> Tuple[List[str], List[int]]:
    """Token texts and types by id, padded with unused tokens up to the embedding's n_vocab rows."""
    T = require_gguf().TokenType
    by_id: Dict[int, Tuple[str, int]] = {i: (t, T.NORMAL) for t, i in tok_json["model"]["vocab"].items()}
    for added in tok_json.get("added_tokens") or []:
        by_id[added["id"]] = (added["content"], T.CONTROL if added.get("special") else T.USER_DEFINED)
    n_tok = max(by_id) + 1 if by_id else 0
    if n_tok > n_vocab:
        raise ConversionError(f"tokenizer.json has token ids up to {n_tok - 1}, but the embedding "
                              f"(config.json vocab_size) has only {n_vocab} rows")
    tokens, types = [], []
    for i in range(n_vocab):
        text, kind = by_id.get(i, (f"[PAD{i}]", T.UNUSED))
        tokens.append(text)
        types.append(int(kind))
    return tokens, types


def _merges(model: Dict[str, Any]) -> List[str]:
    out = []
    for m in model.get("merges") or []:
        if isinstance(m, str):
            out.append(m)
        else:
            if any(" " in part for part in m):
                raise ConversionError(f"tokenizer.json merge {m} has a space inside a token: not representable in GGUF")
            out.append(" ".join(m))
    return out


def _token_content(value: Any) -> Optional[str]:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _special_ids(ckpt: Checkpoint, tok_config: Dict[str, Any], lookup: Dict[str, int]) -> Dict[str, int]:
    """bos/eos/unk/pad ids: the tokenizer's own files first, then config.json's *_token_id."""
    special_map = ckpt.optional_json("special_tokens_map.json") or {}
    out = {}
    for kind in ("bos", "eos", "unk", "pad"):
        content = _token_content(tok_config.get(f"{kind}_token")) or _token_content(special_map.get(f"{kind}_token"))
        if content is not None:
            if content not in lookup:
                raise ConversionError(f"tokenizer_config.json {kind}_token {content!r} is not in the vocabulary")
            out[kind] = lookup[content]
            continue
        token_id = ckpt.config.get(f"{kind}_token_id")
        if isinstance(token_id, list):
            token_id = token_id[0] if token_id else None
        if isinstance(token_id, int) and 0 <= token_id:
            out[kind] = token_id
    return out


def _post_processor_specials(tok_json: Dict[str, Any]) -> Tuple[Optional[str], Optional[str]]:
    """The special tokens the post-processor puts before and after a single sequence."""
    proc = tok_json.get("post_processor")
    procs = (proc.get("processors") or []) if proc and proc.get("type") == "Sequence" else [proc]
    first = last = None
    for p in procs:
        if p is None or p.get("type") == "ByteLevel":
            continue
        if p.get("type") != "TemplateProcessing":
            raise ConversionError(f"tokenizer.json post_processor {p.get('type')!r} is not supported "
                                  f"(only TemplateProcessing and ByteLevel)")
        single = p.get("single") or []
        if single and "SpecialToken" in single[0]:
            first = single[0]["SpecialToken"]["id"]
        if len(single) > 1 and "SpecialToken" in single[-1]:
            last = single[-1]["SpecialToken"]["id"]
    return first, last


def _chat_template(ckpt: Checkpoint, tok_config: Dict[str, Any]) -> Union[str, List[Dict[str, str]], None]:
    jinja = ckpt.src / "chat_template.jinja"      # where transformers >= 4.43 saves it
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    separate = ckpt.optional_json("chat_template.json")
    if separate and separate.get("chat_template"):
        return separate["chat_template"]
    return tok_config.get("chat_template")


def read_vocab(ckpt: Checkpoint, n_vocab: int) -> VocabSpec:
    tok_path = ckpt.src / "tokenizer.json"
    if not tok_path.is_file():
        extra = " (only a SentencePiece tokenizer.model was found: not supported)" \
            if (ckpt.src / "tokenizer.model").is_file() else ""
        raise ConversionError(f"missing file: {tok_path} (the tokenizer){extra}")
    tok_json = json.loads(tok_path.read_text(encoding="utf-8"))
    model = _check_model(tok_json)
    pre = detect_pre(tok_json)
    tok_config = ckpt.optional_json("tokenizer_config.json") or {}
    tokens, types = _token_table(tok_json, n_vocab)
    unused = require_gguf().TokenType.UNUSED
    lookup = {t: i for i, t in enumerate(tokens) if types[i] != unused}
    special = _special_ids(ckpt, tok_config, lookup)
    first, last = _post_processor_specials(tok_json)
    add_bos, add_eos = first is not None, last is not None
    if first is not None:
        special["bos"] = lookup[first]
    if last is not None:
        special["eos"] = lookup[last]
    add_bos = bool(tok_config.get("add_bos_token", add_bos))
    add_eos = bool(tok_config.get("add_eos_token", add_eos))
    if add_bos and "bos" not in special:
        raise ConversionError("the tokenizer adds a BOS token but names none (tokenizer_config.json bos_token)")
    return VocabSpec(tokens=tokens, types=types, merges=_merges(model), pre=pre, special_ids=special,
                     add_bos=add_bos, add_eos=add_eos, chat_template=_chat_template(ckpt, tok_config))
