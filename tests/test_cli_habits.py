"""Issue 39, the CLI follows its ecosystem's habits: help on stdout and usage errors on stderr, a reader that
leaves a pipe ends the command as it ends `seq`, --stats is a short summary (JSON on request), the pool is on by
default, a chat with a model that cannot chat is refused, and llama-server's and llama-cli's command lines run
unchanged (their other flags refused by name). Tiny random-weight models on the CPU, one thread."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

import kvflash_ggml as kvf
from kvflash_ggml.commands import flags, generate, serve
from kvflash_ggml.options import PoolConfig
from kvflash_ggml.testing import random_gguf as rg

REPO = Path(__file__).resolve().parent.parent
TEXT = ("The quick brown fox jumps over the lazy dog. A pooled key-value cache keeps the relevant chunks of a "
        "long context resident, and pages the others out to host memory. ")


def kvflash(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvflash_ggml", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    return tiny_gguf(seed=0)   # tiny-llama: trained for 4096 tokens, 2 layers


@pytest.fixture(scope="module")
def long_trained(tmp_path_factory):
    """tiny-llama trained for 8192 tokens: the CPU's auto pool (4096) is half its context."""
    return str(rg.write_preset(tmp_path_factory.mktemp("long") / "long.gguf", "tiny-llama", n_ctx_train=8192))


@pytest.fixture(scope="module")
def no_template(tmp_path_factory, tiny):
    """tiny-llama whose GGUF has no chat template (as the Gemma 3 270M base model's)."""
    real = rg.build_tokenizer
    rg.build_tokenizer = lambda *a, **k: dataclasses.replace(real(*a, **k), chat_template="")
    try:
        return str(rg.write_preset(tmp_path_factory.mktemp("base") / "base.gguf", "tiny-llama"))
    finally:
        rg.build_tokenizer = real


# -- item 8: help, usage errors, a closed pipe ---------------------------------------------------------------

def test_help_goes_to_stdout_and_a_missing_command_is_a_usage_error():
    # item 8: `kvflash --help` printed to stderr and a bare `kvflash` printed usage to stdout (exit 2): the other
    # way round from every CLI (argparse, git, cargo): asked-for help on stdout with 0, a usage error on stderr
    # with 2. The top-level help named only some benchmarks.
    for flag in ("--help", "-h"):
        proc = kvflash(flag)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert all(f"  {c} " in proc.stdout for c in ("generate", "serve", "convert", "bench"))
        assert all(b in proc.stdout for b in ("decode", "prefill", "restore", "niah", "ruler", "spec", "merge"))
    for argv in ((), ("frobnicate",)):
        proc = kvflash(*argv)
        assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.startswith("usage: kvflash"), proc
    assert "unknown command 'frobnicate'" in proc.stderr


def test_bench_help_lists_every_benchmark_with_what_it_measures():
    # item 8: `kvflash bench --help` printed one usage line to stderr, no benchmark described
    proc = kvflash("bench", "--help")
    assert proc.returncode == 0 and proc.stderr == ""
    described = dict(re.findall(r"^  (\w+) +(\S.+)$", proc.stdout, re.M))
    assert set(described) == {"decode", "prefill", "restore", "niah", "ruler", "serve", "spec", "merge"}
    assert "llama-bench" in described["decode"] and "llama-server" in described["serve"]
    proc = kvflash("bench")
    assert proc.returncode == 2 and proc.stdout == "" and "a benchmark name is required" in proc.stderr


def test_generate_into_a_pipe_closed_early_ends_as_seq_does(tiny, tmp_path):
    # item 8: `kvflash generate ... | head` exited 2 with "kvflash generate: [Errno 32] Broken pipe". A Unix filter
    # whose reader leaves ends silently, with the status a shell shows for SIGPIPE (`seq 1e9 | head`: 141).
    # A real pipe into head, which leaves after 5 bytes while tokens are still being written.
    err = tmp_path / "stderr"
    command = (f"{shlex.quote(sys.executable)} -m kvflash_ggml generate --model {shlex.quote(tiny)} --backend cpu "
               f"--threads 1 --max-tokens 400 --prompt {shlex.quote(TEXT)} 2>{shlex.quote(str(err))} | head -c 5 "
               f">/dev/null; echo ${{PIPESTATUS[0]}}")
    seq = subprocess.run(["bash", "-c", "seq 1000000000 2>/dev/null | head -c 5 >/dev/null; echo ${PIPESTATUS[0]}"],
                         capture_output=True, text=True, timeout=60)
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == seq.stdout.strip() == "141", (proc.stdout, err.read_text())
    assert err.read_text() == ""


