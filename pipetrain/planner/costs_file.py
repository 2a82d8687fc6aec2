"""The costs file: what a model's layers cost, measured once, planned from many times.

One JSON object, versioned (docs/planning.md is the reference)::

    {"version": 3,
     "layers": [{"name": "embed", "forward": 0.41, "backward_input": 0.10,
                 "backward_weight": 0.52, "activation": 0.25, "params": 3.91}, ...],
     "comm": 0.09}

Times are milliseconds per micro-batch, memory GiB. ``activation`` is what one micro-batch holds
from the layer's forward to the end of its last backward piece; ``params`` is static (parameters,
gradients, optimizer state). ``backward`` may stand in for the ``backward_input`` /
``backward_weight`` pair (then schedules that split the backward cannot be planned from it);
given with the pair, it is the fused backward's own time. ``comm`` is the cross-rank transfer of
one activation, overridable per layer (the transfer of that layer's output). Optional per layer:
``workspace`` (GiB used only while the layer's own forward or backward runs, e.g. a loss's float32
logits) and ``activation_for_weight`` (GiB still held between a split backward's input half and
its weight half; default ``activation``). Optional top level: ``meta`` (free-form provenance:
model, device, dtype, batch shape).

Version 2 adds, optional: per layer ``recompute`` (ms to run the layer's forward again inside its
backward when it is checkpointed; default its ``forward``), ``recompute_activation`` (GiB: what
one micro-batch holds from the layer's forward to its backward when the layer is checkpointed:
its input, and on the last layer what the loss saves), ``selective_activation`` (GiB: the same
under selective recompute, which also keeps matrix products' and attention's outputs) and
``selective_recompute`` (ms: what selective recompute adds to the layer's backward; default a
fixed share of ``recompute``), ``recompute_forward`` and ``selective_forward`` (ms: what running
the layer checkpointed adds to its forward — the checkpoint's bookkeeping; default 0) — the
planner's recompute model, ``planner.recompute``; ``optimizer_workspace`` (GiB the optimizer's
update allocates for the layer's parameters while it runs, after the step's activations are
gone — AdamW's or Adam's default multi-tensor update makes a parameter-sized temporary; default
0); ``host_forward``, ``host_backward``, ``host_backward_input``, ``host_backward_weight`` (ms the
host takes to issue each piece) with ``device_forward`` … ``device_backward_weight`` (ms the
device takes for it with its kernels queued ahead), given together — an eager GPU profile's
two-worker model, where the times above are from an idle start (``sim.costs``); per file
``host_action_ms`` (ms the pipeline runtime's host spends per action besides issuing the action
itself — posting transfers, bookkeeping — on the host that will run it: read off a measured eager
step's host spans, ``Timeline.host_spans``; default 0, used only with the times above) and
``host_bandwidth_gbs`` (GB/s between the device and pinned host memory, measured by the profiler
on CUDA; what the planner times activation offload's copies at); per layer ``per_token`` and
``per_token_sq`` (ms per token and per token squared, given together: one row's forward +
backward for a document of ``n`` tokens is ``per_token·n + per_token_sq·n²``, fitted by
``pipetrain profile --seq-lens`` over several lengths; the attention term is what makes packed
micro-batches unequal, ``planner.varlen``).

Version 3 adds, optional: per layer ``gradients`` (GiB of the layer's gradients: what data
parallel reduces each step; default ``params`` over 2 plus the meta's optimizer's states per
parameter, ``gradient_gib``) and ``tp``, the layer at each tensor-parallel degree above 1
(``planner.costs_file_tp``: compute and collectives per rank, memory per rank, measured or
derived); per file ``tp_link_gbs`` (GB/s each rank of a tensor-parallel group sends at, what the
derived collectives were priced at). Version 3 also holds, optional, the mixture-of-experts
fields (``planner.costs_file_moe``; added to version 3 rather than bumping it: a version 3
reader without them refuses them as unknown fields by name, never misreads them): per layer ``dispatched_bytes`` (bytes each MoE
layer's dispatch moves per micro-batch; 0 or absent: a dense layer) and per file
``ep_link_gbs`` (the expert-parallel link the all-to-all is priced at). Older files still load
(newer fields absent: their defaults); a file that gives a field of a later version is refused,
naming that version. Files are written as version 3.

Anything else is refused with the field's path, so a typo never silently becomes a default.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipetrain.planner.costs_file_tp import TpCost, parse_tp

#: the version this module writes; it reads every version in ``VERSIONS``
VERSION = 3
VERSIONS = (1, 2, 3)

_LAYER_NUMBERS = ("forward", "backward_input", "backward_weight", "backward", "activation")
_LAYER_OPTIONAL = ("comm", "workspace", "activation_for_weight")
#: fields a version 1 file may not give
#: an eager profile's host and device times per piece (``LayerCost.has_issue_times``)
_ISSUE = tuple(
    f"{worker}_{piece}"
    for worker in ("host", "device")
    for piece in ("forward", "backward", "backward_input", "backward_weight")
)
_LAYER_V2 = (
    "recompute",
    "recompute_activation",
    "selective_activation",
    "selective_recompute",
    "recompute_forward",
    "selective_forward",
    "optimizer_workspace",
    *_ISSUE,
    "per_token",
    "per_token_sq",
)
_TOP_V2 = ("host_bandwidth_gbs", "host_action_ms")
_LAYER_V3 = ("gradients", "tp", "dispatched_bytes")
_TOP_V3 = ("tp_link_gbs", "ep_link_gbs")
#: the version that introduced each field a version 1 file may not give
_SINCE = {k: 2 for k in (*_LAYER_V2, *_TOP_V2)} | {k: 3 for k in (*_LAYER_V3, *_TOP_V3)}
_LAYER_KEYS = ("name", *_LAYER_NUMBERS, "params", *_LAYER_OPTIONAL, *_LAYER_V2, *_LAYER_V3)
_TOP_KEYS = ("version", "layers", "comm", "meta", *_TOP_V2, *_TOP_V3)
#: the top-level numbers a file may leave out (``ModelCosts`` fields of the same names)
_TOP_OPTIONAL = (*_TOP_V2, *_TOP_V3)
#: optimizer states per parameter, to estimate a layer's gradients from its static memory
_STATES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0, "none": 0}


class CostsFileError(ValueError):
    """A costs file that does not follow the schema; the message names the field."""


#: how a parse reports a bad field: ``fail(where, problem)`` is the error to raise
Fail = Callable[[str, str], CostsFileError]


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """One layer's measured costs (ms per micro-batch; GiB)."""

    name: str
    forward: float
    #: ``None`` when the file gave only ``backward``
    backward_input: float | None
    backward_weight: float | None
    backward: float
    activation: float
    params: float
    #: transfer of this layer's output to another rank; ``None``: the file's ``comm``
    comm: float | None = None
    workspace: float = 0.0
    #: held between ``backward_input`` and ``backward_weight``; ``None``: ``activation``
    activation_for_weight: float | None = None
    #: ms to run the forward again when checkpointed; ``None``: ``forward``
    recompute: float | None = None
    #: GiB held per micro-batch when the layer is checkpointed; ``None``: not measured
    recompute_activation: float | None = None
    #: GiB held per micro-batch under selective recompute; ``None``: not measured
    selective_activation: float | None = None
    #: ms selective recompute adds to the backward; ``None``: not measured
    selective_recompute: float | None = None
    #: ms full and selective recompute add to the forward; ``None``: not measured (0)
    recompute_forward: float | None = None
    selective_forward: float | None = None
    #: GiB the optimizer's update allocates for this layer's parameters; ``None``: not measured (0)
    optimizer_workspace: float | None = None
    #: ms the host takes to issue each piece, and the device with its kernels queued ahead;
    #: ``None``: not measured (no host model; ``has_issue_times``)
    host_forward: float | None = None
    host_backward: float | None = None
    host_backward_input: float | None = None
    host_backward_weight: float | None = None
    device_forward: float | None = None
    device_backward: float | None = None
    device_backward_input: float | None = None
    device_backward_weight: float | None = None
    #: ms per token and per token squared of one row's forward + backward (``None``: not fitted)
    per_token: float | None = None
    per_token_sq: float | None = None
    #: GiB of the layer's gradients (``None``: not given; ``ModelCosts.gradient_gib``)
    gradients: float | None = None
    #: the layer at each tensor-parallel degree above 1, by degree (``planner.costs_file_tp``)
    tp: tuple[TpCost, ...] = ()
    #: bytes this layer's expert dispatch moves per micro-batch (``None``: a dense layer)
    dispatched_bytes: float | None = None

    @property
    def split_backward(self) -> bool:
        return self.backward_input is not None

    @property
    def recompute_ms(self) -> float:
        return self.forward if self.recompute is None else self.recompute

    @property
    def has_issue_times(self) -> bool:
        """Whether the host and device times of every piece the layer has are given."""
        return all(
            getattr(self, f"{w}_{p}") is not None for w in ("host", "device") for p in self.pieces
        )

    @property
    def pieces(self) -> tuple[str, ...]:
        split = ("backward_input", "backward_weight") if self.split_backward else ()
        return ("forward", "backward", *split)


