"""DualPipeV: DualPipe cut in half, on a V placement with overlapped forward & backward pairs.

DeepSeek-V3 technical report (arXiv 2412.19437) §3.2.1 and Fig. 5 describe DualPipe; the V
("cut-in-half") variant is deepseek-ai/DualPipe's ``dualpipev.py`` (after Sea AI Lab), which
torch.distributed.pipelining's ``ScheduleDualPipeV`` follows. Rank r holds chunk 0 = stage r and
chunk 1 = stage 2p − 1 − r. Its eight steps, named as DualPipe names them:

1. nF0: (p − r − 1)·2 forwards of chunk 0;
2. nF0F1: (r + 1) × (F0, F1);
3. nB1W1F1: (p − r − 1) × (I1, W1, F1): zero bubble, each W right after its I;
4. nF0B1F1B0 (main): (m − 2p + r + 1) × [(F0 ; B1), (F1 ; B0)] overlapped pairs; on the last rank
   the very first (F0, B1) runs as two actions, which shortens the bubble;
5. nB1F1B0: (p − r − 1) × [B1, (F1 ; B0)];
6. nB1B0: (r + 1) × (B1, B0), the second half as I with W deferred to a FIFO queue (the switch
   happens at i = (r + 1) // 2, before B1 on odd ranks and between B1 and B0 on even ones);
7. nWB0: (p − r − 1) × (W oldest deferred, B0 — I0 once zero bubble is on);
8. nW: the remaining deferred W, oldest first.

Every chunk runs its forwards and its backwards in increasing micro-batch order (one counter per
chunk and kind, as DualPipe keeps). A backward in an overlapped pair is a full B. Step 4 needs
m >= 2p on rank 0, so smaller m are refused. Peak activations: 2p + 1 chunk-units per rank (an
overlapped pair holds its forward's activation while its backward's is still alive).
"""

from __future__ import annotations

from collections import deque

from pipetrain.schedule.action import Action, overlap
from pipetrain.schedule.builders.common import B, F, I, W, make_program, require_positive
from pipetrain.schedule.placement import v_shape
from pipetrain.schedule.program import Program


class _Row:
    """One rank's actions: per-chunk forward and backward counters and the deferred-W queue."""

    def __init__(self, stages: tuple[int, ...]) -> None:
        self.stages = stages
        self.next_forward = [0, 0]
        self.next_backward = [0, 0]
        self.deferred_w: deque[Action] = deque()
        self.actions: list[Action] = []

    def forward(self, chunk: int) -> Action:
        action = F(self.stages[chunk], self.next_forward[chunk])
        self.next_forward[chunk] += 1
        return action

    def backward(self, chunk: int, *, split: bool = False) -> Action:
        """The next backward of ``chunk``: a full B, or with ``split`` an I whose W is deferred."""
        stage, microbatch = self.stages[chunk], self.next_backward[chunk]
        self.next_backward[chunk] += 1
        if not split:
            return B(stage, microbatch)
        self.deferred_w.append(W(stage, microbatch))
        return I(stage, microbatch)

    def add(self, *actions: Action) -> None:
        self.actions.extend(actions)

    def add_pair(self, forward_chunk: int, backward_chunk: int) -> None:
        self.add(overlap(self.forward(forward_chunk), self.backward(backward_chunk)))

    def add_deferred_w(self) -> None:
        if self.deferred_w:
            self.add(self.deferred_w.popleft())


def build_dualpipev(num_ranks: int, num_microbatches: int) -> Program:
    require_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    p, m = num_ranks, num_microbatches
    if m < 2 * p:
        raise ValueError(
            f"dualpipev needs num_microbatches >= 2 x num_ranks = {2 * p}, got {m} "
            f"(legal with {p} ranks: any num_microbatches >= {2 * p})"
        )
    placement = v_shape(p)
    rows = [dualpipev_row(p, m, rank, placement.stages_of_rank(rank)) for rank in range(p)]
    return make_program("dualpipev", placement, m, rows)


def dualpipev_row(p: int, m: int, rank: int, stages: tuple[int, ...]) -> list[Action]:
    row = _Row(stages)
    step_1 = (p - rank - 1) * 2  # nF0
    step_2 = rank + 1  # nF0F1
    step_3 = p - rank - 1  # nB1W1F1
    step_4 = m - 2 * p + rank + 1  # nF0B1F1B0
    step_5 = p - rank - 1  # nB1F1B0
    step_6 = rank + 1  # nB1B0
    step_7 = p - rank - 1  # nWB0

    for _ in range(step_1):
        row.add(row.forward(0))
    for _ in range(step_2):
        row.add(row.forward(0), row.forward(1))
    for _ in range(step_3):
        row.add(row.backward(1, split=True))
        row.add_deferred_w()  # the W of the I just queued: the queue was empty
        row.add(row.forward(1))
    for i in range(step_4):
        if i == 0 and rank == p - 1:  # not overlapped: the last rank turns the V here
            row.add(row.forward(0), row.backward(1))
        else:
            row.add_pair(0, 1)
        row.add_pair(1, 0)
    for _ in range(step_5):
        row.add(row.backward(1))
        row.add_pair(1, 0)
    split = False
    for i in range(step_6):
        split = split or (i == step_6 // 2 and rank % 2 == 1)
        row.add(row.backward(1, split=split))
        split = split or (i == step_6 // 2 and rank % 2 == 0)
        row.add(row.backward(0, split=split))
    for _ in range(step_7):
        row.add_deferred_w()
        row.add(row.backward(0, split=split))
    while row.deferred_w:  # step 8: nW
        row.add_deferred_w()
    assert row.next_forward == row.next_backward == [m, m], (
        rank,
        row.next_forward,
        row.next_backward,
    )
    return row.actions
