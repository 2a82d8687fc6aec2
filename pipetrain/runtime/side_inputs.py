"""Side inputs: values a stage needs besides the previous stage's output (attention masks,
position ids), passed by ``pipe.step(..., side={...})`` instead of through every stage's return.

Every rank is given the whole batch's side inputs (like the inputs and targets). A tensor is
batched: its dim 0 must be the batch's rows, and it is split into micro-batches exactly like the
inputs. A tensor every micro-batch needs whole (a rotary table) is wrapped, ``Whole(table)``:
guessing from its shape would split a table whose length happens to equal the batch size. Any
other value (a scalar, ``None``) reaches every micro-batch as is. A stage receives the side inputs its ``forward`` names as keyword arguments (all of them
with ``**kwargs``; ``pipetrain.split``'s stages hand each layer the ones it names).

Side inputs carry no gradient: a side tensor that requires one is refused (its gradient would
have to travel back to stage 0's rank, which only the stage outputs do). A name no stage takes
is refused too — a misspelt ``attention_mask`` would otherwise be silently ignored; the names
every rank's stages take are gathered once (``everyones_keywords``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import cast

import torch
import torch.distributed as dist
from torch import nn


class Whole:
    """A side input every micro-batch gets whole (not split along dim 0)."""

    def __init__(self, value: object) -> None:
        self.value = value


def keywords(module: nn.Module) -> frozenset[str] | None:
    """The side-input names ``module`` takes: its ``forward``'s keyword-capable parameters after
    the positional ones it is called with (``None``: it takes ``**kwargs``, so any)."""
    accepted = getattr(module, "accepted_keywords", None)
    if callable(accepted):
        return accepted()
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return frozenset()
    names = set()
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            return None
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            names.add(p.name)
    return frozenset(names)


def check(side: Mapping[str, object], accepted: list[frozenset[str] | None]) -> None:
    """Refuse names no stage takes and tensors that need a gradient."""
    if not isinstance(side, Mapping):
        raise TypeError(f"side must be a dict name -> value, not {type(side).__name__}")
    known: frozenset[str] | None = frozenset()
    for names in accepted:
        known = None if names is None or known is None else known | names
    for name, value in side.items():
        if known is not None and name not in known:
            raise ValueError(
                f"side input {name!r} is taken by no stage's forward; the stages take "
                f"{sorted(known) or 'no keyword arguments'}"
            )
        tensor = value.value if isinstance(value, Whole) else value
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            raise ValueError(
                f"side input {name!r} requires a gradient; side inputs carry none (pass it as a "
                "stage input, or detach it)"
            )


def split(
    side: Mapping[str, object], batch_size: int, num_microbatches: int, device
) -> tuple[dict[str, object], ...]:
    """Per micro-batch: tensors split like the inputs, ``Whole`` values and non-tensors as is."""
    per_mb: list[dict[str, object]] = [{} for _ in range(num_microbatches)]
    for name, value in side.items():
        if isinstance(value, torch.Tensor):
            rows = value.shape[0] if value.dim() else None
            if rows != batch_size:
                raise ValueError(
                    f"side input {name!r} has {rows if rows is not None else 'no'} rows along "
                    f"dim 0 but the batch has {batch_size}; a side tensor is split like the "
                    "inputs — wrap one every micro-batch needs whole as side_inputs.Whole(value)"
                )
            pieces = torch.tensor_split(value.to(device), num_microbatches, dim=0)
            for j, piece in enumerate(pieces):
                per_mb[j][name] = piece
            continue
        if isinstance(value, Whole):
            value = value.value
            if isinstance(value, torch.Tensor):
                value = value.to(device)
        for j in range(num_microbatches):
            per_mb[j][name] = value
    return tuple(per_mb)


def select(side: Mapping[str, object], accepted: frozenset[str] | None) -> dict[str, object]:
    """The side inputs a stage takes."""
    if accepted is None:
        return dict(side)
    return {k: v for k, v in side.items() if k in accepted}


def everyones_keywords(
    mine: list[frozenset[str] | None], group: dist.ProcessGroup | None, world_size: int
) -> list[frozenset[str] | None]:
    """Every stage's side-input names, from this rank's (``mine``) and every other rank's
    (collective over ``group``), for ``check`` to know what some stage takes."""
    everyone: list[object] = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [mine]
    return [k for part in everyone for k in cast(list[frozenset[str] | None], part)]
