"""``pipetrain synthesize``: a program built for a costs file's measured stages under a memory
cap (``planner.synthesize``), drawn beside the planner's pick it must beat or equal, written as a
program file (torch's CSV or pipetrain's JSON) that ``Pipeline(schedule=...)`` and ``pipetrain
show`` read; ``--json`` prints it as a plan, its program inside (``planner.layout``), which
``pipetrain train --plan`` and ``Pipeline.from_plan`` run. Bad input, or a budget nothing fits,
exits 2 with one line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipetrain.cli.budget_flags import BUDGET, COSTS
from pipetrain.cli.flags import (
    WIDTH,
    Command,
    Option,
    microbatches_option,
    ranks_option,
    width_of,
)
from pipetrain.planner.costs_file import load_costs
from pipetrain.planner.layout import Layout
from pipetrain.planner.synthesize import Synthesis, synthesize
from pipetrain.schedule.program_io import save_program

OPTIONS = (
    COSTS,
    ranks_option(required=True),
    microbatches_option(required=True),
    *BUDGET,
    Option(
        ("--out",),
        metavar="FILE",
        help="write the program: .json (placement included) or torch-compatible CSV",
    ),
    Option(("--svg",), metavar="FILE", help="write the synthesized step as an SVG"),
    Option(
        ("--json",),
        switch=True,
        help="print the result as one JSON object: the plan `pipetrain train --plan` runs (the "
        "program inside), its prediction and the planner's pick",
    ),
    WIDTH,
)


def run(args: argparse.Namespace) -> int:
    costs = load_costs(args.costs)
    result = synthesize(
        costs,
        num_ranks=args.ranks,
        num_microbatches=args.microbatches,
        memory_gib=args.memory_gib,
        headroom=args.headroom,
    )
    if args.out:
        save_program(result.program, args.out)
    if args.svg:
        from pipetrain.render.svg import render_svg

        Path(args.svg).write_text(
            render_svg(
                result.timeline,
                title=f"synthesized, stage_layers {list(result.stage_layers)}",
                memory=True,
                static=result.static_gib,
                limit=result.baseline.usable_gib,
            )
        )
    if args.json:
        out = plan_json(result)
        if args.out:
            out["program_file"] = args.out
        print(json.dumps(out))
        return 0
    from pipetrain.render.text import render_text

    print(render_text(result.timeline, width=width_of(args), color=False))
    print(describe(result))
    for path in (args.out, args.svg):
        if path:
            print(f"wrote {path}", file=sys.stderr)
    return 0


def plan_json(result: Synthesis) -> dict[str, object]:
    """The synthesized plan as ``pipetrain train --plan`` reads it (``Layout.of_program``: the
    program inside, the schedule its name), with its prediction, how it was found and the
    planner's pick beside it."""
    plan = Layout.of_program(result.program, result.stage_layers, result.recompute).to_json()
    return plan | {k: v for k, v in result.to_json().items() if k not in plan}


def describe(result: Synthesis) -> str:
    """The synthesized step beside the planner's pick, in words."""
    base = result.baseline
    return "\n".join(
        [
            f"synthesized: {result.program.num_ranks} ranks, {result.program.num_stages} stages, "
            f"{result.program.num_microbatches} micro-batches, stage_layers "
            f"{list(result.stage_layers)}, recompute {list(result.recompute)}",
            f"predicted: step {result.step_ms:.3f} ms, bubble "
            f"{result.timeline.bubble_fraction:.1%}, peak GiB per rank "
            + " ".join(f"{p:.2f}" for p in result.peak_gib)
            + f" (budget {base.memory_gib:g}, {base.usable_gib:.3g} after headroom)",
            f"planner's pick: {base.schedule}, {base.stages_per_rank} stage(s) per rank, "
            f"stage_layers {list(base.stage_layers)}: step {base.step_ms:.3f} ms "
            f"({result.speedup:.3f}x)",
            f"found by: {result.how}",
        ]
    )


COMMAND = Command(
    name="synthesize",
    help="build a schedule for a costs file's stages under a memory cap",
    options=lambda: OPTIONS,
    run=run,
)
