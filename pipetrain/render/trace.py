"""Chrome / Perfetto trace JSON of a timeline (open in ui.perfetto.dev or chrome://tracing).

Units: timeline time is read as **milliseconds** (what the runtime measures; a simulated
timeline's abstract cost units then read as 1 ms each) and written as the trace format's
microseconds, so ``ts = start × 1000``. Times are not shifted: a span starting at 0 has ``ts`` 0.

One process (pid 0) holds one thread per rank (tid = rank, named ``rank r``). Each span is a
complete ("X") event named by its action (``1F3``, ``(0F7;7B3)OVERLAP_F_B``) with the op kind as
category; each rank's activation curve is a counter ("C") track ``activations rank r``. Offload
and reload copies (``schedule.offload``), which run beside compute, go on a thread of their own
per rank (tid = ranks + rank, named ``rank r copies``); where the timeline has the host's issue
spans (an eager GPU step, measured or simulated with host times), they go on a third
(tid = 2 × ranks + rank, named ``rank r host``), so a device waiting for its host shows as a
gap under a host span.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from pipetrain.schedule.timeline import Span, Timeline

PID = 0
US_PER_UNIT = 1000.0  # timeline milliseconds → trace microseconds


def render_trace(timeline: Timeline) -> dict[str, Any]:
    """The trace as a JSON-ready dict ``{"traceEvents": [...], "displayTimeUnit": "ms", ...}``."""
    events: list[dict[str, Any]] = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": PID,
            "tid": 0,
            "args": {"name": timeline.name or "pipetrain"},
        }
    ]
    for rank in range(timeline.num_ranks):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": PID,
                "tid": rank,
                "args": {"name": f"rank {rank}"},
            }
        )
        events.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": PID,
                "tid": rank,
                "args": {"sort_index": rank},
            }
        )
    events.extend(_span_event(s) for s in sorted(timeline.spans, key=lambda s: (s.start, s.rank)))
    events.extend(_side_track(timeline, timeline.copies, 1, "copies"))
    events.extend(_side_track(timeline, timeline.host_spans, 2, "host"))
    events.extend(_counter_events(timeline))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": "measured" if timeline.measured else "simulated",
            "time_unit": "timeline units read as ms; ts/dur in us",
            **timeline.summary(),
        },
    }


def write_trace(timeline: Timeline, path: str | os.PathLike[str]) -> None:
    """Write ``render_trace(timeline)`` to ``path`` as JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(render_trace(timeline), f)


def _side_track(
    timeline: Timeline, spans: tuple[Span, ...], track: int, label: str
) -> list[dict[str, Any]]:
    """``spans`` on one thread per rank (tid = ``track`` × ranks + rank, named ``rank r label``)
    after the ranks' own."""
    if not spans:
        return []
    events: list[dict[str, Any]] = []
    offset = track * timeline.num_ranks
    for rank in range(timeline.num_ranks):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": PID,
                "tid": offset + rank,
                "args": {"name": f"rank {rank} {label}"},
            }
        )
    for span in sorted(spans, key=lambda s: (s.start, s.rank)):
        event = _span_event(span)
        event["tid"] = offset + span.rank
        events.append(event)
    return events


def _span_event(span: Span) -> dict[str, Any]:
    action = span.action
    args: dict[str, Any] = {"stage": action.stage, "microbatch": action.microbatch}
    if action.parts:
        args["parts"] = [str(p) for p in action.parts]
    return {
        "name": str(action),
        "cat": action.kind.value,
        "ph": "X",
        "pid": PID,
        "tid": span.rank,
        "ts": span.start * US_PER_UNIT,
        "dur": span.duration * US_PER_UNIT,
        "args": args,
    }


def _counter_events(timeline: Timeline) -> list[dict[str, Any]]:
    """One counter track per rank: activations held, in units of one micro-batch's activation."""
    events = []
    for rank, curve in enumerate(timeline.memory):
        for t, held in curve:
            if math.isfinite(t):
                events.append(
                    {
                        "name": f"activations rank {rank}",
                        "ph": "C",
                        "pid": PID,
                        "tid": rank,
                        "ts": t * US_PER_UNIT,
                        "args": {"activations": held},
                    }
                )
    return events
