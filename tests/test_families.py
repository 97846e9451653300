"""Every supported family (llama, qwen2, qwen3; gemma3 in test_sliding_window.py) against libllama, on tiny random-weight GGUFs.

The models come from kvflash_ggml.testing.random_gguf, so this is the one runner for every family
(equivalence tests, each tolerance written here): a prompt of N_PROMPT random tokens, then N_DECODE greedy
steps where our argmax is fed to both us and libllama's llama_decode (LlamaReference), comparing every logit
row on the way.
Also: pooled == full cache, tied embeddings, the tokenizer the writer embeds, and bad files.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
from kvflash_ggml import _core
from greedy_check import assert_greedy_matches_argmax, greedy_against_libllama
from kvflash_ggml.testing import random_gguf as rg

N_PROMPT = 300
N_DECODE = 32
MAX_TOKENS = 512
# One thread: on the shared 2-core machine, with another job running, two OpenMP threads wait at every
# graph node's barrier and this file took 156 s instead of 6 s. Ours and libllama get the same count.
N_THREADS = 1

# Our full-cache graph and libllama's run the same ggml CPU kernels on the same weights in the same
# order (matmul path: mul_mat + soft_max_ext with an F16 mask; flash path: ggml_flash_attn_ext with
# F16 K/V and F32 precision, like llama_decode with flash_attn on), so logits come out bit-identical:
# measured max |diff| = 0.0 for every variant below. 1e-5 (logits are O(1)) admits float
# reassociation only; a graph difference (a missing bias, a wrong RoPE type or norm) moves them by far more.
TOL_SAME_KERNELS = 1e-5
# Pooled mode with a pool that holds the whole context is an identity mapping over the same slots
# and the same padded n_kv, so it must equal full-cache mode just as exactly.
TOL_POOLED = TOL_SAME_KERNELS
# Q4_0 only: libllama repacks Q4_0 weights into interleaved blocks for its own CPU matmul kernels
# (llama_model_params.use_extra_bufts, on by default); our weights use ggml's plain Q4_0 mul_mat.
# With repacking off the two are bit-identical; with it on they differ by <= 7.7e-3, and both are
# 8.9e-3 from an F32 model holding the dequantized weights: activation-quantization noise, not a
# graph difference. So: 2e-2, and greedy tokens compared where our top-2 margin exceeds twice that.
TOL_Q4_0_REPACK = 2e-2

VARIANTS = {
    "llama-f32": ("tiny-llama", dict(weight_type="f32")),
    "qwen2-f32": ("tiny-qwen2", dict(weight_type="f32")),
    "qwen3-f32": ("tiny-qwen3", dict(weight_type="f32")),
    "llama-f16": ("tiny-llama", dict(weight_type="f16")),
    "llama-q8_0": ("tiny-llama", dict(weight_type="q8_0")),
    "llama-q4_0": ("tiny-llama", dict(weight_type="q4_0")),
    "llama-tied": ("tiny-llama", dict(tied_embeddings=True)),
    "qwen2-tied": ("tiny-qwen2", dict(tied_embeddings=True)),
    "llama-vocab-1009": ("tiny-llama", dict(n_vocab=1009)),   # a prime: the greedy argmax runs as one row
}
EXACT_VARIANTS = ["llama-f32", "qwen2-f32", "qwen3-f32", "llama-f16", "llama-q8_0"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """variant -> path of its GGUF, each written once per module."""
    return rg.preset_files(tmp_path_factory.mktemp("random-gguf"), VARIANTS)


def random_prompt(n_vocab: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_vocab, N_PROMPT).astype(np.int32)


def greedy_vs_reference(path: str, cfg, flash_ref: bool):
    """Prompt + N_DECODE greedy steps (our argmax fed to both). Returns (ours, ref, fed tokens):
    logits [N_PROMPT + N_DECODE, n_vocab] each, and the N_DECODE tokens fed after the prompt."""
    model = _core.Model(path, backend="cpu", n_threads=N_THREADS)
    ref = _core.testing.LlamaReference(path, n_ctx=MAX_TOKENS, n_threads=N_THREADS, flash_attn=flash_ref)
    return greedy_against_libllama(_core.Session(model, cfg), ref, random_prompt(model.hparams.n_vocab), N_DECODE)


def run_ours(path: str, cfg, fed: list[int]) -> np.ndarray:
    """Our logits for the same prompt followed by the given tokens (teacher-forced)."""
    model = _core.Model(path, backend="cpu", n_threads=N_THREADS)
    sess = _core.Session(model, cfg)
    prompt = random_prompt(model.hparams.n_vocab)
    rows = [sess.forward(prompt, 0, all_logits=True)]
    for i, tok in enumerate(fed):
        rows.append(sess.forward(np.array([tok], np.int32), N_PROMPT + i)[None, :])
    return np.concatenate(rows)


def assert_same_greedy(ours: np.ndarray, ref: np.ndarray, tol: float) -> None:
    assert np.isfinite(ours).all() and np.isfinite(ref).all()
    diff = float(np.abs(ours - ref).max())
    assert diff <= tol, f"max |logit diff| {diff:.3g} > {tol:g}"
    # greedy choices: after the last prompt token and after every decoded token
    np.testing.assert_array_equal(ours[N_PROMPT - 1:].argmax(-1), ref[N_PROMPT - 1:].argmax(-1))


# ---- equivalence with libllama ------------------------------------------------------------------

@pytest.mark.parametrize("variant", EXACT_VARIANTS)
def test_full_cache_matmul_matches_libllama(model_path, variant):
    cfg = _core.SessionConfig(max_tokens=MAX_TOKENS, pool_tokens=0, attention="matmul")
    ours, ref, _ = greedy_vs_reference(model_path(variant), cfg, flash_ref=False)
    assert_same_greedy(ours, ref, TOL_SAME_KERNELS)


@pytest.mark.parametrize("variant", EXACT_VARIANTS)
def test_full_cache_flash_matches_libllama_flash(model_path, variant):
    cfg = _core.SessionConfig(max_tokens=MAX_TOKENS, pool_tokens=0, attention="flash")
    ours, ref, _ = greedy_vs_reference(model_path(variant), cfg, flash_ref=True)
    assert_same_greedy(ours, ref, TOL_SAME_KERNELS)


@pytest.mark.parametrize("variant", ["llama-tied", "qwen2-tied"])
def test_tied_embeddings(model_path, variant):
    path = model_path(variant)
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "output.weight" not in names and "token_embd.weight" in names
    cfg = _core.SessionConfig(max_tokens=MAX_TOKENS, attention="matmul")
    ours, ref, _ = greedy_vs_reference(path, cfg, flash_ref=False)
    assert_same_greedy(ours, ref, TOL_SAME_KERNELS)


def test_q4_0_matches_libllama_within_repack_noise(model_path):
    cfg = _core.SessionConfig(max_tokens=MAX_TOKENS, attention="matmul")
    ours, ref, _ = greedy_vs_reference(model_path("llama-q4_0"), cfg, flash_ref=False)
    assert np.isfinite(ours).all()
    diff = float(np.abs(ours - ref).max())
    assert diff <= TOL_Q4_0_REPACK, f"max |logit diff| {diff:.3g} > {TOL_Q4_0_REPACK:g}"
    top2 = np.sort(ours[N_PROMPT - 1:], axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * TOL_Q4_0_REPACK
    assert clear.sum() >= 10   # (23 of 33 on this model) so the token check below is not vacuous
    np.testing.assert_array_equal(ours[N_PROMPT - 1:].argmax(-1)[clear], ref[N_PROMPT - 1:].argmax(-1)[clear])


@pytest.mark.parametrize("attention", ["matmul", "flash"])
@pytest.mark.parametrize("variant", ["llama-f32", "qwen2-f32", "qwen3-f32"])
def test_pooled_equals_full_cache(model_path, variant, attention):
    # pool_tokens=512 >= max_tokens=512 >= context (332): the pager never evicts, so the pooled
    # path (pager slot mapping, slot mask) must reproduce full-cache mode exactly; n_batch=100 also
    # splits the prompt into steps that straddle chunk boundaries.
    path = model_path(variant)
    full_cfg = _core.SessionConfig(max_tokens=MAX_TOKENS, pool_tokens=0, attention=attention)
    full, _, fed = greedy_vs_reference(path, full_cfg, flash_ref=attention == "flash")
    for n_batch in (512, 100):
        cfg = _core.SessionConfig(max_tokens=MAX_TOKENS, pool_tokens=512, attention=attention, n_batch=n_batch)
        pooled = run_ours(path, cfg, fed)
        diff = float(np.abs(pooled - full).max())
        assert diff <= TOL_POOLED, f"n_batch={n_batch}: max |logit diff| {diff:.3g}"
        np.testing.assert_array_equal(pooled[N_PROMPT - 1:].argmax(-1), full[N_PROMPT - 1:].argmax(-1))


def test_pooled_session_is_not_full_cache(model_path):
    model = _core.Model(model_path("llama-f32"), backend="cpu", n_threads=N_THREADS)
    assert not _core.Session(model, _core.SessionConfig(max_tokens=MAX_TOKENS, pool_tokens=512)).full_cache
    assert _core.Session(model, _core.SessionConfig(max_tokens=MAX_TOKENS, pool_tokens=0)).full_cache


# ---- tokenizer ----------------------------------------------------------------------------------

SAMPLES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces   ",
    "numbers 3.14159 and 1234567890; code: def f(x): return x*x\n\tindented\n\n",
    "don't won't they're I'll we've",
    "naïve café, 日本語, Ελληνικά, emoji 🙂👍",
]
SAMPLES_SPECIAL = ["<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b"]
# The pre-tokenizer regexes of llama.cpp's LLAMA3 / QWEN2 pre-types, as in the HF tokenizer.json files.
_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}%s| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
HF_SPLIT = {"llama": _SPLIT % "{1,3}", "qwen2": _SPLIT % ""}


def hf_tokenizer(arch: str):
    """An independent tokenizer for the same vocabulary: Hugging Face `tokenizers` byte-level BPE."""
    tk = pytest.importorskip("tokenizers")
    spec = rg.build_tokenizer(arch, rg.SHAPES[f"tiny-{arch}"]["n_vocab"])
    vocab = {t: i for i, t in enumerate(spec.tokens)}
    merges = [tuple(m.split(" ")) for m in spec.merges]
    # llama.cpp sets ignore_merges for the llama3 pre-type (as Llama 3's tokenizer.json does)
    t = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, ignore_merges=arch == "llama"))
    t.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Split(tk.Regex(HF_SPLIT[arch]), behavior="isolated"),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.decoder = tk.decoders.ByteLevel()
    t.add_special_tokens([tk.AddedToken(s, special=True, normalized=False) for s in rg.SPECIAL_TOKENS])
    return t


@pytest.mark.parametrize("arch,variant", [("llama", "llama-f32"), ("qwen2", "qwen2-f32")])
def test_vocab_matches_hf_tokenizers(model_path, arch, variant):
    # Our Vocab is libllama's tokenizer on the GGUF; the reference nobody here wrote is HF tokenizers
    # built from the same vocabulary and merges.
    vocab = _core.Vocab(model_path(variant))
    hf = hf_tokenizer(arch)
    for text in SAMPLES + SAMPLES_SPECIAL:
        ours = list(vocab.tokenize(text, add_special=False, parse_special=True))
        assert ours == hf.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("variant", ["llama-f32", "qwen2-f32", "qwen3-f32"])
def test_vocab_from_the_gguf(model_path, variant):
    from kvflash_ggml.tokenizer import Tokenizer

    path = model_path(variant)
    arch = variant.split("-")[0]
    spec = rg.build_tokenizer(arch, 1000)
    vocab, tok = _core.Vocab(path), Tokenizer(path)
    assert vocab.n_vocab == 1000
    ids = spec.special_ids
    assert vocab.eos == ids["<|im_end|>"] and vocab.is_eog(ids["<|im_end|>"])
    assert vocab.add_bos == (arch == "llama")
    assert vocab.bos == ids["<|begin_of_text|>" if arch == "llama" else "<|endoftext|>"]
    for text in SAMPLES:
        ids_plain = list(vocab.tokenize(text, add_special=False))
        assert vocab.detokenize(ids_plain) == text
        assert tok.encode(text, add_special=True) == list(vocab.tokenize(text, add_special=True))
        if arch == "llama":
            assert list(vocab.tokenize(text, add_special=True)) == [vocab.bos] + ids_plain
    # merges are used: a frequent corpus word is one token
    assert len(vocab.tokenize(" the", add_special=False)) == 1
    for s in rg.SPECIAL_TOKENS:
        assert list(vocab.tokenize(s, add_special=False, parse_special=True)) == [ids[s]]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


# ---- the writer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("variant,qtype", [("llama-f16", "F16"), ("llama-q8_0", "Q8_0"), ("llama-q4_0", "Q4_0")])
def test_writer_layout_and_weight_statistics(model_path, variant, qtype):
    r = gguf.GGUFReader(model_path(variant))
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 1 + 2 * 9 + 2   # embeddings, 2 layers x 9, output norm, output
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["tokenizer.ggml.pre"].contents() == "llama-bpe"
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 1000
    for name, t in tensors.items():
        want = "F32" if name.endswith("norm.weight") else qtype
        assert t.tensor_type.name == want, name
    w = gguf.quants.dequantize(tensors["blk.0.ffn_up.weight"].data, tensors["blk.0.ffn_up.weight"].tensor_type)
    assert w.shape == (256, 128)
    assert abs(float(w.std()) - 0.02) < 0.002 and abs(float(w.mean())) < 0.002
    np.testing.assert_array_equal(tensors["output_norm.weight"].data, 1.0)


def test_writer_rejects_bad_shapes(tmp_path):
    base = dict(n_layer=1, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_ff=64, n_vocab=400, n_ctx_train=256)
    with pytest.raises(ValueError, match="qwen2 needs head_dim"):
        rg.write_random_gguf(tmp_path / "a.gguf", "qwen2", **{**base, "head_dim": 16})
    with pytest.raises(ValueError, match="q8_0 rows come in blocks of 32"):
        rg.write_random_gguf(tmp_path / "b.gguf", "llama", **{**base, "n_ff": 48}, weight_type="q8_0")
    with pytest.raises(ValueError, match="unknown architecture"):
        rg.write_random_gguf(tmp_path / "c.gguf", "gemma3n", **base)
    with pytest.raises(ValueError, match="gemma3 / gemma4 / laguna options"):
        rg.write_random_gguf(tmp_path / "e.gguf", "llama", **base, n_swa=64)
    with pytest.raises(ValueError, match="n_vocab=100 is too small"):
        rg.write_random_gguf(tmp_path / "d.gguf", "llama", **{**base, "n_vocab": 100})


def test_cli_writes_a_loadable_model(tmp_path):
    out = tmp_path / "cli.gguf"
    assert rg.main([str(out), "--shape", "tiny-qwen3", "--type", "q8_0", "--n-layer", "1"]) == 0
    hp = _core.Model(str(out), backend="cpu", n_threads=N_THREADS).hparams
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.head_dim_k, hp.n_vocab) == ("qwen3", 1, 64, 32, 1000)


@pytest.mark.slow
def test_big_preset_writes_fast_and_runs(tmp_path):
    # llama3-8b's real widths and vocabulary (2 layers to keep the run short): random Q4_0 blocks
    # are written at disk speed and give finite, non-degenerate logits.
    import time
    t0 = time.perf_counter()
    path = rg.write_preset(tmp_path / "l3.gguf", "llama3-8b", weight_type="q4_0", n_layer=2)
    assert time.perf_counter() - t0 < 30
    model = _core.Model(str(path), backend="cpu", n_threads=N_THREADS)
    sess = _core.Session(model, _core.SessionConfig(max_tokens=256))
    logits = sess.forward(np.arange(16, dtype=np.int32), 0)
    assert logits.shape == (128256,) and np.isfinite(logits).all() and 0.1 < logits.std() < 10


# ---- bad files ----------------------------------------------------------------------------------

def test_truncated_gguf_raises(model_path, tmp_path):
    src = model_path("llama-f32")
    data = open(src, "rb").read()
    data_offset = gguf.GGUFReader(src).data_offset
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: data_offset + (len(data) - data_offset) // 2])   # cut inside the tensor data
    with pytest.raises(RuntimeError, match="is truncated: tensor .* needs bytes up to"):
        _core.Model(str(cut), backend="cpu", n_threads=N_THREADS)


def test_non_gguf_raises(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("this is not a GGUF file\n" * 100)
    with pytest.raises(RuntimeError, match="is not a valid GGUF file"):
        _core.Model(str(p), backend="cpu", n_threads=N_THREADS)


def test_unsupported_architecture_raises(tmp_path):
    p = tmp_path / "gemma3n.gguf"
    w = gguf.GGUFWriter(p, "gemma3n")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_context_length(512)
    w.add_tensor("token_embd.weight", np.zeros((10, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(RuntimeError, match="unsupported architecture 'gemma3n' \\(supported: llama, qwen2, qwen3, qwen3moe, qwen35, qwen35moe, gemma3, gemma4, laguna\\)"):
        _core.Model(str(p), backend="cpu", n_threads=N_THREADS)


@pytest.mark.parametrize("arch,missing", [("qwen2", "blk.1.attn_k.bias"), ("qwen3", "blk.0.attn_q_norm.weight"),
                                          ("llama", "output_norm.weight")])
def test_missing_tensor_raises(tmp_path, arch, missing):
    p = rg.write_preset(tmp_path / "m.gguf", f"tiny-{arch}", omit_tensors=[missing])
    with pytest.raises(RuntimeError, match=f"GGUF is missing the tensor {missing}"):
        _core.Model(str(p), backend="cpu", n_threads=N_THREADS)


# A malformed file must raise, not abort: these cases once crashed the process inside ggml
# (GGML_ASSERT in rope / rms_norm / mul, SIGSEGV in mul_mat, a hang in rope), so each runs in a
# subprocess that loads the file and computes one forward.
_LOAD_AND_RUN = textwrap.dedent("""
    import sys, numpy as np
    from kvflash_ggml import _core
    try:
        m = _core.Model(sys.argv[1], backend="cpu", n_threads=2)
        s = _core.Session(m, _core.SessionConfig(max_tokens=256))
        s.forward(np.arange(8, dtype=np.int32), 0)
        print("LOADED")
    except (RuntimeError, ValueError) as e:
        print("RAISED", e)
