"""``pipetrain simulate``: one step of a schedule (or of a program file) under given costs — the
timeline drawn in the terminal with each rank's held activations over time under it, its bubble
and memory, or one JSON object; an SVG (with the activation curves) or a Chrome/Perfetto trace on
request. ``--offload`` inserts activation offload copies (``schedule.offload``), each reload just
in time under the given costs, moved whole or, with ``--stage-layers`` > 1, layer by layer
(``sim.offload_model``), and draws them under the memory rows."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from pipetrain.cli.flags import (
    GROUP_SIZE,
    WIDTH,
    Command,
    Option,
    UsageError,
    cost_options,
    cost_value,
    costs_from,
    microbatches_option,
    positive_float,
    ranks_option,
    schedule_options,
    shape_flags_given,
    stages_per_rank_option,
    width_of,
)
from pipetrain.planner.costs_file_moe import all_to_all_ms
from pipetrain.schedule.lower import lower
from pipetrain.schedule.offload import check_fractions, insert_offload, offloadable_stages
from pipetrain.schedule.program import Program, describe_shape
from pipetrain.schedule.registry import build_schedule, family
from pipetrain.schedule.timeline import Timeline
from pipetrain.schedule.validate import validate
from pipetrain.sim.all_to_all import AllToAllShare, all_to_all_share
from pipetrain.sim.compare import summary
from pipetrain.sim.costs import Costs
from pipetrain.sim.simulate import reload_timing, simulate

COSTS_GROUP = (
    "costs (time units per stage; one number, or a comma-separated list with one per stage)"
)


def all_to_all_options() -> tuple[Option, ...]:
    """The expert all-to-all: as times (``--all-to-all``), or as bytes over a link."""
    return (
        Option(
            ("--all-to-all",),
            type=cost_value,
            default=0.0,
            metavar="A2A",
            help="a stage's expert-parallel all-to-all per micro-batch in the forward (its MoE "
            "layers' dispatch + combine): a lone F waits for it, an overlapped F&B pair hides it "
            "under the other half's compute",
            group=COSTS_GROUP,
        ),
        Option(
            ("--all-to-all-backward",),
            type=cost_value,
            metavar="A2AB",
            help="the same in the backward (B or I; W has none)",
            shown_default="A2A",
            group=COSTS_GROUP,
        ),
        Option(
            ("--dispatched-bytes",),
            type=cost_value,
            metavar="BYTES",
            help="instead of --all-to-all: bytes a stage's MoE layers dispatch per micro-batch, "
            "priced at --ep-link-gbs (dispatch + combine each way; times are then ms)",
            shown_default="none",
            group=COSTS_GROUP,
        ),
        Option(
            ("--ep-link-gbs",),
            type=positive_float,
            metavar="GB/s",
            help="with --dispatched-bytes: GB/s each rank sends at over the expert-parallel link",
            shown_default="none",
            group=COSTS_GROUP,
        ),
    )


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
    Option(
        ("--offload",),
        type=cost_value,
        metavar="FRAC",
        help="share of each stage's activation kept in host memory between forward and "
        "backward, in [0, 1]: one number (every stage whose micro-batches wait long enough for "
        "the copies) or one per stage; reloads are placed just in time",
        shown_default="none",
        group=COSTS_GROUP,
    ),
    Option(
        ("--host-copy",),
        type=cost_value,
        default=0.0,
        metavar="HC",
        help="time to copy one micro-batch's whole activation of a stage to host memory, one way",
        group=COSTS_GROUP,
    ),
    Option(
        ("--stage-layers",),
        type=cost_value,
        default=1,
        metavar="L",
        help="layers per stage (as a plan's stage_layers): with more than 1, --offload moves a stage's first ⌈FRAC·L⌉ "
        "layers, each as its forward ends, and reloads them one ahead of its backward (as the "
        "runtime does for a stage of layers); 1: the share moves in one copy after the forward",
        group=COSTS_GROUP,
    ),
    *all_to_all_options(),
    Option(("--json",), switch=True, help="print one JSON object instead of the timeline"),
    Option(("--svg",), metavar="FILE", help="write an SVG Gantt chart"),
    Option(("--trace",), metavar="FILE", help="write a Chrome/Perfetto trace JSON"),
    WIDTH,
)


def run(args: argparse.Namespace) -> int:
    if not args.program and args.schedule:
        family(args.schedule)  # an unknown name is refused first, with the legal ones
    program = program_from(args)
    costs = with_all_to_all(costs_from(args), args)
    if args.offload is not None:
        costs = dataclasses.replace(costs, host_copy=args.host_copy, layers=args.stage_layers)
        program, fractions = _offloaded(program, args.offload, costs)
        costs = dataclasses.replace(costs, offload=fractions)
    timeline = simulate(program, costs)
    if args.svg:
        from pipetrain.render import render_svg

        Path(args.svg).write_text(render_svg(timeline, title=shape_title(program), memory=True))
    if args.trace:
        from pipetrain.render import write_trace

        write_trace(timeline, args.trace)
    moved = all_to_all_share(program, costs) if _has_all_to_all(costs) else None
    if args.json:
        out = summary(program, timeline)
        if moved is not None:
            out["all_to_all"] = moved.to_json()
        print(json.dumps(out, indent=1))
        return 0
    from pipetrain.render import render_memory_text, render_text

    print(shape_title(program))
    print(render_text(timeline, width=width_of(args)))
    print(render_memory_text(timeline, width=width_of(args)))
    print(summary_line(timeline))
    if moved is not None:
        print(all_to_all_summary(moved))
    for path in (args.svg, args.trace):
        if path:
            print(f"wrote {path}")
    return 0


def _offloaded(
    program: Program, offload: float | tuple[float, ...], costs: Costs
) -> tuple[Program, tuple[float, ...]]:
    """The program with its offload copies, reloads just in time under ``costs``, and the
    fraction per stage (one number: every stage with a micro-batch whose wait hides the copies)."""
    n = program.num_stages
    try:
        check_fractions(offload if isinstance(offload, tuple) else (offload,) * n, n)
        if isinstance(offload, tuple):
            fractions = offload
        else:
            timing = reload_timing(dataclasses.replace(costs, offload=offload).per_stage(n), n)
            able = offloadable_stages(program, 1, timing)
            fractions = tuple(offload if s in able else 0.0 for s in range(n))
        timing = reload_timing(dataclasses.replace(costs, offload=fractions).per_stage(n), n)
        return validate(insert_offload(program, fractions, timing=timing)), fractions
    except ValueError as e:
        raise UsageError(f"--offload: {e}") from None


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


def with_all_to_all(costs: Costs, args: argparse.Namespace) -> Costs:
    """``costs`` with the all-to-all the flags give (``UsageError`` for a mix that cannot be
    meant)."""
    given_bytes, link = args.dispatched_bytes, args.ep_link_gbs
    if (given_bytes is None) != (link is None):
        raise UsageError("give --dispatched-bytes and --ep-link-gbs together")
    if given_bytes is None:
        backward = args.all_to_all_backward
        return dataclasses.replace(costs, all_to_all=args.all_to_all, all_to_all_backward=backward)
    if args.all_to_all != 0.0 or args.all_to_all_backward is not None:
        raise UsageError("give the all-to-all as --all-to-all or as --dispatched-bytes, not both")
    per_stage = given_bytes if isinstance(given_bytes, tuple) else (given_bytes,)
    times = tuple(all_to_all_ms(b, link) for b in per_stage)
    return dataclasses.replace(costs, all_to_all=times if len(times) > 1 else times[0])


def _has_all_to_all(costs: Costs) -> bool:
    values = [costs.all_to_all, costs.all_to_all_backward]
    return any(any(v) if isinstance(v, tuple) else bool(v) for v in values if v is not None)


def all_to_all_summary(moved: AllToAllShare) -> str:
    """One line: the all-to-all each rank carries and hides (``sim.all_to_all``)."""
    total = ", ".join(f"{t:g}" for t in moved.total)
    hidden = ", ".join(f"{h:g}" for h in moved.hidden)
    return (
        f"all-to-all per rank [{total}]   hidden under compute [{hidden}]   "
        f"hidden {100 * moved.hidden_share:.1f}%"
    )


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
