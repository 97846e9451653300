"""GGUF files with random weights, for tests and benchmarks of every supported family and size.

    write_random_gguf("m.gguf", "qwen3", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32,
                      n_ff=128, n_vocab=1000, n_ctx_train=4096)
    write_preset("m.gguf", "llama3-8b", weight_type="q4_0")
    python -m kvflash_ggml.testing.random_gguf OUT.gguf --shape llama3-8b --type q4_0

(Moved from kvflash_ggml.bench.random_gguf: a test fixture, not a benchmark; the command line moved along.)

The files are what llama.cpp's converter writes for llama / qwen2 / qwen3 / gemma3 / gemma4 / qwen3moe / qwen35 /
qwen35moe / laguna (tensor names from gguf-py's constants, the same metadata keys and shapes), so libllama loads
them too and is the reference in tests. Each file carries a small byte-level BPE tokenizer (256 byte
tokens, merges learned from a built-in text, chatml special tokens, padded with unused tokens up to
n_vocab) and a chatml chat template.

The newer families:
  qwen3moe   qwen3's attention, every FFN replaced by n_expert routed experts (n_expert_used per token,
             width n_ff_exp); 3-D expert tensors, ne = (n_embd, n_ff_exp, n_expert) for gate/up and
             (n_ff_exp, n_embd, n_expert) for down.
  qwen35     Qwen3.5 dense hybrid: gated delta-net (linear attention) layers, and every
             full_attention_interval-th layer (layer i iff (i + 1) % interval == 0) full attention with
             an output gate (attn_q is twice as wide: queries and gate), partial interleaved M-RoPE
             (n_rot < head_dim, rope_sections). Delta-net shape: ssm_n_group key heads and ssm_dt_rank
             value heads of ssm_d_state each, a causal conv of ssm_d_conv taps.
  qwen35moe  qwen35 with routed experts plus a gated shared expert (n_ff_shexp) instead of the dense FFN;
             no feed_forward_length key, as the converter writes none for it.
  laguna     Poolside's Laguna: sigmoid-routed experts with a per-expert selection bias (exp_probs_b) and
             an ungated shared expert, the first n_layer_dense_lead layers dense (n_ff); a softplus attention
             output gate per head or per element (gate_per_element, per layer); q/k norms; n_head_swa query
             heads on the sliding-window layers (one global layer per swa_pattern period, first); YaRN on the
             global layers over n_rot dims (rope_scaling_type="yarn"), plain RoPE over n_rot_swa on the local.
  gemma4     Google Gemma 4 (text): sliding-window layers with their own head size (head_dim_swa, all of it
             rotated) beside global ones (head_dim, rope_freqs proportional-RoPE factors); q/k norms, post-attention
             and post-FFN norms; GeGLU FFN of a per-layer width (n_ff_layers); n_shared_kv last layers without K/V
             of their own; per-layer embeddings of n_embd_per_layer per layer; with n_expert, every layer also has
             routed experts (fused gate_up, per-expert down scales, a router input scale) beside its dense FFN;
             a layer_output_scale per layer. Its norms and scales are random around 1 (not ones), so a norm
             applied in the wrong place shows.
mtp=True (qwen35 / qwen35moe): one multi-token-prediction (nextn) layer after the trunk, as the converter writes
Qwen3.5's (block_count counts it, {arch}.nextn_predict_layers = 1, attention.recurrent_layers has one flag per
block, False for it): blk.N.* a full-attention block of the family (gated attention, q/k norms, the family's FFN)
and blk.N.nextn.{eh_proj, enorm, hnorm, shared_head_norm}; no nextn.embed_tokens / shared_head_head (the trunk's
are shared). Its norms are random around 1, so swapping enorm and hnorm shows; with echo they are ones and
eh_proj passes the normed embedding through, so the head, like the trunk, predicts the token it was given.

Weights: norms are 1, everything else ~N(0, weight_std), but for the delta-net's own parameters, which
get what an untrained real model has so the recurrence is stable and not trivial: ssm_a = -A with
A ~ U(1, 16), ssm_dt.bias = softplus^-1(dt) with dt log-uniform in [1e-3, 0.1] (Mamba2's dt init: the
per-token decay exp(-A * softplus(dt_bias + alpha)) spans short to very long memories), ssm_conv1d ~
N(0, 1/d_conv) (the conv's fan-in scale). Quantized types (q8_0, q4_0) are written as random blocks
directly (random quants, one fp16 scale per block with a random sign, sized so the dequantized weights
have std weight_std): nothing is quantized in Python. Tensors are streamed to disk in pieces, so memory
stays bounded (tens of MB) whatever the model size. Tensors larger than _FRESH_MAX elements take their
values from random windows of a fixed random reservoir, so an 8B model is written at disk speed; small
(test-sized) tensors get fresh values.
"""
from __future__ import annotations

