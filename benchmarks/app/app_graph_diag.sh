#!/bin/bash
# Why `pipetrain train --cuda-graph` stalls after its warm-up steps: short runs, each process's
# Python stacks dumped DUMP seconds in (a sitecustomize on the path), whole logs under $OUT.
#     OUT=... bash benchmarks/app/app_graph_diag.sh
set -u
: "${OUT:?set OUT}"
DUMP=${DUMP:-40} LIMIT=${LIMIT:-60}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
mkdir -p /tmp/diag "$OUT"
cat > /tmp/diag/sitecustomize.py <<'PY'
import faulthandler, os, sys
if os.environ.get("PT_DUMP_AFTER"):
    faulthandler.dump_traceback_later(float(os.environ["PT_DUMP_AFTER"]), exit=False, file=sys.stderr)
PY
export PYTHONPATH=/tmp/diag:/tmp/site:. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PT_DUMP_AFTER=$DUMP
echo "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-unset}" | tee "$OUT/summary.txt"
run() {  # name args...
  local name=$1
  shift
  timeout -k 5 "$LIMIT" python3 -m pipetrain train --device cuda --ranks 2 --steps 5 "$@" \
    > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(date -u +%T)" | tee -a "$OUT/summary.txt"
}
for case in ${CASES:-llama-zbv gpt-zbv llama-1f1b llama-zbv-fp32}; do
  case $case in
    llama-zbv) run "$case" --model llama -s zbv --dtype bfloat16 --cuda-graph ;;
    gpt-zbv) run "$case" --model gpt -s zbv --dtype bfloat16 --cuda-graph ;;
    llama-1f1b) run "$case" --model llama -s 1f1b --dtype bfloat16 --cuda-graph ;;
    llama-zbv-fp32) run "$case" --model llama -s zbv --cuda-graph ;;
  esac
done
tar czf "$OUT/logs.tar.gz" -C "$OUT" --exclude logs.tar.gz .
