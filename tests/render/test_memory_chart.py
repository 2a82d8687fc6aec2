"""Memory per rank over the step: the terminal chart and the SVG curves, on a hand-made
timeline whose held activations are known at every moment."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from pipetrain.render import render_memory_text, render_svg, render_text
from pipetrain.render.memory_chart import LEVELS, OVER
from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.timeline import Span, Timeline

SVG = "{http://www.w3.org/2000/svg}"


def two_ranks() -> Timeline:
    """Rank 0 holds 1 during [0, 4) and 2 during [1, 3) (two forwards, two backwards, activation
    size 1); rank 1 holds 1 during [2, 3)."""
    F, B = OpKind.F, OpKind.B
    spans = (
        Span(0, Action(F, 0, 0), 0, 1),
        Span(0, Action(F, 0, 1), 1, 2),
        Span(1, Action(F, 1, 0), 2, 2.5),
        Span(1, Action(B, 1, 0), 2.5, 3),
        Span(0, Action(B, 0, 1), 2, 3),
        Span(0, Action(B, 0, 0), 3, 4),
    )
    return Timeline(num_ranks=2, spans=spans, activation_size=(1.0, 1.0))


def rows(text: str) -> list[str]:
    return [line.split("|")[1] for line in text.splitlines() if line.startswith("rank ")]


def test_columns_show_the_most_held_and_line_up_with_the_timeline() -> None:
    tl = two_ranks()
    width = 3 + len("rank 1") + 24  # 24 columns: six per unit of time
    text = render_memory_text(tl, width=width)
    zero, one = rows(text)
    assert zero == LEVELS[4] * 6 + LEVELS[8] * 12 + LEVELS[4] * 6
    assert one == " " * 12 + LEVELS[4] * 6 + " " * 6
    assert text.splitlines()[0].startswith("memory per rank (held activations; █ = 2,")
    assert text.splitlines()[-1] == "peak per rank: 2, 1"
    drawn = render_text(tl, width=width, color=False, max_bands=1).splitlines()
    grid = [line for line in drawn if line.startswith("rank ")]
    assert [len(line) for line in text.splitlines()[1:3]] == [len(line) for line in grid]


def test_static_memory_and_a_limit_scale_the_rows_and_mark_what_is_over() -> None:
    text = render_memory_text(two_ranks(), width=25, static=[1.0, 0.0], limit=2.5, unit="GiB")
    zero, one = rows(text)
    assert set(zero) == {LEVELS[7], OVER}  # 1 + 1 of 2.5 is 7 eighths; 1 + 2 is over
    assert OVER not in one
    assert "static + held; █ = 2.5 GiB, the limit" in text and text.endswith("3, 1 GiB")


def test_svg_curves_stand_on_static_memory_under_a_dashed_limit() -> None:
    tl = two_ranks()
    root = ET.fromstring(render_svg(tl, memory=True, static=[1.0, 0.5], limit=4.0))
    lines = list(root.iter(f"{SVG}polyline"))
    assert len(lines) == 2
    limits = [e for e in root.iter(f"{SVG}line") if e.get("class") == "limit"]
    assert len(limits) == 3  # one per strip, one in the legend
    first_y = [float(p.split(",")[1]) for p in lines[0].get("points", "").split()]
    assert first_y[0] > min(first_y)  # starts at its static memory, rises with the forwards
    texts = "".join(t.text or "" for t in root.iter(f"{SVG}text"))
    assert "memory (static + activations)" in texts and "limit 4" in texts


def offloaded() -> Timeline:
    from pipetrain.schedule.lower import lower
    from pipetrain.schedule.offload import insert_offload
    from pipetrain.schedule.registry import build_schedule
    from pipetrain.sim.costs import Costs
    from pipetrain.sim.simulate import simulate

    program = insert_offload(lower(build_schedule("1f1b", 4, 8)), [1.0, 1.0, 1.0, 0.0])
    return simulate(program, Costs(offload=[1.0, 1.0, 1.0, 0.0], host_copy=0.3))


def test_offload_and_reload_are_marked_under_each_rank() -> None:
    text = render_memory_text(offloaded(), width=80)
    lines = text.splitlines()
    marks = [line for line in lines[1:] if line.startswith(" ") and "|" in line]
    assert len(marks) == 4  # one row of marks per rank
    assert "v" in marks[0] and "^" in marks[0]
    assert not marks[3].strip(" |")  # the last stage offloads nothing
    assert "v: an offload ends" in text
    assert "v:" not in render_memory_text(two_ranks(), width=80)  # no copies, no marks


def test_svg_and_trace_draw_the_copies() -> None:
    from pipetrain.render.trace import render_trace

    timeline = offloaded()
    root = ET.fromstring(render_svg(timeline, memory=True))
    classes = [el.get("class") for el in root.iter()]
    assert classes.count("offload") == classes.count("reload") == len(timeline.copies) // 2
    trace = render_trace(timeline)["traceEvents"]
    names = {e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    assert "rank 0 copies" in names
    copies = [e for e in trace if e.get("ph") == "X" and "OFFLOAD" in e["name"]]
    assert copies and all(e["tid"] >= timeline.num_ranks for e in copies)
