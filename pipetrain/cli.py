"""The command line: ``pipetrain schedules | show | simulate | compare | train | demo``.

Input is validated here, at the edge: any bad value exits with status 2 and a one-paragraph
message naming the problem and the legal values, never a traceback. The shape flags every
subcommand shares live in ``pipetrain.flags``. torch is imported only by ``train`` and ``demo``
(lazily, after checking it is installed), so planning commands run anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from pipetrain.flags import (
    add_group_size,
    add_microbatches,
    add_ranks,
    add_schedule,
    add_stages_per_rank,
    add_width,
    describe_shape,
    plural,
    shape_flags_given,
    width_of,
)
from pipetrain.planner.command import add_plan_arguments, run_plan
from pipetrain.schedule.lower import lower
from pipetrain.schedule.program import Program, format_grid
from pipetrain.schedule.registry import FAMILIES, build_schedule, family
from pipetrain.schedule.timeline import Timeline
from pipetrain.schedule.validate import validate
from pipetrain.sim.compare import compare, format_comparison, summary
from pipetrain.sim.costs import MAX_COST, Costs
from pipetrain.sim.simulate import simulate

PROG = "pipetrain"
#: what to install when a command needs torch (planning-only installs stay light without it)
TORCH_HINT = "pip install 'pipetrain[torch]' (or torch==2.13.0 first, as `make demo` does)"


#: at most this many bands of a long program are drawn by ``show``
MAX_BANDS = 6


class UsageError(ValueError):
    """Bad command-line input; reported without a traceback, exit status 2."""


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
    add_width(sub.add_parser("schedules", help="list every schedule with its constraints"))
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
        sub.add_parser("profile", help="measure a model's layers into a costs file")
    )
    train = sub.add_parser(
        "train",
        help="train a model (tiny Llama by default) on a text file, pipeline x data parallel "
        "(launches the processes itself)",
    )
    from pipetrain.app.options import add_train_arguments  # no torch at import: --help stays fast

    add_train_arguments(train)
    _add_demo(sub.add_parser("demo", help="the main job with its defaults (what `make demo` runs)"))
    return parser


def _add_show(p: argparse.ArgumentParser) -> None:
    add_schedule(p)
    add_ranks(p, required=True)
    add_microbatches(p, required=True)
    add_stages_per_rank(p)
    add_group_size(p)
    p.add_argument(
        "--lowered", action="store_true", help="include the SEND/RECV actions lowering adds"
    )
    p.add_argument(
        "--save", metavar="FILE", help="also write the program (.json, else torch-compatible CSV)"
    )
    add_width(p)


def _add_simulate(p: argparse.ArgumentParser) -> None:
    add_schedule(p)
    add_ranks(p)
    add_microbatches(p)
    add_stages_per_rank(p)
    add_group_size(p)
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
    add_width(p)


def _add_compare(p: argparse.ArgumentParser) -> None:
    add_ranks(p, required=True)
    add_microbatches(p, required=True)
    add_stages_per_rank(p)
    _add_costs(p, per_rank=True)
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    add_width(p)


def _add_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="out", metavar="DIR", help="where pictures go (default out/)")
    p.add_argument(
        "--plan-only", action="store_true", help="only compare schedules and draw one; no training"
    )
    add_width(p)


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


def require_torch(instead: str = "") -> None:
    """Refuse a command that needs torch with one line saying what to install (and ``instead``)."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise UsageError(f"needs PyTorch ({e}); install it: {TORCH_HINT}{instead}") from None


