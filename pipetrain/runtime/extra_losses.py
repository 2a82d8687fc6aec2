"""Loss terms a layer adds to the pipeline's loss from inside its forward (a mixture-of-experts
layer's router losses), beside the main loss the last stage computes.

A private stand-in with the interface the runtime's own version keeps: a layer calls
``record_extra_loss(self, name, value)`` during its forward with a scalar already weighted as
the loss wants it (a coefficient times the term over this micro-batch's tokens), and
``take_extra_losses(module)`` returns and clears what the layers in ``module`` recorded in
their last forward (for references run outside a pipeline).
"""

from __future__ import annotations

import torch
from torch import nn

_SLOT = "_pipetrain_extra_losses"


def record_extra_loss(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Keep ``value`` (a scalar tensor) as ``module``'s term ``name`` of its last forward,
    replacing an earlier one (a checkpointed layer's recompute records again)."""
    if value.dim() != 0:
        raise ValueError(f"extra loss {name!r} must be a scalar, got shape {tuple(value.shape)}")
    module.__dict__.setdefault(_SLOT, {})[name] = value


def take_extra_losses(module: nn.Module) -> dict[str, torch.Tensor]:
    """The terms the layers of ``module`` (itself included) recorded, summed by name; cleared."""
    out: dict[str, torch.Tensor] = {}
    for sub in module.modules():
        for name, value in sub.__dict__.pop(_SLOT, {}).items():
            out[name] = out[name] + value if name in out else value
    return out
