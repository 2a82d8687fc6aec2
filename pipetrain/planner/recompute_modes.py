"""The recompute modes a plan writes and the runtime reads: the vocabulary of activation
recompute, apart from its pricing (``planner.recompute``) and its search
(``planner.recompute_search``).

A stage recomputes ``"none"``, ``"selective"`` (Korthikanti et al. 2022's selective recompute),
``"full"`` (each layer its own checkpoint region), ``"whole"`` (the stage as one region), or
``"selective:K"`` / ``"full:K"`` on its first K layers only (Megatron-LM's
``recompute_method="block"`` with ``recompute_num_layers``). ``stage_recompute`` reads one
stage's written form, ``parse_modes`` a plan's list. This module is a format: ``planner.layout``
and the runtime (``runtime.backward.activation_checkpoint``) stand on it, and it imports nothing
of the planner's, so reading a plan never loads its search or its cost model.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import NamedTuple


class Recompute(StrEnum):
    """What a stage recomputes in its backward instead of holding from its forward."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"
    #: the stage as one region: ``F`` without autograd, the forward again at ``I`` or ``B``
    #: (priced by ``planner.recompute.whole_stage``); searched in eager steps only
    #: (``planner.recompute_search.as_whole``)
    WHOLE = "whole"


class StageRecompute(NamedTuple):
    """What one stage recomputes: ``mode`` on its first ``layers`` layers (``None``: on every
    layer), the others plain — Megatron-LM's ``recompute_method="block"`` with
    ``recompute_num_layers``: a rank short of a little memory recomputes a few layers, not the
    whole stage. Written ``"full"``, ``"selective"``, ``"none"``, or ``"full:K"`` /
    ``"selective:K"`` for the first K layers (``stage_recompute`` reads it)."""

    mode: Recompute
    layers: int | None = None

    def __str__(self) -> str:
        return self.mode.value if self.layers is None else f"{self.mode.value}:{self.layers}"

    def layer_modes(self, count: int, ends_model: bool = False) -> tuple[Recompute, ...]:
        """The mode of each of a stage's ``count`` layers, in order. Where the stage ends the
        model (``ends_model``), its last layer feeds the loss and stays plain under selective
        recompute: what it would cache is its output (a language model's logits), which the loss
        keeps or casts anyway, so caching it would hold a second copy and spare nothing."""
        k = count if self.layers is None else min(self.layers, count)
        modes = (self.mode,) * k + (Recompute.NONE,) * (count - k)
        if ends_model and modes and modes[-1] is Recompute.SELECTIVE:
            modes = (*modes[:-1], Recompute.NONE)
        return modes

    def layers_of(self, count: int) -> int:
        """How many of a stage's ``count`` layers recompute."""
        if self.mode is Recompute.NONE:
            return 0
        return count if self.layers is None else min(self.layers, count)


#: the legal per-stage values, in words (for error messages)
LEGAL = (
    "'none', 'selective', 'full', 'whole' (the stage recomputed as one region), or "
    "'selective:K' / 'full:K' (the stage's first K layers)"
)


def stage_recompute(value: object, layers: int | None = None) -> StageRecompute:
    """``value`` (``StageRecompute``'s written form) read and checked against the stage's
    ``layers`` where given (K from 1 to the stage's layer count; K equal to it reads as the whole
    stage): a ``ValueError`` names the bad value and the legal ones."""
    if isinstance(value, StageRecompute):
        value = str(value)
    if not isinstance(value, str):
        raise ValueError(f"unknown recompute mode {value!r}; legal: {LEGAL}")
    name, colon, count = value.partition(":")
    if name not in {m.value for m in Recompute}:
        raise ValueError(f"unknown recompute mode {value!r}; legal: {LEGAL}")
    mode = Recompute(name)
    if not colon:
        return StageRecompute(mode)
    if mode in (Recompute.NONE, Recompute.WHOLE) or not count.isdigit() or int(count) < 1:
        raise ValueError(f"unknown recompute mode {value!r}; legal: {LEGAL}")
    k = int(count)
    if layers is not None and k > layers:
        raise ValueError(
            f"recompute {value!r} names {k} layers of a stage that holds {layers}; K is from 1 "
            f"to {layers}"
        )
    return StageRecompute(mode, None if k == layers else k)


def parse_modes(
    values: object, num_stages: int, where: str, stage_layers: Sequence[int] | None = None
) -> tuple[StageRecompute, ...]:
    """Per-stage recompute (``StageRecompute``'s written form), checked against each stage's
    layer count where ``stage_layers`` gives them: a ``ValueError`` names ``where``, the bad value
    and the legal ones."""
    if not isinstance(values, list | tuple) or not all(
        isinstance(v, str | StageRecompute) for v in values
    ):
        raise ValueError(f"{where} must be a list of {LEGAL} per stage, got {values!r}")
    if len(values) != num_stages:
        raise ValueError(
            f"{where} has {len(values)} entries but the plan has {num_stages} stages; give one "
            f"of {LEGAL} per stage"
        )
    counts = list(stage_layers) if stage_layers is not None else [None] * num_stages
    out = []
    for s, (v, n) in enumerate(zip(values, counts)):
        try:
            out.append(stage_recompute(v, n))
        except ValueError as e:
            raise ValueError(f"{where}, stage {s}: {e}") from None
    return tuple(out)


def describe(modes: Sequence[str]) -> str:
    """Per-stage recompute in a few characters: ``none``, or ``f,f3,s,-`` (full, full on the
    first 3 layers, selective, none)."""
    specs = [stage_recompute(m) for m in modes]
    if all(s.mode is Recompute.NONE for s in specs):
        return "none"
    short = {
        Recompute.NONE: "-",
        Recompute.SELECTIVE: "s",
        Recompute.FULL: "f",
        Recompute.WHOLE: "w",
    }
    return ",".join(short[s.mode] + ("" if s.layers is None else str(s.layers)) for s in specs)