# -- item 9: --stats ----------------------------------------------------------------------------------------

def test_stats_is_a_short_summary_with_speeds_memory_and_paging(tiny):
    # item 9: --stats printed ~40 lines of JSON in raw bytes, without tok/s or the number of generated tokens.
    proc = kvflash("generate", "--model", tiny, "--backend", "cpu", "--threads", "1", "--n-ctx", "2048",
                   "--kvflash", "448", "--max-tokens", "16", "--temp", "0", "--prompt", TEXT * 12, "--stats")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) <= 6 and not proc.stderr.lstrip().startswith("{"), proc.stderr
    fields = {line.split()[0]: line for line in lines}
    assert re.search(r"\d+ tokens in [\d.]+ s \([\d.]+ tok/s\)", fields["prompt"])
    assert re.search(r"\d+ tokens in [\d.]+ s \([\d.]+ tok/s\)", fields["generated"])
    assert "pool of 448 tokens (--kvflash 448) for a context of 2048" in fields["KV"] and "policy lru" in fields["KV"]
    assert re.search(r"[1-9]\d* chunks? paged out", fields["paging"])   # the prompt is larger than the pool
    assert re.search(r"CPU: weights [\d.]+ MiB, KV pool [\d.]+ MiB", fields["memory"])
    assert "host KV store" in fields["memory"]


def test_stats_json_on_request_and_the_full_cache_shows_no_pool(tiny):
    # item 9: JSON with --json; in full-cache mode the stats showed "policy": "lru" and a pool size, which
    # suggested a pool was in use.
    for pool, expect_pool in (("448", 448), ("off", None)):
        proc = kvflash("generate", "--model", tiny, "--backend", "cpu", "--threads", "1", "--n-ctx", "1024",
                       "--kvflash", pool, "--max-tokens", "8", "--temp", "0", "--prompt", TEXT, "--stats", "--json")
        assert proc.returncode == 0, proc.stderr
        stats = json.loads(proc.stderr.strip().splitlines()[-1])
        assert stats["pool_tokens"] == expect_pool and stats["mode"] == ("full" if pool == "off" else "kvflash")
        assert (stats["policy"] is None) == (pool == "off")
        assert stats["completion_tokens"] >= 1 and stats["prompt_tokens"] > 1
        assert stats["prompt_tokens_per_s"] > 0
        assert stats["decode_tokens_per_s"] is None or stats["decode_tokens_per_s"] > 0


# -- item 10: the pool is on by default ----------------------------------------------------------------------

def read_gguf_facts(path: str):
    from kvflash_ggml.commands.gguf_facts import read_gguf_facts
    return read_gguf_facts(path)


def test_the_api_and_the_cli_pool_by_default(tiny, long_trained):
    # item 10: `kvflash generate` defaulted to --kvflash off and Model() to the full cache, so the README demo
    # never ran a pool. Now both default to 'auto', and generate's context to the model's trained one (llama.cpp's
    # -c 0), so a model trained for 8K runs a pool of 4096 on the CPU.
    assert PoolConfig().pool_tokens == "auto"
    with kvf.Model(tiny, backend="cpu", n_threads=1) as m:
        assert m.stats()["mode"] == "kvflash" and m.stats()["pool_tokens"] == 4096
    args = generate.build_parser().parse_args(["--model", long_trained, "--prompt", "x"])
    assert args.kvflash == "auto" and args.n_ctx == 0
    flags.resolve_model_flags(args, read_gguf_facts(long_trained))
    assert args.n_ctx == 8192 and PoolConfig(n_ctx=args.n_ctx, pool_tokens=args.kvflash).resolved_pool_tokens() == 4096


