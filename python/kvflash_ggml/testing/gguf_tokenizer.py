"""The toy byte-level BPE tokenizer every random GGUF carries: 256 byte tokens, merges learned from a
built-in text, chatml special tokens, padded with unused tokens up to n_vocab, and a chatml chat template."""
from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass

import gguf

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>")
# Pre-tokenizer names libllama knows (src/llama-vocab.cpp), one per family, as the real models use.
# Qwen3.5's tokenizer.json has its own split regex (\p{M} joins letters), which libllama knows as "qwen35".
_TOKENIZER_PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "gemma3": "default", "gemma4": "default",
                  "qwen3moe": "qwen2",
                  "qwen35": "qwen35", "qwen35moe": "qwen35", "laguna": "laguna"}
_MAX_MERGES = 600

# The text the BPE merges are learned from (ASCII; any text tokenizes, this only decides the merges).
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A pooled key-value cache keeps the most relevant chunks of a
long context resident on the device, and pages the others out to host memory. When the scorer says that an
evicted chunk matters again, it is paged back in. The model then attends over the pool only, so the cost of
decoding one token is set by the size of the pool and not by the length of the context.
In the beginning there was a question, and the question was simple: how much of what we have seen do we need
to remember in order to say the next word? Most of it, it turns out, can wait in a slower place.
def forward(tokens, start):
    logits = session.forward(tokens, start)
    return logits.argmax(-1)
for i in range(10): print(i, i * i, "hello world")
User: What is the capital of France?
Assistant: The capital of France is Paris. It is known for the Eiffel Tower, the Louvre and its cafes.
User: Write a short poem about the sea.
Assistant: The sea is wide, the sea is deep; it sings the sailors into sleep. Its waves come in, its waves go
out, and no one knows what they're about.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 16 32 64 128 256 512 1024 2048 4096 8192 2024 3.14159 42.
"""
_PRETOKENIZE = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@functools.lru_cache(maxsize=4)
def _learn_merges(max_merges: int) -> tuple[tuple[str, str], ...]:
    """Byte-level BPE merges learned from _CORPUS, most frequent pair first (ties: smallest pair)."""
    b2u = bytes_to_unicode()
    words = Counter(tuple(b2u[b] for b in w.encode("utf-8")) for w in _PRETOKENIZE.findall(_CORPUS))
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        pairs: Counter = Counter()
        for w, f in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += f
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if best[1] < 2:
            break
        a, b = best[0]
        merges.append((a, b))
        merged: Counter = Counter()
        for w, f in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += f
        words = merged
    return tuple(merges)


@dataclass(frozen=True)
class TokenizerSpec:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]          # "left right", in rank order
    pre: str                   # tokenizer.ggml.pre
    bos: int
    eos: int
    pad: int
    add_bos: bool
    chat_template: str = CHATML_TEMPLATE

    @property
    def special_ids(self) -> dict[str, int]:
        return {t: self.tokens.index(t) for t in SPECIAL_TOKENS}


def build_tokenizer(arch: str, n_vocab: int) -> TokenizerSpec:
    """Vocabulary of exactly n_vocab tokens: bytes, learned merges, special tokens, then [PADi] (unused)."""
    n_fixed = 256 + len(SPECIAL_TOKENS)
    if n_vocab < n_fixed:
        raise ValueError(f"n_vocab={n_vocab} is too small: the byte-level vocabulary needs at least {n_fixed} tokens")
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    seen = set(tokens)
    merges = []
    for a, b in _learn_merges(_MAX_MERGES):
        if len(tokens) + len(SPECIAL_TOKENS) >= n_vocab:
            break
        merges.append(f"{a} {b}")
        if a + b not in seen:   # two merge paths can build the same string: one token for it
            seen.add(a + b)
            tokens.append(a + b)
    types = [gguf.TokenType.NORMAL] * len(tokens)
    tokens += SPECIAL_TOKENS
    types += [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
    n_pad = n_vocab - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(n_pad)]
    types += [gguf.TokenType.UNUSED] * n_pad
    ids = {t: tokens.index(t) for t in SPECIAL_TOKENS}
    if arch in ("llama", "gemma3", "gemma4"):   # Llama 3 / Gemma style: a BOS that is added to every prompt
        bos, add_bos = ids["<|begin_of_text|>"], True
    else:                 # Qwen style: no BOS added
        bos, add_bos = ids["<|endoftext|>"], False
    return TokenizerSpec(tokens=tokens, token_types=[int(t) for t in types], merges=merges,
                         pre=_TOKENIZER_PRE[arch], bos=bos, eos=ids["<|im_end|>"], pad=ids["<|endoftext|>"],
                         add_bos=add_bos)
