"""`kvflash serve` driven as a user drives it: a real server process on a free port, the official `openai`
client (and plain HTTP where the client cannot send what we test), SmolLM2 on the CPU."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from kvflash_ggml.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

KEY = "test-key"
N_CTX = 2048


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    return {"cache": root / "prefix-cache", "slots": root / "slots", "log": root}


@pytest.fixture(scope="module")
def server(dirs):
    s = ServerProcess.kvflash("--model", "smollm2", "--parallel", "2", "--kvflash", "512", "--n-ctx", str(N_CTX),
                      "--api-key", KEY, "--prefix-cache", str(dirs["cache"]), "--slot-save-path", str(dirs["slots"]),
                      log=dirs["log"] / "server.log")
    yield s
    assert s.stop() and "Application shutdown complete" in s.log(), s.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def http(server, method, path, **kw):
    headers = {"Authorization": f"Bearer {KEY}", **kw.pop("headers", {})}
    return httpx.request(method, f"{server.url}{path}", headers=headers, timeout=120, **kw)


CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def test_models_lists_the_served_model(client, model_id):
    models = client.models.list().data
    assert [m.id for m in models] == [model_id] == ["SmolLM2-135M-Instruct.Q4_1"]


def test_completion_and_its_usage(server, client, model_id):
    r = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert "Paris" in r.choices[0].text
    n_prompt = len(http(server, "POST", "/tokenize", json={"content": "The capital of France is",
                                                            "add_special": True}).json()["tokens"])
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 8, n_prompt + 8)
    kv = r.usage.model_extra["kvflash"]
    assert kv["pool_tokens"] == 512 and kv["device_kv_bytes"] > 0 and kv["tokens"] == n_prompt + 7


def test_chat_stream_equals_the_unstreamed_answer(client, model_id):
    whole = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and len(text) > 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_equals_the_unstreamed_text(client, model_id):
    kw = dict(model=model_id, prompt="Once upon a time", max_tokens=20, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    assert "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)) == whole


def test_stop_strings_end_the_text_before_them(client, model_id):
    kw = dict(model=model_id, prompt="Count: 1, 2, 3,", max_tokens=24, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    assert stop.strip(), free
    r = client.completions.create(**kw, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[:free.index(stop)]


def test_seeded_sampling_repeats(client, model_id):
    kw = dict(model=model_id, prompt="My favourite animal is", max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_logprobs(client, model_id):
    r = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen <= 0 and chosen == pytest.approx(max(top.values()))   # greedy: the top one
    c = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)


@pytest.mark.parametrize("body, status, code", [
    ({"prompt": "x", "max_tokens": -1}, 400, None),
    ({"prompt": "x", "temperature": "hot"}, 400, None),
    ({"prompt": "x", "n": 2}, 400, None),
    ({"prompt": "x", "model": "gpt-17"}, 404, "model_not_found"),
    ({"prompt": "x " * (N_CTX + 10)}, 413, "context_length_exceeded"),
    ({"prompt": [10 ** 9]}, 400, None),
    ({"max_tokens": 3}, 400, None),
])
def test_bad_requests_get_openai_errors(server, body, status, code):
    r = http(server, "POST", "/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["code"] == code


def test_malformed_json_wrong_key_unknown_path(server, client, model_id):
    r = http(server, "POST", "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200   # health needs no key
    assert http(server, "GET", "/v1/nothing").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="another", messages=CHAT)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_id, messages=[{"role": "wizard", "content": "x"}])
    # and it still serves
    assert client.completions.create(model=model_id, prompt="Hello", max_tokens=2).usage.completion_tokens == 2


def test_tokenize_detokenize(server):
    tokens = http(server, "POST", "/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert tokens and http(server, "POST", "/detokenize", json={"tokens": tokens}).json()["content"] == "Hello world"
    pieces = http(server, "POST", "/tokenize", json={"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokens and "".join(p["piece"] for p in pieces) == "Hello world"
    assert http(server, "POST", "/detokenize", json={"tokens": [-5]}).status_code == 400


def test_slots_save_erase_restore(server, client, model_id, dirs):
    long_chat = [{"role": "user", "content": "Tell me about rivers. " * 20}]
    client.chat.completions.create(model=model_id, messages=long_chat, max_tokens=4, temperature=0)
    slots = http(server, "GET", "/slots").json()
    assert len(slots) == 2 and all(not s["is_processing"] for s in slots)
    slot = max(slots, key=lambda s: s["n_tokens"])
    sid, held = slot["id"], slot["n_tokens"]
    assert held > 100
    saved = http(server, "POST", f"/slots/{sid}?action=save", json={"filename": "rivers.kvf"}).json()
    assert saved["n_saved"] == held and (dirs["slots"] / "rivers.kvf").stat().st_size == saved["n_written"]
    assert http(server, "POST", f"/slots/{sid}?action=erase").json()["n_erased"] == held
    assert http(server, "GET", "/slots").json()[sid]["n_tokens"] == 0
    assert http(server, "POST", f"/slots/{sid}?action=restore", json={"filename": "rivers.kvf"}).json()["n_restored"] \
        == held
    # the restored slot continues without computing the prompt again
    r = client.chat.completions.create(model=model_id, messages=long_chat, max_tokens=4, temperature=0)
    assert r.usage.model_extra["kvflash"]["prompt_tokens_reused"] >= r.usage.prompt_tokens - 1
    for name in ("../escape.kvf", "a/b.kvf", ".hidden", "x" * 300):
        r = http(server, "POST", f"/slots/{sid}?action=save", json={"filename": name})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_filename", name
    assert not (dirs["slots"].parent / "escape.kvf").exists()
    assert http(server, "POST", f"/slots/{sid}?action=restore", json={"filename": "missing.kvf"}).status_code == 404
    (dirs["slots"] / "junk.kvf").write_bytes(b"not a snapshot")
    assert http(server, "POST", f"/slots/{sid}?action=restore", json={"filename": "junk.kvf"}).status_code == 400
    assert http(server, "POST", "/slots/9?action=save", json={"filename": "x.kvf"}).status_code == 404
    assert http(server, "POST", f"/slots/{sid}?action=fly").status_code == 400


def test_metrics(server, client, model_id):
    client.completions.create(model=model_id, prompt="Hi", max_tokens=2)
    text = http(server, "GET", "/metrics").text
    assert 'kvflash_requests_total{endpoint="/v1/completions",status="200"}' in text
    for name in ("kvflash_generated_tokens_total", "kvflash_queue_length", 'kvflash_slot_pool_bytes{slot="1"}',
                 "kvflash_slot_page_ins_total", "kvflash_prompt_tokens_total"):
        assert name in text, name
    pool_bytes = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvflash_slot_pool_bytes{")]
    assert len(pool_bytes) == 2 and all(b > 0 for b in pool_bytes)


def test_one_log_line_per_request(server):
    text = http(server, "GET", "/metrics").text   # every request so far, this one not yet
    served = sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvflash_requests_total{"))
    time.sleep(0.5)
    lines = [json.loads(line.split(" INFO ", 1)[1]) for line in server.log().splitlines()
             if "kvflash_ggml.server.requests INFO" in line]
    assert len(lines) == served + 1
    generations = [entry for entry in lines if "completion_tokens" in entry]
    assert generations and all(entry["slot"] in (0, 1) and entry["prompt_tokens"] > 0 for entry in generations)
    assert {entry["outcome"] for entry in generations} == {"done"}


def test_restart_resumes_from_the_prefix_cache(dirs, tmp_path):
    """A conversation, the server stopped (SIGTERM) and started again on the same prefix cache: the next turn
    of that conversation reuses the stored prefix instead of computing it again."""
    flags = ("--model", "smollm2", "--parallel", "1", "--kvflash", "512", "--n-ctx", str(N_CTX),
             "--prefix-cache", str(tmp_path / "cache"))
    turn1 = [{"role": "user", "content": "Here is a long story about a lighthouse keeper. " * 12}]
    first = ServerProcess.kvflash(*flags, log=tmp_path / "a.log")
    try:
        c = openai.OpenAI(base_url=f"{first.url}/v1", api_key="none", max_retries=0, timeout=120)
        r1 = c.chat.completions.create(model=c.models.list().data[0].id, messages=turn1, max_tokens=8, temperature=0)
    finally:
        assert first.stop() and "Application shutdown complete" in first.log(), first.log()
    assert r1.usage.prompt_tokens > 128
    assert list((tmp_path / "cache").glob("*.kvf")), "nothing stored at shutdown"
    second = ServerProcess.kvflash(*flags, log=tmp_path / "b.log")
    try:
        c = openai.OpenAI(base_url=f"{second.url}/v1", api_key="none", max_retries=0, timeout=120)
        turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                         {"role": "user", "content": "Who is the story about?"}]
        r2 = c.chat.completions.create(model=c.models.list().data[0].id, messages=turn2, max_tokens=8, temperature=0)
    finally:
        second.stop()
    reused = r2.usage.model_extra["kvflash"]["prompt_tokens_reused"]
    assert reused >= r1.usage.prompt_tokens // 64 * 64, (reused, r1.usage.prompt_tokens)
    assert r2.usage.model_extra["kvflash"]["prompt_tokens_computed"] == r2.usage.prompt_tokens - reused
