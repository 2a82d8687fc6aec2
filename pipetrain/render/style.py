"""What every renderer draws the same way: colours per op kind, span labels, axis ticks.

The palette is Okabe & Ito's (2008) colour-blind-safe set. The renderers (``text``, ``svg``,
``trace``) own layout and labels; this module owns only the shared look and the facts about a
timeline they all need (which kinds occur, which chunk of its rank a stage is).
"""

from __future__ import annotations

import math

from pipetrain.schedule.action import OpKind
from pipetrain.schedule.timeline import Timeline

#: fill colour per compute kind (Okabe-Ito); an overlapped pair in the SVG uses its parts' colours
COLOURS: dict[OpKind, str] = {
    OpKind.F: "#0072B2",  # blue
    OpKind.B: "#E69F00",  # orange
    OpKind.I: "#D55E00",  # vermillion
    OpKind.W: "#009E73",  # bluish green
    OpKind.OVERLAP_F_B: "#CC79A7",  # reddish purple
}

#: legend wording per compute kind, in legend order
NAMES: dict[OpKind, str] = {
    OpKind.F: "forward",
    OpKind.B: "backward",
    OpKind.I: "input grad",
    OpKind.W: "weight grad",
    OpKind.OVERLAP_F_B: "overlapped",
}

#: short spelling of a kind in labels and legends
SHORT: dict[OpKind, str] = {k: k.value for k in NAMES} | {OpKind.OVERLAP_F_B: "F+B"}


def kinds_present(timeline: Timeline) -> list[OpKind]:
    """The compute kinds that occur in ``timeline``, in legend order."""
    seen = {s.action.kind for s in timeline.spans}
    return [k for k in NAMES if k in seen]


def multi_stage(timeline: Timeline) -> bool:
    """True when some rank runs actions of more than one stage (so labels must name the stage)."""
    stages: dict[int, int] = {}
    for s in timeline.spans:
        for p in s.action.compute_parts:
            if stages.setdefault(s.rank, p.stage) != p.stage:
                return True
    return False


def chunk_of(timeline: Timeline) -> dict[tuple[int, int], int]:
    """(rank, stage) → the stage's position among the stages on that rank (0 = lowest stage)."""
    per_rank: dict[int, set[int]] = {}
    for s in timeline.spans:
        per_rank.setdefault(s.rank, set()).update(p.stage for p in s.action.compute_parts)
    return {
        (rank, stage): i
        for rank, stages in per_rank.items()
        for i, stage in enumerate(sorted(stages))
    }


def nice_step(extent: float, max_ticks: int) -> float:
    """A 1-2-5 × 10^k tick step giving at most ``max_ticks`` ticks over ``extent``."""
    if extent <= 0 or max_ticks < 1:
        return 1.0
    raw = extent / max_ticks
    base = 10 ** math.floor(math.log10(raw))
    return float(next(m * base for m in (1, 2, 5, 10) if m * base >= raw))


def ticks(start: float, end: float, max_ticks: int) -> list[float]:
    """Tick values (multiples of a nice step) within [start, end]."""
    step = nice_step(end - start, max_ticks)
    first = math.ceil(start / step - 1e-9)
    last = math.floor(end / step + 1e-9)
    return [round(i * step, 10) for i in range(first, last + 1)]


def fmt(value: float) -> str:
    """A number for people: at most 4 significant digits, no trailing zeros."""
    return f"{value:.4g}"


def text_colour(fill: str) -> str:
    """Black or white, whichever reads better on ``fill`` (``#rrggbb``)."""
    r, g, b = (int(fill[i : i + 2], 16) for i in (1, 3, 5))
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#ffffff"