@pytest.mark.slow
def test_the_default_pool_pages_a_long_prompt_and_starts_as_the_full_cache(long_trained):
    # item 10: with the defaults a prompt longer than the pool pages (the stats show it), and the exact prefill
    # gives the first token the full cache's logits, so the first generated token is the full cache's.
    prompt = " ".join(np.random.default_rng(0).choice(TEXT.split(), 1700))   # ~4600 tokens, more than the pool
    runs = {}
    for pool in (None, "off"):
        flags = ["--kvflash", pool] if pool else []
        proc = kvflash("generate", "--model", long_trained, "--backend", "cpu", "--threads", "1", "--max-tokens", "1",
                       "--temp", "0", "--no-display-prompt", "--prompt", prompt, "--stats", "--json", *flags,
                       timeout=600)
        assert proc.returncode == 0, proc.stderr
        runs[pool] = proc.stdout, json.loads(proc.stderr.strip().splitlines()[-1])
    (pooled_text, pooled), (full_text, full) = runs[None], runs["off"]
    assert pooled["mode"] == "kvflash" and pooled["pool_tokens"] == 4096 and pooled["n_ctx"] == 8192
    assert pooled["prompt_tokens"] > 4096 and pooled["page_outs"] > 0
    assert full["mode"] == "full" and full["page_outs"] == 0
    assert pooled_text == full_text and pooled_text.strip()


# -- item 15: chat on a model that cannot chat ---------------------------------------------------------------

