"""Tests of the renderers on hand-made timelines (no simulator): text, SVG and trace."""

from __future__ import annotations

import ast
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.render import render_svg, render_text, render_trace, write_trace
from pipetrain.render.style import fmt
from pipetrain.render.text import MAX_BANDS
from pipetrain.schedule.action import Action, OpKind, overlap
from pipetrain.schedule.timeline import Span, Timeline

SVG = "{http://www.w3.org/2000/svg}"
ANSI = "\x1b["


def _span(rank: int, kind: OpKind, stage: int, mb: int, start: float, end: float) -> Span:
    return Span(rank, Action(kind, stage, mb), start, end)


def tiny(measured: bool = False) -> Timeline:
    """Two ranks, one stage each, two micro-batches, 1F1B-shaped (F = 1, B = 2)."""
    F, B = OpKind.F, OpKind.B
    spans = (
        _span(0, F, 0, 0, 0, 1),
        _span(0, F, 0, 1, 1, 2),
        _span(1, F, 1, 0, 1, 2),
        _span(1, B, 1, 0, 2, 4),
        _span(1, F, 1, 1, 4, 5),
        _span(0, B, 0, 0, 4, 6),
        _span(1, B, 1, 1, 5, 7),
        _span(0, B, 0, 1, 7, 9),
    )
    return Timeline(2, spans, (1.0, 1.0), name="tiny", measured=measured)


def with_pair() -> Timeline:
    """One rank, V-placed stages 0 and 1, an overlapped F&B pair, split backward."""
    pair = overlap(Action(OpKind.F, 0, 1), Action(OpKind.I, 1, 0))
    spans = (
        _span(0, OpKind.F, 0, 0, 0, 1),
        _span(0, OpKind.F, 1, 0, 1, 2),
        Span(0, pair, 2, 4),
        _span(0, OpKind.W, 1, 0, 4, 5),
        _span(0, OpKind.F, 1, 1, 5, 6),
        _span(0, OpKind.I, 1, 1, 6, 7),
        _span(0, OpKind.B, 0, 0, 7, 9),
        _span(0, OpKind.W, 1, 1, 9, 10),
        _span(0, OpKind.B, 0, 1, 10, 12),
    )
    return Timeline(1, spans, (1.0, 1.0), name="pair")


def big(num_ranks: int = 32, num_mb: int = 256) -> Timeline:
    """GPipe-shaped: all forwards, then all backwards, one stage per rank (unit F, B = 2)."""
    spans = []
    for r in range(num_ranks):
        for m in range(num_mb):
            spans.append(_span(r, OpKind.F, r, m, r + m, r + m + 1))
        back = num_mb + num_ranks - 1 + 2 * (num_ranks - 1 - r)
        for m in range(num_mb):
            spans.append(_span(r, OpKind.B, r, m, back + 2 * m, back + 2 * m + 2))
    return Timeline(num_ranks, tuple(spans), (1.0,) * num_ranks, name="big")


def rank_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("rank ")]


# --- text -------------------------------------------------------------------------------------


def test_text_has_a_row_per_rank_and_labels() -> None:
    out = render_text(tiny(), width=80, color=False)
    rows = rank_rows(out)
    assert len(rows) == 2
    assert all(len(line) <= 80 for line in out.splitlines()[:-1])
    assert len({len(r) for r in rows}) == 1
    for label in ("F0", "F1", "B0", "B1"):
        assert label in rows[0] and label in rows[1]
    assert "makespan 9" in out and "legend:" in out.splitlines()[-1]


def test_text_colour_flag() -> None:
    assert ANSI in render_text(tiny(), color=True)
    assert ANSI not in render_text(tiny(), color=False)


def test_text_colour_auto_off_without_tty_or_with_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert ANSI in render_text(tiny())
    monkeypatch.setenv("NO_COLOR", "1")
    assert ANSI not in render_text(tiny())
    monkeypatch.delenv("NO_COLOR")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False, raising=False)
    assert ANSI not in render_text(tiny())


def test_text_marks_chunks_and_pairs() -> None:
    out = render_text(with_pair(), width=120, color=False)
    row = rank_rows(out)[0]
    assert "0F0" in row or "F0" in row
    assert "f0" in row or "1F0" in row  # the rank's second chunk is told apart
    assert "#" in row  # the overlapped pair's fill
    assert "2nd chunk" in out


