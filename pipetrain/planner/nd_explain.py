"""Why a plan beat another, in numbers (``pipetrain plan --explain``), and the table of each
pp × tp × dp shape's best plan.

A plan's step splits exactly into three parts, each divided by the global micro-batches it
carries (micro-batches × dp) so plans of different shapes compare like for like: the **compute**
of its busiest rank (of which its tensor-parallel **collectives** and what **recompute** adds), the
**bubble** (that rank's idle time within the pipeline's step) and the **data-parallel sync** after
it. The difference between two plans is the sum of the differences of the parts, so the
explanation names where the winner gains and where it pays; memory says what the cheaper
alternatives would have needed (a faster candidate that did not fit is not a runner-up: the
search keeps fitting plans only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipetrain.planner.costs_file import ModelCosts
from pipetrain.planner.judge import stage_costs
from pipetrain.planner.nd_search import NdPlan, NdSearch
from pipetrain.planner.partition import bounds
from pipetrain.planner.recompute_modes import describe
from pipetrain.schedule.registry import build_schedule


@dataclass(frozen=True)
class Breakdown:
    """A plan's step in ms per global micro-batch: compute (collectives and recompute within
    it), bubble, sync; and its peak memory."""

    total: float
    compute: float
    collectives: float
    recompute: float
    bubble: float
    sync: float
    peak_gib: float
    usable_gib: float


def breakdown(nd: NdPlan, costs: ModelCosts) -> Breakdown:
    """``nd``'s parts (the module docstring); ``costs``: the file's, before any shape."""
    plan, timeline = nd.plan, nd.candidate.timeline
    layout = plan.layout
    per = plan.microbatches * nd.shape.dp
    busy = timeline.busy
    rank = max(range(len(busy)), key=busy.__getitem__)
    program = build_schedule(
        layout.schedule, layout.ranks, layout.microbatches, layout.stages_per_rank
    )
    at = costs.at_tp(nd.shape.tp)
    blocks = bounds(layout.stage_layers)
    mine = [s for s, r in enumerate(program.placement.rank_of_stage) if r == rank]
    collectives = 0.0
    for s in mine:
        a, b = blocks[s % len(blocks)]
        for layer in costs.layers[a:b]:
            entry = next((e for e in layer.tp if e.degree == nd.shape.tp), None)
            if entry is not None:
                collectives += entry.forward_collective + entry.backward_collective
    recompute = 0.0
    if layout.recomputes:
        n = program.num_stages
        with_ = stage_costs(at, program, layout.stage_layers, layout.recompute).per_stage(n)
        plain = stage_costs(at, program, layout.stage_layers).per_stage(n)
        recompute = sum(
            with_.forward[s] + with_.backward[s] - plain.forward[s] - plain.backward[s]
            for s in mine
        )
    pipeline = timeline.makespan
    return Breakdown(
        total=nd.ms_per_global_microbatch,
        compute=busy[rank] / per,
        collectives=collectives * plan.microbatches / per,
        recompute=recompute * plan.microbatches / per,
        bubble=(pipeline - busy[rank]) / per,
        sync=(nd.step_ms - pipeline) / per,
        peak_gib=max(plan.peak_gib),
        usable_gib=plan.usable_gib,
    )


def title(nd: NdPlan) -> str:
    p = nd.plan
    return (
        f"{nd.shape}: {p.schedule}, {p.stages_per_rank} stage(s) per rank, "
        f"{p.microbatches} micro-batches, recompute {describe(p.recompute)}"
    )


def explain(pick: NdPlan, runner_up: NdPlan | None, costs: ModelCosts) -> list[str]:
    """Lines saying why ``pick`` beat ``runner_up`` (each part's ms per global micro-batch and
    the difference), the part that decided it first."""
    if runner_up is None:
        return ["explain: no other plan fits; nothing to compare the pick with"]
    a, b = breakdown(pick, costs), breakdown(runner_up, costs)
    rows = [
        ("ms per global micro-batch", a.total, b.total),
        ("  compute (busiest rank)", a.compute, b.compute),
        ("    of it tp collectives", a.collectives, b.collectives),
        ("    of it recompute", a.recompute, b.recompute),
        ("  bubble (its idle time)", a.bubble, b.bubble),
        ("  data-parallel sync", a.sync, b.sync),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [
        "why the pick beat the runner-up (ms per global micro-batch = step / (micro-batches x dp)):",
        f"  pick:      {title(pick)}",
        f"  runner-up: {title(runner_up)}",
        f"  {'':<{width}}  {'pick':>10}  {'runner-up':>10}  {'pick - runner-up':>16}",
    ]
    for name, x, y in rows:
        lines.append(f"  {name:<{width}}  {x:>10.4f}  {y:>10.4f}  {x - y:>+16.4f}")
    lines.append(
        f"  {'peak GiB per rank':<{width}}  {a.peak_gib:>10.2f}  {b.peak_gib:>10.2f}  "
        f"(usable {a.usable_gib:.3g})"
    )
    parts = {
        "compute": a.compute - b.compute,
        "bubble": a.bubble - b.bubble,
        "sync": a.sync - b.sync,
    }
    gains = sorted((d, name) for name, d in parts.items() if d < 0)
    losses = sorted(((d, name) for name, d in parts.items() if d > 0), reverse=True)
    saved = b.total - a.total
    share = saved / b.total if b.total else 0.0
    said = f"  the pick is {saved:.4g} ms ({share:.1%}) faster per global micro-batch"
    if gains:
        said += ": it gains on " + ", ".join(f"{n} ({-d:.4g} ms)" for d, n in gains)
    if losses:
        said += "; it pays more for " + ", ".join(f"{n} ({d:.4g} ms)" for d, n in losses)
    lines.append(said)
    if a.recompute > 0 and b.recompute == 0:
        lines.append("  the pick recomputes: it needs the memory recompute frees to fit")
    return lines


def shape_table(found: NdSearch) -> list[str]:
    """One row per shape: its best plan, or why it has none."""
    header = (
        "pp",
        "tp",
        "dp",
        "schedule",
        "v",
        "M",
        "step ms",
        "ms/global mb",
        "tokens/s",
        "peak GiB",
        "recompute",
    )
    rows: list[Sequence[str]] = [header]
    notes = []
    for r in sorted(found.shapes, key=lambda r: (r.shape.tp, r.shape.pp)):
        s = r.shape
        if r.best is None:
            notes.append(f"  {s}: {r.why}")
            continue
        p = r.best.plan
        tokens = r.best.tokens_per_s
        rows.append(
            (
                str(s.pp),
                str(s.tp),
                str(s.dp),
                p.schedule,
                str(p.stages_per_rank),
                str(p.microbatches),
                f"{r.best.step_ms:.3f}",
                f"{r.best.ms_per_global_microbatch:.4f}",
                "-" if tokens is None else f"{tokens:,.0f}",
                f"{max(p.peak_gib):.2f}",
                describe(p.recompute),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    out = ["  ".join(f"{c:<{w}}" for c, w in zip(row, widths)).rstrip() for row in rows]
    if notes:
        out += ["shapes without a plan:", *notes]
    return out
