"""A resend of the prompt the session ran last (a client sending the same conversation again, a regenerate) is
answered from what that prompt computed, while the session holds its positions unchanged (Session.n_unchanged):
no token of it runs again. Before, its last token ran again as a one-token layer-major prefill, which stages every
position of the history (~1.4 s a resend at 32K on the 27B shape, R112).

The reference is a first send: the resend's logits are the same array, and its greedy continuation the same tokens
(the post-prompt reselect runs again with the first send's scores, so the pool holds what the first send left it).
Where the positions changed in between, or a ring or a linear-attention state cannot go back to the prompt's end,
the prompt runs as any other and the answer agrees with the first send's within the kernels' reassociation.
"""
from __future__ import annotations

import numpy as np
import pytest
from kvflash_ggml import Model
from kvflash_ggml.testing import random_gguf as rg

MAX_TOKENS = 1024
POOL = 448   # the smallest pool: a 700-token prompt runs layer-major and pages
# a prompt run again (exactly, over another split of steps) against its first run: reassociation only
TOL_RERUN = 1e-4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return rg.preset_files(tmp_path_factory.mktemp("resend"), {
        "llama": ("tiny-llama", dict(weight_type="f32")),
        "qwen35": ("tiny-qwen35", dict(weight_type="f32")),   # a linear-attention state beside the pool
        "gemma3": ("tiny-gemma3", dict(weight_type="f32")),   # sliding-window rings beside the pool
    })


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(10, 250, n).tolist()


def open_model(path: str, **kw) -> Model:
    return Model(model_path=path, n_ctx=MAX_TOKENS, pool_tokens=POOL, prefill="exact", backend="cpu", n_threads=1,
                 attention="matmul", **kw)


def greedy_text(llm: Model, tokens: list[int], n: int) -> tuple[str, dict]:
    out = llm.create_completion(tokens, max_tokens=n, temperature=0.0)
    return out["choices"][0]["text"], llm.stats()


@pytest.mark.parametrize("name", ["llama", "qwen35"])
def test_a_resend_is_answered_without_running_the_prompt_again(model_path, name):
    p = prompt(700)
    with open_model(model_path(name)) as llm:
        first = llm.engine.prefill(p)
        assert llm.stats()["prompt_tokens_computed"] == 700
        assert llm.engine.session.pager.stats().page_outs > 0   # the prompt did not fit the pool
        again = llm.engine.prefill(p)                           # held as it is
        assert llm.stats()["prompt_tokens_computed"] == 0 and llm.stats()["prompt_tokens_reused"] == 700
        np.testing.assert_array_equal(again, first)

        text, _ = greedy_text(llm, p, 24)                       # decoding moves the session past the prompt
        resent, stats = greedy_text(llm, p, 24)
        assert stats["prompt_tokens_computed"] == 0 and llm.engine.session.n_tokens >= 700
    with open_model(model_path(name)) as fresh:
        cold, _ = greedy_text(fresh, p, 24)
    assert resent == text == cold


@pytest.mark.parametrize("name", ["llama", "qwen35"])
def test_a_resend_after_its_positions_changed_runs_again(model_path, name):
    p = prompt(700)
    with open_model(model_path(name)) as llm:
        first = llm.engine.prefill(p)
        s = llm.engine.session
        s.truncate(s.rewind_point(690))     # below the prompt's end: what the answer was computed from is gone
        assert s.n_unchanged < 700
        again = llm.engine.prefill(p)
        assert llm.stats()["prompt_tokens_computed"] > 0
        diff = np.abs(again - first).max()
        assert diff <= TOL_RERUN, f"max |logit diff| of the rerun to the first send {diff:.3g}"

        llm.engine.prefill(prompt(700, seed=1))   # another prompt: the first one's answer is gone
        llm.engine.prefill(p)
        assert llm.stats()["prompt_tokens_computed"] > 0


def test_a_prompt_that_differs_in_its_last_token_is_not_answered_from_the_held_one(model_path):
    p = prompt(700)
    q = p[:-1] + [p[-1] + 1]
    with open_model(model_path("llama")) as llm, open_model(model_path("llama")) as fresh:
        llm.engine.prefill(p)
        got = llm.engine.prefill(q)
        assert llm.stats()["prompt_tokens_computed"] == 1
        want = fresh.engine.prefill(q)
    assert np.abs(got - want).max() <= TOL_RERUN


def test_a_ring_that_cannot_go_back_to_the_prompts_end_runs_it_again(model_path):
    # tiny-gemma3's rings hold the window and a step: after a long continuation the prompt's end is out of reach
    p = prompt(700)
    with open_model(model_path("gemma3")) as llm:
        text, _ = greedy_text(llm, p, 8)
        llm.create_completion(list(llm.engine.session.tokens) + prompt(200, seed=2), max_tokens=1, temperature=0.0)
        assert llm.engine.session.rewind_point(700) < 700
        resent, stats = greedy_text(llm, p, 8)
        assert stats["prompt_tokens_computed"] > 0
    assert resent == text


def test_n_unchanged_counts_the_positions_held_since_the_mark(model_path):
    with open_model(model_path("llama")) as llm:
        s = llm.engine.session
        s.forward(np.asarray(prompt(200), dtype=np.int32), 0)
        assert s.n_unchanged == 0                  # no mark yet
        s.mark_unchanged()
        assert s.n_unchanged == 200
        s.forward(np.asarray(prompt(60, seed=3), dtype=np.int32), 200)
        s.truncate(230)                            # above the mark: what it counts stays
        assert s.n_unchanged == 200
        s.truncate(150)
        s.forward(np.asarray(prompt(100, seed=4), dtype=np.int32), 150)
        assert s.n_unchanged == 150                # held again, but not as they were
        s.reset()
        assert s.n_unchanged == 0


def test_a_loaded_state_is_not_the_one_the_answer_was_computed_from(model_path, tmp_path):
    p = prompt(700)
    with open_model(model_path("llama")) as llm, open_model(model_path("llama")) as other:
        other.engine.prefill(p)
        other.save_state(tmp_path / "same-tokens.kvf")
        llm.engine.prefill(p)
        llm.load_state(tmp_path / "same-tokens.kvf")   # the same tokens, another session's bytes
        assert llm.engine.session.n_unchanged == 0
        llm.engine.prefill(p)
        assert llm.stats()["prompt_tokens_computed"] == 1
