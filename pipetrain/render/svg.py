"""The SVG Gantt chart: a lane per rank, a rectangle per span, axis, legend and a metrics caption
(and, for an eager step with its hosts' issue spans, a thin bar per issue under each lane).

Layout: a 1200 px wide picture, lanes whose height shrinks with the rank count (36 px down to
10 px), a time axis with 1-2-5 ticks, a legend of the op kinds present and a caption with makespan,
bubble fraction, peak activations per rank and whether the timeline was measured or simulated.
Colours come from ``style`` (colour-blind-safe); a rank's odd chunks are drawn lighter; an
overlapped F&B pair is one rectangle, forward colour on top, backward colour below. Every span is
exactly one ``<rect class="span ...">``, so tools (and tests) can count them. Big timelines stay
small: fills are CSS classes, labels and tooltips are dropped where they would not be readable.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

from pipetrain.render.style import (
    COLOURS,
    NAMES,
    SHORT,
    chunk_of,
    fmt,
    kinds_present,
    text_colour,
    ticks,
)
from pipetrain.schedule.action import OpKind
from pipetrain.schedule.timeline import Span, Timeline

WIDTH = 1200
LEFT, RIGHT = 70, 20
MAX_TOOLTIPS = 3000  # beyond this many spans, skip per-span <title> to keep the file small
LIGHT = 0.55  # opacity of a rank's odd chunks


@dataclass(frozen=True)
class _Layout:
    timeline: Timeline
    top: float
    lane: float
    gap: float
    strip: float = 0.0  # height of the activation strip under each lane (0 = none)
    static: tuple[float, ...] | None = None  # per rank, under the activation curve
    limit: float | None = None  # the memory budget drawn in each strip

    @property
    def scale(self) -> float:
        return (WIDTH - LEFT - RIGHT) / (self.timeline.makespan or 1.0)

    def x(self, t: float) -> float:
        return LEFT + (t - self.timeline.start) * self.scale

    def y(self, rank: int) -> float:
        return self.top + rank * (self.lane + self.strip + self.gap)

    @property
    def bottom(self) -> float:
        return self.y(self.timeline.num_ranks) - self.gap


def render_svg(
    timeline: Timeline,
    title: str = "",
    memory: bool = False,
    static: Sequence[float] | None = None,
    limit: float | None = None,
) -> str:
    """Draw ``timeline`` as a standalone SVG document (a string).

    ``title`` defaults to the timeline's name. With ``memory``, each lane also carries its rank's
    activation curve (``timeline.memory``) as a thin line, scaled to the largest peak, and its
    offload (blue) and reload (orange) copies as bars along the strip's bottom; with
    ``static`` (per rank) the curve stands on the rank's static memory (the planner's curve:
    ``sim.costs.rank_peak_memory``), and with ``limit`` it is scaled to at least that budget,
    drawn dashed.
    """
    title = title or timeline.name
    lane = min(36.0, max(10.0, 480.0 / max(1, timeline.num_ranks)))
    lay = _Layout(
        timeline,
        top=44.0 if title else 16.0,
        lane=lane,
        gap=max(1.0, lane * (0.45 if timeline.host_spans else 0.15)),
        strip=lane * 0.6 if memory else 0.0,
        static=None if static is None else tuple(static),
        limit=limit,
    )
    caption = _caption(timeline)
    height = lay.bottom + 34 + 26 + 16 * len(caption) + 8
    body = [
        f'<rect width="{WIDTH}" height="{height:.0f}" fill="#ffffff"/>',
        *([f'<text class="title" x="{LEFT}" y="26">{escape(title)}</text>'] if title else []),
        *_lanes(lay),
        *_axis(lay),
        *_spans(lay),
        *_hosts(lay),
        *(_memory(lay) if memory else []),
        *_legend(lay, memory),
        *(
            f'<text class="caption" x="{LEFT}" y="{lay.bottom + 78 + 16 * i:.1f}">{escape(line)}</text>'
            for i, line in enumerate(caption)
        ),
    ]
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0f}" '
        f'viewBox="0 0 {WIDTH} {height:.0f}" font-family="Helvetica, Arial, sans-serif">'
    )
    return "\n".join([head, _defs(lay), *body, "</svg>"]) + "\n"


def _defs(lay: _Layout) -> str:
    """CSS classes per kind and the split fills of overlapped pairs (F on top, B or I below).

    Where spans are narrower than ~3 px on average, they are drawn with crisp edges and no outline:
    anti-aliased seams between thousands of slivers would otherwise darken the whole lane."""
    tl = lay.timeline
    mean_px = sum(s.duration for s in tl.spans) * lay.scale / max(1, len(tl.spans))
    # wide spans get a hairline white edge so neighbours of one kind stay apart
    edge = (
        ".span{shape-rendering:crispEdges}"
        if mean_px < 3
        else ".span{stroke:#fff;stroke-width:0.6}"
    )
    rules = [edge]
    rules += [f".{k.name}{{fill:{c}}}" for k, c in COLOURS.items() if k is not OpKind.OVERLAP_F_B]
    rules += [
        f".c1{{fill-opacity:{LIGHT}}}",
        ".lane{fill:#f2f2f2}",
        ".grid{stroke:#d0d0d0;stroke-width:0.5}",
        ".mem{fill:none;stroke:#222;stroke-width:1;stroke-opacity:0.8}",
        ".offload{fill:#1f77b4}.reload{fill:#ff7f0e}",
        ".limit{stroke:#c0392b;stroke-width:0.8;stroke-dasharray:4 3}",
        "text{font-size:11px;fill:#222}",
        ".title{font-size:16px;font-weight:bold}",
        ".caption{font-size:12px}",
        ".lbl{text-anchor:middle;dominant-baseline:central}",
    ]
    grads = [
        f'<linearGradient id="pair-{b.name}" x1="0" y1="0" x2="0" y2="1">'
        f'<stop offset="0.5" stop-color="{COLOURS[OpKind.F]}"/>'
        f'<stop offset="0.5" stop-color="{COLOURS[b]}"/></linearGradient>'
        for b in (OpKind.B, OpKind.I)
    ]
    return f"<defs><style>{''.join(rules)}</style>{''.join(grads)}</defs>"


def _lanes(lay: _Layout) -> list[str]:
    out = []
    size = min(12.0, lay.lane * 0.8)
    for r in range(lay.timeline.num_ranks):
        y = lay.y(r)
        out.append(
            f'<rect class="lane" x="{LEFT}" y="{y:.2f}" width="{WIDTH - LEFT - RIGHT}" '
            f'height="{lay.lane:.2f}"/>'
        )
        out.append(
            f'<text x="{LEFT - 8}" y="{y + lay.lane / 2:.2f}" text-anchor="end" '
            f'dominant-baseline="central" style="font-size:{size:.1f}px">rank {r}</text>'
        )
    return out


def _spans(lay: _Layout) -> list[str]:
    tl = lay.timeline
    chunks = chunk_of(tl)
    tips = len(tl.spans) <= MAX_TOOLTIPS
    out = []
    for s in tl.spans:
        x, w, y = lay.x(s.start), s.duration * lay.scale, lay.y(s.rank)
        odd = chunks[(s.rank, s.action.stage)] % 2 == 1
        if s.action.parts:
            paint = (
                f'class="span {s.action.kind.name}" fill="url(#pair-{s.action.parts[1].kind.name})"'
            )
        else:
            paint = f'class="span {s.action.kind.name}{" c1" if odd else ""}"'
        rect = f'<rect {paint} x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{lay.lane:.2f}"'
        if tips:
            tip = f"{s.action} on rank {s.rank}: {fmt(s.start)}–{fmt(s.end)}"
            out.append(f"{rect}><title>{escape(tip)}</title></rect>")
        else:
            out.append(rect + "/>")
        out.extend(_span_label(s, x + w / 2, y, w, lay.lane, odd))
    return out


def _span_label(s: Span, cx: float, y: float, w: float, h: float, odd: bool) -> list[str]:
    """The micro-batch number centred in the rect, if it fits; a pair gets its forward's number
    in the top (forward-coloured) half and its backward's in the bottom half."""
    parts = s.action.compute_parts
    rows = len(parts)
    longest = max(len(str(p.microbatch)) for p in parts)
    size = min(13.0, h * 0.6 / rows**0.5, (w - 2) / (0.62 * longest))
    if size < 6:
        return []
    out = []
    for i, p in enumerate(parts):
        ink = "#000000" if odd and not s.action.parts else text_colour(COLOURS[p.kind])
        cy = y + h * (2 * i + 1) / (2 * rows)
        out.append(
            f'<text class="lbl" style="font-size:{size:.1f}px;fill:{ink}" x="{cx:.2f}" '
            f'y="{cy:.2f}">{p.microbatch}</text>'
        )
    return out


