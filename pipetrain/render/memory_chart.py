"""Memory per rank over the step, for a terminal: one row of block characters per rank, time
across on the columns of ``render_text``'s grid (one band), so a row lines up under its rank's
timeline drawn in one band.

A column shows the most its rank holds at any moment inside it: the timeline's activation curve
(``Timeline.memory``: held activations and the running action's workspace), plus, when given, the
rank's static memory (parameters, gradients, optimizer state) — together the curve the planner
judges a plan by (``sim.costs.rank_peak_memory``). Heights are eighths of ``limit`` (a budget) or,
without one, of the largest value drawn; a column above the limit is drawn ``!``. Where the
timeline has offload copies (``schedule.offload``), a row under each rank marks the columns where
an offload ends (``v``: its share of the activation left for host memory), where a reload starts
(``^``: it came back) or both (``x``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from pipetrain.render.style import fmt
from pipetrain.schedule.action import OpKind
from pipetrain.schedule.timeline import Timeline

#: heights 0 to 8 eighths
LEVELS = " ▁▂▃▄▅▆▇█"
OVER = "!"


def render_memory_text(
    timeline: Timeline,
    width: int = 100,
    static: Sequence[float] | None = None,
    limit: float | None = None,
    unit: str = "",
) -> str:
    """Rows of memory per rank over ``timeline`` in ``width`` columns (minimum 30), a header
    naming the scale and each rank's peak. ``static``: per rank, added to the curve; ``limit``:
    the value a full block stands for; ``unit``: appended to the numbers (``"GiB"``)."""
    width = max(width, 30)
    label_w = len(f"rank {timeline.num_ranks - 1}")
    cols = width - label_w - 3
    base = list(static) if static is not None else [0.0] * timeline.num_ranks
    rows = [
        _columns(curve, timeline.start, timeline.makespan, cols, base[r])
        for r, curve in enumerate(timeline.memory)
    ]
    peaks = [max(row, default=0.0) for row in rows]
    top = limit if limit is not None else max(peaks, default=0.0)
    what = "static + held" if static is not None else "held activations"
    scale = "the limit" if limit is not None else "the largest peak"
    suffix = f" {unit}" if unit else ""
    lines = [f"memory per rank ({what}; █ = {fmt(top)}{suffix}, {scale}):"]
    marks = _copy_marks(timeline, cols) if timeline.copies else None
    for r, row in enumerate(rows):
        lines.append(f"{f'rank {r}':<{label_w}} |{''.join(_block(x, top, limit) for x in row)}|")
        if marks is not None:
            lines.append(f"{'':<{label_w}} |{''.join(marks[r])}|")
    if marks is not None:
        lines.append("v: an offload ends (to host memory), ^: a reload starts, x: both")
    lines.append(
        "peak per rank: " + ", ".join(f"{fmt(p)}" for p in peaks) + suffix
        if timeline.spans
        else "(no spans)"
    )
    return "\n".join(lines)


def _copy_marks(timeline: Timeline, cols: int) -> list[list[str]]:
    """Per rank, per column: where offloads end and reloads start (the curve's steps)."""
    marks = [[" "] * cols for _ in range(timeline.num_ranks)]
    span = timeline.makespan or 1.0
    for copy in timeline.copies:
        offload = copy.action.kind is OpKind.OFFLOAD
        at = copy.end if offload else copy.start
        col = min(cols - 1, max(0, int((at - timeline.start) / span * cols)))
        now, mark = marks[copy.rank][col], "v" if offload else "^"
        marks[copy.rank][col] = mark if now in (" ", mark) else "x"
    return marks


def _block(value: float, top: float, limit: float | None) -> str:
    if limit is not None and value > limit * (1 + 1e-12):
        return OVER
    if top <= 0 or value <= 0:
        return LEVELS[0]
    return LEVELS[min(8, max(1, math.ceil(value / top * 8 - 1e-9)))]


def _columns(
    curve: Sequence[tuple[float, float]], start: float, span: float, cols: int, base: float
) -> list[float]:
    """The largest value of the step curve ``curve`` (held from each point on) in each of
    ``cols`` equal slices of ``[start, start + span)``, plus ``base``."""
    times = [t for t, _ in curve]
    out = []
    for c in range(cols):
        lo = start + span * c / cols
        hi = start + span * (c + 1) / cols
        first = bisect.bisect_right(times, lo) - 1  # the last change at or before ``lo``
        at_lo = curve[first][1] if first >= 0 else 0.0
        inside = [curve[i][1] for i in range(first + 1, bisect.bisect_left(times, hi))]
        out.append(base + max([at_lo, *inside]))
    return out
