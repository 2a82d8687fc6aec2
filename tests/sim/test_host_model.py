"""The eager host model: each rank a host that issues its actions in order and a device that runs
them as they come (``schedule.execute``, ``sim.costs``)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedule.registry import build_schedule
from pipetrain.sim.costs import Costs
from pipetrain.sim.simulate import simulate


def _times(f: float, b: float) -> Costs:
    return Costs(forward=f, backward_input=b / 2, backward_weight=b / 2, backward=b)


@pytest.mark.parametrize(
    ("host", "device", "wall", "step"),
    [
        # each forward issues in 2, runs in 1 queued ahead, 2.1 from an idle start: the device
        # waits for the host, so the step is the host's 6 and the last action's tail (the wall
        # model: 6.3)
        (2.0, 1.0, 2.1, 6.1),
        # issued in 0.5, run in 2 queued ahead, 2.2 from idle: only the first pays its start
        (0.5, 2.0, 2.2, 6.2),
    ],
)
def test_the_slower_of_host_and_device_paces_the_rank(host, device, wall, step) -> None:
    program = build_schedule("gpipe", 1, 3)
    hosted = Costs(
        forward=wall, backward=0.0, backward_input=0.0, backward_weight=0.0,
        host=_times(host, 0.0), device=_times(device, 0.0),
    )  # fmt: skip
    assert simulate(program, hosted).makespan == pytest.approx(step)


def test_the_host_runs_ahead_while_the_device_waits_for_a_transfer() -> None:
    # rank 1's host issues its forward at once; its device waits for rank 0's output; the host
    # is then free to issue the backward, whose device time alone remains after the forward
    program = build_schedule("gpipe", 2, 1)
    hosted = Costs(
        forward=1.0, backward=1.0, backward_input=0.5, backward_weight=0.5,
        host=_times(1.0, 1.0), device=_times(0.2, 0.2),
    )  # fmt: skip
    spans = {(s.action.kind.value, s.action.stage): s for s in simulate(program, hosted).spans}
    assert spans["F", 1].start == pytest.approx(1.0)  # rank 0's forward, wall from idle
    assert spans["F", 1].end == pytest.approx(1.2)  # queued since 0: device time alone
    assert spans["B", 1].end == pytest.approx(2.0)  # issued at 1, wall 1 from then


def test_both_or_neither() -> None:
    with pytest.raises(ValueError, match="host and device"):
        Costs(host=Costs())


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(
        ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"]
    ),
    p=st.integers(1, 4),
    m=st.integers(1, 12),
    times=st.lists(st.floats(0.1, 3), min_size=9, max_size=9),
    c=st.floats(0, 1),
)
def test_between_the_device_alone_and_the_wall_time(name, p, m, times, c) -> None:
    """Where an action's host and device times are each at most its wall time, the step is at
    least what the device alone takes and at most the plain wall-time model's: every time in the
    two-worker run is a max and sum of smaller or equal terms."""
    try:
        program = build_schedule(name, p, m)
    except ValueError:
        return
    (fw, iw, ww), host, device = times[:3], times[3:6], times[6:]
    wall = Costs(forward=fw, backward_input=iw, backward_weight=ww, comm=c)

    def part(share):
        f, i, w = (x * min(s, 1.0) for x, s in zip((fw, iw, ww), share, strict=True))
        return Costs(forward=f, backward_input=i, backward_weight=w)

    hosted = Costs(
        forward=fw, backward_input=iw, backward_weight=ww, comm=c,
        host=part([h / 3 for h in host]), device=part([d / 3 for d in device]),
    )  # fmt: skip
    alone = part([d / 3 for d in device])
    alone = Costs(
        forward=alone.forward, backward_input=alone.backward_input,
        backward_weight=alone.backward_weight, comm=c,
    )  # fmt: skip
    between = simulate(program, hosted).makespan
    assert simulate(program, alone).makespan <= between + 1e-9
    assert between <= simulate(program, wall).makespan + 1e-9


def test_no_host_time_and_the_wall_as_device_time_is_the_plain_model() -> None:
    program = build_schedule("zb-h1", 4, 8)
    plain = Costs(forward=1.0, backward_input=1.2, backward_weight=0.7, comm=0.1)
    hosted = Costs(
        forward=1.0, backward_input=1.2, backward_weight=0.7, comm=0.1,
        host=Costs(forward=0.0, backward_input=0.0, backward_weight=0.0),
        device=Costs(forward=1.0, backward_input=1.2, backward_weight=0.7),
    )  # fmt: skip
    assert simulate(program, hosted).spans == simulate(program, plain).spans


def test_the_host_spans_are_simulated_and_drawn_on_a_track_of_their_own() -> None:
    """A simulated eager step has its hosts' issue spans, one after another on each rank, as a
    measured one has them; the trace draws them on a ``rank r host`` thread under the rank's."""
    from pipetrain.render.trace import render_trace

    program = build_schedule("1f1b", 2, 4)
    hosted = Costs(
        forward=1.0, backward_input=1.0, backward_weight=1.0,
        host=_times(0.5, 0.8), device=_times(0.9, 1.8),
    )  # fmt: skip
    timeline = simulate(program, hosted)
    assert len(timeline.host_spans) == len(timeline.spans)
    for rank in range(2):
        mine = [s for s in timeline.host_spans if s.rank == rank]
        assert mine[0].start == 0.0
        assert all(a.end == pytest.approx(b.start) for a, b in itertools.pairwise(mine))
    assert simulate(program, Costs()).host_spans == ()
    events = render_trace(timeline)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[4] == "rank 0 host" and names[5] == "rank 1 host"
    assert sum(1 for e in events if e.get("ph") == "X" and e["tid"] in (4, 5)) == 16


def test_the_terminal_draws_each_ranks_host_under_it() -> None:
    from pipetrain.render.text import render_text

    program = build_schedule("1f1b", 2, 4)
    times = Costs(forward=0.5, backward_input=0.5, backward_weight=0.5)
    hosted = simulate(program, Costs(host=times, device=times))
    lines = render_text(hosted, width=80, color=False).splitlines()
    ranks = [i for i, line in enumerate(lines) if line.startswith("rank ")]
    assert all(lines[i + 1].lstrip().startswith("host |") for i in ranks)
    assert "host: when the rank's host issued each action" in "\n".join(lines)
    plain = render_text(simulate(program), width=80, color=False)
    assert "host |" not in plain


def test_the_svg_draws_each_ranks_host_in_bars_under_its_lane() -> None:
    from pipetrain.render.svg import render_svg

    program = build_schedule("1f1b", 2, 4)
    times = Costs(forward=0.5, backward_input=0.5, backward_weight=0.5)
    hosted = simulate(program, Costs(host=times, device=times))
    svg = render_svg(hosted)
    assert svg.count("<title>host issues") == len(hosted.host_spans) == 16
    assert "when its rank's host issued each action" in svg
    assert "host issues" not in render_svg(simulate(program))