def _memory(lay: _Layout) -> list[str]:
    """Each rank's activation curve (on its static memory, when given) as a step line in the
    strip under its lane, scaled to the largest peak over all ranks or the limit, whichever is
    larger; the limit as a dashed line."""
    tl = lay.timeline
    static = lay.static or (0.0,) * tl.num_ranks
    top = max((s + p for s, p in zip(static, tl.peak_activations)), default=0.0)
    top = max(top, lay.limit or 0.0)
    if top <= 0:
        return []
    out = []
    for rank, curve in enumerate(tl.memory):
        base = lay.y(rank) + lay.lane + lay.strip
        height = lay.strip * 0.85
        if lay.limit is not None:
            y = base - lay.limit / top * height
            out.append(
                f'<line class="limit" x1="{LEFT}" y1="{y:.2f}" x2="{WIDTH - RIGHT}" y2="{y:.2f}"/>'
            )
        held = static[rank]
        pts: list[str] = [f"{lay.x(tl.start):.2f},{base - held / top * height:.2f}"]
        for t, now in curve:
            now += static[rank]
            x = lay.x(min(max(t, tl.start), tl.end))
            pts.append(f"{x:.2f},{base - held / top * height:.2f}")
            pts.append(f"{x:.2f},{base - now / top * height:.2f}")
            held = now
        pts.append(f"{lay.x(tl.end):.2f},{base - held / top * height:.2f}")
        out.append(f'<polyline class="mem" points="{" ".join(pts)}"/>')
    return out + _copies(lay)


