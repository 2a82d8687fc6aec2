"""The copy engine in the event loop: when a program's OFFLOAD/RELOAD copies run, and what waits.

PipeOffload (Wan et al. 2025, arXiv 2503.01328) overlaps activation copies with compute on the
GPU's copy engines, one per direction. The model ``schedule.execute`` runs with this module:

* a copy is issued where it stands in its rank's row: when the compute action before it ends
  (at time 0 before the first); it never holds up the rank's next compute action;
* each rank has one queue per direction — device to host (``OFFLOAD``) and host to device
  (``RELOAD``) — and a copy starts when it is issued and its queue is free (a ``RELOAD`` also
  not before its ``OFFLOAD`` ended), lasting its stage's ``CopyPlan`` time;
* an ``OFFLOAD`` of a stage that offloads layer by layer streams during its forward: it may start
  ``early`` before it is issued (its first layer's copy starts when that layer's forward ends);
* the ``B`` or ``I`` of an offloaded (stage, micro-batch) starts no earlier than its ``RELOAD``
  ends — or, where the stage reloads layer by layer inside its backward, ``need`` after the
  ``RELOAD`` starts (the backward runs its kept layers, and each reloaded layer once it is back).

The order within a row (``offload.check_copies``) guarantees that a copy's inputs are on its own
rank and earlier in the row, so a copy never waits on another rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import NamedTuple

from pipetrain.schedule.action import COPY_KINDS, Action, OpKind
from pipetrain.schedule.program import Program
from pipetrain.schedule.timeline import Span

_WAITS = (OpKind.B, OpKind.I)
_kind = attrgetter("kind")


class CopyPlan(NamedTuple):
    """How one stage's copies run: an ``OFFLOAD`` lasts ``offload`` and may start ``early`` before
    it is issued; a ``RELOAD`` lasts ``reload``; a ``B`` (``I``) of an offloaded micro-batch may
    start ``need_b`` (``need_i``) after its ``RELOAD`` starts (``None``: when it ends)."""

    offload: float
    reload: float
    early: float = 0.0
    need_b: float | None = None
    need_i: float | None = None


def has_copies(program: Program) -> bool:
    """Whether ``program`` has OFFLOAD/RELOAD actions (each row's kinds read in C, as
    ``Program.is_lowered`` does: this runs on every simulation)."""
    return any(not COPY_KINDS.isdisjoint(map(_kind, row)) for row in program.actions)


class CopyEngine:
    """Per rank, the copies issued before each compute step; their spans once run."""

    def __init__(
        self,
        rows: Sequence[Sequence[Action]],
        duration: Callable[[Action], float],
        plan: Callable[[int], CopyPlan] | None = None,
    ) -> None:
        """``plan``: each stage's ``CopyPlan`` (``None``: each copy lasts ``duration`` of it and a
        backward waits for its whole reload)."""
        #: [rank] -> compute index -> the copies issued just before it (after the previous one)
        self.pending: list[dict[int, list[Action]]] = []
        for row in rows:
            issued: dict[int, list[Action]] = {}
            k = 0
            for action in row:
                if action.kind in COPY_KINDS:
                    issued.setdefault(k, []).append(action)
                elif action.is_compute:
                    k += 1
            self.pending.append(issued)
        stages = {a.stage for row in rows for a in row if a.kind in COPY_KINDS}
        self.plans = {
            s: plan(s)
            if plan is not None
            else CopyPlan(
                duration(Action(OpKind.OFFLOAD, s, 0)), duration(Action(OpKind.RELOAD, s, 0))
            )
            for s in stages
        }
        self.queue_free = [{OpKind.OFFLOAD: 0.0, OpKind.RELOAD: 0.0} for _ in rows]
        self.offloaded: dict[tuple[int, int], float] = {}  # (stage, mb) -> its OFFLOAD's end
        #: (stage, mb) -> when its B, and its I, may start (after what its RELOAD brings back)
        self.reloaded: dict[tuple[int, int], tuple[float, float]] = {}
        self.spans: list[Span] = []

    def issue(self, rank: int, step: int, now: float) -> None:
        """Run the copies issued before compute ``step`` of ``rank``, issued at ``now``."""
        copies = self.pending[rank].pop(step, None)
        if not copies:
            return
        queues = self.queue_free[rank]
        for copy in copies:
            key = (copy.stage, copy.microbatch)
            plan = self.plans[copy.stage]
            if copy.kind is OpKind.OFFLOAD:
                start = max(now - plan.early, queues[copy.kind])
                end = queues[copy.kind] = start + plan.offload
                self.offloaded[key] = end
            else:
                offloaded = self.offloaded.get(key)
                if offloaded is None:
                    raise ValueError(
                        f"rank {rank}: {copy} runs before its OFFLOAD; validate the program "
                        "(offload.check_copies) before simulating it"
                    )
                start = max(now, queues[copy.kind], offloaded)
                end = queues[copy.kind] = start + plan.reload
                self.reloaded[key] = (
                    end if plan.need_b is None else start + max(0.0, plan.need_b),
                    end if plan.need_i is None else start + max(0.0, plan.need_i),
                )
            self.spans.append(Span(rank, copy, start, end))

    def ready(self, action: Action, start: float) -> float:
        """When ``action`` may start, given it could at ``start``: after the reloads it reads."""
        for part in action.compute_parts:
            if part.kind in _WAITS:
                ready = self.reloaded.get((part.stage, part.microbatch))
                if ready is not None:
                    start = max(start, ready[part.kind is OpKind.I])
        return start
