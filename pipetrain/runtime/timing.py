"""Measured timelines: when each compute action ran, as the simulator's ``Timeline`` type.

CPU runs read ``time.perf_counter`` around each action; CUDA runs record events (no host sync
inside the step; one ``synchronize`` at the end to read them). Times are milliseconds from this
rank's start mark, taken right after a barrier, so ranks' clocks line up to within one barrier
exit. Every rank's spans are gathered so each rank holds the whole ``Timeline``.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from pipetrain.schedule.action import Action
from pipetrain.schedule.timeline import Span, Timeline


class Recorder:
    """Collects (action, start, end) on one rank; a disabled recorder costs one branch per action."""

    def __init__(self, rank: int, device: torch.device, enabled: bool) -> None:
        self.rank = rank
        self.enabled = enabled
        self.cuda = enabled and device.type == "cuda"
        self._marks: list[tuple[Action, object, object]] = []
        self._origin: object = None

    def begin(self, group) -> None:
        if not self.enabled:
            return
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.barrier(group=group)
        self._origin = self._now()

    def _now(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> object:
        return self._now() if self.enabled else None

    def stop(self, action: Action, started: object) -> None:
        if self.enabled:
            self._marks.append((action, started, self._now()))

    def spans(self) -> list[Span]:
        """This rank's spans in milliseconds since ``begin``."""
        if self.cuda:
            torch.cuda.synchronize()
            origin = self._origin
            return [
                Span(self.rank, a, origin.elapsed_time(s), origin.elapsed_time(e))
                for a, s, e in self._marks
            ]
        return [
            Span(self.rank, a, (s - self._origin) * 1e3, (e - self._origin) * 1e3)
            for a, s, e in self._marks
        ]


def gather_timeline(
    recorder: Recorder, group, num_ranks: int, num_stages: int, name: str
) -> Timeline:
    """All ranks' spans as one measured ``Timeline`` (a collective: every rank calls it)."""
    mine = recorder.spans()
    if num_ranks > 1:
        everyone: list[list[Span] | None] = [None] * num_ranks
        dist.all_gather_object(everyone, mine, group=group)
        spans = [s for rank_spans in everyone for s in rank_spans or ()]
    else:
        spans = mine
    spans.sort(key=lambda s: (s.start, s.rank))
    return Timeline(
        num_ranks=num_ranks,
        spans=tuple(spans),
        activation_size=(1.0,) * num_stages,
        name=name,
        measured=True,
    )
