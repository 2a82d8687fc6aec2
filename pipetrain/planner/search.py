"""The planner: schedule family × stages per rank × micro-batches × layer boundaries, each
candidate simulated, the fastest per micro-batch that fits the memory budget chosen.

This module walks the shapes (family, stages per rank ``v``, micro-batches ``M``), each distinct
program once (with one stage per rank interleaved 1F1B builds 1F1B's program and interleaved ZB
ZB-H1's: such a shape is skipped under the later family's name); ``cuts`` says
which layer boundaries are simulated for each and refines the best, ``judge`` how one cut is
simulated and scored (docs/planning.md). When no candidate fits, the shapes are tried again with
stages recomputing their activations (``recompute_search``) and, where the costs file gives a
host bandwidth, offloading them (``offload_search``): a plan recomputes or offloads only when
memory asks for it, and ``NoPlanFits`` means that not even full recompute (with full offload,
where it can be planned) on every stage fits.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pipetrain.planner.costs_file import ModelCosts, load_costs, parse_costs
from pipetrain.planner.cuts import candidates, refine
from pipetrain.planner.judge import (
    DEFAULT_HEADROOM,
    Budget,
    Candidate,
    Plan,
    family_key,
    rank_key,
    simulate_plan,
    stage_costs,
)
from pipetrain.planner.offload_search import offload_candidates
from pipetrain.planner.recompute_modes import describe
from pipetrain.planner.recompute_search import recompute_candidates
from pipetrain.schedule.action import OpKind
from pipetrain.schedule.gc_pause import without_gc
from pipetrain.schedule.program import Program
from pipetrain.schedule.registry import FAMILIES, Family, build_schedule, family

__all__ = [
    "DEFAULT_HEADROOM",
    "NoPlanFits",
    "Plan",
    "Search",
    "plan",
    "search",
    "simulate_plan",
    "stage_costs",
]

#: stages per rank tried for the families that take any number
DEFAULT_STAGES_PER_RANK = (1, 2, 3, 4)
#: micro-batch counts tried (as multiples of the ranks) when none are given
DEFAULT_MICROBATCH_FACTORS = (1, 2, 4)


class NoPlanFits(ValueError):
    """No candidate fits the memory budget, recompute included; the message names the smallest
    peak reached and the budget."""


@dataclass
class Search:
    """Every simulated candidate, and the shapes that could not be tried (with the reason)."""

    candidates: list[Candidate] = field(default_factory=list)
    skipped: list[tuple[str, int, int, str]] = field(default_factory=list)
    #: whether the shapes were tried again with recompute (nothing fitted without)
    recompute_tried: bool = False
    #: whether they were also tried with activation offload (a measured host bandwidth)
    offload_tried: bool = False

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.plan.fits]

    @property
    def best(self) -> Candidate:
        """The fastest fitting candidate per micro-batch; ``NoPlanFits`` when none fits."""
        fitting = self.fitting
        if not fitting:
            raise NoPlanFits(self._nothing_fits())
        return min(fitting, key=rank_key)

    def best_per_family(self) -> list[Candidate]:
        """Each family's best candidate (fitting ones first), fastest first."""
        best: dict[str, Candidate] = {}
        for c in self.candidates:
            name = c.plan.schedule
            if name not in best or family_key(c) < family_key(best[name]):
                best[name] = c
        return sorted(best.values(), key=family_key)

    def near(self, fraction: float) -> list[Candidate]:
        """Fitting candidates whose predicted time per micro-batch is within ``fraction`` of the
        pick's (the pick first), one per distinct plan."""
        pick = self.best.plan.ms_per_microbatch
        seen, out = set(), []
        for c in sorted(self.fitting, key=rank_key):
            key = (
                c.plan.schedule,
                c.plan.stages_per_rank,
                c.plan.microbatches,
                c.plan.stage_layers,
                c.plan.recompute,
                c.plan.offload,
            )
            if c.plan.ms_per_microbatch <= pick * (1 + fraction) and key not in seen:
                seen.add(key)
                out.append(c)
        return out

    def _nothing_fits(self) -> str:
        if not self.candidates:
            reasons = "; ".join(f"{n} v={v} M={m}: {why}" for n, v, m, why in self.skipped[:6])
            return f"no candidate could be built ({reasons})"
        low = min(self.candidates, key=lambda c: max(c.plan.peak_gib))
        p = low.plan
        peak = max(p.peak_gib)
        kept = f" less {p.headroom:.0%} headroom = {p.usable_gib:.3g} GiB" if p.headroom else ""
        even = ", even with full recompute on every stage" if self.recompute_tried else ""
        if self.offload_tried:
            even = ", even with full recompute and full offload on every stage"
        return (
            f"no plan fits {p.memory_gib:g} GiB per rank{kept}{even}: the smallest peak any "
            f"candidate reached is {peak:.3f} GiB on rank {p.peak_gib.index(peak)} "
            f"({p.schedule}, {p.stages_per_rank} stage(s) per rank, {p.microbatches} "
            f"micro-batches, stage_layers {list(p.stage_layers)}, recompute "
            f"{describe(p.recompute)}"
            + (f", offload {list(p.offload)}" if p.layout.offloads else "")
            + "); raise --memory-gib, lower --headroom or add ranks"
        )


