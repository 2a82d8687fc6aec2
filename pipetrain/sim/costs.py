"""Per-stage costs for the simulator.

Every cost is one number for all stages or a sequence with one value per stage (a stage is one
chunk as placed: with two stages per rank each is its own chunk). Defaults follow the papers'
unit model: forward = input-gradient = weight-gradient = 1, full backward = input + weight,
an overlapped F&B pair = its forward + its backward (no overlap gain unless measured), no
communication, activation size 1, held unchanged between a split backward's I and W, no
workspace, nothing offloaded (how an OFFLOAD/RELOAD moves ``offload`` of its stage's activation,
whole or layer by layer over the stage's ``layers``, is ``sim.offload_model``'s).

An eager GPU step is also paced by its host: ``host`` (each action's time to issue, per stage)
and ``device`` (its time with its kernels queued ahead of the device), given together, make the
simulator run each rank as a host and a device (``schedule.execute``), the times above being an
action's from an idle start, host and device together. Without them the host costs nothing.

A mixture-of-experts stage also waits for its experts' all-to-all (dispatch, then combine):
``all_to_all`` per micro-batch in the forward, ``all_to_all_backward`` in the backward's
input-gradient half (default: the same bytes again; ``W`` sends nothing). It is a resource of its
own, the expert-parallel link beside the compute: a lone ``F`` lasts its compute plus its
all-to-all, a lone ``B`` or ``I`` likewise, and an overlapped F&B pair hides each half's
all-to-all under the other half's compute (``overlapped_pair``), which is what DualPipe pairs
for. It is device time: with ``host`` and ``device``, the device's times carry it (from the costs
above) and the host's do not.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any

from pipetrain.schedule.action import OpKind
from pipetrain.schedule.timeline import Timeline

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
    workspace: tuple[float, ...]
    weight_workspace: tuple[float, ...] = ()
    static: tuple[float, ...] = ()
    optimizer_workspace: tuple[float, ...] = ()
    host_copy: tuple[float, ...] = ()
    offload: tuple[float, ...] = ()
    layers: tuple[int, ...] = ()
    #: the host's and the device's times (their time fields only); None: no host model
    host: StageCosts | None = None
    device: StageCosts | None = None
    #: per micro-batch, a factor on its F, I and W times (``Costs.microbatch_weights`` and its
    #: ``_i``, ``_w``, resolved); (): all 1
    microbatch_weights: tuple[float, ...] = ()
    microbatch_weights_i: tuple[float, ...] = ()
    microbatch_weights_w: tuple[float, ...] = ()
    #: the expert all-to-all per micro-batch, forward and backward (``Costs.all_to_all``); ():
    #: none
    all_to_all: tuple[float, ...] = ()
    all_to_all_backward: tuple[float, ...] = ()

    def forward_all_to_all(self, stage: int) -> float:
        return self.all_to_all[stage] if self.all_to_all else 0.0

    def backward_all_to_all(self, stage: int) -> float:
        return self.all_to_all_backward[stage] if self.all_to_all_backward else 0.0


def overlapped_pair(
    forward: float, forward_all_to_all: float, backward: float, backward_all_to_all: float
) -> float:
    """How long an overlapped F&B pair lasts when each half (compute, then its all-to-all, in
    many small pieces: every MoE layer's attention, dispatch, experts, combine) runs its
    all-to-all on the link while the other half computes::

        max(forward + backward,                        # the compute stream's work
            forward_all_to_all + backward_all_to_all,  # the link's work
            forward + forward_all_to_all,              # the forward half's own chain
            backward + backward_all_to_all)            # the backward half's own chain

    Each half is a chain that alternates compute and communication; two resources serve the two
    chains. With the pieces small (DeepSeek-V3 §3.2.1, arXiv 2412.19437, splits each chunk into
    attention, dispatch, MLP and combine, and the backward further into input and weight
    halves, to interleave them), that is the preemptive open shop of two jobs on two machines,
    whose least makespan is the largest machine load or job length (Gonzalez and Sahni, 1976):
    the best a perfect interleaving reaches, and what DeepSeek reports ("fully hidden") when
    the compute covers the communication. Never less than the larger half, never more than both
    halves run one after the other; with no all-to-all it is the forward plus the backward, as
    before. A measured ``forward_backward`` replaces it (it includes everything)."""
    return max(
        forward + backward,
        forward_all_to_all + backward_all_to_all,
        forward + forward_all_to_all,
        backward + backward_all_to_all,
    )


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
    #: memory a stage's action uses only while it runs, on top of what is held (temporaries no
    #: activation count covers, e.g. a loss's float32 logits); same unit as ``activation``
    workspace: Cost = 0.0
    #: what a stage's ``W`` uses while it runs, where it differs from ``workspace`` (``None``:
    #: ``workspace``): a layer's temporaries meet the rest of the micro-batch's activation in
    #: ``F``, ``B`` and ``I`` but only what ``W`` still needs in ``W``
    weight_workspace: Cost | None = None
    #: memory a stage holds for the whole step whatever runs (parameters, gradients, optimizer
    #: state); same unit as ``activation``; ``rank_peak_memory`` adds it to the held activations
    static: Cost = 0.0
    #: memory the optimizer's update after the step allocates for a stage's parameters while it
    #: runs, on top of ``static`` (AdamW's multi-tensor update: a parameter-sized temporary); the
    #: step's activations are gone by then, so ``rank_peak_memory`` takes the larger of the two
    optimizer_workspace: Cost = 0.0
    #: time to copy one micro-batch's whole activation of a stage between device and host memory,
    #: one way (activation bytes / host bandwidth); same unit as ``forward``
    host_copy: Cost = 0.0
    #: the fraction of a stage's activation each of its OFFLOAD actions moves, in [0, 1]
    offload: Cost = 0.0
    #: layers in a stage, over which its activation is spread evenly: with more than one, offload
    #: moves its first ⌈offload × layers⌉ layers, each as soon as its forward ends, and brings
    #: them back one ahead of its backward (``sim.offload_model``); 1: the share moves in one copy
    #: after the forward
    layers: Cost = 1
    #: each action's time for the host to issue it, and the device's time for it with its
    #: kernels queued ahead (their ``forward``, ``backward_input``, ``backward_weight``,
    #: ``backward`` and ``forward_backward`` are read); both or neither (the module docstring)
    host: Costs | None = None
    device: Costs | None = None
    #: per micro-batch, a factor on its compute times relative to the stage costs above (an
    #: overlapped pair: its parts', weighted by their costs), e.g. packed documents' attention
    #: work (``planner.varlen``); one value per micro-batch of the simulated program, ``None``:
    #: all 1. Activation sizes, copies and communication stay as given: micro-batches of one
    #: fixed shape hold and send the same tokens, only what attention does with them differs
    microbatch_weights: Sequence[float] | None = None
    #: the factor for I (and the I share of a B) where it differs (``None``: as
    #: ``microbatch_weights``): attention's backward is a different multiple of its forward than
    #: the dense layers' is
    microbatch_weights_i: Sequence[float] | None = None
    #: the factor for W (and the W share of a B) where it differs (``None``: as
    #: ``microbatch_weights``): attention has no weights, so packed documents of one fixed shape
    #: give W the same work whatever their lengths (all 1)
    microbatch_weights_w: Sequence[float] | None = None
    #: a stage's expert-parallel all-to-all per micro-batch in the forward (its MoE layers'
    #: dispatch plus combine, e.g. their bytes over the link), same unit as ``forward``; a lone
    #: F waits for it, an overlapped pair hides it under the other half's compute (the module
    #: docstring, ``overlapped_pair``); not weighted by ``microbatch_weights`` (the same tokens)
    all_to_all: Cost = 0.0
    #: the same in the backward (``B`` or ``I``; ``None``: ``all_to_all``, the same bytes again)
    all_to_all_backward: Cost | None = None

    def __post_init__(self) -> None:
        if (self.host is None) != (self.device is None):
            raise ValueError("costs host and device: give both (an eager host model) or neither")
        for worker in (self.host, self.device):
            if worker is not None and (
                worker.all_to_all != 0.0 or worker.all_to_all_backward is not None
            ):
                raise ValueError(
                    "costs host and device: give all_to_all on the costs themselves (the "
                    "device's times carry it, the host's do not)"
                )
        for name in ("microbatch_weights", "microbatch_weights_i", "microbatch_weights_w"):
            given = getattr(self, name)
            if given is None:
                continue
            weights = list(given)
            if not weights or any(
                isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w <= MAX_COST
                for w in weights
            ):
                raise ValueError(
                    f"costs {name} must be one number in [0, {MAX_COST:g}] per micro-batch, "
                    f"got {weights!r}"
                )
        if self.microbatch_weights is None and (
            self.microbatch_weights_i is not None or self.microbatch_weights_w is not None
        ):
            raise ValueError(
                "costs microbatch_weights_i and microbatch_weights_w need microbatch_weights (F)"
            )

    def scaled(self, factor: float) -> Costs:
        """Every time and size multiplied by ``factor`` (e.g. 1/v to split a rank's share of the
        model into v stages). Only single-number costs scale; per-stage lists are refused."""
        values: dict[str, Any] = {}
        for name in (
            "forward",
            "backward_input",
            "backward_weight",
            "backward",
            "forward_backward",
            "comm",
            "activation",
            "activation_for_weight",
            "workspace",
            "weight_workspace",
            "static",
            "optimizer_workspace",
            "host_copy",
            "all_to_all",
            "all_to_all_backward",
        ):
            value = getattr(self, name)
            if value is not None and not isinstance(value, int | float):
                raise ValueError(
                    f"cost {name}: compare scales one number per cost to every family's stages; "
                    "give one number here (per-stage lists work with simulate)"
                )
            values[name] = None if value is None else value * (1.0 if name == "comm" else factor)
        for name in ("offload", "layers"):
            if not isinstance(getattr(self, name), int | float):
                raise ValueError(f"cost {name}: compare needs one number for every stage")
        return Costs(
            **values,
            offload=self.offload,
            layers=self.layers,
            host=None if self.host is None else self.host.scaled(factor),
            device=None if self.device is None else self.device.scaled(factor),
            microbatch_weights=self.microbatch_weights,
            microbatch_weights_i=self.microbatch_weights_i,
            microbatch_weights_w=self.microbatch_weights_w,
        )

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
        a2a = _resolve("all_to_all", self.all_to_all, num_stages)
        a2a_back = (
            a2a
            if self.all_to_all_backward is None
            else _resolve("all_to_all_backward", self.all_to_all_backward, num_stages)
        )
        device = None if self.device is None else self.device.per_stage(num_stages)
        if device is not None:
            device = dataclasses.replace(device, all_to_all=a2a, all_to_all_backward=a2a_back)
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
            workspace=_resolve("workspace", self.workspace, num_stages),
            weight_workspace=()
            if self.weight_workspace is None
            else _resolve("weight_workspace", self.weight_workspace, num_stages),
            static=_resolve("static", self.static, num_stages),
            optimizer_workspace=_resolve(
                "optimizer_workspace", self.optimizer_workspace, num_stages
            ),
            host_copy=_resolve("host_copy", self.host_copy, num_stages),
            offload=_resolve_fraction(self.offload, num_stages),
            layers=_resolve_layers(self.layers, num_stages),
            host=None if self.host is None else self.host.per_stage(num_stages),
            device=device,
            microbatch_weights=_weights(self.microbatch_weights, None),
            microbatch_weights_i=_weights(self.microbatch_weights_i, self.microbatch_weights),
            microbatch_weights_w=_weights(self.microbatch_weights_w, self.microbatch_weights),
            all_to_all=a2a,
            all_to_all_backward=a2a_back,
        )


def _resolve(name: str, value: Cost, num_stages: int) -> tuple[float, ...]:
    values = [value] * num_stages if isinstance(value, int | float) else list(value)
    if len(values) != num_stages:
        raise ValueError(
            f"cost {name} has {len(values)} values; give one number or one per stage ({num_stages})"
        )
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= MAX_COST:
            raise ValueError(f"cost {name} must be a number in [0, {MAX_COST:g}], got {v!r}")
    return tuple(float(v) for v in values)


def _weights(given: Sequence[float] | None, default: Sequence[float] | None) -> tuple[float, ...]:
    chosen = default if given is None else given
    return () if chosen is None else tuple(float(w) for w in chosen)


def _resolve_fraction(value: Cost, num_stages: int) -> tuple[float, ...]:
    values = _resolve("offload", value, num_stages)
    if any(v > 1 for v in values):
        raise ValueError(f"cost offload is a fraction in [0, 1] per stage, got {list(values)}")
    return values


def _resolve_layers(value: Cost, num_stages: int) -> tuple[int, ...]:
    values = _resolve("layers", value, num_stages)
    if any(v < 1 or v != int(v) for v in values):
        raise ValueError(f"cost layers is a whole number >= 1 per stage, got {list(values)}")
    return tuple(int(v) for v in values)


def per_rank(values: Sequence[float], rank_of_stage: Sequence[int], num_ranks: int) -> list[float]:
    """Per-stage ``values`` summed over each rank's stages (empty ``values``: zeros)."""
    out = [0.0] * num_ranks
    for stage, rank in enumerate(rank_of_stage):
        out[rank] += values[stage] if values else 0.0
    return out


def rank_peak_memory(
    timeline: Timeline, costs: StageCosts, rank_of_stage: Sequence[int]
) -> tuple[float, ...]:
    """Per rank: the static memory of its stages plus the larger of its peak of held activations
    (and running workspace) over the step, as the timeline accounts them, and its stages'
    ``optimizer_workspace`` (the update after the step, when no activation is held); the
    planner's memory model."""
    static = per_rank(costs.static, rank_of_stage, timeline.num_ranks)
    update = per_rank(costs.optimizer_workspace, rank_of_stage, timeline.num_ranks)
    return tuple(
        s + max(a, u) for s, a, u in zip(static, timeline.peak_activations, update, strict=True)
    )


#: larger costs would overflow when a timeline adds up 10^6 of them
MAX_COST = 1e15


def mean_durations(timelines: Sequence[Timeline]) -> dict[tuple[OpKind, int], float]:
    """Mean span duration per (op kind, stage); an overlapped pair is keyed by its forward's
    stage, as the simulator reads it."""
    durations: dict[tuple[OpKind, int], list[float]] = defaultdict(list)
    for tl in timelines:
        for span in tl.spans:
            durations[span.action.kind, span.action.stage].append(span.duration)
    return {key: fmean(v) for key, v in durations.items()}


def measured_costs(timelines: Sequence[Timeline], num_stages: int, **sizes: Any) -> Costs:
    """Simulator costs from measured timelines: the mean duration per (kind, stage).

    This is how "predicted vs measured" closes the loop: simulate the program with the costs its
    own run measured. ``sizes`` (``comm``, ``activation``, ``activation_for_weight``,
    ``workspace``) and the filling-in of missing kinds are ``costs_from_means``'s.
    """
    return costs_from_means(mean_durations(timelines), num_stages, **sizes)


def costs_from_means(
    mean: dict[tuple[OpKind, int], float],
    num_stages: int,
    *,
    comm: Cost = 0.0,
    activation: Cost = 1.0,
    activation_for_weight: Cost | None = None,
    workspace: Cost = 0.0,
) -> Costs:
    """Costs from mean durations per (kind, stage) (``mean_durations``, or a saved run's). A kind
    a stage never ran is filled in so the costs stay consistent (``I``/``W`` as half a ``B``,
    ``B`` as ``I + W``); the program it was measured on never uses it."""

    def per_stage(kind: OpKind) -> list[float | None]:
        return [mean.get((kind, s)) for s in range(num_stages)]

    f: list[float] = []
    i: list[float] = []
    w: list[float] = []
    b: list[float] = []
    for forward, input_half, weight_half, backward in zip(
        *(per_stage(k) for k in (OpKind.F, OpKind.I, OpKind.W, OpKind.B))
    ):
        if backward is None:
            backward = (input_half or 0.0) + (weight_half or 0.0)
        f.append(forward if forward is not None else 0.0)
        i.append(input_half if input_half is not None else backward / 2)
        w.append(weight_half if weight_half is not None else backward / 2)
        b.append(backward)
    pair = per_stage(OpKind.OVERLAP_F_B)
    have_pairs = any(p is not None for p in pair)
    return Costs(
        forward=f,
        backward_input=i,
        backward_weight=w,
        backward=b,
        forward_backward=[p if p is not None else 0.0 for p in pair] if have_pairs else None,
        comm=comm,
        activation=activation,
        activation_for_weight=activation_for_weight,
        workspace=workspace,
    )
