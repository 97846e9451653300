"""Issue 18, the thread contract of a Model: calls from many threads are serialised (a lock held for a
whole call and for each step of a stream, never across a yield), so every greedy output equals the one
the same call gives alone; a call made while a stream of the same Model is unfinished supersedes it, whose
next step raises StreamSuperseded instead of going on from the other prompt's context; a closed Model
raises ValueError. Separate Models run side by side in threads. Tiny random model, one CPU thread each."""
from __future__ import annotations

import threading

import pytest

import kvflash_ggml as kvf
from kvflash_ggml import StreamSuperseded

N_THREADS, N_CALLS, MAX_TOKENS = 8, 50, 6
# Distinct from their first word, so no call reuses more of another's K/V than the BOS.
PROMPTS = ["The quick brown fox", "A pooled key-value cache", "In the beginning there was",
           "def forward(tokens, start):", "User: What is the capital of France?", "Numbers: 0 1 2 3",
           "When the scorer says that", "Most of it, it turns out,"]


def open_model(path: str, **kw) -> kvf.Model:
    return kvf.Model(path, n_ctx=512, backend="cpu", n_threads=1, **kw)


def text(out: dict) -> str:
    return out["choices"][0]["text"]


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    return tiny_gguf(seed=0)


@pytest.fixture(scope="module")
def twins(tiny):
    """Each prompt's greedy continuation, computed alone, one call at a time."""
    with open_model(tiny) as llm:
        return {p: text(llm.create_completion(p, max_tokens=MAX_TOKENS, temperature=0.0)) for p in PROMPTS}


def run_threads(work, n: int = N_THREADS) -> list:
    """work(i) in n threads started together; the exceptions they raised."""
    errors, start = [], threading.Barrier(n)

    def run(i: int) -> None:
        start.wait()
        try:
            work(i)
        except BaseException as e:   # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


def test_one_model_many_threads_equals_single_threaded(tiny, twins):
    outputs = []
    with open_model(tiny) as llm:
        def work(i: int) -> None:
            for j in range(N_CALLS):
                p = PROMPTS[(i + j) % len(PROMPTS)]
                outputs.append((p, text(llm.create_completion(p, max_tokens=MAX_TOKENS, temperature=0.0))))

        assert run_threads(work) == []
    assert len(outputs) == N_THREADS * N_CALLS
    assert [o for p, o in outputs if o != twins[p]] == []


def test_separate_models_in_threads(tiny, twins):
    models = [open_model(tiny) for _ in range(N_THREADS)]
    outputs = []

    def work(i: int) -> None:
        for j in range(N_CALLS // 2):
            p = PROMPTS[(i + j) % len(PROMPTS)]
            outputs.append((p, text(models[i].create_completion(p, max_tokens=MAX_TOKENS, temperature=0.0))))

    try:
        assert run_threads(work) == []
    finally:
        for m in models:
            m.close()
    assert len(outputs) == N_THREADS * (N_CALLS // 2)
    assert [o for p, o in outputs if o != twins[p]] == []


def test_a_later_call_supersedes_an_unfinished_stream(tiny, twins):
    a, b = PROMPTS[0], PROMPTS[1]
    with open_model(tiny) as llm:
        first = llm.create_completion(a, max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
        got = text(next(first))
        assert twins[a].startswith(got)
        assert text(llm(b, max_tokens=MAX_TOKENS, temperature=0.0)) == twins[b]   # __call__ = create_completion
        with pytest.raises(RuntimeError, match="superseded by a later call on the same Model"):
            next(first)
        with pytest.raises(StopIteration):   # and it stays finished
            next(first)
        # Two streams, the later one created before the earlier one is read: the call, not the first
        # next(), takes the session.
        s1 = llm.create_completion(a, max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
        s2 = llm.create_completion(b, max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
        with pytest.raises(StreamSuperseded):
            next(s1)
        assert "".join(text(c) for c in s2) == twins[b]
        # Engine.generate users get the same contract.
        records = llm.engine.generate(a, max_tokens=MAX_TOKENS, temperature=0.0)
        next(records)
        llm.engine.prefill(llm.tokenize(b))
        with pytest.raises(StreamSuperseded):
            next(records)


def test_streams_in_threads_finish_right_or_are_superseded(tiny, twins):
    results = []
    with open_model(tiny) as llm:
        def work(i: int) -> None:
            for j in range(N_CALLS // 5):
                p = PROMPTS[(i + j) % len(PROMPTS)]
                got = []
                try:
                    for chunk in llm.create_completion(p, max_tokens=MAX_TOKENS, temperature=0.0, stream=True):
                        got.append(text(chunk))
                    results.append((p, "".join(got), None))
                except StreamSuperseded as e:
                    results.append((p, "".join(got), e))

        assert run_threads(work) == []
    assert len(results) == N_THREADS * (N_CALLS // 5)
    wrong = [(p, got) for p, got, e in results if (got != twins[p] if e is None else not twins[p].startswith(got))]
    assert wrong == []


def test_closed_model_raises_value_error(tiny):
    llm = open_model(tiny)
    stream = llm.create_completion(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
    next(stream)
    llm.close()
    for call in (lambda: next(stream), lambda: llm.create_completion("x"), lambda: llm("x"),
                 lambda: llm.create_chat_completion([{"role": "user", "content": "x"}]), lambda: llm.tokenize("x"),
                 lambda: llm.stats(), lambda: llm.save_state("/tmp/never.kvf"), lambda: llm.engine.prefill([1, 2])):
        with pytest.raises(ValueError, match="Model is closed"):
            call()
    llm.close()   # twice is fine


@pytest.mark.slow
def test_smollm2_threads_equal_single_threaded(smollm2_path):
    prompts = PROMPTS[:4]
    with kvf.Model(smollm2_path, n_ctx=512, backend="cpu", n_threads=1) as llm:
        twin = {p: text(llm(p, max_tokens=MAX_TOKENS, temperature=0.0)) for p in prompts}
        outputs = []

        def work(i: int) -> None:
            for j in range(3):
                p = prompts[(i + j) % len(prompts)]
                outputs.append((p, text(llm(p, max_tokens=MAX_TOKENS, temperature=0.0))))

        assert run_threads(work, n=4) == []
    assert len(outputs) == 12 and [o for p, o in outputs if o != twin[p]] == []
