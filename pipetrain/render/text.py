"""The terminal timeline: one row per rank, time across, a block per span, a time axis, a legend.

Every line (rank label, grid, frame) fits ``width`` columns. Each column shows the op kind that
covers most of it (or a bubble, when idle time dominates), and a block wide enough carries its
label (``F3``; lower case ``f3`` for a rank's second chunk, so chunks stay apart without stage
numbers; with three or more chunks on a rank, the stage before it, as ``pipetrain show`` writes
actions: ``4F3``). When a typical action would be too narrow for its label, time wraps into a few bands,
one under the other, each with its own axis; a timeline that would need more bands (thousands of
spans) draws in one, as a heat map. Without colour, kinds are told apart by fill characters; with
colour (ANSI 256-colour backgrounds) by the ``style`` palette. A timeline with its hosts' issue
spans (an eager GPU step, measured or simulated with host times) draws each rank's host in a row
under it, so a device idle under a busy host reads as a host-bound stretch.
"""

from __future__ import annotations

import math
import os
import sys
import textwrap
from collections.abc import Sequence

from pipetrain.render.style import (
    COLOURS,
    NAMES,
    SHORT,
    chunk_of,
    fmt,
    kinds_present,
    multi_stage,
    text_colour,
    ticks,
)
from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.timeline import Span, Timeline

#: fill character per kind when drawing without colour
FILL: dict[OpKind, str] = {
    OpKind.F: "-",
    OpKind.B: "=",
    OpKind.I: "~",
    OpKind.W: "+",
    OpKind.OVERLAP_F_B: "#",
}
IDLE = "."
RESET = "\x1b[0m"
#: at most this many bands of time, one under the other, before labels give way to a heat map
MAX_BANDS = 4

Cell = tuple[str, OpKind | None]  # (character, kind drawn under it; None = bubble)


def render_text(
    timeline: Timeline, width: int = 100, color: bool | None = None, max_bands: int = MAX_BANDS
) -> str:
    """Draw ``timeline`` for a terminal, every line at most ``width`` columns (minimum 30).

    When a typical action would get too few columns for its label, time wraps into up to
    ``max_bands`` bands (each a row per rank and its own axis) so labels stay readable; a timeline
    that would need more bands is drawn in one, as a heat map. ``color`` True adds ANSI colour,
    False never does, None colours only when stdout is a TTY and ``NO_COLOR`` is unset.
    """
    colour = _want_colour(color)
    width = max(width, 30)
    head = _header(timeline)
    if not timeline.spans or timeline.makespan <= 0:
        return "\n".join([*textwrap.wrap(head, width), "(no spans)"])
    label_w = len(f"rank {timeline.num_ranks - 1}")
    cols = width - label_w - 3  # "rank r |" + grid + "|"
    bands = _bands_for_labels(timeline, cols, max_bands)
    scale = bands * cols / timeline.makespan
    rows = _dominant(timeline.spans, timeline, bands * cols, scale)
    _overlay_labels(rows, timeline, scale, cols)
    hosts = _dominant(timeline.host_spans, timeline, bands * cols, scale)
    lines = textwrap.wrap(head, width)
    for band in range(bands):
        lo, hi = band * cols, (band + 1) * cols
        if band:
            lines.append("")
        for rank, row in enumerate(rows):
            lines.append(f"{f'rank {rank}':<{label_w}} |{_paint(row[lo:hi], colour)}|")
            if timeline.host_spans:
                lines.append(f"{'host':>{label_w}} |{_paint(hosts[rank][lo:hi], colour)}|")
        lines.extend(_axis(timeline.start + lo / scale, cols, scale, label_w + 2))
    unit = "ms" if timeline.measured else "time units"
    notes = [_chunk_note(chunk_of(timeline))] if multi_stage(timeline) else []
    notes.append(f"1 column = {1 / scale:.3g} {unit}")
    if timeline.host_spans:
        notes.append("host: when the rank's host issued each action (an eager step)")
    lines.extend(_legend(kinds_present(timeline), colour, notes, width))
    return "\n".join(lines)


