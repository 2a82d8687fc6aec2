"""The learning rate of every step, as a pure function of the step and the run's flags, and the
optimizer's parameter groups it is applied to.

``resolve_schedule`` turns ``--lr``, ``--lr-schedule``, ``--warmup`` and ``--min-lr`` (each None
unless given) into one ``LrSchedule``. The defaults depend on what the run is: a fine-tune of a
released model (``--model-dir``) takes TRL's ``SFTTrainer`` defaults — peak 2e-5, cosine decay
to 0, a linear warm-up over 3% of the steps — since a from-scratch rate such as 3e-3 makes a
pretrained model diverge within a few steps; the built-in models, trained from scratch in the
demo, keep a constant 3e-3.

``LrSchedule.at(step)`` is the rate of the optimizer step that follows step ``step``'s backward
(0-based). Warm-up is linear from 0 as nanoGPT's ``get_lr`` writes it, ``peak · (s + 1) /
(warmup + 1)``, so no step runs at a rate of 0; the decay then follows Hugging Face
``transformers``' ``get_cosine_schedule_with_warmup`` / ``get_linear_schedule_with_warmup``:
progress ``(s − warmup) / (steps − warmup)``, reaching ``--min-lr`` at ``s = steps``, the end of
the run. The loop writes the rate into every parameter group before each update, so nothing
about the schedule is saved in a checkpoint: a resumed run computes the same rates (given the
same ``--steps``).

``parameter_groups`` applies ``--weight-decay`` to parameters of two or more dimensions only
(matrices and embeddings), not to norms' scales and biases, as nanoGPT's ``configure_optimizers``
and ``transformers``' ``Trainer`` do; it also keeps DTensors and plain tensors apart, since
AdamW's fused multi-tensor step refuses a list that mixes them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from pipetrain.app.config import TrainConfig

#: ``--model-dir`` (a fine-tune): TRL ``SFTConfig``'s learning rate and a cosine decay
FINE_TUNE_LR, FINE_TUNE_SCHEDULE, FINE_TUNE_WARMUP = 2e-5, "cosine", 0.03
#: the built-in models, trained from scratch
SCRATCH_LR, SCRATCH_SCHEDULE = 3e-3, "constant"


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate of each step of a run of ``steps`` steps (see the module docstring)."""

    lr: float
    kind: str
    warmup: int
    min_lr: float
    steps: int

    def at(self, step: int) -> float:
        """The rate of step ``step`` (0-based); ``min_lr`` from ``steps`` on (decaying kinds)."""
        if step < self.warmup:
            return self.lr * (step + 1) / (self.warmup + 1)
        if self.kind == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        if self.kind == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = 1.0 - progress
        return self.min_lr + (self.lr - self.min_lr) * shape


def default_warmup(steps: int) -> int:
    """A fine-tune's warm-up: 3% of the steps, rounded, at least one step where there are two."""
    return max(round(FINE_TUNE_WARMUP * steps), 1 if steps >= 2 else 0)


def resolve_schedule(config: TrainConfig) -> LrSchedule:
    """The run's schedule, its defaults filled in; ``ValueError`` naming the flag that cannot
    apply."""
    fine_tune = config.model_dir is not None
    lr = config.lr if config.lr is not None else (FINE_TUNE_LR if fine_tune else SCRATCH_LR)
    kind = config.lr_schedule or (FINE_TUNE_SCHEDULE if fine_tune else SCRATCH_SCHEDULE)
    if config.warmup is not None:
        warmup = config.warmup
    else:
        warmup = default_warmup(config.steps) if fine_tune else 0
    if config.min_lr is not None and kind == "constant":
        raise ValueError("--min-lr is where a decay ends: give --lr-schedule cosine or linear")
    min_lr = config.min_lr if config.min_lr is not None else 0.0
    if min_lr > lr:
        raise ValueError(f"--min-lr {min_lr:g} is above the peak --lr {lr:g}: give a lower one")
    if warmup >= config.steps and config.warmup is not None:
        raise ValueError(
            f"--warmup {warmup} leaves none of --steps {config.steps} after it: give fewer "
            "warm-up steps"
        )
    return LrSchedule(lr=lr, kind=kind, warmup=warmup, min_lr=min_lr, steps=config.steps)


def set_lr(optimizer: Any, lr: float) -> None:
    """Write ``lr`` into every parameter group (before the optimizer's step)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def parameter_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """``params`` in AdamW groups: DTensors apart from plain tensors, and, each, those of two or
    more dimensions (decayed by ``weight_decay``) apart from the others (not decayed)."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault((isinstance(p, DTensor), p.dim() >= 2), []).append(p)
    return [
        {"params": group, "weight_decay": weight_decay if decayed else 0.0}
        for (_, decayed), group in sorted(groups.items())
    ]


__all__ = [
    "LrSchedule",
    "default_warmup",
    "parameter_groups",
    "resolve_schedule",
    "set_lr",
]
