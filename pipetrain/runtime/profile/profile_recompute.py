"""The profiler's recompute times: what running a layer checkpointed adds to its backward and to
its forward, under full and under selective recompute — the costs file's ``recompute`` and
``selective_recompute`` (backward), ``recompute_forward`` and ``selective_forward`` (forward),
which the planner's recompute model adds (``planner.recompute``).

Recompute runs (part of) the layer's forward again inside its backward, so it is timed where it
is paid: the layer's backward with the layer wrapped as a plan's recompute wraps it
(``activation_checkpoint.Recomputed``, each layer its own non-reentrant checkpoint) less its
plain backward, both timed alone by the profiler's own timing (``profile_layers._measure``: the
same runner, rounds and clock). The checkpointed forward is not free either: every tensor it
would save passes through the checkpoint's Python pack hook, and selective recompute runs the
whole forward under a dispatch mode that sees every operator — host time, which on a GPU a small
layer's forward waits for; so the forward is timed the same way, checkpointed less plain. A
difference below zero (noise, on a layer with next to nothing to recompute) counts as 0.
Selective recompute (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models") reruns only what it did not keep, so it is timed on its own rather than
taken as a share of the full time.

As for the other times (``profile_layers``: a lone layer leaves the device idle at the edges of
its timed run that a stage fills), windows of ``context`` consecutive layers are then timed as
one stage, plain and checkpointed, and each layer's lone difference is scaled by its window's
ratio (window difference / sum of its layers' lone differences; 1 where either is not
positive). On the last layer the loss runs outside the checkpointed region and is not rerun:
the difference leaves it out, as the runtime does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipetrain.runtime.backward.activation_checkpoint import Recomputed
from pipetrain.runtime.named_layers import Stage, context_windows
from pipetrain.runtime.stage import StageRunner, leaves

#: recompute mode -> the costs file's fields for what it adds to the backward and the forward
FIELDS = {"full": "recompute", "selective": "selective_recompute"}
FORWARD_FIELDS = {"full": "recompute_forward", "selective": "selective_forward"}


@dataclass(frozen=True)
class StageTimer:
    """How the profiler times a stage's full backward: its ``measure`` (``_measure``, given so a
    test can stub the clock), clock and rounds, with the loss on the model's last layer."""

    measure: Callable[..., tuple[dict[str, Any], object]]
    clock: object
    rounds: tuple[int, int, int]
    loss_fn: Callable | None
    target: object
    num_layers: int

    def times(
        self, first: int, named: Sequence[tuple[str, nn.Module]], inputs: tuple[torch.Tensor, ...]
    ) -> tuple[float, float]:
        """Milliseconds of one micro-batch's forward and full backward through ``named`` (layers
        ``first``, ``first + 1``, ...), fed ``inputs``."""
        is_last = first + len(named) == self.num_layers and self.loss_fn is not None
        runner = StageRunner(first, Stage(named), is_last, self.loss_fn if is_last else None)
        cost, _ = self.measure(
            runner,
            leaves(inputs),
            self.target,
            self.clock,
            *self.rounds,
            split=False,
            issue=False,
        )
        return float(cost["forward"]), float(cost["backward"])


def recompute_times(
    layers: Sequence[nn.Module],
    layer_inputs: Sequence[tuple[torch.Tensor, ...]],
    context: int,
    timer: StageTimer,
) -> tuple[dict[str, list[float]], list[dict[str, float]]]:
    """Per costs file field (``recompute``, ``selective_recompute``, ``recompute_forward``,
    ``selective_forward``) each layer's time (ms), and each window's ratios (for the file's
    ``meta``); ``layer_inputs[i]``: layer ``i``'s input."""
    fields = {(m, "backward"): f for m, f in FIELDS.items()}
    fields |= {(m, "forward"): f for m, f in FORWARD_FIELDS.items()}
    lone: dict[tuple[str, str], list[float]] = {key: [] for key in fields}
    for i, layer in enumerate(layers):
        plain = timer.times(i, [("layer", layer)], layer_inputs[i])
        for mode in FIELDS:
            wrapped = timer.times(i, [("layer", Recomputed(layer, mode))], layer_inputs[i])
            lone[mode, "forward"].append(max(0.0, wrapped[0] - plain[0]))
            lone[mode, "backward"].append(max(0.0, wrapped[1] - plain[1]))
    scaled = {key: list(times) for key, times in lone.items()}
    windows: list[dict[str, float]] = []
    for span in context_windows(len(layers), context):
        first, end = span.start, span.stop
        plain = timer.times(first, [(f"layer{i}", layers[i]) for i in span], layer_inputs[first])
        window: dict[str, float] = {"first": first, "end": end}
        for mode in FIELDS:
            chain = [(f"layer{i}", Recomputed(layers[i], mode)) for i in span]
            wrapped = timer.times(first, chain, layer_inputs[first])
            for part, index in (("forward", 0), ("backward", 1)):
                paid = wrapped[index] - plain[index]
                alone = sum(lone[mode, part][i] for i in span)
                ratio = paid / alone if paid > 0 and alone > 0 else 1.0
                for i in span:
                    scaled[mode, part][i] = lone[mode, part][i] * ratio
                window[fields[mode, part]] = ratio
        windows.append(window)
    return {fields[key]: times for key, times in scaled.items()}, windows