import argparse
import functools
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import gguf
import numpy as np
from gguf import MODEL_TENSOR as T
from gguf import GGMLQuantizationType as QT

ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "gemma4", "qwen3moe", "qwen35", "qwen35moe", "laguna")
MOE_ARCHS = ("qwen3moe", "qwen35moe", "laguna")   # routed experts instead of the dense FFN
SWA_ARCHS = ("gemma3", "gemma4", "laguna")   # sliding-window layers beside the global ones
HYBRID_ARCHS = ("qwen35", "qwen35moe")       # gated delta-net layers + every interval-th layer full attention
PARTIAL_ROTARY_ARCHS = HYBRID_ARCHS + ("laguna", "gemma4")   # RoPE over part of the (global) head
WEIGHT_TYPES = {"f32": QT.F32, "f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0}
_FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
               "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}

# Named shapes. The 8B ones follow the published configs (Llama 3.1 8B keeps its 128K context but
# plain RoPE, without the llama3 frequency factors; Qwen3 8B as released).
SHAPES: dict[str, dict] = {
    "tiny-llama": dict(arch="llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff=256,
                       n_vocab=1000, n_ctx_train=4096),
    "tiny-qwen2": dict(arch="qwen2", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32, n_ff=256,
                       n_vocab=1000, n_ctx_train=4096),
    # head_dim * n_head != n_embd, as in the real Qwen3 models
    "tiny-qwen3": dict(arch="qwen3", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128,
                       n_vocab=1000, n_ctx_train=4096),
    # sliding-window layers 0 and 2 (window 96: not a chunk multiple), global layers 1 and 3
    "tiny-gemma3": dict(arch="gemma3", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128,
                        n_vocab=1000, n_ctx_train=4096, n_swa=96, swa_pattern=2, rope_freq_base=1000000.0),
    # gemma4: local layers 0, 1, 3, 4 (window 96, head 32), global 2 and 5 (head 64); per-layer embeddings of 32;
    # FFN widths per layer; no shared K/V (tests ask for it by override:
    # n_shared_kv=3 makes local layers 3 and 4 attend layer 1's K/V and global layer 5 layer 2's), no experts (n_expert=4, n_expert_used=2,
    # n_ff_exp=64 by override).
    "tiny-gemma4": dict(arch="gemma4", n_layer=6, n_embd=64, n_head=4, n_head_kv=2, head_dim=64, head_dim_swa=32,
                        n_ff=128, n_ff_layers=(128, 96, 128, 160, 128, 96), n_vocab=1000, n_ctx_train=4096, n_swa=96,
                        swa_pattern=3, rope_freq_base=1000000.0, rope_freq_base_swa=10000.0, n_embd_per_layer=32,
                        logit_softcap=30.0),
    # Gemma 3 4B / 12B as released: 5 sliding-window layers (1024) to each global one, linear RoPE scaling 8
    # on the global layers, the 262K vocabulary.
    "gemma3-4b": dict(arch="gemma3", n_layer=34, n_embd=2560, n_head=8, n_head_kv=4, head_dim=256, n_ff=10240,
                      n_vocab=262144, n_ctx_train=131072, n_swa=1024, rope_freq_base=1000000.0,
                      rope_scaling_factor=8.0, tied_embeddings=True),
    "gemma3-12b": dict(arch="gemma3", n_layer=48, n_embd=3840, n_head=16, n_head_kv=8, head_dim=256, n_ff=15360,
                       n_vocab=262144, n_ctx_train=131072, n_swa=1024, rope_freq_base=1000000.0,
                       rope_scaling_factor=8.0, tied_embeddings=True),
    # Llama 3.2 1B as released (tied embeddings, the 128K vocabulary of the 8B): a draft for the 8B shape.
    "llama3.2-1b": dict(arch="llama", n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, head_dim=64, n_ff=8192,
                        n_vocab=128256, n_ctx_train=131072, rope_freq_base=500000.0, rms_eps=1e-5,
                        tied_embeddings=True),
    "llama3-8b": dict(arch="llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=14336,
                      n_vocab=128256, n_ctx_train=131072, rope_freq_base=500000.0, rms_eps=1e-5),
    "qwen3-8b": dict(arch="qwen3", n_layer=36, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=12288,
                     n_vocab=151936, n_ctx_train=40960, rope_freq_base=1000000.0, rms_eps=1e-6),
    # 4 experts, 2 a token; n_ff (written, unused by the MoE graph) differs from n_ff_exp to catch mix-ups
    "tiny-qwen3moe": dict(arch="qwen3moe", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128,
                          n_expert=4, n_expert_used=2, n_ff_exp=64, n_vocab=1000, n_ctx_train=4096),
    # global layers 0 and 2 (4 query heads), sliding-window 1 and 3 (8 heads, window 96); layer 0 dense, 1-3 4
    # experts (2 a token) + a shared one; layer 0's gate per element, the others' per head; YaRN x4 over 16 of
    # the global heads' 32 dims, plain RoPE over all 32 on the local ones.
    "tiny-laguna": dict(arch="laguna", n_layer=4, n_embd=64, n_head=4, n_head_swa=8, n_head_kv=2, head_dim=32,
                        n_ff=128, n_expert=4, n_expert_used=2, n_ff_exp=64, n_ff_shexp=96, n_layer_dense_lead=1,
                        expert_weights_scale=2.5, gate_per_element=(True, False, False, False), n_vocab=1000,
                        n_ctx_train=4096, n_swa=96, swa_pattern=2, n_rot=16, n_rot_swa=32,
                        rope_freq_base=500000.0, rope_freq_base_swa=10000.0, rope_scaling_type="yarn",
                        rope_scaling_factor=4.0, rope_orig_ctx=1024),
    # layers 0 and 2 delta-net, 1 and 3 full attention; 2 key heads and 4 value heads of 32; n_rot 8 of 32
    "tiny-qwen35": dict(arch="qwen35", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128,
                        n_vocab=1000, n_ctx_train=4096, full_attention_interval=2, ssm_d_conv=4, ssm_d_state=32,
                        ssm_n_group=2, ssm_dt_rank=4, n_rot=8, rope_sections=(2, 1, 1, 0)),
    "tiny-qwen35moe": dict(arch="qwen35moe", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32,
                           n_expert=4, n_expert_used=2, n_ff_exp=64, n_ff_shexp=128,
                           n_vocab=1000, n_ctx_train=4096, full_attention_interval=2, ssm_d_conv=4, ssm_d_state=32,
                           ssm_n_group=2, ssm_dt_rank=4, n_rot=8, rope_sections=(2, 1, 1, 0)),
    # Qwen3-30B-A3B as released (Qwen/Qwen3-30B-A3B config.json: hidden 2048, intermediate 6144, moe_intermediate
    # 768, 48 layers, 32 heads / 4 KV of 128, 128 experts, 8 a token, 40960 positions, rope_theta 1e6, vocab 151936,
    # untied; read from public copies of that config, not from the Hugging Face page itself).
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_ff=6144,
                          n_expert=128, n_expert_used=8, n_ff_exp=768, n_vocab=151936, n_ctx_train=40960,
                          rope_freq_base=1000000.0, rms_eps=1e-6),
    # Qwen3.5-27B as released (text_config of Qwen/Qwen3.5-27B config.json, read from public copies of it and
    # cross-checked with THUDM/slime scripts/models/qwen3.5-27B.sh): hidden 5120, intermediate 17408, 64 layers
    # (full_attention_interval 4: 16 full-attention layers), 24 heads / 4 KV of 256, partial_rotary_factor 0.25
    # (n_rot 64), mrope_section [11, 11, 10], rope_theta 1e7, linear attention 16 key / 48 value heads of 128,
    # conv kernel 4, 262144 positions, vocab 248320, untied, rms_norm_eps 1e-6.
    "qwen35-27b": dict(arch="qwen35", n_layer=64, n_embd=5120, n_head=24, n_head_kv=4, head_dim=256, n_ff=17408,
                       n_vocab=248320, n_ctx_train=262144, rope_freq_base=10000000.0, rms_eps=1e-6,
                       full_attention_interval=4, ssm_d_conv=4, ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=48,
                       n_rot=64, rope_sections=(11, 11, 10, 0)),
    # Qwen3.5-35B-A3B as released (text_config of Qwen/Qwen3.5-35B-A3B config.json, from public copies, cross-checked
    # with THUDM/slime scripts/models/qwen3.5-35B-A3B.sh and transformers' Qwen3_5MoeTextConfig defaults): hidden
    # 2048, 40 layers (interval 4: 10 full-attention), 16 heads / 2 KV of 256, 256 experts, 8 a token,
    # moe_intermediate 512, shared expert 512, linear attention 16 key / 32 value heads of 128, conv 4, rope as
    # qwen35-27b, 262144 positions, vocab 248320, untied. The config has no intermediate_size: no n_ff.
    "qwen35-35b-a3b": dict(arch="qwen35moe", n_layer=40, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256,
                           n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512,
                           n_vocab=248320, n_ctx_train=262144, rope_freq_base=10000000.0, rms_eps=1e-6,
                           full_attention_interval=4, ssm_d_conv=4, ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32,
                           n_rot=64, rope_sections=(11, 11, 10, 0)),
    # Laguna XS.2's published shape (Poolside's model card and libllama's laguna.cpp): 40 layers, one global layer
    # in four (first), sliding window 512, 131072 positions, 256 experts + 1 shared, 48 query heads on the global
    # layers and 64 on the local ones, head size 128, YaRN over 64 dims on the global layers (theta 5e5), plain
    # RoPE over all 128 on the local ones (theta 1e4), one leading dense layer, per-head gates. NOT published
    # (assumed, Qwen3-30B-A3B-like, ~33B weights): hidden 2048, 8 KV heads, 8 experts a token of width 512,
    # shared expert 512, dense FFN 8192, vocab 100352, YaRN factor 32 over 4096, routed scale 2.5.
    "laguna-xs2": dict(arch="laguna", n_layer=40, n_embd=2048, n_head=48, n_head_swa=64, n_head_kv=8, head_dim=128,
                       n_ff=8192, n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512, n_layer_dense_lead=1,
                       expert_weights_scale=2.5, n_vocab=100352, n_ctx_train=131072, n_swa=512, n_rot=64,
                       n_rot_swa=128, rope_freq_base=500000.0, rope_freq_base_swa=10000.0, rope_scaling_type="yarn",
                       rope_scaling_factor=32.0, rope_orig_ctx=4096, rms_eps=1e-6),
}

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


# ---- tokenizer ------------------------------------------------------------------------------------

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


# ---- tensors --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]        # ggml order: ne[0] is the row length
    # "weight" (weight_type, or F32 where the converter keeps F32), "norm" (F32 ones), "bias" (F32 random), "scale"
    # (F32 in [0.5, 1.5): gemma4's norms and scales), "rope_freqs" (F32 proportional-RoPE factors), and the
    # delta-net's own F32 parameters: "conv" (ssm_conv1d), "decay" (ssm_a, negative), "dt_bias" (ssm_dt.bias); "eh_proj"
    # (a nextn layer's projection: a weight), "eh_echo" (the same of an echo model: F32 [I, 0])
    kind: str
    qtype: QT

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.ne))

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return self.n_elements // block * size


def _name(t: T, suffix: str, bid: int | None = None) -> str:
    """gguf-py's name for tensor t (of block bid), then "." + suffix; suffix "" for bare names (ssm_a)."""
    base = gguf.TENSOR_NAMES[t]
    base = base.format(bid=bid) if bid is not None else base
    return base + "." + suffix if suffix else base


@dataclass(frozen=True)
class _Dims:
    """The widths one layer's tensors are cut to (see tensor_specs for what each means)."""
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_expert: int
    n_ff_exp: int
    n_ff_shexp: int
    ssm_d_conv: int
    ssm_d_state: int
    ssm_n_group: int
    ssm_dt_rank: int


