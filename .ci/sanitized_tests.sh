#!/usr/bin/env bash
# The C++-facing tests (pager, pool, snapshots and their fuzz, the GGUF fuzz, threads) once more with our C++
# built under AddressSanitizer + UndefinedBehaviorSanitizer (CMake option KVFLASH_SANITIZE, target
# _core_sanitized), in the build folder the README's `pip install .` left, so ggml and libllama are reused,
# not rebuilt. Any report aborts the process (-fno-sanitize-recover) and so fails the test that caused it.
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(ls -d build/cp3*-cp3*-linux_* | head -n 1)
[ -f "$build/CMakeCache.txt" ] || { echo "sanitized: no build folder (run pip install . first)" >&2; exit 1; }
# pip built in an isolated environment that is gone now: point CMake at a pybind11 of our own
python -m pip install -q pybind11
cmake -S . -B "$build" -DKVFLASH_SANITIZE=ON -Dpybind11_DIR="$(python -m pybind11 --cmakedir)" >/dev/null
cmake --build "$build" --target _core_sanitized -j "$(nproc)" >/dev/null
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
cp -r python/kvflash_ggml "$site/"
rm -f "$site"/kvflash_ggml/_core*.so
cp "$build"/sanitized/_core*.so "$site/kvflash_ggml/"

tests=()
for t in test_pager.py test_pooled_kv.py test_snapshot.py test_snapshot_fuzz.py test_gguf_fuzz.py \
         test_session_threads.py test_threads.py test_sliding_window.py test_batch_decoder.py; do
    [ -f "tests/$t" ] && tests+=("tests/$t")
done
# Python itself is not instrumented: preload the ASan runtime (and libstdc++, or ASan cannot intercept
# __cxa_throw); leaks are Python's own, not ours to judge. A report kills the process while pytest holds
# the output of the test, so reports go to files, printed when the run fails. An allocation over 4 GiB
# fails (MemoryError) as under the GGUF fuzz's RLIMIT_AS, which ASan's shadow memory rules out.
reports="$site/reports"
mkdir -p "$reports"
rc=0
LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libstdc++.so)" \
ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:max_allocation_size_mb=4096:log_path=$reports/asan" \
UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan" \
PYTHONPATH="$site" python -m pytest -q -p no:cacheprovider "${tests[@]}" || rc=$?
if [ -n "$(ls "$reports")" ]; then
    echo "sanitized: reports:" >&2
    head -n 60 "$reports"/* >&2
    rc=1
fi
exit "$rc"
