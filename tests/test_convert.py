# Guards issue 7: `python -m kvflash_ggml.convert` turns Hugging Face Qwen3 / Qwen2 / Llama checkpoints
# into GGUF files that this engine and libllama both load, compute and tokenize exactly as transformers
# does, and refuses every malformed checkpoint with a message that names the problem.
#
# Everything is built here: tiny random-weight models from transformers' config classes, and small
# byte-level BPE tokenizers trained with `tokenizers` on a few lines of text. torch and transformers
# are hard requirements (imported, never skipped): CI installs them with the `test` extra.
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvflash_ggml import _core
from kvflash_ggml.convert import ConversionError, convert
from kvflash_ggml.convert.vocab import LLAMA3_REGEX, QWEN2_REGEX

transformers.logging.set_verbosity_error()
torch.set_num_threads(2)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. I'm sure you'll see it's true, they've said.",
    "def main(argv):\n    return sum(x * 2 for x in range(12345))  # code, with   spaces\n\n",
    "Numbers: 3.14159, 2024-11-01, 1000000 and 42; emails like a.b@c.de!",
    "Ünïcödé: café, naïve, Straße; 日本語のテキスト; emoji 🙂🚀; Ελληνικά.",
    "\tTabs\tand\r\nWindows line ends\r\n, trailing spaces   ",
]
SAMPLES = CORPUS + [
    "Hello world", " leading space", "multiple     spaces and\n\n\nnewlines", "12 345 6789 1234567",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n", "", "a", "???!!!...",
    "don't DON'T We'Ll", "mixed 日本 and ASCII 123abc456",
]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# tokenizer flavour -> (pre-tokenizer, model.ignore_merges, special tokens, BOS added by the post-processor)
FLAVOURS = {
    "qwen2": (lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_REGEX), "isolated"),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
              False, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None),
    "gpt2": (lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
             False, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None),
    "llama3": (lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_REGEX), "isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
               True, ["<|begin_of_text|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"], "<|begin_of_text|>"),
}

# checkpoint kind -> (GGUF arch, config class, model class, tokenizer flavour, config overrides);
# each covers different features
ARCHS = {
    "qwen3": ("qwen3", transformers.Qwen3Config, transformers.Qwen3ForCausalLM, "qwen2",
              dict(head_dim=32, tie_word_embeddings=True, rope_theta=1e6)),   # head_dim != n_embd / n_head
    "qwen2": ("qwen2", transformers.Qwen2Config, transformers.Qwen2ForCausalLM, "gpt2",
              dict(tie_word_embeddings=False, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama": ("llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, "llama3",
              dict(tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 128})),
    "mistral": ("llama", transformers.MistralConfig, transformers.MistralForCausalLM, "llama3",
                dict(tie_word_embeddings=True, head_dim=None, bos_token_id=0, eos_token_id=1)),
}


