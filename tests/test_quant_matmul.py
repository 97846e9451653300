"""Our kernels for Q4_1 / Q8_0 weights times several tokens (model/quant_matmul.h) give ggml's own outputs.

A step of several tokens (prompt steps, a speculative verify step, a batched decode) runs its Q4_1 and Q8_0
weight matmuls through kernels of ours that take several tokens per pass over the weights, computing each output
with the operations of ggml's x86 dot products. The logits must be bit for bit what ggml_mul_mat gives: every
step size, both attention paths, with paging.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest

from kvflash_ggml import _core


def _cpu_flags() -> set:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


HAS_KERNELS = {"avx2", "fma", "f16c"} <= _cpu_flags()


@contextlib.contextmanager
def kernels(enabled: bool):
    _core.testing.quant_mul_mat(enabled)
    try:
        yield
    finally:
        _core.testing.quant_mul_mat(True)


def test_the_kernels_are_used_where_the_cpu_has_them():
    # They are switched off quietly when their check against ggml fails: on an AVX2 CPU that would be a
    # regression (ggml's dot products changed), not a property of the machine.
    usable = _core.testing.quant_mul_mat()
    if not HAS_KERNELS:
        pytest.skip("the kernels need x86-64 with AVX2, FMA and F16C")
    assert usable == {"q4_1": True, "q8_0": True}
    with kernels(False):
        assert _core.testing.quant_mul_mat() == {"q4_1": False, "q8_0": False}
    assert _core.testing.quant_mul_mat() == {"q4_1": True, "q8_0": True}


def _steps(model, attention: str, enabled: bool) -> list:
    with kernels(enabled):
        config = _core.SessionConfig(max_tokens=2048, pool_tokens=448, attention=attention, n_batch=56)
        s = _core.Session(model, config)
        tokens = np.random.default_rng(0).integers(3, 900, 1100).astype(np.int32)
        out = [s.forward(tokens[:1000], 0, all_logits=True)]   # steps of 56 through a pool that pages
        for n in (2, 3, 5, 8, 9, 16, 17, 1):
            out.append(s.forward(tokens[1000:1000 + n], 1000, all_logits=True))
            s.truncate(1000)
        return out


@pytest.mark.skipif(not HAS_KERNELS, reason="the kernels need x86-64 with AVX2, FMA and F16C")
@pytest.mark.parametrize("attention", ["matmul", "flash"])
def test_several_token_steps_are_ggml_bit_for_bit_on_smollm2(smollm2, attention):
    # SmolLM2: Q4_1 layers, Q8_0 output matrix; 2 threads (each thread takes a share of the rows)
    ours, ggml = _steps(smollm2, attention, True), _steps(smollm2, attention, False)
    for i, (a, b) in enumerate(zip(ours, ggml)):
        assert np.array_equal(a, b), (attention, i, float(np.abs(a - b).max()))


@pytest.mark.skipif(not HAS_KERNELS, reason="the kernels need x86-64 with AVX2, FMA and F16C")
def test_several_token_steps_are_ggml_bit_for_bit_on_a_q8_0_model(tiny_gguf):
    model = _core.Model(tiny_gguf(weight_type="q8_0"), backend="cpu", n_threads=2)
    ours, ggml = _steps(model, "matmul", True), _steps(model, "matmul", False)
    for i, (a, b) in enumerate(zip(ours, ggml)):
        assert np.array_equal(a, b), (i, float(np.abs(a - b).max()))
