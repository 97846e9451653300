"""The portable build: the CPU backend ggml loaded is a variant this CPU runs, the best one it runs, and the
build tools the README names work after the README's install alone. The wheel-level checks (manylinux tag,
an emulated older CPU) run in .ci/portable_wheel.sh, where the wheel is built."""
import os
import platform
import subprocess
from pathlib import Path

import pytest

from kvflash_ggml import _core

ROOT = Path(__file__).resolve().parent.parent

# ggml's feature names -> the flag /proc/cpuinfo shows for it
CPUINFO_FLAG = {"SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX2": "avx2", "F16C": "f16c", "FMA": "fma",
                "BMI2": "bmi2", "AVX_VNNI": "avx_vnni", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
                "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AMX_INT8": "amx_int8"}


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def compiled_features() -> dict[str, str]:
    name, _, feats = _core.cpu_variant().partition(":")
    assert name == "CPU", _core.cpu_variant()
    return dict(f.split("=", 1) for f in feats.split())


@pytest.mark.skipif(platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists(), reason="x86-64 Linux")
def test_the_loaded_cpu_variant_uses_only_instructions_this_cpu_has():
    flags, feats = cpu_flags(), compiled_features()
    isa = [f for f in feats if f in CPUINFO_FLAG]
    assert isa, f"no ISA features reported: {feats}"   # even the x64 baseline reports SSE3
    missing = [f for f in isa if CPUINFO_FLAG[f] not in flags]
    assert not missing, f"the loaded CPU backend was compiled for {missing}, which this CPU lacks"
    assert "AMX_INT8" not in feats   # the AMX variant is never shipped (libllama crashed in its matmul)


@pytest.mark.skipif(platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists(), reason="x86-64 Linux")
def test_the_loaded_cpu_variant_is_the_best_this_cpu_runs():
    # regression guard for the portable build: ggml must not fall back to a baseline variant (x64, sse42) on a
    # CPU that runs AVX2 code; a native build always has what the CPU has
    flags, feats = cpu_flags(), compiled_features()
    for feature in ("AVX", "AVX2", "FMA", "F16C"):
        if CPUINFO_FLAG[feature] in flags:
            assert feature in feats, f"this CPU has {feature} but the loaded variant was built without it: {feats}"
    if "avx512f" in flags and "avx512bw" in flags:
        assert "AVX512" in feats, feats


@pytest.mark.slow
def test_build_llama_bench_configures_without_pybind11(tmp_path):
    # regression (issue 18.9): the script named by `kvflash bench decode` stopped with "Could not find a package
    # configuration file provided by pybind11" after the README's install, which leaves no pybind11 behind
    env = dict(os.environ, KVFLASH_CONFIGURE_ONLY="1")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_bench.sh"),
                           "-DCMAKE_DISABLE_FIND_PACKAGE_pybind11=TRUE"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (ROOT / "build" / "llama-bench" / "CMakeCache.txt").is_file()
