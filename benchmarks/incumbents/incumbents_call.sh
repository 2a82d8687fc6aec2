#!/bin/bash
# One GPU call for docs/incumbents.md: benchmarks/incumbents/incumbents.py in parts, the most needed
# first, inside one wall budget (TOTAL seconds, default 540). Each part is one launch (a
# separate torchrun; --launch K rotates the libraries' order); summary.md pools every launch
# with 95% intervals (incumbents_stats.py). PLAN picks the list:
#   issue21 (2 GPUs; issue 21, ~525 s): the GPT at 16 micro-batches, 1F1B and interleaved 1F1B:
#     pipetrain (defaults) and pipetrain-nodefer (plain autograd weight gradients: the
#     incumbents' kernels) against Megatron's 1F1B without batch sync and every interleaved
#     variant (launch 0: v = 2, 4, 8 × group p, 2p × warm-up/flush overlap on, off; launches 1
#     and 2: launch 0's two fastest), 20 timed steps a row; then the Llama-3-8B-like block stack
#     (8 layers, 8 micro-batches; pipetrain cut by its planner, Megatron by its
#     account-for-embedding/loss rule), one launch.
#   issue21-llama (2 GPUs): the Llama shape alone, three launches.
#   issue21-llama3 (2 GPUs, ~520 s): the Llama shape's 1F1B, interleaved and ZBV on the planner's
#     and on the incumbents' cut (pipetrain-samecut) beside Megatron's, three launches.
#   issue21-mgraph / issue21x4-mgraph (2 / 4 GPUs, ~520 s, ALLOC_CONF= TUNED=...): pipetrain's
#     CUDA-graph rows against Megatron-Core's own full-iteration graph, three launches;
#     SCHEDULES= a subset, LIMIT_GRAPH=1 also ZBV's limit as one CUDA graph (--limit-graph),
#     VARIANTS= pipetrain's variants (default graph; nodefer-graph,graph,nodefer: equal kernels).
#   issue21-equal / issue21x4-equal (2 / 4 GPUs, ~400 s, TUNED=...): the equal-kernel rows alone
#     (pipetrain, pipetrain-nodefer, Megatron's 1F1B and best interleaved), three launches.
#   issue21-equal-1f1b (2 GPUs, LAUNCHES=6, ~520 s): the 1F1B equal-kernel rows alone, no limits.
#   issue21-llama-v (2 GPUs, ~510 s): the Llama shape's ZBV and DualPipeV (planner's and
#     incumbents' cut, limits, DeepSpeed's DualPipeV engine), three launches.
#   issue21x4 (4 GPUs, ~530 s): the GPT at 16 and 8 micro-batches, 1F1B, interleaved, ZBV and
#     DualPipeV: pipetrain and pipetrain-nodefer, Megatron (1F1B without batch sync; launch 0
#     every interleaved variant, launches 1 and 2 its two fastest), the limit for ZBV/DualPipeV
#     efficiency; three launches, each 16 micro-batches first: launch 0 with Python's garbage
#     collector as it is (pauses recorded per step), launches 1 and 2 with it off (--gc manual).
#   issue21x4b (4 GPUs, ~510 s): what issue21x4 left: the 8-micro-batch rows (two launches) and
#     16 once more, Megatron's interleaved variants without warm-up/flush overlap (it hung).
#   issue21-best2 (2 GPUs, ~430 s): pipetrain's 1F1B, interleaved and ZBV beside Megatron's best
#     rows, three launches (TUNED= an earlier launch-0 file).
#   issue21-best2g (2 GPUs, ~420 s, ALLOC_CONF=): issue21-best2's interleaved and ZBV rows also as
#     CUDA graphs (pipetrain-graph) beside Megatron's best interleaved row, three launches.
#   issue21x4g (4 GPUs, ~520 s): the V rows and interleaved 1F1B eager and as CUDA graphs beside
#     their limits and Megatron's best interleaved row (TUNED=), 16 and 8 micro-batches, 3 launches (~430 s).
#   issue21x4-extra (4 GPUs, ~390 s): issue21-extra's GPT rows at 4 ranks, one launch each.
#   issue21-extra (2 GPUs): the rows those leave out: torch's ZB-H1, interleaved-ZB, ZBV and
#     DualPipeV, DeepSpeed (1F1B, bf16 optimizer, DualPipeV), Megatron 1F1B with batch sync.
#   (older) default: the 4-GPU list of issue 13; leads2, confirm2, full2 (2 GPUs): see below.
# Each part's harness stops starting rows at its budget (--budget-s: a row starts only if the
# longest row so far still fits); the timeout adds start-up (~20 s) and one overrunning row.
# ONLY=name1,name2 runs only those parts; TUNED=FILE gives launches 1 and 2 an earlier launch 0
# (its incumbents.json) to pick Megatron's fastest interleaved variants from, e.g. from a call
# that was cut off. STEPS overrides the timed steps (20). LAUNCHES (default 3) and FIRST_LAUNCH
# (default 0) set how many launches the three-launch plans run and where their numbering starts,
# so two calls' launches pool as one series (incumbents_stats.py over both folders). PREHEAT=S
# keeps the GPUs busy S seconds before each launch's first row (incumbents.py --preheat-s; inside
# the part's budget), so that the first row does not run on a cooler card than the others.
# Run from a folder holding pipetrain/, benchmarks/ and .whl/ (the carried wheels of
# megatron-core, deepspeed and their needs; the GPU machine has no internet), with $OUT set:
#     PLAN=issue21 TOTAL=540 bash benchmarks/incumbents/incumbents_call.sh
# What comes back (the device tool returns at most 8 files): $OUT/env.txt, $OUT/summary.md (the
# pooled tables, intervals and target lines so far), $OUT/clocks.md (each row's mean SM clock
# and power per GPU: incumbents_clocks.py), $OUT/results.tar.gz (each part's incumbents.json,
# log and SM clock samples) and $OUT/traces-<lib>.tar (Chrome traces), all rewritten after each
# part, so a part cut off by its timeout still leaves the rows it finished.
# CPU check of the plumbing (gloo, tiny shapes; WHEELS=none: use EXTRA_PATH's Megatron/DeepSpeed):
#     OUT=/tmp/o WIDE=wide-tiny GPT=gpt-tiny BLOCKS=blocks-tiny LLAMA=llama-tiny NPROC4=2 \
#         STEPS=3 WHEELS=none EXTRA_PATH=/tmp/incsite PYTHON=.venv/bin/python PLAN=issue21 \
#         bash benchmarks/incumbents/incumbents_call.sh
set -u
: "${OUT:?set OUT to the folder for results}"
TOTAL=${TOTAL:-540}
PYTHON=${PYTHON:-python3}
WIDE=${WIDE:-wide} GPT=${GPT:-gpt} BLOCKS=${BLOCKS:-blocks} LLAMA=${LLAMA:-llama}
LLAMA4=${LLAMA4:-llama-x4} STEPS=${STEPS:-20} ONLY=${ONLY:-} WHEELS=${WHEELS:-.whl}
NPROC4=${NPROC4:-4}  # the "4-rank" parts (2 on a CPU check, or on a 2-GPU machine: then p4 is p1)
WORK=$(mktemp -d /tmp/incumbents.XXXXXX)
SCRIPT=benchmarks/incumbents/incumbents.py

