"""A model as an ordered list of layers, cut into pipeline stages by per-stage layer counts.

    stages = pipetrain.split(model_layers, [3, 2, 2, 3])      # 10 layers, 4 stages
    pipe = pipetrain.Pipeline(stages, "1f1b", 8, loss_fn)

Each layer consumes the previous layer's output: a tensor, or a tuple of tensors passed on as
positional arguments. A stage registers every layer under its **global** name (``layers.17`` by
default, or the names given), so ``stage.state_dict()`` keys such as ``layers.17.mlp.up.weight``
are the same whatever the cut — checkpoints written at one pipeline size load at another
(``runtime.checkpoint``). The layers are never changed: where one layer's name is a prefix of
another's (GPT-2's embedding is ``transformer``, its blocks ``transformer.h.3``), the stage puts
a container of its own at that path holding the layer's children, instead of adding the other
layer to the given module. Side inputs (an attention mask, position ids) reach a layer as keyword
arguments when its ``forward`` names them (``runtime.side_inputs``).

The callable form ``split(layer_factory, stage_layers, num_layers=N)`` returns a lazy sequence
of stages: ``Pipeline`` asks only for this rank's stages, so each rank builds only its own layers.
With ``init=``, the factory runs under the meta device (no memory, no initialisation) and each
layer is materialised (``to_empty``) and initialised by ``init(index, layer)`` — seed inside it
per index and the weights do not depend on the cut either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from pipetrain.runtime.backward.activation_checkpoint import recompute_stages
from pipetrain.runtime.named_layers import (
    LayerFactory,
    LazyStages,
    Stage,
    check_counts,
    require_module,
    stage_ranges,
)
from pipetrain.runtime.parallel.tied import shared_across


def split(
    layers: Sequence[nn.Module] | Mapping[str, nn.Module] | LayerFactory,
    stage_layers: Sequence[int],
    *,
    num_layers: int | None = None,
    names: Sequence[str] | Callable[[int], str] | None = None,
    init: Callable[[int, nn.Module], None] | None = None,
    device: torch.device | str | None = None,
    recompute: Sequence[str] | None = None,
) -> Sequence[nn.Module]:
    """Cut a model given as an ordered list of layers into pipeline stages.

    ``layers``: the layers in call order (a sequence; a mapping name → layer, ``nn.ModuleDict``
    included, keeps its names), or
    a factory ``index -> nn.Module`` with ``num_layers=`` (each rank then builds only its own
    layers; with ``init=``, under the meta device, materialised on ``device`` and initialised by
    ``init(index, layer)``). ``stage_layers``: how many consecutive layers each stage gets; they
    must sum to the number of layers and each be at least 1. ``names``: the global layer names
    (default ``layers.<index>``), dotted paths allowed (``model.layers.3``). ``recompute``: per
    stage, activation checkpointing as a plan gives it (``"none"``, ``"selective"``, ``"full"``,
    or ``"selective:K"`` / ``"full:K"`` for the stage's first K layers;
    ``backward.activation_checkpoint.recompute_stages``).
    """
    if recompute is not None:
        plain = split(
            layers, stage_layers, num_layers=num_layers, names=names, init=init, device=device
        )
        return recompute_stages(plain, recompute)
    if isinstance(layers, (Mapping, nn.ModuleDict)):
        if names is not None:
            raise ValueError("layers is a mapping name -> layer; do not pass names= as well")
        names = list(layers.keys())
        layers = list(layers.values())
    if callable(layers) and not isinstance(layers, (nn.Module, Sequence)):
        if num_layers is None:
            raise ValueError("layers is a factory index -> nn.Module; pass num_layers=")
        counts = check_counts(stage_layers, num_layers)
        return LazyStages(layers, counts, _namer(names, num_layers), init, device)
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.Sequential, nn.ModuleList)):
        raise TypeError(
            "layers must be a sequence of nn.Module (an nn.ModuleList or nn.Sequential is one), "
            "a mapping name -> nn.Module, or a factory index -> nn.Module"
        )
    if init is not None:
        raise ValueError("init= applies to the factory form (layers built under the meta device)")
    layers = list(layers)
    if num_layers is not None and num_layers != len(layers):
        raise ValueError(f"num_layers={num_layers} but {len(layers)} layers were given")
    for i, layer in enumerate(layers):
        require_module(layer, i)
    counts = check_counts(stage_layers, len(layers))
    namer = _namer(names, len(layers))
    stages = [Stage([(namer(i), layers[i]) for i in r]) for r in stage_ranges(counts)]
    # One Parameter object in two stages is a tied weight (GPT-2's embedding and head): every
    # stage records the name sets, so ranks that hold only one side still know (runtime.parallel.tied).
    tied = shared_across(stages)
    for stage in stages:
        stage.tied_names = tied
    return stages


def _namer(names, num_layers: int) -> Callable[[int], str]:
    if names is None:
        return lambda i: f"layers.{i}"
    if callable(names):
        return names
    names = list(names)
    if len(names) != num_layers:
        raise ValueError(f"{len(names)} names for {num_layers} layers; give one name per layer")
    if len(set(names)) != len(names):
        raise ValueError("layer names must be unique")
    return names.__getitem__
