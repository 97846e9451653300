"""`kvflash bench decode` (no timing assertions: machines are shared and noisy), and how the bench tools find
llama-bench and build it (issue 39 item 13)."""
import argparse
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvflash_ggml.bench import reference

ROOT = Path(__file__).resolve().parent.parent

# A stand-in for llama-bench: the JSON records `kvflash bench decode` reads, 100 tok/s with flash attention
# off and 200 with it on, for every depth asked for.
FAKE_LLAMA_BENCH = f"""#!{sys.executable}
import json, sys
a = sys.argv
depths = a[a.index("-d") + 1].split(",") if "-d" in a else ["0"]
fas = a[a.index("-fa") + 1].split(",")
print(json.dumps([{{"n_depth": int(d), "flash_attn": fa == "1", "n_prompt": 0, "samples_ts": [100.0 * (1 + int(fa))],
                    "avg_ts": 100.0 * (1 + int(fa))}} for d in depths for fa in fas]))
"""


def fake_llama_bench(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "llama-bench"
    path.write_text(FAKE_LLAMA_BENCH)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.mark.slow
def test_bench_decode_smoke(tmp_path):
    # Issue 39 item 13 too: run from a folder other than the repository, with llama-bench named by
    # $KVFLASH_LLAMA_BENCH; which llama-bench ran and the progress go to stderr, stdout stays the report.
    out = tmp_path / "decode.json"
    elsewhere = tmp_path / "elsewhere"
    binary = fake_llama_bench(tmp_path / "tools")
    elsewhere.mkdir()
    env = dict(os.environ, KVFLASH_LLAMA_BENCH=str(binary))
    proc = subprocess.run([sys.executable, "-m", "kvflash_ggml", "bench", "decode", "--model", "smollm2",
                           "--depths", "0,600", "--kvflash", "448", "--n-gen", "16", "--threads", "2",
                           "--policy", "qk", "--tau", "64", "--json", str(out), "--plot", ""],
                          capture_output=True, text=True, timeout=600, cwd=elsewhere, env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [r["depth"] for r in report["rows"]] == [0, 600]
    deep = report["rows"][1]
    assert deep["pooled"]["device_kv_bytes"] < deep["full"]["device_kv_bytes"]
    assert deep["pooled"]["host_kv_bytes"] > 0 and deep["pooled"]["tok_s"] > 0
    assert deep["pooled"]["reselect_ms"] > 0 and deep["pooled"]["reselect_every"] == 64
    assert 0 < deep["pooled"]["reselect_share"] < 1 and "reselect %" in proc.stdout
    assert deep["pooled"]["page_outs"] > 0
    assert (deep["llama_fa0"], deep["llama_fa1"]) == (100.0, 200.0) and report["llama_bench"] == str(binary)
    assert f"llama-bench {binary} ($KVFLASH_LLAMA_BENCH)" in proc.stderr
    for line in ("depth 600, full cache: prefilling 601 tokens", "depth 600, pool 448: prefilling 601 tokens",
                 "llama-bench -p 0 -n 16 -d 0,600 -r 5 (-fa 0,1): running"):
        assert line in proc.stderr and line not in proc.stdout, proc.stderr


def test_bench_decode_rejects_bad_flags():
    proc = subprocess.run([sys.executable, "-m", "kvflash_ggml", "bench", "decode", "--depths", "a,b",
                           "--no-llama-bench"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--depths" in proc.stderr


# -- issue 39 item 13: finding llama-bench ----------------------------------------------------------------

def test_the_packages_source_tree_is_searched_from_any_folder(tmp_path, monkeypatch):
    # regression: llama-bench built by scripts/build_llama_bench.sh was found only under the working directory
    package_root = Path(reference.__file__).resolve().parents[3]
    if package_root != ROOT and not (ROOT / "build").is_dir():
        pytest.skip("this package was not built from this checkout")
    monkeypatch.chdir(tmp_path)
    assert ROOT in reference.source_trees()


def test_llama_bench_in_a_source_trees_build_folder_is_found_and_named(tmp_path, monkeypatch):
    tree = tmp_path / "checkout"
    binary = fake_llama_bench(tree / "build" / "llama-bench" / "bin")
    monkeypatch.delenv("KVFLASH_LLAMA_BENCH", raising=False)
    monkeypatch.setattr(reference, "source_trees", lambda: [tree])
    monkeypatch.setattr(reference.shutil, "which", lambda name: None)
    monkeypatch.chdir(tmp_path)
    beside = Path(reference.__file__).resolve().parent.parent / "llama-bench"
    if beside.exists():
        pytest.skip("a llama-bench is installed beside the package (found first)")
    assert reference.locate_llama_bench(None) == (str(binary), f"built in {tree / 'build'}")


def test_the_environment_variable_names_llama_bench_or_fails(tmp_path, monkeypatch, capsys):
    binary = fake_llama_bench(tmp_path)
    monkeypatch.setenv("KVFLASH_LLAMA_BENCH", str(binary))
    args = argparse.Namespace(no_llama_bench=False, llama_bench=None)
    assert reference.reference_binary(args, "kvflash bench decode") == str(binary)
    assert f"kvflash bench decode: llama-bench {binary} ($KVFLASH_LLAMA_BENCH)" in capsys.readouterr().err
    # --llama-bench wins over the variable
    other = fake_llama_bench(tmp_path / "other")
    assert reference.locate_llama_bench(str(other)) == (str(other), "--llama-bench")
    # a path that is not an executable ends the command: no silent fallback to another llama-bench
    monkeypatch.setenv("KVFLASH_LLAMA_BENCH", str(tmp_path / "missing"))
    with pytest.raises(SystemExit) as e:
        reference.reference_binary(args, "kvflash bench decode")
    assert e.value.code == 2 and "is not an executable file" in capsys.readouterr().err
    # the same variable switches llama-bench on in a build (KVFLASH_LLAMA_BENCH=ON pip install .): not a path
    monkeypatch.setenv("KVFLASH_LLAMA_BENCH", "ON")
    found = reference.locate_llama_bench(None)
    assert found is None or found[1] != "$KVFLASH_LLAMA_BENCH"


# -- issue 39 item 13: building llama-bench --------------------------------------------------------------

def test_build_llama_bench_reuses_the_packages_libraries(tmp_path):
    # regression: the script compiled all of ggml again (every CPU variant: 15 min on 2 cores, thousands of
    # warnings from ggml's headers); it now links llama-bench against the libraries the package built
    env = dict(os.environ, KVFLASH_CONFIGURE_ONLY="1", KVFLASH_LLAMA_BENCH_BUILD=str(tmp_path / "lb"))
    env.pop("KVFLASH_LIB_DIR", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_bench.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    if "building ggml and libllama too" in proc.stderr:
        pytest.skip("no portable build of the package to reuse here (a native build is static)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "linking against the package's ggml and libllama in" in proc.stderr
    cache = (tmp_path / "lb" / "CMakeCache.txt").read_text()
    assert f"CMAKE_HOME_DIRECTORY:INTERNAL={ROOT / 'scripts' / 'llama_bench'}" in cache
    lib_dir = Path(next(l for l in cache.splitlines() if l.startswith("KVFLASH_LIB_DIR:")).split("=", 1)[1])
    assert (lib_dir / "libkvflash-ggml.so").is_file()
    # warnings are off for everything it compiles (all of it vendored)
    commands = json.loads((tmp_path / "lb" / "compile_commands.json").read_text())
    assert commands and all(" -w " in c["command"] for c in commands)
    assert {Path(c["file"]).name for c in commands} >= {"llama-bench.cpp", "common.cpp"}


def test_build_llama_bench_says_what_a_wrong_library_folder_lacks(tmp_path):
    env = dict(os.environ, KVFLASH_CONFIGURE_ONLY="1", KVFLASH_LLAMA_BENCH_BUILD=str(tmp_path / "lb"),
               KVFLASH_LIB_DIR=str(tmp_path))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_bench.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and f"KVFLASH_LIB_DIR={tmp_path} does not hold libkvflash-ggml.so" in proc.stderr
    assert not (tmp_path / "lb" / "CMakeCache.txt").exists()


def test_llama_bench_gets_the_same_split_as_ours():
    # Issue 40 item 1: a split over this host's GPUs (or RPC devices named in --devices) is compared with llama-bench
    # running the same devices in the same order with the same shares; a device llama-bench cannot name is refused.
    from argparse import Namespace
    from kvflash_ggml.bench.reference import holds_rpc, llama_bench_split

    two_gpus = Namespace(devices=["cuda0", "cuda1"], rpc=None, tensor_split=[1.0, 1.0])
    assert llama_bench_split(two_gpus) == ["-dev", "CUDA0/CUDA1", "-sm", "layer", "-ts", "1/1"]
    assert not holds_rpc(two_gpus)
    mixed = Namespace(devices=["rpc:10.0.0.2:50052", "CUDA1"], rpc=None, tensor_split=[3.0, 1.0])
    assert llama_bench_split(mixed) == ["--rpc", "10.0.0.2:50052", "-dev", "RPC0/CUDA1", "-sm", "layer", "-ts", "3/1"]
    # ggml-rpc numbers RPC devices in the order the servers register (--rpc's order), after any --rpc servers
    both = Namespace(devices=["rpc:b:2", "rpc:a:1"], rpc=["a:1"], tensor_split=None)
    assert llama_bench_split(both) == ["--rpc", "a:1,b:2", "-dev", "RPC1/RPC0", "-sm", "layer"]
    assert holds_rpc(mixed)
    assert llama_bench_split(Namespace(devices=None, rpc=["h:1"], tensor_split=[1.0, 2.0])) == \
        ["--rpc", "h:1", "-ts", "1/2"]
    with pytest.raises(ValueError, match="cpu"):
        llama_bench_split(Namespace(devices=["cpu", "cuda0"], rpc=None, tensor_split=None))


def test_serve_interference_measures_the_gaps_that_overlap_the_long_prompt():
    # Issue 38's bar: the decoding streams' inter-token p99 while a long prompt runs vs their median over the run.
    from kvflash_ggml.bench.serve import stall
    steady = {"stamps": [0.00, 0.01, 0.02, 0.03, 0.53, 0.54, 0.55]}   # a 0.5 s stall from 0.03 to 0.53
    other = {"stamps": [0.005, 0.015, 0.025, 0.035, 0.045, 0.055]}    # ended before the prompt's first token
    r = stall([steady, other], t_from=0.10, t_to=0.50)
    assert r["gaps_during"] == 1 and abs(r["itl_p99_during_ms"] - 500.0) < 1e-6
    assert abs(r["itl_median_ms"] - 10.0) < 1e-6 and abs(r["p99_over_median"] - 50.0) < 1e-6
    assert stall([other], t_from=1.0, t_to=2.0)["p99_over_median"] is None   # no gap overlaps: no ratio


def test_serve_throughput_counts_the_window_where_every_stream_decodes_and_says_when_it_is_short(capsys):
    from kvflash_ggml.bench.serve import aggregate_decode
    def stream(t0, first, n, dt=0.01):
        return {"t0": t0, "stamps": [first + i * dt for i in range(n)], "tokens": n}
    # together from 0.0 to 0.99: the window (0.1, 0.99] holds the tokens both stamped after the later first token
    r = aggregate_decode("kvflash", [stream(0.0, 0.0, 100), stream(0.0, 0.1, 100)])
    assert abs(r["window_s"] - 0.89) < 1e-9 and r["tokens_in_window"] == 89 + 89
    assert abs(r["tok_s"] - 178 / 0.89) < 1e-6 and r["generated"] == 200
    assert "short sample" not in capsys.readouterr().out
    # the second starts as the first is nearly done: 18 of the 200 tokens in the window, and the bench says so
    r = aggregate_decode("llama-server", [stream(0.0, 0.0, 100), stream(0.0, 0.9, 100)])
    out = capsys.readouterr().out
    assert r["tokens_in_window"] == 9 + 9 and "short sample; raise --gen" in out
    assert out.lstrip().startswith("llama-server: only 18 of the 200")   # names the server the row belongs to
