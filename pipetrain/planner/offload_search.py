"""The planner's offload pass, when no plan without recompute fits: the same shapes with each
stage keeping a fraction of its activations in host memory between forward and backward
(PipeOffload, arXiv 2503.01328; ``schedule.offload`` places the copies, the simulator's copy
engine times them at the costs file's ``host_bandwidth_gbs``).

For each shape already built, from its fastest cut without recompute and from its lowest-peak
cut: every stage offloading ``FRACTIONS`` in turn, stopping at the first that fits (a larger
fraction frees more and copies longer), and the ceiling, full recompute with full offload on every
stage — when that does not fit, nothing the planner knows does. Stages none of whose micro-batches
wait long enough offload nothing (``judge.usable_offload``). Without a measured host bandwidth no
offload is planned: its cost would be a guess.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipetrain.planner.costs_file import ModelCosts
from pipetrain.planner.judge import Budget, Candidate, evaluate, rank_key
from pipetrain.planner.recompute_modes import Recompute
from pipetrain.schedule.program import Program

#: the offload fractions tried per stage, smallest first
FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def offload_candidates(
    costs: ModelCosts,
    programs: Mapping[tuple[str, int, int], Program],
    plain: Sequence[Candidate],
    budget: Budget,
) -> list[Candidate]:
    """Every shape of ``programs`` judged with offload (module docstring); ``plain``: the
    candidates without recompute or offload already simulated."""
    out: list[Candidate] = []
    if not costs.host_bandwidth_gbs:
        return out
    for (name, v, m), program in programs.items():
        mine = [
            c
            for c in plain
            if (c.plan.schedule, c.plan.stages_per_rank, c.plan.microbatches) == (name, v, m)
            and not c.plan.layout.recomputes
            and not c.plan.layout.offloads
        ]
        if not mine:
            continue
        fastest, lowest = min(mine, key=rank_key), min(mine, key=lambda c: max(c.plan.peak_gib))
        for start in (fastest, lowest) if lowest is not fastest else (fastest,):
            cut = start.plan.stage_layers
            for fraction in FRACTIONS:
                tried = evaluate(
                    costs, program, name, v, cut, "offload", budget, (), (fraction,) * len(cut)
                )
                out.append(tried)
                if tried.plan.fits:
                    break
            full = (Recompute.FULL.value,) * len(cut)
            everything = (1.0,) * len(cut)
            out.append(
                evaluate(costs, program, name, v, cut, "full+offload", budget, full, everything)
            )
    return out