def tensor_specs(arch: str, *, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, head_dim: int, n_ff: int,
                 n_vocab: int, weight_type: str = "f32", tied_embeddings: bool = False, n_expert: int = 0,
                 n_ff_exp: int = 0, n_ff_shexp: int = 0, ssm_d_conv: int = 0, ssm_d_state: int = 0,
                 ssm_n_group: int = 0, ssm_dt_rank: int = 0, full_attention_interval: int = 4,
                 swa_layers: Sequence[bool] = (), n_head_swa: int = 0, n_layer_dense_lead: int = 0,
                 gate_per_element: Sequence[bool] = (), head_dim_swa: int = 0, n_ff_layers: Sequence[int] = (),
                 n_embd_per_layer: int = 0, split_experts: bool = False, n_nextn: int = 0) -> list[TensorSpec]:
    """Every tensor of the model, in file order, with llama.cpp's names and shapes.

    n_expert / n_ff_exp: routed experts and their width (qwen3moe, qwen35moe, laguna); n_ff_shexp: the shared
    expert's width (qwen35moe, laguna). ssm_*: the delta-net's conv taps, head size, key heads and value heads
    (qwen35*); full_attention_interval: which of their layers attend (layer i iff (i + 1) % interval == 0).
    laguna: swa_layers (one flag per layer) with n_head_swa query heads, the first n_layer_dense_lead layers
    dense, gate_per_element (one flag per layer: the attention gate per element, else per head).
    gemma4: head_dim_swa (the sliding-window layers' head size), n_ff_layers (FFN width per layer),
    n_embd_per_layer (per-layer embeddings; 0: none), n_expert (routed experts on every layer; 0: none),
    split_experts (separate gate and up expert tensors, each with per-expert scales, instead of fused gate_up).
    n_nextn: multi-token-prediction layers after the n_layer of the trunk (qwen35*; see mtp in the module doc).
    """
    wt = WEIGHT_TYPES[weight_type]
    d = _Dims(n_embd, n_head, n_head_kv, head_dim, n_ff, n_expert, n_ff_exp, n_ff_shexp, ssm_d_conv, ssm_d_state,
              ssm_n_group, ssm_dt_rank)
    specs = [TensorSpec(_name(T.TOKEN_EMBD, "weight"), (n_embd, n_vocab), "weight", wt)]
    if arch == "gemma4":
        specs += _gemma4_globals(n_layer, n_vocab, d, wt, n_embd_per_layer)
    for il in range(n_layer):
        if arch == "gemma4":
            local = bool(swa_layers and swa_layers[il])
            specs += _gemma4_layer(il, replace(d, head_dim=head_dim_swa if local else head_dim,
                                               n_ff=n_ff_layers[il] if n_ff_layers else n_ff), wt, n_embd_per_layer,
                                  split_experts)
        elif arch in HYBRID_ARCHS:
            specs += _hybrid_layer(arch, il, d, wt, attends=(il + 1) % full_attention_interval == 0)
        elif arch == "laguna":
            heads = n_head_swa if swa_layers and swa_layers[il] else n_head
            specs += _laguna_layer(il, replace(d, n_head=heads), wt, dense=il < n_layer_dense_lead,
                                   gate_per_element=bool(gate_per_element and gate_per_element[il]))
        else:
            specs += _transformer_layer(arch, il, d, wt)
    for il in range(n_layer, n_layer + n_nextn):
        specs += _hybrid_layer(arch, il, d, wt, attends=True) + _nextn(il, d, wt)
    specs.append(TensorSpec(_name(T.OUTPUT_NORM, "weight"), (n_embd,), "norm", QT.F32))
    if not tied_embeddings:
        specs.append(TensorSpec(_name(T.OUTPUT, "weight"), (n_embd, n_vocab), "weight", wt))
    return specs


def _transformer_layer(arch: str, il: int, d: _Dims, wt: QT) -> list[TensorSpec]:
    """llama / qwen2 / qwen3 / gemma3 / qwen3moe: attention then a dense or routed FFN, each pre-normed."""
    n_embd, head_dim = d.n_embd, d.head_dim
    n_q, n_kv = head_dim * d.n_head, head_dim * d.n_head_kv
    specs = [TensorSpec(_name(T.ATTN_NORM, "weight", il), (n_embd,), "norm", QT.F32),
             TensorSpec(_name(T.ATTN_Q, "weight", il), (n_embd, n_q), "weight", wt),
             TensorSpec(_name(T.ATTN_K, "weight", il), (n_embd, n_kv), "weight", wt),
             TensorSpec(_name(T.ATTN_V, "weight", il), (n_embd, n_kv), "weight", wt)]
    if arch == "qwen2":
        specs.append(TensorSpec(_name(T.ATTN_Q, "bias", il), (n_q,), "bias", QT.F32))
        specs.append(TensorSpec(_name(T.ATTN_K, "bias", il), (n_kv,), "bias", QT.F32))
        specs.append(TensorSpec(_name(T.ATTN_V, "bias", il), (n_kv,), "bias", QT.F32))
    if arch in ("qwen3", "gemma3", "qwen3moe"):
        specs.append(TensorSpec(_name(T.ATTN_Q_NORM, "weight", il), (head_dim,), "norm", QT.F32))
        specs.append(TensorSpec(_name(T.ATTN_K_NORM, "weight", il), (head_dim,), "norm", QT.F32))
    specs.append(TensorSpec(_name(T.ATTN_OUT, "weight", il), (n_q, n_embd), "weight", wt))
    if arch == "gemma3":
        specs.append(TensorSpec(_name(T.ATTN_POST_NORM, "weight", il), (n_embd,), "norm", QT.F32))
    specs.append(TensorSpec(_name(T.FFN_NORM, "weight", il), (n_embd,), "norm", QT.F32))
    specs += _routed_experts(il, d, wt) if arch in MOE_ARCHS else _dense_ffn(il, d, wt)
    if arch == "gemma3":
        specs.append(TensorSpec(_name(T.FFN_POST_NORM, "weight", il), (n_embd,), "norm", QT.F32))
    return specs


def _laguna_layer(il: int, d: _Dims, wt: QT, dense: bool, gate_per_element: bool) -> list[TensorSpec]:
    """Attention with q/k norms and a softplus output gate (attn_gate: one output per head or per element), then
    a dense FFN or routed experts (with their selection bias) beside an ungated shared expert."""
    n_q, n_kv = d.head_dim * d.n_head, d.head_dim * d.n_head_kv
    specs = [TensorSpec(_name(T.ATTN_NORM, "weight", il), (d.n_embd,), "norm", QT.F32),
             TensorSpec(_name(T.ATTN_Q, "weight", il), (d.n_embd, n_q), "weight", wt),
             TensorSpec(_name(T.ATTN_K, "weight", il), (d.n_embd, n_kv), "weight", wt),
             TensorSpec(_name(T.ATTN_V, "weight", il), (d.n_embd, n_kv), "weight", wt),
             TensorSpec(_name(T.ATTN_Q_NORM, "weight", il), (d.head_dim,), "norm", QT.F32),
             TensorSpec(_name(T.ATTN_K_NORM, "weight", il), (d.head_dim,), "norm", QT.F32),
             TensorSpec(_name(T.ATTN_GATE, "weight", il), (d.n_embd, n_q if gate_per_element else d.n_head),
                        "weight", wt),
             TensorSpec(_name(T.ATTN_OUT, "weight", il), (n_q, d.n_embd), "weight", wt),
             TensorSpec(_name(T.FFN_NORM, "weight", il), (d.n_embd,), "norm", QT.F32)]
    if dense:
        return specs + _dense_ffn(il, d, wt)
    f = d.n_ff_shexp
    return specs + _routed_experts(il, d, wt) + [
        TensorSpec(_name(T.FFN_EXP_PROBS_B, "bias", il), (d.n_expert,), "bias", QT.F32),
        TensorSpec(_name(T.FFN_GATE_SHEXP, "weight", il), (d.n_embd, f), "weight", wt),
        TensorSpec(_name(T.FFN_UP_SHEXP, "weight", il), (d.n_embd, f), "weight", wt),
        TensorSpec(_name(T.FFN_DOWN_SHEXP, "weight", il), (f, d.n_embd), "weight", wt)]


