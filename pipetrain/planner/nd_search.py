"""The N-D planner: pipeline × tensor × data parallel under a GPU count and a memory budget.

Megatron-LM users choose ``pp``, ``tp`` and ``dp`` by hand; Alpa (Zheng et al., OSDI 2022),
Galvatron, Aceso and Mist (Zhu et al., EuroSys 2025) search them. Here every shape
``pp × tp × dp = gpus`` with ``tp`` dividing the GPUs of a node (a tensor-parallel group never
leaves its node: its collectives run on every layer) and ``pp`` up to ``MAX_PIPELINE`` (and the
layer count) is priced as:

* **the pipeline**: the layers' costs at degree ``tp`` (``ModelCosts.at_tp``: each rank's share of
  the compute, its collectives, its memory) searched by the pipeline planner for ``pp`` ranks
  (``planner.search``: family, stages per rank, micro-batches, cut, recompute, offload), each of
  its candidates simulated;
* **the data-parallel sync** (``DataParallel``): once a step, after each rank's last backward
  piece (pipetrain syncs once a step, ``runtime.parallel.data_parallel``), nothing of it
  overlapped with compute: DDP all-reduces a rank's gradients (a ring: ``2(dp-1)/dp`` of the
  bytes sent), FSDP2 all-gathers the parameters before the step's first forward and
  reduce-scatters the gradients after its last backward (``(dp-1)/dp`` each) and holds a
  ``1/dp`` share of the optimizer's state and update. The bytes go at ``link_gbs`` while the
  data-parallel group fits in a node (the mesh is pp-major: ``tp`` innermost, then ``dp``) and at
  ``node_link_gbs`` once it spans nodes. A rank's step is its pipeline end plus its sync; the
  job's step the slowest rank's.

The pick is the fitting plan with the least time per global micro-batch (step ÷ (micro-batches ×
dp): the most tokens per second), ties to the smaller ``tp``, then ``pp``. Shapes are searched in
the order of a lower bound on that time (the busiest rank's compute, no bubble: its perfect
share, the heaviest layer, the lightest layers some rank must hold; or the mean rank's compute and
sync) and a shape whose bound exceeds the best found is
not simulated: it cannot win, so the pick equals an exhaustive search's (tests/planner). A shape
whose static memory alone, spread evenly, exceeds the budget is refused before any simulation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipetrain.planner.costs_file import ModelCosts
from pipetrain.planner.costs_file_tp import all_reduce_ms
from pipetrain.planner.judge import DEFAULT_HEADROOM, Candidate, Plan, rank_key
from pipetrain.planner.partition import bounds
from pipetrain.planner.search import NoPlanFits, microbatch_options, search
from pipetrain.schedule.registry import family

#: the deepest pipeline searched
MAX_PIPELINE = 64
#: how the data-parallel replicas sync (``runtime.parallel.data_parallel.KINDS``)
DATA_PARALLEL = ("fsdp", "ddp")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The machines: ``gpus`` in all, ``gpus_per_node`` to a node, and the GB/s one GPU sends at
    within a node and between nodes."""

    gpus: int
    gpus_per_node: int
    link_gbs: float
    node_link_gbs: float

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(
                f"--gpus and --gpus-per-node must be >= 1, got {self.gpus}, {self.gpus_per_node}"
            )
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise ValueError(
                f"--gpus {self.gpus} is not a whole number of nodes of --gpus-per-node "
                f"{self.gpus_per_node}"
            )
        if not (self.link_gbs > 0 and self.node_link_gbs > 0):
            raise ValueError("--link-gbs and --node-link-gbs must be > 0")

    def group_gbs(self, span: int) -> float:
        """The GB/s of a group of ``span`` consecutive GPUs: the node's link while it fits."""
        return self.link_gbs if span <= self.gpus_per_node else self.node_link_gbs


@dataclass(frozen=True)
class Shape:
    pp: int
    tp: int
    dp: int

    def __str__(self) -> str:
        return f"pp {self.pp} x tp {self.tp} x dp {self.dp}"


