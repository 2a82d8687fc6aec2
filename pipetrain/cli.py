"""The command line: ``pipetrain schedules | show | simulate | compare | train | demo``.

Input is validated here, at the edge: any bad value exits with status 2 and a one-paragraph
message naming the problem and the legal values, never a traceback. torch is imported only by
``train`` (lazily), so planning commands run anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from pipetrain.planner.command import add_plan_arguments, run_plan
from pipetrain.schedule.lower import lower
from pipetrain.schedule.program import Program
from pipetrain.schedule.registry import FAMILIES, build_schedule, family
from pipetrain.schedule.validate import validate
from pipetrain.sim.compare import compare, format_comparison, summary
from pipetrain.sim.costs import MAX_COST, Costs
from pipetrain.sim.simulate import simulate

PROG = "pipetrain"


class UsageError(ValueError):
    """Bad command-line input; reported without a traceback, exit status 2."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def cost_value(text: str) -> float | tuple[float, ...]:
    """One non-negative finite number, or a comma-separated list with one per stage."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number >= 0 or a comma-separated list of them, got {text!r}"
        ) from None
    for v in values:
        if not 0 <= v <= MAX_COST:  # NaN fails too
            raise argparse.ArgumentTypeError(f"costs must be numbers in [0, {MAX_COST:g}], got {v}")
    return values[0] if len(values) == 1 else tuple(values)


def _add_shape(p: argparse.ArgumentParser, required: bool = True) -> None:
    names = ", ".join(FAMILIES)
    p.add_argument(
        "--schedule", "-s", required=required, metavar="NAME", help=f"schedule family: {names}"
    )
    p.add_argument(
        "--ranks",
        "-p",
        type=positive_int,
        required=required,
        metavar="P",
        help="pipeline ranks (GPUs)",
    )
    p.add_argument(
        "--microbatches",
        "-m",
        type=positive_int,
        required=required,
        metavar="M",
        help="micro-batches per step",
    )
    p.add_argument(
        "--stages-per-rank",
        "-v",
        type=positive_int,
        metavar="V",
        help="stages (model chunks) per rank; default 2 for "
        + ", ".join(f.name for f in FAMILIES.values() if f.default_stages_per_rank == 2)
        + ", else 1",
    )
    p.add_argument(
        "--group-size",
        type=positive_int,
        metavar="G",
        help="interleaved-1f1b only: micro-batch group size per virtual stage (default: the "
        "smallest legal size, ranks when it divides the micro-batches)",
    )


def _add_costs(p: argparse.ArgumentParser, per_rank: bool = False) -> None:
    g = p.add_argument_group(
        "costs (time units for one rank's share of the model; one number each)"
        if per_rank
        else "costs (time units per stage; one number, or a comma-separated list with one per stage)"
    )
    g.add_argument(
        "--forward",
        "-F",
        type=cost_value,
        default=1.0,
        metavar="F",
        help="forward time (default 1)",
    )
    g.add_argument(
        "--backward-input",
        "-I",
        type=cost_value,
        default=1.0,
        metavar="I",
        help="input-gradient time (default 1)",
    )
    g.add_argument(
        "--backward-weight",
        "-W",
        type=cost_value,
        default=1.0,
        metavar="W",
        help="weight-gradient time (default 1)",
    )
    g.add_argument(
        "--backward", "-B", type=cost_value, metavar="B", help="full backward time (default I + W)"
    )
    g.add_argument(
        "--forward-backward",
        type=cost_value,
        metavar="FB",
        help="overlapped F&B pair time (default F + B)",
    )
    g.add_argument(
        "--comm",
        "-C",
        type=cost_value,
        default=0.0,
        metavar="C",
        help="latency on every cross-rank dependency (default 0)",
    )
    g.add_argument(
        "--activation",
        type=cost_value,
        default=1.0,
        metavar="A",
        help="activation size of one micro-batch per stage (default 1)",
    )
    g.add_argument(
        "--activation-for-weight",
        type=cost_value,
        metavar="AW",
        help="activation held between a split backward's I and W (default A)",
    )
    g.add_argument(
        "--workspace",
        type=cost_value,
        default=0.0,
        metavar="WS",
        help="memory an action uses only while it runs, in activation units (default 0)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Pipeline-parallel schedules: build, check, simulate, draw and train.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("schedules", help="list every schedule with its constraints")
    _add_show(sub.add_parser("show", help="print a schedule's program grid"))
    _add_simulate(sub.add_parser("simulate", help="simulate one step: timeline, bubble, memory"))
    _add_compare(
        sub.add_parser("compare", help="every schedule that accepts the shape, best first")
    )
    add_plan_arguments(
        sub.add_parser("plan", help="pick schedule, micro-batches and cut from a costs file")
    )
    from pipetrain.app.profile_model import add_profile_arguments

    add_profile_arguments(
        sub.add_parser("profile", help="measure the built-in GPT's layers into a costs file")
    )
    train = sub.add_parser(
        "train", help="train a small GPT with a pipeline schedule (launches the processes itself)"
    )
    from pipetrain.app.train import add_train_arguments  # no torch at import: --help stays fast

    add_train_arguments(train)
    demo = sub.add_parser("demo", help="the main job with its defaults (what `make demo` runs)")
    demo.add_argument(
        "--out", default="out", metavar="DIR", help="where pictures go (default out/)"
    )
    demo.add_argument(
        "--plan-only", action="store_true", help="only compare schedules and draw one; no training"
    )
    return parser


def _add_show(p: argparse.ArgumentParser) -> None:
    _add_shape(p)
    p.add_argument(
        "--lowered", action="store_true", help="include the SEND/RECV actions lowering adds"
    )
    p.add_argument(
        "--save", metavar="FILE", help="also write the program (.json, else torch-compatible CSV)"
    )


def _add_simulate(p: argparse.ArgumentParser) -> None:
    _add_shape(p, required=False)
    p.add_argument(
        "--program",
        metavar="FILE",
        help="simulate a program file (CSV as torch's _dump_csv writes, or JSON) instead of --schedule",
    )
    _add_costs(p)
    p.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the timeline"
    )
    p.add_argument("--svg", metavar="FILE", help="write an SVG Gantt chart")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace JSON")
    p.add_argument(
        "--width",
        type=positive_int,
        default=100,
        metavar="COLS",
        help="terminal timeline width (default 100)",
    )


def _add_compare(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ranks", "-p", type=positive_int, required=True, metavar="P", help="pipeline ranks (GPUs)"
    )
    p.add_argument(
        "--microbatches",
        "-m",
        type=positive_int,
        required=True,
        metavar="M",
        help="micro-batches per step",
    )
    p.add_argument(
        "--stages-per-rank",
        "-v",
        type=positive_int,
        metavar="V",
        help="stages per rank for the families that take several (default 2)",
    )
    _add_costs(p, per_rank=True)
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


def costs_from(args: argparse.Namespace) -> Costs:
    return Costs(
        forward=args.forward,
        backward_input=args.backward_input,
        backward_weight=args.backward_weight,
        backward=args.backward,
        forward_backward=args.forward_backward,
        comm=args.comm,
        activation=args.activation,
        activation_for_weight=args.activation_for_weight,
        workspace=args.workspace,
    )


def program_from(args: argparse.Namespace) -> Program:
    if getattr(args, "program", None):
        shape = [
            flag
            for flag, value in (
                ("--schedule", args.schedule),
                ("--ranks", args.ranks),
                ("--microbatches", args.microbatches),
                ("--stages-per-rank", args.stages_per_rank),
                ("--group-size", args.group_size),
            )
            if value is not None
        ]
        if shape:
            raise UsageError(
                f"--program FILE carries its own schedule and shape; drop {', '.join(shape)}"
            )
        from pipetrain.schedule.program_io import load_program

        return validate(lower(validate(load_program(args.program))))
    if not (args.schedule and args.ranks and args.microbatches):
        raise UsageError("give --schedule NAME --ranks P --microbatches M, or --program FILE")
    program = build_schedule(
        args.schedule, args.ranks, args.microbatches, args.stages_per_rank, args.group_size
    )
    return validate(lower(program))


def cmd_schedules(_: argparse.Namespace) -> int:
    width = max(len(n) for n in FAMILIES)
    for fam in FAMILIES.values():
        print(f"{fam.name:<{width}}  {fam.summary}")
        print(f"{'':<{width}}  constraints: {fam.constraints}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    program = build_schedule(
        args.schedule, args.ranks, args.microbatches, args.stages_per_rank, args.group_size
    )
    lowered = validate(lower(program))
    shown = lowered if args.lowered else program
    placement = program.placement
    print(
        f"{program.name}: {program.num_ranks} ranks, {program.num_stages} stages "
        f"({placement.kind} placement), {program.num_microbatches} micro-batches"
    )
    print(shown.grid())
    if args.save:
        from pipetrain.schedule.program_io import save_program

        save_program(shown, args.save)
        print(f"wrote {args.save}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    program = program_from(args)
    timeline = simulate(program, costs_from(args))
    if args.svg:
        from pipetrain.render import render_svg

        Path(args.svg).write_text(render_svg(timeline, title=_title(program)))
    if args.trace:
        from pipetrain.render import write_trace

        write_trace(timeline, args.trace)
    if args.json:
        print(json.dumps(summary(program, timeline), indent=1))
        return 0
    from pipetrain.render import render_text

    print(_title(program))
    print(render_text(timeline, width=args.width))
    print(_summary_text(timeline))
    for path in (args.svg, args.trace):
        if path:
            print(f"wrote {path}")
    return 0


def _title(program: Program) -> str:
    v = program.placement.stages_per_rank
    per_rank = f"{v} stage{'s' if v != 1 else ''} per rank" if v else "uneven stages"
    return (
        f"{program.name}: {program.num_ranks} ranks, {per_rank}, "
        f"{program.num_microbatches} micro-batches"
    )


def _summary_text(timeline) -> str:
    peaks = ", ".join(f"{p:g}" for p in timeline.peak_activations)
    return (
        f"makespan {timeline.makespan:g}   span {timeline.span:g}   "
        f"bubble {100 * timeline.bubble_fraction:.1f}%   peak activations per rank [{peaks}]"
    )


def cmd_compare(args: argparse.Namespace) -> int:
    result = compare(args.ranks, args.microbatches, args.stages_per_rank, costs_from(args))
    if args.json:
        print(json.dumps(list(result.rows), indent=1))
        return 0
    print(
        f"{args.ranks} ranks, {args.microbatches} micro-batches, best first; costs and peaks are per "
        "rank's share of the model (with v stages per rank, a stage costs 1/v)"
    )
    print(format_comparison(result.rows))
    for name, why in result.refused:
        print(f"  not applicable: {name}: {why}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("$ pipetrain compare --ranks 4 --microbatches 8")
    print(format_comparison(compare(4, 8, None, Costs()).rows))
    from pipetrain.render import render_svg, render_text

    program = validate(lower(build_schedule("zbv", 4, 8)))
    timeline = simulate(program)
    svg = out / "zbv_simulated.svg"
    svg.write_text(render_svg(timeline, title=_title(program)))
    print(f"\n{_title(program)} (simulated, unit costs)")
    print(render_text(timeline))
    print(_summary_text(timeline))
    print(f"wrote {svg}")
    if args.plan_only:
        return 0
    from pipetrain.app.train import add_train_arguments, run_train

    parser = argparse.ArgumentParser(prog=f"{PROG} train")
    add_train_arguments(parser)
    print("\n$ pipetrain train   # 4 processes on CPU, zbv, defaults")
    return run_train(parser.parse_args([]))


def cmd_train(args: argparse.Namespace) -> int:
    from pipetrain.app.train import run_train

    return run_train(args)


def cmd_profile(args: argparse.Namespace) -> int:
    from pipetrain.app.profile_model import run_profile  # torch only when profiling

    return run_profile(args)


COMMANDS = {
    "schedules": cmd_schedules,
    "show": cmd_show,
    "simulate": cmd_simulate,
    "compare": cmd_compare,
    "demo": cmd_demo,
    "train": cmd_train,
    "plan": run_plan,
    "profile": cmd_profile,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "simulate" and not args.program:
            if args.schedule:
                family(args.schedule)
        return COMMANDS[args.command](args)
    except ValueError as e:  # ScheduleError and UsageError are ValueErrors
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except OSError as e:  # an output path that cannot be written
        print(
            f"{PROG} {args.command}: error: cannot write {e.filename!r}: {e.strerror}",
            file=sys.stderr,
        )
        return 2
