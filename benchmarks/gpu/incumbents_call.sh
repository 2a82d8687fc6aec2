#!/bin/bash
# One GPU call for docs/incumbents.md: benchmarks/gpu/incumbents.py in four parts, the
# most needed first, inside one wall budget (TOTAL seconds, default 540; 4 GPUs):
#   p1-wide4    the wide/long shape at 4 ranks, 16 and 8 micro-batches, every library and
#               family (interleaved-zb last)                       budget 175 s, timeout 215 s
#   p2-prof4    one torch.profiler step each of Megatron's and pipetrain's interleaved 1F1B
#               (GPT, 4 ranks, 16 micro-batches), with the per-rank device-time summary
#                                                                  budget  45 s, timeout 100 s
#   p2e-exact4  float64 exactness of pipetrain on NCCL against unsplit training (gpu_equivalence.py:
#               1f1b, interleaved-1f1b, zbv, dualpipev+overlap; 10 training steps) timeout 60 s
#   p3-blocks2  the block stack at 2 ranks, 16 and 8 micro-batches budget 150 s, timeout 180 s
#   p4-wide2    the wide shape at 2 ranks (8 micro-batches first, 4 timed steps), with whatever
#               time is left (about 90 s: the 8-micro-batch 1F1B and interleaved rows)
# PLAN=leads2, PLAN=confirm2 and PLAN=full2 run other lists on 2 GPUs instead (receives posted late against
# where lowering puts them, and Megatron-Core): see their parts below.
# Each part's harness stops starting rows at its budget (--budget-s: a row starts only if the
# longest row so far still fits); the timeout adds start-up (~15 s) and one overrunning row.
# Run from a folder holding pipetrain/, benchmarks/ and .whl/ (the carried wheels of
# megatron-core, deepspeed and their needs; the GPU machine has no internet), with $OUT set:
#     cd .dev/incumb && TOTAL=540 bash benchmarks/gpu/incumbents_call.sh
# What comes back (the device tool returns at most 8 files): $OUT/env.txt, $OUT/summary.md (every
# part's tables and target lines so far), $OUT/results.tar.gz (each part's incumbents.json and
# log) and $OUT/traces-<lib>.tar (the Chrome traces), all rewritten after each part, so a part cut
# off by its timeout still leaves the rows it finished.
# CPU check of the plumbing (gloo, tiny shapes):
#     OUT=/tmp/o WIDE=wide-tiny GPT=gpt-tiny BLOCKS=blocks-tiny NPROC4=2 \
#         PYTHON=.venv/bin/python bash benchmarks/gpu/incumbents_call.sh
set -u
: "${OUT:?set OUT to the folder for results}"
TOTAL=${TOTAL:-540}
PYTHON=${PYTHON:-python3}
WIDE=${WIDE:-wide} GPT=${GPT:-gpt} BLOCKS=${BLOCKS:-blocks}
NPROC4=${NPROC4:-4}  # the "4-rank" parts (2 on a CPU check, or on a 2-GPU machine: then p4 is p1)
WORK=$(mktemp -d /tmp/incumbents.XXXXXX)
SCRIPT=benchmarks/gpu/incumbents.py

if [ -d .whl ]; then
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
  date -u
  nvidia-smi -L && nvidia-smi topo -m
  $PYTHON - <<'EOF'
import importlib.metadata as m
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
for d in ("megatron-core", "deepspeed", "pydantic", "triton"):
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        print(d, "absent")
EOF
  git log -1 --format='commit %H %s' 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
tail -6 "$OUT/env.txt"

pack() {  # everything so far into $OUT (few files; each rewritten whole)
  local jsons
  jsons=$(ls "$WORK"/*/incumbents.json 2>/dev/null)
  # shellcheck disable=SC2086
  [ -n "$jsons" ] && $PYTHON $SCRIPT --report $jsons > "$OUT/summary.md" 2>&1
  tar czf "$OUT/results.tar.gz" -C "$WORK" --exclude '*.json.gz' .
  for lib in megatron pipetrain torch deepspeed; do
    local traces
    traces=$(cd "$WORK" && ls ./*/trace-*-"$lib"-r*.json.gz 2>/dev/null)
    # shellcheck disable=SC2086
    [ -n "$traces" ] && tar cf "$OUT/traces-$lib.tar" -C "$WORK" $traces
  done
}

part() {  # name nproc budget-s limit-s harness-args...: run one part if it still fits TOTAL
  local name=$1 nproc=$2 budget=$3 limit=$4
  shift 4
  local left=$((TOTAL - SECONDS - 10))  # 10 s to pack at the end
  if [ "$left" -lt 45 ]; then
    echo "== $name skipped: ${left}s left"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  [ "$budget" -gt $((limit - 30)) ] && budget=$((limit - 30))  # startup + the last row
  echo "== $name: budget ${budget}s, timeout ${limit}s, at ${SECONDS}s"
  timeout -k 10 "$limit" $PYTHON -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    $SCRIPT --out "$WORK/$name" --budget-s "$budget" "$@" > "$WORK/$name.log" 2>&1
  echo "== $name rc=$? at ${SECONDS}s"
  grep -E '^\[ *[0-9.]+s\]' "$WORK/$name.log" | grep -v ': ERROR' | tail -40
  pack
}

