"""benchmarks/data/varlen_balance.py's bound: the step if every micro-batch cost the mean of its
step's, priced by the same simulator as the packings it bounds."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.data.varlen_balance import (
    Shape,
    bound_step_time,
    reached,
    replica_step_time,
)
from pipetrain.planner.varlen import StepPack
from pipetrain.schedule.registry import build_schedule

SHAPE = Shape(ranks=2, rows=1, seq_len=32768)


def pack_of(lengths: list[int]) -> StepPack:
    """One document a micro-batch (one row each), in order."""
    return StepPack(tuple(((i,),) for i in range(len(lengths))), ())


def test_equal_microbatches_are_their_own_bound() -> None:
    program = build_schedule("1f1b", SHAPE.ranks, SHAPE.microbatches)
    lengths = [20000] * SHAPE.microbatches
    pack = pack_of(lengths)
    assert bound_step_time(program, 1, pack, lengths, SHAPE) == replica_step_time(
        program, 1, pack, lengths, SHAPE
    )


def test_one_dear_microbatch_costs_more_than_the_mean_would() -> None:
    """A whole-row document among short ones stalls the pipeline behind it; spread evenly, the
    same attention work does not."""
    program = build_schedule("1f1b", SHAPE.ranks, SHAPE.microbatches)
    lengths = [32768] + [2000] * (SHAPE.microbatches - 1)
    pack = pack_of(lengths)
    fixed = replica_step_time(program, 1, pack, lengths, SHAPE)
    bound = bound_step_time(program, 1, pack, lengths, SHAPE)
    assert bound < fixed
    # the same total attention work: the bound's micro-batches are each the mean of these
    even = [round((sum(n * n for n in lengths) / len(lengths)) ** 0.5)] * len(lengths)
    assert abs(bound - replica_step_time(program, 1, pack_of(even), even, SHAPE)) < 1e-3 * bound


def test_the_share_of_the_bound_reached() -> None:
    assert reached(1.05, 1.10) == "50%"
    assert reached(1.0, 1.0005) == "-"  # nothing to reach
