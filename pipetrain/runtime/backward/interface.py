"""How a stage splits its backward into ``I`` (input gradients) and ``W`` (weight gradients).

The zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) run a stage's
backward as two actions, ``I`` then later ``W``; the 1F1B family runs it whole (``B``). A
``StageRunner`` holds one ``BackwardSplit`` and calls it without asking which it is. Two exist:

* ``graph_replay.GraphReplay`` splits any module exactly by replaying graph nodes;
* ``deferred_wgrad.DeferredLinears`` leaves the plain linear layers' weight GEMMs to ``W`` (the
  paper's own way: fewer engine calls, less memory between ``I`` and ``W``), for stages whose
  linears hold most of the parameters.

Each instance belongs to one stage and keeps its state (a plan cache, a mode) on itself, so stages
and pipelines in one process never see each other's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from pipetrain.runtime.backward.activation_checkpoint import recomputes
from pipetrain.runtime.backward.deferred_wgrad import (
    DeferredLinears,
    has_compiled_parts,
    linear_share,
    worth_deferring,
)
from pipetrain.runtime.backward.graph_replay import GraphReplay
from pipetrain.runtime.torch_compat import GradientEdge

_log = logging.getLogger(__name__)


class BackwardSplit(Protocol):
    """Full, input and weight backward of one stage (every argument in the stage's order)."""

    #: whether ``W`` is the linear layers' deferred GEMMs (reported, never branched on)
    defers_linear_weights: bool
    #: whether pieces that no hook needs to see apart are cheaper through ``AccumulateGrad``
    #: (autograd's own in-place accumulation, as unsplit training runs) than quietly
    plain_accumulation: bool

    def call(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> Any:
        """Run the stage's forward so its backward can be split this way."""
        ...

    def backward_full(
        self,
        roots: Sequence[GradientEdge],
        grads: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
        hooks: bool,
    ) -> list[torch.Tensor | None]:
        """``B``: the inputs' gradients; weight gradients into ``.grad`` (through
        ``AccumulateGrad`` and its hooks only with ``hooks``)."""
        ...

    def backward_input(
        self,
        roots: Sequence[GradientEdge],
        grads: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
        last_piece: bool = False,
        through_autograd: bool = False,
    ) -> tuple[list[torch.Tensor | None], Any]:
        """``I``: the inputs' gradients and the work ``backward_weight`` finishes
        (``last_piece``: this micro-batch's ``W`` is the step's last weight piece;
        ``through_autograd``: no hook needs the weight gradients ``I`` takes added quietly, so
        they may go through ``AccumulateGrad`` as they come)."""
        ...

    def backward_weight(self, work: Any, hooks: bool = True) -> None:
        """``W``: finish ``work``'s weight gradients into ``.grad``."""
        ...


def fire_hooks(params: Sequence[torch.Tensor]) -> None:
    """Run post-accumulate-grad hooks of ``params`` once, adding nothing: ``AccumulateGrad`` of a
    zero gradient (only where a gradient exists; an unused parameter's hooks never fire). A stage
    whose split accumulates quietly (``hooks`` off) fires them once afterwards, as tied
    weights do after their sum (``parallel.tied``)."""
    ready = [p for p in params if p.grad is not None]
    if ready:
        torch.autograd.backward(ready, [torch.zeros_like(p) for p in ready])


def choose_split(
    module: nn.Module,
    defer_weight_grads: bool | None,
    stage: int | None = None,
    captured: bool = False,
    splits_backward: bool = True,
) -> BackwardSplit:
    """``DeferredLinears`` with ``defer_weight_grads`` (``None``: where ``worth_deferring``,
    nothing is compiled and, in an eager step, nothing recomputes and the schedule splits the
    stage's backward), else ``GraphReplay``; the
    choice and its reason are logged (INFO) for ``stage``. A compiled stage defaults to graph
    replay: deferral breaks a compiled block's graph around each linear. So does a stage whose
    layers recompute (``Recomputed``) in an eager step: deferral runs each recomputed forward
    through Python autograd functions per linear again, which turns the step host-bound, while
    graph replay runs such a stage's backward whole, in one engine call. In a ``captured`` step
    (a CUDA graph, which replays no host work) the same stage defers wherever it holds a plain
    ``nn.Linear``, however few of its parameters the linears hold: its ``W`` then keeps their
    weight GEMMs for the schedule's bubbles, where graph replay would put the whole backward in
    ``I`` (docs/benchmarks.md, "Activation checkpointing under the pipeline", measures both).
    A stage whose schedule never splits its backward (``splits_backward=False``: only ``B``, the
    1F1B family) defers in an eager step only on request: there deferral would only fuse the
    gradient accumulation into the weight GEMM (Megatron-LM's gradient-accumulation fusion),
    which saves a gradient-sized add per micro-batch but routes every linear's forward and
    backward through a Python autograd function, and on shapes whose kernels are short that
    host work, not the device, sets the step's pace; plain autograd runs the backward in one
    engine call. ``defer_weight_grads=True`` defers in every case."""
    if defer_weight_grads is None and has_compiled_parts(module):
        defer = False
        why = "it holds compiled regions, whose graphs deferral would break around each linear"
    elif defer_weight_grads is None and recomputes(module) and not captured:
        defer = False
        why = (
            "its layers recompute in an eager step, and deferral would run each recomputed "
            "linear through Python again; pass defer_weight_grads=True to defer anyway"
        )
    elif defer_weight_grads is None and not splits_backward and not captured:
        defer = False
        why = (
            "its schedule never splits the backward, so deferral would only fuse the gradient "
            "accumulation, through Python per linear; pass defer_weight_grads=True to fuse anyway"
        )
    elif defer_weight_grads is None and recomputes(module):
        defer = linear_share(module)[0] > 0
        why = (
            "its layers recompute in a step captured as a CUDA graph: any deferred linear leaves "
            "W work for the bubbles, where graph replay would run the whole backward in I"
        )
    elif defer_weight_grads is None:
        defer = worth_deferring(module)
        in_linears, total = linear_share(module)
        share = f"plain nn.Linear layers hold {in_linears} of its {total} trainable elements"
        why = f"{share}; half defers"
    else:
        defer, why = defer_weight_grads, f"defer_weight_grads={defer_weight_grads}"
    way = "deferred linear weight GEMMs" if defer else "graph replay"
    _log.info("stage %s splits its backward by %s (%s)%s", stage, way, why, _caveats(module, defer))
    return DeferredLinears(module) if defer else GraphReplay(whole=recomputes(module))


def _caveats(module: nn.Module, defer: bool) -> str:
    """What of the stage that split leaves in ``I``: linear subclasses (torchao's float8
    linears: their own forward and backward, not deferred) and, under graph replay, compiled
    regions and recomputed layers (their backward runs whole, in ``I``)."""
    subclasses = sorted(
        {type(m).__name__ for m in module.modules() if isinstance(m, nn.Linear)}
        - {nn.Linear.__name__}
    )
    notes = []
    if subclasses:
        notes.append(f"{', '.join(subclasses)} layers: weight gradients in I, not deferred")
    if not defer and has_compiled_parts(module):
        notes.append("compiled regions: their whole backward runs in I")
    if not defer and recomputes(module):
        notes.append(
            "recomputed layers: the whole backward runs in I (replayed, they would recompute twice)"
        )
    return "".join(f"; {n}" for n in notes)
