"""``pipetrain plan``: read a costs file, search, print the pick (JSON, or its timeline and a
table of each family's best). Bad input raises ``ValueError`` (the CLI exits 2 with it)."""

from __future__ import annotations

import argparse
import json

from pipetrain.planner.costs_file import load_costs
from pipetrain.planner.search import DEFAULT_HEADROOM, Search, search
from pipetrain.render.text import render_text


def _int_list(text: str) -> list[int]:
    try:
        values = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers >= 1, got {text!r}"
        ) from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _positive(text: str) -> int:
    (value,) = _int_list(text)
    return value


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of GiB > 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costs", required=True, metavar="FILE", help="costs file (JSON, version 1)")
    p.add_argument(
        "--ranks", "-p", type=_positive, required=True, metavar="P", help="pipeline ranks"
    )
    p.add_argument(
        "--memory-gib", type=_gib, required=True, metavar="G", help="memory budget per rank (GiB)"
    )
    p.add_argument(
        "--headroom",
        type=_fraction,
        default=DEFAULT_HEADROOM,
        metavar="F",
        help="share of --memory-gib kept free for what the costs file cannot see: allocator "
        f"fragmentation, NCCL buffers, optimizer temporaries (default {DEFAULT_HEADROOM:g})",
    )
    p.add_argument(
        "--microbatches",
        "-m",
        type=_int_list,
        metavar="M1,M2,...",
        help="micro-batch counts to try (default: 1, 2 and 4 x ranks)",
    )
    p.add_argument(
        "--schedules",
        metavar="A,B,...",
        help="families to search (default: every family Pipeline runs; see `pipetrain schedules`)",
    )
    p.add_argument("--global-batch", type=_positive, metavar="B", help="fixed global batch")
    p.add_argument(
        "--micro-batch-size", type=_positive, metavar="b", help="micro-batch size (with B)"
    )
    p.add_argument("--json", action="store_true", help="print the pick as one JSON object")
    p.add_argument("--width", type=_positive, default=100, metavar="COLS", help="timeline width")


def run_plan(args: argparse.Namespace) -> int:
    costs = load_costs(args.costs)
    found = search(
        costs,
        num_ranks=args.ranks,
        memory_gib=args.memory_gib,
        headroom=args.headroom,
        microbatches=args.microbatches,
        schedules=[s.strip() for s in args.schedules.split(",")] if args.schedules else None,
        global_batch=args.global_batch,
        micro_batch_size=args.micro_batch_size,
    )
    best = found.best  # NoPlanFits (a ValueError) when nothing fits: exit 2
    if args.json:
        print(json.dumps(best.plan.to_json()))
        return 0
    print(render_text(best.timeline, width=args.width, color=False))
    print()
    print(format_plan(found))
    return 0


def format_plan(found: Search) -> str:
    """The pick in words, then each family's best (step ms, bubble, peak GiB, fits)."""
    best = found.best.plan
    lines = [
        f"plan: {best.schedule}, {best.ranks} ranks x {best.stages_per_rank} stage(s), "
        f"{best.microbatches} micro-batches, stage_layers {list(best.stage_layers)}",
        f"predicted: step {best.step_ms:.3f} ms ({best.ms_per_microbatch:.3f} ms per micro-batch), "
        f"bubble {best.bubble_fraction:.1%}, peak GiB per rank "
        + " ".join(f"{p:.2f}" for p in best.peak_gib)
        + f" (budget {best.memory_gib:g}"
        + (
            f", {best.usable_gib:.3g} after {best.headroom:.0%} headroom)" if best.headroom else ")"
        ),
    ]
    names = best.stage_layer_names()
    if names:
        lines.append(
            "stages: "
            + "; ".join(
                f"{s}: {n[0]}" + (f"..{n[-1]}" if len(n) > 1 else "") for s, n in enumerate(names)
            )
        )
    lines += ["", "best plan of each family:"]
    header = (
        "schedule",
        "v",
        "M",
        "step ms",
        "ms/mb",
        "bubble",
        "peak GiB",
        "fits",
        "stage_layers",
    )
    rows = [header]
    for c in found.best_per_family():
        p = c.plan
        rows.append(
            (
                p.schedule,
                str(p.stages_per_rank),
                str(p.microbatches),
                f"{p.step_ms:.3f}",
                f"{p.ms_per_microbatch:.3f}",
                f"{p.bubble_fraction:.1%}",
                f"{max(p.peak_gib):.2f}",
                "yes" if p.fits else "no",
                ",".join(map(str, p.stage_layers)),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    for r in rows:
        lines.append("  ".join(f"{cell:<{w}}" for cell, w in zip(r, widths)) + "  " + r[-1])
    if found.skipped:
        lines.append(
            f"({len(found.skipped)} shapes skipped: not legal for their family, or the family "
            "splits the backward and the costs file has no backward_input/backward_weight)"
        )
    return "\n".join(lines)
