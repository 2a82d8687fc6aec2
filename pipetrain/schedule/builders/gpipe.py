"""GPipe: every forward, then every backward (Huang et al. 2019, "GPipe", Fig. 2c).

Bubble (p − 1)(F + B); every rank holds all m activations at the turn.
"""

from __future__ import annotations

from pipetrain.schedule.builders.common import B, F, make_program, require_positive
from pipetrain.schedule.placement import one_per_rank
from pipetrain.schedule.program import Program


def build_gpipe(num_ranks: int, num_microbatches: int) -> Program:
    require_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    m = num_microbatches
    rows = []
    for rank in range(num_ranks):
        stage = rank
        phase_1_forward = [F(stage, j) for j in range(m)]
        phase_2_backward = [B(stage, j) for j in range(m)]  # same order as torch's ScheduleGPipe
        rows.append(phase_1_forward + phase_2_backward)
    return make_program("gpipe", one_per_rank(num_ranks), m, rows)
