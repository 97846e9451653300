"""A step of more rows than _core.FFN_PART_ROWS runs its feed-forward in parts (ffn.h: add_in_row_parts), except an
exact prefill's step of up to _core.EXACT_FFN_PART_ROWS, whose FFN takes its rows at once.

The exact prefill's steps take 1024 rows; their FFN's F32 intermediates (gate, up, their product) were the largest
part of its step buffer (the 8B shape: 3 x 56 MiB). Over the step's rows at once, SiLU and the product in place, it
holds two of them (each layer's FFN weights read once a step: 1-1.5% of an H100's 32K-128K prefill, R134). In parts
of 512 rows the graph holds one part's, and the rows come out as a step of 512 computes them: on the CPU's mul_mat
attention path every row is its own, so a full cache that takes 1100 rows in one step computes the logits it computes
in steps of 512, byte for byte; where sliding-window rings widen with the step (more masked slots) the two agree
within float sums.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvflash_ggml import _core

PARTS = _core.FFN_PART_ROWS
N = 2 * PARTS + 76   # parts of 512, 512 and 76 rows


def logits(model, n_batch: int, tokens: np.ndarray) -> np.ndarray:
    s = _core.Session(model, _core.SessionConfig(max_tokens=2 * N, pool_tokens=0, n_batch=n_batch, attention="matmul"))
    return s.forward(tokens, 0)


@pytest.mark.parametrize("arch,tol", [("llama", 0.0), ("qwen3moe", 0.0), ("qwen35moe", 0.0),
                                      ("gemma3", 1e-3), ("gemma4", 1e-3), ("laguna", 1e-3)])
def test_a_step_in_ffn_parts_computes_what_steps_of_a_part_do(tiny_models, arch, tol):
    model = tiny_models(arch)
    tokens = np.random.default_rng(0).integers(0, model.hparams.n_vocab, N).astype(np.int32)
    whole, in_steps = logits(model, N, tokens), logits(model, PARTS, tokens)
    assert np.isfinite(whole).all()
    assert float(np.abs(whole - in_steps).max()) <= tol


def test_a_step_holds_one_parts_ffn_intermediates(tiny_models):
    # n_ff 8192: a part's gate, up and product are 3 x 16 MiB, far above the rest of the tiny model's step
    model = tiny_models("llama", n_ff=8192)
    tokens = np.random.default_rng(1).integers(0, model.hparams.n_vocab, 2 * PARTS).astype(np.int32)
    held = {}
    for n_batch in (PARTS, 2 * PARTS):
        s = _core.Session(model, _core.SessionConfig(max_tokens=2 * PARTS, pool_tokens=0, n_batch=n_batch, attention="matmul"))
        s.forward(tokens, 0)
        held[n_batch] = s.memory()["compute_bytes"]
    one_part_ffn = 3 * 8192 * PARTS * 4
    # twice the rows, the same FFN intermediates: the buffer grows by the step's other rows (attention, hidden states)
    assert held[PARTS] > one_part_ffn
    assert held[2 * PARTS] - held[PARTS] < one_part_ffn / 2


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
@pytest.mark.parametrize("attention", ["matmul", "flash"])
def test_an_exact_prefill_takes_its_steps_ffn_whole(tiny_models, arch, attention):
    # By default (ffn_part_rows 0: EXACT_FFN_PART_ROWS, the default step's rows) a step's FFN runs over all its rows at
    # once, SiLU and the product in the gate's memory (the fused GLU is never run in place), so the step holds two
    # intermediates of its rows where parts of PARTS held three of a part's; the logits are the parts', byte for byte
    step = _core.EXACT_FFN_PART_ROWS
    assert step == 2 * PARTS
    model = tiny_models(arch, n_ff=8192) if arch == "llama" else tiny_models(arch)
    tokens = np.random.default_rng(2).integers(0, model.hparams.n_vocab, N).astype(np.int32)
    logits, held = {}, {}
    for rows in (PARTS, 0):
        s = _core.Session(model, _core.SessionConfig(max_tokens=2 * N, pool_tokens=512, n_batch=step, attention=attention))
        logits[rows], _ = s.prefill_exact(tokens, 0, n_batch=step, ffn_part_rows=rows)
        held[rows] = s.memory()["prefill_peak_bytes"]
    np.testing.assert_array_equal(logits[0], logits[PARTS])
    if arch == "llama":   # n_ff 8192: a part's F32 intermediate is 16 MiB
        one_part = 8192 * PARTS * 4
        assert one_part * 0.9 <= held[0] - held[PARTS] <= one_part * 1.1
    with pytest.raises(ValueError, match="ffn_part_rows"):
        s.prefill_exact(tokens[:8], N, ffn_part_rows=-1)
    assert s.n_tokens == N   # refused before anything changed