def _bands_for_labels(timeline: Timeline, cols: int, max_bands: int) -> int:
    """How many bands of ``cols`` columns give a median-length action room for its label."""
    durations = sorted(s.end - s.start for s in timeline.spans if s.end > s.start)
    if not durations:
        return 1
    need = 1 + max(len(str(s.action.microbatch)) for s in timeline.spans)  # "F12": kind + number
    chunks = chunk_of(timeline) if multi_stage(timeline) else {}
    typical = [durations[len(durations) // 2]]
    if max(chunks.values(), default=0) >= 2:  # "14F12": the stage first (``_label``), which
        need += len(str(max(stage for _, stage in chunks)))  # only a label says: room for the
        typical.insert(0, durations[len(durations) // 4])  # shorter actions' too, where it fits
    for length in typical:
        wanted = math.ceil(timeline.makespan * need / length / cols - 1e-9)
        if 1 <= wanted <= max_bands:
            return wanted
    return 1


def _want_colour(color: bool | None) -> bool:
    if color is not None:
        return color
    return sys.stdout.isatty() and "NO_COLOR" not in os.environ


def _header(timeline: Timeline) -> str:
    source = "measured" if timeline.measured else "simulated"
    name = timeline.name or "timeline"
    text = f"{name} ({source}): makespan {fmt(timeline.makespan)}"
    text += f", bubble {timeline.bubble_fraction:.1%}"
    peaks = timeline.peak_activations
    if peaks:
        top = max(range(len(peaks)), key=peaks.__getitem__)
        text += f", peak activations {fmt(peaks[top])} (rank {top})"
    return text


def _dominant(
    spans: Sequence[Span], timeline: Timeline, cols: int, scale: float
) -> list[list[Cell]]:
    """Per rank and column, the kind of ``spans`` (the timeline's, or its hosts') covering most
    of the column (None when idle dominates)."""
    cover: list[list[dict[OpKind, float]]] = [
        [{} for _ in range(cols)] for _ in range(timeline.num_ranks)
    ]
    for s in spans:
        a = (s.start - timeline.start) * scale
        b = (s.end - timeline.start) * scale
        for c in range(max(0, int(a)), min(cols, int(b) + 1)):
            part = min(b, c + 1) - max(a, c)
            if part > 0:
                cell = cover[s.rank][c]
                cell[s.action.kind] = cell.get(s.action.kind, 0.0) + part
    rows: list[list[Cell]] = []
    for rank_cover in cover:
        row: list[Cell] = []
        for cell in rank_cover:
            kind = max(cell, key=cell.__getitem__, default=None)
            if kind is None or cell[kind] < 1.0 - sum(cell.values()):
                row.append((IDLE, None))
            else:
                row.append((FILL[kind], kind))
        rows.append(row)
    return rows


def _overlay_labels(
    rows: list[list[Cell]], timeline: Timeline, scale: float, band_cols: int
) -> None:
    """Write each span's label at the start of its block and fill the rest of the block.

    A label never straddles two bands: a block that starts at a band's end is labelled where it
    continues, at the start of the next band.
    """
    chunks = chunk_of(timeline) if multi_stage(timeline) else None
    cols = len(rows[0]) if rows else 0
    for s in timeline.spans:
        first = round((s.start - timeline.start) * scale)
        last = min(cols, round((s.end - timeline.start) * scale))
        row = rows[s.rank]
        for c in range(first, last):
            row[c] = (FILL[s.action.kind], s.action.kind)
        band_end = (first // band_cols + 1) * band_cols
        at = first
        text = _label(s.action, s.rank, chunks, min(last, band_end) - first)
        if not text and last > band_end:
            at = band_end
            text = _label(s.action, s.rank, chunks, last - band_end)
        for i, ch in enumerate(text):
            row[at + i] = (ch, s.action.kind)


def _chunk_note(chunks: dict[tuple[int, int], int]) -> str:
    """The legend's line for how a label names its stage (``_label``)."""
    if max(chunks.values(), default=0) < 2:
        return "f3 = a rank's 2nd chunk"
    return "4F3 = stage 4, micro-batch 3"


def _label(action: Action, rank: int, chunks: dict[tuple[int, int], int] | None, room: int) -> str:
    """The longest label that fits a block of ``room`` cells.

    ``F3`` may fill its block (``F3F4`` still reads as two blocks); a bare ``3`` needs one fill
    cell after it. With two stages per rank, the label is lower case for a rank's second chunk
    (``f3``), so the chunks stay apart without a stage number; with three or more, where case
    alone would draw chunks 0 and 2 alike, it starts with the stage (``4F3``, as ``pipetrain
    show`` writes an action). The legend says which.
    """
    parts = action.compute_parts
    many = chunks is not None and max(chunks.values()) >= 2

    def one(stage: int, kind: str, microbatch: int) -> str:
        if chunks is None:
            return kind + str(microbatch)
        if many:
            return f"{stage}{kind}{microbatch}"
        return (kind.lower() if chunks[(rank, stage)] % 2 else kind) + str(microbatch)

    short = "+".join(one(p.stage, p.kind.value, p.microbatch) for p in parts)
    if len(short) <= room:
        return short
    bare = "+".join(str(p.microbatch) for p in parts)
    return bare if len(bare) < room else ""


def _ansi(fill: str) -> str:
    """The xterm-256 background (and readable foreground) escape nearest to ``#rrggbb``."""
    levels = (0, 95, 135, 175, 215, 255)

    def nearest(value: int) -> int:
        return min(range(6), key=lambda i: abs(levels[i] - value))

    r, g, b = (nearest(int(fill[i : i + 2], 16)) for i in (1, 3, 5))
    fg = 16 if text_colour(fill) == "#000000" else 231
    return f"\x1b[48;5;{16 + 36 * r + 6 * g + b};38;5;{fg}m"


def _paint(row: list[Cell], colour: bool) -> str:
    if not colour:
        return "".join(ch for ch, _ in row)
    out: list[str] = []
    current: OpKind | str | None = "start"
    for ch, kind in row:
        if kind != current:
            out.append(RESET if kind is None else _ansi(COLOURS[kind]))
            current = kind
        if kind is None:
            out.append(" ")
        else:
            out.append(ch if ch != FILL[kind] else " ")
    out.append(RESET)
    return "".join(out)


def _axis(start: float, cols: int, scale: float, indent: int) -> list[str]:
    """A tick line under ``cols`` columns from time ``start`` (``+`` at each tick), values under it."""
    end = start + cols / scale
    marks = ["-"] * (cols + 1)
    values = [" "] * (indent + cols + 12)
    free_from = 0
    for t in ticks(start, end, max(1, cols // 10)):
        x = round((t - start) * scale)
        marks[min(x, cols)] = "+"
        text = fmt(t)
        pos = indent + x - (len(text) if x >= cols - 1 else 0)
        if pos >= free_from:
            values[pos : pos + len(text)] = text
            free_from = pos + len(text) + 1
    return [" " * (indent - 1) + "".join(marks), "".join(values).rstrip()]


def _legend(kinds: list[OpKind], colour: bool, notes: list[str], width: int) -> list[str]:
    """Legend items packed into lines of at most ``width`` visible columns."""
    items: list[tuple[str, int]] = []  # (text with escapes, visible length)
    for k in kinds:
        swatch = f"{_ansi(COLOURS[k])}  {RESET}" if colour else FILL[k]
        text = f"{SHORT[k]} {NAMES[k]}"
        items.append((f"{swatch} {text}", len(text) + (3 if colour else 2)))
    items.append((f"{' ' if colour else IDLE} idle", 6))
    items.extend((note, len(note)) for note in notes)
    lines, line, used = [], "legend:", len("legend:")
    for text, size in items:
        if used + 2 + size > width and used > len("legend:"):
            lines.append(line)
            line, used = " " * len("legend:"), len("legend:")
        line, used = f"{line}  {text}", used + 2 + size
    return [*lines, line]
