"""Losses exact whatever their reduction: how each micro-batch's loss is weighted.

A step splits a batch into micro-batches and backpropagates ``w_j · loss_j`` for each; the
weights make the sum equal the unsplit batch's loss, so the gradients equal unsplit training's.
Which weights depends on what ``loss_fn`` returns — the ``loss_reduction`` contract:

* ``"mean"`` — the mean over the micro-batch's rows (``mse_loss``, a per-sample loss): weight
  ``n_j / N`` (rows in the micro-batch over rows in the batch), ``Σ_j (n_j/N)·mean_j = mean``.
* ``"sum"`` — the sum over the micro-batch (``reduction='sum'``): weight 1, the batch's sum.
* ``"token_mean"`` — the sum over the micro-batch's counted tokens (target elements that are not
  ``ignore_index``): weight ``1 / T`` with ``T`` the count over the whole batch — every
  micro-batch, and every data-parallel replica when a count group is given — so the result is
  the global token mean a padded language-model loss means. (Per-micro-batch token means
  weighted by rows are off whenever micro-batches hold different numbers of real tokens.)

``TokenCrossEntropy`` is the built-in ``"token_mean"`` loss; a ``loss_fn`` with a
``loss_reduction`` attribute states its own contract, so ``Pipeline`` needs no argument for it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipetrain.runtime.comm.p2p import DTYPE_CODE, DTYPES

REDUCTIONS = ("mean", "sum", "token_mean")


class TokenCrossEntropy:
    """Cross-entropy summed over tokens whose target is not ``ignore_index``; ``Pipeline``
    divides by the global token count (``loss_reduction = "token_mean"``).

    ``logits``: ``(..., vocab)``; ``targets``: ``(...)`` class indices, already aligned with the
    logits (shift them for next-token prediction before the step)."""

    loss_reduction = "token_mean"

    def __init__(self, ignore_index: int = -100) -> None:
        self.ignore_index = ignore_index

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=self.ignore_index,
            reduction="sum",
        )


def resolve(
    loss_fn, loss_reduction: str | None, ignore_index: int | None
) -> tuple[str, int, Callable[[object], None]]:
    """The reduction (argument, else ``loss_fn.loss_reduction``, else ``"mean"``), the
    ``ignore_index`` (argument, else ``loss_fn.ignore_index``, else -100) and the check of a
    step's whole targets: ``loss_fn.check_targets`` where it has one. The pipeline runs it on the
    host before a step's actions, so a loss keeps its data-dependent checks (which wait for the
    device) out of the step itself, where a captured step (``cuda_graph=True``) cannot have them."""
    reduction = loss_reduction or getattr(loss_fn, "loss_reduction", "mean")
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"loss_reduction={reduction!r}; legal values are {', '.join(REDUCTIONS)} "
            "(what loss_fn returns for a micro-batch: its mean over rows, its sum, or its sum "
            "over counted tokens)"
        )
    if ignore_index is None:
        ignore_index = getattr(loss_fn, "ignore_index", -100)
    check = getattr(loss_fn, "check_targets", None)

    def check_targets(targets: object) -> None:
        if check is not None and targets is not None:
            check(targets)

    return reduction, ignore_index, check_targets


def counted_tokens(targets: object, ignore_index: int) -> torch.Tensor:
    """Target elements that are not ``ignore_index`` (the first tensor of a tuple of targets)."""
    if isinstance(targets, (tuple, list)):
        targets = targets[0] if targets else None
    if not isinstance(targets, torch.Tensor):
        raise ValueError(
            "loss_reduction='token_mean' counts target tokens: pass targets as a tensor of class "
            f"indices (or a tuple whose first item is one), not {type(targets).__name__}"
        )
    return (targets != ignore_index).sum().to(torch.float64)


def weights(
    reduction: str,
    row_weights: tuple[float, ...],
    targets: object,
    ignore_index: int,
    count_group=None,
) -> tuple[float, ...]:
    """The micro-batch weights for ``reduction``; ``targets`` is the whole batch's.

    ``count_group``: a process group over which the token count is summed (the data-parallel
    replicas of this pipeline stage; collective: each member calls this once per step)."""
    if reduction == "mean":
        return row_weights
    if reduction == "sum":
        return (1.0,) * len(row_weights)
    count = counted_tokens(targets, ignore_index)
    if count_group is not None and dist.get_world_size(count_group) > 1:
        dist.all_reduce(count, group=count_group)
    total = float(count.item())
    if total == 0:
        raise ValueError(
            f"loss_reduction='token_mean': every target is ignore_index={ignore_index}, so no "
            "token is counted and the mean is undefined"
        )
    return (1.0 / total,) * len(row_weights)


def agree(
    held: dict[int, torch.Tensor] | None,
    weights,
    transport,
    last_rank: int,
    world_size: int,
    extra: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The batch's loss on every rank: ``Σ_j w_j · loss_j`` of the micro-batch losses ``held``
    by the last stage's rank (``None`` elsewhere), in float64, returned in its dtype (sent with
    its dtype's code). Every rank then holds the same value, so a decision on it (is it finite?)
    is the same everywhere without another collective.

    ``extra``: a float64 vector of this rank's to sum over the ranks in the same collective
    (``runtime.extra_losses``' step report); returned summed (``None`` without it). The loss
    travels in the same all-reduce, where other ranks add zeros: exactly a broadcast."""
    size = 2 + (0 if extra is None else extra.numel())
    value = torch.zeros(size, dtype=torch.float64, device=transport.device)
    if held is not None:
        dtype = held[0].dtype
        value[0] = sum(w * held.pop(j).double() for j, w in enumerate(weights))
        value[1] = DTYPE_CODE.get(dtype, DTYPE_CODE[torch.float64])
    if extra is not None:
        value[2:] = extra
    if world_size > 1 and extra is None:
        transport.broadcast(value, last_rank, "the loss broadcast")
    elif world_size > 1:
        sum_over_ranks(value, transport, last_rank, "the loss and extra loss agreement")
    loss = value[0].to(DTYPES[int(value[1].item())])
    return loss, None if extra is None else value[2:]


def sum_over_ranks(value: torch.Tensor, transport, peer: int, what: str) -> None:
    """``value`` summed in place over the transfer group's ranks, waited with the transport's
    timeout (a failed or silent ``peer`` is named)."""
    work = dist.all_reduce(value, group=transport.group, async_op=True)
    transport.wait_work(work, what, peer)