def plan(
    costs: ModelCosts | Mapping[str, object] | str | os.PathLike[str],
    *,
    num_ranks: int,
    memory_gib: float,
    microbatches: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    global_batch: int | None = None,
    micro_batch_size: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
) -> Plan:
    """The fastest plan per micro-batch whose every rank's predicted peak fits ``memory_gib``
    less ``headroom`` (a fraction kept free, see ``DEFAULT_HEADROOM``); without recompute if any
    such plan fits, else with stages recomputing; ``NoPlanFits`` (a ``ValueError``) when not even
    full recompute on every stage fits, naming the smallest peak reached and its rank.

    ``costs``: a ``ModelCosts``, a costs file's path (``pipetrain profile > costs.json``) or
    its parsed JSON (a dict); anything else is a ``TypeError`` naming the three."""
    return search(
        as_costs(costs),
        num_ranks=num_ranks,
        memory_gib=memory_gib,
        headroom=headroom,
        microbatches=microbatches,
        schedules=schedules,
        global_batch=global_batch,
        micro_batch_size=micro_batch_size,
    ).best.plan


def as_costs(costs: object) -> ModelCosts:
    """``plan``'s ``costs`` as a ``ModelCosts`` (read or parsed; a ``CostsFileError`` names what
    is wrong in the file or dict)."""
    if isinstance(costs, ModelCosts):
        return costs
    if isinstance(costs, (str, os.PathLike)):
        return load_costs(os.fspath(costs))
    if isinstance(costs, Mapping):
        return parse_costs(dict(costs))
    raise TypeError(
        f"costs must be a ModelCosts, a costs file's path or its JSON as a dict; got "
        f"{type(costs).__name__}"
    )