""")


def _load_in_subprocess(path) -> str:
    r = subprocess.run([sys.executable, "-c", _LOAD_AND_RUN, str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"process died (rc {r.returncode}): {r.stderr[-2000:]}"
    return r.stdout.strip()


def _patched_copy(src: str, dst, key: str, value) -> str:
    shutil.copy(src, dst)
    r = gguf.GGUFReader(dst, "r+")
    field = r.fields[key]
    field.parts[field.data[0]][0] = value
    del r   # flushes the memmap
    return str(dst)


@pytest.mark.parametrize("key,value,message", [
    ("qwen3.rope.dimension_count", 64, "rope.dimension_count=64 must be even"),
    ("qwen3.rope.dimension_count", 31, "rope.dimension_count=31 must be even"),
    ("qwen3.rope.dimension_count", 0, "rope.dimension_count=0 must be even"),
    ("qwen3.attention.layer_norm_rms_epsilon", -1.0, "layer_norm_rms_epsilon=-1.0+ must be finite and >= 0"),
    ("qwen3.block_count", 2**31 - 1, "block_count=2147483647 but the file has only"),
])
def test_bad_metadata_raises(model_path, tmp_path, key, value, message):
    path = _patched_copy(model_path("qwen3-f32"), tmp_path / "bad.gguf", key, value)
    out = _load_in_subprocess(path)
    assert out.startswith("RAISED") and re.search(message, out), out


@pytest.mark.parametrize("tensor,message", [
    ("blk.0.attn_q.weight", "tensor blk.0.attn_q.weight has type i32, expected a float or quantized type"),
    ("blk.0.attn_norm.weight", "tensor blk.0.attn_norm.weight has type i32, expected f32"),
    ("token_embd.weight", "tensor token_embd.weight has type i32"),
])
def test_bad_tensor_type_raises(model_path, tmp_path, tensor, message):
    dst = tmp_path / "badtype.gguf"
    shutil.copy(model_path("qwen3-f32"), dst)
    r = gguf.GGUFReader(dst, "r+")
    info = next(t for t in r.tensors if t.name == tensor)
    info.field.parts[-2][0] = int(gguf.GGMLQuantizationType.I32)   # [.., type, offset]: same size as F32
    del r
    out = _load_in_subprocess(dst)
    assert out.startswith("RAISED") and message in out, out


@pytest.mark.parametrize("variant", ["llama-f32", "qwen3-f32", "llama-vocab-1009"])
def test_greedy_on_the_backend_equals_argmax_of_the_logits(model_path, variant):
    # forward_greedy splits the vocabulary into rows (1000 = 1000 x 1; 1009 prime = 1 x 1009) and takes the
    # argmax in the graph; it must match NumPy's argmax of the same step's logits.
    model = _core.Model(model_path(variant), backend="cpu", n_threads=N_THREADS)
    cfg = _core.SessionConfig(max_tokens=MAX_TOKENS, pool_tokens=448)
    assert_greedy_matches_argmax(model, cfg, random_prompt(model.hparams.n_vocab), N_DECODE)