if [ -d "$WHEELS" ]; then
  $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 3
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
[ -n "${EXTRA_PATH:-}" ] && export PYTHONPATH=$PYTHONPATH:$EXTRA_PATH
export PYTHONUNBUFFERED=1
# one allocator and NCCL environment for every library (issue 21); NVLink multicast off
# ALLOC_CONF= (empty) keeps the default allocator: Pipeline(cuda_graph=True) refuses expandable
# segments (docs/runtime.md), so the pipetrain-graph rows need it
export PYTORCH_CUDA_ALLOC_CONF=${ALLOC_CONF-expandable_segments:True}
# the carried DeepSpeed wheel was built on a CPU box: name its accelerator rather than rely on
# detection
command -v nvidia-smi > /dev/null && export DS_ACCELERATOR=cuda
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

pack() {  # everything so far into $OUT (few files; each rewritten whole); $1: bootstrap draws
  local jsons
  jsons=$(ls "$WORK"/*/incumbents.json 2>/dev/null)
  # shellcheck disable=SC2086
  [ -n "$jsons" ] && INCUMBENTS_RESAMPLES=${1:-300} $PYTHON benchmarks/incumbents/incumbents_stats.py \
    $jsons > "$OUT/summary.md" 2>&1  # no torch import: a second or two
  $PYTHON benchmarks/incumbents/incumbents_clocks.py "$WORK" > "$OUT/clocks.md" 2>&1
  tar czf "$OUT/results.tar.gz" -C "$WORK" --exclude '*.json.gz' .
  for lib in megatron pipetrain torch deepspeed; do
    local traces
    traces=$(cd "$WORK" && ls ./*/trace-*-"$lib"*-r*.json.gz 2>/dev/null)
    # shellcheck disable=SC2086
    [ -n "$traces" ] && tar cf "$OUT/traces-$lib.tar" -C "$WORK" $traces
  done
}

