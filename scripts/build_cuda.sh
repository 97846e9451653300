#!/usr/bin/env bash
# Build and install kvflash-ggml with ggml's CUDA backend on a GPU machine, in one step, together with
# llama-bench and llama-server from the same build: one ggml-cuda compile serves all three (building
# llama-bench separately with scripts/build_llama_bench.sh -DKVFLASH_CUDA=ON would compile ggml-cuda a second
# time). The wheel puts both tools into kvflash_ggml/ beside the libraries and backend modules, where
# `kvflash bench decode` and `kvflash bench serve` find them.
#
# Usage: scripts/build_cuda.sh [LLAMA_TREE.tar.xz]
#   LLAMA_TREE.tar.xz: a third_party/llama.cpp tree packed by scripts/pack_llama_tree.sh, unpacked first
#   when the tree is missing or was packed without llama-server's sources; it carries the .kvflash-source
#   stamp, so CMake does not fetch (a machine that reaches no package registry can build). Without it the
#   tree must be present or CMake fetches it.
# Environment: CMAKE_CUDA_ARCHITECTURES (default 90: H100/H200 only), BUILD_JOBS (default: all cores),
# KVFLASH_LLAMA_SERVER (default ON; OFF: no llama-server. It adds mtmd and the server, ~150 CPU-seconds of C++
# and no CUDA, which the cores compile beside ggml-cuda).
# Incremental: the build folder (build/<wheel tag>) is kept, so a second run recompiles only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f third_party/llama.cpp/.kvflash-source ] || [ ! -d third_party/llama.cpp/tools/server ] ||
   [ ! -d third_party/llama.cpp/ggml/src/ggml-rpc ]; then
    if [ $# -ge 1 ]; then
        rm -rf third_party/llama.cpp && mkdir -p third_party && tar xJf "$1" -C third_party
    fi
fi
if [ "${KVFLASH_LLAMA_SERVER:-ON}" != OFF ] && [ ! -d third_party/llama.cpp/tools/server ]; then
    echo "build_cuda.sh: the llama.cpp tree has no tools/server (packed before llama-server was carried):" \
         "repack it with scripts/pack_llama_tree.sh, or set KVFLASH_LLAMA_SERVER=OFF" >&2
    exit 1
fi
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
jobs=${BUILD_JOBS:-$(nproc)}
arch=${CMAKE_CUDA_ARCHITECTURES:-90}
# CMakeLists.txt keeps GGML_CUDA_FA_ALL_QUANTS off: only the f16/q8_0/q4_0 flash-attention pairs get built.
# KVFLASH_NATIVE: one static ggml for this host (its CPU code tuned to it), as before the portable build. The
# GPU machine's GCC 13 links libstdc++ into every shared library it makes; in the portable build's shared
# ggml/libllama those copies crashed libllama's print_info (std::ostream) on the H100, as they once did in _core.
KVFLASH_CUDA=ON KVFLASH_LLAMA_BENCH=ON KVFLASH_LLAMA_SERVER=${KVFLASH_LLAMA_SERVER:-ON} KVFLASH_NATIVE=ON \
    CMAKE_BUILD_PARALLEL_LEVEL=$jobs \
    python3 -m pip install -v --no-build-isolation --no-deps --no-cache-dir \
    -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="$arch" -Ccmake.define.KVFLASH_NATIVE=ON -Cbuild.verbose=true .
python3 -c 'import kvflash_ggml, kvflash_ggml._core as c; print("installed", kvflash_ggml.__file__, c.gpu_devices())'
