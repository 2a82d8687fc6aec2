"""The end-of-run report's host line: an eager GPU step's hosts, as its measured timeline carries
them (``Timeline.host_spans``)."""

from __future__ import annotations

import dataclasses

from pipetrain.app.report import report
from pipetrain.schedule.registry import build_schedule
from pipetrain.schedule.timeline import Span
from pipetrain.sim.costs import Costs
from pipetrain.sim.simulate import simulate


def test_the_report_gives_the_hosts_issue_time_and_their_time_between_actions(tmp_path) -> None:
    program = build_schedule("1f1b", 2, 4)
    times = Costs(forward=0.5, backward_input=0.5, backward_weight=0.5)
    step = simulate(program, Costs(forward=1.0, backward_input=1.0, backward_weight=1.0,
                                   host=times, device=times))  # fmt: skip
    # each issue 0.1 shorter: 0.1 between actions, as a runtime's transfers and bookkeeping
    measured = dataclasses.replace(
        step,
        measured=True,
        host_spans=tuple(Span(s.rank, s.action, s.start, s.end - 0.1) for s in step.host_spans),
    )
    text = report(tmp_path / "s.svg", [2.0, 1.0] * 4, [measured], program)
    line = next(x for x in text.splitlines() if x.startswith("host:"))
    assert "0.100 ms between actions" in line and "host_action_ms" in line
    busiest = 4 * 0.4 + 4 * 0.9  # per rank 4 F issued in 0.5 - 0.1, 4 B (I + W) in 1.0 - 0.1
    assert f"{busiest:8.2f} ms on its busiest rank" in line
    plain = report(tmp_path / "p.svg", [2.0, 1.0] * 4, [simulate(program)], program)
    assert not any(x.startswith("host:") for x in plain.splitlines())
