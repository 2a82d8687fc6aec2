"""benchmarks/incumbents/incumbents_call.sh's launch series: three launches numbered from 0 by default,
``LAUNCHES`` and ``FIRST_LAUNCH`` to run more or to continue a series in a later call (each
launch's number rotates the libraries' order and names its folder)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "incumbents" / "incumbents_call.sh"


def _parts(**env: str) -> list[str]:
    """The parts ``launches3`` starts, with ``part`` stubbed to print its arguments."""
    code = (
        'part() { echo "$*"; }\n'
        f"eval \"$(sed -n '/^launches3() {{/,/^}}/p' '{SCRIPT}')\"\n"
        "launches3 e gpt16 2 110 145 --more\n"
    )
    done = subprocess.run(
        ["bash", "-c", code], capture_output=True, text=True, timeout=30,
        env={k: v for k, v in os.environ.items() if k not in ("LAUNCHES", "FIRST_LAUNCH")} | env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_three_launches_from_zero_by_default() -> None:
    assert _parts() == [
        "e1-gpt16-l0 2 110 145 --launch 0 --more",
        "e2-gpt16-l1 2 110 145 --launch 1 --more",
        "e3-gpt16-l2 2 110 145 --launch 2 --more",
    ]


def test_a_later_call_continues_the_series() -> None:
    assert _parts(LAUNCHES="2", FIRST_LAUNCH="3") == [
        "e4-gpt16-l3 2 110 145 --launch 3 --more",
        "e5-gpt16-l4 2 110 145 --launch 4 --more",
    ]