@dataclass(frozen=True, kw_only=True)
class NdPlan:
    """A pipeline plan at one shape, with what the data-parallel sync adds."""

    shape: Shape
    candidate: Candidate
    #: per pipeline rank: ms of its data-parallel sync after its last action
    sync_ms: tuple[float, ...]
    #: the job's step: the latest rank's end with its sync, from the step's start
    step_ms: float
    #: tokens in one micro-batch (``None``: the costs file's meta does not say)
    tokens_per_microbatch: int | None = None

    @property
    def plan(self) -> Plan:
        return self.candidate.plan

    @property
    def ms_per_global_microbatch(self) -> float:
        return self.step_ms / (self.plan.microbatches * self.shape.dp)

    @property
    def tokens_per_s(self) -> float | None:
        if self.tokens_per_microbatch is None:
            return None
        return self.tokens_per_microbatch / self.ms_per_global_microbatch * 1e3

    def key(self) -> tuple[float, int, int, tuple[object, ...]]:
        return (
            self.ms_per_global_microbatch,
            self.shape.tp,
            self.shape.pp,
            rank_key(self.candidate),
        )

    def to_json(self) -> dict[str, object]:
        """``pipetrain plan --json``: the layout ``train --plan`` runs, and the prediction."""
        out = self.plan.to_json()
        predicted = dict(out["predicted"])  # type: ignore[call-overload]
        predicted |= {
            "pipeline_ms": self.plan.step_ms,
            "step_ms": self.step_ms,
            "sync_ms": max(self.sync_ms),
            "tokens_per_s": self.tokens_per_s,
        }
        return {**out, "predicted": predicted}


@dataclass
class ShapeResult:
    shape: Shape
    #: the shape's best plan (``None``: not simulated or nothing fits; ``why`` says)
    best: NdPlan | None = None
    why: str = ""
    #: the lower bound on ms per global micro-batch the search ordered the shapes by
    bound: float = 0.0
    #: whether its pipeline was searched (else refused or skipped by the bound: ``why``)
    simulated: bool = False


@dataclass
class NdSearch:
    shapes: list[ShapeResult] = field(default_factory=list)
    data_parallel: str = "fsdp"

    @property
    def ranked(self) -> list[NdPlan]:
        return sorted((r.best for r in self.shapes if r.best), key=NdPlan.key)

    @property
    def best(self) -> NdPlan:
        ranked = self.ranked
        if not ranked:
            reasons = "; ".join(f"{r.shape}: {r.why}" for r in self.shapes[:6])
            raise NoPlanFits(f"no pp x tp x dp shape has a plan that fits ({reasons})")
        return ranked[0]

    @property
    def runner_up(self) -> NdPlan | None:
        """The best plan of another shape (``None``: only one shape has a plan); the true
        runner-up where the search kept two (``nd_search(keep=2)``)."""
        ranked = self.ranked
        return ranked[1] if len(ranked) > 1 else None


