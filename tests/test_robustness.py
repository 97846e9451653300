"""Issue 18, no crash and no silent wrong output from any input or use (the Python side): bytes prompts
are text, token ids outside the vocabulary are refused; a prefix cache that cannot be written or read
costs the reuse, never the text; Ctrl-C inside a long prompt stops it between forward steps and leaves
the session as it was; every bad option or path says what is wrong; the converter fails in one line.
Tiny random-weight models, CPU, one thread (the Ctrl-C run: two)."""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kvflash_ggml as kvf
from kvflash_ggml import _core, threads
from kvflash_ggml.testing import random_gguf as rg

TEXT = ("The quick brown fox jumps over the lazy dog. A pooled key-value cache keeps the relevant chunks of a "
        "long context resident, and pages the others out to host memory. ")
GREEDY = dict(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    return tiny_gguf(seed=0)


@pytest.fixture(scope="module")
def llm(tiny):
    with kvf.Model(tiny, n_ctx=1024, backend="cpu", n_threads=1) as m:
        yield m


def text(out: dict) -> str:
    return out["choices"][0]["text"]


# -- prompts: bytes are text, token ids are checked ------------------------------------------------------

def test_bytes_prompt_is_utf8_text(llm):
    as_str = llm.create_completion("The quick brown fox", **GREEDY)
    as_bytes = llm.create_completion(b"The quick brown fox", **GREEDY)
    assert text(as_bytes) == text(as_str)
    assert as_bytes["usage"]["prompt_tokens"] == len(llm.tokenize("The quick brown fox")) != len(b"The quick brown fox")
    records = list(llm.engine.generate("Grüße".encode(), **GREEDY))
    assert [r.token for r in records] == [r.token for r in llm.engine.generate("Grüße", **GREEDY)]
    with pytest.raises(ValueError, match="not valid UTF-8"):
        llm.create_completion(b"\xff\xfe broken", **GREEDY)


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    llm.create_completion("The quick brown fox", **GREEDY)
    held = llm.engine.session.tokens.tolist()
    for bad, message in (([5, 6, 1000], r"token id 1000 \(prompt\[2\]\) is outside the vocabulary \[0, 1000\)"),
                         ([-1, 5], r"token id -1 \(prompt\[0\]\)"), ([5, 2.5], r"prompt\[1\] is 2\.5"),
                         ([5, "x"], r"prompt\[1\] is 'x'")):
        for call in (lambda: llm.create_completion(bad, **GREEDY), lambda: llm.engine.prefill(bad),
                     lambda: llm.engine.generate(bad, **GREEDY)):
            with pytest.raises(ValueError, match=message):
                call()
    assert llm.engine.session.tokens.tolist() == held
    assert text(llm.create_completion(np.array(llm.tokenize("The quick"), np.int64), **GREEDY))


# -- the prefix cache: a failure costs the reuse, never the text ----------------------------------------

def cache_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvflash_ggml.snapshot" and r.levelno == logging.WARNING]


def run_turns(tiny: str, cache_dir, prompt: str) -> tuple[list[str], list[dict]]:
    """Two non-streamed calls and a stream on a Model with the given cache folder."""
    with kvf.Model(tiny, n_ctx=1024, backend="cpu", n_threads=1, prefix_cache_dir=cache_dir) as m:
        outs = [text(m.create_completion(prompt, **GREEDY)), text(m.create_completion(prompt + "again", **GREEDY))]
        chunks = list(m.create_completion(prompt, stream=True, **GREEDY))
    return outs, chunks


def test_unwritable_prefix_cache_is_a_warning(tiny, tmp_path, caplog, monkeypatch):
    prompt = TEXT * 2
    with kvf.Model(tiny, n_ctx=1024, backend="cpu", n_threads=1) as m:
        expected = [text(m.create_completion(prompt, **GREEDY)), text(m.create_completion(prompt + "again", **GREEDY))]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    unwritable = [blocker / "cache"]   # under a file: not even root can create it
    if Path("/sys").is_dir():
        unwritable.append(Path("/sys/kvflash-test-cache"))   # sysfs refuses root too
    for cache_dir in unwritable:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvflash_ggml.snapshot"):
            outs, chunks = run_turns(tiny, cache_dir, prompt)
        assert outs == expected
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" in chunks[-1]
        assert "".join(text(c) for c in chunks) == expected[0]
        warnings = cache_warnings(caplog)
        kinds = {w.split("cannot ")[1].split(" (")[0] for w in warnings}
        assert kinds == {"create the folder", "store a snapshot"} and len(warnings) == len(kinds), warnings


def test_full_disk_and_unreadable_cache_are_warnings(tiny, tmp_path, caplog, monkeypatch):
    prompt = TEXT * 2
    with kvf.Model(tiny, n_ctx=1024, backend="cpu", n_threads=1) as m:
        expected = text(m.create_completion(prompt, **GREEDY))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_core.Session, "save", full)
    with caplog.at_level(logging.WARNING, logger="kvflash_ggml.snapshot"):
        outs, chunks = run_turns(tiny, tmp_path / "full", prompt)
    assert outs[0] == expected and "".join(text(c) for c in chunks) == expected
    assert len([w for w in cache_warnings(caplog) if "No space left" in w]) == 1
    monkeypatch.undo()

    # A cached file that fails to load, in a folder where nothing can be deleted or listed.
    cache = tmp_path / "unreadable"
    run_turns(tiny, cache, prompt)
    for f in cache.glob("*.kvf"):
        f.write_bytes(f.read_bytes()[:100])                       # corrupt: the load fails
    monkeypatch.setattr(Path, "unlink", full)                    # ... and so does its removal
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvflash_ggml.snapshot"):
        outs, _ = run_turns(tiny, cache, prompt)
    assert outs[0] == expected
    assert any("cannot delete a stale snapshot" in w for w in cache_warnings(caplog))
    monkeypatch.setattr(Path, "glob", full)                      # a folder that cannot be listed
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvflash_ggml.snapshot"):
        outs, _ = run_turns(tiny, cache, prompt)
    assert outs[0] == expected and any("cannot list the folder" in w for w in cache_warnings(caplog))


