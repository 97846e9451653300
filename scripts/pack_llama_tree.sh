#!/usr/bin/env bash
# Pack third_party/llama.cpp for a machine without network access (the lent GPU machine): CMake files,
# ggml with only the CPU, BLAS and CUDA backends, libllama, common/, vendor/ and tools/ (llama-bench),
# with the .kvflash-source stamp, so scripts/build_cuda.sh there does not fetch. About 4 MB.
# Usage: scripts/pack_llama_tree.sh OUT.tar.xz
set -euo pipefail
out=$(realpath -m "$1")
cd "$(dirname "$0")/../third_party"
[ -f llama.cpp/.kvflash-source ] || { echo "third_party/llama.cpp is missing: run scripts/fetch_llama_cpp.py" >&2; exit 1; }
excl=()
for d in models docs media .github .devops tools/ui tools/server tests examples pocs benches gguf-py conversion \
         scripts skills app; do
    excl+=(--exclude="llama.cpp/$d")
done
for b in cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan webgpu zdnn zendnn; do
    excl+=(--exclude="llama.cpp/ggml/src/ggml-$b")
done
tar "${excl[@]}" -cJf "$out" llama.cpp
ls -la "$out"
