"""``pipetrain compare``: every schedule family that accepts a shape, simulated on the same
work per rank, best first (a table, or a JSON list)."""

from __future__ import annotations

import argparse
import json
import textwrap

from pipetrain.cli.flags import (
    WIDTH,
    Command,
    Option,
    cost_options,
    costs_from,
    microbatches_option,
    ranks_option,
    stages_per_rank_option,
    width_of,
)
from pipetrain.schedule.program import plural
from pipetrain.sim.compare import compare, format_comparison
from pipetrain.sim.costs import Costs

OPTIONS = (
    ranks_option(required=True),
    microbatches_option(required=True),
    stages_per_rank_option(),
    *cost_options(per_rank=True),
    Option(("--json",), switch=True, help="print a JSON list instead of a table"),
    WIDTH,
)


def run(args: argparse.Namespace) -> int:
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


COMMAND = Command(
    name="compare",
    help="every schedule that accepts the shape, best first",
    options=lambda: OPTIONS,
    run=run,
)
