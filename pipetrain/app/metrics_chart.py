"""A run's metrics file drawn as SVG: the training loss and the held-out loss over the steps in one
panel, the learning rate under it on the same step axis.

Hand-written SVG like ``render.svg``'s (no plotting library to install; the file opens in any
browser): 1-2-5 ticks from ``render.style``, a line per series, the evaluations as dots on their
own line (there are few of them), a legend naming each series with its last value. ``write_chart``
is what ``pipetrain train --metrics FILE`` calls at the end and ``pipetrain report`` runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from pipetrain.render.style import fmt, ticks

WIDTH, LEFT, RIGHT = 900, 80, 30
LOSS_TOP, LOSS_HEIGHT = 80, 300
LR_TOP, LR_HEIGHT = LOSS_TOP + LOSS_HEIGHT + 60, 140
HEIGHT = LR_TOP + LR_HEIGHT + 50
#: Okabe-Ito colours (colour-blind safe, as ``render.style``'s)
LOSS_COLOUR, EVAL_COLOUR, LR_COLOUR = "#0072B2", "#D55E00", "#009E73"


def series(records: Sequence[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """``(step, value)`` of the records that have a number for ``key``."""
    return [
        (float(r["step"]), float(r[key]))
        for r in records
        if isinstance(r.get(key), (int, float)) and r[key] == r[key]  # NaN left out
    ]


def render_chart(records: Sequence[dict[str, Any]], title: str) -> str:
    """The SVG of ``records`` (a metrics file's; see the module docstring)."""
    if not records:
        raise ValueError("no step in the metrics: nothing to draw")
    loss, evals, lr = (series(records, key) for key in ("loss", "eval_loss", "lr"))
    steps = [float(r["step"]) for r in records]
    first, last = min(steps), max(steps)
    if first == last:
        first -= 1
    x = _scale(first, last, LEFT, WIDTH - RIGHT)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif">',
        "<style>text{font-size:11px;fill:#222}.title{font-size:16px;font-weight:bold}"
        ".axis{stroke:#444;stroke-width:1}.grid{stroke:#ddd;stroke-width:1}</style>",
        '<rect width="100%" height="100%" fill="#ffffff"/>',
        f'<text class="title" x="{LEFT}" y="26">{escape(title)}</text>',
    ]
    values = [v for _, v in loss + evals] or [0.0]
    parts += _panel(x, (first, last), values, LOSS_TOP, LOSS_HEIGHT, "loss", False)
    y = _y_of(values, LOSS_TOP, LOSS_HEIGHT, False)
    parts += _line(x, y, loss, LOSS_COLOUR, 1.5) + _line(x, y, evals, EVAL_COLOUR, 2, True)
    rates = [v for _, v in lr] or [0.0]
    parts += _panel(x, (first, last), rates, LR_TOP, LR_HEIGHT, "learning rate", True)
    parts += _line(x, _y_of(rates, LR_TOP, LR_HEIGHT, True), lr, LR_COLOUR, 1.5)
    legend = [("loss", loss, LOSS_COLOUR), ("eval loss", evals, EVAL_COLOUR), ("lr", lr, LR_COLOUR)]
    parts += _legend([(name, s[-1][1], colour) for name, s, colour in legend if s])
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_chart(metrics: str | Path, out: str | Path | None = None) -> Path:
    """Draw the metrics file ``metrics`` to ``out`` (default: beside it, ``.svg``); its path."""
    from pipetrain.app.metrics import read_metrics

    path = Path(out) if out is not None else Path(metrics).with_suffix(".svg")
    svg = render_chart(read_metrics(metrics), f"{Path(metrics).name}: loss and learning rate")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(svg)
    return path


def _scale(lo: float, hi: float, out_lo: float, out_hi: float):
    span = (hi - lo) or 1.0
    return lambda v: out_lo + (v - lo) / span * (out_hi - out_lo)


def _bounds(values: Sequence[float], from_zero: bool) -> tuple[float, float]:
    lo, hi = (0.0 if from_zero else min(values)), max(values)
    if hi <= lo:
        lo, hi = lo - 0.5 * (abs(lo) or 1.0), hi + 0.5 * (abs(hi) or 1.0)
    pad = 0.0 if from_zero else 0.05 * (hi - lo)
    return lo - pad, hi + pad


def _y_of(values: Sequence[float], top: float, height: float, from_zero: bool):
    lo, hi = _bounds(values, from_zero)
    return _scale(lo, hi, top + height, top)


def _panel(x, steps, values, top, height, label, from_zero) -> list[str]:
    """A panel's frame, grid, value ticks and step ticks."""
    lo, hi = _bounds(values, from_zero)
    y = _scale(lo, hi, top + height, top)
    right, bottom = WIDTH - RIGHT, top + height
    out = [f'<text x="{LEFT}" y="{top - 8}" style="font-weight:bold">{label}</text>']
    for v in ticks(lo, hi, 6):
        out.append(f'<line class="grid" x1="{LEFT}" x2="{right}" y1="{y(v):.1f}" y2="{y(v):.1f}"/>')
        out.append(
            f'<text x="{LEFT - 6}" y="{y(v):.1f}" text-anchor="end" '
            f'dominant-baseline="central">{fmt(v)}</text>'
        )
    for s in ticks(steps[0], steps[1], 10):
        tick = f'x1="{x(s):.1f}" x2="{x(s):.1f}" y1="{bottom}" y2="{bottom + 4}"'
        out.append(f'<line class="axis" {tick}/>')
        out.append(f'<text x="{x(s):.1f}" y="{bottom + 16}" text-anchor="middle">{fmt(s)}</text>')
    out.append(
        f'<rect x="{LEFT}" y="{top}" width="{right - LEFT}" height="{height}" fill="none" '
        'class="axis"/>'
    )
    out.append(f'<text x="{right}" y="{bottom + 30}" text-anchor="end">step</text>')
    return out


def _line(x, y, points, colour: str, width: float, dots: bool = False) -> list[str]:
    if not points:
        return []
    path = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
    out = [f'<polyline fill="none" stroke="{colour}" stroke-width="{width}" points="{path}"/>']
    if dots:
        out += [
            f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="3.5" fill="{colour}"/>' for s, v in points
        ]
    return out


def _legend(entries: Sequence[tuple[str, float, str]]) -> list[str]:
    out = []
    for i, (name, last, colour) in enumerate(entries):
        cx = LEFT + 190 * i
        out.append(f'<rect x="{cx}" y="42" width="16" height="4" fill="{colour}"/>')
        out.append(f'<text x="{cx + 22}" y="48">{escape(name)} (last {fmt(last)})</text>')
    return out


__all__ = ["render_chart", "series", "write_chart"]
