"""Issue 39 items 12 and 14: the options a user meets say one thing everywhere. pool_tokens follows the CLI's rule
(0 is refused, not a silent full cache), the n_ctx error's advice is a keyword Model takes, Model.devices exists
as documented, and the default thread count leaves out the cores other processes keep busy (ggml's spinning
threads made decoding 30-80x slower on shared cores). Tiny random-weight models, CPU."""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

import pytest

import kvflash_ggml as kvf
from kvflash_ggml import threads
from kvflash_ggml.commands.flags import parse_pool
from kvflash_ggml.testing import random_gguf as rg

GREEDY = dict(max_tokens=3, temperature=0.0)


@pytest.fixture(scope="module")
def short_ctx(tmp_path_factory):
    """A tiny llama trained for 512 positions."""
    return str(rg.write_preset(tmp_path_factory.mktemp("short") / "short.gguf", "tiny-llama", n_ctx_train=512))


# -- item 12 ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pool", [0, -64])
def test_pool_tokens_zero_is_refused_as_the_cli_refuses_it(tiny_gguf, pool):
    # regression: Model(pool_tokens=0) silently ran the full cache while `--kvflash 0` was an error
    with pytest.raises(ValueError, match=r"pool_tokens must be a positive number of tokens, 'auto', or None / 'off'"):
        kvf.Model(tiny_gguf(), pool_tokens=pool, backend="cpu", n_threads=1)
    with pytest.raises(argparse.ArgumentTypeError, match="pool must be positive"):
        parse_pool(str(pool))


@pytest.mark.parametrize("pool", [None, "off"])
def test_the_full_cache_is_still_none_or_off(tiny_gguf, pool):
    with kvf.Model(tiny_gguf(), n_ctx=256, pool_tokens=pool, backend="cpu", n_threads=1) as m:
        assert m.engine.session.full_cache


def test_n_ctx_past_the_trained_context_names_a_keyword_model_takes(short_ctx):
    # regression: the error said "pass allow_beyond_train_ctx", a keyword Model did not accept (TypeError)
    with pytest.raises(ValueError, match=r"n_ctx=1024 exceeds the model's trained context 512; pass "
                                         r"allow_beyond_train_ctx=True"):
        kvf.Model(short_ctx, n_ctx=1024, backend="cpu", n_threads=1)
    with kvf.Model(short_ctx, n_ctx=1024, allow_beyond_train_ctx=True, backend="cpu", n_threads=1) as m:
        assert m.pool.allow_beyond_train_ctx and m.engine.session.config.max_tokens == 1024
        past = list(range(5, 605))   # 600 prompt positions: past the 512 trained
        assert m.create_completion(past, **GREEDY)["usage"]["completion_tokens"] == 3


def test_model_devices_shows_the_split(tiny_gguf):
    # regression: docs/devices.md (then the README) documents Model.devices; Model had no such attribute
    m = kvf.Model(tiny_gguf(), n_ctx=256, backend="cpu", n_threads=1)
    n_layer = m._core_model.hparams.n_layer
    devices = m.devices
    assert [d["name"] for d in devices] == ["CPU"]
    assert devices[0]["layers"] == list(range(n_layer + 1))   # n_layer: the output layer
    assert devices[0]["weight_bytes"] == m._core_model.weight_bytes
    m.close()
    with pytest.raises(ValueError, match="closed"):
        m.devices


def test_a_split_model_loads_with_the_default_pool(tiny_gguf):
    # regression: with 'auto' the default pool (item 10), Model(devices=... / rpc=...) refused to load without a
    # number ('auto' fits one local GPU's memory); on a split 'auto' is the CPU's rule, min(n_ctx, 4096), as the
    # CLI resolves it
    with kvf.Model(tiny_gguf(), n_ctx=256, devices=["cpu"], n_threads=1) as m:
        assert m.stats()["pool_tokens"] == kvf.PoolConfig(n_ctx=256, pool_tokens="auto").resolved_pool_tokens() == 256
        assert m.create_completion("hello", **GREEDY)["usage"]["completion_tokens"] >= 1


# -- item 14 ---------------------------------------------------------------------------------------------

def test_free_cores_leave_out_what_other_processes_keep_busy():
    # Issue 39 item 14: the default thread count took every core, and on cores another process keeps busy ggml's
    # spinning threads made a decode 30-80x slower; it now leaves out the cores others use (a core counts when
    # more than half of one is busy), never fewer than one
    for cores, busy, expected in ((2, 1.0, 1), (2, 0.3, 2), (2, 0.6, 1), (2, 7.5, 1), (16, 3.2, 13), (4, None, 4),
                                  (1, 0.9, 1)):
        assert threads.free_cores(cores, busy) == expected, (cores, busy)


def test_default_threads_follow_the_sample_and_an_explicit_count_wins(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    assert threads.cpu_threads(None, sample=lambda: 2.2) == 2
    assert threads.cpu_threads(0, sample=lambda: 0.1) == 4
    assert threads.cpu_threads(None, sample=lambda: None) == 4   # no /proc/stat: every core

    def never() -> float:
        raise AssertionError("an explicit n_threads needs no sample")
    assert threads.cpu_threads(3, sample=never) == 3
    assert threads.cpu_threads(9, sample=never) == 4   # clamped, as before
    with pytest.raises(ValueError, match="n_threads must be a positive integer"):
        threads.cpu_threads(-1)


def test_a_model_loaded_beside_a_busy_process_leaves_its_core(tiny_gguf):
    # The measurement itself: a process spinning on one core is seen, and Model(n_threads=None) takes one thread
    # less than the cores this process may use (more when other work keeps more busy).
    cores = threads.usable_cores()
    if cores < 2:
        pytest.skip("one core: one thread either way")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)   # started and spinning
        assert threads.busy_cores_of_others() >= 0.5
        with kvf.Model(tiny_gguf(), n_ctx=256, backend="cpu") as m:
            assert 1 <= m._core_model.n_threads <= cores - 1
    finally:
        hog.kill()
        hog.wait()