part() {  # name nproc budget-s limit-s harness-args...: run one part if it still fits TOTAL
  local name=$1 nproc=$2 budget=$3 limit=$4
  shift 4
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then
    return
  fi
  local left=$((TOTAL - SECONDS - 10))  # 10 s to pack at the end
  if [ "$left" -lt 45 ]; then
    echo "== $name skipped: ${left}s left"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  [ "$budget" -gt $((limit - 30)) ] && budget=$((limit - 30))  # startup + the last row
  echo "== $name: budget ${budget}s, timeout ${limit}s, at ${SECONDS}s"
  # every rank prints its threads' stacks shortly before the timeout: a hang shows where it waits
  # the GPUs' SM clock, power and temperature every 200 ms while the part runs
  # (incumbents_clocks.py lines them up with each row's started/ended)
  local sampler=""
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu \
      --format=csv,noheader,nounits -lms 200 > "$WORK/$name.smi.csv" 2> /dev/null &
    sampler=$!
  fi
  STACKS_AFTER=$((limit - 12)) timeout -k 10 "$limit" $PYTHON -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    $SCRIPT --out "$WORK/$name" --budget-s "$budget" ${PREHEAT:+--preheat-s "$PREHEAT"} "$@" \
    > "$WORK/$name.log" 2>&1
  echo "== $name rc=$? at ${SECONDS}s"
  [ -n "$sampler" ] && kill "$sampler" 2> /dev/null
  grep -E '^\[ *[0-9.]+s\]' "$WORK/$name.log" | grep -v ': ERROR' | tail -40
  pack
}

launches3() {  # letter what nproc budget-s limit-s harness-args...: one part in LAUNCHES
  # launches (default 3), the libraries' order rotated, numbered from FIRST_LAUNCH (default 0;
  # a later call continues a pooled series: FIRST_LAUNCH=3 gives launches 3, 4, 5) — parts
  # <letter>1-<what>-l0, <letter>2-<what>-l1, ...
  local letter=$1 what=$2 nproc=$3 budget=$4 limit=$5
  shift 5
  local first=${FIRST_LAUNCH:-0} k
  for ((k = first; k < first + ${LAUNCHES:-3}; k++)); do
    part "$letter$((k + 1))-$what-l$k" "$nproc" "$budget" "$limit" --launch "$k" "$@"
  done
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
    benchmarks/runtime/gpu_equivalence.py --schedules 1f1b,interleaved-1f1b,zbv,dualpipev+overlap \
    --train-steps 10 --out "$WORK/$name" > "$WORK/$name.log" 2>&1
  echo "== $name rc=$? at ${SECONDS}s"
  grep -A8 '^## equivalence' "$WORK/$name.log"
  pack
}

