#!/bin/bash
# One GPU call for the compile and float8 targets (docs/benchmarks.md, "torch.compile and float8
# under the pipeline"): per preset, LAUNCHES launches of compile_float8_gpu.py's unsplit part (GPU
# 0 alone) and pipeline part (2 GPUs, SCHEDULE), the variants' order rotated per launch, every
# first step compiling from scratch; then compile_float8_report.py pools the launches into the
# targets with 95% intervals ($OUT/summary.md, rewritten after each launch). Run from the
# repository root with .whl/ holding the torchao wheel:
#     OUT=... PRESETS=h2048,h4096 LAUNCHES=3 bash benchmarks/runtime/compile_float8_call.sh
# SUFFIX=/precompile runs the pipeline's variants with Pipeline(precompile=True) (the report
# shows them as their own split).
set -u
: "${OUT:?set OUT}"
PRESETS=${PRESETS:-h2048} LAUNCHES=${LAUNCHES:-3} SCHEDULE=${SCHEDULE:-zbv} STEPS=${STEPS:-20}
LIMIT=${LIMIT:-150}  # seconds a part may take (a stalled first step prints stacks before)
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING=false
S=benchmarks/runtime/compile_float8_gpu.py
ORDER=(eager compile compile+float8)
mkdir -p "$OUT"
nvidia-smi -L > "$OUT/env.txt"
for preset in ${PRESETS//,/ }; do
  for ((launch = 0; launch < LAUNCHES; launch++)); do
    k=$((launch % 3))
    variants=$(IFS=,; echo "${ORDER[*]:k} ${ORDER[*]:0:k}" | tr ' ' ',' | sed 's/,$//')
    echo "== $preset launch $launch ($variants) $(date -u +%T)"
    CUDA_VISIBLE_DEVICES=0 timeout -k 5 "$LIMIT" python3 $S --part unsplit --preset "$preset" \
      --launch "$launch" --variants "$variants" --steps "$STEPS" --stall-dump-s $((LIMIT - 20)) \
      --out "$OUT" >> "$OUT/log.txt" 2>&1
    echo "   unsplit rc=$?"
    timeout -k 5 "$LIMIT" torchrun --nproc-per-node 2 $S --part pipeline --preset "$preset" \
      --schedule "$SCHEDULE" --launch "$launch" --steps "$STEPS" \
      --variants "$(echo "$variants" | sed "s|,|${SUFFIX:-},|g; s|\$|${SUFFIX:-}|")" \
      --stall-dump-s $((LIMIT - 20)) --out "$OUT" >> "$OUT/log.txt" 2>&1
    echo "   pipeline rc=$?"
    python3 benchmarks/runtime/compile_float8_report.py "$OUT"/compile_float8-*.jsonl \
      > "$OUT/summary.md" 2>&1
  done
done
cat "$OUT/summary.md"
