#!/bin/bash
# GPU proof of data parallel under the pipeline: pp=2 x dp=2 on 4 GPUs (NCCL), tied embeddings,
# clipping; FSDP2 training;
# DDP checkpoint + resume against the uninterrupted run (float64 and float32).
# Run from a folder holding pipetrain/ and .whl/ (a transformers wheel; the GPU machine has no
# internet), with $OUT set to where the logs go. Results: docs/training-gpu.md.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpus.txt
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> $OUT/gpus.txt
M="--model llama --layers 8 --hidden 512 --heads 8 --kv-heads 4 --seq-len 256 --tie-embeddings --clip-grad-norm 1 -p 2 --dp 2 --device cuda -s zbv -m 8"
timeout 150 python3 -m pipetrain train $M --data-parallel fsdp --steps 30 --svg $OUT/fsdp_step.svg > $OUT/fsdp_tied.log 2>&1; echo "rc=$?" >> $OUT/fsdp_tied.log
for dt in float64 float32; do
  timeout 100 python3 -m pipetrain train $M --data-parallel ddp --dtype $dt --steps 20 --checkpoint-dir /tmp/full_$dt --checkpoint-every 10 > $OUT/ddp_${dt}_full.log 2>&1; echo "rc=$?" >> $OUT/ddp_${dt}_full.log
  timeout 100 python3 -m pipetrain train $M --data-parallel ddp --dtype $dt --steps 10 --checkpoint-dir /tmp/res_$dt --checkpoint-every 10 > $OUT/ddp_${dt}_first.log 2>&1; echo "rc=$?" >> $OUT/ddp_${dt}_first.log
  timeout 100 python3 -m pipetrain train $M --data-parallel ddp --dtype $dt --steps 20 --checkpoint-dir /tmp/res_$dt --resume > $OUT/ddp_${dt}_resume.log 2>&1; echo "rc=$?" >> $OUT/ddp_${dt}_resume.log
done
cat $OUT/gpus.txt; grep -H "^step 10/\|^step 20/\|^step 30/\|rc=\|rror" $OUT/*.log | head -40
