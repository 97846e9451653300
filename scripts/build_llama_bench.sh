#!/usr/bin/env bash
# Build llama-bench from the same llama.cpp tree and the same ggml build options as our module (the
# portable CPU variants, or KVFLASH_NATIVE=ON as the module was built), so `kvflash bench decode`
# compares like with like. Needs only a C++ compiler and CMake (the Python module is not built: no pybind11).
# Usage: scripts/build_llama_bench.sh [extra cmake args, e.g. -DKVFLASH_CUDA=ON or -DKVFLASH_NATIVE=ON]
set -euo pipefail
cd "$(dirname "$0")/.."
build=build/llama-bench
command -v cmake >/dev/null || { echo "build_llama_bench.sh: cmake is needed (pip install cmake)" >&2; exit 1; }
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DKVFLASH_LLAMA_BENCH=ON -DKVFLASH_PYTHON=OFF \
      "$@" >/dev/null
[ "${KVFLASH_CONFIGURE_ONLY:-0}" = 1 ] && exit 0   # tests: check that configuring works after the README's install
cmake --build "$build" --target llama-bench -j "$(nproc)"
# ggml looks for its CPU variant modules beside the executable (or in the working directory): link them there.
for so in "$build"/lib/libggml-cpu-*.so; do [ -e "$so" ] && ln -sf "../lib/$(basename "$so")" "$build/bin/"; done
find "$build" -name llama-bench -type f -perm -u+x -print -quit
