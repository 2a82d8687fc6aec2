"""``pipetrain show``: a schedule's program grid, cut into bands that fit the terminal."""

from __future__ import annotations

import argparse

from pipetrain.cli.flags import (
    GROUP_SIZE,
    PROG,
    WIDTH,
    Command,
    Option,
    UsageError,
    microbatches_option,
    ranks_option,
    schedule_options,
    stages_per_rank_option,
    width_of,
)
from pipetrain.schedule.lower import lower
from pipetrain.schedule.program import Program, format_grid, plural
from pipetrain.schedule.registry import FAMILIES, build_schedule
from pipetrain.schedule.validate import validate

#: at most this many bands of a long program are drawn
MAX_BANDS = 6

OPTIONS = (
    *schedule_options(),
    ranks_option(required=True),
    microbatches_option(required=True),
    stages_per_rank_option(),
    GROUP_SIZE,
    Option(("--lowered",), switch=True, help="include the SEND/RECV actions lowering adds"),
    Option(
        ("--save",),
        metavar="FILE",
        help="also write the program (.json, else torch-compatible CSV)",
    ),
    WIDTH,
)


def run(args: argparse.Namespace) -> int:
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


COMMAND = Command(
    name="show", help="print a schedule's program grid", options=lambda: OPTIONS, run=run
)
