"""The Python layer: sampling, streamed text, the llama-cpp-python-shaped API, the CLI, bad input."""
import json
import subprocess
import sys

import numpy as np
import pytest

import kvflash_ggml as kvf
from kvflash_ggml.options import PoolConfig, SamplingParams
from kvflash_ggml.sampling import Sampler
from kvflash_ggml.tokenizer import TextStream


# -- sampling and text streaming (no model) ------------------------------------------------------
def test_greedy_is_argmax_and_seeded_sampling_repeats():
    logits = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    assert Sampler(SamplingParams(temperature=0.0))(logits) == int(logits.argmax())
    assert Sampler(SamplingParams(temperature=1.0, top_k=1))(logits) == int(logits.argmax())
    a = [Sampler(SamplingParams(temperature=1.0, seed=7))(logits) for _ in range(5)]
    s = Sampler(SamplingParams(temperature=1.0, seed=7))
    assert a[0] == s(logits)


def test_min_p_and_top_p_cut_the_tail():
    logits = np.array([10.0, 9.9, 0.0, -5.0], np.float32)
    draws = {Sampler(SamplingParams(temperature=1.0, min_p=0.5, top_k=0, seed=i))(logits) for i in range(50)}
    assert draws <= {0, 1}
    draws = {Sampler(SamplingParams(temperature=1.0, top_p=0.1, min_p=0.0, top_k=0, seed=i))(logits) for i in range(50)}
    assert draws == {0}


def test_bad_sampling_params_raise():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)


def test_text_stream_holds_back_partial_stop_and_split_utf8():
    s = TextStream(["STOP"])
    out = s.push(b"hello ST")
    assert out == "hello "        # "ST" could still become "STOP"
    assert s.push(b"OP and more") == "" and s.stopped
    s = TextStream([])
    euro = "€".encode()
    assert s.push(euro[:2]) == "" and s.push(euro[2:]) == "€"


def test_pool_config_resolution_and_errors():
    assert PoolConfig(pool_tokens=None).resolved_pool_tokens() == 0
    assert PoolConfig(n_ctx=8192, pool_tokens="auto").resolved_pool_tokens() == 4096
    # the minimum: sink, head chunk, one tail chunk (a quarter of 4 chunks) and one chunk for evidence
    assert PoolConfig(n_ctx=100, pool_tokens="auto").resolved_pool_tokens() == 256
    # prefill steps: n_batch for the full cache, 1/8 of a pool (whole chunks, >= 1) capped at n_batch
    assert [PoolConfig(n_ctx=8192, pool_tokens=p).prefill_batch() for p in (None, 448, 1024, 4096, 8192)] == \
        [512, 64, 128, 512, 512]
    assert PoolConfig(pool_tokens=1024, n_batch=32).prefill_batch() == 32
    with pytest.raises(ValueError, match="pool_tokens"):
        PoolConfig(pool_tokens=-3).resolved_pool_tokens()
    # the protected tail: a quarter of the pool's chunks, 1 to 4, unless given
    assert [PoolConfig(n_ctx=8192, pool_tokens=p).resolved_tail_chunks(p) for p in (256, 448, 512, 768, 1024, 4096)] == \
        [1, 1, 2, 3, 4, 4]
    assert PoolConfig(n_ctx=8192, pool_tokens=512, tail_chunks=4).resolved_tail_chunks(512) == 4
    for bad in (-1, "some", 2.5):
        with pytest.raises(ValueError, match="tail_chunks must be an integer >= 0 or 'auto'"):
            PoolConfig(tail_chunks=bad)
    with pytest.raises(ValueError, match="tail_chunks"):   # the core's rule: sink + tail + 2 chunks at least
        PoolConfig(n_ctx=8192, pool_tokens=256, tail_chunks=4)


def test_a_session_takes_the_pools_tail(tiny_gguf):
    with kvf.Model(tiny_gguf(), n_ctx=2048, pool_tokens=512, n_threads=1) as m:
        assert m.engine.session.pager.config().tail_chunks == 2


# -- the model API on SmolLM2 ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    with kvf.Model("smollm2", n_ctx=2048, pool_tokens=448, n_threads=2) as m:
        yield m