# -- Ctrl-C: between forward steps, and the session is left as it was ---------------------------------------

class Interrupt:
    """Raises KeyboardInterrupt at the n-th call of the engine's between-steps hook."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == self.n:
            raise KeyboardInterrupt


@pytest.mark.parametrize("pool_tokens", [None, 448])
def test_interrupted_prompt_leaves_the_session_as_it_was(tiny, pool_tokens, monkeypatch):
    def open_model():
        return kvf.Model(tiny, n_ctx=2048, pool_tokens=pool_tokens, n_batch=64, backend="cpu", n_threads=1)

    with open_model() as m, open_model() as twin:
        eng = m.engine
        first = m.tokenize(TEXT * 2)
        for model in (m, twin):
            model.create_completion(first, **GREEDY)
        held = (eng.session.n_tokens, eng.session.tokens.tolist())
        longer = eng.session.tokens.tolist() + m.tokenize(TEXT * 8, add_bos=False)   # ~10 steps of 64 past what is held
        hook = Interrupt(2)   # after the second forward step, or (pooled: exact prefill, 2 layers) the last layer
        monkeypatch.setattr(eng, "_between_prefill_steps", hook)
        with pytest.raises(KeyboardInterrupt):
            m.create_completion(longer, **GREEDY)
        assert hook.calls == 2
        assert (eng.session.n_tokens, eng.session.tokens.tolist()) == held
        eng.session.pager.check_invariants()
        monkeypatch.undo()
        assert text(m.create_completion(longer, **GREEDY)) == text(twin.create_completion(longer, **GREEDY))
        # A prompt that shares only part of what is held keeps that part.
        monkeypatch.setattr(eng, "_between_prefill_steps", Interrupt(1))
        with pytest.raises(KeyboardInterrupt):
            m.create_completion(first[:40] + m.tokenize(TEXT * 8, add_bos=False), **GREEDY)
        assert eng.session.tokens.tolist() == first[:40]


@pytest.mark.parametrize("pool_tokens", [None, 448])
def test_a_prompt_run_a_step_at_a_time_is_the_prompt_run_whole(tiny, pool_tokens):
    # Generation.step_prompt: a server's round runs one step of a prompt (a forward step, or one layer-step of an
    # exact prefill), then the other slots' decode steps; the first record is the one next() gives.
    def open_model():
        return kvf.Model(tiny, n_ctx=2048, pool_tokens=pool_tokens, n_batch=64, backend="cpu", n_threads=1)

    params = kvf.SamplingParams(**GREEDY)
    with open_model() as m, open_model() as twin:
        tokens = m.tokenize(TEXT * 10)
        g = m.engine.generate(tokens, params)
        steps = 0
        while (first := g.step_prompt()) is None:
            steps += 1
        assert steps > 5 and g.started
        whole = twin.engine.generate(tokens, params)
        mine, theirs = [first] + list(g), list(whole)
        assert [(r.token, r.text, r.finish_reason) for r in mine] == [(r.token, r.text, r.finish_reason) for r in theirs]
        assert m.engine.session.tokens.tolist() == twin.engine.session.tokens.tolist()


@pytest.mark.parametrize("pool_tokens", [None, 448])
@pytest.mark.parametrize("how", ["close", "next call"])
def test_a_prompt_left_part_way_leaves_the_session_as_it_was(tiny, pool_tokens, how):
    def open_model():
        return kvf.Model(tiny, n_ctx=2048, pool_tokens=pool_tokens, n_batch=64, backend="cpu", n_threads=1)

    with open_model() as m, open_model() as twin:
        first = m.tokenize(TEXT * 2)
        for model in (m, twin):
            model.create_completion(first, **GREEDY)
        eng = m.engine
        held = eng.session.tokens.tolist()
        longer = held + m.tokenize(TEXT * 8, add_bos=False)
        g = eng.generate(longer, kvf.SamplingParams(**GREEDY))
        for _ in range(3):
            assert g.step_prompt() is None
        if how == "close":
            g.close()
            assert eng.session.tokens.tolist() == held
            eng.session.pager.check_invariants()
        # the next call (superseding the stream if it was not closed) starts from what was held
        assert text(m.create_completion(longer, **GREEDY)) == text(twin.create_completion(longer, **GREEDY))
        if how == "next call":
            with pytest.raises(kvf.StreamSuperseded):
                next(g)


def test_interrupt_between_a_forward_and_its_bookkeeping(tiny):
    # Ctrl-C can land after a decode step's forward returned and before the engine recorded its token
    # (in a REPL that catches it and goes on): the next call must start from what the session holds.
    with kvf.Model(tiny, n_ctx=512, backend="cpu", n_threads=1) as m, \
            kvf.Model(tiny, n_ctx=512, backend="cpu", n_threads=1) as twin:
        first = m.tokenize(TEXT)
        for model in (m, twin):
            model.create_completion(first, **GREEDY)
        eng = m.engine
        eng.session.forward(np.asarray([5], np.int32), eng.session.n_tokens)   # forward ran, the append did not
        longer = eng.session.tokens.tolist() + m.tokenize(TEXT, add_bos=False)
        assert text(m.create_completion(longer, **GREEDY)) == text(twin.create_completion(longer, **GREEDY))
        eng.session.forward(np.asarray([5], np.int32), eng.session.n_tokens)
        eng.decode_one(7)   # fed after what the session holds, the 5 included
        assert eng.session.tokens.tolist()[-2:] == [5, 7]


# `python -m kvflash_ggml` with SIGINT's usual handler installed first. A process started with SIGINT ignored (a
# background job of a non-interactive shell, as `pytest &` in a script) passes the ignored disposition on to its
# children, and Python then installs no KeyboardInterrupt handler: the child would never see Ctrl-C.
WITH_SIGINT = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "runpy.run_module('kvflash_ggml', run_name='__main__', alter_sys=True)")


@pytest.fixture(params=["default", "ignored"])
def runner_sigint(request):
    """The test runner's own SIGINT disposition while it starts the child: as started from a terminal, or
    ignored as in a background job of a non-interactive shell."""
    if request.param == "default":
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("kvflash", ["off", "1024"])
def test_ctrl_c_in_a_long_prompt_exits_130_at_once(tmp_path, runner_sigint, kvflash):
    # Issue 39 item 17: this test failed whenever the runner was started with SIGINT ignored (the child inherited
    # it); the child now installs SIGINT's handler itself, and the "ignored" case runs the test that way.
    # kvflash=1024: the pool (on by default since item 10) prefills a prompt larger than it exactly, layer-major;
    # it checked for Ctrl-C only between layers (~10 s each here), and now after every step too.
    path = rg.write_preset(tmp_path / "long.gguf", "tiny-llama", n_ctx_train=16384)
    words = np.random.default_rng(0).choice(TEXT.split(), 5500)
    # ~15K tokens: the prompt alone runs ~20 s on two cores, in 512-token steps
    prompt = " ".join(words)
    out = tmp_path / "stdout"
    with open(out, "wb") as stdout:
        proc = subprocess.Popen([sys.executable, "-c", WITH_SIGINT, "generate", "--model", str(path), "--n-ctx",
                                 "16384", "--kvflash", kvflash, "--threads", "2", "--backend", "cpu", "--prompt", "-"],
                                stdin=subprocess.PIPE, stdout=stdout, stderr=subprocess.PIPE)
        proc.stdin.write(prompt.encode())
        proc.stdin.close()
        deadline = time.monotonic() + 60
        while out.stat().st_size == 0 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)   # the prompt is echoed just before it is computed
        time.sleep(1.0)
        assert proc.poll() is None, proc.stderr.read().decode()
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        try:
            proc.wait(timeout=30)
        finally:
            proc.kill()
        waited = time.monotonic() - t0
    err = proc.stderr.read().decode()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["kvflash generate: interrupted (Ctrl-C)"]
    assert waited < 8.0, f"exited {waited:.1f} s after Ctrl-C"


# -- options, paths and requests that say what is wrong -------------------------------------------------------

@pytest.mark.parametrize("messages, message", [
    ("hello", r"messages must be a list"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\] has no 'role'"),
    ([{"role": "user"}], r"messages\[0\] has no 'content'"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\] must be a string, got int"),
    ([{"role": None, "content": "x"}], r"messages\[0\]\['role'\] must be a string, got NoneType"),
])
def test_malformed_chat_messages_name_the_message(llm, messages, message):
    with pytest.raises(ValueError, match=message):
        llm.create_chat_completion(messages, **GREEDY)
    if any(isinstance(m, dict) for m in messages):   # Engine.generate: any dict makes the list a chat
        with pytest.raises(ValueError, match=message):
            llm.engine.generate(messages, **GREEDY)


def test_template_errors_are_value_errors(tiny):
    with kvf.Model(tiny, n_ctx=256, backend="cpu", n_threads=1,
                   chat_template="{{ raise_exception('roles must alternate') }}") as m:
        with pytest.raises(ValueError, match="chat template: roles must alternate"):
            m.create_chat_completion([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("options, message", [
    (dict(temperature=float("nan")), r"temperature must be a finite number >= 0 \(0 = greedy\), got nan"),
    (dict(temperature=-1.0), r"temperature must be .* got -1\.0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(max_tokens=-1), r"max_tokens must be an integer >= 0, or None"),
    (dict(max_tokens=2.5), r"max_tokens must be an integer"),
    (dict(seed=-2), r"seed must be an integer >= 0, or None / -1 \(random\)"),
    (dict(top_k=-3), r"top_k must be an integer >= 0"),
    (dict(stop=[1]), r"stop must be a string or a sequence of strings"),
])
def test_bad_sampling_options_name_the_option(llm, options, message):
    with pytest.raises(ValueError, match=message):
        llm.create_completion("x", **{**GREEDY, **options})


def test_seed_minus_one_is_random_and_max_tokens_none_fills_the_context(tiny):
    with kvf.Model(tiny, n_ctx=96, backend="cpu", n_threads=1) as m:
        draws = {text(m.create_completion("The", max_tokens=4, temperature=1.0, top_k=0, min_p=0.0, seed=-1))
                 for _ in range(6)}
        assert len(draws) > 1
        out = m.create_completion("The quick brown fox", max_tokens=None, temperature=0.0)
        usage, finish = out["usage"], out["choices"][0]["finish_reason"]
        if finish == "length":   # an end-of-generation token may come first
            assert usage["total_tokens"] == 96 + 1   # the last token is returned, not fed
        assert usage["kvflash"]["tokens"] <= 96


def test_bad_model_options_and_paths_say_what_is_wrong(tiny, tmp_path, monkeypatch, caplog):
    for n_ctx in (0, -5):
        with pytest.raises(ValueError, match=rf"n_ctx must be a positive integer, got {n_ctx}"):
            kvf.Model(tiny, n_ctx=n_ctx, backend="cpu", n_threads=1)
    with pytest.raises(ValueError, match="n_batch must be a positive integer"):
        kvf.Model(tiny, n_batch=0, backend="cpu", n_threads=1)
    with pytest.raises(IsADirectoryError, match=r"is a directory; pass the \.gguf file inside it"):
        kvf.Model(str(tmp_path), backend="cpu", n_threads=1)
    with pytest.raises(ValueError, match="n_threads must be a positive integer"):
        kvf.Model(tiny, n_threads=-2, backend="cpu")
    # ./smollm2/ does not shadow the known short name
    (tmp_path / "smollm2").mkdir()
    monkeypatch.chdir(tmp_path)
    assert kvf.resolve_model_path("smollm2").endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    # far more threads than cores: a warning, and the cores
    cores = threads.usable_cores()   # the cores this process may run on
    with caplog.at_level(logging.WARNING, logger="kvflash_ggml.threads"):
        with kvf.Model(tiny, n_ctx=256, backend="cpu", n_threads=64 * cores) as m:
            assert m._core_model.n_threads == cores
    assert any("more than the" in r.getMessage() and "CPU cores" in r.getMessage() for r in caplog.records)


def test_cli_errors_are_one_line(tiny, tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "kvflash_ggml", "generate", "--backend", "cpu", "--threads", "1",
                               *args], capture_output=True, text=True, timeout=120)

    for args, message in (((("--model", str(tmp_path)), "is a directory")),
                          (("--model", tiny, "--n-ctx", "-5"), "--n-ctx must be positive, or 0 for the model's trained"),
                          (("--model", tiny, "--top-p", "0"), "top_p must be in (0, 1]"),
                          (("--model", tiny, "--temp", "nan"), "temperature must be")):
        proc = run(*args, "--prompt", "x")
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# -- the converter: one line, exit 1, ConversionError from the API -------------------------------------------

def write_checkpoint(d: Path, **config) -> Path:
    """A minimal llama checkpoint (zeros): enough to get through the config and tensor checks."""
    from safetensors.numpy import save_file
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=16, hidden_size=8,
               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16,
               tie_word_embeddings=True, max_position_embeddings=64)
    cfg.update(config)
    (d / "config.json").write_text(json.dumps(cfg))
    z = lambda *shape: np.zeros(shape, np.float32)   # noqa: E731
    tensors = {"model.embed_tokens.weight": z(16, 8), "model.norm.weight": z(8),
               "model.layers.0.input_layernorm.weight": z(8), "model.layers.0.post_attention_layernorm.weight": z(8),
               "model.layers.0.self_attn.q_proj.weight": z(8, 8), "model.layers.0.self_attn.k_proj.weight": z(4, 8),
               "model.layers.0.self_attn.v_proj.weight": z(4, 8), "model.layers.0.self_attn.o_proj.weight": z(8, 8),
               "model.layers.0.mlp.gate_proj.weight": z(16, 8), "model.layers.0.mlp.up_proj.weight": z(16, 8),
               "model.layers.0.mlp.down_proj.weight": z(8, 16)}
    save_file(tensors, str(d / "model.safetensors"))
    return d


def safetensors_with_header(d: Path, header) -> None:
    raw = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(64))


def convert_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvflash_ggml.convert", *args], capture_output=True, text=True,
                          timeout=120)


CONVERT_CASES = [   # (id, checkpoint mutation, message)
    ("rope_scaling-string", lambda d: write_checkpoint(d, rope_scaling="linear"),
     r"config\.json rope_scaling = 'linear' is not an object"),
    ("rope_theta-string", lambda d: write_checkpoint(d, rope_theta="1e4"),
     r"config\.json rope_theta = '1e4' is not a positive number"),
    ("llama3-no-factor", lambda d: write_checkpoint(d, rope_scaling={"rope_type": "llama3"}),
     r"malformed config\.json in .*KeyError: 'factor'"),
    ("header-list", lambda d: safetensors_with_header(write_checkpoint(d), [1, 2]),
     r"corrupt safetensors header: a JSON list, not an object"),
    ("header-no-offsets", lambda d: safetensors_with_header(
        write_checkpoint(d), {"model.norm.weight": {"dtype": "F32", "shape": [8]}}),
     r"corrupt safetensors header: tensor model\.norm\.weight has data_offsets None"),
    ("header-bad-shape", lambda d: safetensors_with_header(
        write_checkpoint(d), {"model.norm.weight": {"dtype": "F32", "shape": "8", "data_offsets": [0, 32]}}),
     r"tensor model\.norm\.weight has shape '8'"),
]


@pytest.mark.parametrize("mutate, message", [c[1:] for c in CONVERT_CASES], ids=[c[0] for c in CONVERT_CASES])
def test_converter_malformed_input_is_a_conversion_error(tmp_path, mutate, message):
    from kvflash_ggml.convert import ConversionError, convert
    src = tmp_path / "ckpt"
    mutate(src)
    with pytest.raises(ConversionError, match=message):
        convert(src, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists() and not (tmp_path / "out.gguf.partial").exists()


def test_converter_cli_errors_are_one_line(tmp_path):
    src = write_checkpoint(tmp_path / "ckpt", rope_scaling="linear")
    proc = convert_cli(str(src), str(tmp_path / "out.gguf"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"kvflash convert: error: config.json rope_scaling = 'linear' is "
                                                f"not an object (expected e.g. {{\"rope_type\": \"linear\", "
                                                f"\"factor\": 2.0}})"]
    # an output folder that cannot be written: refused before any weight is read
    outs = [tmp_path / "a-file" / "out.gguf"]
    (tmp_path / "a-file").write_text("")
    if Path("/sys").is_dir():
        outs.append(Path("/sys/kvflash-test.gguf"))
    for out in outs:
        proc = convert_cli(str(write_checkpoint(tmp_path / "ok")), str(out))
        assert proc.returncode == 1 and "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1
        assert "does not exist" in proc.stderr or "cannot write the output" in proc.stderr, proc.stderr


def test_converter_without_the_gguf_package(tmp_path, monkeypatch):
    from kvflash_ggml.convert import ConversionError, convert
    src = write_checkpoint(tmp_path / "ckpt")
    monkeypatch.setitem(sys.modules, "gguf", None)   # import gguf now raises ImportError
    with pytest.raises(ConversionError, match=r"needs the `gguf` package.*pip install gguf"):
        convert(src, tmp_path / "out.gguf")
    code = ("import sys; sys.modules['gguf'] = None; from kvflash_ggml.commands import main; "
            f"sys.exit(main(['convert', {str(src)!r}, {str(tmp_path / 'out.gguf')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert "pip install gguf" in proc.stderr


def test_reserve_host_pins_the_store_for_n_ctx_and_refuses_more(tiny):
    # Engine.reserve_host: the host store for the context's positions beyond the pool, made before any prompt;
    # stats() reports it; a context it cannot be for is refused before anything is made.
    with kvf.Model(tiny, n_ctx=1024, pool_tokens=448, backend="cpu", n_threads=1) as m:
        held = m.engine.reserve_host()
        assert held >= 1024 // 64 * m.engine.session.kv.chunk_bytes   # an image per chunk of n_ctx
        assert m.engine.stats()["host_store_bytes"] == held and m.engine.stats()["host_kv_bytes"] == 0
        with pytest.raises(ValueError, match="outside 0..n_ctx=1024"):
            m.engine.reserve_host(1025)
