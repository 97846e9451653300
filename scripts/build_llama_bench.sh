#!/usr/bin/env bash
# Build llama-bench from the same llama.cpp tree and the same ggml as our module, so that `kvflash bench decode`
# and `prefill` compare like with like. The result is build/llama-bench/bin/llama-bench; `kvflash bench` finds it
# from any folder (or set KVFLASH_LLAMA_BENCH to its path).
#
# By default llama-bench is linked against the ggml and libllama the package already built: the build folder the
# README's `pip install .` leaves (build/<wheel tag>/lib), else the installed package's folder (KVFLASH_LIB_DIR
# overrides). Only llama-common and llama-bench are compiled (scripts/llama_bench/CMakeLists.txt): 7 CPU-minutes
# (measured), against ~40 for ggml's CPU variants and libllama besides (the package's own build log). With --full,
# with extra cmake arguments, or when no such libraries exist (a KVFLASH_NATIVE build is static), ggml and libllama
# are built again with the module's options: every CPU variant, about 15 minutes on 2 cores.
# Warnings of the vendored code are silenced. Needs a C++ compiler and CMake (no pybind11).
# Usage: scripts/build_llama_bench.sh [--full] [extra cmake args, e.g. -DKVFLASH_CUDA=ON or -DKVFLASH_NATIVE=ON]
# KVFLASH_CONFIGURE_ONLY=1: configure and stop (tests); KVFLASH_LLAMA_BENCH_BUILD: another build folder (tests).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=${KVFLASH_LLAMA_BENCH_BUILD:-build/llama-bench}   # (another folder: tests)
case $build in /*) ;; *) build=$root/$build ;; esac
command -v cmake >/dev/null || { echo "build_llama_bench.sh: cmake is needed (pip install cmake)" >&2; exit 1; }

full=0
if [ "${1:-}" = "--full" ]; then full=1; shift; fi
[ $# -gt 0 ] && full=1   # cmake options are options of a ggml build

# The package's shared libraries (a portable build): libkvflash-ggml-base.so, libkvflash-ggml.so and the ggml
# backend modules llama-bench loads from its own folder (libggml-cpu-*.so, ...) in one folder, and
# libkvflash-llama.so there or, in a build folder, in bin/ beside it. Prints "GGML_DIR LLAMA_LIB".
find_libs_in() {
    local ggml=$1 llama
    [ -f "$ggml/libkvflash-ggml.so" ] && [ -f "$ggml/libkvflash-ggml-base.so" ] &&
        compgen -G "$ggml/libggml-*.so" >/dev/null || return 1
    for llama in "$ggml/libkvflash-llama.so" "$ggml/../bin/libkvflash-llama.so"; do
        [ -f "$llama" ] && { echo "$(cd "$ggml" && pwd -P) $(cd "$(dirname "$llama")" && pwd -P)/libkvflash-llama.so"; return 0; }
    done
    return 1
}
find_libs() {
    if [ -n "${KVFLASH_LIB_DIR:-}" ]; then
        find_libs_in "$KVFLASH_LIB_DIR" || { echo "build_llama_bench.sh: KVFLASH_LIB_DIR=$KVFLASH_LIB_DIR does not hold" \
            "libkvflash-ggml.so, libkvflash-ggml-base.so, libggml-*.so and libkvflash-llama.so" >&2; exit 1; }
        return 0
    fi
    local d
    for d in $(ls -dt build/*/lib 2>/dev/null); do   # the build folders `pip install .` leaves, newest first
        [ "$root/$d" = "$build/lib" ] && continue      # (not a --full build of this script)
        find_libs_in "$d" && return 0
    done
    # the installed package, located without importing it (no extension module is loaded)
    d=$(python3 -c 'import importlib.util as u; s = u.find_spec("kvflash_ggml"); print(s.submodule_search_locations[0] if s else "")' 2>/dev/null || true)
    [ -n "$d" ] && find_libs_in "$d" && return 0
    return 0
}

libs=""
[ $full = 0 ] && libs=$(find_libs)
if [ $full = 0 ] && [ -n "${KVFLASH_LIB_DIR:-}" ] && [ -z "$libs" ]; then exit 1; fi   # find_libs said why
lib_dir=${libs%% *}
if [ -n "$libs" ]; then
    source_dir=$root/scripts/llama_bench
    [ -f third_party/llama.cpp/.kvflash-source ] || python3 scripts/fetch_llama_cpp.py
    echo "build_llama_bench.sh: linking against the package's ggml and libllama in $lib_dir" \
         "(compiles llama-common and llama-bench only: ~7 CPU-minutes, about 4 minutes on 2 free cores)" >&2
    cmake_args=(-DKVFLASH_LIB_DIR="$lib_dir" -DKVFLASH_LLAMA_LIB="${libs#* }")
else
    source_dir=$root
    echo "build_llama_bench.sh: building ggml and libllama too (no package libraries to reuse, or --full / cmake" \
         "options given): about 15 minutes on 2 cores" >&2
    cmake_args=(-DKVFLASH_LLAMA_BENCH=ON -DKVFLASH_PYTHON=OFF -DCMAKE_C_FLAGS=-w -DCMAKE_CXX_FLAGS=-w
                -DGGML_ALL_WARNINGS=OFF "$@")
fi

# One build folder for both ways: a cache made from the other source folder is dropped (cmake refuses it).
if [ -f "$build/CMakeCache.txt" ] && ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$source_dir" "$build/CMakeCache.txt"; then
    rm -rf "$build/CMakeCache.txt" "$build/CMakeFiles"
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
mkdir -p "$build"
log=$build/configure.log
cmake -S "$source_dir" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "${cmake_args[@]}" >"$log" 2>&1 ||
    { cat "$log" >&2; echo "build_llama_bench.sh: configuring failed (log: $log)" >&2; exit 1; }
[ "${KVFLASH_CONFIGURE_ONLY:-0}" = 1 ] && exit 0
start=$SECONDS
cmake --build "$build" --target llama-bench -j "$(nproc)"
# ggml looks for its backend modules (CPU variants, CUDA) beside the executable: link them there.
modules=${lib_dir:-$build/lib}
for so in "$modules"/libggml-*.so; do [ -e "$so" ] && ln -sf "$so" "$build/bin/"; done
echo "build_llama_bench.sh: built in $((SECONDS - start)) s" >&2
find "$build" -name llama-bench -type f -perm -u+x -print -quit
