"""A stage as a module: its layers registered under their global names (``Stage``), built
eagerly or on first access from a layer factory (``LazyStages``), and the per-stage layer counts
a model is cut by (``check_counts``, ``stage_ranges``).

This is what ``runtime.layers.split`` returns, and what the modules that wrap or measure a stage
(``backward.activation_checkpoint``, ``host_offload``, ``profile``, ``hf``) read; it imports
nothing of theirs, so they stand on it without standing on ``split``. The naming rules (global
names, prefixes that hold a container of their own) are ``runtime.layers``'s docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
            require_module(layer, index)
            return layer
        with torch.device("meta"):
            layer = self.factory(index)
        require_module(layer, index)
        layer = layer.to_empty(device=self.device or "cpu")
        with torch.no_grad():
            self.init(index, layer)
        return layer


def context_windows(num_layers: int, size: int) -> list[range]:
    """Consecutive windows of ``size`` layers in order (the last one shorter where ``size`` does
    not divide ``num_layers``), those of one layer left out: what the profiler times as one stage
    to put lone-layer times in context."""
    starts = range(0, num_layers, size)
    spans = [range(first, min(first + size, num_layers)) for first in starts]
    return [span for span in spans if len(span) >= 2]


def require_module(layer: object, index: int) -> None:
    if not isinstance(layer, nn.Module):
        raise TypeError(f"layer {index} is a {type(layer).__name__}, not an nn.Module")