@without_gc
def search(
    costs: ModelCosts,
    *,
    num_ranks: int,
    memory_gib: float,
    microbatches: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    global_batch: int | None = None,
    micro_batch_size: int | None = None,
    stages_per_rank: Sequence[int] | None = None,
    headroom: float = DEFAULT_HEADROOM,
    offload: bool = True,
    prune: bool = False,
) -> Search:
    """Simulate every candidate (see the module docstring); ``ValueError`` names bad input.
    ``offload=False`` leaves activation offload out (a run replayed as a CUDA graph cannot
    offload: ``Pipeline(cuda_graph=True)`` refuses it). ``prune=True`` skips the refinement's
    moves that a lower bound proves slower than the best (``cuts.refine``): the pick and each
    family's best are the same, but ``Search.candidates`` then lacks those moves, so a caller
    that reads every candidate (e.g. for the lowest peak any cut reaches) keeps the default."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if not memory_gib > 0:
        raise ValueError(f"memory_gib must be > 0, got {memory_gib}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom}")
    budget = Budget(memory_gib, headroom)
    counts = microbatch_options(num_ranks, microbatches, global_batch, micro_batch_size)
    families = [family(n) for n in schedules] if schedules else default_families()
    out = Search()
    programs: dict[tuple[str, int, int], Program] = {}
    seen: dict[
        tuple[object, ...], str
    ] = {}  # a program's actions and placement -> the family that made it
    for fam in families:
        for v in _stages_per_rank(fam, num_ranks, costs.num_layers, stages_per_rank):
            for m in counts:
                try:
                    program = build_schedule(fam.name, num_ranks, m, v)
                except ValueError as e:
                    out.skipped.append((fam.name, v, m, str(e)))
                    continue
                if program.placement.stages_per_chain > costs.num_layers:
                    out.skipped.append(
                        (
                            fam.name,
                            v,
                            m,
                            f"needs {program.placement.stages_per_chain} stages "
                            f"but the model has {costs.num_layers} layers",
                        )
                    )
                    continue
                if not costs.split_backward and _splits_backward(program):
                    out.skipped.append(
                        (
                            fam.name,
                            v,
                            m,
                            "splits the backward: the costs file gives no "
                            "backward_input/backward_weight",
                        )
                    )
                    continue
                same = seen.setdefault((program.actions, program.placement), fam.name)
                if same != fam.name:  # one stage per rank: interleaved 1F1B is 1F1B, and so on
                    out.skipped.append((fam.name, v, m, f"the same program as {same}"))
                    continue
                out.candidates += candidates(costs, program, fam.name, v, budget)
                programs[fam.name, v, m] = program
    if programs and not out.fitting:
        out.recompute_tried = True
        plain = list(out.candidates)
        out.candidates += recompute_candidates(costs, programs, plain, budget)
        out.offload_tried = offload and bool(costs.host_bandwidth_gbs)
        if offload:
            out.candidates += offload_candidates(costs, programs, plain, budget)
    out.candidates += refine(out.candidates, costs, programs, budget, prune)
    return out


def default_families() -> list[Family]:
    """Every family ``pipetrain.Pipeline`` runs (a plan is for running)."""
    return [f for f in FAMILIES.values() if f.runnable]


def microbatch_options(
    num_ranks: int,
    microbatches: Sequence[int] | None,
    global_batch: int | None,
    micro_batch_size: int | None,
) -> tuple[int, ...]:
    """The micro-batch counts to try: ``global_batch / micro_batch_size`` when given, else the
    given list, else 1, 2 and 4 times the ranks."""
    if (global_batch is None) != (micro_batch_size is None):
        raise ValueError("give --global-batch and --micro-batch-size together")
    for name, value in (("global_batch", global_batch), ("micro_batch_size", micro_batch_size)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if global_batch is not None and micro_batch_size is not None:
        if global_batch % micro_batch_size:
            raise ValueError(
                f"global batch {global_batch} is not a multiple of the micro-batch size "
                f"{micro_batch_size}"
            )
        fixed = global_batch // micro_batch_size
        if microbatches and set(microbatches) != {fixed}:
            raise ValueError(
                f"micro-batches {list(microbatches)} contradict global batch / micro-batch size "
                f"= {fixed}"
            )
        return (fixed,)
    if microbatches:
        bad = [m for m in microbatches if m < 1]
        if bad:
            raise ValueError(f"micro-batch counts must be >= 1, got {bad}")
        return tuple(sorted(set(microbatches)))
    return tuple(f * num_ranks for f in DEFAULT_MICROBATCH_FACTORS)


def _stages_per_rank(
    fam: Family, num_ranks: int, num_layers: int, wanted: Sequence[int] | None
) -> Iterable[int]:
    if fam.stages_per_rank is not None:
        return fam.stages_per_rank
    return [v for v in wanted or DEFAULT_STAGES_PER_RANK if v * num_ranks <= num_layers]


def _splits_backward(program: Program) -> bool:
    return any(
        p.kind in (OpKind.I, OpKind.W) for _, _, a in program.cells() for p in a.compute_parts
    )
