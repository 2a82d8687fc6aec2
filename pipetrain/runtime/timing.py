"""Measured timelines: when each compute action ran, as the simulator's ``Timeline`` type.

CPU runs read ``time.perf_counter`` around each action; CUDA runs record events (no host sync
inside the step; one ``synchronize`` at the end to read them). Times are milliseconds from this
rank's start mark, taken right after a barrier, so ranks' clocks line up to within one barrier
exit. Every rank's spans are gathered so each rank holds the whole ``Timeline``.

CUDA runs also note the host clock when each action's issue begins, on the device clock's axis (the
start mark is recorded on an idle device, right after a ``synchronize``). An idle gap before an
action that the host had not begun issuing yet is the host's doing, not the schedule's: its sum
per rank is ``Timeline.host_bound_idle``, the part of a measured bubble the simulator does not
model (Python and kernel-launch overhead when actions are short).

A step replayed as a CUDA graph (``Pipeline(cuda_graph="timed")``) is timed by events recorded
inside the graph at capture: external events (``torch.cuda.Event(external=True)``), which a
capture turns into event-record nodes that every replay records again, rather than into
dependencies between streams. The ranks line up as for an eager step — a barrier and a
``synchronize`` before the replay, whose first node is the start mark — and there is no host
clock to compare with: a replay issues nothing per action.

Those host readings, with one more when the host has issued the action, are also the measured
timeline's ``host_spans``: how long the host took to issue each action, and, between them, what
it did besides (posting transfers, polling) — the host side of an eager step that the
simulator's host model prices (``sim.costs``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.comm.barrier import barrier
from pipetrain.schedule.action import Action
from pipetrain.schedule.timeline import Span, Timeline


class Recorder:
    """Collects (action, start, end) on one rank; a disabled recorder costs one branch per action."""

    def __init__(
        self, rank: int, device: torch.device, enabled: bool, captured: bool = False
    ) -> None:
        self.rank = rank
        self.enabled = enabled
        self.cuda = enabled and device.type == "cuda"
        #: records inside a CUDA graph's capture (see the module docstring)
        self.captured = captured
        self._marks: list[tuple[Action, object, object, float]] = []
        #: when the host ended issuing each action (``perf_counter``), beside ``_marks``
        self._issued: list[float] = []
        self._origin: object = None
        self._host_origin = 0.0

    def begin(self, group) -> None:
        if not self.enabled:
            return
        self._marks, self._issued = [], []
        if not self.captured:  # a captured step lines up before each replay instead
            align(group, self.cuda)
        self._host_origin = time.perf_counter()
        self._origin = self._now()

    def _now(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True, external=self.captured)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> tuple[object, float] | None:
        return (self._now(), time.perf_counter()) if self.enabled else None

    def stop(self, action: Action, started: tuple[object, float] | None) -> None:
        if started is not None:
            self._issued.append(time.perf_counter())
            self._marks.append((action, started[0], self._now(), started[1]))

    def host_spans(self) -> list[Span]:
        """When the host began and ended issuing each action (ms since ``begin``, the device
        clock's axis); empty on CPU, where issuing is running, and for a replay."""
        if not self.cuda or self.captured:
            return []
        origin = self._host_origin
        return [
            Span(self.rank, a, (begun - origin) * 1e3, (ended - origin) * 1e3)
            for (a, _, _, begun), ended in zip(self._marks, self._issued)
        ]

    def spans(self) -> list[Span]:
        """This rank's spans in milliseconds since ``begin``."""
        if self.cuda:
            torch.cuda.synchronize()
            origin: Any = self._origin  # a torch.cuda.Event here
            return [
                Span(self.rank, a, origin.elapsed_time(s), origin.elapsed_time(e))
                for a, s, e, _ in self._marks
            ]
        start: Any = self._origin  # a perf_counter reading here
        return [
            Span(self.rank, a, (s - start) * 1e3, (e - start) * 1e3) for a, s, e, _ in self._marks
        ]

    def host_bound_idle(self, spans: list[Span]) -> float | None:
        """Idle time (ms) before actions the host had not begun issuing when the device fell
        idle; ``None`` on CPU, where issuing is running. ``spans`` are this rank's, in order."""
        if not self.cuda or self.captured:
            return None
        total, prev_end = 0.0, None
        for span, (*_, host) in zip(spans, self._marks):
            if prev_end is not None and span.start > prev_end:
                issued = (host - self._host_origin) * 1e3
                total += min(span.start, max(issued, prev_end)) - prev_end
            prev_end = span.end
        return total


def align(group, cuda: bool) -> None:
    """Line the ranks up for a timed step: a barrier, then (CUDA) an idle device, so the start
    mark recorded next runs at once: one axis for the host's and the device's clocks."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        barrier(group)
    if cuda:
        torch.cuda.synchronize()


def gather_timeline(
    group, num_ranks: int, num_stages: int, recorder: Recorder, name: str
) -> Timeline:
    """All ranks' spans as one measured ``Timeline`` (a collective: every rank calls it)."""
    spans = recorder.spans()
    mine = (spans, recorder.host_bound_idle(spans), recorder.host_spans())
    if num_ranks > 1:
        gathered: list[Any] = [None] * num_ranks
        dist.all_gather_object(gathered, mine, group=group)
        everyone: list[Any] = gathered
    else:
        everyone = [mine]
    spans = [s for rank_spans, _, _ in everyone for s in rank_spans]
    spans.sort(key=lambda s: (s.start, s.rank))
    host_spans = [s for _, _, rank_host in everyone for s in rank_host]
    idle = tuple(host for _, host, _ in everyone)
    return Timeline(
        num_ranks=num_ranks,
        spans=tuple(spans),
        activation_size=(1.0,) * num_stages,
        name=name,
        measured=True,
        host_bound_idle=None if None in idle else idle,
        host_spans=tuple(host_spans),
    )
