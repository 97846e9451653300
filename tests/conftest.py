import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")   # no test may reach a model hub


@pytest.fixture(scope="session")
def smollm2_path():
    from kvflash_ggml import resolve_model_path
    return resolve_model_path("smollm2")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from kvflash_ggml import _core
    return _core.Model(smollm2_path, backend="cpu", n_threads=2)


@pytest.fixture(scope="session")
def smollm2_vocab(smollm2_path):
    from kvflash_ggml import _core
    return _core.Vocab(smollm2_path)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """tiny_gguf(seed=0, weight_type="f16") -> path of a tiny random-weight llama GGUF (with tokenizer),
    written once per session per argument set."""
    from kvflash_ggml.testing import random_gguf as rg
    root = tmp_path_factory.mktemp("tiny-gguf")
    paths = {}

    def get(seed: int = 0, weight_type: str = "f16") -> str:
        if (seed, weight_type) not in paths:
            out = root / f"tiny-llama-{weight_type}-{seed}.gguf"
            paths[seed, weight_type] = str(rg.write_preset(out, "tiny-llama", weight_type=weight_type, seed=seed))
        return paths[seed, weight_type]

    return get


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """tiny_models(arch, **overrides) -> a _core.Model of the tiny-{arch} random shape (f32 weights, CPU, one thread),
    written and loaded once per session per argument set."""
    from kvflash_ggml import _core
    from kvflash_ggml.testing import random_gguf as rg
    root = tmp_path_factory.mktemp("tiny-models")
    models = {}

    def get(arch: str, **overrides):
        name = "-".join([arch] + [f"{k}{v}" for k, v in sorted(overrides.items())])
        if name not in models:
            path = rg.write_preset(root / f"{name}.gguf", f"tiny-{arch}", weight_type="f32", **overrides)
            models[name] = _core.Model(str(path), backend="cpu", n_threads=1)
        return models[name]

    return get


@pytest.fixture(scope="module")
def rpc_binary():
    """ggml-rpc-server (test_rpc, test_split), or the test is skipped when this build has none."""
    from kvflash_ggml.rpc import find_rpc_server
    binary = find_rpc_server()
    if binary is None:
        pytest.skip("ggml-rpc-server was not built (pip install . builds it: KVFLASH_RPC_SERVER=ON; or "
                    "$KVFLASH_RPC_SERVER, or build/*/bin/ggml-rpc-server)")
    return binary


@pytest.fixture
def run_scheduled():
    """run_scheduled(sched, prompts, max_tokens) -> each prompt's records from a server Scheduler (greedy, submitted
    together, so their rounds can batch); the scheduler is stopped after, whatever happens."""
    import asyncio

    from kvflash_ggml.options import SamplingParams
    from kvflash_ggml.server.scheduler import Request

    def run(sched, prompts, max_tokens: int) -> list:
        async def main():
            loop = asyncio.get_running_loop()
            reqs = [Request(p, SamplingParams(max_tokens=max_tokens, temperature=0), loop) for p in prompts]
            for r in reqs:
                sched.submit(r)
            out = []
            for r in reqs:
                recs = []
                while (item := await r.out.get()) is not None:
                    recs.append(item)
                out.append(recs)
            return out

        try:
            return asyncio.run(asyncio.wait_for(main(), 300))
        finally:
            sched.stop()

    return run
