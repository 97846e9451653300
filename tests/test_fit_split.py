"""pool_tokens="auto" on a model split across devices, sized from each device's free memory (issue 40 item 2):
two ggml-rpc-servers (CPU devices) that report different memory hold a tiny random model split 1,1.

ggml-rpc-server at this commit has no -m flag (llama.cpp removed it with device selection): a CPU device reports
its host's physical RAM (sysconf) as both free and total. To give two servers on one host different memory, each
runs with a preloaded sysconf that reports FAKE_PHYS_BYTES of RAM (compiled here; skipped without a C compiler)."""
from __future__ import annotations

import gc
import os
import shutil
import subprocess

import numpy as np
import pytest

from kvflash_ggml import Model, _core
from kvflash_ggml.engine_parts import make_session
from kvflash_ggml.fit import GPU_POOL_ALIGN, MIN_HEADROOM, fit_pool_tokens
from kvflash_ggml.options import PoolConfig
from kvflash_ggml.rpc import start_rpc_server
from kvflash_ggml.testing import random_gguf as rg
from kvflash_ggml.tokens import forward_in_steps

pytestmark = pytest.mark.skipif(not _core.rpc_available(), reason="this build has no ggml RPC backend (KVFLASH_RPC=OFF)")

C = _core.CHUNK_TOKENS
MIB = 1 << 20
N_CTX = 32768
# Above the 512 MiB headroom: SMALL holds a few thousand tokens of this model's pool, LARGE the whole context, and
# TINY not even the exact prefill's workspace (the minimum pool cannot fit).
SMALL, LARGE, TINY = 620 * MIB, 700 * MIB, 560 * MIB

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>
long sysconf(int name) {
    static long (*real)(int) = 0;
    if (!real) real = (long (*)(int)) dlsym(RTLD_NEXT, "sysconf");
    const char * bytes = getenv("FAKE_PHYS_BYTES");
    if (name == _SC_PHYS_PAGES && bytes) return atol(bytes) / real(_SC_PAGE_SIZE);
    return real(name);
}
"""


@pytest.fixture(scope="module")
def memory_shim(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the sysconf shim that gives an rpc-server less memory")
    root = tmp_path_factory.mktemp("shim")
    (root / "shim.c").write_text(SHIM)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(root / "shim.so"), str(root / "shim.c"), "-ldl"], check=True)
    return str(root / "shim.so")


@pytest.fixture(scope="module")
def servers(rpc_binary, memory_shim):
    """{memory: endpoint} of three rpc-servers that report SMALL, LARGE and TINY bytes of memory."""
    started = {}
    saved = {k: os.environ.get(k) for k in ("LD_PRELOAD", "FAKE_PHYS_BYTES")}
    try:
        for n_bytes in (SMALL, LARGE, TINY):
            os.environ["LD_PRELOAD"] = " ".join(x for x in (memory_shim, saved["LD_PRELOAD"]) if x)
            os.environ["FAKE_PHYS_BYTES"] = str(n_bytes)
            started[n_bytes] = start_rpc_server(rpc_binary, threads=1)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield {n: endpoint for n, (_, endpoint) in started.items()}
    for proc, _ in started.values():
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    # 5 layers: split 1,1 puts layers 0-2 on the first device and 3, 4 and the output layer on the second
    return str(rg.write_preset(tmp_path_factory.mktemp("fit-split") / "tiny5.gguf", "tiny-llama", n_layer=5,
                               n_ctx_train=N_CTX))


def split(path: str, *endpoints: str) -> _core.Model:
    return _core.Model(path, devices=[f"rpc:{e}" for e in endpoints], tensor_split=[1, 1], n_threads=1)


def device_costs(model: _core.Model, pool_tokens: int) -> list[dict]:
    """Per device: what a session of pool_tokens holds after a prompt that fills it in steps of 512 tokens."""
    s = make_session(model, PoolConfig(n_ctx=N_CTX, pool_tokens=pool_tokens), n_batch=512)
    forward_in_steps(s, np.zeros(pool_tokens + C, dtype=np.int32), 0)
    return s.memory()["devices"]


def expected_pool(model: _core.Model, device: int, n_slots: int = 1) -> int:
    """The issue's formula on one device: n_slots x (K/V + compute per pool token x P + compute fixed) + the exact
    prefill's workspace (its staging K/V on every device with pooled layers, an attention block, and a step's compute
    buffer: a 2048-token pool's after steps of 512, scaled to the exact prefill's steps of 1024) + headroom <= the
    device's memory less the weights. The per-token and fixed bytes come from sessions built here, of 1536 and
    3072 tokens (not the fit's probes of 1024 and 2048; pools from 1024 on take whole steps of 512)."""
    a, b = device_costs(model, 1536)[device], device_costs(model, 3072)[device]
    step = device_costs(model, 2048)[device]["compute_bytes"] * 1024 / 512   # flash attention: exact steps of 1024
    per_token = (b["pool_bytes"] + b["compute_bytes"] - a["pool_bytes"] - a["compute_bytes"]) / 1536
    fixed = a["pool_bytes"] + a["compute_bytes"] - per_token * 1536
    mem = model.device_memory()[device]
    layer_bytes = 2 * model.hparams.n_head_kv * model.hparams.head_dim_k * 2   # one layer's K and V (F16) per token
    staging = N_CTX * layer_bytes if a["pool_bytes"] else 0
    prefill = staging + _core.ATTENTION_BLOCK_BYTES + step
    free = mem["memory_total"] - mem["weight_bytes"]
    fitted = int((free - n_slots * fixed - prefill - MIN_HEADROOM) / (n_slots * per_token)) // C * C
    return fitted // GPU_POOL_ALIGN * GPU_POOL_ALIGN   # an RPC device counts as an accelerator (fit.GPU_POOL_ALIGN)


def test_auto_on_a_split_is_what_the_smaller_device_holds(tiny_path, servers):
    # Issue 40 item 2: on a split, 'auto' was min(n_ctx, 4096) whatever the devices held; now every device's
    # share of the sessions must fit its own memory, and the smaller server limits the pool.
    model = split(tiny_path, servers[SMALL], servers[LARGE])
    memory = model.device_memory()
    # What a CPU rpc-server reports: the (faked) RAM as free and total, unchanged after our weights were placed
    # there; so the fit counts the total less our weights.
    assert [(m["memory_free"], m["memory_total"]) for m in memory] == [(SMALL, SMALL), (LARGE, LARGE)]
    assert all(m["weight_bytes"] > 0 and m["kind"] == "rpc" for m in memory)
    fit = fit_pool_tokens(model, PoolConfig(n_ctx=N_CTX, pool_tokens="auto"), 1)
    print(fit.reason)
    small_name = model.devices[0]["name"]
    assert servers[SMALL] in small_name and f"what {small_name}'s memory holds" in fit.reason
    expected = expected_pool(model, 0)
    assert 448 <= expected < N_CTX   # the test's memory sizes put the limit inside the range
    assert abs(fit.pool_tokens - expected) <= GPU_POOL_ALIGN, (fit.pool_tokens, expected)
    assert expected_pool(model, 1) >= N_CTX   # the larger server alone would hold the whole context
    # Four slots: four sessions' shares on the smaller server
    four = fit_pool_tokens(model, PoolConfig(n_ctx=N_CTX, pool_tokens="auto"), 4)
    assert abs(four.pool_tokens - expected_pool(model, 0, n_slots=4)) <= GPU_POOL_ALIGN and four.pool_tokens < fit.pool_tokens
    # The Python API's default pool on the same split is that fit (after this model is gone: the servers' figures
    # do not drop as weights arrive, so a Model counts only its own weights there)
    del model
    gc.collect()
    with Model(tiny_path, devices=[f"rpc:{servers[SMALL]}", f"rpc:{servers[LARGE]}"], tensor_split=[1, 1],
               n_ctx=N_CTX, n_threads=1) as llm:
        assert llm.pool.pool_tokens == fit.pool_tokens


def test_the_smaller_device_limits_in_either_place(tiny_path, servers):
    # Issue 40 item 2: the output layer on the smaller server now
    model = split(tiny_path, servers[LARGE], servers[SMALL])
    fit = fit_pool_tokens(model, PoolConfig(n_ctx=N_CTX, pool_tokens="auto"), 1)
    assert servers[SMALL] in fit.reason.split("'s memory holds")[0]
    assert abs(fit.pool_tokens - expected_pool(model, 1)) <= GPU_POOL_ALIGN


def test_a_server_too_small_for_the_minimum_pool_is_named(tiny_path, servers):
    # Issue 40 item 2: a device that cannot hold even the minimum pool is a ValueError naming it
    model = split(tiny_path, servers[TINY], servers[LARGE])
    with pytest.raises(ValueError, match=r"do not fit RPC\d+\[" + servers[TINY].replace(".", r"\.")):
        fit_pool_tokens(model, PoolConfig(n_ctx=N_CTX, pool_tokens="auto"), 1)


def test_a_budget_caps_each_device_of_a_split(tiny_path, servers):
    # Issue 37 item 4 on a split: max_device_bytes caps what each device offers (min(free, budget - weights))
    model = split(tiny_path, servers[SMALL], servers[LARGE])
    free = fit_pool_tokens(model, PoolConfig(n_ctx=N_CTX, pool_tokens="auto"), 1)
    capped = fit_pool_tokens(model, PoolConfig(n_ctx=N_CTX, pool_tokens="auto", max_device_bytes=SMALL - MIB), 1)
    assert capped.pool_tokens < free.pool_tokens and "max_device_bytes" in capped.reason


def test_the_exact_prefill_stages_on_each_device_of_a_split(tiny_path, servers):
    # Issue 40 item 2: each device that holds pooled layers stages its own layer's K/V of the prompt (one staging
    # pool on the output device made the other device's layers read their keys across devices every step), and
    # the K/V equal one device's byte for byte.
    prompt = np.random.default_rng(3).integers(10, 900, 1500).astype(np.int32)

    def prefilled(model):   # one attention path on both (auto picks matmul on the local CPU, flash over RPC)
        s = _core.Session(model, _core.SessionConfig(max_tokens=2048, pool_tokens=512, n_batch=256, attention="flash"))
        s.prefill_exact(prompt, 0)
        return s

    one = prefilled(_core.Model(tiny_path, backend="cpu", n_threads=1))
    two = prefilled(split(tiny_path, servers[SMALL], servers[LARGE]))
    assert one.memory()["prefill_staging_bytes"] > 0
    assert two.memory()["prefill_staging_bytes"] == 2 * one.memory()["prefill_staging_bytes"]
    assert np.array_equal(one.pager.chunk_blocks(), two.pager.chunk_blocks())
    for c in range(one.pager.n_chunks()):   # the chunks paged out during the prompt, and the resident ones
        assert one.kv.has_host_image(c) == two.kv.has_host_image(c)
        if one.kv.has_host_image(c):
            assert np.array_equal(one.kv.host_image(c), two.kv.host_image(c)), c
    for b in range(512 // C):
        assert np.array_equal(one.kv.read_block(b), two.kv.read_block(b)), b
