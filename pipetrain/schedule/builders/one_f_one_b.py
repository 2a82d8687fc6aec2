"""1F1B (PipeDream-flush): warm-up forwards, then one forward / one backward, then cool-down.

Narayanan et al. 2019 (PipeDream-2BW / flush, Fig. 4); Megatron-LM's
``forward_backward_pipelining_without_interleaving`` with ``num_warmup = p − r − 1``.
Makespan (m + p − 1)(F + B); rank r holds at most min(p − r, m) activations.
"""

from __future__ import annotations

from pipetrain.schedule.builders.common import B, F, make_program, require_positive
from pipetrain.schedule.placement import one_per_rank
from pipetrain.schedule.program import Program


def build_1f1b(num_ranks: int, num_microbatches: int) -> Program:
    require_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    p, m = num_ranks, num_microbatches
    rows = []
    for rank in range(p):
        stage = rank
        num_warmup = min(p - 1 - rank, m)
        num_steady = m - num_warmup
        row = [F(stage, j) for j in range(num_warmup)]  # phase 1: warm-up
        for k in range(num_steady):  # phase 2: one forward, then the oldest backward
            row += [F(stage, num_warmup + k), B(stage, k)]
        row += [B(stage, j) for j in range(num_steady, m)]  # phase 3: cool-down
        rows.append(row)
    return make_program("1f1b", one_per_rank(p), m, rows)
