"""The server under concurrent load: 16 streamed requests on 4 slots with clients that leave part way, the
bounded queue's 503, and a non-streamed request whose client gives up. SmolLM2 on the CPU."""
from __future__ import annotations

import random
import re
import threading
import time

import httpx
import openai
import pytest

from kvflash_ggml.testing.server_process import ServerProcess

pytestmark = pytest.mark.slow

WORDS = ["Apples", "Bridges", "Clouds", "Deserts", "Engines", "Forests", "Glaciers", "Harbors", "Islands", "Jungles",
         "Kites", "Lanterns", "Mountains", "Nebulae", "Oceans", "Pyramids"]
PROMPTS = [f"{w} are interesting because" for w in WORDS]
MAX_TOKENS = 24
COUNTING = "1, 2, 3, 4, 5, 6,"   # SmolLM2 counts on to the end of its context: a request that runs long


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-load")
    s = ServerProcess.kvflash("--model", "smollm2", "--parallel", "4", "--queue", "32", "--kvflash", "512", "--n-ctx", "2048",
                      "--prefix-cache", str(root / "cache"), log=root / "server.log")
    yield s
    assert s.stop() and "Application shutdown complete" in s.log(), s.log()


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


def stream_text(client, model, prompt, *, leave_after=None) -> str:
    """The streamed text; leave_after=k closes the connection after k chunks (the client goes away)."""
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    parts = []
    for i, chunk in enumerate(stream):
        parts.append(chunk.choices[0].text)
        if leave_after is not None and i + 1 >= leave_after:
            stream.close()
            return "".join(parts)
    return "".join(parts)


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_idle(server, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        slots = httpx.get(f"{server.url}/slots").json()
        if not any(s["is_processing"] for s in slots) and metric(server, "kvflash_queue_length") == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"slots still busy after {timeout} s: {slots}")


def burst(server, model, leave: set[int]) -> dict[int, str]:
    client, out, errors = client_for(server), {}, []

    def run(i):
        try:
            out[i] = stream_text(client, model, PROMPTS[i], leave_after=3 if i in leave else None)
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return out


def test_concurrent_streams_equal_one_at_a_time_and_memory_settles(server):
    client = client_for(server)
    model = client.models.list().data[0].id
    alone = {i: stream_text(client, model, p) for i, p in enumerate(PROMPTS)}
    assert all(len(t) > 20 for t in alone.values())
    wait_idle(server)
    rss_before = server.rss_bytes()
    cancelled_before = metric(server, "kvflash_cancelled_requests_total")

    rng = random.Random(0)
    for round_ in range(2):
        leave = set(rng.sample(range(len(PROMPTS)), 5))
        together = burst(server, model, leave)
        for i, text in together.items():
            if i in leave:
                assert alone[i].startswith(text), (i, text, alone[i])   # what came before it left is the same
            else:
                assert text == alone[i], (i, text, alone[i])
        wait_idle(server)
        if round_ == 0:
            rss_after_first = server.rss_bytes()
    rss_after = server.rss_bytes()
    assert metric(server, "kvflash_cancelled_requests_total") > cancelled_before   # some left before the end
    assert metric(server, "kvflash_batched_steps_total") > 0   # slots decoded together, and still equal
    mib = 1 << 20
    # the burst's buffers are freed: within 64 MiB of before it, and a second burst adds nothing that stays
    assert rss_after_first <= rss_before + 64 * mib, (rss_before / mib, rss_after_first / mib)
    assert rss_after <= rss_after_first + 16 * mib, (rss_after_first / mib, rss_after / mib)
    # and it still serves
    assert client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                     temperature=0).choices[0].text == alone[0]


def test_a_client_that_gives_up_frees_its_slot(server):
    """A non-streamed request that would run to the full context; its client times out; the slot stops."""
    cancelled = metric(server, "kvflash_cancelled_requests_total")
    model = client_for(server).models.list().data[0].id
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", timeout=1.0,
                   json={"model": model, "prompt": COUNTING, "max_tokens": 2000, "temperature": 0})
    wait_idle(server, timeout=30)
    assert metric(server, "kvflash_cancelled_requests_total") == cancelled + 1


def test_a_full_queue_answers_503_with_retry_after(tmp_path):
    s = ServerProcess.kvflash("--model", "smollm2", "--parallel", "1", "--queue", "1", "--kvflash", "512", "--n-ctx", "2048",
                      "--prefix-cache", "off", log=tmp_path / "server.log")
    try:
        client = client_for(s)
        model = client.models.list().data[0].id
        long = client.completions.create(model=model, prompt=COUNTING, max_tokens=1500,
                                         temperature=0, stream=True)
        next(iter(long))   # the slot is busy
        waiting = threading.Thread(target=lambda: client.completions.create(model=model, prompt="Hi", max_tokens=1))
        waiting.start()
        deadline = time.monotonic() + 30
        while metric(s, "kvflash_queue_length") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = httpx.post(f"{s.url}/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        long.close()      # the busy slot's client leaves: the waiting request gets the slot
        waiting.join(60)
        assert not waiting.is_alive()
    finally:
        assert s.stop() and "Application shutdown complete" in s.log(), s.log()
