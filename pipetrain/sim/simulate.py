"""Discrete-event simulation of a program under a cost model.

The model (the one the ZB paper, Qi et al. 2024 §2 and Table 2, uses to state its bubbles):

* each rank runs its compute actions in program order, one at a time;
* an action starts when its rank is free and every value it needs (``deps.requires``) has
  arrived; it lasts its stage's cost (``F``, ``B``, ``I``, ``W``; an overlapped pair lasts
  ``forward_backward`` of its forward stage, default its forward plus its backward);
* a value produced on one rank and needed on another arrives ``comm`` (of the producing stage)
  after its producer ends: the latency is paid on every dependency that crosses ranks — F→F
  downstream, B/I→B/I upstream — and on nothing that stays on a rank (the last stage's F→B turn,
  the V turn between a rank's two stages);
* SEND/RECV actions in a lowered program cost nothing themselves: communication is the latency
  above, so the same program simulates the same lowered or not.

Activations are accounted by the ``Timeline`` (held from the start of F to the end of the last
backward piece, times the stage's activation size). The simulation is event driven: a rank that
waits on a value is parked on it and woken when it is produced, so a run is O(actions).
"""

from __future__ import annotations

from pipetrain.schedule import deps
from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.lower import deadlock_error
from pipetrain.schedule.program import Program
from pipetrain.schedule.timeline import Span, Timeline
from pipetrain.sim.costs import Costs, StageCosts


def duration(action: Action, costs: StageCosts) -> float:
    """How long a compute action takes under ``costs``."""
    match action.kind:
        case OpKind.F:
            return costs.forward[action.stage]
        case OpKind.B:
            return costs.backward[action.stage]
        case OpKind.I:
            return costs.backward_input[action.stage]
        case OpKind.W:
            return costs.backward_weight[action.stage]
        case OpKind.OVERLAP_F_B:
            pair = costs.forward_backward[action.stage]
            if pair is not None:
                return pair
            return sum(duration(p, costs) for p in action.parts)
        case _:
            raise AssertionError(f"communication has no duration of its own: {action}")


def simulate(program: Program, costs: Costs | None = None) -> Timeline:
    """Predict the timeline of one step of ``program``; raises ``ScheduleError`` on deadlock."""
    program = program.compute_only()
    placement, num_stages = program.placement, program.num_stages
    sc = (costs or Costs()).per_stage(num_stages)
    rows = program.actions
    produced: dict[deps.Key, float] = {}
    waiting: dict[deps.Key, list[int]] = {}
    pos = [0] * len(rows)
    free_at = [0.0] * len(rows)
    spans: list[Span] = []
    work = list(range(len(rows)))
    while work:
        rank = work.pop()
        row = rows[rank]
        while pos[rank] < len(row):
            action = row[pos[rank]]
            start = free_at[rank]
            blocked_on = None
            for key in deps.requires(action, num_stages):
                t = produced.get(key)
                if t is None:
                    blocked_on = key
                    break
                if placement.rank(key[1]) != rank:
                    t += sc.comm[key[1]]
                start = max(start, t)
            if blocked_on is not None:
                waiting.setdefault(blocked_on, []).append(rank)
                break
            end = start + duration(action, sc)
            spans.append(Span(rank, action, start, end))
            free_at[rank] = end
            pos[rank] += 1
            for key in deps.produces(action):
                produced[key] = end
                work.extend(waiting.pop(key, ()))
    if any(p < len(r) for p, r in zip(pos, rows)):
        have = [set(produced)] * len(rows)  # a stuck rank waits on a value nobody produced
        raise deadlock_error(program, pos, have)
    return Timeline(
        num_ranks=program.num_ranks,
        spans=tuple(spans),
        activation_size=sc.activation,
        name=program.name,
    )
