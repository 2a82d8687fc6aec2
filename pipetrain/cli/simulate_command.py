"""``pipetrain simulate``: one step of a schedule (or of a program file) under given costs — the
timeline drawn in the terminal with each rank's held activations over time under it, its bubble
and memory, or one JSON object; an SVG (with the activation curves) or a Chrome/Perfetto trace on
request."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipetrain.cli.flags import (
    GROUP_SIZE,
    WIDTH,
    Command,
    Option,
    UsageError,
    cost_options,
    costs_from,
    microbatches_option,
    ranks_option,
    schedule_options,
    shape_flags_given,
    stages_per_rank_option,
    width_of,
)
from pipetrain.schedule.lower import lower
from pipetrain.schedule.program import Program, describe_shape
from pipetrain.schedule.registry import build_schedule, family
from pipetrain.schedule.timeline import Timeline
from pipetrain.schedule.validate import validate
from pipetrain.sim.compare import summary
from pipetrain.sim.simulate import simulate

OPTIONS = (
    *schedule_options(),
    ranks_option(),
    microbatches_option(),
    stages_per_rank_option(),
    GROUP_SIZE,
    Option(
        ("--program",),
        metavar="FILE",
        help="simulate a program file (CSV as torch's _dump_csv writes, or JSON) instead of "
        "--schedule",
    ),
    *cost_options(),
    Option(("--json",), switch=True, help="print one JSON object instead of the timeline"),
    Option(("--svg",), metavar="FILE", help="write an SVG Gantt chart"),
    Option(("--trace",), metavar="FILE", help="write a Chrome/Perfetto trace JSON"),
    WIDTH,
)


def run(args: argparse.Namespace) -> int:
    if not args.program and args.schedule:
        family(args.schedule)  # an unknown name is refused first, with the legal ones
    program = program_from(args)
    timeline = simulate(program, costs_from(args))
    if args.svg:
        from pipetrain.render import render_svg

        Path(args.svg).write_text(render_svg(timeline, title=shape_title(program), memory=True))
    if args.trace:
        from pipetrain.render import write_trace

        write_trace(timeline, args.trace)
    if args.json:
        print(json.dumps(summary(program, timeline), indent=1))
        return 0
    from pipetrain.render import render_memory_text, render_text

    print(shape_title(program))
    print(render_text(timeline, width=width_of(args)))
    print(render_memory_text(timeline, width=width_of(args)))
    print(summary_line(timeline))
    for path in (args.svg, args.trace):
        if path:
            print(f"wrote {path}")
    return 0


def program_from(args: argparse.Namespace) -> Program:
    """The lowered, validated program: the ``--program`` file's, or the shape flags' schedule."""
    if getattr(args, "program", None):
        shape = shape_flags_given(args)
        if shape:
            raise UsageError(
                f"--program FILE carries its own schedule and shape; drop {', '.join(shape)}"
            )
        from pipetrain.schedule.program_io import load_program

        return validate(lower(validate(load_program(args.program))))
    if not (args.schedule and args.ranks and args.microbatches):
        raise UsageError(
            "give SCHEDULE (or --schedule NAME) --ranks P --microbatches M, or --program FILE"
        )
    program = build_schedule(
        args.schedule, args.ranks, args.microbatches, args.stages_per_rank, args.group_size
    )
    return validate(lower(program))


def shape_title(program: Program) -> str:
    return describe_shape(
        program.name,
        program.num_ranks,
        program.placement.stages_per_rank,
        program.num_microbatches,
    )


def summary_line(timeline: Timeline) -> str:
    peaks = ", ".join(f"{p:g}" for p in timeline.peak_activations)
    return (
        f"makespan {timeline.makespan:g}   span {timeline.span:g}   "
        f"bubble {100 * timeline.bubble_fraction:.1f}%   peak activations per rank [{peaks}]"
    )


COMMAND = Command(
    name="simulate",
    help="simulate one step: timeline, bubble, memory",
    options=lambda: OPTIONS,
    run=run,
)
