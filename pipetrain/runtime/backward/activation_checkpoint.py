"""Activation checkpointing inside stages: ``torch.utils.checkpoint`` with ``use_reentrant=False``
is exact under every schedule; the reentrant variant is refused at the first step. A plan's
per-stage recompute (``Layout.recompute``) is applied here: ``recompute_stage`` wraps each layer
of a stage in a non-reentrant checkpoint, full or selective (``Recomputed``); ``recompute_layers``
wraps only the layers it names, each in its own mode (``pipetrain.hf.from_pretrained``'s
``recompute=``, per decoder layer).

Non-reentrant checkpointing (saved-tensor hooks: a checkpointed region's saved tensors are
recomputed when a backward unpacks them) keeps the region's nodes in the stage's autograd graph,
so ``B``, and the ``I``/``W`` split of either kind, run through it like through any other nodes.
The reentrant variant hides the region behind one ``CheckpointFunction`` node whose backward runs
a nested ``torch.autograd.backward`` over the recomputed region: that nested call accumulates
weight gradients during ``I`` (through ``AccumulateGrad``, hooks included) and cannot be split,
so it would put gradients in the wrong piece of the step — refused.

Cost (measured in docs/training.md): each backward engine call that reaches a checkpointed node
recomputes its region once. Deferred weight gradients (``defer_weight_grads=True``) need one —
``I`` recomputes, ``W`` uses the inputs the deferred linears stashed — so a micro-batch runs the
region's forward twice. Graph replay's ``W`` calls the engine again (once per group of boundary
nodes), each recomputing: more forward runs, same numbers.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node
from torch.utils.checkpoint import (
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from pipetrain.planner.recompute_modes import Recompute, StageRecompute, stage_recompute
from pipetrain.runtime import torch_compat
from pipetrain.runtime.comm.failures import PipelineRefused
from pipetrain.runtime.named_layers import LazyStages, Stage

REENTRANT_NODE = "CheckpointFunctionBackward"


def refuse_reentrant(roots: Iterable[Node], stage: int) -> None:
    """Walk the stage's graph from ``roots`` (once per stage: its inputs are leaves, so the
    walk stays inside the stage) and refuse a reentrant checkpoint node (``PipelineRefused``, a
    ``ValueError``: every peer raises it too)."""
    seen: set[Node] = set()
    todo = [r for r in roots if r is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == REENTRANT_NODE:
            raise PipelineRefused(
                f"stage {stage} uses torch.utils.checkpoint with use_reentrant=True, whose "
                "backward cannot be split or held back for the schedule; pass "
                "use_reentrant=False (exact under every schedule)"
            )
        todo.extend(child for child, _ in node.next_functions if child is not None)


#: what a stage may recompute (the planner's ``planner.recompute`` modes)
RECOMPUTE_MODES = ("none", "selective", "full")


class Recomputed(nn.Module):
    """Runs ``layer`` inside ``torch.utils.checkpoint.checkpoint`` (``use_reentrant=False``):
    ``"full"`` keeps only the layer's inputs and runs its forward again when a backward reaches
    it; ``"selective"`` also keeps the outputs of matrix products and fused attention
    (``torch_compat.saved_by_selective_recompute``) and recomputes the rest — pointwise ops and
    norms, cheap to run and costly to hold (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models").

    Held only in a ``Stage``'s call list, never registered on it: the stage's parameters,
    buffers and state-dict keys stay those of the layer as given, and the layer is not changed.
    Without autograd (``eval_step``, ``torch.no_grad``) the layer runs plainly: nothing is saved
    that recompute could spare."""

    def __init__(self, layer: nn.Module, mode: str) -> None:
        super().__init__()
        self.layer = layer
        self.mode = mode
        self.context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn
        if mode == "selective":
            ops = torch_compat.saved_by_selective_recompute()
            self.context_fn = functools.partial(create_selective_checkpoint_contexts, ops)
        import_apart("torch._dynamo")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.layer(*args, **kwargs)
        return checkpoint(
            self.layer, *args, use_reentrant=False, context_fn=self.context_fn, **kwargs
        )


def import_apart(name: str) -> None:
    """Import module ``name`` on a thread of its own, unless it is imported already.

    ``checkpoint``'s first call imports ``torch._dynamo``, and one module of that import leaves a
    frame that refers to itself (``torch.fx.wrap`` keeps ``inspect.currentframe()`` in a local):
    that frame, and through its callers every frame below it, stay alive until the garbage
    collector runs. Imported during a step, those callers hold the pipeline — its modules and,
    on a GPU, their memory — after the user dropped it. On a thread of its own the import's
    callers are the thread's, holding nothing of the pipeline's."""
    if name in sys.modules:
        return
    thread = threading.Thread(target=importlib.import_module, args=(name,), daemon=True)
    thread.start()
    thread.join()


def _check_mode(mode: object, where: str) -> None:
    if mode not in RECOMPUTE_MODES:
        raise ValueError(
            f"{where}: unknown recompute mode {mode!r}; legal: "
            + ", ".join(map(repr, RECOMPUTE_MODES))
        )


def recompute_layers(stage: Stage, modes: Mapping[str, str], index: int = 0) -> Stage:
    """``stage`` with each layer named in ``modes`` (its global name, ``Stage.layer_names``)
    wrapped in ``Recomputed`` for its mode; ``"none"`` and layers not named stay as they are.
    Refused with a ``ValueError``: a name the stage does not hold, an unknown mode, and a layer
    already recomputing another way. The wrapper goes into the call list only, so parameter
    names and state-dict keys do not change. Idempotent for the same modes."""
    unknown = [name for name in modes if name not in stage.layer_names]
    if unknown:
        raise ValueError(
            f"stage {index} holds no layer {unknown[0]!r}; its layers: "
            + ", ".join(stage.layer_names)
        )
    for name, mode in modes.items():
        _check_mode(mode, f"stage {index}, layer {name}")
    chain = []
    for name, (layer, accepts) in zip(stage.layer_names, stage.chain, strict=True):
        mode = modes.get(name, "none")
        if isinstance(layer, Recomputed) and mode not in ("none", layer.mode):
            raise ValueError(
                f"stage {index}, layer {name} already recomputes {layer.mode!r}; it cannot also "
                f"recompute {mode!r}"
            )
        if mode != "none" and not isinstance(layer, Recomputed):
            layer = Recomputed(layer, mode)
        chain.append((layer, accepts))
    stage.chain = chain
    return stage


def recomputes(module: nn.Module) -> bool:
    """Whether some layer of ``module`` (a ``Stage``) runs under ``Recomputed``."""
    return isinstance(module, Stage) and any(
        isinstance(layer, Recomputed) for layer, _ in module.chain
    )


def recompute_stage(stage: nn.Module, mode: str, index: int, last: bool = False) -> nn.Module:
    """``stage`` with the layers in its call list wrapped in ``Recomputed`` as ``mode`` says
    (``planner.recompute_modes.StageRecompute``'s written form: ``"full"`` or ``"selective"`` for
    every layer, ``"full:K"`` or ``"selective:K"`` for the first K, the rest plain;
    ``recompute_layers`` does the wrapping: the planner models a stage's recompute layer by
    layer, ``planner.recompute``); ``"whole"`` marks the stage to run its forward without
    autograd and again at its backward (``whole_stage_recompute``; not a planner mode: its
    memory is modelled nowhere yet); ``"none"`` leaves it as it is. On the ``last`` stage,
    selective recompute leaves the stage's last layer plain, the one rule the planner prices
    too (``StageRecompute.layer_modes``: that layer feeds the loss). Refused with a ``ValueError``: an
    unknown mode, K above the stage's layer count, a stage already recomputing another way, and
    a stage none of whose layers holds parameters (nothing a backward would reach to
    recompute). Idempotent for the same mode."""
    if not isinstance(stage, Stage):
        spec = _spec(mode, index, None)
        if spec.mode is Recompute.NONE:
            return stage
        raise ValueError(
            f"stage {index}: recompute {mode!r} applies to a stage of layers (pipetrain.split "
            f"makes them), got a {type(stage).__name__}"
        )
    current = {layer.mode for layer, _ in stage.chain if isinstance(layer, Recomputed)}
    current |= {WHOLE} if stage.recompute_whole else set()
    if mode == WHOLE:
        if current - {WHOLE}:
            raise ValueError(
                f"stage {index} already recomputes {sorted(current)[0]!r}; it cannot also "
                "recompute as a whole"
            )
        _refuse_without_parameters(stage, index, mode)
        stage.recompute_whole = True
        return stage
    spec = _spec(mode, index, len(stage.layer_names))
    if spec.mode is Recompute.NONE:
        return stage
    if current - {spec.mode.value}:
        raise ValueError(
            f"stage {index} already recomputes {sorted(current - {spec.mode.value})[0]!r}; it "
            f"cannot also recompute {mode!r}"
        )
    _refuse_without_parameters(stage, index, mode)
    layer_modes = spec.layer_modes(len(stage.layer_names), ends_model=last)
    chosen = {n: m.value for n, m in zip(stage.layer_names, layer_modes) if m is not Recompute.NONE}
    return recompute_layers(stage, chosen, index)


#: ``recompute_stage``'s mode for a stage recomputed as one region (``whole_stage_recompute``)
WHOLE = "whole"


def _refuse_without_parameters(stage: Stage, index: int, mode: str) -> None:
    if next(stage.parameters(), None) is None:
        raise ValueError(
            f"stage {index} (layers {', '.join(stage.layer_names)}) recomputes {mode!r}, but none "
            "of its layers holds parameters: nothing there is worth checkpointing; plan it with "
            "recompute 'none'"
        )


def _spec(mode: object, index: int, layers: int | None) -> StageRecompute:
    try:
        return stage_recompute(mode, layers)
    except ValueError as e:
        raise ValueError(f"stage {index}: {e}") from None


def recompute_stages(stages: Sequence[nn.Module], modes: Sequence[str]) -> Sequence[nn.Module]:
    """``stages`` (``pipetrain.split``'s) with ``recompute_stage`` applied per ``modes``: all at
    once for a list, so every process refuses the same plan before any waits for another;
    on first access for the lazy stages of a layer factory (each rank builds only its own)."""
    if len(modes) != len(stages):
        raise ValueError(
            f"recompute gives {len(modes)} modes for {len(stages)} stages; give one per stage"
        )
    if isinstance(stages, LazyStages):
        return _LazyRecomputed(stages, tuple(modes))
    last = len(stages) - 1
    return [
        recompute_stage(stage, mode, s, last=s == last)
        for s, (stage, mode) in enumerate(zip(stages, modes))
    ]


class _LazyRecomputed(Sequence[nn.Module]):
    def __init__(self, stages: LazyStages, modes: tuple[str, ...]) -> None:
        self.stages, self.modes = stages, modes

    def __len__(self) -> int:
        return len(self.stages)

    def __getitem__(self, stage):  # type: ignore[override]
        if isinstance(stage, slice):
            return [self[s] for s in range(len(self))[stage]]
        index = range(len(self))[stage]
        last = index == len(self) - 1
        return recompute_stage(self.stages[index], self.modes[index], index, last=last)
