"""Issue 39 items 12 and 14: the options a user meets say one thing everywhere. pool_tokens follows the CLI's rule
(0 is refused, not a silent full cache), the n_ctx error's advice is a keyword Model takes, Model.devices exists
as documented, and the package makes ggml's OpenMP threads wait passively unless the user chose otherwise
(spinning threads made decoding 30-80x slower on shared cores). Tiny random-weight models, CPU."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap

import pytest

import kvflash_ggml as kvf
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
    # regression: the README documents Model.devices; Model had no such attribute
    m = kvf.Model(tiny_gguf(), n_ctx=256, backend="cpu", n_threads=1)
    n_layer = m._core_model.hparams.n_layer
    devices = m.devices
    assert [d["name"] for d in devices] == ["CPU"]
    assert devices[0]["layers"] == list(range(n_layer + 1))   # n_layer: the output layer
    assert devices[0]["weight_bytes"] == m._core_model.weight_bytes
    m.close()
    with pytest.raises(ValueError, match="closed"):
        m.devices


# -- item 14 ---------------------------------------------------------------------------------------------

def run_python(code: str, **env_changes) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_changes)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


POLICY = "import kvflash_ggml, os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"


def test_openmp_threads_wait_passively_by_default():
    # regression: with the OpenMP default, ggml's threads spin at every barrier and between steps, and a decode on
    # cores shared with another busy process ran 30-80x slower than one thread
    proc = run_python(POLICY)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["passive", "None"]


@pytest.mark.parametrize("env, expected", [({"OMP_WAIT_POLICY": "active"}, ["active", "None"]),
                                           ({"GOMP_SPINCOUNT": "10000"}, ["None", "10000"])])
def test_a_users_own_wait_policy_wins(env, expected):
    proc = run_python(POLICY, **env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == expected


def test_the_wait_policy_reaches_openmp():
    # Set before libgomp is loaded (it reads the variable once, when _core loads it): libgomp's own settings then
    # say that a waiting thread spins 0 times (OpenMP's default spins 300000 times, ~3 ms, before it sleeps).
    code = """
        import ctypes, sys, kvflash_ggml
        if "libgomp" not in open("/proc/self/maps").read():
            sys.exit("no libgomp")
        ctypes.CDLL("libgomp.so.1").omp_display_env(1)   # the process's libgomp: the one _core loaded
    """
    proc = run_python(code)
    if "no libgomp" in proc.stderr:
        pytest.skip("this build of ggml does not use OpenMP (libgomp)")
    assert proc.returncode == 0, proc.stderr
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in proc.stderr and "GOMP_SPINCOUNT = '0'" in proc.stderr, proc.stderr
