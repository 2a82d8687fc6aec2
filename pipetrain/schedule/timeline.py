"""The ``Timeline``: what ran where and when, and the metrics every picture and report reads.

The simulator predicts one and the runtime measures one; both are this type, so "predicted vs
measured" is one subtraction and every renderer works on both. It lives beside the program (not in
``sim``) because the runtime may import ``schedule`` but not ``sim``.

Metrics, as the ZB paper (Qi et al. 2024, §2) uses them:

* makespan: last end − first start over all ranks;
* span of a rank: its first start to its last end; ``span`` = max over ranks (the ZB paper's "cost");
* bubble fraction = 1 − Σ busy / (ranks × makespan);
* activations: a micro-batch's activation on a stage is held from the start of its ``F`` to the
  end of its last backward piece (``B``, or ``W`` when split), times the stage's activation size;
  between a split backward's ``I`` and ``W`` it weighs ``weight_activation_size`` instead (what
  ``W`` still needs: by default the same, measured it is the retained graph plus the gradients
  captured for ``W``);
  an overlapped pair allocates its forward at its start and frees its backward at its end;
  where a ``workspace_size`` is given, each action also uses its stage's workspace while it runs
  (``W`` its ``weight_workspace_size`` where given; an overlapped pair: the larger of its two
  stages'), so ``peak_activations`` is the peak of
  held activations plus the running action's temporaries;
* offload (``schedule.offload``): where ``copies`` holds OFFLOAD/RELOAD spans, an offloaded
  micro-batch of stage ``s`` keeps ``offload_memory[s].moved`` of its activation in host memory.
  Its OFFLOAD frees ``out`` by the time it ends — ``layer`` at a time, each ``gap`` before the
  next, the last at its end (the device copy lives until the copy has read it) — and its RELOAD
  takes ``back`` when it starts (the reloaded copy lives from the start of the copy that writes
  it; PipeOffload, arXiv 2503.01328). What is moved beyond those (a stage that offloads layer by
  layer streams the rest during the forward and the backward, a couple of layers on the device at
  a time: ``sim.offload_model``) is never held: its ``F`` allocates, and its last backward piece
  frees, that much less; and an ``F`` of a stage of ``layers`` allocates layer by layer over its
  span. Copies are not compute: they count in no busy time, span or makespan.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate, compress, pairwise, repeat
from operator import attrgetter, is_, itemgetter, sub
from typing import NamedTuple

from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.gc_pause import without_gc

_F, _W, _OVERLAP = OpKind.F, OpKind.W, OpKind.OVERLAP_F_B
_action, _kind = attrgetter("action"), attrgetter("kind")
_stage, _microbatch = attrgetter("stage"), attrgetter("microbatch")
_time, _delta, _time_order = itemgetter(0), itemgetter(2), itemgetter(0, 1)
_start, _end = itemgetter(2), itemgetter(3)  # of a ``Span``


class Span(NamedTuple):
    """One action on one rank from ``start`` to ``end`` (a tuple: timelines hold 10^5 of them)."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


class OffloadMemory(NamedTuple):
    """What offload moves on one stage, in activation units: what an offloaded micro-batch keeps in
    host memory (``moved``), what its forward still holds when it ends and its OFFLOAD frees
    (``out``, ``layer`` at a time, the copies ``gap`` apart; ``layer`` 0: at once), and what its
    RELOAD takes back when it starts (``back``); with ``layers`` > 1, a forward of the stage
    allocates layer by layer over its span (on a rank where copies free memory during a forward,
    allocating it all at its start would count what has left already)."""

    moved: float
    out: float
    back: float
    layer: float = 0.0
    gap: float = 0.0
    layers: int = 1


@dataclass(frozen=True, slots=True)
class RankStats:
    rank: int
    busy: float
    idle: float
    span: float
    peak_activations: float