def make_tokenizer(flavour: str) -> transformers.PreTrainedTokenizerFast:
    pre, ignore_merges, specials, bos = FLAVOURS[flavour]
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    eos = "<|eot_id|>" if bos else "<|im_end|>"
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                              pad_token="<|endoftext|>" if not bos else None)
    hf.chat_template = CHATML
    return hf


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that every mistake (a missed permutation, a wrong bias) moves the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def make_checkpoint(arch: str, path: Path, **overrides) -> Path:
    _, config_cls, model_cls, flavour, extra = ARCHS[arch]
    tok = make_tokenizer(flavour)
    n_vocab = (len(tok) + 63) // 64 * 64          # padded like real checkpoints: unused rows at the end
    kw = dict(vocab_size=n_vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    kw.update(extra)
    kw.update(overrides)
    torch.manual_seed(0)
    model = model_cls(config_cls(**kw)).eval()
    randomize(model, seed=len(arch))
    # llama: shards of ~40 KB, so the index path is exercised
    model.save_pretrained(path, max_shard_size="40KB" if arch == "llama" else "1GB")
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    return {arch: make_checkpoint(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def converted(checkpoints, tmp_path_factory) -> dict:
    """(arch, outtype) -> GGUF path, converted once per module."""
    root = tmp_path_factory.mktemp("gguf")
    cache = {}

    def get(arch: str, outtype: str) -> Path:
        if (arch, outtype) not in cache:
            out = root / f"{arch}-{outtype}.gguf"
            convert(checkpoints[arch], out, outtype=outtype)
            cache[(arch, outtype)] = out
        return cache[(arch, outtype)]
    return get


def hf_logits(src: Path, tokens: list) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def hf_tokenizer(src: Path) -> transformers.PreTrainedTokenizerFast:
    # Not AutoTokenizer: transformers 5 maps model_type qwen2/qwen3 to Qwen2Tokenizer, which replaces the
    # pre-tokenizer of tokenizer.json by Qwen2's own; the tokenizer under test is the one in tokenizer.json.
    return transformers.PreTrainedTokenizerFast.from_pretrained(src)


def sample_tokens(src: Path) -> list:
    tok = hf_tokenizer(src)
    ids = tok(SAMPLES[0] + SAMPLES[2] + SAMPLES[4], add_special_tokens=True).input_ids
    return ids[:48]


# Tolerance on max |ours - HF| / max |HF| over all positions and the whole vocabulary. Weight rounding
# dominates: f32 and bf16/f16 differ only by it (f16 keeps 11 significant bits, bf16 8), q8_0 keeps ~8 bits
# per 32-value block. The f32 bound leaves room for ggml's different summation order only.
TOLERANCE = {"f32": 2e-4, "f16": 5e-3, "bf16": 3e-2, "q8_0": 8e-2}


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers(arch, outtype, checkpoints, converted):
    src, path = checkpoints[arch], converted(arch, outtype)
    tokens = sample_tokens(src)
    ref = hf_logits(src, tokens)
    model = _core.Model(str(path), backend="cpu", n_threads=2)
    config = json.loads((src / "config.json").read_text())
    hp = model.hparams
    assert (hp.arch, hp.n_layer, hp.n_head, hp.n_head_kv, hp.head_dim_k, hp.n_ff, hp.n_vocab) == (
        ARCHS[arch][0], 2, 4, 2, config.get("head_dim") or 16, 96, config["vocab_size"])
    session = _core.Session(model, _core.SessionConfig(max_tokens=64, pool_tokens=0, attention="matmul",
                                                      kv_type="f32"))
    ours = session.forward(np.array(tokens, dtype=np.int32), 0, all_logits=True)
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err < TOLERANCE[outtype], f"{arch} {outtype}: relative max error {err:.2e}"
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.9


@pytest.mark.parametrize("arch", list(ARCHS))
def test_libllama_logits_match_transformers(arch, checkpoints, converted):
    """libllama reads the same file the same way (Q/K layout, biases, RoPE scaling, tied output)."""
    src, path = checkpoints[arch], converted(arch, "f32")
    tokens = sample_tokens(src)
    ref = hf_logits(src, tokens)
    theirs = _core.testing.LlamaReference(str(path), n_ctx=64, n_threads=2).decode(tokens, all_logits=True)
    err = np.abs(theirs - ref).max() / np.abs(ref).max()
    assert err < 2e-3, f"{arch}: libllama relative max error {err:.2e}"   # libllama keeps its KV cache in f16


def test_bf16_output(checkpoints, converted):
    src, path = checkpoints["qwen3"], converted("qwen3", "bf16")
    tokens = sample_tokens(src)
    ref = hf_logits(src, tokens)
    session = _core.Session(_core.Model(str(path), backend="cpu", n_threads=2),
                            _core.SessionConfig(max_tokens=64, attention="matmul", kv_type="f32"))
    ours = session.forward(np.array(tokens, dtype=np.int32), 0, all_logits=True)
    assert np.abs(ours - ref).max() / np.abs(ref).max() < TOLERANCE["bf16"]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_libllama_tokenizes_like_hf(arch, checkpoints, converted):
    src = checkpoints[arch]
    hf = hf_tokenizer(src)
    vocab = _core.Vocab(str(converted(arch, "f16")))
    for text in SAMPLES:
        want = hf(text, add_special_tokens=True).input_ids
        got = list(vocab.tokenize(text, add_special=True, parse_special=True))
        assert got == want, f"{arch}: {text!r}"
        assert vocab.detokenize(got, remove_special=True) == hf.decode(want, skip_special_tokens=True)
    assert vocab.add_bos == (ARCHS[arch][3] == "llama3")
    assert vocab.eos == hf.eos_token_id
    assert vocab.chat_template == CHATML == hf.chat_template


def test_gguf_metadata(checkpoints, converted):
    """RoPE settings are carried over: theta, linear scaling, llama3 frequency factors."""
    from gguf import GGUFReader

    def field(reader, key):
        f = reader.fields[key]
        return f.parts[f.data[0]].tolist()[0] if len(f.data) == 1 else None

    qwen3 = GGUFReader(converted("qwen3", "f16"))
    assert field(qwen3, "qwen3.rope.freq_base") == 1e6
    assert field(qwen3, "qwen3.attention.key_length") == 32
    assert "output.weight" not in {t.name for t in qwen3.tensors}                # tied: libllama reuses token_embd
    qwen2 = GGUFReader(converted("qwen2", "f16"))
    assert field(qwen2, "qwen2.rope.scaling.factor") == 2.0
    llama = GGUFReader(converted("llama", "f16"))
    freqs = next(t for t in llama.tensors if t.name == "rope_freqs.weight").data
    assert freqs[0] == 1.0 and freqs[-1] == 8.0 and 1.0 < freqs[2] < 8.0
    assert bytes(llama.fields["tokenizer.ggml.pre"].parts[-1]).decode() == "llama-bpe"


def run_cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "kvflash_ggml.convert", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli(checkpoints, tmp_path):
    out = tmp_path / "m.gguf"
    r = run_cli(checkpoints["qwen2"], out, "--outtype", "q8_0", "--quiet")
    assert r.returncode == 0, r.stderr
    assert _core.Model(str(out), backend="cpu", n_threads=1).hparams.arch == "qwen2"
    r = run_cli(checkpoints["qwen2"], out)
    assert r.returncode == 1 and "already exists (pass --force" in r.stderr
    from kvflash_ggml.commands import main as kvflash_main
    assert kvflash_main(["convert", str(checkpoints["qwen2"]), str(out), "--force", "--quiet"]) == 0


# ---- bad input: every case raises ConversionError naming the problem, and leaves no output behind ----

def copy_checkpoint(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def edit_config(**changes):
    return lambda d: edit_json(d / "config.json", lambda c: c.update(changes))


def edit_tensors(fn):
    def apply(d: Path) -> None:
        tensors = load_file(d / "model.safetensors")
        fn(tensors)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return apply


def set_nan(t: dict) -> None:
    t["model.layers.1.mlp.down_proj.weight"][3, 5] = np.nan


def unlink(name: str):
    return lambda d: (d / name).unlink()


def first_shard(d: Path) -> None:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    (d / sorted(set(index["weight_map"].values()))[0]).unlink()


def tokenizer_json(fn):
    return lambda d: edit_json(d / "tokenizer.json", fn)


BAD_INPUTS = [   # (id, arch, mutation of the checkpoint directory, expected message)
    ("no-config", "qwen3", unlink("config.json"), r"missing file: .*config\.json \(the model configuration\)"),
    ("no-weights", "qwen3", unlink("model.safetensors"), r"missing file: no model\.safetensors"),
    ("no-shard", "llama", first_shard, r"missing file: .*model-00001-of-\d+\.safetensors \(a shard named by"),
    ("no-tokenizer", "qwen3", unlink("tokenizer.json"), r"missing file: .*tokenizer\.json \(the tokenizer\)"),
    ("unsupported-arch", "qwen3", edit_config(model_type="gpt2", architectures=["GPT2LMHeadModel"]),
     r"unsupported architecture: config\.json has model_type 'gpt2' .* supported: qwen3 \(qwen3, Qwen3ForCausalLM\); "
     r"qwen2 \(qwen2, Qwen2ForCausalLM\); llama \(llama, mistral, LlamaForCausalLM, MistralForCausalLM\)"),
    ("unknown-tensor", "qwen3", edit_tensors(lambda t: t.update({"model.layers.0.self_attn.o_proj.bias":
                                                                 np.zeros(64, np.float32)})),
     r"unknown tensor: model\.layers\.0\.self_attn\.o_proj\.bias has no place in a qwen3 model"),
    ("missing-tensor", "qwen3", edit_tensors(lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
     r"missing tensor: model\.layers\.1\.mlp\.up_proj\.weight \(needed by a qwen3 model\)"),
    ("wrong-shape", "qwen2", edit_tensors(lambda t: t.update({"model.layers.1.self_attn.k_proj.weight":
                                                              np.zeros((64, 64), np.float32)})),
     r"tensor model\.layers\.1\.self_attn\.k_proj\.weight has shape \[64, 64\], expected \[32, 64\]"),
    ("non-finite", "qwen3", edit_tensors(set_nan),
     r"non-finite weights: tensor model\.layers\.1\.mlp\.down_proj\.weight has 1 NaN/inf value"),
    ("head_dim", "qwen3", edit_config(head_dim=16),
     r"config\.json head_dim = 16 disagrees with the weights: model\.layers\.0\.self_attn\.q_norm\.weight has "
     r"shape \[32\], which gives head_dim = 32"),
    ("head_dim-from-q", "llama", edit_config(num_attention_heads=8),
     r"config\.json head_dim = 16 disagrees with the weights: model\.layers\.0\.self_attn\.q_proj\.weight has "
     r"shape \[64, 64\], which gives head_dim = 8 \(64 rows / num_attention_heads 8\)"),
    ("num_key_value_heads", "qwen3", edit_config(num_key_value_heads=4),
     r"config\.json num_key_value_heads = 4 disagrees with the weights: model\.layers\.0\.self_attn\.k_proj\.weight "
     r"has shape \[64, 64\], which gives num_key_value_heads = 2"),
    ("num_attention_heads", "qwen3", edit_config(num_attention_heads=2, num_key_value_heads=2),
     r"config\.json num_attention_heads = 2 .*q_proj\.weight has shape \[128, 64\], which gives "
     r"num_attention_heads = 4"),
    ("intermediate_size", "qwen2", edit_config(intermediate_size=128),
     r"config\.json intermediate_size = 128 disagrees with the weights: model\.layers\.0\.mlp\.gate_proj\.weight "
     r"has shape \[96, 64\], which gives intermediate_size = 96"),
    ("num_hidden_layers", "qwen2", edit_config(num_hidden_layers=3),
     r"config\.json num_hidden_layers = 3 disagrees with the weights: .*which gives num_hidden_layers = 2"),
    ("hidden_size", "qwen2", edit_config(hidden_size=128),
     r"config\.json hidden_size = 128 disagrees with the weights: model\.embed_tokens\.weight has shape "
     r"\[\d+, 64\], which gives hidden_size = 64"),
    ("vocab_size", "qwen2", edit_config(vocab_size=1000),
     r"config\.json vocab_size = 1000 disagrees with the weights: model\.embed_tokens\.weight .*which gives "
     r"vocab_size = \d+"),
    ("rope-yarn", "qwen3", edit_config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                        "original_max_position_embeddings": 128}),
     r"rope scaling type 'yarn' is not supported \(supported: default, linear, llama3\)"),
    ("pre-tokenizer", "qwen3", tokenizer_json(lambda j: j.update(pre_tokenizer={"type": "Whitespace"})),
     r"tokenizer\.json pre-tokenizer is not one libllama reproduces exactly .*Whitespace"),
    ("sentencepiece", "qwen3", tokenizer_json(lambda j: j["model"].update(byte_fallback=True)),
     r"SentencePiece-style BPE"),
]


@pytest.mark.parametrize("arch, mutate, message", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(arch, mutate, message, checkpoints, tmp_path):
    src = copy_checkpoint(checkpoints[arch], tmp_path)
    mutate(src)
    out = tmp_path / "out.gguf"
    with pytest.raises(ConversionError, match=message):
        convert(src, out, outtype="f16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "a failed conversion left files behind"


def test_bad_arguments(checkpoints, tmp_path):
    out = tmp_path / "out.gguf"
    with pytest.raises(ConversionError, match=r"missing file: source directory .*nowhere does not exist"):
        convert(tmp_path / "nowhere", out)
    with pytest.raises(ConversionError, match=r"--arch llama contradicts config\.json \(model_type 'qwen3'"):
        convert(checkpoints["qwen3"], out, arch="llama")
    with pytest.raises(ConversionError, match=r"unknown outtype 'q4_k' \(supported: f32, f16, bf16, q8_0\)"):
        convert(checkpoints["qwen3"], out, outtype="q4_k")
    out.write_bytes(b"keep me")
    with pytest.raises(ConversionError, match=r"output .*out\.gguf already exists \(pass --force to overwrite it\)"):
        convert(checkpoints["qwen3"], out)
    assert out.read_bytes() == b"keep me"
    convert(checkpoints["qwen3"], out, force=True)
    assert _core.Model(str(out), backend="cpu", n_threads=1).hparams.arch == "qwen3"


def test_rope_from_either_config_layout():
    """transformers 5 writes rope_parameters; older checkpoints have rope_theta + rope_scaling."""
    from kvflash_ggml.convert.hparams import read_rope
    old = read_rope({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}}, head_dim=64)
    new = read_rope({"rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 4.0}}, head_dim=64)
    assert (old.theta, old.kind, old.factor) == (new.theta, new.kind, new.factor) == (5e5, "linear", 4.0)
    assert read_rope({}, head_dim=64).theta == 10000.0
    llama3 = read_rope({"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 32.0,
                                                            "original_max_position_embeddings": 8192}}, 64)
    assert llama3.freq_factors.shape == (32,) and llama3.freq_factors[0] == 1.0 and llama3.freq_factors[-1] == 32.0
