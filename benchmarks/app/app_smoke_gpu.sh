#!/bin/bash
# `pipetrain demo` and `pipetrain train` on 2 GPUs as a user runs them (device auto picks the
# GPUs; eager and with --cuda-graph), each run's whole output kept: $OUT/<name>.log, and a line per run in
# $OUT/summary.txt (return code, the first error lines). PYTHONFAULTHANDLER makes a worker that
# dies by a signal print its stacks; a run still going 15 s before its limit prints them too.
# Run from the repository root with .whl/ holding a transformers wheel (the demo's Llama).
#     OUT=... bash benchmarks/app/app_smoke_gpu.sh
set -u
: "${OUT:?set OUT}"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
# every process dumps its Python stacks 15 s before its run's limit (a sitecustomize on the path)
mkdir -p /tmp/smoke-site "$OUT"
cat > /tmp/smoke-site/sitecustomize.py <<'PY'
import faulthandler, os, sys
if os.environ.get("PT_DUMP_AFTER"):
    faulthandler.dump_traceback_later(float(os.environ["PT_DUMP_AFTER"]), exit=False, file=sys.stderr)
PY
export PYTHONPATH=/tmp/smoke-site:/tmp/site:. PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 NCCL_NVLS_ENABLE=0
run() {  # name limit-s args...
  local name=$1 limit=$2
  shift 2
  PT_DUMP_AFTER=$((limit - 15)) timeout -k 5 "$limit" python3 -m pipetrain "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(date -u +%T)" | tee -a "$OUT/summary.txt"
  grep -n -m 8 -E "Error|error:|Traceback" "$OUT/$name.log" | cut -c1-300 | tee -a "$OUT/summary.txt"
}
nvidia-smi -L | tee "$OUT/summary.txt"
run train-default 90 train --device cuda --steps 20
run train-zbv-bf16 90 train --device cuda --ranks 2 --schedule zbv --dtype bfloat16 --steps 20
run train-zbv-bf16-graph 90 train --device cuda --ranks 2 --schedule zbv --dtype bfloat16 \
  --steps 20 --cuda-graph
run train-gpt-graph 90 train --device cuda --ranks 2 --model gpt --schedule zbv --dtype bfloat16 \
  --steps 20 --cuda-graph
run train-gpt-compile 150 train --device cuda --ranks 2 --model gpt --schedule zbv --dtype bfloat16 \
  --steps 20 --compile
run train-gpt-compile-graph 150 train --device cuda --ranks 2 --model gpt --schedule zbv \
  --dtype bfloat16 --steps 20 --compile --cuda-graph
run train-gpt-float8-compile 150 train --device cuda --ranks 2 --model gpt --schedule zbv \
  --dtype bfloat16 --steps 20 --float8 --compile
run train-tp2 90 train --device cuda --ranks 1 --tp 2 --dtype bfloat16 --steps 20
run train-dp2 90 train --device cuda --ranks 1 --dp 2 --dtype bfloat16 --steps 20
run demo 150 demo --out "$OUT/demo-out"