def _gemma4_globals(n_layer: int, n_vocab: int, d: _Dims, wt: QT, n_embd_per_layer: int) -> list[TensorSpec]:
    """The global layers' proportional-RoPE factors (one tensor, libllama reads it for each), and the per-layer
    embeddings' token rows, projection and norm."""
    specs = [TensorSpec(_name(T.ROPE_FREQS, "weight"), (d.head_dim // 2,), "rope_freqs", QT.F32)]
    if n_embd_per_layer:
        width = n_embd_per_layer * n_layer
        specs += [TensorSpec(_name(T.PER_LAYER_TOKEN_EMBD, "weight"), (width, n_vocab), "weight", wt),
                  TensorSpec(_name(T.PER_LAYER_MODEL_PROJ, "weight"), (d.n_embd, width), "weight", wt),
                  TensorSpec(_name(T.PER_LAYER_PROJ_NORM, "weight"), (n_embd_per_layer,), "scale", QT.F32)]
    return specs


def _gemma4_layer(il: int, d: _Dims, wt: QT, n_embd_per_layer: int, split_experts: bool) -> list[TensorSpec]:
    """Attention with q/k norms and a post-norm, a GeGLU FFN with a post-norm (beside routed experts with their own
    norms when n_expert), the per-layer embedding's gate, projection and norm, the layer's output scale. K and V
    are written for every layer, as the converter does; libllama ignores them on shared-KV layers."""
    e, n_q, n_kv = d.n_embd, d.head_dim * d.n_head, d.head_dim * d.n_head_kv
    specs = [TensorSpec(_name(T.ATTN_NORM, "weight", il), (e,), "scale", QT.F32),
             TensorSpec(_name(T.ATTN_Q, "weight", il), (e, n_q), "weight", wt),
             TensorSpec(_name(T.ATTN_Q_NORM, "weight", il), (d.head_dim,), "scale", QT.F32),
             TensorSpec(_name(T.ATTN_K, "weight", il), (e, n_kv), "weight", wt),
             TensorSpec(_name(T.ATTN_K_NORM, "weight", il), (d.head_dim,), "scale", QT.F32),
             TensorSpec(_name(T.ATTN_V, "weight", il), (e, n_kv), "weight", wt),
             TensorSpec(_name(T.ATTN_OUT, "weight", il), (n_q, e), "weight", wt),
             TensorSpec(_name(T.ATTN_POST_NORM, "weight", il), (e,), "scale", QT.F32),
             TensorSpec(_name(T.FFN_NORM, "weight", il), (e,), "scale", QT.F32)]
    specs += _dense_ffn(il, d, wt)
    specs.append(TensorSpec(_name(T.FFN_POST_NORM, "weight", il), (e,), "scale", QT.F32))
    if d.n_expert:
        x, f = d.n_expert, d.n_ff_exp
        specs += [TensorSpec(_name(T.FFN_GATE_INP, "weight", il), (e, x), "weight", QT.F32),
                  TensorSpec(_name(T.FFN_GATE_INP, "scale", il), (e,), "scale", QT.F32),
                  TensorSpec(_name(T.FFN_PRE_NORM_2, "weight", il), (e,), "scale", QT.F32),
                  TensorSpec(_name(T.FFN_POST_NORM_1, "weight", il), (e,), "scale", QT.F32),
                  TensorSpec(_name(T.FFN_POST_NORM_2, "weight", il), (e,), "scale", QT.F32)]
        if split_experts:   # libllama reads these scales only beside separate gate and up tensors
            specs += [TensorSpec(_name(T.FFN_GATE_EXP, "weight", il), (e, f, x), "weight", wt),
                      TensorSpec(_name(T.FFN_GATE_EXP, "scale", il), (x,), "scale", QT.F32),
                      TensorSpec(_name(T.FFN_UP_EXP, "weight", il), (e, f, x), "weight", wt),
                      TensorSpec(_name(T.FFN_UP_EXP, "scale", il), (x,), "scale", QT.F32)]
        else:
            specs.append(TensorSpec(_name(T.FFN_GATE_UP_EXP, "weight", il), (e, 2 * f, x), "weight", wt))
        specs += [TensorSpec(_name(T.FFN_DOWN_EXP, "weight", il), (f, e, x), "weight", wt),
                  TensorSpec(_name(T.FFN_DOWN_EXP, "scale", il), (x,), "scale", QT.F32)]
    if n_embd_per_layer:
        specs += [TensorSpec(_name(T.PER_LAYER_INP_GATE, "weight", il), (e, n_embd_per_layer), "weight", wt),
                  TensorSpec(_name(T.PER_LAYER_PROJ, "weight", il), (n_embd_per_layer, e), "weight", wt),
                  TensorSpec(_name(T.PER_LAYER_POST_NORM, "weight", il), (e,), "scale", QT.F32)]
    return specs + [TensorSpec(_name(T.LAYER_OUT_SCALE, "weight", il), (1,), "scale", QT.F32)]


def _hybrid_layer(arch: str, il: int, d: _Dims, wt: QT, attends: bool) -> list[TensorSpec]:
    """qwen35 / qwen35moe: gated attention or gated delta-net, post-attention norm, dense FFN or experts."""
    specs = [TensorSpec(_name(T.ATTN_NORM, "weight", il), (d.n_embd,), "norm", QT.F32)]
    specs += _gated_attention(il, d, wt) if attends else _delta_net(il, d, wt)
    # Qwen3.5 names its FFN pre-norm post_attention_layernorm: libllama's ATTN_POST_NORM, there is no ffn_norm
    specs.append(TensorSpec(_name(T.ATTN_POST_NORM, "weight", il), (d.n_embd,), "norm", QT.F32))
    if arch == "qwen35moe":
        return specs + _routed_experts(il, d, wt) + _shared_expert(il, d, wt)
    return specs + _dense_ffn(il, d, wt)


def _gated_attention(il: int, d: _Dims, wt: QT) -> list[TensorSpec]:
    """Full attention whose attn_q also projects a per-head output gate: queries and gate interleaved per head,
    so its output width is twice n_head * head_dim."""
    n_q, n_kv = d.head_dim * d.n_head, d.head_dim * d.n_head_kv
    return [TensorSpec(_name(T.ATTN_Q, "weight", il), (d.n_embd, 2 * n_q), "weight", wt),
            TensorSpec(_name(T.ATTN_K, "weight", il), (d.n_embd, n_kv), "weight", wt),
            TensorSpec(_name(T.ATTN_V, "weight", il), (d.n_embd, n_kv), "weight", wt),
            TensorSpec(_name(T.ATTN_Q_NORM, "weight", il), (d.head_dim,), "norm", QT.F32),
            TensorSpec(_name(T.ATTN_K_NORM, "weight", il), (d.head_dim,), "norm", QT.F32),
            TensorSpec(_name(T.ATTN_OUT, "weight", il), (n_q, d.n_embd), "weight", wt)]


def _nextn(il: int, d: _Dims, wt: QT) -> list[TensorSpec]:
    """A multi-token-prediction layer's own tensors: the projection of [enorm(embedding), hnorm(hidden)] into the
    block's input, those norms, and the norm before the (shared) head."""
    e = d.n_embd
    return [TensorSpec(_name(T.NEXTN_EH_PROJ, "weight", il), (2 * e, e), "eh_proj", wt),
            TensorSpec(_name(T.NEXTN_ENORM, "weight", il), (e,), "scale", QT.F32),
            TensorSpec(_name(T.NEXTN_HNORM, "weight", il), (e,), "scale", QT.F32),
            TensorSpec(_name(T.NEXTN_SHARED_HEAD_NORM, "weight", il), (e,), "scale", QT.F32)]


def _delta_net(il: int, d: _Dims, wt: QT) -> list[TensorSpec]:
    """Gated delta-net, in libllama's layout: q, k (ssm_n_group heads) and v (ssm_dt_rank heads), all of
    ssm_d_state, come from one attn_qkv projection and a depthwise causal conv over its channels."""
    key_dim, value_dim = d.ssm_d_state * d.ssm_n_group, d.ssm_d_state * d.ssm_dt_rank
    conv_dim = 2 * key_dim + value_dim
    return [TensorSpec(_name(T.ATTN_QKV, "weight", il), (d.n_embd, conv_dim), "weight", wt),
            TensorSpec(_name(T.ATTN_GATE, "weight", il), (d.n_embd, value_dim), "weight", wt),
            # ggml_ssm_conv reads its kernel as F32, and the converter keeps SSM_CONV1D F32 whatever the type
            TensorSpec(_name(T.SSM_CONV1D, "weight", il), (d.ssm_d_conv, conv_dim), "conv", QT.F32),
            TensorSpec(_name(T.SSM_DT, "bias", il), (d.ssm_dt_rank,), "dt_bias", QT.F32),
            TensorSpec(_name(T.SSM_A, "", il), (d.ssm_dt_rank,), "decay", QT.F32),    # -exp(A_log): no suffix
            TensorSpec(_name(T.SSM_BETA, "weight", il), (d.n_embd, d.ssm_dt_rank), "weight", wt),
            TensorSpec(_name(T.SSM_ALPHA, "weight", il), (d.n_embd, d.ssm_dt_rank), "weight", wt),
            TensorSpec(_name(T.SSM_NORM, "weight", il), (d.ssm_d_state,), "norm", QT.F32),
            TensorSpec(_name(T.SSM_OUT, "weight", il), (value_dim, d.n_embd), "weight", wt)]


def _dense_ffn(il: int, d: _Dims, wt: QT) -> list[TensorSpec]:
    return [TensorSpec(_name(T.FFN_GATE, "weight", il), (d.n_embd, d.n_ff), "weight", wt),
            TensorSpec(_name(T.FFN_UP, "weight", il), (d.n_embd, d.n_ff), "weight", wt),
            TensorSpec(_name(T.FFN_DOWN, "weight", il), (d.n_ff, d.n_embd), "weight", wt)]


def _routed_experts(il: int, d: _Dims, wt: QT) -> list[TensorSpec]:
    """The router (F32: the converter and llama-quantize never quantize ffn_gate_inp) and the experts stacked
    into 3-D tensors, expert index outermost."""
    e, f = d.n_expert, d.n_ff_exp
    return [TensorSpec(_name(T.FFN_GATE_INP, "weight", il), (d.n_embd, e), "weight", QT.F32),
            TensorSpec(_name(T.FFN_GATE_EXP, "weight", il), (d.n_embd, f, e), "weight", wt),
            TensorSpec(_name(T.FFN_UP_EXP, "weight", il), (d.n_embd, f, e), "weight", wt),
            TensorSpec(_name(T.FFN_DOWN_EXP, "weight", il), (f, d.n_embd, e), "weight", wt)]


def _shared_expert(il: int, d: _Dims, wt: QT) -> list[TensorSpec]:
    """qwen35moe's shared expert and its sigmoid gate (one output: a 1-D F32 tensor, as the converter writes it)."""
    f = d.n_ff_shexp
    return [TensorSpec(_name(T.FFN_GATE_INP_SHEXP, "weight", il), (d.n_embd,), "weight", QT.F32),
            TensorSpec(_name(T.FFN_GATE_SHEXP, "weight", il), (d.n_embd, f), "weight", wt),
            TensorSpec(_name(T.FFN_UP_SHEXP, "weight", il), (d.n_embd, f), "weight", wt),
            TensorSpec(_name(T.FFN_DOWN_SHEXP, "weight", il), (f, d.n_embd), "weight", wt)]


_FRESH_MAX = 1 << 20         # tensors up to this many elements get fresh random values
_RESERVOIR = 1 << 22         # elements per type in the reservoir large tensors are cut from
_PIECE = 1 << 22             # most elements generated and written at once
# std of a uniformly random quant: int8 in [-128, 127] (q8_0), nibble - 8 in [-8, 7] (q4_0)
_QUANT_STD = {QT.Q8_0: float(np.sqrt((256**2 - 1) / 12)), QT.Q4_0: float(np.sqrt((16**2 - 1) / 12))}


class _Random:
    """Encoded random tensor bytes: fresh for small tensors, windows of a fixed reservoir for large ones.

    Reservoirs hold _RESERVOIR already encoded elements per type (twice, so any window fits), so writing
    a large tensor costs a slice per piece and the file is written at disk speed.
    """

    def __init__(self, seed: int, std: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.std = std
        self._reservoirs: dict[tuple[QT, float], np.ndarray] = {}

    def encode(self, qtype: QT, n: int, scale: float = 1.0) -> np.ndarray:
        """n fresh random elements of type qtype and std self.std * scale, as bytes (n is a multiple of the
        type's block size)."""
        std = self.std * scale
        if qtype in (QT.F32, QT.F16):
            x = self.rng.standard_normal(n, dtype=np.float32) * np.float32(std)
            return x.astype(np.float32 if qtype == QT.F32 else np.float16).view(np.uint8)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        nb = n // block
        out = np.empty((nb, block_bytes), dtype=np.uint8)
        out[:, 2:] = np.frombuffer(self.rng.bytes(nb * (block_bytes - 2)), dtype=np.uint8).reshape(nb, -1)
        # random-sign scales: a uniform nibble - 8 has mean -0.5, the sign keeps the weights zero-mean
        d = np.float16(std / _QUANT_STD[qtype])
        scales = np.where(self.rng.integers(0, 2, nb, dtype=np.uint8) == 1, -d, d).astype(np.float16)
        out[:, :2] = scales.view(np.uint8).reshape(nb, 2)
        return out.reshape(-1)

    def window(self, qtype: QT, n: int, scale: float = 1.0) -> np.ndarray:
        """n elements (n <= _RESERVOIR) cut from the reservoir of (type, scale) at a random block offset."""
        res = self._reservoirs.get((qtype, scale))
        if res is None:
            r = self.encode(qtype, _RESERVOIR, scale)
            res = self._reservoirs[(qtype, scale)] = np.concatenate([r, r])
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        start = int(self.rng.integers(0, _RESERVOIR // block)) * block_bytes
        return res[start:start + n // block * block_bytes]


def _delta_net_values(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """F32 values for the delta-net's own parameters, as an untrained real model has them (small tensors)."""
    n = spec.n_elements
    if spec.kind == "conv":        # depthwise conv: fan-in d_conv (ne[0]) scale
        return rng.standard_normal(n, dtype=np.float32) / np.float32(np.sqrt(spec.ne[0]))
    if spec.kind == "decay":       # ssm_a = -exp(A_log), A ~ U(1, 16) (HF inits A ~ U(0, 16)): strictly negative
        return -rng.uniform(1.0, 16.0, n).astype(np.float32)
    if spec.kind == "dt_bias":     # softplus^-1 of a log-uniform dt in [1e-3, 0.1] (Mamba2's dt init)
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), n))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
    raise ValueError(f"unknown tensor kind {spec.kind!r} ({spec.name})")


# echo=True: the projections that write into the residual stream, and their weights' scale. With them small the
# last token's own embedding dominates the final hidden state, so (tied embeddings) the model predicts the token
# it was given, by a margin of ~sqrt(n_embd) logits over the rest: greedy decoding repeats it, and no kernel's
# summation order can flip the choice. The compute is a real model's; what it predicts is certain.
ECHO_SCALE = 1e-3
_RESIDUAL_WRITERS = ("attn_output.", "ffn_down.", "ffn_down_exps.", "ffn_down_shexp.", "ssm_out.")


def _pieces(spec: TensorSpec, rnd: _Random) -> Iterator[np.ndarray]:
    """The tensor's bytes, in pieces of at most _PIECE elements."""
    n = spec.n_elements
    if spec.kind == "norm":
        yield np.ones(n, dtype=np.float32).view(np.uint8)
        return
    if spec.kind in ("conv", "decay", "dt_bias"):
        assert spec.qtype == QT.F32, spec
        yield _delta_net_values(spec, rnd.rng).view(np.uint8)
        return
    if spec.kind == "scale":
        yield rnd.rng.uniform(0.5, 1.5, n).astype(np.float32).view(np.uint8)
        return
    if spec.kind == "rope_freqs":
        # Gemma 4's proportional RoPE: a first part of the pairs at their own frequency, then slower ones, then
        # pairs that never rotate (a factor so large the angle is 0), as the converter writes them.
        f = np.ones(n, dtype=np.float32)
        f[n // 2:] = rnd.rng.uniform(1.0, 8.0, n - n // 2)
        f[3 * n // 4:] = 1e30
        yield f.view(np.uint8)
        return
    if spec.kind == "eh_echo":   # [I, 0]: the MTP block's input is its normed token embedding (F32 rows of 2 * n_embd)
        e = spec.ne[1]
        w = np.zeros((e, 2 * e), dtype=np.float32)
        w[:, :e] = np.eye(e, dtype=np.float32)
        yield w.reshape(-1).view(np.uint8)
        return
    scale = ECHO_SCALE if spec.kind == "echo" else 1.0
    for p0 in range(0, n, _PIECE):
        m = min(_PIECE, n - p0)
        yield rnd.encode(spec.qtype, m, scale) if n <= _FRESH_MAX else rnd.window(spec.qtype, m, scale)


# ---- the file -------------------------------------------------------------------------------------

def _check_shape(arch: str, weight_type: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, head_dim: int,
                 n_ff: int, n_vocab: int, n_ctx_train: int, n_layer_dense_lead: int = 0) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r} (expected one of {', '.join(ARCHS)})")
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"unknown weight_type {weight_type!r} (expected one of {', '.join(WEIGHT_TYPES)})")
    dims = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_ff=n_ff,
                n_vocab=n_vocab, n_ctx_train=n_ctx_train)
    if arch == "qwen35moe":
        # its FFN is the experts: Qwen3.5 MoE configs have no intermediate_size, the converter no feed_forward_length
        if n_ff:
            raise ValueError(f"qwen35moe has no dense FFN: n_ff must be 0 (its widths are n_ff_exp and n_ff_shexp), "
                             f"got {n_ff}")
        del dims["n_ff"]
    if arch == "laguna" and not n_layer_dense_lead:
        del dims["n_ff"]   # only its leading dense layers have a dense FFN
    for k, v in dims.items():
        if int(v) <= 0:
            raise ValueError(f"{k} must be positive, got {v}")
    if n_head % n_head_kv:
        raise ValueError(f"n_head={n_head} must be a multiple of n_head_kv={n_head_kv}")
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even (RoPE rotates pairs)")
    if arch == "qwen2" and head_dim * n_head != n_embd:
        raise ValueError(f"qwen2 needs head_dim * n_head == n_embd (llama.cpp's qwen2 has square q/o), "
                         f"got {head_dim} * {n_head} != {n_embd}")
    _check_rows(weight_type, n_embd=n_embd, n_ff=n_ff, head_dim_x_n_head=head_dim * n_head)


def _check_rows(weight_type: str, **rows: int) -> None:
    """Quantized rows (ne[0]) come in whole blocks. Real models' rows all do; tensors whose rows may not
    (1-D ones, ssm_conv1d, the routers) are F32, as the converter writes them."""
    block = gguf.GGML_QUANT_SIZES[WEIGHT_TYPES[weight_type]][0]
    for k, v in rows.items():
        if v % block:
            raise ValueError(f"{weight_type} rows come in blocks of {block}: {k}={v} is not a multiple")


def _check_moe(arch: str, weight_type: str, n_expert: int, n_expert_used: int, n_ff_exp: int, n_ff_shexp: int) -> None:
    if arch == "gemma4" and n_expert:   # optional experts, beside the dense FFN that acts as the shared one
        if n_ff_shexp:
            raise ValueError(f"gemma4's shared expert is its dense FFN (n_ff): n_ff_shexp must be 0, got {n_ff_shexp}")
        if not 0 < n_expert_used <= n_expert or n_ff_exp <= 0:
            raise ValueError(f"gemma4 experts need 0 < n_expert_used <= n_expert and n_ff_exp > 0, got "
                             f"{n_expert_used} / {n_expert} / {n_ff_exp}")
        _check_rows(weight_type, n_ff_exp=n_ff_exp)
        return
    if arch not in MOE_ARCHS:
        if n_expert or n_expert_used or n_ff_exp or n_ff_shexp:
            raise ValueError(f"experts (n_expert, n_expert_used, n_ff_exp, n_ff_shexp) are {' / '.join(MOE_ARCHS)} "
                             f"options, not {arch}'s")
        return
    for k, v in dict(n_expert=n_expert, n_expert_used=n_expert_used, n_ff_exp=n_ff_exp).items():
        if int(v) <= 0:
            raise ValueError(f"{arch} needs {k} > 0, got {v}")
    if n_expert_used > n_expert:
        raise ValueError(f"n_expert_used={n_expert_used} must be at most n_expert={n_expert}")
    if arch in ("qwen35moe", "laguna") and n_ff_shexp <= 0:
        # libllama would fall back to n_ff (qwen35moe files have none) or n_ff_exp (laguna: the converter writes it)
        raise ValueError(f"{arch} needs a shared expert: n_ff_shexp > 0, got {n_ff_shexp}")
    if arch == "qwen3moe" and n_ff_shexp:
        raise ValueError(f"qwen3moe has no shared expert: n_ff_shexp must be 0, got {n_ff_shexp}")
    _check_rows(weight_type, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp)


def _check_delta_net(arch: str, weight_type: str, n_layer: int, ssm_d_conv: int, ssm_d_state: int, ssm_n_group: int,
                     ssm_dt_rank: int, full_attention_interval: int | None) -> None:
    shape = dict(ssm_d_conv=ssm_d_conv, ssm_d_state=ssm_d_state, ssm_n_group=ssm_n_group, ssm_dt_rank=ssm_dt_rank)
    if arch not in HYBRID_ARCHS:
        if any(shape.values()) or full_attention_interval is not None:
            raise ValueError(f"delta-net layers ({', '.join(shape)}, full_attention_interval) are "
                             f"{' / '.join(HYBRID_ARCHS)} options, not {arch}'s")
        return
    for k, v in shape.items():
        if int(v) <= 0:
            raise ValueError(f"{arch} needs {k} > 0 (the gated delta-net's shape), got {v}")
    if ssm_dt_rank % ssm_n_group:
        # libllama repeats (or broadcasts) the key heads over the value heads
        raise ValueError(f"ssm_dt_rank={ssm_dt_rank} (value heads) must be a multiple of ssm_n_group={ssm_n_group} "
                         f"(key heads)")
    interval = 4 if full_attention_interval is None else full_attention_interval
    if interval <= 0:
        raise ValueError(f"full_attention_interval must be positive, got {interval}")
    if interval > n_layer:
        # libllama sizes a KV cache for the attention layers and fails on an empty one (GGML_ASSERT(buffer))
        raise ValueError(f"{arch} needs a full-attention layer: full_attention_interval={interval} > n_layer={n_layer}")
    _check_rows(weight_type, ssm_d_state_x_ssm_dt_rank=ssm_d_state * ssm_dt_rank)   # ssm_out's rows


def _check_gemma4(arch: str, weight_type: str, n_layer: int, head_dim_swa: int, n_ff_layers: Sequence[int],
                  n_embd_per_layer: int, n_shared_kv: int, swa_layers: list[bool], split_experts: bool) -> None:
    if arch != "gemma4":
        if head_dim_swa or n_ff_layers or n_embd_per_layer or n_shared_kv or split_experts:
            raise ValueError(f"head_dim_swa, n_ff_layers, n_embd_per_layer, n_shared_kv and split_experts are gemma4 "
                             f"options, not {arch}'s")
        return
    if not swa_layers:
        raise ValueError("gemma4 needs a sliding window (n_swa > 0): libllama requires the window and its pattern")
    if head_dim_swa <= 0 or head_dim_swa % 2:
        raise ValueError(f"gemma4 needs an even head_dim_swa > 0 (the sliding-window layers' head size), got {head_dim_swa}")
    if n_ff_layers and (len(n_ff_layers) != n_layer or min(n_ff_layers) <= 0):
        raise ValueError(f"n_ff_layers needs {n_layer} positive widths, got {list(n_ff_layers)}")
    if n_embd_per_layer < 0:
        raise ValueError(f"n_embd_per_layer must be >= 0, got {n_embd_per_layer}")
    # libllama's cache reuse wants the layer before the cut global and the one before that local; other cuts are
    # written anyway (the loader's refusal of them is tested)
    if not 0 <= n_shared_kv <= n_layer - 2:
        raise ValueError(f"n_shared_kv={n_shared_kv} must leave at least 2 layers with K/V of their own")
    _check_rows(weight_type, head_dim_swa=head_dim_swa, n_embd_per_layer=n_embd_per_layer,
                **{f"n_ff_layers[{i}]": f for i, f in enumerate(n_ff_layers)})


def _default_sections(n_rot: int) -> list[int]:
    """M-RoPE sections (pairs per t/h/w position) that split n_rot / 2 pairs as Qwen3.5 does: 32 -> [11, 11, 10, 0]."""
    q, r = divmod(n_rot // 2, 3)
    return [q + (r > 0), q + (r > 1), q, 0]


def _rope_dims(arch: str, head_dim: int, n_rot: int | None,
               rope_sections: Sequence[int] | None) -> tuple[int, list[int] | None]:
    """(rope.dimension_count, rope.dimension_sections or None), checked. The qwen35 families rotate part of the
    head (n_rot defaults to head_dim / 4, partial_rotary_factor 0.25 as released) with interleaved M-RoPE; laguna's
    and gemma4's global layers may (n_rot, default head_dim; no sections)."""
    if arch not in PARTIAL_ROTARY_ARCHS:
        if (n_rot is not None and n_rot != head_dim) or rope_sections is not None:
            raise ValueError(f"partial rotary (n_rot) and rope_sections are {' / '.join(PARTIAL_ROTARY_ARCHS)} "
                             f"options, not {arch}'s (which rotates all head_dim={head_dim})")
        return head_dim, None
    if n_rot is None:
        n_rot = head_dim // 4 if arch in HYBRID_ARCHS else head_dim
    if n_rot <= 0 or n_rot > head_dim or n_rot % 2:
        raise ValueError(f"n_rot={n_rot} must be even and in (0, head_dim={head_dim}]")
    if arch not in HYBRID_ARCHS:
        if rope_sections is not None:
            raise ValueError(f"rope_sections are {' / '.join(HYBRID_ARCHS)} options, not {arch}'s")
        return n_rot, None
    sections = _default_sections(n_rot) if rope_sections is None else [int(v) for v in rope_sections]
    if len(sections) != 4 or min(sections) < 0 or 2 * sum(sections) != n_rot:
        # ggml's rope_multi gives each of the n_rot / 2 rotated pairs a section (t, h, w, extra)
        raise ValueError(f"rope_sections={sections} must be 4 non-negative pair counts summing to n_rot / 2 = "
                         f"{n_rot // 2}")
    return n_rot, sections


def _swa_layers(arch: str, n_layer: int, n_swa: int, swa_pattern: int | Sequence[bool] | None) -> list[bool]:
    """Which layers have the sliding window, as libllama reads the pattern: one flag per layer, or a period with
    one global layer in each, the last (gemma3, default 6) or the first (laguna, default 4). []: no window."""
    if not n_swa:
        if swa_pattern is not None:
            raise ValueError("swa_pattern needs a sliding window (n_swa > 0)")
        return []
    if swa_pattern is not None and not isinstance(swa_pattern, int):
        flags = [bool(f) for f in swa_pattern]
        if len(flags) != n_layer:
            raise ValueError(f"swa_pattern has {len(flags)} flags for {n_layer} layers")
    else:
        period = swa_pattern if swa_pattern is not None else (4 if arch == "laguna" else 6)
        first = arch == "laguna"
        flags = [period == 0 or (il % period != 0 if first else il % period < period - 1) for il in range(n_layer)]
    if all(flags):
        raise ValueError("swa_pattern leaves no global layer")
    return flags


def _laguna_heads(arch: str, n_layer: int, n_head: int, n_head_kv: int, n_head_swa: int, swa_layers: list[bool],
                  n_rot_swa: int | None, head_dim: int, n_layer_dense_lead: int, expert_weights_scale: float | None,
                  gate_per_element: Sequence[bool]) -> list[int]:
    """laguna's per-layer query head counts (written as an array, as its converter does), its options checked;
    [] for the other families, which must not use those options."""
    if arch != "laguna":
        if n_head_swa or n_rot_swa is not None or n_layer_dense_lead or expert_weights_scale is not None \
                or gate_per_element:
            raise ValueError(f"n_head_swa, n_rot_swa, n_layer_dense_lead, expert_weights_scale and gate_per_element "
                             f"are laguna options, not {arch}'s")
        return []
    n_head_swa = n_head_swa or n_head
    if n_head_swa % n_head_kv:
        raise ValueError(f"n_head_swa={n_head_swa} must be a multiple of n_head_kv={n_head_kv}")
    if n_rot_swa is not None and (n_rot_swa <= 0 or n_rot_swa > head_dim or n_rot_swa % 2):
        raise ValueError(f"n_rot_swa={n_rot_swa} must be even and in (0, head_dim={head_dim}]")
    if not 0 <= n_layer_dense_lead <= n_layer:
        raise ValueError(f"n_layer_dense_lead={n_layer_dense_lead} must be in [0, n_layer={n_layer}]")
    if gate_per_element and len(gate_per_element) != n_layer:
        raise ValueError(f"gate_per_element has {len(gate_per_element)} flags for {n_layer} layers")
    return [n_head_swa if swa_layers and swa_layers[il] else n_head for il in range(n_layer)]


def write_random_gguf(path: str | Path, arch: str, *, n_layer: int, n_embd: int, n_head: int, n_head_kv: int,
                      head_dim: int, n_ff: int = 0, n_vocab: int, n_ctx_train: int, weight_type: str = "f32",
                      tied_embeddings: bool = False, seed: int = 0, rope_freq_base: float = 10000.0,
                      rms_eps: float = 1e-6, weight_std: float = 0.02, name: str | None = None,
                      omit_tensors: Iterable[str] = (), n_swa: int = 0, swa_pattern: int | Sequence[bool] | None = None,
                      rope_freq_base_swa: float | None = None, rope_scaling_factor: float | None = None,
                      logit_softcap: float | None = None, n_expert: int = 0, n_expert_used: int = 0,
                      n_ff_exp: int = 0, n_ff_shexp: int = 0, ssm_d_conv: int = 0, ssm_d_state: int = 0,
                      ssm_n_group: int = 0, ssm_dt_rank: int = 0, full_attention_interval: int | None = None,
                      n_rot: int | None = None, rope_sections: Sequence[int] | None = None, echo: bool = False,
                      rope_scaling_type: str = "linear", rope_orig_ctx: int | None = None, n_head_swa: int = 0,
                      n_rot_swa: int | None = None, n_layer_dense_lead: int = 0,
                      expert_weights_scale: float | None = None, gate_per_element: Sequence[bool] = (),
                      head_dim_swa: int = 0, n_ff_layers: Sequence[int] = (), n_embd_per_layer: int = 0,
                      n_shared_kv: int = 0, split_experts: bool = False, mtp: bool = False) -> Path:
    """Write a random-weights GGUF of family `arch` to `path`; returns the path.

    gemma3 and laguna: n_swa (sliding window; 0 = every layer global), swa_pattern (a period: one global layer
    in each, the last (gemma3, libllama's default 6) or the first (laguna, default 4); or one flag per layer,
    True = sliding window), rope_freq_base_swa. gemma3: logit_softcap (final_logit_softcapping).
    rope_scaling_factor: RoPE scaling of the global layers, rope_scaling_type "linear" or "yarn" (with
    rope_orig_ctx, the context before scaling; default n_ctx_train).

    laguna: n_head_swa (query heads of the sliding-window layers; default n_head), n_rot (the global layers'
    rotated dims) and n_rot_swa (the local ones'), n_layer_dense_lead (leading layers with a dense FFN of n_ff),
    expert_weights_scale (routed weights' scale), gate_per_element (per layer; default per-head gates).

    gemma4: head_dim_swa (the sliding-window layers' head size; head_dim is the global layers'), n_ff_layers (the
    FFN width of each layer; default n_ff everywhere), n_embd_per_layer (per-layer embeddings; 0: none),
    n_shared_kv (the last layers without K/V of their own), n_expert / n_expert_used / n_ff_exp (routed experts on
    every layer beside the dense FFN; 0: none; split_experts: separate gate and up tensors with per-expert scales
    instead of the fused gate_up the converter writes), logit_softcap. The window's pattern is written as one flag per layer.

    qwen3moe / qwen35moe: n_expert routed experts of width n_ff_exp, n_expert_used a token; qwen35moe also a
    shared expert of width n_ff_shexp, and no n_ff (qwen3moe writes n_ff, which its graph does not use).
    qwen35 / qwen35moe: ssm_d_conv (conv taps), ssm_d_state (key and value head size), ssm_n_group (key heads),
    ssm_dt_rank (value heads), full_attention_interval (default 4: layers 3, 7, ... attend), n_rot (rotated
    head dims, default head_dim / 4) and rope_sections (4 M-RoPE pair counts summing to n_rot / 2; default
    the n_rot / 2 pairs split in three as Qwen3.5's [11, 11, 10, 0]).

    weight_type applies to every 2-D and 3-D weight (embeddings, output and experts included) but the expert
    routers and ssm_conv1d; those, norms, biases and the other 1-D tensors are F32, as the converter writes them.
    tied_embeddings: no output.weight (the model reuses token_embd.weight, like small Qwen models).
    echo: a model that predicts the token it was given, with certainty (see ECHO_SCALE; implies tied
    embeddings): speculative decoding with the model as its own draft then keeps every draft (and, with mtp,
    with its multi-token-prediction layer as the draft).
    mtp: one multi-token-prediction (nextn) layer after the trunk (qwen35 / qwen35moe; see the module doc).
    omit_tensors: tensor names to leave out (tests of the loader's error for a missing tensor).
    """
    _check_shape(arch, weight_type, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_ctx_train,
                 n_layer_dense_lead)
    if arch not in SWA_ARCHS and (n_swa or swa_pattern is not None or rope_freq_base_swa):
        raise ValueError(f"sliding windows are {' / '.join(SWA_ARCHS)} options, not {arch}'s")
    if arch not in ("gemma3", "gemma4") and logit_softcap:
        raise ValueError(f"logit soft-capping is a gemma3 / gemma4 option, not {arch}'s")
    _check_moe(arch, weight_type, n_expert, n_expert_used, n_ff_exp, n_ff_shexp)
    _check_delta_net(arch, weight_type, n_layer, ssm_d_conv, ssm_d_state, ssm_n_group, ssm_dt_rank,
                     full_attention_interval)
    n_rot, rope_sections = _rope_dims(arch, head_dim, n_rot, rope_sections)
    swa_layers = _swa_layers(arch, n_layer, n_swa, swa_pattern)
    _check_gemma4(arch, weight_type, n_layer, head_dim_swa, n_ff_layers, n_embd_per_layer, n_shared_kv, swa_layers,
                  split_experts)
    heads = _laguna_heads(arch, n_layer, n_head, n_head_kv, n_head_swa, swa_layers, n_rot_swa, head_dim,
                          n_layer_dense_lead, expert_weights_scale, gate_per_element)
    if mtp and arch not in HYBRID_ARCHS:
        raise ValueError(f"mtp (a multi-token-prediction layer) is a {' / '.join(HYBRID_ARCHS)} option, not {arch}'s")
    n_nextn = 1 if mtp else 0
    if rope_scaling_type not in ("linear", "yarn"):
        raise ValueError(f"rope_scaling_type must be 'linear' or 'yarn', got {rope_scaling_type!r}")
    if full_attention_interval is None:
        full_attention_interval = 4    # libllama's default for a file without the key; written anyway
    path = Path(path)
    tied_embeddings = tied_embeddings or echo
    tok = build_tokenizer(arch, n_vocab)
    specs = tensor_specs(arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                         head_dim=head_dim, n_ff=n_ff, n_vocab=n_vocab, weight_type=weight_type,
                         tied_embeddings=tied_embeddings, n_expert=n_expert, n_ff_exp=n_ff_exp, n_ff_shexp=n_ff_shexp,
                         ssm_d_conv=ssm_d_conv, ssm_d_state=ssm_d_state, ssm_n_group=ssm_n_group,
                         ssm_dt_rank=ssm_dt_rank, full_attention_interval=full_attention_interval,
                         swa_layers=swa_layers, n_head_swa=n_head_swa or n_head, n_layer_dense_lead=n_layer_dense_lead,
                         gate_per_element=gate_per_element, head_dim_swa=head_dim_swa, n_ff_layers=n_ff_layers,
                         n_embd_per_layer=n_embd_per_layer, split_experts=split_experts, n_nextn=n_nextn)
    omit = set(omit_tensors)
    unknown = omit - {s.name for s in specs}
    if unknown:
        raise ValueError(f"omit_tensors names tensors this model does not have: {sorted(unknown)}")
    specs = [s for s in specs if s.name not in omit]
    if echo:
        specs = [TensorSpec(s.name, s.ne, "echo", s.qtype) if any(r in s.name for r in _RESIDUAL_WRITERS) else s
                 for s in specs]
        specs = [_echo_nextn(s) if ".nextn." in s.name else s for s in specs]

    w = gguf.GGUFWriter(path, arch)
    w.add_name(name or f"random-{arch}-{n_layer}L-{n_embd}E-{weight_type}")
    w.add_file_type(int(_FILE_TYPES[weight_type]))
    if weight_type in ("q8_0", "q4_0"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer + n_nextn)
    if n_ff_layers:
        w.add_feed_forward_length([int(f) for f in n_ff_layers])
    elif n_ff:
        w.add_feed_forward_length(n_ff)
    w.add_head_count(heads if heads else n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(n_rot)
    w.add_rope_freq_base(rope_freq_base)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_vocab_size(n_vocab)
    if rope_scaling_factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN if rope_scaling_type == "yarn" else gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scaling_factor)
        if rope_orig_ctx:
            w.add_rope_scaling_orig_ctx_len(rope_orig_ctx)
    if n_swa:
        w.add_sliding_window(n_swa)
        if arch == "gemma4":   # libllama's gemma4 reads only the per-layer flags
            w.add_sliding_window_pattern(swa_layers)
        elif swa_pattern is not None:
            w.add_sliding_window_pattern(swa_pattern if isinstance(swa_pattern, int) else [bool(f) for f in swa_pattern])
        if rope_freq_base_swa:
            w.add_rope_freq_base_swa(rope_freq_base_swa)
    if logit_softcap:
        w.add_final_logit_softcapping(logit_softcap)
    if arch in MOE_ARCHS:
        _add_moe_keys(w, n_expert, n_expert_used, n_ff_exp, n_ff_shexp)
    if arch == "laguna":   # what the converter's LagunaModel writes besides
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(1.0 if expert_weights_scale is None else expert_weights_scale)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_leading_dense_block_count(n_layer_dense_lead)
        if n_swa:
            w.add_rope_dimension_count_swa(head_dim if n_rot_swa is None else n_rot_swa)
    if arch == "gemma4":   # what the converter's Gemma4 class writes besides
        w.add_key_length_swa(head_dim_swa)
        w.add_value_length_swa(head_dim_swa)
        w.add_rope_dimension_count_swa(head_dim_swa)
        w.add_embedding_length_per_layer_input(n_embd_per_layer)
        if n_shared_kv:
            w.add_shared_kv_layers(n_shared_kv)
        if n_expert:
            _add_moe_keys(w, n_expert, n_expert_used, n_ff_exp, 0)
    if arch in HYBRID_ARCHS:
        _add_delta_net_keys(w, ssm_d_conv, ssm_d_state, ssm_n_group, ssm_dt_rank, full_attention_interval,
                            rope_sections)
    if n_nextn:   # as the converter's Qwen3.5 classes (config.json has layer_types): a flag for every block
        w.add_nextn_predict_layers(n_nextn)
        w.add_array(f"{arch}.attention.recurrent_layers",
                    [(il + 1) % full_attention_interval != 0 for il in range(n_layer)] + [False] * n_nextn)

    _add_tokenizer(w, tok)
    for s in specs:
        # numpy order (reversed ne); a non-uint8 dtype tells gguf-py the shape is in elements, not bytes
        w.add_tensor_info(s.name, tuple(reversed(s.ne)), np.dtype(np.float32), s.nbytes, raw_dtype=s.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    _write_tensor_data(w, specs, _Random(seed, weight_std))
    w.close()
    return path


def _echo_nextn(spec: TensorSpec) -> TensorSpec:
    """An echo model's nextn tensors: norms of ones, and an eh_proj that passes the normed embedding through (F32)."""
    if spec.kind == "eh_proj":
        return TensorSpec(spec.name, spec.ne, "eh_echo", QT.F32)
    return TensorSpec(spec.name, spec.ne, "norm", QT.F32) if spec.kind == "scale" else spec


def _add_moe_keys(w: gguf.GGUFWriter, n_expert: int, n_expert_used: int, n_ff_exp: int, n_ff_shexp: int) -> None:
    """What the converter's Qwen2MoeModel writes (expert_count / expert_used_count come from TextModel)."""
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_expert_feed_forward_length(n_ff_exp)
    if n_ff_shexp:
        w.add_expert_shared_feed_forward_length(n_ff_shexp)


def _add_delta_net_keys(w: gguf.GGUFWriter, ssm_d_conv: int, ssm_d_state: int, ssm_n_group: int, ssm_dt_rank: int,
                        full_attention_interval: int, rope_sections: Sequence[int] | None) -> None:
    """What the converter's Qwen3NextModel / Qwen3.5 classes write; libllama requires every one but the interval.
    The converter also writes attention.recurrent_layers when config.json lists layer_types; the interval alone
    says the same here (and is all libllama reads without the array)."""
    w.add_ssm_conv_kernel(ssm_d_conv)
    w.add_ssm_state_size(ssm_d_state)
    w.add_ssm_group_count(ssm_n_group)
    w.add_ssm_time_step_rank(ssm_dt_rank)
    w.add_ssm_inner_size(ssm_d_state * ssm_dt_rank)    # linear_value_head_dim * linear_num_value_heads
    w.add_full_attention_interval(full_attention_interval)
    w.add_rope_dimension_sections(list(rope_sections or ()))


def _add_tokenizer(w: gguf.GGUFWriter, tok: TokenizerSpec) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok.pre)
    w.add_token_list(tok.tokens)
    w.add_token_types(tok.token_types)
    w.add_token_merges(tok.merges)
    w.add_bos_token_id(tok.bos)
    w.add_eos_token_id(tok.eos)
    w.add_pad_token_id(tok.pad)
    w.add_add_bos_token(tok.add_bos)
    w.add_chat_template(tok.chat_template)


def _write_tensor_data(w: gguf.GGUFWriter, specs: list[TensorSpec], rnd: _Random) -> None:
    """Streams every tensor piece by piece, laid out as GGUFWriter.write_tensor_data does: each tensor
    starts at an aligned offset (the offsets in the tensor infos already written assume exactly this)."""
    assert w.fout is not None and len(w.fout) == 1
    fout = w.fout[0]
    for s in specs:
        w.write_padding(fout, fout.tell())
        written = 0
        for piece in _pieces(s, rnd):
            fout.write(memoryview(piece))
            written += piece.nbytes
        assert written == s.nbytes, (s.name, written, s.nbytes)
        w.write_padding(fout, s.nbytes)


def write_preset(path: str | Path, shape: str, **overrides) -> Path:
    """write_random_gguf with a named shape from SHAPES; keyword arguments override the shape's values."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    kw = {**SHAPES[shape], **overrides}
    return write_random_gguf(path, kw.pop("arch"), **kw)


def preset_files(root: str | Path, variants: dict) -> Callable[[str], str]:
    """variant -> the path of its GGUF under root, written on first use: variants maps a name to (shape,
    overrides, ...) (tests keep a tolerance or more after them)."""
    paths: dict[str, str] = {}

    def get(variant: str) -> str:
        if variant not in paths:
            shape, overrides = variants[variant][:2]
            paths[variant] = str(write_preset(Path(root) / f"{variant}.gguf", shape, **overrides))
        return paths[variant]

    return get


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvflash_ggml.testing.random_gguf",
                                 description="Write a GGUF model with random weights (" + " / ".join(ARCHS) + ").")
    ap.add_argument("out", help="output .gguf path")
    ap.add_argument("--shape", default="tiny-llama", choices=sorted(SHAPES), help="named shape (default tiny-llama)")
    ap.add_argument("--type", dest="weight_type", default="f16", choices=list(WEIGHT_TYPES),
                    help="type of the 2-D weights (default f16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tied-embeddings", action="store_true", help="no output.weight: reuse token_embd.weight")
    ap.add_argument("--echo", action="store_true",
                    help="a model that predicts the token it was given, with certainty (speculation's upper bound)")
    ap.add_argument("--n-layer", type=int, default=None,
                    help="override the shape's layer count (hybrid shapes keep their full-attention interval)")
    ap.add_argument("--n-ctx-train", type=int, default=None, help="override the shape's trained context")
    ap.add_argument("--mtp", action="store_true",
                    help="add a multi-token-prediction (nextn) layer after the trunk (qwen35 / qwen35moe shapes)")
    args = ap.parse_args(argv)
    overrides = dict(weight_type=args.weight_type, seed=args.seed, tied_embeddings=args.tied_embeddings, echo=args.echo)
    if args.mtp:
        overrides["mtp"] = True
    if args.n_layer is not None:
        overrides["n_layer"] = args.n_layer
    if args.n_ctx_train is not None:
        overrides["n_ctx_train"] = args.n_ctx_train
    t0 = time.perf_counter()
    try:
        path = write_preset(args.out, args.shape, **overrides)
    except ValueError as e:
        ap.error(str(e))
    dt = time.perf_counter() - t0
    size = path.stat().st_size
    print(f"wrote {path} ({args.shape}, {args.weight_type}): {size / 2**20:.1f} MiB in {dt:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
