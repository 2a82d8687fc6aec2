"""Small helpers shared by the builders: argument checks and row assembly."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.placement import Placement
from pipetrain.schedule.program import Program


def require_positive(**counts: int) -> None:
    """Refuse counts below 1, naming the argument."""
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


# The kinds as module constants: reading a member off the enum class costs as much as making the
# action, and builders make one action per (stage, micro-batch, kind).
_F, _B, _I, _W = OpKind.F, OpKind.B, OpKind.I, OpKind.W


def F(stage: int, microbatch: int) -> Action:
    return Action(_F, stage, microbatch)


def B(stage: int, microbatch: int) -> Action:
    return Action(_B, stage, microbatch)


def I(stage: int, microbatch: int) -> Action:
    return Action(_I, stage, microbatch)


def W(stage: int, microbatch: int) -> Action:
    return Action(_W, stage, microbatch)


def make_program(
    name: str, placement: Placement, num_microbatches: int, rows: Sequence[Sequence[Action]]
) -> Program:
    return Program(placement, num_microbatches, tuple(tuple(r) for r in rows), name)
