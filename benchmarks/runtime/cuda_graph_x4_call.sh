#!/bin/bash
# One 4-GPU call: does a captured step run on 4 ranks, and with expandable segments? Runs, each
# under its own timeout and with every rank's stacks dumped before it (a hang shows where it waits):
#   probe4      NCCL sends/receives on two groups captured and replayed, 4 ranks, alone;
#   exact4-zbv  the float64 graph-vs-eager check of benchmarks/runtime/cuda_graph_gpu.py, ZBV, 4 ranks,
#               default allocator;
#   exact2-exp  the same on 2 ranks with expandable_segments:True;
#   exact4-exp  the same on 4 ranks with expandable_segments:True;
#   exact4-all  every other family on 4 ranks, default allocator;
#   speed4      eager vs graph on 4 ranks, both shapes, ZBV, DualPipeV and interleaved 1F1B.
# What comes back: $OUT/summary.txt (each run's return code and last lines) and $OUT/logs.tar.gz.
#     OUT=... bash benchmarks/runtime/cuda_graph_x4_call.sh
set -u
: "${OUT:?set OUT}"
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false
S=benchmarks/runtime/cuda_graph_gpu.py
mkdir -p "$OUT/logs"
step() {  # name timeout command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name $(date -u +%T)" | tee -a "$OUT/summary.txt"
  timeout -k 5 "$limit" "$@" --out "$OUT/logs/$name" > "$OUT/logs/$name.log" 2>&1
  echo "rc=$? $(date -u +%T)" | tee -a "$OUT/summary.txt"
  grep -E "probe:|exact |speed |Error|error" "$OUT/logs/$name.log" | tail -12 | cut -c1-400 \
    | tee -a "$OUT/summary.txt"
  tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs
}
nvidia-smi -L | tee -a "$OUT/summary.txt"
T4="torchrun --nproc-per-node 4"
T2="torchrun --nproc-per-node 2"
step probe4 50 $T4 $S --part probe --stacks-after 40
step exact4-zbv 100 $T4 $S --part exact --schedules zbv --stacks-after 85
CUDA_VISIBLE_DEVICES=0,1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  step exact2-exp 80 $T2 $S --part exact --schedules zbv --allow-expandable --stacks-after 65
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  step exact4-exp 80 $T4 $S --part exact --schedules zbv --allow-expandable \
  --stacks-after 65
step exact4-all 130 $T4 $S --part exact --stacks-after 115 \
  --schedules 1f1b,interleaved-1f1b,zb-h1,interleaved-zb,zbv+replayw,dualpipev,dualpipev+overlap
step speed4 150 $T4 $S --part speed --stacks-after 140 --rounds 2 --steps 15 \
  --speed-schedules zbv,dualpipev,interleaved-1f1b
