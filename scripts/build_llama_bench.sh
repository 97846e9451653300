#!/usr/bin/env bash
# Build llama-bench from the same llama.cpp tree and the same ggml build options as our module
# (AMX off, GGML_NATIVE), so `kvflash bench decode` compares like with like.
# Usage: scripts/build_llama_bench.sh [extra cmake args, e.g. -DKVFLASH_CUDA=ON]
set -euo pipefail
cd "$(dirname "$0")/.."
build=build/llama-bench
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVFLASH_LLAMA_BENCH=ON \
      -Dpybind11_DIR="$(python -m pybind11 --cmakedir)" "$@" >/dev/null
cmake --build "$build" --target llama-bench
find "$build" -name llama-bench -type f -perm -u+x -print -quit
