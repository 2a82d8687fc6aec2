"""The order of F, I and W on every rank, built for given stage costs by greedy list scheduling
under a memory cap per rank: the automatic scheduler of the ZB paper (Qi et al., *Zero Bubble
Pipeline Parallelism*, ICLR 2024, §3 and Appendix B) in pipetrain's cost model.

The step is played out in time, as ``sim.simulate`` would play it (a rank runs one action at a
time; a value that crosses ranks arrives its producing stage's ``comm`` after its producer ends;
nothing else waits). Whenever a rank is free it picks among the actions it could start now:

1. an ``I`` (or ``B``, when the backward is not split) first — it is on the critical path of
   every rank upstream;
2. else an ``F``, if the micro-batch's activations fit under the rank's cap (a micro-batch's
   first forward on a rank reserves what all of its stages on that rank will hold, so a V rank
   never starts micro-batches it then cannot turn at the bottom of the V: that would deadlock;
   an ``I`` gives back all but what its ``W`` still needs, the ``W`` the rest);
3. else a ``W``: deferred weight gradients fill what would be bubble. Under ``fill="fits"`` a
   ``W`` runs only where it ends before the next value the rank is known to receive (or where the
   cap blocks a forward: a ``W`` frees memory); under ``fill="eager"`` whenever the rank would
   idle.

Forwards, input halves and weight halves run in micro-batch order on each stage, as in every
published family; the only freedom is their interleaving, which is where unequal stages lose time
in the fixed families. The order played out is the program: since every action started only once
all it needs had arrived, the program runs in that order and the simulator reproduces the times.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.placement import Placement
from pipetrain.schedule.program import Program

__all__ = ["OrderPolicy", "StageTimes", "greedy_program"]


@dataclass(frozen=True)
class StageTimes:
    """Per stage: what its pieces last (ms), the latency of its output to another rank, and what
    one micro-batch holds on it (GiB: from ``F`` to ``I``, then from ``I`` to ``W``)."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    backward: tuple[float, ...]
    comm: tuple[float, ...]
    activation: tuple[float, ...]
    activation_for_weight: tuple[float, ...]


@dataclass(frozen=True)
class OrderPolicy:
    """One variant of the greedy rule.

    ``memory``: per rank, the GiB of activations it may hold (``math.inf``: no cap);
    ``in_flight``: per rank, the most micro-batches it may hold at once (0: no cap beyond
    memory); ``fill``: ``"fits"`` or ``"eager"`` (module docstring); ``deep_first``: with two
    stages on a rank, prefer the forward of the later stage (the micro-batch nearer its turn)."""

    memory: tuple[float, ...]
    in_flight: tuple[int, ...] = ()
    fill: str = "fits"
    deep_first: bool = True
    split: bool = True
    #: an ``I`` gives back what its ``W`` no longer needs (else the whole activation is held to
    #: the ``W``: fewer forwards in flight, more room for deferred ``W``s)
    early_release: bool = True


@dataclass
class _Rank:
    free_at: float = 0.0
    held: float = 0.0
    #: micro-batch -> [GiB still reserved on this rank, its backward pieces left here]
    reserved: dict[int, list[float]] | None = None
    row: list[Action] | None = None


class _State:
    """The step being played: next micro-batch per stage and kind, every end time so far."""

    def __init__(self, placement: Placement, m: int, times: StageTimes, policy: OrderPolicy):
        self.placement, self.m, self.t, self.policy = placement, m, times, policy
        n = placement.num_stages
        self.next = {k: [0] * n for k in (OpKind.F, OpKind.I, OpKind.W)}
        self.end: dict[tuple[OpKind, int, int], float] = {}
        self.ranks = [_Rank(reserved={}, row=[]) for _ in range(placement.num_ranks)]
        self.stages = [placement.stages_of_rank(r) for r in range(placement.num_ranks)]
        self.remaining = n * m * (3 if policy.split else 2)

    def arrival(self, kind: OpKind, stage: int, mb: int, consumer: int) -> float:
        """When the value ``kind`` of (``stage``, ``mb``) is usable by ``consumer``'s stage
        (``math.inf``: its producer has not started)."""
        end = self.end.get((kind, stage, mb))
        if end is None:
            return math.inf
        same = self.placement.rank(stage) == self.placement.rank(consumer)
        return end if same else end + self.t.comm[stage]

    def candidates(self, rank: int) -> list[tuple[float, Action]]:
        """Each stage's next F, I (or B) and W on ``rank`` whose inputs are known, with the time
        they are all there."""
        out: list[tuple[float, Action]] = []
        last = self.placement.num_stages - 1
        back = OpKind.I if self.policy.split else OpKind.B
        for s in self.stages[rank]:
            j = self.next[OpKind.F][s]
            if j < self.m:
                ready = 0.0 if s == 0 else self.arrival(OpKind.F, s - 1, j, s)
                if ready < math.inf:
                    out.append((ready, Action(OpKind.F, s, j)))
            j = self.next[OpKind.I][s]
            if j < self.next[OpKind.F][s]:
                ready = self.end[OpKind.F, s, j]
                if s < last:
                    ready = max(ready, self.arrival(OpKind.I, s + 1, j, s))
                if ready < math.inf:
                    out.append((ready, Action(back, s, j)))
            j = self.next[OpKind.W][s]
            if self.policy.split and j < self.next[OpKind.I][s]:
                out.append((self.end[OpKind.I, s, j], Action(OpKind.W, s, j)))
        return out

    def duration(self, a: Action) -> float:
        match a.kind:
            case OpKind.F:
                return self.t.forward[a.stage]
            case OpKind.I:
                return self.t.backward_input[a.stage]
            case OpKind.W:
                return self.t.backward_weight[a.stage]
            case _:
                return self.t.backward[a.stage]

    def fits(self, rank: int, a: Action) -> bool:
        """Whether ``rank`` may start forward ``a`` under its caps."""
        r = self.ranks[rank]
        assert r.reserved is not None
        if a.microbatch in r.reserved:
            return True  # reserved at its first forward on this rank
        caps = self.policy.in_flight
        if caps and caps[rank] and len(r.reserved) >= caps[rank]:
            return False
        need = self.reservation(rank, a.stage)
        return not r.reserved or r.held + need <= self.policy.memory[rank] + 1e-12

    def reservation(self, rank: int, stage: int) -> float:
        return sum(self.t.activation[s] for s in self.stages[rank] if s >= stage)