ALL=1f1b,interleaved-1f1b,zbv,dualpipev,interleaved-zb
# issue 21's common settings: 20 timed steps, pipetrain with and without deferred weight
# gradients, no timeline step (diagnostics cost device time), torch rows only where asked
C21="--steps $STEPS --warmup 2 --timeline-steps 0 --variants nodefer --torch-schedules none"
tuned() {  # the launch-0 file launches 1 and 2 pick Megatron's fastest interleaved rows from
  echo "--libraries megatron-nosync,megatron-tuned --megatron-tuned-from ${TUNED:-$WORK/$1/incumbents.json}"
}
if [ "${PLAN:-issue13}" = issue21 ]; then
  G="--shapes $GPT --microbatches 16 --schedules 1f1b,interleaved-1f1b --limit-schedules none"
  part i1-gpt16-l0 2 170 210 --launch 0 $G $C21 --plan issue21 \
    --libraries megatron-nosync,megatron-sweep,megatron-gaf
  part i2-gpt16-l1 2 75 110 --launch 1 $G $C21 --plan issue21 $(tuned i1-gpt16-l0)
  part i3-gpt16-l2 2 75 110 --launch 2 $G $C21 --plan issue21 $(tuned i1-gpt16-l0)
  part i4-llama8-l0 2 125 165 --launch 0 --shapes "$LLAMA" --microbatches 8 \
    --schedules 1f1b,interleaved-1f1b --limit-schedules none $C21 --plan issue21 \
    --libraries megatron-nosync,megatron-sweep
elif [ "${PLAN:-issue13}" = issue21-llama ]; then
  L="--shapes $LLAMA --microbatches 8 --schedules 1f1b,interleaved-1f1b --limit-schedules none"
  part j1-llama8-l0 2 125 165 --launch 0 $L $C21 --plan issue21-llama \
    --libraries megatron-nosync,megatron-sweep,megatron-gaf
  part j2-llama8-l1 2 110 150 --launch 1 $L $C21 --plan issue21-llama $(tuned j1-llama8-l0)
  part j3-llama8-l2 2 110 150 --launch 2 $L $C21 --plan issue21-llama $(tuned j1-llama8-l0)
elif [ "${PLAN:-issue13}" = issue21-llama3 ]; then
  # 2 GPUs: the Llama shape, three launches: pipetrain's 1F1B, interleaved and ZBV on the
  # planner's cut and on the incumbents' cut (pipetrain-samecut: memory at equal layers per
  # rank), beside Megatron's 1F1B and its interleaved v = 5 variants (launch 0 sweeps them,
  # launches 1 and 2 run its fastest)
  L="--shapes $LLAMA --microbatches 8 --schedules 1f1b,interleaved-1f1b,zbv --limit-schedules zbv"
  L="$L --plan issue21-llama3 --steps $STEPS --warmup 3 --timeline-steps 0 --torch-schedules none"
  L="$L --variants samecut --gc manual"
  part k1-llama8-l0 2 150 185 --launch 0 $L --libraries megatron-nosync,megatron-sweep-nowf
  part k2-llama8-l1 2 130 165 --launch 1 $L $(tuned k1-llama8-l0)
  part k3-llama8-l2 2 130 165 --launch 2 $L $(tuned k1-llama8-l0)
elif [ "${PLAN:-issue13}" = issue21-llama-v ]; then
  # 2 GPUs: the Llama shape's V rows, three launches: pipetrain's ZBV and DualPipeV on the
  # planner's and on the incumbents' cut, their no-pipeline limits, DeepSpeed's DualPipeV engine
  L="--shapes $LLAMA --microbatches 8 --schedules zbv,dualpipev --limit-schedules zbv,dualpipev"
  L="$L --plan issue21-llama-v --steps $STEPS --warmup 3 --timeline-steps 0 --torch-schedules none"
  L="$L --variants samecut --gc manual --libraries deepspeed-dualpipev"
  launches3 v llama8 2 130 165 $L
