"""Every schedule family on one shape, simulated on the same model: the table behind
``pipetrain compare``.

Costs describe one rank's share of the model, so families compare like for like: a chain (one
copy of the model) of S stages over p ranks gives each stage p/S of a rank's share — 1/v with v
stages per rank, 1 for DualPipe's two full copies. Communication latency stays per transfer.
Peaks are then in units of one rank's share of the activations, as docs/design.md counts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.schedule.lower import lower
from pipetrain.schedule.program import Program
from pipetrain.schedule.registry import FAMILIES, build_schedule
from pipetrain.schedule.timeline import Timeline
from pipetrain.schedule.validate import validate
from pipetrain.sim.costs import Costs
from pipetrain.sim.simulate import simulate


def summary(program: Program, timeline: Timeline) -> dict[str, Any]:
    """The JSON-ready headline of one simulated program (``pipetrain simulate --json``)."""
    return {
        "schedule": program.name,
        "ranks": program.num_ranks,
        "stages": program.num_stages,
        "stages_per_rank": program.placement.stages_per_rank,
        "microbatches": program.num_microbatches,
        "p2p_transfers": transfers(program),
        **timeline.summary(),
    }


def transfers(program: Program) -> int:
    """Point-to-point transfers one step makes (SEND actions after lowering)."""
    counts = lower(program).count()
    return counts.get("SEND_F", 0) + counts.get("SEND_B", 0)


@dataclass(frozen=True)
class Comparison:
    """``rows``: one summary per family that accepts the shape, best (makespan, then peak) first;
    ``refused``: (family, why) for the others."""

    rows: tuple[dict[str, object], ...]
    refused: tuple[tuple[str, str], ...]


def compare(
    num_ranks: int, num_microbatches: int, stages_per_rank: int | None, costs: Costs
) -> Comparison:
    rows: list[dict[str, Any]] = []
    refused: list[tuple[str, str]] = []
    for fam in FAMILIES.values():
        v = stages_per_rank if (fam.multi_stage and stages_per_rank) else None
        try:
            built = build_schedule(fam.name, num_ranks, num_microbatches, v)
        except ValueError as e:  # the family refuses the shape; a bad program is not hidden
            refused.append((fam.name.value, str(e).splitlines()[0]))
            continue
        program = validate(lower(built))
        per_stage = costs.scaled(program.num_ranks / program.placement.stages_per_chain)
        rows.append(summary(program, simulate(program, per_stage)))
    rows.sort(key=lambda r: (r["makespan"], max(x["peak_activations"] for x in r["per_rank"])))
    return Comparison(tuple(rows), tuple(refused))


def format_comparison(rows: Sequence[dict[str, Any]]) -> str:
    header = (
        f"{'schedule':<17}{'v':>2}{'makespan':>10}{'span':>9}{'bubble':>8}{'peak':>6}  "
        f"{'p2p':>6}  peak per rank"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        peaks = [x["peak_activations"] for x in r["per_rank"]]
        per = " ".join(f"{p:g}" for p in peaks[:16]) + (" …" if len(peaks) > 16 else "")
        lines.append(
            f"{r['schedule']:<17}{r['stages_per_rank']:>2}{r['makespan']:>10g}{r['span']:>9g}"
            f"{100 * r['bubble_fraction']:>7.1f}%{max(peaks):>6g}  {r['p2p_transfers']:>6}  {per}"
        )
    return "\n".join(lines)
