"""`kvflash bench decode --max-device-memory` (issue 37 item 4): our pool fitted under the budget at each depth with its
peak beside its rate, and llama.cpp at the largest depth it runs within the same budget, found by measuring
llama-bench (here a stand-in and a stand-in driver: no GPU needed)."""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from kvflash_ggml import Model
from kvflash_ggml.bench import budget as bb
from kvflash_ggml.bench import decode
from kvflash_ggml.bench.budget import FAILED, FITS, OVER, Attempt, largest_fitting
from kvflash_ggml.options import PoolConfig
from kvflash_ggml.testing import random_gguf as rg

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
N_CTX_TRAIN = 8192
BUDGET = 100 * MIB   # tiny-llama on the CPU: a pool of several hundred tokens besides ~84 MiB of prefill workspace

# A llama.cpp stand-in whose footprint grows with its context as a KV cache does: WEIGHTS + PER_TOKEN bytes a token,
# on top of OURS (what our process already holds on the device: its CUDA context), against a 24 GiB budget.
WEIGHTS, PER_TOKEN, OURS, LLAMA_BUDGET = 15 * GIB, 64 * KIB, 1 * GIB, 24 * GIB
BENCH_DEPTHS = [65536, 131072, 262144]


def own_footprint(depth: int) -> int:
    return WEIGHTS + PER_TOKEN * depth


def rate(depth: int) -> float:   # a rate that names its depth, so a rate from the wrong attempt is caught
    return 1e7 / (1000 + depth)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(rg.write_preset(tmp_path_factory.mktemp("bench-budget") / "tiny.gguf", "tiny-llama",
                               n_ctx_train=N_CTX_TRAIN))


# ---- the search: which depth is the largest that fits ----------------------------------------------------------

def fake_attempts(fits, log):
    """attempt(depth) for largest_fitting: FITS where fits(depth), else OVER; every depth asked for is logged."""
    def attempt(depth: int) -> Attempt:
        log.append(depth)
        ok = fits(depth)
        return Attempt(depth, FITS if ok else OVER, own_footprint(depth), rate(depth) if ok else None)
    return attempt


def test_the_largest_bench_depth_that_fits_is_found_from_the_top_down():
    # Issue 37 item 4: llama.cpp beside ours at the largest context it fits; depths are tried from the largest down
    # and the first that fits ends the scan (a smaller one fits too: no prefill spent on it).
    log = []
    best, tried = largest_fitting(BENCH_DEPTHS, fake_attempts(lambda d: own_footprint(d) <= LLAMA_BUDGET, log))
    assert best.depth == 131072 and best.tok_s == rate(131072)
    assert log == [262144, 131072] and [a.depth for a in tried] == log
    log = []   # everything fits: only the largest runs
    best, _ = largest_fitting(BENCH_DEPTHS, fake_attempts(lambda d: True, log))
    assert best.depth == 262144 and log == [262144]
    log = []   # nothing fits: every depth was tried and none is reported
    best, tried = largest_fitting(BENCH_DEPTHS, fake_attempts(lambda d: False, log))
    assert best is None and log == [262144, 131072, 65536] and not any(a.fits for a in tried)


def test_bisection_refines_the_largest_fitting_depth_between_bench_depths():
    # Issue 37 item 4: between the largest fitting bench depth and the next one up, bisection at a granularity:
    # with a 24 GiB budget the stand-in fits up to 147456 tokens (15 GiB + 9 GiB of K/V)
    log = []
    fits = lambda d: own_footprint(d) <= LLAMA_BUDGET   # noqa: E731
    best, _ = largest_fitting(BENCH_DEPTHS, fake_attempts(fits, log), bisect_steps=3, granularity=1024)
    assert log == [262144, 131072, 196608, 163840, 147456] and best.depth == 147456 and best.tok_s == rate(147456)
    log = []   # none of the bench's depths fits: the bisection starts from 0
    best, _ = largest_fitting(BENCH_DEPTHS, fake_attempts(lambda d: d <= 20000, log), bisect_steps=2, granularity=1024)
    assert log == [262144, 131072, 65536, 32768, 16384] and best.depth == 16384
    log = []   # nothing left between the two at this granularity: no attempt wasted
    best, _ = largest_fitting([4096, 5120], fake_attempts(lambda d: d <= 4096, log), bisect_steps=5, granularity=1024)
    assert log == [5120, 4096] and best.depth == 4096