def cmd_schedules(args: argparse.Namespace) -> int:
    name_w = max(len(n) for n in FAMILIES)
    indent = " " * (name_w + 2)
    for fam in FAMILIES.values():
        text = f"{fam.summary}\nconstraints: {fam.constraints}"
        lines = [
            line
            for para in text.splitlines()
            for line in textwrap.wrap(
                para, max(40, width_of(args) - len(indent)), break_on_hyphens=False
            )
        ]
        print(f"{fam.name:<{name_w}}  {lines[0]}")
        for line in lines[1:]:
            print(indent + line)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    if args.schedule is None:
        raise UsageError(
            f"give the schedule: {PROG} show NAME -p P -m M (or --schedule NAME); "
            f"legal schedules: {', '.join(FAMILIES)}"
        )
    program = build_schedule(
        args.schedule, args.ranks, args.microbatches, args.stages_per_rank, args.group_size
    )
    lowered = validate(lower(program))
    shown = lowered if args.lowered else program
    print(
        f"{program.name}: {plural(program.num_ranks, 'rank')}, "
        f"{plural(program.num_stages, 'stage')} ({program.placement.kind} placement), "
        f"{plural(program.num_microbatches, 'micro-batch', 'micro-batches')}"
    )
    print(grid_in_bands(shown, width_of(args)))
    if args.save:
        from pipetrain.schedule.program_io import save_program

        save_program(shown, args.save)
        print(f"wrote {args.save}")
    return 0


