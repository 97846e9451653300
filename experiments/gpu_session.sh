#!/usr/bin/env bash
# What ran on the lent H100 for docs/RESULTS.md, phase by phase, each phase's log under $OUT.
#
#   experiments/gpu_session.sh PHASE...     phases run in the order given:
#     build        scripts/build_cuda.sh (CUDA module + llama-bench + llama-server, sm_90), from $CARRY/llama.cpp.tar.xz
#     check        GPU facts, then tests/test_cuda.py (ours on CUDA vs ours on CPU vs libllama on CUDA; CHECK_K:
#                  a pytest -k expression, e.g. "paging or adopt")
#     model        write MODEL (SHAPE) now, so the next call's phases find it
#     bench-small  kvflash bench decode on the 8B shape at depths 0,4096 (fails fast before the grid)
#     bench        kvflash bench decode on the 8B shape, the issue's grid (DEPTHS, N_GEN; BENCH_ARGS: more flags, e.g.
#                  "--kv-type q8_0 --no-llama-bench" for 1M; BENCH_TAG: a suffix for its JSON)
#     prefill      kvflash bench prefill on the 8B shape: full / exact / pooled vs llama-bench -p N, with the
#                  device memory each held (PREFILL_LENGTHS, PREFILL_REPS, POOL)
#     sparse       issue 37 item 2: kvflash bench prefill, exact and sparse beside llama-bench -p N (SPARSE_LENGTHS,
#                  default 32768,262144; POOL; SPARSE_MODES, SPARSE_ARGS: more flags, e.g. "--kv-type q8_0
#                  --no-llama-bench"; SPARSE_TAG: a suffix for its JSON; KVF_CMD: how kvflash runs, e.g.
#                  "python3 experiments/with_knobs.py" with FFN_PART_ROWS=512)
#     sparse-1m    the sparse prefill of 1,048,576 tokens alone (llama.cpp's f16 K/V would be 128 GiB), SPARSE_1M_KV
#                  K/V (default q8_0: a 68 GiB host store); about 3-5 minutes, so start it with setsid on one call
#                  and poll; quality: the niah / ruler phases with PREFILL=exact+sparse and NIAH_ARGS / RULER_ARGS
#                  "--attention flash" (SmolLM2 is 98 MB: over one call's carry, send it in parts)
#     decode-1m    issue 37 item 3: pooled decode at 4K and 1,048,576 tokens, q8_0 K/V (a 68 GiB host store), ours only
#                  (llama.cpp's f16 K/V at 1M would be 128 GiB); the 1M prompt prefilled pooled: about 4 minutes
#     resend       experiments/resend_latency.py on the 8B shape: a resend of a long prompt answered from the held
#                  prompt vs its last token run again (RESEND_LENGTHS, default 32768,131072; POOL)
#     order        pooled decode with and without the position-ordered K/V copy (what ordering costs)
#     niah, ruler  kvflash bench niah / ruler on SmolLM2 at 8K (SMOL: its GGUF; NIAH_CASES, RULER_CASES,
#                  NIAH_POLICIES, RULER_POLICIES, RULER_TASKS, NIAH_ARGS / RULER_ARGS (more flags, split
#                  at spaces, e.g. --no-full),
#                  PREFILL_RESELECT, PREFILL); plots are drawn afterwards from the JSON
#     fit          experiments/fit_check.py: pool_tokens="auto" for 1 and 8 slots at 32K, then those slots built and
#                  filled (FIT_CTX, FIT_SLOTS)
#     serve        kvflash bench serve on the 8B shape: aggregate decode tok/s of 1, 4, 8 streams (SERVE_STREAMS) at
#                  each of SERVE_CONTEXTS, --kvflash SERVE_POOL (default auto), beside the llama-server the build
#                  phase installed (LLAMA_SERVER: another binary, or none: ours only); SERVE_FLAGS: more flags for
#                  ours (e.g. "--policy quest"), SERVE_TAG: a suffix for its JSON and log folder; SERVE_GEN: tokens a
#                  stream (default 512; the 27B shape's continuations start seconds apart: 2048 for a longer window);
#                  SERVE_ARGS: more bench flags (e.g. "--interference": S - 1 streams decode while a long prompt arrives)
#     serve-profile  experiments/serve_batching.py --profile on the GPU: where the server's decode time goes (the core's
#                  calls vs the rest, the sessions' timers) for PROFILE_CONFIGS (default lru,quest), SERVE_STREAMS
#                  slots (one number, default 8) of SERVE_CONTEXTS (one, default 32768), SERVE_POOL (default 4096);
#                  PROFILE_ARGS: more flags (e.g. "--cprofile 40", "--switch-interval 0.0002")
#     batched-profile  experiments/profile_batched.py: SERVE_STREAMS slots (default 8; a list: steps of the first N)
#                  of MODEL, PROFILE_CONTEXT tokens each (default 8192), pool SERVE_POOL (default 4096), stepped by
#                  BatchDecoder: the step's ms, its kernels; BATCHED_ARGS: more flags (e.g. "--steps 32")
#     spec         kvflash bench spec on the 8B shape: plain vs speculative decode with the model itself as the draft
#                  and a random Llama 3.2 1B shape (acceptance ~0: a miss's cost), then the same shape written as an
#                  echo model (random_gguf --echo) drafting itself (acceptance 1: the machinery's upper bound);
#                  random prompts of SPEC_CONTEXTS, pool POOL
#     split        issue 24: the layer split of one GPU + a ggml-rpc-server on this host's CPU (-d CPU): kvflash bench
#                  decode on the 8B shape with --rpc and --tensor-split SPLIT_TS (default 1,1), beside llama-bench with
#                  the same --rpc and -ts (SPLIT_DEPTHS, default 0,4096; SPLIT_REPS, N_GEN)
#     mg-logits    issue 40: the model split over this host's GPUs (MG_DEVICES, default all; MG_TS, default equal
#                  shares): its prompt logits against libllama on the GPUs and on the CPU (MG_NO_CPU=1: not the CPU)
#     mg-decode    kvflash bench decode of the split beside llama-bench with the same -dev / -sm layer / -ts
#                  (MG_DEPTHS, default 0,4096,131072; MG_FULL_UP_TO, default 4096; MG_REPS, default 3; PREFILL)
#     mg-prefill   kvflash bench prefill (exact) of the split beside llama-bench -p (MG_PREFILL_LENGTHS, default 32768)
#     prefill-profile  experiments/profile_prefill.py: exact prefill vs libllama (PROFILE_LENGTHS, EXACT_BATCH,
#                  ATTN_BLOCK_MIB, BLOCKS_PER_CALL: query blocks per flash attention call, 0 the default; lists run
#                  each pair, or PROFILE_PAIRS only the pairs it lists, e.g. "0:0 0:1": a call per 64 MiB block;
#                  FFN_PART_ROWS: the FFN's rows at once, 0 the default 1024 (a step's whole), 512 parts; PROFILE_TOP), GPU
#                  idle gaps, kernels, the host's time in CUDA calls; aborts if a step graph re-reserves
#     prefill-memory  experiments/prefill_memory.py: the exact prefill's device memory (driver) after the Engine, after
#                  the bench's warm-up prompt and at the prompt's peak, with and without that warm-up (MEMORY_LENGTHS)
#     budget       issue 37 item 4: the Qwen3.5-27B shape (random Q4_0, BUDGET_MODEL, default /tmp/q35-27b.gguf, written
#                  if absent) within BUDGET (default 24G) of device memory: kvflash bench decode --kvflash auto
#                  --max-device-memory BUDGET at BUDGET_DEPTHS (default 65536,131072,262144; PREFILL default pooled),
#                  each depth's pool fitted under the budget with the whole GPU's peak (driver) beside its rate; then
#                  llama-bench at the largest depth it runs within the budget (its own footprint measured; the
#                  bench's depths from the largest down, then BUDGET_FIT_STEPS bisection steps, default 3);
#                  BUDGET_REPS (default 3). Longer than one device command (~15 min with the model's writing):
#     budget-bg    the budget phase in the background (setsid), writing to /tmp/kvf-budget; the machine keeps it
#                  running while it stays warm
#     budget-collect  waits up to COLLECT_S seconds (default 540) for the background run, then copies its log and
#                  JSON under $OUT (call it again while it is still running)
#     profile      decode step wall vs compute time (full/pooled), CUDA-graph log counts, and per-kernel GPU
#                  time of decode steps under ncu: ours (full cache, depth 0) and llama-bench (depth 0)
#
# Environment: OUT (logs; default ./gpu-out), CARRY (folder with llama.cpp.tar.xz and whl/*.whl, wheels of
# pure-Python packages the machine lacks or has too old: gguf >= 0.19, as pyproject.toml asks; the machines
# carry 0.17.1: `pip download --no-deps gguf==0.19.0 -d .devcarry/whl`; the serve phases need the server's, which the H100
# machines lack (uvicorn): `pip download -d .devcarry/whl --python-version 3.12 --platform manylinux2014_x86_64
# --only-binary=:all: fastapi uvicorn sse-starlette prometheus-client`), MODEL (default /tmp/l8b.gguf: llama3-8b shape, random
# Q4_0 weights, written here in seconds; SHAPE: another random_gguf preset for it, e.g. qwen35-27b), DEPTHS, N_GEN, REPS, POOL, FULL_UP_TO (bench: our full cache only up to
# this depth), PREFILL (bench: exact or pooled).
# A chain longer than one device command (lent machines are also taken back mid-call): start it detached with an
# OUT of its own, and copy OUT back in each call until the script's last line, "done", appears:
#   mkdir -p /tmp/gs; (OUT=/tmp/gs setsid nohup bash experiments/gpu_session.sh PHASE... > /tmp/gs/chain.log 2>&1 &)
#   for i in $(seq 57); do sleep 10; cp -r /tmp/gs/. $OUT/; grep -q '] done$' /tmp/gs/session.log && break; done
# (`pgrep -f gpu_session.sh` as the test finds the polling command itself and never stops.)
# KVF_SRC/KVF_DIR: copy the tree at KVF_SRC into KVF_DIR file by file where the bytes differ (touched files
# only get a new mtime, so a kept build folder recompiles only what changed), then run from KVF_DIR.
set -uo pipefail
if [ -n "${KVF_SRC:-}" ]; then
    python3 - "$KVF_SRC" "$KVF_DIR" <<'PY'
