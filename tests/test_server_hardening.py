"""What a hostile or careless client can do to `kvflash serve` (issue 39): one request must not freeze the
server, bad text and bad files get OpenAI-shaped errors, conversations on disk are private, and a SIGTERM ends a
stream with an error event. A real server on 127.0.0.1 (SmolLM2 on the CPU); the prefix cache's modes in-process."""
from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import stat
import threading
import time

import httpx
import numpy as np
import pytest

from kvflash_ggml import _core
from kvflash_ggml.snapshot import PrefixCache
from kvflash_ggml.testing.server_process import ServerProcess

N_CTX = 2048
CONTROL = "<|im_end|>"   # a control token of SmolLM2's chat template: libllama's partition is quadratic in them


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-hardening")
    return {"cache": root / "new" / "prefix-cache", "slots": root / "slots", "log": root}


@pytest.fixture(scope="module")
def server(dirs):
    dirs["slots"].mkdir()
    s = ServerProcess.kvflash("--model", "smollm2", "--parallel", "1", "--kvflash", "512", "--n-ctx", str(N_CTX),
                              "--prefix-cache", str(dirs["cache"]), "--slot-save-path", str(dirs["slots"]),
                              log=dirs["log"] / "server.log")
    yield s
    assert s.stop() and "Application shutdown complete" in s.log(), s.log()


def post(server, path, *, timeout=30.0, **kw):
    return httpx.post(f"{server.url}{path}", timeout=timeout, **kw)


def health_latencies_while(server, busy: threading.Thread, deadline_s: float) -> list[float]:
    """/health's latency, probed again and again while `busy` runs (each probe started while it ran)."""
    latencies = []
    t_end = time.monotonic() + deadline_s
    while busy.is_alive() and time.monotonic() < t_end:
        t0 = time.perf_counter()
        try:
            ok = httpx.get(f"{server.url}/health", timeout=5.0).status_code == 200
        except httpx.TimeoutException:
            ok = False
        latencies.append(time.perf_counter() - t0 if ok else float("inf"))
        time.sleep(0.02)
    return latencies


def in_thread(fn):
    out = {}

    def run():
        t0 = time.perf_counter()
        try:
            out["response"] = fn()
        except Exception as e:   # noqa: BLE001 - the test reads it
            out["error"] = e
        out["seconds"] = time.perf_counter() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# -- item 1: one request must not freeze the server ------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("case", ["prompt", "chat", "tokenize", "token_ids", "messages", "body", "chunked"])
def test_an_oversized_request_is_refused_at_once_while_health_answers(server, case):
    # Issue 39 item 1: a 1 MB prompt of control tokens was tokenized on the event loop before the length check
    # (libllama's partition is quadratic in them): 413 after ~44 s while /health timed out; a 20 MB chat of
    # 300,000 messages did not answer in 11 min. Now: refused by size before tokenizing, the body before JSON.
    big = CONTROL * (1_000_000 // len(CONTROL))
    bodies = {"prompt": ("/v1/completions", {"prompt": big, "max_tokens": 1}),
              "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}], "max_tokens": 1}),
              "tokenize": ("/tokenize", {"content": big}),
              "token_ids": ("/v1/completions", {"prompt": [1] * 200_000, "max_tokens": 1}),
              # as many messages as the body cap lets through (2.3 MB): counted before pydantic validates each
              "messages": ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 80_000}),
              "body": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}] * 300_000})}
    path, body = bodies["body" if case == "chunked" else case]
    data = json.dumps(body, separators=(",", ":")).encode()
    if case == "chunked":   # no Content-Length: the body is counted as it arrives
        data = iter([data[i:i + (1 << 20)] for i in range(0, len(data), 1 << 20)])
    busy, out = in_thread(lambda: post(server, path, content=data, timeout=10.0,
                                       headers={"content-type": "application/json"}))
    latencies = health_latencies_while(server, busy, 10.0)
    busy.join(10.0)
    r = out.get("response")
    assert r is not None, out.get("error")
    assert r.status_code == 413, r.text
    code = "request_too_large" if case in ("body", "chunked") else "context_length_exceeded"
    assert r.json()["error"]["code"] == code, r.text
    assert out["seconds"] < 2.0, f"413 after {out['seconds']:.2f} s (bar: under 2 s)"
    assert max(latencies, default=0.0) < 1.0, f"/health latencies while the request ran: {latencies}"
    assert httpx.get(f"{server.url}/health", timeout=5.0).status_code == 200


@pytest.mark.slow
def test_a_request_that_fits_is_still_served(server):
    # Issue 39 item 1, the other side of the bound: a prompt of control tokens that fits is tokenized (off the
    # event loop) and answered, and a chat just under the message bound is not refused by count.
    r = post(server, "/v1/completions", json={"prompt": CONTROL * 50, "max_tokens": 1}, timeout=120.0)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 50, r.text
    n = len(post(server, "/tokenize", json={"content": CONTROL * 1000}).json()["tokens"])
    assert n == 1000