@pytest.mark.slow
def test_logprobs_match_libllama(llm, smollm2_path):
    """Each token's log-probability (and the top ones) against log-softmax of libllama's logits for the same
    tokens: the prompt, then the generated tokens fed one by one."""
    out = llm.create_completion("The capital of France is", max_tokens=4, temperature=0.0, logprobs=3)
    lp = out["choices"][0]["logprobs"]
    ref = kvf._core.testing.LlamaReference(smollm2_path, n_ctx=256)
    prompt = llm.tokenize("The capital of France is")
    logits = ref.decode(prompt)
    for i, (text, chosen, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])):
        x = logits.astype(np.float64)
        log_p = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        token = int(np.argmax(log_p))
        assert llm.detokenize([token]) == text
        assert chosen == pytest.approx(log_p[token], abs=0.05)
        want = np.argsort(-log_p)[:3]
        assert list(top) == [llm.detokenize([int(t)]) for t in want]
        assert list(top.values()) == pytest.approx(log_p[want].tolist(), abs=0.05)
        logits = ref.decode([token])
    chat = llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0.0,
                                      logprobs=True, top_logprobs=2)
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] and all(len(e["top_logprobs"]) == 2 for e in content)


@pytest.mark.slow
def test_completion_is_openai_shaped_and_greedy_deterministic(llm):
    a = llm.create_completion("The capital of France is", max_tokens=8, temperature=0.0)
    b = llm.create_completion("The capital of France is", max_tokens=8, temperature=0.0)
    assert a["object"] == "text_completion" and a["choices"][0]["text"] == b["choices"][0]["text"]
    assert "Paris" in a["choices"][0]["text"]
    usage = a["usage"]
    assert usage["completion_tokens"] == 8 and usage["total_tokens"] == usage["prompt_tokens"] + 8
    assert usage["kvflash"]["mode"] == "kvflash" and usage["kvflash"]["pool_tokens"] == 448
    streamed = "".join(c["choices"][0]["text"] for c in
                       llm.create_completion("The capital of France is", max_tokens=8, temperature=0.0, stream=True))
    assert streamed == a["choices"][0]["text"]


