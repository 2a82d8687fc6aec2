"""Zero-bubble ZB-H1 and ZB-H2: the backward split into I and W, with W deferred into the bubbles.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024, arXiv 2401.10241): ZB-H1 is §2.1 and
Fig. 3, ZB-H2 is §2.2 and Fig. 4; their bubbles are Table 2. The input gradient ``I`` is on the
critical path and goes upstream at once; the weight gradient ``W`` is not, so each rank runs it a
fixed number of micro-batches late, where 1F1B would idle. One stage per rank; rank r runs:

1. warm-up: ``num_warmup`` forwards;
2. ``num_lagged`` × (I, F): W deferred, which opens the lag;
3. (I, W, F) while forwards remain: W of micro-batch j − num_lagged after I of j;
4. (I, W) while input gradients remain;
5. the ``num_lagged`` deferred W, oldest first.

ZB-H1 keeps 1F1B's memory (warm-up p − r, lag r, p activations on every rank) and has bubble
(p − 1)(F + I − W). ZB-H2 warms up longer (2p − 1 − 2r, lag 2r, 2p − 1 activations) and has bubble
(p − 1)(F + I − 2W): none at F = I = W in steady state.

Fewer micro-batches than the warm-up wants: the warm-up takes all m (phase 2 is then empty, so no W
is deferred), and the lag is capped by the forwards left after the warm-up. Phase 4 always drains
exactly the warm-up's micro-batches, so every count stays >= 0 and every (stage, micro-batch) gets
one F, one I and one W for any m >= 1. With m < p ZB-H1 takes (m + p − 1)(F + I) + W.
"""

from __future__ import annotations

from pipetrain.schedule.action import Action
from pipetrain.schedule.builders.common import F, I, W, make_program, require_positive
from pipetrain.schedule.placement import one_per_rank
from pipetrain.schedule.program import Program


def build_zb_h1(num_ranks: int, num_microbatches: int) -> Program:
    """ZB-H1 (Fig. 3): warm-up min(p − r, m) forwards, W lagged by r micro-batches."""
    require_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    p, m = num_ranks, num_microbatches
    rows = [_zero_bubble_row(r, m, num_warmup=min(p - r, m), lag=r) for r in range(p)]
    return make_program("zb-h1", one_per_rank(p), m, rows)


def build_zb_h2(num_ranks: int, num_microbatches: int) -> Program:
    """ZB-H2 (Fig. 4): warm-up min(2p − 1 − 2r, m) forwards, W lagged by 2r micro-batches."""
    require_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    p, m = num_ranks, num_microbatches
    rows = [
        _zero_bubble_row(r, m, num_warmup=min(2 * p - 1 - 2 * r, m), lag=2 * r) for r in range(p)
    ]
    return make_program("zb-h2", one_per_rank(p), m, rows)


def _zero_bubble_row(stage: int, m: int, *, num_warmup: int, lag: int) -> list[Action]:
    """The five phases of one rank; ``lag`` is how many W the rank defers once it is warm."""
    num_lagged = min(lag, m - num_warmup)  # (I, F) pairs: as many as there are forwards left
    num_steady = m - num_warmup - num_lagged  # (I, W, F) triples: the remaining forwards
    num_drain = num_warmup  # (I, W) pairs: input gradients left once every forward ran

    next_f, next_i, next_w = 0, 0, 0
    row: list[Action] = []

    def forward() -> None:
        nonlocal next_f
        row.append(F(stage, next_f))
        next_f += 1

    def input_grad() -> None:
        nonlocal next_i
        row.append(I(stage, next_i))
        next_i += 1

    def weight_grad() -> None:
        nonlocal next_w
        row.append(W(stage, next_w))
        next_w += 1

    for _ in range(num_warmup):  # phase 1: warm-up
        forward()
    for _ in range(num_lagged):  # phase 2: open the W lag
        input_grad()
        forward()
    for _ in range(num_steady):  # phase 3: steady state
        input_grad()
        weight_grad()
        forward()
    for _ in range(num_drain):  # phase 4: drain input gradients
        input_grad()
        weight_grad()
    for _ in range(num_lagged):  # phase 5: the deferred W
        weight_grad()
    assert next_f == next_i == next_w == m, (stage, next_f, next_i, next_w, m)
    return row