import filecmp, os, shutil, sys
src, dst = sys.argv[1:3]
n = 0
for root, _, files in os.walk(src):
    for f in files:
        s = os.path.join(root, f)
        d = os.path.join(dst, os.path.relpath(s, src))
        if not os.path.exists(d) or not filecmp.cmp(s, d, shallow=False):
            os.makedirs(os.path.dirname(d), exist_ok=True)
            shutil.copyfile(s, d)
            shutil.copymode(s, d)
            n += 1
print(f"synced {n} changed files into {dst}")
open("/tmp/kvf-synced", "w").write(str(n))
PY
    cd "$KVF_DIR"
else
    cd "$(dirname "$0")/.."
fi
OUT=${OUT:-$PWD/gpu-out}
CARRY=${CARRY:-$PWD/.devcarry}
MODEL=${MODEL:-/tmp/l8b.gguf}
DEPTHS=${DEPTHS:-0,4096,32768,65536,131072}
N_GEN=${N_GEN:-64}
REPS=${REPS:-5}
POOL=${POOL:-4096}
KVF_CMD=${KVF_CMD:-python3 -m kvflash_ggml}
mkdir -p "$OUT"
t0=$(date +%s)
log() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$OUT/session.log"; }

if ls "$CARRY"/whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$CARRY"/whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1