elif [ "${PLAN:-issue13}" = issue21x4 ]; then
  X="--shapes $GPT --microbatches 16,8 --schedules 1f1b,interleaved-1f1b,zbv,dualpipev"
  X="$X --limit-schedules zbv,dualpipev --plan issue21x4"
  # launch 0 with the collector on (each step's pauses recorded; a trace of interleaved 1F1B
  # with and without deferral), launches 1 and 2 with it off for every library (--gc manual)
  part x1-gpt-l0 "$NPROC4" 190 225 --launch 0 $X $C21 --gc python \
    --libraries megatron-nosync,megatron-sweep,megatron-gaf \
    --profile pipetrain:interleaved-1f1b,pipetrain-nodefer:interleaved-1f1b
  part x2-gpt-l1 "$NPROC4" 125 160 --launch 1 $X $C21 --gc manual $(tuned x1-gpt-l0)
  part x3-gpt-l2 "$NPROC4" 125 160 --launch 2 $X $C21 --gc manual $(tuned x1-gpt-l0)
elif [ "${PLAN:-issue13}" = issue21x4b ]; then
  # what issue21x4 left (2026-11-27: its launch 0 hung in megatron-v2-wf, the warm-up/flush
  # overlap, at 4 ranks, and the 8-micro-batch rows ran out of time): the 8-micro-batch rows
  # twice and 16 once more, Megatron's interleaved variants but the -wf ones, collector off
  X="--shapes $GPT --schedules 1f1b,interleaved-1f1b,zbv,dualpipev --limit-schedules zbv,dualpipev"
  X="$X --plan issue21x4 --gc manual $C21"
  part y1-gpt8-l0 "$NPROC4" 150 185 --launch 0 --microbatches 8 $X \
    --libraries megatron-nosync,megatron-sweep-nowf
  part y2-gpt16-l1 "$NPROC4" 160 195 --launch 1 --microbatches 16 $X \
    --libraries megatron-nosync,megatron-sweep-nowf
  part y3-gpt8-l2 "$NPROC4" 95 130 --launch 2 --microbatches 8 $X $(tuned y1-gpt8-l0)
elif [ "${PLAN:-issue13}" = issue21-extra ]; then
  E="--shapes $GPT --microbatches 16 --limit-schedules zbv,dualpipev --plan issue21-extra"
  part e1-zb 2 150 190 --launch 0 $E --steps $STEPS --warmup 2 --timeline-steps 0 \
    --schedules zb-h1,interleaved-zb,zbv,dualpipev --libraries deepspeed-dualpipev \
    --torch-schedules zb-h1,interleaved-zb,zbv,dualpipev
  part e2-ds 2 120 160 --launch 0 $E --steps $STEPS --warmup 2 --timeline-steps 0 \
    --schedules 1f1b --libraries megatron,megatron-nosync,deepspeed,deepspeed-bf16 \
    --torch-schedules 1f1b --variants nodefer
  part e3-llama-v 2 120 160 --launch 0 --shapes "$LLAMA" --microbatches 8 --steps $STEPS \
    --warmup 2 --timeline-steps 0 --schedules zbv,dualpipev --limit-schedules zbv,dualpipev \
    --libraries deepspeed-dualpipev --torch-schedules zbv,dualpipev --plan issue21-extra
