"""Per-rank runner for ``pipetrain train --prefetch-batches`` (``test_varlen_train``): a tiny
float64 Llama folder under a token budget, trained with its batches built in the loop (0), one
ahead (1, the default) and two ahead (2), each run's losses returned."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from finetune_cases import train_args

STEPS = 3


def prefetch_runs(rank: int, world: int, directory: str, folder: str) -> dict[int, list[float]]:
    """``--prefetch-batches`` → the run's losses."""
    from pipetrain.app.train import train

    text = Path(directory) / "text.txt"
    if rank == 0:
        from pipetrain.app.models.data import make_corpus

        text.write_bytes(make_corpus(2000))
    dist.barrier()
    common = ["--model-dir", folder, "--dtype", "float64", "--seq-len", "24", "-s", "1f1b"]
    common += ["--microbatch-size", "2", "--global-batch-tokens", "200", "--text", str(text)]
    common += ["--steps", str(STEPS), "--timeout", "60", "--data-cache", f"{directory}/cache"]
    common += ["--svg", f"{directory}/step.svg", "--lr", "0.01", "--warmup", "0"]
    return {
        ahead: train(
            train_args(*common, "--prefetch-batches", str(ahead)), torch.device("cpu")
        ).losses
        for ahead in (0, 1, 2)
    }
