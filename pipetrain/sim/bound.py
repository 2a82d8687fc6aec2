"""A lower bound on a program's simulated step from its costs alone, so a search can skip a
candidate that cannot win without simulating it.

Under the plain model of ``sim.simulate`` (no host times, no micro-batch weights, no measured
overlapped-pair times), every rank runs its compute actions one at a time, and no action of stage
``s`` can start before the forwards of the stages ahead of it in its chain have run once, each
followed by its transfer where the next stage lives on another rank (``head``). So a rank ends no
earlier than the least ``head`` of its stages plus the sum of its actions' durations; and a rank
that never splits its backward ends on a backward, after which the input gradient still has to
run back through the stages ahead (``tail``). The step is at least the largest such end: the
classic fill-and-drain argument of the pipeline papers (GPipe's ``(M + P − 1)`` steps, the ZB
paper's bubble accounting), stated for any placement and any order. Copies (offload) only
delay actions, so the bound holds with them too.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pipetrain.schedule.action import OpKind
from pipetrain.schedule.program import Program
from pipetrain.sim.costs import Costs, StageCosts


@dataclass(frozen=True)
class ActionCounts:
    """What the bound reads from a program (once: it does not depend on the costs): per rank,
    how many plain compute parts of each (kind, stage) it runs (an overlapped pair's two parts
    counted as its parts), whether it has overlapped pairs, and whether it runs any ``W``."""

    program: Program
    per_rank: tuple[Counter[tuple[OpKind, int]], ...]
    has_pairs: bool
    splits: tuple[bool, ...]


def count_actions(program: Program) -> ActionCounts:
    per_rank = []
    has_pairs = False
    for row in program.actions:
        counts: Counter[tuple[OpKind, int]] = Counter()
        for action in row:
            if action.parts:
                has_pairs = True
                counts.update((p.kind, p.stage) for p in action.parts)
            else:
                counts[action.kind, action.stage] += 1
        per_rank.append(counts)
    splits = tuple(any(kind is OpKind.W for kind, _ in c) for c in per_rank)
    return ActionCounts(program, tuple(per_rank), has_pairs, splits)


def step_lower_bound(counts: ActionCounts, costs: Costs) -> float | None:
    """A number the simulated makespan of ``counts.program`` under ``costs`` never falls below
    (the module docstring); None where the plain model does not apply (host and device times,
    micro-batch weights, measured overlapped pairs in a program that has pairs)."""
    program = counts.program
    sc = costs.per_stage(program.num_stages)
    if sc.host is not None or sc.device is not None or sc.microbatch_weights:
        return None
    if sc.microbatch_weights_i or sc.microbatch_weights_w:
        return None
    if counts.has_pairs and any(x is not None for x in sc.forward_backward):
        return None
    head, tail = _head_and_tail(program, sc, counts)
    duration = {
        OpKind.F: sc.forward,
        OpKind.B: sc.backward,
        OpKind.I: sc.backward_input,
        OpKind.W: sc.backward_weight,
    }
    best = 0.0
    for rank, rank_counts in enumerate(counts.per_rank):
        stages = {stage for _, stage in rank_counts}
        if not stages:
            continue
        work = sum(n * duration[kind][stage] for (kind, stage), n in rank_counts.items())
        drain = 0.0 if counts.splits[rank] else min(tail[s] for s in stages)
        best = max(best, min(head[s] for s in stages) + work + drain)
    return best


def _head_and_tail(
    program: Program, sc: StageCosts, counts: ActionCounts
) -> tuple[list[float], list[float]]:
    """Per stage: the least time before any of its actions can start (the forwards ahead of it
    in its chain, with their transfers), and the least time after a backward of it ends before
    the step can end (the input-gradient pieces ahead of it, ``B`` or ``I`` as the program runs
    them, with their transfers)."""
    runs = {kind_stage for rank_counts in counts.per_rank for kind_stage in rank_counts}
    placement = program.placement
    per_chain, rank_of = placement.stages_per_chain, placement.rank_of_stage
    head = [0.0] * program.num_stages
    tail = [0.0] * program.num_stages
    for s in range(program.num_stages):
        if s % per_chain == 0:
            continue  # a chain's first stage reads the input
        crosses = rank_of[s - 1] != rank_of[s]
        head[s] = head[s - 1] + sc.forward[s - 1] + (sc.comm[s - 1] if crosses else 0.0)
        pieces = [
            time[s - 1]
            for kind, time in ((OpKind.B, sc.backward), (OpKind.I, sc.backward_input))
            if (kind, s - 1) in runs
        ]
        backward = min(pieces, default=0.0)
        tail[s] = tail[s - 1] + backward + (sc.comm[s] if crosses else 0.0)
    return head, tail
