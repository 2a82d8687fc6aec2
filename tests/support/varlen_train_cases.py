"""Per-rank runner for ``pipetrain train --global-batch-tokens`` (``test_varlen_train``): a tiny
float64 Llama folder on 2 gloo ranks, each step of its own micro-batch count, against the
unsplit ``transformers`` model on the same packed batches; and a resume mid-run."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
import torch.distributed as dist
from finetune_cases import reference_run, train_args

STEPS = 4


def budget_runs(rank: int, world: int, directory: str, folder: str, schedules) -> dict:
    """Per schedule: the straight run's losses, the reference's (rank 0), each step's count;
    for the first schedule, a run to step 2 resumed to ``STEPS``, and ``--dp 2`` and ``--tp 2`` on
    one rank."""
    from pipetrain.app.batch_source import train_batches
    from pipetrain.app.train import train

    text = Path(directory) / "text.txt"
    if rank == 0:
        from pipetrain.app.models.data import make_corpus

        text.write_bytes(make_corpus(3000))
    dist.barrier()
    results = {}
    for schedule in schedules:
        common = [
            "--model-dir",
            folder,
            "--dtype",
            "float64",
            "--seq-len",
            "32",
            "-s",
            schedule,
            "--microbatch-size",
            "2",
            "--global-batch-tokens",
            "300",
            "--lr",
            "0.01",
            "--lr-schedule",
            "constant",
            "--warmup",
            "0",
            "--text",
            str(text),
            "--svg",
            f"{directory}/{schedule}.svg",
            "--timeout",
            "60",
            "--data-cache",
            f"{directory}/cache",
        ]
        metrics = Path(directory) / f"{schedule}.jsonl"
        config = train_args(*common, "--steps", str(STEPS), "--metrics", str(metrics))
        straight = train(config, torch.device("cpu"))
        result: dict = {"straight": straight.losses}
        if rank == 0:
            result["report"] = straight.report
            lines = metrics.read_text().splitlines()
            result["recorded"] = [json.loads(line)["microbatches"] for line in lines]
        batches = itertools.islice(train_batches(config, None, 4), STEPS)
        result["counts"] = [b.microbatches for b in batches]
        if schedule == schedules[0]:
            ckpt = ["--checkpoint-dir", f"{directory}/{schedule}-ckpt"]
            train(train_args(*common, *ckpt, "--steps", "2"), torch.device("cpu"))
            resumed = train(
                train_args(*common, *ckpt, "--steps", str(STEPS), "--resume"), torch.device("cpu")
            )
            result["resumed"] = (resumed.first_step, resumed.losses)
            # 2 replicas of one rank: each its share of every step's own count of micro-batches
            dp = train_args(*common, "-p", "1", "--dp", "2", "--steps", str(STEPS))
            result["dp"] = train(dp, torch.device("cpu")).losses
            if rank == 0:
                result["dp_reference"] = reference_run(dp, STEPS)[0]
            # tensor parallel 2 on one rank: the same counts, every micro-batch split by features
            tp = train_args(*common, "-p", "1", "--tp", "2", "--steps", str(STEPS))
            result["tp"] = train(tp, torch.device("cpu")).losses
            if rank == 0:
                result["tp_reference"] = reference_run(tp, STEPS)[0]
        if rank == 0:
            result["reference"] = reference_run(config, STEPS)[0]
        results[schedule] = result
    return results
