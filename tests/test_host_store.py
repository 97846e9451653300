"""The host store's bound (issue 37 item 3: host memory reported and bounded): a pooled session's host store takes
at most an image per chunk of its context, and a context whose store could outgrow the host (max_host_bytes, else
the memory the host has available) is refused when the sessions are made, with the figures and what would fit;
before, it ran until the kernel's OOM killer ended the process. On the CPU, a tiny random model."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvflash_ggml import Model, _core
from kvflash_ggml.commands import generate, serve
from kvflash_ggml.commands.flags import pool_config
from kvflash_ggml.host_store import available_host_bytes, check_host_store, host_store_bound
from kvflash_ggml.options import PoolConfig, ResidencyConfig
from kvflash_ggml.server.scheduler import slot_engines
from kvflash_ggml.testing import random_gguf as rg
from kvflash_ggml.tokenizer import Tokenizer

N_CTX = 8192
N_CHUNKS = N_CTX // _core.CHUNK_TOKENS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(rg.write_preset(tmp_path_factory.mktemp("host") / "tiny.gguf", "tiny-llama", n_ctx_train=N_CTX))


def load(path: str, **kw) -> Model:
    return Model(path, backend="cpu", n_threads=1, n_ctx=N_CTX, pool_tokens=512, **kw)


def chunk_bytes(path: str, kv_type: str = "f16") -> int:
    with load(path, kv_type=kv_type) as llm:
        return llm.engine.session.kv.chunk_bytes


def test_the_store_stays_within_its_bound_and_stats_report_both(tiny):
    # A context past the pool pages out; what the store holds never passes an image per chunk of n_ctx, the bound
    # stats() and --stats report. A full cache sends nothing to the host.
    with load(tiny) as llm:
        per_chunk = llm.engine.session.kv.chunk_bytes
        prompt = list(np.random.default_rng(0).integers(1, llm._core_model.hparams.n_vocab, 3000))
        llm.create_completion(prompt, max_tokens=8, temperature=0)
        st = llm.stats()
        assert st["host_kv_max_bytes"] == N_CHUNKS * per_chunk
        assert 0 < st["host_kv_bytes"] <= st["host_kv_max_bytes"]
    with Model(tiny, backend="cpu", n_threads=1, n_ctx=N_CTX, pool_tokens=None) as full:
        assert full.stats()["host_kv_max_bytes"] == 0 == host_store_bound(full.engine.session, N_CTX)


def test_a_context_the_host_cannot_hold_is_refused_with_what_fits(tiny):
    per_chunk = chunk_bytes(tiny)
    need = N_CHUNKS * per_chunk
    with load(tiny, max_host_bytes=need):   # exactly the bound: fits
        pass
    # an f16 store over the cap that q8_0's fits: the message names the need, the cap, q8_0 and the n_ctx that fits
    cap = int(need * 0.6)
    with pytest.raises(ValueError, match=rf"n_ctx={N_CTX} with 1 pooled session\(s\) can send up to .* of f16 "
                                         rf"K/V .* more than max_host_bytes={cap} .*kv_type='q8_0' .*kv_type='q4_0'.*"
                                         rf"n_ctx <= {int(cap // per_chunk) * 64}"):
        load(tiny, max_host_bytes=cap)
    with load(tiny, max_host_bytes=cap, kv_type="q8_0") as q8:
        assert q8.stats()["host_kv_max_bytes"] <= cap
    with pytest.raises(ValueError, match="max_host_bytes must be a positive"):
        PoolConfig(max_host_bytes=0)
    with Model(tiny, backend="cpu", n_threads=1, n_ctx=N_CTX, pool_tokens=None, max_host_bytes=1):   # full cache
        pass


def test_the_default_cap_is_the_memory_the_host_has_available(tiny, monkeypatch):
    assert available_host_bytes() > 0
    need = N_CHUNKS * chunk_bytes(tiny)
    monkeypatch.setattr("kvflash_ggml.host_store.available_host_bytes", lambda: need - 1)
    with pytest.raises(ValueError, match="more than the memory this host has available"):
        load(tiny)


def test_a_servers_slots_are_checked_together(tiny):
    # Each slot's store fits alone; four together do not: slot_engines refuses them (and frees what it made).
    model = _core.Model(tiny, backend="cpu", n_threads=1)
    tok = Tokenizer(tiny)
    need = N_CHUNKS * chunk_bytes(tiny)
    pool = PoolConfig(n_ctx=N_CTX, pool_tokens=512, max_host_bytes=3 * need)
    with pytest.raises(ValueError, match=r"with 4 pooled session\(s\)"):
        slot_engines(4, model, tok, pool, ResidencyConfig())
    engines = slot_engines(3, model, tok, pool, ResidencyConfig())
    assert len(engines) == 3
    check_host_store([e.session for e in engines], N_CTX, "f16", None)   # the host itself holds three tiny stores
    for e in engines:
        e.close()


def test_generate_and_serve_take_max_host_memory(tiny, capsys):
    args = serve.build_parser().parse_args(["-m", tiny, "--max-host-memory", "2G"])
    assert pool_config(args).max_host_bytes == 2 << 30
    argv = ["-m", tiny, "--backend", "cpu", "-t", "1", "-n", "2", "-p", "x", "-c", str(N_CTX), "--kvflash", "512",
            "--json", "--max-host-memory", "1G"]
    assert generate.main(argv) == 0
    stats = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert stats["host_kv_max_bytes"] == N_CHUNKS * chunk_bytes(tiny)
    assert generate.main(argv[:-1] + ["1K"]) == 2
    assert "more than max_host_bytes=1024" in capsys.readouterr().err