@dataclass(frozen=True)
class Timeline:
    """Spans of compute actions (communication is latency on the dependencies, not a span).

    ``activation_size[s]`` weighs one micro-batch's activation on stage ``s``;
    ``weight_activation_size[s]`` what it weighs between its ``I`` and ``W`` (``None``: the same);
    ``workspace_size[s]`` what an action of stage ``s`` uses only while it runs (``None``: none);
    ``weight_workspace_size[s]`` what its ``W`` uses (``None``: ``workspace_size``).
    ``measured`` says whether the spans came from a real run (clocks or CUDA events) or the
    simulator. ``host_bound_idle[r]`` (measured GPU runs only) is the part of rank ``r``'s idle
    time between actions that its device spent waiting for the host to issue the next action, as
    opposed to waiting for inputs from other ranks: the simulator models the second, not the first.
    ``host_spans`` are when each rank's host began and ended issuing each action, on the same
    axis: measured on eager GPU runs, simulated where the costs give host times (``sim.costs``).
    """

    num_ranks: int
    spans: tuple[Span, ...]
    activation_size: tuple[float, ...]
    name: str = ""
    measured: bool = False
    weight_activation_size: tuple[float, ...] | None = None
    host_bound_idle: tuple[float, ...] | None = None
    workspace_size: tuple[float, ...] | None = None
    weight_workspace_size: tuple[float, ...] | None = None
    #: OFFLOAD/RELOAD spans on the ranks' copy engines (``schedule.copy_engine``)
    copies: tuple[Span, ...] = ()
    #: per stage, what offload moves, in activation units (``None``: nothing)
    offload_memory: tuple[OffloadMemory, ...] | None = None
    host_spans: tuple[Span, ...] = ()

    @cached_property
    def start(self) -> float:
        return min(map(_start, self.spans), default=0.0)

    @cached_property
    def end(self) -> float:
        return max(map(_end, self.spans), default=0.0)

    @property
    def makespan(self) -> float:
        return self.end - self.start

    @cached_property
    def busy(self) -> tuple[float, ...]:
        # each rank's durations added in span order (``accumulate``: the sum a loop makes), in C
        return tuple(
            deque(accumulate(map(sub, map(_end, row), map(_start, row)), initial=0.0), 1)[0]
            for row in self._spans_by_rank
        )

    @cached_property
    def _spans_by_rank(self) -> list[list[Span]]:
        return _by_rank(self.spans, self.num_ranks)

    @cached_property
    def host_gaps(self) -> tuple[tuple[float, ...], ...]:
        """Per rank, its host's time between ending one action's issue and beginning the next
        (posting transfers, bookkeeping: what an action costs the host beyond its own issue);
        empty rows without ``host_spans``."""
        rows: list[list[Span]] = [[] for _ in range(self.num_ranks)]
        for s in sorted(self.host_spans, key=lambda s: s.start):
            rows[s.rank].append(s)
        return tuple(tuple(b.start - a.end for a, b in pairwise(row)) for row in rows)

    @cached_property
    def rank_spans(self) -> tuple[float, ...]:
        first = [float("inf")] * self.num_ranks
        last = [float("-inf")] * self.num_ranks
        for s in self.spans:
            first[s.rank] = min(first[s.rank], s.start)
            last[s.rank] = max(last[s.rank], s.end)
        return tuple(max(0.0, b - a) for a, b in zip(first, last))

    @property
    def span(self) -> float:
        return max(self.rank_spans, default=0.0)

    @property
    def bubble_fraction(self) -> float:
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.num_ranks * self.makespan)

    @cached_property
    @without_gc
    def memory(self) -> tuple[tuple[tuple[float, float], ...], ...]:
        """Per rank, the activation curve as (time, held) steps, in activation-size units."""
        curves: list[tuple[tuple[float, float], ...]] = []
        for events in self._events():
            if not events:
                curves.append(((0.0, 0.0),))
                continue
            held = accumulate(map(_delta, events))
            curves.append(tuple(zip(map(_time, events), held)))
        return tuple(curves)

    @cached_property
    @without_gc
    def peak_activations(self) -> tuple[float, ...]:
        if "memory" in self.__dict__:  # the curves are drawn already
            return tuple(max((held for _, held in curve), default=0.0) for curve in self.memory)
        # the peak of each curve without building it (the planner reads only this)
        return tuple(
            max(accumulate(map(_delta, events))) if events else 0.0 for events in self._events()
        )

    def _events(self) -> Iterator[list[tuple[float, int, float]]]:
        """Per rank, its ``_activation_events``."""
        for rank_spans, rank_copies in zip(
            self._spans_by_rank, _by_rank(self.copies, self.num_ranks)
        ):
            yield _activation_events(
                rank_spans,
                self.activation_size,
                self.weight_activation_size or self.activation_size,
                self.workspace_size,
                rank_copies,
                self.offload_memory,
                self.weight_workspace_size,
            )

    def rank_stats(self) -> tuple[RankStats, ...]:
        return tuple(
            RankStats(
                rank=r,
                busy=self.busy[r],
                idle=self.makespan - self.busy[r],
                span=self.rank_spans[r],
                peak_activations=self.peak_activations[r],
            )
            for r in range(self.num_ranks)
        )

    def summary(self) -> dict[str, object]:
        """A JSON-ready dict of the headline metrics."""
        return {
            "makespan": self.makespan,
            "span": self.span,
            "bubble_fraction": self.bubble_fraction,
            "per_rank": [
                {
                    "rank": st.rank,
                    "busy": st.busy,
                    "idle": st.idle,
                    "span": st.span,
                    "peak_activations": st.peak_activations,
                }
                for st in self.rank_stats()
            ],
        }


def _by_rank(spans: Sequence[Span], num_ranks: int) -> list[list[Span]]:
    rows: list[list[Span]] = [[] for _ in range(num_ranks)]
    appends = [row.append for row in rows]
    for s in spans:
        appends[s[0]](s)
    return rows