def test_a_failed_attempt_is_not_a_fit():
    # Issue 37 item 4: llama-bench ending with its own error (out of memory on a card no larger than the budget) did
    # not run within the budget; the depth below it is tried
    def attempt(depth):
        return Attempt(depth, FAILED, 0, message="exit 1: failed to create context") if depth > 70000 else \
            Attempt(depth, FITS, own_footprint(depth), rate(depth))
    best, tried = largest_fitting(BENCH_DEPTHS, attempt)
    assert best.depth == 65536 and [a.status for a in tried] == [FAILED, FAILED, FITS]
    llama = {"attempts": [vars(a) for a in tried], "largest_fitting_depth": 65536, "tok_s": rate(65536)}
    assert [bb.llama_cell(llama, d) for d in BENCH_DEPTHS] == [f"{rate(65536):.1f}", "failed", "failed"]


# ---- one llama-bench process watched under the budget ------------------------------------------------------------

FAKE_LLAMA_BENCH = f"""#!{sys.executable}
# Stands in for llama-bench and for the device: writes "pid footprint" to $FAKE_GPU_STATE as a KV cache of its
# context would take, runs a while, then prints llama-bench's JSON with a rate that names its depth.
import json, os, sys, time
a = sys.argv
depth = int(a[a.index("-d") + 1])
state = os.environ["FAKE_GPU_STATE"]
with open(state + ".tmp", "w") as f:
    f.write(f"{{os.getpid()}} {{{WEIGHTS} + {PER_TOKEN} * depth}}")
os.replace(state + ".tmp", state)
time.sleep(0.3)
ts = 1e7 / (1000 + depth)
print(json.dumps([{{"n_depth": depth, "flash_attn": True, "n_prompt": 0, "samples_ts": [ts], "avg_ts": ts}}]))
"""


def fake_driver(state: Path):
    """read() as the driver would answer: OURS always, plus the stand-in's footprint while its process lives."""
    def read() -> dict:
        try:
            pid, used = map(int, state.read_text().split())
            os.kill(pid, 0)
        except (FileNotFoundError, ValueError, ProcessLookupError):
            return {"CUDA0": OURS}
        return {"CUDA0": OURS + used}
    return read


def test_llama_bench_is_stopped_over_the_budget_and_its_rate_kept_where_it_fits(tmp_path, monkeypatch):
    # Issue 37 item 4: each attempt is measured while it runs (its own footprint above what was in use before it
    # started: our process's context is not counted against it), stopped once past the budget, and the rate printed
    # is that of the largest depth that ran within it
    binary = tmp_path / "llama-bench"
    binary.write_text(FAKE_LLAMA_BENCH)
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    state = tmp_path / "gpu"
    monkeypatch.setenv("FAKE_GPU_STATE", str(state))
    llama = bb.llama_in_budget(str(binary), "model.gguf", BENCH_DEPTHS, n_gen=8, threads=1, reps=1, split=[],
                               budget=LLAMA_BUDGET, bisect_steps=3, read=fake_driver(state))
    attempts = {a["depth"]: a for a in llama["attempts"]}
    assert list(attempts) == [262144, 131072, 196608, 163840, 147456]
    assert llama["largest_fitting_depth"] == 147456 and llama["tok_s"] == pytest.approx(rate(147456))
    for d in (262144, 196608, 163840):   # stopped, with the footprint it had reached
        assert attempts[d]["status"] == OVER and attempts[d]["peak_bytes"] == own_footprint(d) > LLAMA_BUDGET
    assert attempts[147456]["peak_bytes"] == own_footprint(147456) == LLAMA_BUDGET
    assert [bb.llama_cell(llama, d) for d in BENCH_DEPTHS] == [
        "-", f"{rate(131072):.1f}", "does not fit"]


