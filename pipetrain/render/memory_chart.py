"""Memory per rank over the step, for a terminal: one row of block characters per rank, time
across on the columns of ``render_text``'s grid (one band), so a row lines up under its rank's
timeline drawn in one band.

A column shows the most its rank holds at any moment inside it: the timeline's activation curve
(``Timeline.memory``: held activations and the running action's workspace), plus, when given, the
rank's static memory (parameters, gradients, optimizer state) — together the curve the planner
judges a plan by (``sim.costs.rank_peak_memory``). Heights are eighths of ``limit`` (a budget) or,
without one, of the largest value drawn; a column above the limit is drawn ``!``. Offload has no
marks: activation offload is not built.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from pipetrain.render.style import fmt
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
    for r, row in enumerate(rows):
        lines.append(f"{f'rank {r}':<{label_w}} |{''.join(_block(x, top, limit) for x in row)}|")
    lines.append(
        "peak per rank: " + ", ".join(f"{fmt(p)}" for p in peaks) + suffix
        if timeline.spans
        else "(no spans)"
    )
    return "\n".join(lines)


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