def shapes(cluster: Cluster, costs: ModelCosts, max_pipeline: int = MAX_PIPELINE) -> list[Shape]:
    """Every ``pp × tp × dp`` of the cluster: ``tp`` a degree the costs give that divides a
    node's GPUs, ``pp`` at most ``max_pipeline`` and the layer count."""
    out = []
    for tp in costs.tp_degrees:
        if cluster.gpus_per_node % tp or cluster.gpus % tp:
            continue
        rest = cluster.gpus // tp
        for pp in range(1, min(rest, max_pipeline, costs.num_layers) + 1):
            if rest % pp == 0:
                out.append(Shape(pp, tp, rest // pp))
    return out


def nd_search(
    costs: ModelCosts,
    cluster: Cluster,
    *,
    memory_gib: float,
    headroom: float = DEFAULT_HEADROOM,
    data_parallel: str = "fsdp",
    microbatches: Sequence[int] | None = None,
    global_batch: int | None = None,
    micro_batch_size: int | None = None,
    schedules: Sequence[str] | None = None,
    max_pipeline: int = MAX_PIPELINE,
    offload: bool = True,
    exhaustive: bool = False,
    keep: int = 1,
) -> NdSearch:
    """Search every shape (the module docstring); ``exhaustive`` simulates every shape, the
    default skips those whose lower bound cannot beat the ``keep``-th best shape found, so the
    best ``keep`` shapes are an exhaustive search's (``keep=2``: the pick and its runner-up, for
    ``--explain``)."""
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(
            f"--data-parallel {data_parallel!r}: legal values {', '.join(DATA_PARALLEL)}"
        )
    if (global_batch is None) != (micro_batch_size is None):
        raise ValueError("give --global-batch and --micro-batch-size together")
    if schedules and not all(family(name).runnable for name in schedules):
        # an overlapped F&B pair may take less than F + B: the bound would not hold
        exhaustive = True
    found = NdSearch(data_parallel=data_parallel)
    usable = memory_gib * (1 - headroom)
    pending = []
    for shape in shapes(cluster, costs, max_pipeline):
        result = ShapeResult(shape)
        found.shapes.append(result)
        at = shape_costs(costs, shape, data_parallel)
        counts, result.why = _microbatches(shape, microbatches, global_batch, micro_batch_size)
        if not counts:
            continue
        static = sum(x.params for x in at.layers) / shape.pp
        if static > usable:
            result.why = f"static memory alone {static:.3g} GiB a rank > {usable:.3g} GiB usable"
            continue
        result.bound = _bound(at, shape, cluster, max(counts), data_parallel)
        pending.append((result, at, counts))
    pending.sort(key=lambda p: (p[0].bound, p[0].shape.tp, p[0].shape.pp))
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    leaders: list[NdPlan] = []  # the best ``keep`` shapes' plans so far, best first
    for result, at, counts in pending:
        if len(leaders) == keep and not exhaustive:
            if result.bound > leaders[-1].ms_per_global_microbatch:
                result.why = f"not simulated: at least {result.bound:.4g} ms per global micro-batch"
                continue
        result.simulated = True
        try:
            pipeline = search(
                at,
                num_ranks=result.shape.pp,
                memory_gib=memory_gib,
                headroom=headroom,
                microbatches=counts,
                schedules=schedules,
                offload=offload,
            )
        except ValueError as e:
            result.why = str(e)
            continue
        result.best = _best_with_sync(pipeline.fitting, at, result.shape, cluster, data_parallel)
        if result.best is None:
            result.why = "nothing fits, recompute and offload included"
            continue
        leaders = sorted([*leaders, result.best], key=NdPlan.key)[:keep]
    return found


def _microbatches(
    shape: Shape,
    given: Sequence[int] | None,
    global_batch: int | None,
    micro_batch_size: int | None,
) -> tuple[tuple[int, ...], str]:
    """The micro-batch counts a shape tries; empty with the reason when none is possible."""
    if global_batch is None or micro_batch_size is None:
        return microbatch_options(shape.pp, given, None, None), ""
    rows = global_batch // micro_batch_size if global_batch % micro_batch_size == 0 else 0
    if rows == 0 or rows % shape.dp:
        return (), (
            f"global batch {global_batch} is not a whole number of micro-batches of "
            f"{micro_batch_size} on each of {shape.dp} replicas"
        )
    return microbatch_options(shape.pp, given, rows // shape.dp, 1), ""


def shape_costs(costs: ModelCosts, shape: Shape, data_parallel: str) -> ModelCosts:
    """The layers at degree ``tp``; under FSDP each rank holding ``1/dp`` of the optimizer's
    state and update (parameters and gradients stay whole through the step: ZeRO-2's)."""
    at = costs.at_tp(shape.tp)
    if data_parallel != "fsdp" or shape.dp == 1:
        return at
    layers = []
    for layer in at.layers:
        grads = at.gradient_gib(layer)
        states = max(layer.params - 2 * grads, 0.0)
        layers.append(
            dataclasses.replace(
                layer,
                params=layer.params - states * (1 - 1 / shape.dp),
                gradients=grads,
                optimizer_workspace=(layer.optimizer_workspace or 0.0) / shape.dp,
            )
        )
    return dataclasses.replace(at, layers=tuple(layers))


def sync_ms(gradient_gib: float, shape: Shape, cluster: Cluster, data_parallel: str) -> float:
    """One rank's data-parallel sync of ``gradient_gib`` (the module docstring)."""
    nbytes = gradient_gib * 2**30
    gbs = cluster.group_gbs(shape.tp * shape.dp)
    # FSDP's all-gather and reduce-scatter send what one all-reduce sends
    return all_reduce_ms(nbytes, shape.dp, gbs)


def _bound(
    at: ModelCosts, shape: Shape, cluster: Cluster, most_microbatches: int, data_parallel: str
) -> float:
    """A lower bound on a shape's ms per global micro-batch, no bubble: the busiest rank's
    compute per micro-batch is at least its perfect share of the layers', at least the heaviest
    layer's (a layer is never split between ranks) and at least the lightest ``⌈L / pp⌉`` layers'
    (some rank holds that many), each piece at the cheapest time any clock gives it (recompute
    only adds); and, the step being at least any rank's compute plus its sync, at least the mean
    rank's compute plus the mean sync."""
    works = []
    for x in at.layers:
        backward = [x.backward]
        if x.split_backward:
            backward.append((x.backward_input or 0.0) + (x.backward_weight or 0.0))
        if x.device_backward is not None:
            backward.append(x.device_backward)
        forward = min(x.forward, x.device_forward if x.device_forward is not None else x.forward)
        works.append(forward + min(backward))
    most_layers = -(-len(works) // shape.pp)
    busiest = max(sum(works) / shape.pp, max(works), sum(sorted(works)[:most_layers]))
    grads = sum(at.gradient_gib(x) for x in at.layers) / shape.pp
    sync = sync_ms(grads, shape, cluster, data_parallel)
    return max(busiest, sum(works) / shape.pp + sync / most_microbatches) / shape.dp


def _best_with_sync(
    fitting: Sequence[Candidate], at: ModelCosts, shape: Shape, cluster: Cluster, dp_kind: str
) -> NdPlan | None:
    """The fitting candidate whose step with its sync is the fastest per global micro-batch
    (``None``: none fits). Its pipeline alone is a lower bound on its step, so candidates are
    priced in that order until the bound passes the best priced."""
    best: NdPlan | None = None
    for c in sorted(fitting, key=lambda c: c.plan.ms_per_microbatch):
        if best is not None and c.plan.ms_per_microbatch / shape.dp > best.ms_per_global_microbatch:
            break
        nd = _with_sync(c, at, shape, cluster, dp_kind)
        if best is None or nd.key() < best.key():
            best = nd
    return best


def _with_sync(
    c: Candidate, at: ModelCosts, shape: Shape, cluster: Cluster, data_parallel: str
) -> NdPlan:
    """``c`` with each rank's sync after its last action, and the shape's sizes in its layout."""
    layout = c.plan.layout
    ends = [c.timeline.start] * shape.pp
    rank_of: dict[int, int] = {}  # stage -> rank, read off the spans (no program to rebuild)
    for span in c.timeline.spans:
        ends[span.rank] = max(ends[span.rank], span.end)
        rank_of[span.action.stage] = span.rank
    blocks = bounds(layout.stage_layers)
    grads = [0.0] * shape.pp
    for s, rank in rank_of.items():
        a, b = blocks[s % len(blocks)]
        grads[rank] += sum(at.gradient_gib(x) for x in at.layers[a:b])
    syncs = tuple(sync_ms(g, shape, cluster, data_parallel) for g in grads)
    step = max(e + s for e, s in zip(ends, syncs)) - c.timeline.start
    plan = dataclasses.replace(c.plan, layout=dataclasses.replace(layout, tp=shape.tp, dp=shape.dp))
    tokens = _tokens(at)
    return NdPlan(
        shape=shape,
        candidate=dataclasses.replace(c, plan=plan),
        sync_ms=syncs,
        step_ms=step,
        tokens_per_microbatch=tokens,
    )


def _tokens(costs: ModelCosts) -> int | None:
    """Tokens per micro-batch from the profile's meta (``micro_batch_size`` × ``seq_len``)."""
    rows, length = costs.meta.get("micro_batch_size"), costs.meta.get("seq_len")
    if isinstance(rows, int) and isinstance(length, int):
        return rows * length
    return None
