"""Golden files: the exact programs for a fixed grid of shapes, and the CLI's help text.

A change to any builder, to lowering or to a flag shows up here as a diff. To accept it on
purpose: ``PIPETRAIN_REGENERATE=1 make test`` and review ``git diff tests/golden``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipetrain.cli import build_parser
from pipetrain.schedule.lower import lower
from pipetrain.schedule.program_io import from_csv, to_csv
from pipetrain.schedule.registry import FAMILIES, build_schedule
from pipetrain.schedule.validate import validate

GOLDEN = Path(__file__).parents[1] / "golden"
REGENERATE = os.environ.get("PIPETRAIN_REGENERATE") == "1"
SHAPES = [(1, 2), (2, 4), (3, 5), (4, 8)]


def check_golden(path: Path, text: str) -> None:
    if REGENERATE or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if not REGENERATE:
            pytest.fail(f"golden file {path.name} was missing and has been written; rerun")
    assert text == path.read_text(), f"{path.name} differs from its golden file"


def _accepted(name: str, p: int, m: int) -> bool:
    try:
        build_schedule(name, p, m)
    except ValueError:
        return False
    return True


CASES = [(n, p, m) for n in FAMILIES for p, m in SHAPES if _accepted(n, p, m)]


def test_grid_covers_every_family() -> None:
    assert {n for n, _, _ in CASES} == set(FAMILIES)
    refused = {(n, p, m) for n in FAMILIES for p, m in SHAPES} - set(CASES)
    # dualpipev needs m >= 2p; dualpipe also needs even ranks and micro-batches
    assert refused == {("dualpipev", 3, 5), ("dualpipe", 1, 2), ("dualpipe", 3, 5)}


@pytest.mark.parametrize(("name", "p", "m"), CASES)
def test_program_matches_golden(name: str, p: int, m: int) -> None:
    program = build_schedule(name, p, m)
    lowered = validate(lower(program))
    text = to_csv(lowered)
    check_golden(GOLDEN / "programs" / f"{name}_p{p}_m{m}.csv", text)
    # the golden file is itself a program that loads and validates
    assert validate(from_csv(text)).actions == lowered.actions


def _help_text() -> str:
    parser = build_parser()
    sections = [parser.format_help()]
    subparsers = next(a for a in parser._actions if a.dest == "command")
    for name, sub in subparsers.choices.items():
        sections.append(f"=== {name}\n{sub.format_help()}")
    return "\n".join(sections)


def test_help_text_is_pinned(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    check_golden(GOLDEN / "cli_help.txt", _help_text())
