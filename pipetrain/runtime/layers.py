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

from pipetrain.runtime import side_inputs

LayerFactory = Callable[[int], nn.Module]


class Stage(nn.Module):
    """Consecutive layers of a model run in order, each registered under its global name."""

    def __init__(self, named_layers: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        if not named_layers:
            raise ValueError("a stage needs at least one layer")
        for name, layer in named_layers:
            _register(self, name, layer)
        # A plain list (not registered again): the call order, with the keywords each accepts.
        self.chain: list[tuple[nn.Module, frozenset[str] | None]] = [
            (layer, side_inputs.keywords(layer)) for _, layer in named_layers
        ]
        self.layer_names = tuple(name for name, _ in named_layers)
        #: name sets of parameters this stage shares with other stages (``runtime.parallel.tied``)
        self.tied_names: list[tuple[str, ...]] = []
        #: recomputed as a whole in the backward (``backward.whole_stage_recompute``)
        self.recompute_whole = False

    def forward(self, *args, **side):
        out = args
        for layer, accepts in self.chain:
            kwargs = side if accepts is None else {k: v for k, v in side.items() if k in accepts}
            result = layer(*out, **kwargs)
            out = result if isinstance(result, tuple) else (result,)
        return out[0] if len(out) == 1 else out

    def train(self, mode: bool = True):
        super().train(mode)
        for layer, _ in self.chain:  # a layer held through a path container is not registered
            layer.train(mode)
        return self

    def accepted_keywords(self) -> frozenset[str] | None:
        """Keyword arguments some layer's ``forward`` takes (``None``: a layer takes any)."""
        names: set[str] = set()
        for _, accepts in self.chain:
            if accepts is None:
                return None
            names |= accepts
        return frozenset(names)


class _Path(nn.Module):
    """A container on the way to a layer's name (``model`` in ``model.layers.3``)."""


def _register(root: nn.Module, name: str, layer: nn.Module) -> None:
    """``root.<a>.<b>.<c> = layer`` for ``name = "a.b.c"``, making containers on the way.

    A given layer never gains children: where the path runs through a layer (its name is a
    prefix of this one's), a container holding that layer's children takes its place."""
    parts = name.split(".")
    if not all(parts):
        raise ValueError(f"layer name {name!r} has an empty part; use names like 'layers.3'")
    node = root
    for depth, part in enumerate(parts[:-1]):
        child = node._modules.get(part)
        if child is None:
            child = _Path()
        elif not isinstance(child, _Path):
            child = _holding(child, ".".join(parts[: depth + 1]))
        node.add_module(part, child)
        node = child
    existing = node._modules.get(parts[-1])
    if existing is None:
        node.add_module(parts[-1], layer)
    elif isinstance(existing, _Path):  # a later layer named like a path already made
        _adopt(existing, layer, name)
    else:
        raise ValueError(f"two layers are named {name!r}; layer names must be unique")


def _holding(layer: nn.Module, name: str) -> _Path:
    path = _Path()
    _adopt(path, layer, name)
    return path


def _adopt(path: _Path, layer: nn.Module, name: str) -> None:
    """Register ``layer``'s children (the same objects) on ``path``. Its own parameters and
    buffers are refused: moving or sharding replaces such tensors on the module that holds
    them, and the layer, which is what runs, would keep the old ones."""
    if next(layer.parameters(recurse=False), None) is not None or (
        next(layer.buffers(recurse=False), None) is not None
    ):
        raise ValueError(
            f"layer {name!r} holds parameters or buffers of its own and other layers are named "
            f"under it ({name}.…); give the layers names that do not nest, or keep its tensors "
            "in submodules"
        )
    for child_name, child in layer.named_children():
        if child_name in path._modules:
            raise ValueError(
                f"layer {name!r} has a child {child_name!r} and another layer is named "
                f"{name}.{child_name}; layer names must be unique"
            )
        path.add_module(child_name, child)


def check_counts(stage_layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """The per-stage layer counts, or a ``ValueError`` naming both numbers."""
    counts = tuple(stage_layers)
    if not counts:
        raise ValueError("stage_layers is empty; give one layer count per stage")
    low = [c for c in counts if not isinstance(c, int) or c < 1]
    if low:
        raise ValueError(
            f"stage_layers={list(counts)} has a count below 1 ({low[0]}); every stage needs at "
            f"least one of the {num_layers} layers"
        )
    if sum(counts) != num_layers:
        raise ValueError(
            f"stage_layers={list(counts)} sums to {sum(counts)} but the model has {num_layers} "
            "layers; the counts must sum to the number of layers (no layer dropped or duplicated)"
        )
    return counts


def stage_ranges(counts: Sequence[int]) -> list[range]:
    """Layer indices of each stage: consecutive, in order."""
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


class LazyStages(Sequence):
    """Stages built on first access from a layer factory (``Pipeline`` reads only its own)."""

    def __init__(
        self,
        factory: LayerFactory,
        counts: tuple[int, ...],
        names: Callable[[int], str],
        init: Callable[[int, nn.Module], None] | None,
        device: torch.device | str | None,
    ) -> None:
        self.factory, self.counts, self.names = factory, counts, names
        self.init, self.device = init, device
        self.ranges = stage_ranges(counts)

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, stage):  # type: ignore[override]
        if isinstance(stage, slice):
            return [self[s] for s in range(len(self))[stage]]
        if not -len(self) <= stage < len(self):
            raise IndexError(f"stage {stage} out of range: there are {len(self)} stages")
        return Stage([(self.names(i), self._build(i)) for i in self.ranges[stage]])

    def _build(self, index: int) -> nn.Module:
        if self.init is None:
            layer = self.factory(index)
            _require_module(layer, index)
            return layer
        with torch.device("meta"):
            layer = self.factory(index)
        _require_module(layer, index)
        layer = layer.to_empty(device=self.device or "cpu")
        with torch.no_grad():
            self.init(index, layer)
        return layer


def _require_module(layer: object, index: int) -> None:
    if not isinstance(layer, nn.Module):
        raise TypeError(f"layer {index} is a {type(layer).__name__}, not an nn.Module")


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
        from pipetrain.runtime.backward.activation_checkpoint import recompute_stages

        plain = split(layers, stage_layers, num_layers=num_layers, names=names, init=init,
                      device=device)  # fmt: skip
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
        _require_module(layer, i)
    counts = check_counts(stage_layers, len(layers))
    namer = _namer(names, len(layers))
    stages = [Stage([(namer(i), layers[i]) for i in r]) for r in stage_ranges(counts)]
    # One Parameter object in two stages is a tied weight (GPT-2's embedding and head): every
    # stage records the name sets, so ranks that hold only one side still know (runtime.parallel.tied).
    from pipetrain.runtime.parallel.tied import shared_across

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