@pytest.mark.slow
def test_health_answers_while_a_prompt_within_the_bound_is_tokenized(tmp_path, smollm2_path):
    # Issue 39 item 1, "keep /health responsive under any single request": the largest prompt of control tokens the
    # byte bound lets through at SmolLM2's full context (8192 x the longest token: 66,000 control tokens) took
    # ~30 s to tokenize on the event loop (libllama's partition is quadratic in them), /health timing out. Now it is
    # tokenized off the loop (and the tokenizer's own partition is linear): /health answers and the 413 follows.
    from kvflash_ggml.server.limits import RequestLimits
    from kvflash_ggml.tokenizer import Tokenizer
    n_ctx = 8192
    limits = RequestLimits.of(Tokenizer(smollm2_path), n_ctx)
    s = ServerProcess.kvflash("--model", "smollm2", "--parallel", "1", "--kvflash", "512", "--n-ctx", str(n_ctx),
                              "--prefix-cache", "off", log=tmp_path / "server.log")
    try:
        prompt = CONTROL * (limits.max_text_bytes // len(CONTROL))
        busy, out = in_thread(lambda: post(s, "/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                                           timeout=300.0))
        latencies = health_latencies_while(s, busy, 300.0)
        busy.join(300.0)
    finally:
        s.stop()
    assert out["response"].status_code == 413, out
    assert out["seconds"] < 2.0, f"413 after {out['seconds']:.2f} s"
    assert latencies and max(latencies) < 1.0, latencies


# -- item 7: bad text, bad files, bad messages -----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"prompt": "abc\\ud800def", "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"prompt": ["\\udc00"], "max_tokens": 1}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud83d"}], "max_tokens": 1}',
     "messages.0.content"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}], "max_tokens": 1}',
     "messages.0.content.0.text"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 1}', "stop"),
    ("/tokenize", '{"content": "x\\ud800"}', "content"),
])
def test_a_lone_surrogate_is_a_400_naming_it(server, path, body, param):
    # Issue 39 item 7: a lone surrogate (a JSON escape that is half of a pair) reached pybind11, whose
    # "incompatible function arguments" became a plain-text 500. Now a 400 naming the field and the index.
    with httpx.Client(base_url=server.url, timeout=30.0) as c:
        r = c.post(path, content=body.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "lone surrogate" in error["message"] and error["param"] == param, error
        assert c.get("/health").status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("message, ok", [
    ({"role": "user"}, False),
    ({"role": "user", "content": None}, False),
    ({"role": "system"}, False),
    ({"role": "assistant"}, False),
    ({"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                           "function": {"name": "f", "arguments": "{}"}}]}, True),
])
def test_a_message_without_content_is_a_400(server, message, ok):
    # Issue 39 item 7: a user message without content was accepted (OpenAI answers 400); only an assistant
    # message that calls tools may go without content.
    messages = [message, {"role": "user", "content": "Hi"}]
    r = post(server, "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=120.0)
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages.0" and "needs 'content'" in error["message"], error


def keep_alive_request(conn: http.client.HTTPConnection, method: str, path: str, body: dict) -> tuple[int, dict]:
    conn.request(method, path, body=json.dumps(body), headers={"content-type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


@pytest.mark.slow
def test_a_failed_slot_save_is_an_openai_error_on_a_kept_connection(server, dirs):
    # Issue 39 item 7: a failed slot save (a directory at the file's place, a full disk) answered a plain 500
    # and the server closed the client's keep-alive connection. Now an OpenAI error naming the reason, and the
    # same connection serves the next request.
    (dirs["slots"] / "taken.kvf").mkdir()
    r = post(server, "/v1/completions", json={"prompt": "The river runs", "max_tokens": 2}, timeout=120.0)
    assert r.status_code == 200
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.auto_open = 0   # a closed connection is an error here, not a silent reconnect
    conn.connect()
    try:
        status, body = keep_alive_request(conn, "POST", "/slots/0?action=save", {"filename": "taken.kvf"})
        assert status in (400, 500) and body["error"]["code"] == "slot_save_failed", body
        assert "taken.kvf" in body["error"]["message"] and "directory" in body["error"]["message"].lower(), body
        status, body = keep_alive_request(conn, "POST", "/slots/0?action=save", {"filename": "ok.kvf"})
        assert status == 200 and body["n_saved"] > 0, body
    finally:
        conn.close()
    # item 4: a slot file holds the conversation: 0600
    assert stat.S_IMODE((dirs["slots"] / "ok.kvf").stat().st_mode) == 0o600


# -- item 4: the prefix cache is private, and the startup log says where it is ---------------------------------

@pytest.mark.slow
def test_the_startup_log_says_where_the_prefix_cache_is(server, dirs):
    # Issue 39 item 4: the server kept every conversation on disk by default without saying so.
    assert f"prefix cache on: {dirs['cache']}" in server.log(), server.log()
    assert stat.S_IMODE(dirs["cache"].stat().st_mode) == 0o700


@pytest.fixture(scope="module")
def tiny_model(tiny_gguf):
    return _core.Model(tiny_gguf(), backend="cpu", n_threads=1)


def tiny_session(model, n_tokens: int, seed: int = 0):
    s = _core.Session(model, _core.SessionConfig(max_tokens=1024, pool_tokens=512))
    s.forward(np.random.default_rng(seed).integers(0, 1000, n_tokens).astype(np.int32), 0)
    return s


def test_the_prefix_cache_folder_is_0700_and_its_files_0600(tiny_model, tmp_path, caplog):
    # Issue 39 item 4: prefix-cache files were 0644 in a 0755 folder, and their token section detokenizes to the
    # prompt: any user of the machine could read every conversation. A folder the cache creates is 0700, each
    # file it stores or uses is 0600; a folder others can enter is a warning (its mode is the user's to change).
    folder = tmp_path / "a" / "cache"
    cache = PrefixCache(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    stored = cache.store("k", tiny_session(tiny_model, 200))
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    os.chmod(stored, 0o644)   # as an older version left it
    assert cache.lookup("k", tiny_session(tiny_model, 200).tokens.tolist()).path == stored
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with caplog.at_level(logging.WARNING, logger="kvflash_ggml.snapshot"):
        PrefixCache(shared)
    assert "other users may read this folder" in caplog.text
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755


# -- item 7: an error nothing expected is still an OpenAI error --------------------------------------------------

@pytest.fixture
def tiny_app(tiny_model, tiny_gguf):
    from starlette.testclient import TestClient

    from kvflash_ggml.options import PoolConfig, ResidencyConfig
    from kvflash_ggml.server.app import ServerState, create_app
    from kvflash_ggml.server.scheduler import Scheduler, slot_engines
    from kvflash_ggml.tokenizer import Tokenizer
    engines = slot_engines(1, tiny_model, Tokenizer(tiny_gguf()), PoolConfig(n_ctx=512, pool_tokens=None),
                           ResidencyConfig(), store_each_turn=False)
    state = ServerState(scheduler=Scheduler(engines, max_queue=1), model_name="tiny")
    with TestClient(create_app(state), raise_server_exceptions=False) as client:
        yield client, engines[0]


def test_an_unexpected_error_is_an_openai_500(tiny_app, monkeypatch):
    # Issue 39 item 7: an error no handler expected (then: pybind11's TypeError for a lone surrogate) was
    # answered by Starlette's outermost handler as a plain-text 500, which then re-raised, so uvicorn closed the
    # client's keep-alive connection. Now an OpenAI-shaped 500 naming the error, answered like any other.
    client, engine = tiny_app

    def broken(*_a, **_k):
        raise TypeError("incompatible function arguments")

    monkeypatch.setattr(engine.tokenizer, "decode", broken)
    r = client.post("/detokenize", json={"tokens": [1, 2]})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert error["type"] == "server_error" and "TypeError: incompatible function arguments" in error["message"]
    assert client.get("/health").status_code == 200


def test_a_body_larger_than_any_fitting_request_is_a_413_before_parsing(tiny_app):
    # Issue 39 item 1: the body is capped before JSON parsing, at what the largest request that fits can need,
    # by its Content-Length or, sent in chunks, as it arrives; a body within the cap reaches the endpoint whole.
    from kvflash_ggml.server.limits import RequestLimits
    client, engine = tiny_app
    limit = RequestLimits.of(engine.tokenizer, 512).max_body_bytes
    junk = b"[" + b" " * limit + b"]"   # not even JSON: refused before anything reads it
    r = client.post("/tokenize", content=junk, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    r = client.post("/tokenize", content=iter([junk[:1000], junk[1000:]]), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    body = json.dumps({"content": "hello"}).encode()
    padded = body[:-1] + b" " * (limit - len(body)) + b"}"   # exactly the cap: served
    r = client.post("/tokenize", content=padded, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["tokens"], r.text


# -- item 7: SIGTERM during a stream ---------------------------------------------------------------------------

@pytest.mark.slow
def test_sigterm_during_a_stream_ends_it_with_an_error_event(tmp_path):
    # Issue 39 item 7: a SIGTERM during a stream cut the connection mid-response (the client read an incomplete
    # chunked body). Now the stream ends with an error event naming the shutdown, the response is whole, and the
    # server exits promptly.
    s = ServerProcess.kvflash("--model", "smollm2", "--parallel", "1", "--kvflash", "512", "--n-ctx", str(N_CTX),
                              "--prefix-cache", "off", log=tmp_path / "server.log")
    events, t_term = [], None
    try:
        body = {"prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 1500, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60.0) as r:
            for line in r.iter_lines():   # raises if the body is cut
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                if len(events) == 5 and t_term is None:
                    t_term = time.monotonic()
                    s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(30)
        t_exit = time.monotonic() - t_term
    finally:
        clean = s.stop()
    assert clean, s.log()
    last = json.loads(events[-1])
    assert last["error"]["code"] == "server_shutting_down", events[-3:]
    assert all("choices" in json.loads(e) for e in events[:-1])
    assert t_exit < 10.0, f"the server took {t_exit:.1f} s to exit after SIGTERM"
