#!/usr/bin/env bash
# One device call of the MoE overlap benchmark (moe_overlap_gpu.py, docs/moe.md), from the
# repository root with $OUT set and .whl/ holding the transformers wheel pipetrain needs (the GPU
# image's transformers is older; the machine has no internet):
#
#   NPROC=4 PRESET=h200x4 benchmarks/moe/moe_overlap_call.sh                # timing, one call
#   NPROC=4 PRESET=h200x4 MODE=profile benchmarks/moe/moe_overlap_call.sh   # the short second call
#   NPROC=8 PRESET=h200x8 benchmarks/moe/moe_overlap_call.sh                # 8 GPUs, pp 2 x ep 4
#
# EXTRA adds flags (EXTRA="--pp 4 --ep 2"); LIMIT (default 560 s) bounds the run inside the
# call's 10 minutes. What comes back: env.txt, log.txt, results.json or profile.json, table.md,
# and with MODE=profile traces/ (rank 0's two DualPipeV traces).
set -u
: "${OUT:?set OUT to the folder the results go to}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site:.
else
    export PYTHONPATH=.
fi
# NVLink multicast stays off: a program using it can take a shared host's GPUs out of service
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
{
    date -u
    nvidia-smi -L
    nvidia-smi topo -m
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} >"$OUT/env.txt" 2>&1
flags=(--preset "${PRESET:-h200x4}" --out "$OUT" --megatron)
if [ "${MODE:-timing}" = profile ]; then
    flags+=(--profile)
fi
# shellcheck disable=SC2086  # EXTRA is a list of flags
timeout -k 10 "${LIMIT:-560}" python3 -m torch.distributed.run --standalone \
    --nproc-per-node "${NPROC:-4}" benchmarks/moe/moe_overlap_gpu.py "${flags[@]}" ${EXTRA:-} \
    >"$OUT/log.txt" 2>&1
status=$?
tail -n 40 "$OUT/log.txt"
exit $status