def _hosts(lay: _Layout) -> list[str]:
    """Each rank's host issuing its actions (an eager step's ``host_spans``) as thin bars in the
    gap under its lane, coloured by kind, each titled with its action."""
    out = []
    for span in lay.timeline.host_spans:
        y = lay.y(span.rank) + lay.lane + lay.strip + lay.gap * 0.15
        x, w = lay.x(span.start), max(span.duration * lay.scale, 0.5)
        out.append(
            f'<rect class="span {span.action.kind.name}" x="{x:.2f}" y="{y:.2f}" '
            f'width="{w:.2f}" height="{lay.gap * 0.55:.2f}"><title>host issues {span.action}'
            "</title></rect>"
        )
    return out


def _copies(lay: _Layout) -> list[str]:
    """Offload and reload copies (``schedule.offload``) as thin bars along the bottom of each
    rank's memory strip, offloads above reloads, each titled with its action."""
    out = []
    for copy in lay.timeline.copies:
        offload = copy.action.kind is OpKind.OFFLOAD
        y = lay.y(copy.rank) + lay.lane + lay.strip * (0.86 if offload else 0.93)
        x, w = lay.x(copy.start), max(copy.duration * lay.scale, 0.5)
        kind = "offload" if offload else "reload"
        out.append(
            f'<rect class="{kind}" x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" '
            f'height="{lay.strip * 0.06:.2f}"><title>{copy.action}</title></rect>'
        )
    return out