exact() {  # name nproc limit-s: float64 exactness on NCCL of the runtime measured here
  local name=$1 nproc=$2 limit=$3
  local left=$((TOTAL - SECONDS - 10))
  if [ "$left" -lt "$limit" ]; then
    echo "== $name skipped: ${left}s left"
    return
  fi
  echo "== $name: timeout ${limit}s, at ${SECONDS}s"
  timeout -k 10 "$limit" $PYTHON -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    benchmarks/gpu/gpu_equivalence.py --schedules 1f1b,interleaved-1f1b,zbv,dualpipev+overlap \
    --train-steps 10 --out "$WORK/$name" > "$WORK/$name.log" 2>&1
  echo "== $name rc=$? at ${SECONDS}s"
  grep -A8 '^## equivalence' "$WORK/$name.log"
  pack
}

ALL=1f1b,interleaved-1f1b,zbv,dualpipev,interleaved-zb
if [ "${PLAN:-issue13}" = leads2 ]; then
  # PLAN=leads2 (2 GPUs): receives posted late (Pipeline(receive_lead=0|1), rows pipetrain-leadN)
  # against pipetrain's default and Megatron-Core, then the 8-micro-batch V rows
  L="--receive-leads 0,1 --torch-schedules none"
  part q1-gpt16 2 120 150 --shapes "$GPT" --microbatches 16 --schedules interleaved-1f1b,1f1b \
    --libraries megatron,megatron-nosync $L
  part q2-blocks16 2 120 150 --shapes "$BLOCKS" --microbatches 16 \
    --schedules interleaved-1f1b,zbv,dualpipev --libraries megatron $L
  part q3-v8 2 110 140 --shapes "$GPT,$BLOCKS" --microbatches 8 \
    --schedules zbv,dualpipev,interleaved-1f1b --libraries megatron $L
  part q4-prof 2 40 90 --shapes "$GPT" --microbatches 16 --schedules interleaved-1f1b \
    --libraries none --torch-schedules none --receive-leads 1 --timeline-steps 0 \
    --profile pipetrain-lead1:interleaved-1f1b,pipetrain:interleaved-1f1b
elif [ "${PLAN:-issue13}" = confirm2 ]; then
  # PLAN=confirm2 (2 GPUs): the default receive_lead=1 against receives where lowering puts
  # them (rows pipetrain-leadnone) and Megatron-Core: the wide shape, then the 8- and
  # 16-micro-batch interleaved rows of the GPT and the block stack again
  L="--receive-leads none --torch-schedules none --libraries megatron"
  part c1-wide16 2 150 180 --shapes "$WIDE" --microbatches 16 \
    --schedules interleaved-1f1b,zbv,dualpipev,1f1b $L
  part c2-wide8 2 100 130 --shapes "$WIDE" --microbatches 8 \
    --schedules interleaved-1f1b,zbv,dualpipev $L
  part c3-il8 2 90 120 --shapes "$BLOCKS,$GPT" --microbatches 8 --schedules interleaved-1f1b $L
  part c4-il16 2 100 130 --shapes "$BLOCKS,$GPT" --microbatches 16 --schedules interleaved-1f1b \
    --steps 8 $L
elif [ "${PLAN:-issue13}" = full2 ]; then
  # PLAN=full2 (2 GPUs): one shape's whole table (SHAPE, default the GPT: every library and
  # family, 16 and 8 micro-batches)
  part "g2-${SHAPE:-$GPT}" 2 250 290 --shapes "${SHAPE:-$GPT}" --microbatches 16,8 --schedules $ALL
else
part p1-wide4 "$NPROC4" 175 215 --shapes "$WIDE" --microbatches 16,8 --schedules $ALL
part p2-prof4 "$NPROC4" 45 100 --shapes "$GPT" --microbatches 16 --schedules interleaved-1f1b \
  --libraries megatron --torch-schedules none --timeline-steps 0 \
  --profile megatron:interleaved-1f1b,pipetrain:interleaved-1f1b
exact p2e-exact4 "$NPROC4" 60
part p3-blocks2 2 150 180 --shapes "$BLOCKS" --microbatches 16,8 --schedules $ALL
left=$((TOTAL - SECONDS - 10))
[ "$NPROC4" = 2 ] || part p4-wide2 2 $((left - 30)) "$left" --shapes "$WIDE" --microbatches 8,16 --steps 4 --schedules $ALL
fi
echo "== done at ${SECONDS}s (TOTAL ${TOTAL}s)"
cat "$OUT/summary.md" 2>/dev/null | grep -v '^$' | head -150
ls -la "$OUT"
rm -rf "$WORK"
