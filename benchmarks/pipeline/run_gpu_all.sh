#!/usr/bin/env bash
# Every GPU measurement in one command, for a machine with 2 or 4 GPUs (NCCL), from the repository
# root:
#
#     bash benchmarks/pipeline/run_gpu_all.sh            # 2 GPUs; results under $OUT (default ./out/gpu)
#     NPROC=4 bash benchmarks/pipeline/run_gpu_all.sh    # 4 GPUs (same model: 4 or 8 stages of 16 layers)
#
# 1. gpu_equivalence.py  (torchrun × NPROC): float64 gradients vs unsplit + a 30-step training run
# 2. split_backward_gpu.py (one GPU): time(I) + time(W) vs time(B) for one block
# 3. gpu_pipeline.py     (torchrun × NPROC): pipetrain vs torch.distributed.pipelining
# Each section has its own timeout (the whole run stays under ~7.5 minutes) and its own log under
# $OUT; the summary at the end repeats each section's table. Needs no network and no installs:
# the package is imported from this checkout (PYTHONPATH). Set NPROC to use another GPU count;
# EQ_ARGS, SPLIT_ARGS, BENCH_ARGS add arguments to a section (e.g. a CPU smoke run:
#   NPROC=4 PYTHON=.venv/bin/python SPLIT_ARGS="--hidden 256 --heads 4 --seq 128 --reps 5" \
#   bash benchmarks/pipeline/run_gpu_all.sh   — without CUDA the scripts fall back to gloo and small presets).
# The equivalence check runs max(8, 2 x NPROC) micro-batches (DualPipeV needs >= 2 x ranks).
set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH="$(cd "$(dirname "$0")/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}"
cd "$(dirname "$0")/../.."
OUT="${OUT:-./out/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
NPROC="${NPROC:-2}"
EQ_S="${EQ_S:-80}"
SPLIT_S="${SPLIT_S:-60}"
BENCH_S="${BENCH_S:-300}"
BUDGET_S="${BUDGET_S:-$((BENCH_S - 65))}"   # gpu_pipeline skips configurations past this
EQ_MB=$((2 * NPROC > 8 ? 2 * NPROC : 8))
start=$(date +%s)

section() {  # name, timeout (s), log file, command...
    local name=$1 limit=$2 logfile=$3
    shift 3
    local t0=$(date +%s)
    echo "=== $name (timeout ${limit}s) ==="
    timeout -k 10 "$limit" "$@" >"$logfile" 2>&1
    local rc=$?
    local t1=$(date +%s)
    echo "=== $name: exit $rc after $((t1 - t0))s (total $((t1 - start))s); log $logfile ==="
    [ "$rc" = 124 ] && echo "!!! $name timed out after ${limit}s"
    return 0
}

"$PY" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
EOF

TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
section equivalence "$EQ_S" "$OUT/equivalence.log" \
    "${TORCHRUN[@]}" benchmarks/runtime/gpu_equivalence.py --out "$OUT" --microbatches "$EQ_MB" \
    ${EQ_ARGS:-}
section split-backward "$SPLIT_S" "$OUT/split_backward.log" \
    "$PY" benchmarks/runtime/split_backward_gpu.py --out "$OUT" ${SPLIT_ARGS:-}
section pipeline "$BENCH_S" "$OUT/pipeline.log" \
    "${TORCHRUN[@]}" benchmarks/pipeline/gpu_pipeline.py --out "$OUT" --budget-s "$BUDGET_S" \
    ${BENCH_ARGS:-}

echo
echo "################ summary ($(($(date +%s) - start))s in all; files in $OUT) ################"
# the tables each script prints last; on failure, the log's tail instead
summarise() {  # log file, marker of the table
    if grep -q "$2" "$1" 2>/dev/null; then
        sed -n "/$2/,\$p" "$1" | grep -v "^\[W\|^W[0-9]\|Warning\|warn(" | head -c 6000
    else
        echo "(no table in $1; its last lines:)"
        tail -n 25 "$1" 2>/dev/null | cut -c1-400
    fi
}
summarise "$OUT/equivalence.log" "^## equivalence"
echo
summarise "$OUT/split_backward.log" "^## split backward"
echo
grep "ERROR\|skipped" "$OUT/pipeline.log" 2>/dev/null | cut -c1-300 | head -n 20
summarise "$OUT/pipeline.log" "^## gpu_pipeline"
ls -la "$OUT"