def _axis(lay: _Layout) -> list[str]:
    """Gridlines through the lanes, the axis line, tick labels and the unit."""
    tl = lay.timeline
    out = [
        f'<line x1="{LEFT}" y1="{lay.bottom + 4:.2f}" x2="{WIDTH - RIGHT}" '
        f'y2="{lay.bottom + 4:.2f}" stroke="#444"/>'
    ]
    for t in ticks(tl.start, tl.end, 12):
        x = lay.x(t)
        out.append(
            f'<line class="grid" x1="{x:.2f}" y1="{lay.top:.2f}" x2="{x:.2f}" '
            f'y2="{lay.bottom + 8:.2f}"/>'
        )
        out.append(
            f'<text x="{x:.2f}" y="{lay.bottom + 20:.2f}" text-anchor="middle">{fmt(t)}</text>'
        )
    unit = "time (ms)" if tl.measured else "time (cost units)"
    out.append(
        f'<text x="{WIDTH - RIGHT}" y="{lay.bottom + 32:.2f}" text-anchor="end">{unit}</text>'
    )
    return out


def _legend(lay: _Layout, memory: bool) -> list[str]:
    y = lay.bottom + 44
    x = float(LEFT)
    out = []
    entries: list[tuple[str, str]] = []  # (class and fill attributes, text)
    for k in kinds_present(lay.timeline):
        paint = 'class="swatch" fill="url(#pair-B)"' if k is OpKind.OVERLAP_F_B else ""
        entries.append((paint or f'class="swatch {k.name}"', f"{SHORT[k]} {NAMES[k]}"))
    chunks = chunk_of(lay.timeline).values()
    if any(i % 2 for i in chunks):
        text = "a rank's 2nd chunk" if max(chunks) < 2 else "odd chunks (tooltips name stages)"
        entries.append(('class="swatch F c1"', f"lighter: {text}"))
    entries.append(('class="swatch lane" stroke="#bbb"', "idle"))
    for paint, text in entries:
        out.append(f'<rect {paint} x="{x:.1f}" y="{y}" width="14" height="12"/>')
        out.append(f'<text x="{x + 19:.1f}" y="{y + 10}">{escape(text)}</text>')
        x += 19 + 6.2 * len(text) + 18
    if memory:
        what = "memory (static + activations)" if lay.static is not None else "activations held"
        out.append(f'<line class="mem" x1="{x:.1f}" y1="{y + 6}" x2="{x + 14:.1f}" y2="{y + 6}"/>')
        out.append(f'<text x="{x + 19:.1f}" y="{y + 10}">{what}</text>')
        if lay.limit is not None:
            x += 19 + 6.2 * len(what) + 18
            out.append(
                f'<line class="limit" x1="{x:.1f}" y1="{y + 6}" x2="{x + 14:.1f}" y2="{y + 6}"/>'
            )
            out.append(f'<text x="{x + 19:.1f}" y="{y + 10}">limit {fmt(lay.limit)}</text>')
    return out


def _caption(tl: Timeline) -> list[str]:
    """Caption lines: headline metrics, then peak activations per rank (wrapped)."""
    source = "measured" if tl.measured else "simulated"
    first = (
        f"{source} · makespan {fmt(tl.makespan)} · bubble {tl.bubble_fraction * 100:.1f}% · "
        f"{len(tl.spans)} spans on {tl.num_ranks} ranks"
    )
    peaks = " ".join(f"r{r}={fmt(p)}" for r, p in enumerate(tl.peak_activations))
    hosts = ["thin bars under each lane: when its rank's host issued each action"]
    return [
        first,
        *textwrap.wrap(f"peak activations per rank: {peaks}", 150),
        *(hosts if tl.host_spans else []),
    ]
