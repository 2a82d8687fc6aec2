"""The simulator's model of activation offload: what a stage's copies cost in time and what they
save in memory, whole or layer by layer.

PipeOffload (Wan et al. 2025, arXiv 2503.01328) moves a micro-batch's activations to host memory
while they wait for their backward; Megatron-Core's and torchtitan's activation offload move each
module's saved tensors as soon as that module's forward is done and bring them back one module
ahead of its backward, so only a couple of layers of a micro-batch are on the device at once. The
runtime does the second where a stage is a list of layers (``runtime.host_offload``). Per stage
``s`` with activation ``a``, ``host_copy`` ``c`` (the whole activation one way), fraction ``f``,
``layers`` ``L``, forward ``F`` and backward ``B`` (``I`` for an input-gradient half):

* ``L = 1`` — the share moves in one copy: an OFFLOAD after the forward lasts ``f·c`` and frees
  ``f·a`` when it ends; the RELOAD lasts as long, takes ``f·a`` back when it starts, and the
  backward waits for it to end.
* ``L > 1`` — the first ``n = ⌈f·L⌉`` layers move (``schedule.offload.offloaded_layers``), each
  ``a/L`` copied in ``t = c/L``. The OFFLOAD streams during the forward: it starts when the first
  layer's forward ends (``early = F·(L−1)/L`` before the forward's end) and ends no sooner than
  ``t`` after the last offloaded layer's forward. The forward holds the kept layers plus a window
  of ``max(RESIDENT_LAYERS, copy backlog at its end)`` offloaded layers (at most ``n``), which
  leave one at a time, the last when the OFFLOAD ends and each earlier one ``max(t, F/L)`` before
  the next; the rest of the ``n`` layers is never held. Where a program has copies, each forward
  of a stage of layers allocates layer by layer over its span (``Timeline``). The RELOAD (``n·t``) brings
  back the last offloaded layer first and the others one ahead of the backward: it takes one
  layer back when it starts while the kept layers wait for the backward, ``RESIDENT_LAYERS`` where
  fewer than that are kept (once the kept layers are consumed, the backward reads one reloaded
  layer while the next comes back; the backward still frees its activation at its end, as
  without offload, so this bounds what it holds). The backward, which runs its ``L − n`` kept
  layers first, may start ``need = max(t − (L−n)·b, n·t − (L−1)·b)`` after the RELOAD starts
  (``b = B/L``): early enough that every reloaded layer is back when its backward begins, with the
  copies back to back.

``sim.simulate.reload_timing`` gives ``schedule.offload``'s just-in-time rule the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.schedule.copy_engine import CopyPlan
from pipetrain.schedule.offload import RESIDENT_LAYERS, offloaded_layers
from pipetrain.schedule.timeline import OffloadMemory
from pipetrain.sim.costs import StageCosts


@dataclass(frozen=True)
class StageOffload:
    """One stage's offload under the model (module docstring), in the costs' units: how its
    copies run on the copy engine, and what they move (``Timeline``'s memory accounting)."""

    plan: CopyPlan
    memory: OffloadMemory

    @property
    def moved(self) -> float:
        return self.memory.moved

    @property
    def out(self) -> float:
        return self.memory.out

    @property
    def back(self) -> float:
        return self.memory.back


def stage_offload(costs: StageCosts, stage: int) -> StageOffload:
    """The model's numbers for ``stage`` (nothing moved where its fraction is 0)."""
    fraction = costs.offload[stage] if costs.offload else 0.0
    a = costs.activation[stage]
    c = costs.host_copy[stage] if costs.host_copy else 0.0
    layers = costs.layers[stage] if costs.layers else 1
    if fraction <= 0:
        return StageOffload(CopyPlan(0.0, 0.0), OffloadMemory(0.0, 0.0, 0.0, layers=layers))
    if layers == 1:
        moved, copy = fraction * a, fraction * c
        return StageOffload(CopyPlan(copy, copy), OffloadMemory(moved, moved, moved))
    n = offloaded_layers(fraction, layers)
    t, per_layer = c / layers, a / layers
    forward = costs.forward[stage]
    step = forward / layers  # one layer's forward
    offload_time = max(n * t, (n - 1) * step + t)
    early = forward - step
    backlog = n - early / t if t > 0 else 0.0
    window_out = min(n, max(RESIDENT_LAYERS, backlog))
    # the RELOAD brings back one layer while the kept ones wait for the backward; once those are
    # consumed, the backward reads one reloaded layer while the next comes back
    window_in = min(n, max(RESIDENT_LAYERS - 1, RESIDENT_LAYERS - (layers - n)))

    def need(backward: float) -> float:
        b = backward / layers
        return max(t - (layers - n) * b, n * t - (layers - 1) * b)

    plan = CopyPlan(
        offload=offload_time,
        reload=n * t,
        early=early,
        need_b=need(costs.backward[stage]),
        need_i=need(costs.backward_input[stage]),
    )
    # the forward's window leaves a layer at a time as each copy ends: back to back where the
    # copies are the bottleneck, a layer's forward apart where compute is (whichever is longer)
    memory = OffloadMemory(
        moved=n * per_layer,
        out=window_out * per_layer,
        back=window_in * per_layer,
        layer=per_layer,
        gap=max(t, step),
        layers=layers,
    )
    return StageOffload(plan, memory)


def offload_stages(costs: StageCosts, num_stages: int) -> tuple[StageOffload, ...]:
    return tuple(stage_offload(costs, s) for s in range(num_stages))
