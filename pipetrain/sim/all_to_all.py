"""How much of a mixture-of-experts model's expert all-to-all a schedule hides.

DualPipe and DualPipeV pair one micro-batch's forward with another's backward so that each
half's dispatch/combine all-to-all runs under the other half's compute (DeepSeek-V3 technical
report §3.2.1, arXiv 2412.19437); schedules without such pairs make every F, B and I wait for its
own. Under the simulator's model (``sim.costs``: the all-to-all is a resource of its own, an
overlapped pair lasts ``overlapped_pair`` of its halves), per rank:

* ``total``: the all-to-all its actions carry (each F's forward one, each B's or I's backward
  one, every pair's two);
* ``hidden``: the part that runs under compute. A lone action hides none (it waits for its
  own); a pair hides its two all-to-alls less what it lasts beyond its two halves' compute (its
  measured ``forward_backward`` where given, clamped to what it carries).

Computed from the program and its costs, not from a timeline: what a pair hides is a property of
the pair, and a rank's waits for its neighbours (the bubble) are not all-to-all. Micro-batch
weights scale compute, not the all-to-all (``sim.simulate.weight``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.schedule.action import COMPUTE_KINDS, Action
from pipetrain.schedule.program import Program
from pipetrain.sim.costs import Costs, StageCosts, overlapped_pair
from pipetrain.sim.simulate import all_to_all_of, compute_of, compute_weight, weight


@dataclass(frozen=True)
class AllToAllShare:
    """Per rank: the all-to-all time one step carries (``total``) and the part of it that runs
    under compute (``hidden``), in the costs' time unit."""

    total: tuple[float, ...]
    hidden: tuple[float, ...]

    @property
    def exposed(self) -> tuple[float, ...]:
        """Per rank: the all-to-all its compute waits for."""
        return tuple(t - h for t, h in zip(self.total, self.hidden, strict=True))

    @property
    def hidden_share(self) -> float:
        """The share of the step's all-to-all, over every rank, that runs under compute (0 when
        there is none)."""
        total = sum(self.total)
        return sum(self.hidden) / total if total > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "total": list(self.total),
            "hidden": list(self.hidden),
            "hidden_share": self.hidden_share,
        }


def all_to_all_share(program: Program, costs: Costs) -> AllToAllShare:
    """What each rank of ``program`` carries and hides of its stages' all-to-all under
    ``costs`` (the module docstring)."""
    sc = costs.per_stage(program.num_stages)
    total, hidden = [], []
    for row in program.actions:
        carried = under = 0.0
        for action in row:
            if action.kind not in COMPUTE_KINDS:
                continue
            moved, kept = _carried_and_hidden(action, sc)
            carried += moved
            under += kept
        total.append(carried)
        hidden.append(under)
    return AllToAllShare(tuple(total), tuple(hidden))


def _carried_and_hidden(action: Action, sc: StageCosts) -> tuple[float, float]:
    if not action.parts:
        return all_to_all_of(action, sc), 0.0
    weighted = bool(sc.microbatch_weights)
    halves = [
        (
            compute_of(p, sc) * (compute_weight(p, sc) if weighted else 1.0),
            all_to_all_of(p, sc),
        )
        for p in action.parts
    ]
    moved = halves[0][1] + halves[1][1]
    if not moved:
        return 0.0, 0.0
    measured = sc.forward_backward[action.stage]
    if measured is None:
        lasts = overlapped_pair(*halves[0], *halves[1])
    else:
        lasts = measured * (weight(action, sc) if weighted else 1.0)
    beyond = lasts - halves[0][0] - halves[1][0]
    return moved, moved - min(max(beyond, 0.0), moved)