@dataclass(frozen=True, kw_only=True)
class ModelCosts:
    """A validated costs file."""

    layers: tuple[LayerCost, ...]
    comm: float = 0.0
    meta: Mapping[str, Any] = field(default_factory=dict)
    #: GB/s between the device and pinned host memory (``None``: not measured)
    host_bandwidth_gbs: float | None = None
    #: ms the runtime's host spends per action beyond the action's own issue (``None``: 0)
    host_action_ms: float | None = None
    #: GB/s a tensor-parallel group's derived collectives were priced at (``None``: none derived)
    tp_link_gbs: float | None = None
    #: GB/s the expert all-to-all moves at (``None``: not priced; ``planner.costs_file_moe``)
    ep_link_gbs: float | None = None
    #: the step runs as a CUDA graph, where a recomputing stage splits its backward as any other
    #: (``planner.recompute``); how the step runs, not part of the file
    captured: bool = False

    def __post_init__(self) -> None:
        if not self.layers:
            raise CostsFileError("layers: a model needs at least one layer")
        if self.captured and self.has_issue_times:
            raise CostsFileError("a captured step's costs have no host times: for_captured_step()")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def split_backward(self) -> bool:
        """Whether every layer has the input/weight pair (needed by zero-bubble schedules)."""
        return all(layer.split_backward for layer in self.layers)

    @property
    def has_issue_times(self) -> bool:
        """Whether every layer has its host and device times (an eager GPU profile)."""
        return all(layer.has_issue_times for layer in self.layers)

    def without_issue_times(self) -> ModelCosts:
        """The costs without host and device times: a step replayed as a CUDA graph issues
        nothing per action, so its host paces nothing."""
        cleared: dict[str, Any] = dict.fromkeys(_ISSUE)
        layers = tuple(dataclasses.replace(layer, **cleared) for layer in self.layers)
        return dataclasses.replace(self, layers=layers, host_action_ms=None)

    def for_captured_step(self) -> ModelCosts:
        """The costs of a step replayed as a CUDA graph: no host times, and recomputing
        stages split (``captured``)."""
        return dataclasses.replace(self.without_issue_times(), captured=True)

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degrees every layer has an entry for, 1 (the layers' own) first."""
        common = set.intersection(*({e.degree for e in x.tp} for x in self.layers))
        return (1, *sorted(common))

    def at_tp(self, degree: int) -> ModelCosts:
        """The costs one rank of a tensor-parallel group of ``degree`` sees: each layer's
        entry of that degree, its collectives added to the forward and to the backward's input
        half (where a Megatron-style backward all-reduces the input gradient); the host model,
        measured at degree 1, dropped. ``ValueError`` names a degree some layer lacks."""
        if degree == 1:
            return self
        if degree not in self.tp_degrees:
            raise ValueError(
                f"tensor-parallel degree {degree}: the costs file gives degrees "
                f"{', '.join(map(str, self.tp_degrees))} for every layer; profile with --tp"
            )
        cleared: dict[str, Any] = dict.fromkeys(_ISSUE)
        layers = []
        for layer in self.without_issue_times().layers:
            e = next(x for x in layer.tp if x.degree == degree)
            share = e.params / layer.params if layer.params else 0.0  # what this rank holds
            layers.append(
                dataclasses.replace(
                    layer,
                    forward=e.forward + e.forward_collective,
                    backward_input=e.backward_input + e.backward_collective
                    if layer.split_backward
                    else None,
                    backward_weight=e.backward_weight if layer.split_backward else None,
                    backward=e.backward + e.backward_collective,
                    activation=e.activation,
                    params=e.params,
                    gradients=e.gradients
                    if e.gradients is not None
                    else self.gradient_gib(layer) * share,
                    optimizer_workspace=(layer.optimizer_workspace or 0.0) * share,
                    tp=(),
                    **cleared,
                )
            )
        return dataclasses.replace(self, layers=tuple(layers), host_action_ms=None)

    def gradient_gib(self, layer: LayerCost) -> float:
        """GiB of ``layer``'s gradients: given, or its static memory over parameters,
        gradients and the meta's optimizer's states per parameter (AdamW when not named)."""
        if layer.gradients is not None:
            return layer.gradients
        return layer.params / (2 + _STATES.get(str(self.meta.get("optimizer", "adamw")), 2))

    def layer_comm(self, index: int) -> float:
        own = self.layers[index].comm
        return self.comm if own is None else own

    def to_json(self) -> dict[str, Any]:
        layers = []
        for layer in self.layers:
            entry: dict[str, Any] = {"name": layer.name, "forward": layer.forward}
            if layer.split_backward:
                entry["backward_input"] = layer.backward_input
                entry["backward_weight"] = layer.backward_weight
            entry["backward"] = layer.backward
            entry["activation"] = layer.activation
            entry["params"] = layer.params
            if layer.comm is not None:
                entry["comm"] = layer.comm
            if layer.workspace:
                entry["workspace"] = layer.workspace
            if layer.activation_for_weight is not None:
                entry["activation_for_weight"] = layer.activation_for_weight
            for key in _LAYER_V2:
                if getattr(layer, key) is not None:
                    entry[key] = getattr(layer, key)
            if layer.gradients is not None:
                entry["gradients"] = layer.gradients
            if layer.tp:
                entry["tp"] = [e.to_json() for e in layer.tp]
            if layer.dispatched_bytes is not None:
                entry["dispatched_bytes"] = layer.dispatched_bytes
            layers.append(entry)
        out: dict[str, Any] = {"version": VERSION, "layers": layers, "comm": self.comm}
        for key in _TOP_OPTIONAL:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.meta:
            out["meta"] = dict(self.meta)
        return out


def parse_costs(data: object, source: str = "costs") -> ModelCosts:
    """Validate a decoded costs file; ``CostsFileError`` names the first bad field."""

    def fail(where: str, problem: str) -> CostsFileError:
        return CostsFileError(f"{source}: {where}: {problem}")

    if not isinstance(data, dict):
        raise fail("top level", f"expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        raise fail(unknown[0], f"unknown field; legal fields: {', '.join(_TOP_KEYS)}")
    known = " or ".join(map(str, VERSIONS))
    if "version" not in data:
        raise fail("version", f"missing; this reader knows version {known}")
    version = data["version"]
    if version not in VERSIONS or isinstance(version, bool):
        raise fail("version", f"expected {known}, got {version!r}")
    newer = [(k, _SINCE[k]) for k in _TOP_KEYS if _SINCE.get(k, 1) > version and k in data] + [
        (f"layers[{i}].{k}", _SINCE[k])
        for i, raw in enumerate(data.get("layers") or [])
        if isinstance(raw, dict)
        for k in _LAYER_KEYS
        if _SINCE.get(k, 1) > version and k in raw
    ]
    if newer:
        (where, since) = newer[0]
        raise fail(
            where, f"a version {since} field in a version {version} file; write version {since}"
        )
    comm = _number(data.get("comm", 0.0), "comm", fail)
    optional: dict[str, Any] = {k: _number(data[k], k, fail) for k in _TOP_OPTIONAL if k in data}
    if optional.get("ep_link_gbs") == 0:
        raise fail("ep_link_gbs", "expected GB/s > 0, got 0")
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise fail("meta", f"expected a JSON object, got {type(meta).__name__}")
    raw_layers = data.get("layers")
    if not isinstance(raw_layers, list) or not raw_layers:
        raise fail("layers", "expected a non-empty list of layer objects")
    return ModelCosts(
        layers=tuple(_layer(raw, f"layers[{i}]", fail) for i, raw in enumerate(raw_layers)),
        comm=comm,
        meta=meta,
        **optional,
    )


def _layer(raw: object, where: str, fail: Fail) -> LayerCost:
    if not isinstance(raw, dict):
        raise fail(where, f"expected a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_LAYER_KEYS))
    if unknown:
        raise fail(
            f"{where}.{unknown[0]}", f"unknown field; legal fields: {', '.join(_LAYER_KEYS)}"
        )
    name = raw.get("name", where)
    if not isinstance(name, str) or not name:
        raise fail(f"{where}.name", f"expected a non-empty string, got {name!r}")

    def need(key: str) -> float:
        if key not in raw:
            raise fail(f"{where}.{key}", "missing")
        return _number(raw[key], f"{where}.{key}", fail)

    def maybe(key: str) -> float | None:
        return _number(raw[key], f"{where}.{key}", fail) if key in raw else None

    i, w, b = maybe("backward_input"), maybe("backward_weight"), maybe("backward")
    if (i is None) != (w is None):
        missing = "backward_weight" if w is None else "backward_input"
        raise fail(
            f"{where}.{missing}", "missing: give backward_input and backward_weight together"
        )
    if i is None and b is None:
        raise fail(
            f"{where}.backward", "missing: give backward, or backward_input and backward_weight"
        )
    layer = LayerCost(
        name=name,
        forward=need("forward"),
        backward_input=i,
        backward_weight=w,
        backward=b if b is not None else i + w,  # type: ignore[operator]
        activation=need("activation"),
        params=need("params"),
        comm=maybe("comm"),
        workspace=maybe("workspace") or 0.0,
        activation_for_weight=maybe("activation_for_weight"),
        recompute=maybe("recompute"),
        recompute_activation=maybe("recompute_activation"),
        selective_activation=maybe("selective_activation"),
        selective_recompute=maybe("selective_recompute"),
        recompute_forward=maybe("recompute_forward"),
        selective_forward=maybe("selective_forward"),
        optimizer_workspace=maybe("optimizer_workspace"),
        **{k: maybe(k) for k in _ISSUE},
        per_token=maybe("per_token"),
        per_token_sq=maybe("per_token_sq"),
        gradients=maybe("gradients"),
        tp=parse_tp(raw["tp"], f"{where}.tp", fail) if "tp" in raw else (),
        dispatched_bytes=maybe("dispatched_bytes"),
    )
    if (layer.per_token is None) != (layer.per_token_sq is None):
        missing = "per_token" if layer.per_token is None else "per_token_sq"
        raise fail(f"{where}.{missing}", "missing: give per_token and per_token_sq together")
    given = [k for k in _ISSUE if k in raw]
    if given and not layer.has_issue_times:
        missing = next(
            f"{w}_{p}" for w in ("host", "device") for p in layer.pieces if f"{w}_{p}" not in raw
        )
        raise fail(f"{where}.{missing}", "missing: give the host and device times of every piece")
    return layer


#: larger numbers are not milliseconds or GiB a pipeline could have
_LARGEST = 1e12


def _number(value: object, where: str, fail: Fail) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise fail(where, f"expected a number >= 0, got {value!r}")
    if not (0 <= value <= _LARGEST) or math.isnan(value):
        raise fail(where, f"expected a finite number in [0, {_LARGEST:g}], got {value!r}")
    return float(value)


def load_costs(path: str | Path) -> ModelCosts:
    """Read and validate a costs file; ``CostsFileError`` for unreadable or bad files."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise CostsFileError(f"{path}: cannot read: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CostsFileError(f"{path}: not JSON: {e.msg} at line {e.lineno}") from None
    return parse_costs(data, str(path))


def save_costs(costs: ModelCosts, path: str | Path) -> None:
    Path(path).write_text(json.dumps(costs.to_json(), indent=1) + "\n")


def uniform_costs(
    names: Sequence[str], *, forward: float = 1.0, backward: float = 2.0, activation: float = 1.0
) -> ModelCosts:
    """Equal layers with the I/W pair split evenly (for tests and examples)."""
    return ModelCosts(
        layers=tuple(
            LayerCost(
                name=n,
                forward=forward,
                backward_input=backward / 2,
                backward_weight=backward / 2,
                backward=backward,
                activation=activation,
                params=0.0,
            )
            for n in names
        )
    )