def grid_in_bands(program: Program, width: int) -> str:
    """The program grid cut into bands of steps that each fit ``width`` columns.

    A band is drawn by ``format_grid`` (the error grids' drawing) on that band's steps, under a
    header that numbers the steps as in the whole program. A long program shows its first and
    last bands (``MAX_BANDS`` in all) and says which steps it leaves out.
    """
    rows = program.actions
    num_steps = max((len(row) for row in rows), default=0)
    cell = max((len(str(a)) for row in rows for a in row), default=2) + 2
    label = len(f"rank {len(rows) - 1}") + 2
    per_band = max(1, (width - label - 2) // cell)  # 2: the " …" that says a band continues
    if num_steps <= per_band:
        return program.grid()
    starts = list(range(0, num_steps, per_band))
    if len(starts) > MAX_BANDS:
        starts = [*starts[: MAX_BANDS - 1], starts[-1]]
    bands: list[tuple[int, str]] = []
    for lo in starts:
        hi = min(num_steps, lo + per_band)
        if bands and lo != bands[-1][0] + per_band:
            skipped = f"steps {bands[-1][0] + per_band}–{lo - 1} not shown"
            bands.append((lo, f"… {skipped}; --save FILE writes the whole program"))
        band = [row[lo:hi] for row in rows]
        band_cell = max((len(str(a)) for row in band for a in row), default=2) + 2
        header = " " * label + "".join(f"{s:<{band_cell}}" for s in range(lo, hi))
        drawn = format_grid(band).splitlines()[1:]
        lines = [header.rstrip()]
        lines += [line + (" …" if len(row) > hi else "") for line, row in zip(drawn, rows)]
        bands.append((lo, "\n".join(lines)))
    return "\n\n".join(text for _, text in bands)


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
    print(render_text(timeline, width=width_of(args)))
    print(_summary_text(timeline))
    for path in (args.svg, args.trace):
        if path:
            print(f"wrote {path}")
    return 0


def _title(program: Program) -> str:
    return describe_shape(
        program.name,
        program.num_ranks,
        program.placement.stages_per_rank,
        program.num_microbatches,
    )


def _summary_text(timeline: Timeline) -> str:
    peaks = ", ".join(f"{p:g}" for p in timeline.peak_activations)
    return (
        f"makespan {timeline.makespan:g}   span {timeline.span:g}   "
        f"bubble {100 * timeline.bubble_fraction:.1f}%   peak activations per rank [{peaks}]"
    )


def comparison_header(num_ranks: int, num_microbatches: int, costs: Costs, width: int) -> str:
    """What the compare table's numbers mean, so rows of different families read alike."""
    work = ", ".join(
        f"{name}={value:g}"
        for name, value in (
            ("F", costs.forward),
            ("I", costs.backward_input),
            ("W", costs.backward_weight),
            ("activation", costs.activation),
        )
        if isinstance(value, int | float)
    )
    text = (
        f"{plural(num_ranks, 'rank')}, {plural(num_microbatches, 'micro-batch', 'micro-batches')}, "
        f"best first. Costs and peaks are per rank's share of the model ({work}); a schedule "
        "with v stages per rank gives each stage 1/v of them, so every row does the same work. "
        "makespan: first start to last end; span: the longest rank's own first-to-last; "
        "bubble: idle share of ranks × makespan; peak: activations held at once; p2p: "
        "transfers per step."
    )
    return textwrap.fill(text, min(width, 100))


def cmd_compare(args: argparse.Namespace) -> int:
    costs = costs_from(args)
    result = compare(args.ranks, args.microbatches, args.stages_per_rank, costs)
    if args.json:
        print(json.dumps(list(result.rows), indent=1))
        return 0
    print(comparison_header(args.ranks, args.microbatches, costs, width_of(args)))
    print(format_comparison(result.rows))
    for name, why in result.refused:
        print(f"  not applicable: {name}: {why}")
    return 0


#: the demo's pipeline: what it compares, draws, then trains
DEMO_SCHEDULE, DEMO_RANKS, DEMO_MICROBATCHES = "zbv", 2, 4
#: the demo's training job: a tiny Llama with tied embeddings, clipped, checkpointed, then
#: resumed from its checkpoint for the last steps
DEMO_TRAIN = ["--model", "llama", "--tie-embeddings", "--clip-grad-norm", "1"]
DEMO_STEPS, DEMO_RESUME_AT, DEMO_CHECKPOINT_EVERY = 60, 40, 20


def cmd_demo(args: argparse.Namespace) -> int:
    if not args.plan_only:
        require_torch("; or plan without it: pipetrain demo --plan-only")  # before any output
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    costs = Costs()
    p, m = DEMO_RANKS, DEMO_MICROBATCHES
    print(f"$ {PROG} compare --ranks {p} --microbatches {m}")
    print(comparison_header(p, m, costs, width_of(args)))
    print(format_comparison(compare(p, m, None, costs).rows))
    from pipetrain.render import render_svg, render_text

    program = validate(lower(build_schedule(DEMO_SCHEDULE, p, m)))
    # the table's zbv row: a rank's share costs 1, so each of a rank's 2 stages costs 1/2
    timeline = simulate(
        program, costs.scaled(program.num_ranks / program.placement.stages_per_chain)
    )
    svg = out / f"{DEMO_SCHEDULE}_simulated.svg"
    svg.write_text(render_svg(timeline, title=_title(program)))
    print(f"\n$ {PROG} simulate {DEMO_SCHEDULE} -p {p} -m {m} -F .5 -I .5 -W .5 --activation .5")
    print(f"{_title(program)} (the table's {DEMO_SCHEDULE} row)")
    print(render_text(timeline, width=width_of(args)))
    print(_summary_text(timeline))
    print(f"wrote {svg}")
    if args.plan_only:
        return 0
    from pipetrain.app.launch import run_train
    from pipetrain.app.options import add_train_arguments

    parser = argparse.ArgumentParser(prog=f"{PROG} train")
    add_train_arguments(parser)
    checkpoints = out / "demo_checkpoints"
    if checkpoints.exists():  # a fresh run each time: --resume below must find this run's
        import shutil

        shutil.rmtree(checkpoints)
    job = [*DEMO_TRAIN, "--schedule", DEMO_SCHEDULE, "-p", str(p), "-m", str(m)]
    job += ["--checkpoint-dir", str(checkpoints), "--svg", str(out / "train_step.svg")]
    job += ["--checkpoint-every", str(DEMO_CHECKPOINT_EVERY)]
    for steps, resume in ((DEMO_RESUME_AT, []), (DEMO_STEPS, ["--resume"])):
        argv = [*job, "--steps", str(steps), *resume]
        print(f"\n$ {PROG} train {' '.join(argv)}")
        status = run_train(parser.parse_args(argv))
        if status:
            return status
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    require_torch()
    from pipetrain.app.launch import run_train

    return run_train(args)


def cmd_profile(args: argparse.Namespace) -> int:
    require_torch()
    from pipetrain.app.profile_model import run_profile

    return run_profile(args)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
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
    command: str = args.command
    try:
        if command == "simulate" and not args.program:
            if args.schedule:
                family(args.schedule)
        return COMMANDS[command](args)
    except ValueError as e:  # ScheduleError and UsageError are ValueErrors
        print(f"{PROG} {command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except OSError as e:  # an output path that cannot be written
        print(
            f"{PROG} {command}: error: cannot write {e.filename!r}: {e.strerror}",
            file=sys.stderr,
        )
        return 2