def test_text_names_the_chunk_where_case_alone_cannot() -> None:
    """With three chunks a rank, lower case would draw chunks 0 and 2 alike: the label starts
    with the stage instead (as ``pipetrain show`` writes actions), and the legend says so."""
    from pipetrain.schedule.registry import build_schedule
    from pipetrain.sim.costs import Costs
    from pipetrain.sim.simulate import simulate

    program = build_schedule("interleaved-1f1b", 2, 4, stages_per_rank=3)
    out = render_text(simulate(program, Costs(forward=1.0, backward=2.0)), width=100, color=False)
    rows = "".join(rank_rows(out))
    # rank 0 holds stages 0, 2, 4; rank 1 stages 1, 3, 5
    top, bottom = rank_rows(out)[0] + rank_rows(out)[2], rank_rows(out)[1] + rank_rows(out)[3]
    assert {"0F0", "2F0", "4F0", "4B3"} <= {top[i : i + 3] for i in range(len(top))}
    assert {"1F0", "3F0", "5F0", "5B3"} <= {bottom[i : i + 3] for i in range(len(bottom))}
    assert "f0" not in rows and "2nd chunk" not in out
    assert "4F3 = stage 4, micro-batch 3" in out


def test_text_big_timeline_stays_readable() -> None:
    tl = big()
    out = render_text(tl, width=100, color=False)
    rows = rank_rows(out)
    assert len(rows) == 32
    assert all(len(r) <= 100 for r in rows)
    assert rows[0].count("-") > 10 and rows[0].count("=") > 10
    assert ANSI in render_text(tl, width=100, color=True)


def unit_gpipe(num_ranks: int, num_mb: int) -> Timeline:
    """GPipe-shaped, unit F and B, one stage per rank: every block is 1 time unit long."""
    spans, free = [], [0.0] * num_ranks
    for m in range(num_mb):
        for r in range(num_ranks):
            start = max(free[r], r + m)
            spans.append(_span(r, OpKind.F, r, m, start, start + 1))
            free[r] = start + 1
    end = max(free)
    for m in range(num_mb):
        for r in reversed(range(num_ranks)):
            start = max(free[r], end + m + (num_ranks - 1 - r))
            spans.append(_span(r, OpKind.B, r, m, start, start + 1))
            free[r] = start + 1
    return Timeline(num_ranks, tuple(spans), (1.0,) * num_ranks, name="unit")


def test_text_wraps_time_into_bands_so_narrow_blocks_keep_labels() -> None:
    tl = unit_gpipe(4, 12)  # 2 × 12 + 3 units of 1: too narrow for "F11" in one 60-column band
    out = render_text(tl, width=60, color=False)
    rows = rank_rows(out)
    assert 1 < len(rows) // 4 <= MAX_BANDS and len(rows) % 4 == 0
    assert all(len(line) <= 60 for line in out.splitlines())
    for r in range(4):  # every block labelled, each label in one piece
        text = "".join(row[row.index("|") + 1 : -1] for row in rows[r::4])
        for m in range(12):
            assert f"F{m}" in text and f"B{m}" in text, (r, m, text)
    one_band = render_text(tl, width=60, color=False, max_bands=1)
    assert len(rank_rows(one_band)) == 4
    # the axis continues across bands: the second band starts where the first ended
    axes = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert float(axes[1][0]) >= float(axes[0][-1]) > float(axes[0][0])


def test_text_empty_and_narrow() -> None:
    assert "(no spans)" in render_text(Timeline(2, (), (1.0, 1.0)), color=False)
    assert len(rank_rows(render_text(tiny(), width=5, color=False))) == 2


# --- SVG --------------------------------------------------------------------------------------


def svg_tree(tl: Timeline, **kwargs: object) -> ET.Element:
    return ET.fromstring(render_svg(tl, **kwargs))  # type: ignore[arg-type]


def span_rects(root: ET.Element) -> list[ET.Element]:
    return [e for e in root.iter(f"{SVG}rect") if "span" in e.get("class", "").split()]


def caption(root: ET.Element) -> str:
    return " ".join(e.text or "" for e in root.iter(f"{SVG}text") if e.get("class") == "caption")


@pytest.mark.parametrize("make", [tiny, with_pair])
def test_svg_is_xml_with_one_rect_per_span(make) -> None:
    tl = make()
    root = svg_tree(tl, title="a <title> & more")
    assert len(span_rects(root)) == len(tl.spans)
    swatches = [e for e in root.iter(f"{SVG}rect") if "swatch" in e.get("class", "")]
    assert len(swatches) >= 2
    assert float(root.get("width")) == 1200


