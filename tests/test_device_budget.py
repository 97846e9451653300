"""A device-memory budget (issue 37 item 4): max_device_bytes (Model, PoolConfig) / --max-device-memory (kvflash
generate and serve) caps each device's whole footprint (weights + pool + rings and state + compute buffers +
the exact prefill's workspace + headroom). On the CPU backend the budget applies too (the same probes run there),
so it is tested here on a tiny random model."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from kvflash_ggml import Model
from kvflash_ggml.commands import generate, serve
from kvflash_ggml.commands.flags import parse_bytes, pool_config
from kvflash_ggml.fit import HEADROOM_FRACTION
from kvflash_ggml.options import PoolConfig
from kvflash_ggml.testing import random_gguf as rg

MIB = 1 << 20
N_CTX = 8192
# tiny-llama at n_ctx 8192 on the CPU: about 85 MiB of exact-prefill workspace (64 MiB of it one attention block),
# ~10 KiB per pool token; 100 MiB holds a pool of several hundred tokens, below the CPU's auto pool of 4096
BUDGET = 100 * MIB


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(rg.write_preset(tmp_path_factory.mktemp("budget") / "tiny.gguf", "tiny-llama", n_ctx_train=N_CTX))


def load(path: str, **kw) -> Model:
    return Model(path, backend="cpu", n_threads=1, n_ctx=N_CTX, **kw)


def test_a_budget_shrinks_the_auto_pool_and_the_footprint_stays_within_it(tiny):
    # Issue 37 item 4: the pool is sized so that the whole device footprint stays within max_device_bytes; on the
    # CPU 'auto' was min(n_ctx, 4096) whatever the budget (there was none). A prompt larger than the pool (the
    # exact prefill's workspace) and decoding after it: stats()' peak (weights included) within the budget.
    with load(tiny) as free:
        assert free.pool.pool_tokens == 4096
    with load(tiny, max_device_bytes=BUDGET) as llm:
        pool = llm.pool.pool_tokens
        assert 448 <= pool < 4096, pool
        tokens = np.random.default_rng(1).integers(3, 1000, N_CTX - 200).tolist()
        out = llm.create_completion(tokens, max_tokens=16, temperature=0)
        assert out["usage"]["completion_tokens"] == 16
        stats = llm.stats()
        peak = stats["device_peak_bytes"]   # weights + pool + rings + state + compute + exact-prefill workspace
        print(f"pool {pool}, peak {peak / MIB:.1f} MiB of a {BUDGET / MIB:.0f} MiB budget")
        assert stats["pool_tokens"] == pool and stats["device_prefill_peak_bytes"] > 0
        assert peak + HEADROOM_FRACTION * BUDGET <= BUDGET
    with load(tiny, max_device_bytes=2 * BUDGET) as roomier:   # more room: a larger pool, up to the CPU's rule
        assert pool < roomier.pool.pool_tokens <= 4096


def test_a_budget_below_the_weights_or_the_minimum_pool_is_refused(tiny):
    # Issue 37 item 4: clear ValueErrors with the figures, before any session is made
    with pytest.raises(ValueError, match=r"max_device_bytes=1000 .* below the weights on CPU \(\d+ bytes"):
        load(tiny, max_device_bytes=1000)
    with pytest.raises(ValueError, match=r"do not fit CPU's memory \(max_device_bytes 0\.0\d+ GiB less .* MiB of "
                                         r"weights.*at least 256 tokens"):
        load(tiny, max_device_bytes=70 * MIB)
    with pytest.raises(ValueError, match="max_device_bytes must be a positive"):
        PoolConfig(max_device_bytes=0)


def test_a_pool_size_given_with_a_budget_is_checked_not_changed(tiny):
    # Issue 37 item 4: a number and a budget: the number is kept if it fits, refused if not (no silent change)
    with load(tiny, max_device_bytes=BUDGET) as auto:
        fitted = auto.pool.pool_tokens
    with load(tiny, pool_tokens=fitted, max_device_bytes=BUDGET) as llm:
        assert llm.pool.pool_tokens == fitted
    with pytest.raises(ValueError, match=rf"pool_tokens=4096 x 1 session\(s\) does not fit max_device_bytes={BUDGET} "
                                         rf"on CPU: at most {fitted} tokens"):
        load(tiny, pool_tokens=4096, max_device_bytes=BUDGET)
    with pytest.raises(ValueError, match=r"the full cache \(8192 tokens\).*does not fit"):
        load(tiny, pool_tokens=None, max_device_bytes=BUDGET)


def test_max_device_memory_parses_sizes():
    # Issue 37 item 4: --max-device-memory 24G (K/M/G/T, binary) and plain bytes; anything else a usage error
    for text, n in (("24G", 24 << 30), ("512M", 512 << 20), ("1.5T", 3 << 39), ("2048", 2048), ("100k", 100 << 10),
                    ("24GiB", 24 << 30), ("8GB", 8 << 30)):
        assert parse_bytes(text) == n, text
    for bad in ("", "G", "-1G", "0", "1.5", "twelve", "1e9", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)


def test_serve_and_generate_take_max_device_memory(tiny, capsys):
    # Issue 37 item 4: the flag on both commands reaches PoolConfig.max_device_bytes; generate runs under it
    args = serve.build_parser().parse_args(["-m", tiny, "--max-device-memory", "100M"])
    assert pool_config(args).max_device_bytes == BUDGET
    argv = ["-m", tiny, "--backend", "cpu", "-t", "1", "-n", "2", "-p", "x", "--json", "--max-device-memory", "100M"]
    assert generate.main(argv) == 0
    stats = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert 448 <= stats["pool_tokens"] < 4096
    assert generate.main(argv[:-1] + ["1K"]) == 2
    assert "below the weights on CPU" in capsys.readouterr().err
