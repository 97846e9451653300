"""Issue 38 item 1: one place loads a model and resolves its options (loading.py, DeviceConfig); the Model, `kvflash
serve` and the benches call it, so the same options give the same core model and the same pool. Tiny random-weight
models, CPU."""
from __future__ import annotations

import argparse

import pytest

import kvflash_ggml as kvf
from kvflash_ggml import threads
from kvflash_ggml.bench import reference
from kvflash_ggml.commands import generate, serve
from kvflash_ggml.commands.flags import add_model_flags, device_config, device_keywords, model_keywords
from kvflash_ggml.loading import load, load_for_slots
from kvflash_ggml.testing import random_gguf as rg

CORES = 4   # usable_cores as the tests see it: the thread count must not depend on the runner's machine


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: CORES)


def core_facts(model) -> dict:
    """What a loaded core model says about where it runs."""
    return dict(backend=model.backend_name, n_threads=model.n_threads, on_gpu=model.on_gpu,
                devices=[(d["name"], list(d["layers"])) for d in model.devices])


def served(path: str, *flags: str):
    args = serve.build_parser().parse_args(["-m", path, "--prefix-cache", "off", *flags])
    engines, _, why = serve.build_engines(args)
    return engines, why


def bench_model(path: str, *flags: str):
    ap = argparse.ArgumentParser()
    add_model_flags(ap)
    return reference.open_model(ap.parse_args(["--model", path, *flags]), "test")


@pytest.mark.parametrize("budget", [None, 1 << 30])
def test_model_serve_and_bench_load_the_same_model_and_pool(tiny_gguf, four_cores, budget):
    # item 1: the same options gave different core models: the benches passed --threads to the core as given
    # (8 threads on 4 cores, oversubscribed) where Model and serve clamp it (threads.py); and 'auto' is resolved
    # for them in one place (fit.resolve_pool through loading.load_for_slots), so the pool and its reason agree.
    path = tiny_gguf()
    budget_flags = ["--max-device-memory", str(budget)] if budget else []
    with kvf.Model(path, n_ctx=256, backend="cpu", n_threads=8, max_device_bytes=budget) as m:
        model_facts, model_pool = core_facts(m._core_model), m.pool
        assert model_facts["n_threads"] == CORES and model_pool.pool_tokens == 256   # the whole context
    engines, why = served(path, "-c", "256", "--backend", "cpu", "-t", "8", "-np", "1", *budget_flags)
    try:
        assert core_facts(engines[0].model) == model_facts
        assert engines[0].pool == model_pool
    finally:
        for e in engines:
            e.close()
    _, bench_core, tokenizer = bench_model(path, "--backend", "cpu", "--threads", "8")
    assert core_facts(bench_core) == model_facts and tokenizer.n_vocab == bench_core.hparams.n_vocab
    # the assembly step itself, beside them: the same pool and reason for one session
    slots = load_for_slots(load(path, kvf.DeviceConfig(backend="cpu", n_threads=8)).model,
                           kvf.PoolConfig(n_ctx=256, max_device_bytes=budget), 1)
    assert slots.pool == model_pool and why == f"--kvflash auto: {slots.why}"


def test_serve_refuses_a_context_past_the_trained_one_as_model_does(tmp_path):
    # item 1: the trained-context check is part of the one assembly step: serve says what Model says (the core's
    # own refusal named max_tokens, a word of neither)
    path = str(rg.write_preset(tmp_path / "short.gguf", "tiny-llama", n_ctx_train=512))
    words = r"n_ctx=1024 exceeds the model's trained context 512; pass allow_beyond_train_ctx=True"
    with pytest.raises(ValueError, match=words):
        kvf.Model(path, n_ctx=1024, backend="cpu", n_threads=1)
    with pytest.raises(ValueError, match=words):
        served(path, "-c", "1024", "--backend", "cpu", "-t", "1", "-np", "1")


def test_device_config_checks_what_was_checked_before(tiny_gguf):
    # item 1: the device options are one dataclass; its checks are the ValueErrors Model and the core gave before
    with pytest.raises(ValueError, match=r"n_threads must be a positive integer or None \(the free cores\), got -1"):
        kvf.DeviceConfig(n_threads=-1)
    with pytest.raises(ValueError, match="n_threads must be a positive integer"):
        kvf.Model(tiny_gguf(), n_threads=True, backend="cpu")
    config = kvf.DeviceConfig(rpc="10.0.0.2:50052, 10.0.0.3:50052", tensor_split=[3, 1])
    assert config.rpc == ("10.0.0.2:50052", "10.0.0.3:50052") and config.tensor_split == (3, 1)
    assert config.placement() == dict(backend="auto", rpc=["10.0.0.2:50052", "10.0.0.3:50052"], devices=[],
                                      tensor_split=[3, 1])
    for match, kw in {"unknown device": dict(devices=["tpu"]), "named twice": dict(devices=["cpu", "CPU"]),
                      "backend 'cpu'": dict(backend="cpu", rpc=["127.0.0.1:1"])}.items():
        with pytest.raises(ValueError, match=match):   # the core's checks of a split, reached as before
            kvf.Model(tiny_gguf(), n_threads=1, **kw)


def test_cli_flags_build_the_device_config_model_builds():
    # item 1: the flags' DeviceConfig is the one Model builds from the keywords the CLI hands it
    args = generate.build_parser().parse_args(["--devices", "cpu", "-ts", "3/1", "-t", "2", "-p", "x"])
    assert device_config(args) == kvf.DeviceConfig(devices=["cpu"], tensor_split=[3.0, 1.0], n_threads=2)
    kw = model_keywords(args)
    assert kvf.DeviceConfig(**{k: kw[k] for k in ("backend", "rpc", "devices", "tensor_split", "n_threads")}) == \
        device_config(args)
    assert device_keywords(args) == device_config(args).placement()
