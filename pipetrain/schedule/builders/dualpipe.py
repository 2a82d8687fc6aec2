"""DualPipe: two copies of the model fed from both ends of the pipeline (DeepSeek-V3 §3.2.1).

DeepSeek-V3 technical report (arXiv 2412.19437) §3.2.1, Fig. 5; deepseek-ai/DualPipe
``dualpipe.py``. The placement has two chains over the same p ranks: the *down* chain puts its
stage k on rank k and takes micro-batches 0 … m/2 − 1; the *up* chain puts its stage k (pipetrain
stage p + k) on rank p − 1 − k and takes micro-batches m/2 … m − 1. Each rank therefore holds two
stages, one of each copy, and every rank's parameters exist twice (the price DualPipeV removes).

DualPipe's own code runs, on rank r with h = min(r, p − 1 − r), exactly the eight steps of
DualPipeV on p/2 ranks with m/2 micro-batches, V-rank h — "phase 0" being the chain whose
micro-batches enter at this rank's end of the pipeline and "phase 1" the other one. So this
builder takes DualPipeV's row for V-rank h and renames its two chunks:

* rank r < p/2: chunk 0 (V-stage h) is down-chain stage h; chunk 1 (V-stage p − 1 − h) is up-chain
  position p − 1 − h, i.e. stage 2p − 1 − h, on micro-batches offset by m/2;
* rank r ≥ p/2: chunk 0 is up-chain position h (stage p + h, micro-batches offset by m/2); chunk 1
  is down-chain stage p − 1 − h.

Constraints as DualPipe's: p even, m even, m >= 2p. Bubble (p/2 − 1)(FB + B − 3W); peak
activations p + 1 chunk-units on every rank (docs/schedules.md).
"""

from __future__ import annotations

from pipetrain.schedule.action import Action, overlap
from pipetrain.schedule.builders.common import make_program, require_positive
from pipetrain.schedule.builders.dualpipev import dualpipev_row
from pipetrain.schedule.placement import bidirectional
from pipetrain.schedule.program import Program


def build_dualpipe(num_ranks: int, num_microbatches: int) -> Program:
    require_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    p, m = num_ranks, num_microbatches
    if p % 2 or m % 2 or m < 2 * p:
        raise ValueError(
            f"dualpipe needs an even num_ranks, an even num_microbatches and num_microbatches >= "
            f"2 x num_ranks; got {p} ranks and {m} micro-batches (legal with {p + p % 2} ranks: "
            f"even num_microbatches >= {2 * (p + p % 2)})"
        )
    half_ranks, half_m = p // 2, m // 2
    rows = []
    for rank in range(p):
        h = min(rank, p - 1 - rank)
        near, far = h, p - 1 - h  # the V-rank's two chunks, as DualPipeV names its stages
        if rank < half_ranks:
            rename = {near: (h, 0), far: (2 * p - 1 - h, half_m)}
        else:
            rename = {near: (p + h, half_m), far: (p - 1 - h, 0)}
        row = dualpipev_row(half_ranks, half_m, h, (near, far))
        rows.append([_renamed(a, rename) for a in row])
    return make_program("dualpipe", bidirectional(p), m, rows)


def _renamed(action: Action, rename: dict[int, tuple[int, int]]) -> Action:
    if action.parts:
        forward, backward = (_renamed(part, rename) for part in action.parts)
        return overlap(forward, backward)
    stage, offset = rename[action.stage]
    return Action(action.kind, stage, action.microbatch + offset)