elif [ "${PLAN:-issue13}" = issue21x4-extra ]; then
  # 4 GPUs: issue21-extra's GPT rows at 4 ranks, one launch each: torch's zero-bubble rows and
  # DeepSpeed's DualPipeV beside pipetrain's and the limit; DeepSpeed's 1F1B (fp32 and bf16
  # optimizer), torch's 1F1B and Megatron's with and without batch sync beside pipetrain's
  # (defaults and plain weight gradients)
  E="--shapes $GPT --microbatches 16 --limit-schedules zbv,dualpipev --plan issue21x4-extra"
  part f1-zb "$NPROC4" 170 210 --launch 0 $E --steps $STEPS --warmup 2 --timeline-steps 0 \
    --schedules zb-h1,interleaved-zb,zbv,dualpipev --libraries deepspeed-dualpipev \
    --torch-schedules zb-h1,interleaved-zb,zbv,dualpipev
  part f2-ds "$NPROC4" 140 180 --launch 0 $E --steps $STEPS --warmup 2 --timeline-steps 0 \
    --schedules 1f1b --libraries megatron,megatron-nosync,deepspeed,deepspeed-bf16 \
    --torch-schedules 1f1b --variants nodefer
elif [ "${PLAN:-issue13}" = issue21-best2 ]; then
  # 2 GPUs: pipetrain's ZBV (with its no-pipeline limit) beside Megatron's best rows — 1F1B
  # without batch sync and the fastest interleaved variant of TUNED (the issue21 call's launch 0)
  # — in the same three launches, rotated: the 2-rank "best / best" in one call
  B="--shapes $GPT --microbatches 16 --schedules 1f1b,interleaved-1f1b,zbv --limit-schedules zbv"
  B="$B --plan issue21-best2 --steps $STEPS --warmup 2 --timeline-steps 0 --torch-schedules none"
  B="$B --libraries megatron-nosync,megatron-tuned --megatron-top 1 --megatron-tuned-from"
  launches3 b gpt16 2 110 145 $B "${TUNED:?set TUNED to a launch-0 incumbents.json}"
elif [ "${PLAN:-issue13}" = issue21-best2g ]; then
  # 2 GPUs: issue21-best2 with pipetrain's interleaved 1F1B and ZBV also as one CUDA graph
  # (pipetrain-graph), every library on the allocator's default segments (ALLOC_CONF=)
  B="--shapes $GPT --microbatches 16 --schedules interleaved-1f1b,zbv --limit-schedules zbv"
  B="$B --plan issue21-best2g --steps $STEPS --warmup 3 --timeline-steps 0 --torch-schedules none"
  B="$B --variants graph --gc manual --libraries megatron-tuned --megatron-top 1"
  B="$B --megatron-tuned-from ${TUNED:?set TUNED to a launch-0 incumbents.json}"
  launches3 c gpt16 2 105 135 $B
elif [ "${PLAN:-issue13}" = issue21-equal ] || [ "${PLAN:-issue13}" = issue21x4-equal ]; then
  # 2 GPUs (issue21-equal) or 4 (issue21x4-equal): the equal-kernel rows alone — pipetrain and
  # pipetrain-nodefer beside Megatron's 1F1B without batch sync and its fastest interleaved
  # variant of TUNED, 16 micro-batches, collector off, three launches
  NP=2
  [ "$PLAN" = issue21x4-equal ] && NP=$NPROC4
  E="--shapes $GPT --microbatches 16 --schedules 1f1b,interleaved-1f1b --plan $PLAN"
  E="$E --steps $STEPS --warmup 3 --timeline-steps 0 --torch-schedules none --variants nodefer"
  E="$E --gc manual --libraries megatron-nosync,megatron-tuned --megatron-top 1"
  E="$E --megatron-tuned-from ${TUNED:?set TUNED to a launch-0 incumbents.json}"
  launches3 e gpt16 "$NP" 110 145 $E
elif [ "${PLAN:-issue13}" = issue21-equal-1f1b ]; then
  # 2 GPUs, LAUNCHES=6 (~85 s each): the 1F1B equal-kernel rows alone — pipetrain,
  # pipetrain-nodefer and Megatron's 1F1B without batch sync, 16 micro-batches, no limit rows,
  # collector off — for a narrower interval on the one 2-rank question three launches left open
  F="--shapes $GPT --microbatches 16 --schedules 1f1b --limit-schedules none --plan $PLAN"
  F="$F --steps $STEPS --warmup 3 --timeline-steps 0 --torch-schedules none --variants nodefer"
  F="$F --gc manual --libraries megatron-nosync"
  launches3 f gpt16 2 80 105 $F
