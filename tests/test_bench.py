"""Smoke test of `kvflash bench decode` (no timing assertions: machines are shared and noisy)."""
import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_decode_smoke(tmp_path):
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, "-m", "kvflash_ggml", "bench", "decode", "--model", "smollm2",
                           "--depths", "0,600", "--kvflash", "448", "--n-gen", "16", "--threads", "2",
                           "--no-llama-bench", "--policy", "qk", "--tau", "64", "--json", str(out), "--plot", ""],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [r["depth"] for r in report["rows"]] == [0, 600]
    deep = report["rows"][1]
    assert deep["pooled"]["device_kv_bytes"] < deep["full"]["device_kv_bytes"]
    assert deep["pooled"]["host_kv_bytes"] > 0 and deep["pooled"]["tok_s"] > 0
    assert deep["pooled"]["reselect_ms"] > 0 and deep["pooled"]["reselect_every"] == 64
    assert 0 < deep["pooled"]["reselect_share"] < 1 and "reselect %" in proc.stdout
    assert deep["pooled"]["page_outs"] > 0


def test_bench_decode_rejects_bad_flags():
    proc = subprocess.run([sys.executable, "-m", "kvflash_ggml", "bench", "decode", "--depths", "a,b",
                           "--no-llama-bench"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--depths" in proc.stderr
