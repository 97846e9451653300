#!/usr/bin/env bash
# Pack third_party/llama.cpp for a machine without network access (the lent GPU machine): CMake files,
# ggml with only the CPU, BLAS, CUDA and RPC backends, libllama, common/, vendor/ and tools/ (llama-bench,
# llama-server with mtmd and an empty web UI), with the .kvflash-source stamp, so scripts/build_cuda.sh there
# does not fetch. About 3 MB.
# Usage: scripts/pack_llama_tree.sh OUT.tar.xz
set -euo pipefail
out=$(realpath -m "$1")
# -P: from the tree's real parent, as a worktree's third_party/llama.cpp may be a link to another checkout's
cd -P "$(dirname "$0")/../third_party/llama.cpp/.." 2>/dev/null || cd "$(dirname "$0")/../third_party"
[ -f llama.cpp/.kvflash-source ] || { echo "third_party/llama.cpp is missing: run scripts/fetch_llama_cpp.py" >&2; exit 1; }
excl=()
for d in models docs media .github .devops tests examples pocs benches gguf-py conversion skills app \
         tools/server/tests tools/server/bench tools/mtmd/tests tools/mtmd/test-1.jpeg tools/mtmd/test-2.mp3 \
         tools/mtmd/test-3.mp4; do
    excl+=(--exclude="llama.cpp/$d")
done
# GNU tar cannot exclude a folder and name one of its files back (excludes apply to named files too): where a
# build needs a few files of a folder, every other entry is excluded.
keep_only() {   # keep_only DIR FILE...: exclude every other entry of DIR
    local dir=$1 entry; shift
    for entry in llama.cpp/"$dir"/* llama.cpp/"$dir"/.[!.]*; do
        [ -e "$entry" ] || continue
        [[ " $* " == *" $(basename "$entry") "* ]] || excl+=(--exclude="$entry")
    done
}
# llama-server's UI target only turns the (absent) tools/ui/dist into ui.cpp: the script and its templates,
# not the Svelte sources (npm is never run: CMakeLists.txt sets LLAMA_BUILD_UI off).
keep_only scripts ui-assets.cmake
keep_only tools/ui CMakeLists.txt ui.h.in ui.cpp.in
for b in cann et hexagon hip metal musa opencl openvino sycl virtgpu vulkan webgpu zdnn zendnn; do
    excl+=(--exclude="llama.cpp/ggml/src/ggml-$b")
done
tar "${excl[@]}" -cJf "$out" llama.cpp
ls -la "$out"