elif [ "${PLAN:-issue13}" = issue21-mgraph ] || [ "${PLAN:-issue13}" = issue21x4-mgraph ]; then
  # 2 GPUs (issue21-mgraph) or 4 (issue21x4-mgraph), ALLOC_CONF= : whole-step CUDA graphs on
  # both sides — pipetrain's (pipetrain-graph) against Megatron-Core's full-iteration graph
  # (megatron-*-graph) — 1F1B, interleaved 1F1B (Megatron's fastest variant of TUNED) and ZBV
  # with its limit, 16 micro-batches, three launches
  NP=2
  [ "$PLAN" = issue21x4-mgraph ] && NP=$NPROC4
  M="--shapes $GPT --microbatches 16 --schedules ${SCHEDULES:-1f1b,interleaved-1f1b,zbv}"
  M="$M --limit-schedules zbv ${LIMIT_GRAPH:+--limit-graph}"
  M="$M --plan $PLAN --steps $STEPS --warmup 3 --timeline-steps 0 --torch-schedules none"
  M="$M --variants ${VARIANTS:-graph} --gc manual --megatron-top 1"
  M="$M --libraries megatron-nosync,megatron-nosync-graph,megatron-tuned,megatron-tuned-graph"
  M="$M --megatron-tuned-from ${TUNED:?set TUNED to launch-0 incumbents.json files}"
  launches3 m gpt16 "$NP" 150 185 $M
elif [ "${PLAN:-issue13}" = issue21x4g ]; then
  # 4 GPUs: the V rows eager and as one CUDA graph (pipetrain-graph), their no-pipeline limits,
  # and Megatron's best interleaved variant of TUNED (comma list of earlier launch-0 files),
  # 16 then 8 micro-batches, three launches rotated
  G="--shapes $GPT --schedules zbv,dualpipev,interleaved-1f1b --limit-schedules zbv,dualpipev"
  G="$G --plan issue21x4g --steps $STEPS --warmup 3 --timeline-steps 0 --torch-schedules none"
  G="$G --variants graph --gc manual --libraries megatron-tuned --megatron-top 1"
  G="$G --megatron-tuned-from ${TUNED:?set TUNED to launch-0 incumbents.json files}"
  part g1-gpt16-l0 "$NPROC4" 120 150 --launch 0 --microbatches 16 $G
  part g2-gpt8-l0 "$NPROC4" 90 120 --launch 0 --microbatches 8 $G
  part g3-gpt16-l1 "$NPROC4" 120 150 --launch 1 --microbatches 16 $G
  part g4-gpt8-l1 "$NPROC4" 90 120 --launch 1 --microbatches 8 $G
  part g5-gpt16-l2 "$NPROC4" 120 150 --launch 2 --microbatches 16 $G
  part g6-gpt8-l2 "$NPROC4" 90 120 --launch 2 --microbatches 8 $G
elif [ "${PLAN:-issue13}" = leads2 ]; then
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
  --profile megatron-v2:interleaved-1f1b,pipetrain:interleaved-1f1b
exact p2e-exact4 "$NPROC4" 60
part p3-blocks2 2 150 180 --shapes "$BLOCKS" --microbatches 16,8 --schedules $ALL
left=$((TOTAL - SECONDS - 10))
[ "$NPROC4" = 2 ] || part p4-wide2 2 $((left - 30)) "$left" --shapes "$WIDE" --microbatches 8,16 --steps 4 --schedules $ALL
fi
pack 2000  # the final summary: 2000 bootstrap draws per interval (between parts: 300)
echo "== done at ${SECONDS}s (TOTAL ${TOTAL}s)"
cat "$OUT/summary.md" 2>/dev/null | grep -v '^$' | head -150
ls -la "$OUT"
rm -rf "$WORK"
