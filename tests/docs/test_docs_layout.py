"""The documentation's shape: the README is a front door and docs/*.md a reference in the
present tense, while the history of what was tried lives in docs/performance.md alone. So no
guide carries a dated heading, none outgrows one subject (500 lines; the README 250), and every
benchmark script a document names is one a reader can run. Runs no code: reads files only."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the one document that keeps dated runs, superseded tables and investigations
HISTORY = "docs/performance.md"
GUIDE_LINES = 500
README_LINES = 250
_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_SCRIPT = re.compile(r"(?<![\w/.-])benchmarks/[\w./-]*\w")


def _guides() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _headings(text: str) -> list[str]:
    """The markdown headings outside code blocks."""
    prose = _FENCE.sub("", text)
    return [line for line in prose.splitlines() if line.startswith("#")]


def test_no_dated_heading_outside_the_history() -> None:
    dated = [
        f"{_name(path)}: {heading}"
        for path in _guides()
        if _name(path) != HISTORY
        for heading in _headings(path.read_text())
        if _DATE.search(heading)
    ]
    assert not dated, "dated runs belong in docs/performance.md:\n" + "\n".join(dated)


def test_a_heading_with_a_date_is_found() -> None:
    text = "# Guide\n```text\n# 2026-11-27 inside a block\n```\n## On 2 × H100 (2026-11-27)\n"
    assert _headings(text) == ["# Guide", "## On 2 × H100 (2026-11-27)"]
    assert [h for h in _headings(text) if _DATE.search(h)] == ["## On 2 × H100 (2026-11-27)"]


def test_every_guide_stays_one_subject_long() -> None:
    too_long = []
    for path in _guides():
        limit = README_LINES if path.name == "README.md" else GUIDE_LINES
        lines = len(path.read_text().splitlines())
        if _name(path) != HISTORY and lines > limit:
            too_long.append(f"{_name(path)}: {lines} lines (at most {limit})")
    assert not too_long, "split the guide or move history out:\n" + "\n".join(too_long)


def test_every_named_benchmark_script_exists() -> None:
    results = sorted((ROOT / "docs" / "results").glob("*/README.md"))
    missing = []
    for path in [*_guides(), *results]:
        if _name(path) == HISTORY:
            continue
        for name in set(_SCRIPT.findall(path.read_text())):
            if not (ROOT / name).exists():
                missing.append(f"{_name(path)}: {name}")
    assert not missing, "a document names a benchmark that is gone:\n" + "\n".join(sorted(missing))


def test_a_benchmark_path_is_read_whole() -> None:
    said = "`python3 benchmarks/gpu/gpu_pipeline.py`; benchmarks/README.md; tests/benchmarks/x.py."
    assert _SCRIPT.findall(said) == ["benchmarks/gpu/gpu_pipeline.py", "benchmarks/README.md"]
