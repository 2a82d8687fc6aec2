"""``--eval-data``: the held-out loss, a token mean over the whole evaluation set.

The pipeline runs forward only (``Pipeline.eval_step``: no gradients, no activations kept for a
backward) and returns the last stage's logits on the ranks that hold it. There each batch's
cross entropy is summed over the predicted targets (``-100`` ones left out, as
``causal_lm_token_loss`` does) together with their count, in float64; the two sums are added
over every process of the run, so every rank gets the same number, the sum over all the set's
tokens divided by their count — the mean ``transformers`` computes over one batch, taken over
the whole set instead of averaged per batch (which would weigh short batches up). Ranks that
hold the same logits (the tensor-parallel ranks of the last stage) add the same sums, which
scale the numerator and the denominator alike.

When: ``--eval-every N`` steps, and after the last step; without it, every ``--checkpoint-every``
steps if given, and after the last step (``eval_due``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipetrain.app.batch_source import IGNORE_INDEX, StepBatch, eval_batches

if TYPE_CHECKING:
    import torch

    from pipetrain.app.config import TrainConfig
    from pipetrain.runtime.pipeline import Pipeline


def eval_due(config: TrainConfig, step: int) -> bool:
    """Whether to evaluate after step ``step`` (1-based) of the run."""
    if config.eval_data is None:
        return False
    every = config.eval_every or config.checkpoint_every or config.steps
    return step % every == 0 or step == config.steps


def check_eval(config: TrainConfig, rows: int) -> None:
    """``--eval-every`` needs ``--eval-data``, which must give at least one row (read as the
    run reads it)."""
    if config.eval_every is not None and config.eval_data is None:
        raise ValueError("--eval-every needs --eval-data FILE (the held-out text)")
    if config.eval_data is not None:
        eval_batches(config, config.model_dir is not None, rows)


def evaluate(
    pipe: Pipeline, batches: Sequence[StepBatch], mine: slice, device: torch.device
) -> float:
    """The token-mean loss of ``batches`` (every replica's rows; this replica's are ``mine``),
    the same on every process (collective)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in batches:
        local = batch.rows(mine, device)
        out = pipe.eval_step(local.inputs, side=local.side)
        if out is None:  # not the last stage's rank
            continue
        logits = out if not isinstance(out, tuple) else out[0]
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            local.targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        sums[0] += loss.double()
        sums[1] += (local.targets != IGNORE_INDEX).sum()
    if dist.is_initialized():
        dist.all_reduce(sums)
    return float(sums[0] / sums[1])


__all__ = ["check_eval", "eval_due", "evaluate"]