def test_svg_caption_matches_metrics() -> None:
    tl = tiny()
    text = caption(svg_tree(tl))
    assert f"makespan {fmt(tl.makespan)}" in text
    assert f"bubble {tl.bubble_fraction * 100:.1f}%" in text
    assert "simulated" in text
    for r, peak in enumerate(tl.peak_activations):
        assert f"r{r}={fmt(peak)}" in text
    assert "measured" in caption(svg_tree(tiny(measured=True)))


def test_svg_pair_is_one_split_rect() -> None:
    root = svg_tree(with_pair())
    pairs = [e for e in span_rects(root) if "OVERLAP_F_B" in e.get("class", "")]
    assert len(pairs) == 1 and pairs[0].get("fill") == "url(#pair-I)"
    assert any(g.get("id") == "pair-I" for g in root.iter(f"{SVG}linearGradient"))


def test_svg_memory_lines() -> None:
    tl = tiny()
    root = svg_tree(tl, memory=True)
    assert len(list(root.iter(f"{SVG}polyline"))) == tl.num_ranks
    assert not list(svg_tree(tl).iter(f"{SVG}polyline"))


def test_svg_big_timeline_stays_small() -> None:
    tl = big()
    out = render_svg(tl)
    root = ET.fromstring(out)
    assert len(span_rects(root)) == len(tl.spans)
    assert len(out) < 3_000_000
    assert "<title>" not in out  # no per-span tooltips at this size


# --- trace ------------------------------------------------------------------------------------


def test_trace_round_trips_with_one_event_per_span() -> None:
    tl = with_pair()
    trace = render_trace(tl)
    assert json.loads(json.dumps(trace)) == trace
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(tl.spans)
    by_key = {(e["tid"], e["name"]): e for e in xs}
    for s in tl.spans:
        e = by_key[(s.rank, str(s.action))]
        assert e["ts"] == pytest.approx(s.start * 1000)
        assert e["dur"] == pytest.approx(s.duration * 1000)
        assert e["cat"] == s.action.kind.value
    assert by_key[(0, "(0F1;1I0)OVERLAP_F_B")]["args"]["parts"] == ["0F1", "1I0"]


def test_trace_thread_names_and_counters(tmp_path: Path) -> None:
    tl = tiny()
    path = tmp_path / "t.json"
    write_trace(tl, path)
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"activations rank 0", "activations rank 1"}
    peak0 = max(e["args"]["activations"] for e in counters if e["tid"] == 0)
    assert peak0 == tl.peak_activations[0]


# --- all three on random timelines ------------------------------------------------------------


@st.composite
def timelines(draw: st.DrawFn) -> Timeline:
    num_ranks = draw(st.integers(1, 6))
    spans = []
    for rank in range(num_ranks):
        t = 0.0
        for mb in range(draw(st.integers(0, 12))):
            kind = draw(st.sampled_from([OpKind.F, OpKind.B, OpKind.I, OpKind.W]))
            t += draw(st.floats(0, 3))
            dur = draw(st.floats(0.01, 5))
            spans.append(_span(rank, kind, rank, mb, t, t + dur))
            t += dur
    return Timeline(num_ranks, tuple(spans), (1.0,) * num_ranks)


@settings(max_examples=40, deadline=None)
@given(timelines(), st.integers(20, 160))
def test_renderers_never_crash(tl: Timeline, width: int) -> None:
    text = render_text(tl, width=width, color=False)
    if tl.spans and tl.makespan > 0:
        rows = rank_rows(text)
        assert len(rows) % tl.num_ranks == 0 and len(rows) <= tl.num_ranks * MAX_BANDS
        assert all(len(r) <= max(width, 30) for r in rows)
    assert len(span_rects(ET.fromstring(render_svg(tl)))) == len(tl.spans)
    xs = [e for e in render_trace(tl)["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(tl.spans)


def test_render_imports_only_stdlib_and_schedule() -> None:
    allowed = set(sys.stdlib_module_names) | {"pipetrain"}
    for path in Path(__file__).parents[2].joinpath("pipetrain", "render").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
                if name.startswith("pipetrain."):
                    assert name.split(".")[1] in ("schedule", "render"), f"{path.name}: {name}"
