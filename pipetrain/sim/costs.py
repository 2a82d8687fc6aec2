"""Per-stage costs for the simulator.

Every cost is one number for all stages or a sequence with one value per stage (a stage is one
chunk as placed: with two stages per rank each is its own chunk). Defaults follow the papers'
unit model: forward = input-gradient = weight-gradient = 1, full backward = input + weight,
an overlapped F&B pair = its forward + its backward (no overlap gain unless measured), no
communication, activation size 1, held unchanged between a split backward's I and W.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Cost = float | Sequence[float]


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Costs resolved to one tuple entry per stage. ``forward_backward`` entries may be None,
    meaning "the pair's forward plus its backward"."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    backward: tuple[float, ...]
    forward_backward: tuple[float | None, ...]
    comm: tuple[float, ...]
    activation: tuple[float, ...]
    activation_for_weight: tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class Costs:
    forward: Cost = 1.0
    backward_input: Cost = 1.0
    backward_weight: Cost = 1.0
    backward: Cost | None = None
    forward_backward: Cost | None = None
    comm: Cost = 0.0
    activation: Cost = 1.0
    #: what a stage holds between a split backward's I and W (default: ``activation``)
    activation_for_weight: Cost | None = None

    def scaled(self, factor: float) -> Costs:
        """Every time and size multiplied by ``factor`` (e.g. 1/v to split a rank's share of the
        model into v stages). Only single-number costs scale; per-stage lists are refused."""
        values = {}
        for name in (
            "forward",
            "backward_input",
            "backward_weight",
            "backward",
            "forward_backward",
            "comm",
            "activation",
            "activation_for_weight",
        ):
            value = getattr(self, name)
            if value is not None and not isinstance(value, int | float):
                raise ValueError(f"cost {name}: give one number here, not one per stage")
            values[name] = None if value is None else value * (1.0 if name == "comm" else factor)
        return Costs(**values)

    def per_stage(self, num_stages: int) -> StageCosts:
        """Resolve to per-stage tuples; ``ValueError`` names a bad value and the legal ones."""
        f = _resolve("forward", self.forward, num_stages)
        i = _resolve("backward_input", self.backward_input, num_stages)
        w = _resolve("backward_weight", self.backward_weight, num_stages)
        b = (
            tuple(x + y for x, y in zip(i, w))
            if self.backward is None
            else _resolve("backward", self.backward, num_stages)
        )
        fb: tuple[float | None, ...] = (
            (None,) * num_stages
            if self.forward_backward is None
            else _resolve("forward_backward", self.forward_backward, num_stages)
        )
        activation = _resolve("activation", self.activation, num_stages)
        return StageCosts(
            forward=f,
            backward_input=i,
            backward_weight=w,
            backward=b,
            forward_backward=fb,
            comm=_resolve("comm", self.comm, num_stages),
            activation=activation,
            activation_for_weight=activation
            if self.activation_for_weight is None
            else _resolve("activation_for_weight", self.activation_for_weight, num_stages),
        )


def _resolve(name: str, value: Cost, num_stages: int) -> tuple[float, ...]:
    values = [value] * num_stages if isinstance(value, int | float) else list(value)
    if len(values) != num_stages:
        raise ValueError(
            f"cost {name} has {len(values)} values; give one number or one per stage ({num_stages})"
        )
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ValueError(f"cost {name} must be a finite number >= 0, got {v!r}")
    return tuple(float(v) for v in values)
