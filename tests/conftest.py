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