need_model() {
    [ -f "$MODEL" ] || python3 -m kvflash_ggml.testing.random_gguf "$MODEL" --shape "${SHAPE:-llama3-8b}" --type q4_0 2>&1 | tee -a "$OUT/session.log"
}

# kvflash bench decode on MODEL with the pool POOL: $1 its JSON's name, $2 the depths, $3 the plot ("": none), then
# the phase's own flags.
decode_bench() {
    local name=$1 depths=$2 plot=$3
    shift 3
    need_model
    python3 -m kvflash_ggml bench decode --model "$MODEL" --depths "$depths" --kvflash "$POOL" "$@" \
        --json "$OUT/$name.json" --plot "$plot" 2>&1 | tee -a "$OUT/bench.log"
}

for phase in "$@"; do
    log "phase $phase"
    case $phase in
    build)
        if [ "$(cat /tmp/kvf-synced 2>/dev/null)" = 0 ] && python3 -c "import kvflash_ggml._core as c; assert c.gpu_devices()" 2>/dev/null; then
            log "build: nothing changed since the last build on this machine"; continue
        fi
        if ! bash scripts/build_cuda.sh "$CARRY/llama.cpp.tar.xz" > "$OUT/build.log" 2>&1; then
            tail -40 "$OUT/build.log"; log "build FAILED"; exit 1
        fi
        grep -E "^\[[0-9]+/[0-9]+\]" "$OUT/build.log" | tail -1; tail -2 "$OUT/build.log" ;;
    check)
        { nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem --format=csv
          nvcc --version | tail -1; lscpu | grep -E "Model name|^CPU\(s\)"
          so=$(python3 -c 'import kvflash_ggml._core as c; print(c.__file__)')
          echo "libstdc++ symbols exported by _core: $(nm -D --defined-only "$so" | grep -c 'St6locale\|codecvt')"; } 2>&1 | tee -a "$OUT/session.log"
        python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda.py -k "${CHECK_K:-}" 2>&1 | tee "$OUT/check.log" | grep -E "CUDA-|passed|failed|Error|^#" ;;
    model)
        need_model ;;
    bench-small)
        decode_bench decode-small 0,4096 "" --n-gen 32 ;;
    bench)
        decode_bench "decode${BENCH_TAG:-}" "$DEPTHS" "$OUT/decode.png" --n-gen "$N_GEN" --reps "$REPS" \
            ${FULL_UP_TO:+--full-up-to "$FULL_UP_TO"} ${PREFILL:+--prefill "$PREFILL"} ${BENCH_ARGS:-} ;;
    mg-logits|mg-decode|mg-prefill)
        need_model
        devs=${MG_DEVICES:-$(python3 -c 'from kvflash_ggml import _core; print(",".join(f"cuda{i}" for i in range(len(_core.gpu_devices()))))')}
        ts=${MG_TS:-$(echo "$devs" | sed 's/[^,]*/1/g')}
        nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv 2>&1 | tee -a "$OUT/session.log"
        log "split over $devs, shares $ts, model $MODEL ($(du -h "$MODEL" | cut -f1))"
        case $phase in
        mg-logits)
            python3 experiments/split_logits.py --model "$MODEL" --devices "$devs" --tensor-split "$ts" \
                ${MG_NO_CPU:+--no-cpu} 2>&1 | tee -a "$OUT/mg.log" ;;
        mg-decode)
            python3 -m kvflash_ggml bench decode --model "$MODEL" --devices "$devs" --tensor-split "$ts" \
                --depths "${MG_DEPTHS:-0,4096,131072}" --full-up-to "${MG_FULL_UP_TO:-4096}" --kvflash "$POOL" \
                --n-gen "$N_GEN" --reps "${MG_REPS:-3}" ${PREFILL:+--prefill "$PREFILL"} \
                --json "$OUT/mg-decode-$(basename "$MODEL" .gguf).json" --plot "" 2>&1 | tee -a "$OUT/mg.log" ;;
        mg-prefill)
            python3 -m kvflash_ggml bench prefill --model "$MODEL" --devices "$devs" --tensor-split "$ts" \
                --lengths "${MG_PREFILL_LENGTHS:-32768}" --modes exact --kvflash "$POOL" --reps "${PREFILL_REPS:-1}" \
                --json "$OUT/mg-prefill-$(basename "$MODEL" .gguf).json" 2>&1 | tee -a "$OUT/mg.log" ;;
        esac ;;
    split)
        need_model
        server=$(python3 -c 'from kvflash_ggml.rpc import find_rpc_server; print(find_rpc_server() or "")')
        port=$(python3 -c 'from kvflash_ggml.rpc import free_port; print(free_port())')
        "$server" -H 127.0.0.1 -p "$port" -d CPU > "$OUT/rpc-server.log" 2>&1 &
        rpc_pid=$!
        sleep 3
        python3 -m kvflash_ggml bench decode --model "$MODEL" --rpc "127.0.0.1:$port" --tensor-split "${SPLIT_TS:-1,1}" \
            --depths "${SPLIT_DEPTHS:-0,4096}" --kvflash "$POOL" --n-gen "${N_GEN:-32}" --reps "${SPLIT_REPS:-3}" \
            --json "$OUT/split.json" --plot "" 2>&1 | tee -a "$OUT/split.log"
        kill "$rpc_pid" ;;
    prefill)
        need_model
        python3 -m kvflash_ggml bench prefill --model "$MODEL" --lengths "${PREFILL_LENGTHS:-4096,32768,131072}" \
            --kvflash "$POOL" --reps "${PREFILL_REPS:-2}" --json "$OUT/prefill.json" 2>&1 | tee -a "$OUT/bench.log" ;;
    sparse)
        need_model
        $KVF_CMD bench prefill --model "$MODEL" --lengths "${SPARSE_LENGTHS:-32768,262144}" \
            --modes "${SPARSE_MODES:-exact,sparse}" --kvflash "$POOL" --reps "${PREFILL_REPS:-1}" ${SPARSE_ARGS:-} \
            --json "$OUT/prefill-sparse${SPARSE_TAG:-}.json" 2>&1 | tee -a "$OUT/sparse.log" ;;
    sparse-1m)
        need_model
        python3 -m kvflash_ggml bench prefill --model "$MODEL" --lengths 1048576 --modes sparse --kvflash "$POOL" \
            --kv-type "${SPARSE_1M_KV:-q8_0}" --reps 1 --no-llama-bench --json "$OUT/prefill-1m.json" \
            2>&1 | tee -a "$OUT/sparse.log" ;;
    decode-1m)
        decode_bench decode-1m 4096,1048576 "" --kv-type q8_0 --prefill pooled --full-up-to 0 --n-gen 64 --reps 3 \
            --no-llama-bench ;;
    resend)
        need_model
        python3 experiments/resend_latency.py --model "$MODEL" --lengths "${RESEND_LENGTHS:-32768,131072}" \
            --pool "$POOL" 2>&1 | tee -a "$OUT/resend.log" ;;
    order)
        need_model
        python3 experiments/profile_decode.py --model "$MODEL" --runs pooled:8192 --pool "$POOL" --compare-order 2>&1 | tee -a "$OUT/extra.log" ;;
    fit)
        need_model
        python3 experiments/fit_check.py "$MODEL" --n-ctx "${FIT_CTX:-32768}" --slots "${FIT_SLOTS:-1,8}" 2>&1 | tee -a "$OUT/fit.log" ;;
    serve)
        need_model
        for ctx in ${SERVE_CONTEXTS:-4096 32768}; do
            python3 -m kvflash_ggml bench serve --model "$MODEL" --streams "${SERVE_STREAMS:-1,4,8}" --context "$ctx" \
                --gen "${SERVE_GEN:-512}" --kvflash "${SERVE_POOL:-auto}" --ours-flags "--backend cuda ${SERVE_FLAGS:-}" \
                ${LLAMA_SERVER:+--llama-server "$LLAMA_SERVER"} --logs "$OUT/serve${SERVE_TAG:-}" \
                --out "$OUT/serve${SERVE_TAG:-}-$ctx.json" ${SERVE_ARGS:-} 2>&1 | tee -a "$OUT/serve.log"
        done ;;
    serve-profile)
        need_model
        python3 experiments/serve_batching.py --model "$MODEL" --backend cuda --batched-only --profile \
            --slots "${SERVE_STREAMS:-8}" --prompt "${SERVE_CONTEXTS:-32768}" --gen "${SERVE_GEN:-512}" \
            --pool "${SERVE_POOL:-4096}" --configs "${PROFILE_CONFIGS:-lru,quest}" ${PROFILE_ARGS:-} 2>&1 | tee -a "$OUT/serve-profile.log" ;;
    batched-profile)
        need_model
        python3 experiments/profile_batched.py --model "$MODEL" --slots "${SERVE_STREAMS:-8}" \
            --context "${PROFILE_CONTEXT:-8192}" --pool "${SERVE_POOL:-4096}" ${BATCHED_ARGS:-} 2>&1 | tee -a "$OUT/batched-profile${SERVE_TAG:-}.log" ;;
    spec)
        need_model
        [ -f /tmp/l1b.gguf ] || python3 -m kvflash_ggml.testing.random_gguf /tmp/l1b.gguf --shape llama3.2-1b --type q4_0 2>&1 | tee -a "$OUT/session.log"
        python3 -m kvflash_ggml bench spec --model "$MODEL" --task random --contexts "${SPEC_CONTEXTS:-4096,131072}" \
            --draft "$MODEL,/tmp/l1b.gguf" --kvflash "$POOL" --n-gen "${SPEC_GEN:-64}" --reps "${SPEC_REPS:-2}" \
            --json "$OUT/spec.json" 2>&1 | tee -a "$OUT/bench.log"
        # The same shape as an echo model (it predicts the token it was given, with certainty) drafting itself:
        # every draft kept, whatever the kernels' summation order: the machinery's upper bound.
        echo_model=/tmp/echo-${SHAPE:-llama3-8b}.gguf
        [ -f "$echo_model" ] || python3 -m kvflash_ggml.testing.random_gguf "$echo_model" --shape "${SHAPE:-llama3-8b}" --type q4_0 --echo 2>&1 | tee -a "$OUT/session.log"
        python3 -m kvflash_ggml bench spec --model "$echo_model" --task random --contexts "${SPEC_CONTEXTS:-4096,131072}" \
            --draft "$echo_model" --kvflash "$POOL" --n-gen "${SPEC_GEN:-64}" --reps "${SPEC_REPS:-2}" \
            --json "$OUT/spec-echo.json" 2>&1 | tee -a "$OUT/bench.log" ;;
    budget)
        BM=${BUDGET_MODEL:-/tmp/q35-27b.gguf}
        [ -f "$BM" ] || python3 -m kvflash_ggml.testing.random_gguf "$BM" --shape qwen35-27b --type q4_0 2>&1 | tee -a "$OUT/session.log"
        nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee -a "$OUT/budget.log"
        # --full-up-to 0: no full-cache rows (it does not fit the budget at these depths; the bench says so if asked)
        python3 -m kvflash_ggml bench decode --model "$BM" --kvflash auto --max-device-memory "${BUDGET:-24G}" \
            --depths "${BUDGET_DEPTHS:-65536,131072,262144}" --full-up-to 0 --prefill "${PREFILL:-pooled}" \
            --n-gen "$N_GEN" --reps "${BUDGET_REPS:-3}" --llama-fit-steps "${BUDGET_FIT_STEPS:-3}" \
            --json "$OUT/budget.json" --plot "" 2>&1 | tee -a "$OUT/budget.log" ;;
    budget-bg)
        rm -rf /tmp/kvf-budget && mkdir -p /tmp/kvf-budget
        OUT=/tmp/kvf-budget setsid nohup bash -c "bash '$PWD/experiments/gpu_session.sh' budget; touch /tmp/kvf-budget/ENDED" \
            > /tmp/kvf-budget/run.log 2>&1 < /dev/null &
        log "budget: running in the background (pid $!), its output in /tmp/kvf-budget: collect with budget-collect" ;;
    budget-collect)
        for _ in $(seq "${COLLECT_S:-540}"); do [ -f /tmp/kvf-budget/ENDED ] && break; sleep 1; done
        [ -f /tmp/kvf-budget/ENDED ] && log "budget: the background run has ended" || log "budget: still running"
        mkdir -p "$OUT/budget-run" && cp -r /tmp/kvf-budget/. "$OUT/budget-run/"
        tail -30 /tmp/kvf-budget/budget.log 2>/dev/null ;;
    profile)
        need_model
        python3 experiments/profile_decode.py --model "$MODEL" --pool "$POOL" --steps 64 \
            --runs full:0,pooled:0,full:4096,pooled:4096,pooled:8192 2>&1 | tee -a "$OUT/extra.log"
        python3 experiments/profile_decode.py --model "$MODEL" --pool "$POOL" --steps 16 --runs full:0,pooled:8192 \
            --count-logs 2>&1 | tee -a "$OUT/extra.log"
        ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --print-summary per-kernel \
            python3 experiments/profile_decode.py --model "$MODEL" --pool "$POOL" --runs full:0 --steps 3 --cuda-profiler \
            > "$OUT/ncu-ours.log" 2>&1; tail -3 "$OUT/ncu-ours.log"
        lb=$(python3 -c 'from kvflash_ggml.bench.reference import find_llama_bench; print(find_llama_bench(None))')
        ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
            "$lb" -m "$MODEL" -p 0 -n 2 -r 1 -ngl 99 -fa 1 > "$OUT/ncu-llama.log" 2>&1; tail -3 "$OUT/ncu-llama.log" ;;
    prefill-profile)
        # GGML_SCHED_DEBUG_REALLOC=1: ggml aborts if a step graph makes it reserve again (each such step waited for
        # the device: R89); then where the GPU idles and what the host waits in, ours beside libllama
        need_model
        pairs=${PROFILE_PAIRS:-}
        if [ -z "$pairs" ]; then
            for block_mib in ${ATTN_BLOCK_MIB:-0}; do
                for per_call in ${BLOCKS_PER_CALL:-0}; do pairs="$pairs $block_mib:$per_call"; done
            done
        fi
        for len in ${PROFILE_LENGTHS:-32768}; do
            for pair in $pairs; do
                GGML_SCHED_DEBUG_REALLOC=1 python3 experiments/profile_prefill.py --model "$MODEL" --length "$len" \
                    --modes exact --pool "$POOL" --exact-batch "${EXACT_BATCH:-1024}" --attention-block-mib "${pair%%:*}" \
                    --blocks-per-call "${pair##*:}" --ffn-part-rows "${FFN_PART_ROWS:-0}" --top "${PROFILE_TOP:-6}" 2>&1 | \
                    tee -a "$OUT/prefill-profile.log"
            done
            python3 experiments/profile_prefill.py --model "$MODEL" --length "$len" --modes llama --top "${PROFILE_TOP:-6}" 2>&1 | \
                tee -a "$OUT/prefill-profile.log"
        done ;;
    prefill-memory)
        # the driver's view of the exact prefill's memory stage by stage, with and without the bench's warm-up prompt
        need_model
        for len in ${MEMORY_LENGTHS:-32768}; do
            python3 experiments/prefill_memory.py --model "$MODEL" --length "$len" --pool "$POOL" 2>&1 | \
                tee -a "$OUT/prefill-memory.log"
        done ;;
    niah)
        SMOL=${SMOL:-/tmp/smollm2.gguf}
        python3 -m kvflash_ggml bench niah --model "$SMOL" --lengths 8192 --kvflash 512,1024 \
            --policies "${NIAH_POLICIES:-lru,qk,quest,drafter}" --drafter-model "$SMOL" --cases "${NIAH_CASES:-20}" \
            --prefill-reselect "${PREFILL_RESELECT:-default}" --prefill "${PREFILL:-default}" ${NIAH_ARGS:-} --threads 16 \
            --json "$OUT/niah.json" --plot "" 2>"$OUT/niah.err" | tee -a "$OUT/retrieval.log" ;;
    ruler)
        SMOL=${SMOL:-/tmp/smollm2.gguf}
        python3 -m kvflash_ggml bench ruler --model "$SMOL" --lengths 8192 --kvflash 1024 \
            --policies "${RULER_POLICIES:-lru,qk,quest,drafter}" --drafter-model "$SMOL" --cases "${RULER_CASES:-10}" \
            --tasks "${RULER_TASKS:-niah,multikey,multivalue,multiquery,vt,cwe}" --prefill "${PREFILL:-default}" \
            ${RULER_ARGS:-} --threads 16 --json "$OUT/ruler.json" --plot "" 2>"$OUT/ruler.err" | tee -a "$OUT/retrieval.log" ;;
    *) log "unknown phase $phase"; exit 2 ;;
    esac
done
log "done"