def test_chat_on_a_gguf_without_a_template_is_refused(no_template, tiny, capsys, monkeypatch):
    # item 15: the Gemma 3 270M package is a base model without a chat template; `--chat` answered newlines.
    # A GGUF without a template is refused for --chat with the reason (a template may still be given), and a
    # known base model gets a one-line warning.
    argv = ["--model", no_template, "--backend", "cpu", "--threads", "1", "--n-ctx", "256", "--max-tokens", "2",
            "--prompt", "Hi", "--chat"]
    assert generate.main(argv) == 2
    err = capsys.readouterr().err
    assert "no chat template" in err and "base model" in err and len(err.strip().splitlines()) == 1
    template = rg.CHATML_TEMPLATE
    assert generate.main([*argv, "--chat-template", template]) == 0
    assert "warning" not in capsys.readouterr().err
    monkeypatch.setitem(generate.BASE_MODELS, tiny, "tiny-llama is a base model")
    assert generate.main([*argv[:1], tiny, *argv[2:]]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: tiny-llama is a base model: it completes text and does not follow chat turns") == 1


# -- item 16: llama.cpp's command lines ------------------------------------------------------------------------

def test_a_llama_server_command_line_serves(tiny, tmp_path, monkeypatch):
    # item 16: a script that starts llama-server must run unchanged with `kvflash serve` in its place. The typical
    # line, then a chat request through it by the alias.
    from kvflash_ggml.rpc import free_port
    from kvflash_ggml.testing.server_process import ServerProcess

    monkeypatch.setenv("HOME", str(tmp_path))   # the default prefix cache goes under ~/.cache
    port = free_port()
    line = f"-m {tiny} -c 4096 -np 2 -ngl 99 -fa on --host 127.0.0.1 --port {port} -a name -t 1 --jinja -cb --metrics"
    server = ServerProcess([sys.executable, "-m", "kvflash_ggml", "serve", *shlex.split(line)], port=port,
                           log=tmp_path / "serve.log")
    try:
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["name"] and models[0]["meta"]["slots"] == 2
        assert models[0]["meta"]["n_ctx"] == 4096
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                       json={"model": "name", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        server.stop()


def parsed(command, argv: list[str]):
    from kvflash_ggml.commands.llama_flags import resolve_parsed
    ap = command.build_parser()
    args = ap.parse_args(argv)
    resolve_parsed(args, ap)
    return args


def test_llama_spellings_map_onto_kvflash_options(tiny, capsys):
    # item 16: llama.cpp's spellings are aliases of ours, and those whose meaning differs are resolved:
    # -c 0 is the trained context, -ngl 0 the CPU and -ngl all (or >= the layer count) every layer where the
    # backend goes, -fa on/off the attention path, -ctk/-ctv the one KV type, -n -1 no limit.
    facts = read_gguf_facts(tiny)   # 2 layers, trained for 4096
    args = parsed(generate, ["-m", tiny, "-c", "0", "-n", "-1", "-p", "hi", "-t", "1", "-s", "7", "--temperature",
                             "0.5", "--top-k", "5", "-ngl", "0", "-fa", "off", "-ctk", "q8_0", "-ctv", "q8_0",
                             "-ub", "128", "-b", "2048", "-r", "STOP", "-md", tiny, "--draft", "6"])
    flags.resolve_model_flags(args, facts)
    assert (args.model, args.n_ctx, args.threads, args.prompt) == (tiny, 4096, 1, "hi")
    assert (args.backend, args.attention, args.kv_type, args.n_batch) == ("cpu", "matmul", "q8_0", 128)
    params = flags.sampling_params(args)
    assert (params.max_tokens, params.seed, params.temperature, params.top_k) == (None, 7, 0.5, 5)
    assert params.stop == ("STOP",)
    spec = flags.speculative_config(args)
    assert (spec.draft, spec.max_draft) == (tiny, 6)
    for ngl in ("99", "all", "2", "-1"):
        args = parsed(serve, ["-m", tiny, "-ngl", ngl, "-fa", "on"])
        flags.resolve_model_flags(args, facts)
        assert args.backend == "auto" and args.attention == "flash"
    capsys.readouterr()
    args = parsed(serve, ["-m", tiny, "-ngl", "1"])   # 1 of 2 layers: llama.cpp's partial offload
    with pytest.raises(ValueError, match=r"-ngl 1: kvflash has no partial offload by layer count \(this model has 2 "
                                         r"layers\).*--devices cpu,cuda0 --tensor-split 1,1"):
        flags.resolve_model_flags(args, facts)
    args = parsed(serve, ["-m", tiny, "-np", "-1", "-a", "x", "--chat-template", rg.CHATML_TEMPLATE])
    assert (args.parallel, args.alias) == (-1, "x")


@pytest.mark.parametrize("command, argv, message", [
    (generate, ["-ctk", "q8_0"], r"-ctk q8_0 -ctv f16: kvflash keeps K and V in one type"),
    (generate, ["-ctk", "q4_1", "-ctv", "q4_1"], r"kvflash keeps K and V in one type, one of f16, q8_0, q4_0"),
    (generate, ["-fa", "sometimes"], r"-fa/--flash-attn takes on, off or auto, got 'sometimes'"),
    (generate, ["-fa", "on", "--attention", "matmul"], r"-fa on \(--attention flash\) contradicts --attention matmul"),
    (generate, ["--mirostat", "2"], r"--mirostat 2 \(llama-cli's\) is not supported: kvflash samples with a temperature"),
    (generate, ["--repeat-penalty", "1.1"], r"--repeat-penalty 1\.1 \(llama-cli's\) is not supported"),
    (generate, ["-hf", "org/model"], r"-hf org/model \(llama-cli's\) is not supported: kvflash downloads nothing"),
    (generate, ["-cnv"], r"-cnv \(llama-cli's\) is not supported: kvflash generate answers one prompt"),
    (generate, ["--grammar-file", "g.gbnf"], r"--grammar-file g\.gbnf \(llama-cli's\) is not supported"),
    (serve, ["--lora", "a.gguf"], r"--lora a\.gguf \(llama-server's\) is not supported: kvflash loads no adapters"),
    (serve, ["--temp", "0.7"], r"--temp 0\.7 \(llama-server's\) is not supported: kvflash serve takes sampling per "
                               r"request .*gets temperature 0\.8"),
    (serve, ["-sm", "row"], r"-sm row \(llama-server's\) is not supported: kvflash splits a model by layers only"),
    (serve, ["--ssl-key-file", "k.pem"], r"--ssl-key-file k\.pem \(llama-server's\) is not supported: put a TLS"),
    (serve, ["-kvu"], r"-kvu \(llama-server's\) is not supported: kvflash manages each slot's context"),
    (serve, ["--embeddings"], r"--embeddings \(llama-server's\) is not supported"),
])
def test_llama_flags_without_a_meaning_here_are_refused_by_name(tiny, capsys, command, argv, message):
    # item 16: a llama.cpp flag kvflash does not support is refused by name, with what to use instead (never
    # silently ignored); a value that asks for what kvflash does anyway is accepted.
    with pytest.raises(SystemExit) as e:
        parsed(command, ["-m", tiny, *(["-p", "x"] if command is generate else []), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and re.search(message, err), err


def test_llama_flags_that_ask_for_what_kvflash_does_are_accepted(tiny):
    # item 16: neutral values and switches kvflash always honours run unchanged
    parsed(generate, ["-m", tiny, "-p", "x", "--repeat-penalty", "1.0", "--presence-penalty", "0", "-sm", "layer",
                      "--jinja", "-no-cnv", "-co", "off", "--no-warmup", "--display-prompt", "--no-escape"])
    parsed(serve, ["-m", tiny, "--temp", "0.8", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.05", "-s", "-1",
                   "-n", "-1", "--metrics", "--slots", "--no-webui", "-cb", "--cache-prompt", "-kvo"])


def test_every_llama_server_and_llama_cli_flag_has_an_answer():
    # item 16: every spelling of llama-server's and llama-cli's flags in the pinned tree is known to kvflash serve /
    # kvflash generate: its own flag, an accepted switch, or a refusal with the reason (argparse's bare
    # "unrecognized arguments" says nothing of what to use instead).
    arg_cpp = REPO / "third_party" / "llama.cpp" / "common" / "arg.cpp"
    if not arg_cpp.is_file():
        pytest.skip(f"{arg_cpp} is not fetched (scripts/fetch_llama_cpp.py)")
    source = arg_cpp.read_text()
    body = source[source.index("auto add_opt = [&](common_arg arg)"):]
    missing = {}
    for tool, command, example in (("llama-server", serve, "SERVER"), ("llama-cli", generate, "CLI")):
        known = set(command.build_parser()._option_string_actions)
        for block in body.split("add_opt(common_arg(")[1:]:
            head = block[:block.index("[](")] if "[](" in block else block[:300]
            examples = re.search(r"set_examples\(\{([^}]*)\}", block)
            excludes = re.search(r"set_excludes\(\{([^}]*)\}", block)
            wanted = examples is None or "COMMON" in examples.group(1) or f"_{example}" in examples.group(1)
            if not wanted or excludes and f"_{example}" in excludes.group(1):
                continue
            for spelling in re.findall(r'"(-[^"\s]*)"', head):
                if spelling not in known and spelling != "--version":
                    missing.setdefault(tool, []).append(spelling)
    assert not missing, missing


def test_llama_environment_variables_are_named_not_ignored(tiny, capsys, monkeypatch):
    # item 16: llama.cpp reads LLAMA_ARG_* as flags; kvflash says it does not, instead of ignoring them
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "8192")
    assert generate.main(["-m", tiny, "--backend", "cpu", "-t", "1", "-c", "256", "-n", "1", "-p", "x"]) == 0
    assert "LLAMA_ARG_CTX_SIZE set: llama.cpp's environment variables are not read here" in capsys.readouterr().err


def test_a_llama_cli_command_line_generates(tiny, tmp_path, capsys):
    # item 16: llama-cli's spellings for a completion: -m, -f, -n, -c, -ngl 0, -e, --no-display-prompt
    (tmp_path / "prompt.txt").write_text("The quick\\tbrown fox")
    argv = ["-m", tiny, "-f", str(tmp_path / "prompt.txt"), "-n", "6", "-c", "512", "-ngl", "0", "-t", "1", "--temp",
            "0", "-e", "--no-display-prompt"]
    assert generate.main(argv) == 0
    got = capsys.readouterr().out
    with kvf.Model(tiny, n_ctx=512, backend="cpu", n_threads=1) as m:
        want = m.create_completion("The quick\tbrown fox", max_tokens=6, temperature=0.0)["choices"][0]["text"]
    assert got == want + "\n"


def test_the_header_read_agrees_with_libllama(tiny, long_trained, smollm2_path, tmp_path):
    # items 10 and 16: --n-ctx 0 (the trained context, generate's default) and -ngl N read two numbers from the
    # GGUF's header without libllama's vocabulary load (2.6 s for Gemma 3's); they must be libllama's numbers.
    from kvflash_ggml import _core
    from kvflash_ggml.commands.gguf_facts import read_gguf_facts

    for path in (tiny, long_trained, smollm2_path):
        vocab = _core.Vocab(path)
        arch = vocab.meta("general.architecture")
        facts = read_gguf_facts(path)
        assert (facts.n_ctx_train, facts.n_layer) == (int(vocab.meta(f"{arch}.context_length")),
                                                      int(vocab.meta(f"{arch}.block_count")))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01" * 7)
    with pytest.raises(ValueError, match="junk.gguf: not a readable GGUF header"):
        read_gguf_facts(str(junk))
    junk.write_bytes(b"ggml" + b"\x00" * 40)
    with pytest.raises(ValueError, match="junk.gguf: not a readable GGUF header .*not .GGUF."):
        read_gguf_facts(str(junk))


def test_chat_special_and_beyond_the_trained_context_have_flags(tiny, capsys, monkeypatch):
    # item 16 (with issue items 3 and 12): Model's chat_special (llama-server's parsing of control-token text in chat
    # messages; text by default) and allow_beyond_train_ctx reach both commands: --parse-special-content and
    # --allow-beyond-train-ctx (llama.cpp runs past the trained context with a warning; kvflash on request).
    argv = ["-m", tiny, "--backend", "cpu", "-t", "1", "-n", "1", "-p", "x"]
    assert generate.main([*argv, "-c", "8192"]) == 2
    assert "exceeds the model's trained context 4096" in capsys.readouterr().err
    made = []
    real = generate.Model
    monkeypatch.setattr(generate, "Model", lambda *a, **k: made.append(k) or real(*a, **k))
    assert generate.main([*argv, "-c", "8192", "--allow-beyond-train-ctx", "--parse-special-content"]) == 0
    assert made[-1]["allow_beyond_train_ctx"] is True and made[-1]["chat_special"] is True
    assert generate.main(argv) == 0 and made[-1]["chat_special"] is False
    args = serve.build_parser().parse_args(["-m", tiny, "-np", "1", "-c", "8192", "--allow-beyond-train-ctx",
                                            "--parse-special-content", "--prefix-cache", "off", "-t", "1"])
    engines, _, _ = serve.build_engines(args)
    try:
        assert engines[0].tokenizer.chat_special and engines[0].pool.n_ctx == 8192
    finally:
        for e in engines:
            e.close()


def test_the_default_pool_of_a_split_model_is_fitted(long_trained, rpc_binary, capsys):
    # item 10: with 'auto' the default, `kvflash generate --rpc HOST:PORT` (docs/devices.md) met Model's refusal of
    # 'auto' on a split ('auto' measures one local GPU); 'auto' is resolved where every 'auto' is (fit.py: the API,
    # generate and serve alike). Issue 40 item 2 changed the number: the split's devices are fitted from their
    # own memory, and this CPU server reports this host's RAM (GBs), which holds the whole context: 8192 (was the
    # CPU's rule, min(n_ctx, 4096)). A size given is kept.
    from kvflash_ggml.rpc import start_rpc_server
    proc, endpoint = start_rpc_server(rpc_binary, threads=1)
    try:
        for extra, pool in (([], 8192), (["--kvflash", "1024"], 1024)):
            argv = ["-m", long_trained, "--rpc", endpoint, "-t", "1", "-n", "1", "-p", "x", "--json", *extra]
            assert generate.main(argv) == 0
            stats = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
            assert stats["pool_tokens"] == pool and stats["n_ctx"] == 8192
    finally:
        proc.terminate()
        proc.wait(timeout=10)