def test_a_process_under_the_budget_runs_to_its_end(tmp_path):
    read = lambda: {"CUDA0": OURS}   # noqa: E731  (it takes nothing)
    w = bb.watch([sys.executable, "-c", "print('[]')"], LLAMA_BUDGET, read)
    assert (w.returncode, w.over, w.peak_bytes, w.stdout.strip()) == (0, False, 0, "[]")
    # a llama-bench that ran within the budget but printed no JSON: a fit without a rate, and why (no crash)
    garbled = tmp_path / "llama-bench"
    garbled.write_text(f"#!{sys.executable}\nprint('not json')\n")
    garbled.chmod(garbled.stat().st_mode | stat.S_IXUSR)
    a = bb.llama_attempt(str(garbled), "m.gguf", 4096, n_gen=8, threads=1, reps=1, split=[], budget=LLAMA_BUDGET,
                         read=read)
    assert a.fits and a.tok_s is None and "not llama-bench's JSON" in a.message
    assert bb.describe(a).startswith("fits, peak 0.00 GiB, no rate: its output is not llama-bench's JSON")


# ---- the command: the flag reaches the fit, a budget that cannot hold the minimum ends it -------------------------

def run_bench(tiny, tmp_path, *extra):
    out = tmp_path / "decode.json"
    rc = decode.main(["--model", tiny, "--backend", "cpu", "--threads", "1", "--kvflash", "auto",
                      "--depths", "1000,4000", "--n-gen", "4", "--reps", "1", "--no-llama-bench",
                      "--json", str(out), "--plot", "", *extra])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_bench_decode_fits_each_depths_pool_within_the_budget(tiny, tmp_path, capsys):
    # Issue 37 item 4: --max-device-memory reaches the product's fit: each depth runs the pool a Model of that
    # context gets under the same budget, and its row prints the peak and whether it is within the budget
    rc, report = run_bench(tiny, tmp_path, "--max-device-memory", "100M")
    assert rc == 0
    assert report["budget"]["max_device_bytes"] == BUDGET
    for row in report["rows"]:
        n_ctx = decode.depth_pool(PoolConfig(), row["depth"], 4).n_ctx
        with Model(tiny, backend="cpu", n_threads=1, n_ctx=n_ctx, max_device_bytes=BUDGET) as m:
            assert row["pool_tokens"] == m.pool.pool_tokens
        pooled = row["pooled"]
        assert pooled["within_budget"] and 0 < pooled["peak_bytes"] <= BUDGET and pooled["tok_s"] > 0
    assert report["rows"][1]["pool_tokens"] < decode.depth_pool(PoolConfig(), 4000, 4).n_ctx   # the budget binds
    out = capsys.readouterr().out
    assert "within max_device_bytes 104857600 (0.10 GiB) per device" in out
    assert "our full cache does not fit" in out   # the full cache is checked against the budget too, not run
    rc, plain = run_bench(tiny, tmp_path)   # no budget: no fit, the pool as given
    assert rc == 0 and "budget" not in plain and "pool_tokens" not in plain["rows"][0]


def test_bench_decode_refuses_a_budget_below_the_minimum(tiny, tmp_path, capsys):
    # Issue 37 item 4: a clear error naming the budget and what it must hold, status 2, nothing measured
    rc, report = run_bench(tiny, tmp_path, "--max-device-memory", "1K")
    err = capsys.readouterr().err
    assert rc == 2 and report is None and "max_device_bytes=1024 (0.000 GiB) is below the weights on CPU" in err
    rc, report = run_bench(tiny, tmp_path, "--max-device-memory", "70M")
    err = capsys.readouterr().err
    assert rc == 2 and report is None and "do not fit CPU's memory" in err and "at least 256 tokens" in err
    with pytest.raises(SystemExit) as e:   # RPC devices: no driver figures to read for them
        run_bench(tiny, tmp_path, "--max-device-memory", "24G", "--rpc", "127.0.0.1:50052")
    assert e.value.code == 2 and "not RPC devices" in capsys.readouterr().err