@pytest.mark.slow
def test_chat_completion_uses_the_gguf_template(llm):
    out = llm.create_chat_completion([{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0.0)
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant" and out["choices"][0]["message"]["content"]
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_extending_prompt_prefills_only_the_suffix(llm):
    eng = llm.engine
    first = llm.tokenize("A long time ago in a galaxy far, far away, there lived")
    eng.prefill(first)
    computes_before = eng.session.timings.n_computes
    longer = first + llm.tokenize(" a small robot", add_bos=False)
    logits_warm = eng.prefill(longer)
    assert eng.session.timings.n_computes == computes_before + 1   # one batch: just the suffix
    fresh = kvf.Engine(llm._core_model, llm.tokenizer, PoolConfig(n_ctx=2048, pool_tokens=448))
    np.testing.assert_allclose(fresh.prefill(longer), logits_warm, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "quest"])
def test_exact_prefill_holds_the_full_cache_bytes_across_turns(llm, policy, monkeypatch):
    # prefill="exact" (the default): every whole chunk of the prompt, resident or paged out, holds the bytes a
    # full-cache session computes for it, also when a second turn extends the first from a mid-chunk point
    # (layer-major prefill then reads the history back from the pool and the host store). No second session
    # is made, and the transient workspace stays far below the full cache's KV.
    pool = PoolConfig(n_ctx=2048, pool_tokens=448, attention="matmul")
    exact = kvf.Engine(llm._core_model, llm.tokenizer, pool, kvf.ResidencyConfig(policy=policy))
    full = kvf.Engine(llm._core_model, llm.tokenizer, PoolConfig(n_ctx=2048, pool_tokens=None, attention="matmul"))
    made = []
    real_make_session = kvf.engine.make_session
    monkeypatch.setattr(kvf.engine, "make_session", lambda *a, **k: made.append(1) or real_make_session(*a, **k))
    text = " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(150))
    first = llm.tokenize(text)[:700]
    second = first + llm.tokenize(" The last item was", add_bos=False) + llm.tokenize(text, add_bos=False)[:500]
    for prompt in (first, second):
        logits = exact.prefill(prompt)
        np.testing.assert_array_equal(logits, full.prefill(prompt))
        s, f = exact.session, full.session
        assert s.pager.stats().page_outs > 0 and s.n_tokens == len(prompt)
        for c in range(len(prompt) // 64):
            mine = s.kv.read_block(s.pager.slot_of(c * 64) // 64) if s.pager.is_resident(c) else s.kv.host_image(c)
            assert mine == f.kv.read_block(c), f"chunk {c} of a {len(prompt)}-token prompt"
    assert not made
    # the workspace: one layer's K/V of the context (the full cache holds n_layer of them) beside a compute
    # buffer no larger than the full cache's own scaled to the exact prefill's larger steps, plus the causal
    # band's mask table (F16, about n_kv x one block of queries; the bound allows the old band and a step's mask)
    mine, theirs = exact.stats(), full.stats()
    one_layer = theirs["device_kv_bytes"] // llm._core_model.hparams.n_layer
    step = exact._exact_prefill_step()
    n_kv = -(-len(second) // 256) * 256
    mask = ((n_kv + step + 256) * step + n_kv * step) * 2
    compute = theirs["device_compute_bytes"] * step // pool.n_batch
    assert 0 < mine["device_prefill_peak_bytes"] <= compute + one_layer + mask + 2**20
    assert mine["device_peak_bytes"] < theirs["device_peak_bytes"]
    # issue 39 item 11: the driver's view of the GPU is reported beside ours, and only where a GPU was opened
    assert mine["device_driver_bytes"] is None


@pytest.mark.slow
def test_stop_strings_end_generation(llm):
    out = llm.create_completion("1, 2, 3, 4,", max_tokens=20, temperature=0.0, stop=[" 7"])
    text = out["choices"][0]["text"]
    assert out["choices"][0]["finish_reason"] == "stop" and " 7" not in text and "6" in text


@pytest.mark.slow
def test_bad_requests_raise_clear_errors(llm):
    with pytest.raises(ValueError, match="exceeds n_ctx"):
        llm.create_completion(list(range(10, 2100)), max_tokens=1)
    with pytest.raises(ValueError, match="minimum"):
        kvf.Model("smollm2", n_ctx=2048, pool_tokens=192)
    with pytest.raises(ValueError, match="policy"):
        kvf.Model("smollm2", policy="nonsense")
    with pytest.raises(ValueError, match="prefill must be one of"):
        kvf.Model("smollm2", pool_tokens=448, prefill="fast")
    with pytest.raises(ValueError, match="trained context"):
        kvf.Model("smollm2", n_ctx=1 << 20)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        kvf.Model("/nonexistent/model.gguf")


def test_non_gguf_and_truncated_files_raise(tmp_path, smollm2_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file at all" * 100)
    with pytest.raises(RuntimeError, match="not a valid GGUF"):
        kvf._core.Model(str(junk), backend="cpu")
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as f:
        cut.write_bytes(f.read(20_000_000))
    with pytest.raises(RuntimeError, match="truncated"):
        kvf._core.Model(str(cut), backend="cpu")


@pytest.mark.slow
def test_cli_generate_prints_a_continuation():
    proc = subprocess.run([sys.executable, "-m", "kvflash_ggml", "generate", "--model", "smollm2", "--prompt",
                           "The capital of France is", "--max-tokens", "8", "--kvflash", "448", "--stats", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The capital of France is") and "Paris" in proc.stdout
    assert json.loads(proc.stderr[proc.stderr.index("{"):])["pool_tokens"] == 448


def test_cli_rejects_bad_flags():
    proc = subprocess.run([sys.executable, "-m", "kvflash_ggml", "generate", "--prompt", "x", "--kvflash", "lots"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "expected N, 'auto' or 'off'" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "kvflash_ggml", "frobnicate"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown command" in proc.stderr


@pytest.mark.slow
def test_engine_generate_takes_text_tokens_or_messages(llm):
    eng = llm.engine
    by_text = [r.token for r in eng.generate("The capital of France is", max_tokens=5, temperature=0.0)]
    by_tokens = [r.token for r in eng.generate(llm.tokenize("The capital of France is", special=True), max_tokens=5,
                                                temperature=0.0)]
    assert by_text == by_tokens and by_text[-1] is None and len(by_text) == 6
    chat = list(eng.generate([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.0))
    assert chat[-1].finish_reason in ("stop", "length")