def _activation_events(
    spans: Sequence[Span],
    activation_size: Sequence[float],
    weight_activation_size: Sequence[float],
    workspace_size: Sequence[float] | None = None,
    copies: Sequence[Span] = (),
    moves: Sequence[OffloadMemory] | None = None,
    weight_workspace_size: Sequence[float] | None = None,
) -> list[tuple[float, int, float]]:
    """(time, order, change) of held activations, sorted by time, frees first at equal times
    (order 0 before 1): allocate at the start of F; between I and W hold the weight-gradient
    size; free at the end of the last backward piece of (stage, mb); each action's workspace for
    its span alone; an offloaded micro-batch's streamed share never held (module docstring)."""
    if moves is None:
        events = _plain_events(spans, activation_size, weight_activation_size)
    else:
        events = _offload_events(spans, activation_size, weight_activation_size, copies, moves)
    if workspace_size is not None:
        weight_workspace = weight_workspace_size or workspace_size
        for s in spans:
            used = max(
                (weight_workspace if p.kind is OpKind.W else workspace_size)[p.stage]
                for p in s.action.compute_parts
            )
            if used:
                events += [(s.start, 1, used), (s.end, 0, -used)]
    if moves is not None:
        events += _copy_events(copies, moves)
    events.sort(key=_time_order)
    return events


def _plain_events(
    spans: Sequence[Span],
    activation_size: Sequence[float],
    weight_activation_size: Sequence[float],
) -> list[tuple[float, int, float]]:
    """``_offload_events`` where nothing is offloaded, one branch per action: the same events in
    the same order (so the same sums), without its per-part bookkeeping."""
    actions = list(map(_action, spans))
    kinds = set(map(_kind, actions))
    # the split backwards' cells, read in C: what an I looks up
    weights = list(compress(actions, map(is_, map(_kind, actions), repeat(_W))))
    split = set(zip(map(_stage, weights), map(_microbatch, weights)))
    events: list[tuple[float, int, float]] = []
    append = events.append
    if _OVERLAP in kinds:  # an overlapped pair's parts each hold or free their own
        pieces = [(p, start, end) for _, a, start, end in spans for p in a.parts or (a,)]
    else:
        pieces = [(a, start, end) for _, a, start, end in spans]
    for p, start, end in pieces:
        kind, stage = p.kind, p.stage
        if kind is _F:
            append((start, 1, activation_size[stage]))
        elif kind is _W:
            append((end, 0, -weight_activation_size[stage]))
        elif (stage, p.microbatch) not in split:  # B, or an I whose W never runs here
            append((end, 0, -activation_size[stage]))
        else:  # I of a split backward: what W still needs stays
            change = weight_activation_size[stage] - activation_size[stage]
            if change:
                append((end, 0 if change < 0 else 1, change))
    return events


def _offload_events(
    spans: Sequence[Span],
    activation_size: Sequence[float],
    weight_activation_size: Sequence[float],
    copies: Sequence[Span],
    moves: Sequence[OffloadMemory],
) -> list[tuple[float, int, float]]:
    """The compute actions' events where stages offload (unsorted)."""
    parts = [(s, p) for s in spans for p in s.action.compute_parts]
    split = {(p.stage, p.microbatch) for _, p in parts if p.kind is OpKind.W}
    offloaded = {
        (c.action.stage, c.action.microbatch) for c in copies if c.action.kind is OpKind.OFFLOAD
    }
    events: list[tuple[float, int, float]] = []  # (time, order, delta): frees sort before allocs
    for s, p in parts:
        size, key = activation_size[p.stage], (p.stage, p.microbatch)
        streamed_out = streamed_in = 0.0
        if key in offloaded:
            streamed_out = moves[p.stage].moved - moves[p.stage].out
            streamed_in = moves[p.stage].moved - moves[p.stage].back
        if p.kind is OpKind.F:
            steps = moves[p.stage].layers
            for i in range(steps):
                events.append(
                    (s.start + i * (s.end - s.start) / steps, 1, (size - streamed_out) / steps)
                )
        elif p.kind is OpKind.W:
            events.append((s.end, 0, -weight_activation_size[p.stage]))
        elif key not in split:  # B, or an I whose W never runs here
            events.append((s.end, 0, -(size - streamed_in)))
        else:  # I of a split backward: what W still needs stays
            change = weight_activation_size[p.stage] - (size - streamed_in)
            if change:
                events.append((s.end, 0 if change < 0 else 1, change))
    return events


def _copy_events(
    copies: Sequence[Span], moves: Sequence[OffloadMemory]
) -> list[tuple[float, int, float]]:
    """What OFFLOAD copies free and RELOAD copies take back (unsorted)."""
    events: list[tuple[float, int, float]] = []
    for s in copies:
        move = moves[s.action.stage]
        if s.action.kind is OpKind.RELOAD:
            events.append((s.start, 1, move.back))
            continue
        left, at = move.out, s.end
        while left > 1e-12:  # the window leaves a layer at a time, the last at the end
            piece = min(left, move.layer) if move.layer > 0 else left
            events.append((max(s.start, at), 0, -piece))
            left, at = left - piece, at - move.gap
    return events
