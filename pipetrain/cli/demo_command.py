"""``pipetrain demo``: the main job with its defaults (what ``make demo`` runs) — compare the
schedules on one shape, draw one of them, then train a tiny Llama on it, checkpoint, and resume
from the checkpoint for the last steps. ``--plan-only`` stops before training (no torch)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipetrain.cli.compare_command import comparison_header
from pipetrain.cli.flags import PROG, WIDTH, Command, Option, require_torch, width_of
from pipetrain.cli.simulate_command import shape_title, summary_line
from pipetrain.cli.train_command import config_from_argv
from pipetrain.schedule.lower import lower
from pipetrain.schedule.registry import build_schedule
from pipetrain.schedule.validate import validate
from pipetrain.sim.compare import compare, format_comparison
from pipetrain.sim.costs import Costs
from pipetrain.sim.simulate import simulate

#: the demo's pipeline: what it compares, draws, then trains
DEMO_SCHEDULE, DEMO_RANKS, DEMO_MICROBATCHES = "zbv", 2, 4
#: the demo's training job: a tiny Llama with tied embeddings, clipped, checkpointed, then
#: resumed from its checkpoint for the last steps
DEMO_TRAIN = ["--model", "llama", "--tie-embeddings", "--clip-grad-norm", "1"]
DEMO_STEPS, DEMO_RESUME_AT, DEMO_CHECKPOINT_EVERY = 60, 40, 20

OPTIONS = (
    Option(
        ("--out",), default="out", metavar="DIR", help="where pictures go", shown_default="out/"
    ),
    Option(("--plan-only",), switch=True, help="only compare schedules and draw one; no training"),
    WIDTH,
)


def run(args: argparse.Namespace) -> int:
    if not args.plan_only:
        require_torch("; or plan without it: pipetrain demo --plan-only")  # before any output
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _plan(out, width_of(args))
    if args.plan_only:
        return 0
    return _train(out)


def _plan(out: Path, width: int) -> None:
    """The compare table, then the table's zbv row drawn (and written as SVG)."""
    costs = Costs()
    p, m = DEMO_RANKS, DEMO_MICROBATCHES
    print(f"$ {PROG} compare --ranks {p} --microbatches {m}")
    print(comparison_header(p, m, costs, width))
    print(format_comparison(compare(p, m, None, costs).rows))
    from pipetrain.render import render_svg, render_text

    program = validate(lower(build_schedule(DEMO_SCHEDULE, p, m)))
    # the table's zbv row: a rank's share costs 1, so each of a rank's 2 stages costs 1/2
    timeline = simulate(
        program, costs.scaled(program.num_ranks / program.placement.stages_per_chain)
    )
    svg = out / f"{DEMO_SCHEDULE}_simulated.svg"
    svg.write_text(render_svg(timeline, title=shape_title(program)))
    print(f"\n$ {PROG} simulate {DEMO_SCHEDULE} -p {p} -m {m} -F .5 -I .5 -W .5 --activation .5")
    print(f"{shape_title(program)} (the table's {DEMO_SCHEDULE} row)")
    print(render_text(timeline, width=width))
    print(summary_line(timeline))
    print(f"wrote {svg}")


def _train(out: Path) -> int:
    """Train ``DEMO_RESUME_AT`` steps with checkpoints, then resume to ``DEMO_STEPS``."""
    from pipetrain.app.launch import run_train

    checkpoints = out / "demo_checkpoints"
    if checkpoints.exists():  # a fresh run each time: --resume below must find this run's
        import shutil

        shutil.rmtree(checkpoints)
    p, m = DEMO_RANKS, DEMO_MICROBATCHES
    job = [*DEMO_TRAIN, "--schedule", DEMO_SCHEDULE, "-p", str(p), "-m", str(m)]
    job += ["--checkpoint-dir", str(checkpoints), "--svg", str(out / "train_step.svg")]
    job += ["--checkpoint-every", str(DEMO_CHECKPOINT_EVERY)]
    for steps, resume in ((DEMO_RESUME_AT, []), (DEMO_STEPS, ["--resume"])):
        argv = [*job, "--steps", str(steps), *resume]
        print(f"\n$ {PROG} train {' '.join(argv)}")
        status = run_train(config_from_argv(argv))
        if status:
            return status
    return 0


COMMAND = Command(
    name="demo",
    help="the main job with its defaults (what `make demo` runs)",
    options=lambda: OPTIONS,
    run=run,
)
