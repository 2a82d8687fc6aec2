"""The models and settings ``plan_nd_gpu.py`` runs (standard library only): per preset the N-D
mode's model, budget, global batch and tensor-parallel link; the synthesized mode's cases (the
unequal models of ``synthesize_cases.py``, built rather than derived: a Llama-3-8B-shaped
embedding and head at 2048 wide, 16 blocks; the same at a 256k vocabulary with the embedding tied
to the head; 13 blocks); and the launches' counts and limits.

``h200``: NCCL with a GPU per process, bfloat16, 3 launches of 5 untimed and 20 timed steps;
the tensor-parallel link at 360 GB/s (an H200's NVLink as an NCCL all-reduce sees it) prices the
degrees the profiler derives. ``cpu-smoke``: gloo, a narrow model, one launch of a few steps, and
in the N-D mode every shape run (``near`` unbounded), so that tensor and data parallel both run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.planner.plan_nd_launch import Model

LLAMA_8B_HEAD = dict(model="llama", hidden=2048, heads=16, kv_heads=8, dtype="bfloat16")
PRESETS = {
    "h200": {
        "nd": dict(
            model=Model(**LLAMA_8B_HEAD, blocks=16, vocab=128256, seq_len=2048, micro_batch_size=1),
            memory_gib=60.0,
            global_batch=32,
            link_gbs=360.0,
            near=0.10,
        ),
        "synthesized": [
            (
                "heavy head, 128k vocabulary",
                Model(**LLAMA_8B_HEAD, blocks=16, vocab=128256, seq_len=1024, micro_batch_size=2),
            ),
            (
                "256k vocabulary, tied embedding",
                Model(
                    **LLAMA_8B_HEAD,
                    blocks=16,
                    vocab=256000,
                    seq_len=1024,
                    micro_batch_size=2,
                    tie_embeddings=True,
                ),
            ),
            (
                "13 blocks, not divisible by the ranks",
                Model(**LLAMA_8B_HEAD, blocks=13, vocab=128256, seq_len=1024, micro_batch_size=2),
            ),
        ],
        "microbatches": 8,
        "device": "cuda",
        "warmup": 5,
        "steps": 20,
        "launches": 3,
        "launch_s": 420,
        "repeats": 5,
    },
    "cpu-smoke": {
        "nd": dict(
            model=Model(
                "llama",
                blocks=3,
                hidden=32,
                heads=2,
                kv_heads=2,
                vocab=256,
                seq_len=32,
                micro_batch_size=2,
                dtype="float32",
            ),
            memory_gib=1.0,
            global_batch=8,
            link_gbs=None,
            near=float("inf"),
        ),
        "synthesized": [
            (
                "heavy head, 4k vocabulary",
                Model(
                    "llama",
                    blocks=3,
                    hidden=32,
                    heads=2,
                    kv_heads=2,
                    vocab=4096,
                    seq_len=32,
                    micro_batch_size=2,
                    dtype="float32",
                ),
            ),
        ],
        "microbatches": 4,
        "device": "cpu",
        "warmup": 1,
        "steps": 2,
        "launches": 1,
        "launch_s": 240,
        "repeats": 2,
    },
}