def greedy_program(
    placement: Placement,
    num_microbatches: int,
    times: StageTimes,
    policy: OrderPolicy,
    name: str = "synthesized",
) -> Program:
    """The program the greedy rule (module docstring) plays out; every action of every stage
    and micro-batch exactly once."""
    state = _State(placement, num_microbatches, times, policy)
    while state.remaining:
        best: tuple[float, int, Action] | None = None
        for rank in range(placement.num_ranks):
            pick = _choose(state, rank)
            if pick is not None and (best is None or pick[0] < best[0]):
                best = (pick[0], rank, pick[1])
        assert best is not None, "the greedy order deadlocked"  # reservations rule it out
        _start(state, *best)
    rows = tuple(tuple(r.row or ()) for r in state.ranks)
    return Program(placement, num_microbatches, rows, name)


def _choose(state: _State, rank: int) -> tuple[float, Action] | None:
    """The earliest time ``rank`` can start something and what it starts then (``None``: it
    waits for values whose producers have not started)."""
    r = state.ranks[rank]
    options = state.candidates(rank)
    if not options:
        return None
    at = max(r.free_at, min(t for t, _ in options))
    ready = [a for t, a in options if t <= at]
    backward = [a for a in ready if a.kind in (OpKind.I, OpKind.B)]
    if backward:
        return at, min(backward, key=lambda a: (a.microbatch, -a.stage))
    forwards = [a for a in ready if a.kind is OpKind.F]
    allowed = [a for a in forwards if state.fits(rank, a)]
    if allowed:
        key = (lambda a: (-a.stage, a.microbatch)) if state.policy.deep_first else _by_mb
        return at, min(allowed, key=key)
    weights = [a for a in ready if a.kind is OpKind.W]
    if weights:
        w = min(weights, key=_by_mb)
        upcoming = [t for t, a in options if t > at and a.kind is not OpKind.W]
        blocked = bool(forwards)  # forwards ready but over the cap: a W frees memory
        soon = min(upcoming, default=math.inf)
        if state.policy.fill == "eager" or blocked or at + state.duration(w) <= soon + 1e-12:
            return at, w  # (with no arrival known, ``soon`` is infinite: the W runs)
        return soon, _first_at(options, soon)
    later = [t for t, _ in options if t > at]
    if not later:
        return None  # only forwards over the cap, and nothing to free them here yet
    t = min(later)
    return t, _first_at(options, t)


def _first_at(options: Sequence[tuple[float, Action]], t: float) -> Action:
    """What a rank that waits until ``t`` would start: re-chosen then (this is a placeholder
    for the time only; ``_start`` never runs it before it is chosen at ``t``)."""
    return min((a for at, a in options if at == t), key=_by_mb)


def _by_mb(a: Action) -> tuple[int, int]:
    return a.microbatch, a.stage


def _release(state: _State, r: _Rank, action: Action) -> None:
    """What a backward piece frees of its micro-batch's reservation: an ``I`` all but what its
    ``W`` still needs (the I-to-W size), a ``W`` the rest, a ``B`` the whole; the micro-batch
    leaves the rank with its last piece there."""
    assert r.reserved is not None
    s, j, t = action.stage, action.microbatch, state.t
    match action.kind:
        case OpKind.I:
            kept = t.activation_for_weight[s] if state.policy.early_release else t.activation[s]
            freed = max(0.0, t.activation[s] - kept)
        case OpKind.W:
            kept = t.activation_for_weight[s] if state.policy.early_release else t.activation[s]
            freed = min(t.activation[s], kept)
        case _:
            freed = t.activation[s]
    entry = r.reserved[j]
    entry[0] -= freed
    r.held -= freed
    if action.kind is not OpKind.I:
        entry[1] -= 1
        if entry[1] == 0:
            r.held -= r.reserved.pop(j)[0]


def _start(state: _State, at: float, rank: int, action: Action) -> None:
    """Run ``action`` on ``rank`` from ``at`` — unless the rank only waits until ``at`` for a
    value, in which case the rank's clock moves there and it chooses again."""
    r = state.ranks[rank]
    ready = {a: t for t, a in state.candidates(rank)}
    if ready.get(action, math.inf) > at or (
        action.kind is OpKind.F and not state.fits(rank, action)
    ):
        r.free_at = max(r.free_at, at)
        return
    end = at + state.duration(action)
    assert r.reserved is not None and r.row is not None
    s, j = action.stage, action.microbatch
    if action.kind is OpKind.F and j not in r.reserved:
        stages = [x for x in state.stages[rank] if x >= s]
        r.reserved[j] = [state.reservation(rank, s), len(stages)]
        r.held += r.reserved[j][0]
    elif action.kind is not OpKind.F:
        _release(state, r, action)
    state.end[OpKind.I if action.kind is OpKind.B else action.kind, s, j] = end
    state.next[OpKind.I if action.kind is OpKind.B else action.kind][s] += 1
    if action.kind is OpKind.B:
        state.next[OpKind.W][s] += 1
    r.row.append(action)
    r.free_at = end
    state.remaining -= 1
