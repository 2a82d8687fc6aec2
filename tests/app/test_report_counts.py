"""The end-of-run report under a token budget (``--global-batch-tokens``): each step runs the
micro-batch count its documents fill, so the median step is simulated with the program of its own
count, and one line says how the counts were spread over the steps."""

from __future__ import annotations

import dataclasses
import re

import pytest

from pipetrain.app.report import counts_line, report
from pipetrain.schedule.registry import build_schedule
from pipetrain.sim.costs import Costs, measured_costs
from pipetrain.sim.simulate import simulate


def _measured(program, forward: list[float]):  # type: ignore[no-untyped-def]
    """A measured-looking step of ``program``: stages of unequal cost, so the simulated makespan
    depends on the program's micro-batch count."""
    costs = Costs(forward=forward, backward_input=[2 * f for f in forward], backward_weight=0.5)
    return dataclasses.replace(simulate(program, costs), measured=True)


def _simulated_ms(text: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith("simulated step:"))
    found = re.search(r"makespan\s+([0-9.]+) ms", line)
    assert found is not None, line
    return float(found.group(1))


def test_the_median_step_is_simulated_with_the_program_of_its_own_count(tmp_path) -> None:
    four, six = build_schedule("1f1b", 2, 4), build_schedule("1f1b", 2, 6)
    # three measured steps: 4 micro-batches (the fastest), 6 (the median), 6 on slower stages
    steps = [_measured(four, [1.0, 1.5]), _measured(six, [1.0, 2.0]), _measured(six, [2.0, 3.0])]
    assert steps[0].makespan < steps[1].makespan < steps[2].makespan
    counts = [4, 6, 4, 6, 6]  # every step's count; the last three measured
    text = report(
        tmp_path / "s.svg",
        [3.0, 2.0] * 3,
        steps,
        four,
        programs=[four, six, six],
        step_counts=counts,
    )
    median = steps[1]
    own = simulate(six, measured_costs([median], six.num_stages)).makespan
    nominal = simulate(four, measured_costs([median], four.num_stages)).makespan
    assert abs(own - nominal) > 0.1  # the nominal program would have been visibly wrong
    assert _simulated_ms(text) == pytest.approx(own, abs=0.006)  # printed to 2 decimals
    assert "with the program of its own 6 micro-batches" in text
    assert "micro-batches per step: 4 (2 steps), 6 (3 steps)" in text.splitlines()
    assert "6 micro-batches" in next(x for x in text.splitlines() if "measured step (ms)" in x)


def test_without_counts_the_report_simulates_the_nominal_program(tmp_path) -> None:
    program = build_schedule("1f1b", 2, 4)
    step = _measured(program, [1.0, 2.0])
    text = report(tmp_path / "s.svg", [3.0, 2.0] * 3, [step], program)
    expected = simulate(program, measured_costs([step], program.num_stages)).makespan
    assert _simulated_ms(text) == pytest.approx(expected, abs=0.006)
    assert "micro-batches per step" not in text and "its own" not in text


def test_one_program_per_measured_step_is_required(tmp_path) -> None:
    program = build_schedule("1f1b", 2, 4)
    step = _measured(program, [1.0, 2.0])
    with pytest.raises(ValueError, match="2 programs for 1 measured steps"):
        report(tmp_path / "s.svg", [1.0], [step], program, programs=[program, program])


def test_the_counts_line_names_each_count_once_fewest_first() -> None:
    assert counts_line([7, 6, 6, 7, 6]) == "micro-batches per step: 6 (3 steps), 7 (2 steps)"
    assert counts_line([8]) == "micro-batches per step: 8 (1 step)"
