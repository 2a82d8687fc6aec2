"""Micro-batching: split a batch along dim 0, weigh each piece, and merge outputs back.

A batch of ``N`` rows split into ``m`` pieces of sizes ``n_j`` (``torch.tensor_split`` sizes: the
first ``N mod m`` pieces get one row more) is trained exactly like the unsplit batch when each
piece's loss is weighted by ``n_j / N``: for a mean-reducing loss, ``Σ_j (n_j/N)·mean_j = mean``.
So uneven splits are handled, never refused; only ``m > N`` is (an empty micro-batch has no loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Batch = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class MicroBatches:
    """``inputs[j]`` is the positional-argument tuple of stage 0 for micro-batch ``j``."""

    inputs: tuple[tuple[torch.Tensor, ...], ...]
    targets: tuple[object, ...]
    weights: tuple[float, ...]
    batch_size: int


def as_tuple(batch: object, what: str) -> tuple[torch.Tensor, ...]:
    """A tensor or a tuple/list of tensors as a tuple; anything else is a ``TypeError``."""
    items = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{what} must be a tensor or a tuple of tensors; item {i} is {type(t).__name__}"
            )
    return items


def to_device(
    inputs: object, targets: object, device: torch.device
) -> tuple[tuple[torch.Tensor, ...], object]:
    """``inputs`` as a tuple of tensors on ``device``, and ``targets`` there too where they are a
    tensor or a tuple/list of them (anything else stays as given)."""
    xs = tuple(x.to(device) for x in as_tuple(inputs, "inputs"))
    if isinstance(targets, torch.Tensor):
        return xs, targets.to(device)
    if isinstance(targets, (tuple, list)):
        return xs, tuple(t.to(device) for t in as_tuple(targets, "targets"))
    return xs, targets


def batch_size_of(tensors: Sequence[torch.Tensor], what: str) -> int:
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(f"{what} must have a batch dimension (dim 0); got a 0-dim tensor")
    sizes = {int(t.shape[0]) for t in tensors}
    if len(sizes) != 1:
        raise ValueError(f"{what} disagree on the batch size (dim 0): {sorted(sizes)}")
    return sizes.pop()


def split(inputs: Batch, targets: object, num_microbatches: int) -> MicroBatches:
    """Split ``inputs`` (and ``targets``, if tensors) into ``num_microbatches`` along dim 0."""
    xs = as_tuple(inputs, "inputs")
    n = batch_size_of(xs, "inputs")
    if num_microbatches > n:
        raise ValueError(
            f"num_microbatches={num_microbatches} is larger than the batch size {n}; "
            f"legal values are 1..{n}"
        )
    pieces = [torch.tensor_split(x, num_microbatches, dim=0) for x in xs]
    per_mb = tuple(tuple(p[j] for p in pieces) for j in range(num_microbatches))
    sizes = [per_mb[j][0].shape[0] for j in range(num_microbatches)]
    return MicroBatches(
        inputs=per_mb,
        targets=split_targets(targets, num_microbatches, n),
        weights=tuple(s / n for s in sizes),
        batch_size=n,
    )


def split_targets(targets: object, num_microbatches: int, batch_size: int) -> tuple[object, ...]:
    """Targets split like the inputs; ``None`` stays ``None`` for every micro-batch."""
    if targets is None:
        return (None,) * num_microbatches
    ts = as_tuple(targets, "targets")
    if batch_size_of(ts, "targets") != batch_size:
        raise ValueError(
            f"targets have batch size {ts[0].shape[0]} but inputs have {batch_size}; "
            "they must match along dim 0"
        )
    pieces = [torch.tensor_split(t, num_microbatches, dim=0) for t in ts]
    if isinstance(targets, torch.Tensor):
        return tuple(pieces[0])
    return tuple(tuple(p[j] for p in pieces) for j in range(num_microbatches))


def merge(outputs: Sequence[tuple[torch.Tensor, ...]], single: bool) -> Batch:
    """Concatenate per-micro-batch outputs along dim 0 (the inverse of ``split``)."""
    merged = tuple(torch.cat(parts, dim=0) for parts in zip(*outputs))
    return merged[0] if single else merged
