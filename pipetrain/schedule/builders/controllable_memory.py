"""V-Half and V-Min: V schedules with controllable memory (Qi et al., "Pipeline Parallelism with
Controllable Memory", NeurIPS 2024, arXiv 2405.15362).

The paper builds a schedule from a **building block** — where each pass of one micro-batch runs —
repeated every ``T`` (§3, Fig. 2): here the block of one micro-batch is four passes per rank, the
forwards and input-gradient backwards of its two V chunks (rank r holds chunk 0 = stage r and
chunk 1 = stage 2p − 1 − r), and with unit passes the block repeats every ``T = 6`` slots, the
work of one micro-batch on one rank (2 chunks × F, I, W). The weight-gradient passes W are not
placed by the block: they fill each rank's free slots, oldest first.

**Lifespan.** A stage's activation lives ``l`` slots, from its F to its W; in the steady state the
block repeats ``⌈l / T⌉``-ish times within that span, so a rank holds about the sum over its
stages of ``l / T`` micro-batches' activations (§3.1). 1F1B's block keeps rank 0's activation for
about 2p of its own stage times, the whole round trip, which is where its p comes from. The V
blocks shorten the lifespans by offsetting the passes so that the long lifespan of one chunk is
paired with the short one of the other (§4.1, Fig. 3), with these offsets (slots, rank r,
p ranks; Appendix, the reference implementation's stable patterns):

=======  ============  ================  =====================  ===================
block    F chunk 0     F chunk 1         I chunk 1              I chunk 0
=======  ============  ================  =====================  ===================
V-Min    r             2p − 1 − r        2p + g + r             4p − 1 + g − r
V-Half   2r            3p − 2 − r        3p − 1 + g + 2r        6p − 2 + g − r
=======  ============  ================  =====================  ===================

with a gap ``g`` (V-Min: 2 when p % 3 == 0, V-Half: 3 when p is even, else 0) that keeps the four
offsets distinct modulo T, so repeated blocks never collide. V-Min's lifespans are 4p + g − 2r
and 2r + g + 1 slots (about 4p per rank, a third of 1F1B's 12p in these half-stage slots); V-Half
runs its forwards two slots apart, giving 6p + g − 3r − 2 and 3r + g + 1 (about 6p, a half).
The published peaks, in micro-batches of a rank's share (two chunk-units each): V-Min
``⌊(p + 4) / 3⌋``, V-Half ``⌊(p + 2) / 2⌋``, against 1F1B's p. At F = I = W the bubble
(longest rank span − work) is about 4p chunk-slots for V-Min and 3p for V-Half against 1F1B's
6(p − 1): bubble rates ≈ 2p/3m and p/2m against p/m (Table 1 and the authors' summary table).

Building a program follows the paper's three steps (§3, Fig. 2):

1. **repeat** the block: micro-batch j's passes at ``offset + 6j``, then W into free slots;
2. **squeeze**: a rank runs its passes in slot order as soon as their inputs are ready (the
   simulator and the runtime both execute that way, so the order is all the program records);
3. **reorder** the warm-up and cool-down: each pass outside the steady state moves to the earliest
   free slot after its inputs where its rank stays within the block's peak memory; then, in the
   cool-down, the W are taken out, the F and I moved up the same way, and the W put back into
   the free slots (the reference implementation's two greedy passes, ``zbv_greedy``).

Any p >= 1 and m >= 1 build: no dependency crosses micro-batches, so a schedule with fewer
micro-batches than the block is deep simply never reaches its steady state (lower peak, larger
bubble).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.builders.common import F, I, W, make_program, require_positive
from pipetrain.schedule.placement import Placement, v_shape
from pipetrain.schedule.program import Program

#: slots between two repeats of the block: one micro-batch's work on one rank (2 × F, I, W)
INTERVAL = 6

Offsets = tuple[int, int, int, int]  # slots of F chunk 0, F chunk 1, I chunk 1, I chunk 0


def v_min_offsets(num_ranks: int, rank: int) -> Offsets:
    """V-Min's block on ``rank``: forwards one slot apart down and back up the V."""
    p, gap = num_ranks, 2 if num_ranks % 3 == 0 else 0
    return (rank, 2 * p - 1 - rank, 2 * p + gap + rank, 4 * p - 1 + gap - rank)


def v_half_offsets(num_ranks: int, rank: int) -> Offsets:
    """V-Half's block on ``rank``: chunk-0 forwards and chunk-1 backwards two slots apart."""
    p, gap = num_ranks, 3 if num_ranks % 2 == 0 else 0
    return (2 * rank, 3 * p - 2 - rank, 3 * p - 1 + gap + 2 * rank, 6 * p - 2 + gap - rank)


def build_v_min(num_ranks: int, num_microbatches: int) -> Program:
    """V-Min: a third of 1F1B's activation memory at about 2/3 of its bubble."""
    return _build("v-min", v_min_offsets, num_ranks, num_microbatches)


def build_v_half(num_ranks: int, num_microbatches: int) -> Program:
    """V-Half: half of 1F1B's activation memory at about half of its bubble."""
    return _build("v-half", v_half_offsets, num_ranks, num_microbatches)


def _build(
    name: str, offsets: Callable[[int, int], Offsets], num_ranks: int, num_microbatches: int
) -> Program:
    require_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    p, m = num_ranks, num_microbatches
    placement = v_shape(p)
    ranks = [_Rank(placement.stages_of_rank(r)) for r in range(p)]
    for rank, row in enumerate(ranks):  # step 1: repeat the block, W into the free slots
        row.place_block(offsets(p, rank), m)
        row.fill_weight_grads()
    cap = max(row.peak() for row in ranks)
    steady_start = ranks[0].slot[I(0, 0)]  # the first micro-batch has come back to stage 0
    steady_end = ranks[0].slot[F(0, m - 1)]  # the last micro-batch enters the pipeline
    slot_of = _SlotIndex(placement, ranks)
    # step 3a: warm-up and cool-down passes, W included, to the earliest slot within the peak
    for action in slot_of.in_slot_order():
        if not steady_start <= slot_of[action] <= steady_end:
            slot_of.move_up(action, cap)
    # step 3b: the cool-down again with its W taken out and put back into the free slots
    for row in ranks:
        row.drop_weight_grads(after=steady_end)
    for action in slot_of.in_slot_order():
        if slot_of[action] > steady_end:
            slot_of.move_up(action, cap, refill_after=steady_end)
    for row in ranks:
        row.fill_weight_grads(after=steady_end)
    # step 2, squeezing, is what executing each rank's passes in slot order does
    rows = [[row.at[t] for t in sorted(row.at)] for row in ranks]
    return make_program(name, placement, m, rows)


class _Rank:
    """One rank's passes by slot (``at``: slot → action, ``slot``: action → slot)."""

    def __init__(self, stages: tuple[int, ...]) -> None:
        self.chunk0, self.chunk1 = stages
        self.at: dict[int, Action] = {}
        self.slot: dict[Action, int] = {}

    def put(self, action: Action, slot: int) -> None:
        self.at[slot] = action
        self.slot[action] = slot

    def take(self, action: Action) -> int:
        slot = self.slot.pop(action)
        del self.at[slot]
        return slot

    def place_block(self, offsets: Offsets, num_microbatches: int) -> None:
        f0, f1, i1, i0 = offsets
        assert len({o % INTERVAL for o in offsets}) == 4, offsets  # repeats never collide
        for j in range(num_microbatches):
            start = INTERVAL * j
            self.put(F(self.chunk0, j), f0 + start)
            self.put(F(self.chunk1, j), f1 + start)
            self.put(I(self.chunk1, j), i1 + start)
            self.put(I(self.chunk0, j), i0 + start)

    def drop_weight_grads(self, after: int) -> None:
        for action in [a for a, t in self.slot.items() if t > after and a.kind is OpKind.W]:
            self.take(action)

    def fill_weight_grads(self, after: int = -1) -> None:
        """Each free slot after ``after`` runs the W of the oldest I still waiting for it."""
        for slot, action in _with_weight_grads(self.at, after):
            if action.kind is OpKind.W:
                self.put(action, slot)

    def peak(self, refill_after: int | None = None) -> int:
        """Peak activations (chunk-units): held from an F's slot to the end of its W's slot; with
        ``refill_after``, the W after that slot are first placed as ``fill_weight_grads`` would."""
        timeline = (
            sorted(self.at.items())
            if refill_after is None
            else _with_weight_grads(self.at, refill_after)
        )
        held = peak = 0
        for _, action in timeline:  # one pass per slot: a W's free comes before the next F
            if action.kind is OpKind.F:
                held += 1
                peak = max(peak, held)
            elif action.kind is OpKind.W:
                held -= 1
        return peak


def _with_weight_grads(at: dict[int, Action], after: int) -> Iterable[tuple[int, Action]]:
    """``at``'s passes in slot order with, in each free slot after ``after``, the W of the oldest
    I whose W is not placed yet (the passes' own W up to ``after`` stay where they are)."""
    placed = {(a.stage, a.microbatch) for a in at.values() if a.kind is OpKind.W}
    waiting: deque[Action] = deque()
    last = max(at)
    slot = 0
    for slot in range(last + 1):
        action = at.get(slot)
        if action is not None:
            if action.kind is OpKind.I and (action.stage, action.microbatch) not in placed:
                waiting.append(W(action.stage, action.microbatch))
            yield slot, action
        elif slot > after and waiting:
            yield slot, waiting.popleft()
    for slot, action in enumerate(waiting, start=last + 1):
        yield slot, action


class _SlotIndex:
    """Every rank's slots, for moving passes up to the earliest slot their inputs allow."""

    def __init__(self, placement: Placement, ranks: list[_Rank]) -> None:
        self.placement = placement
        self.ranks = ranks

    def __getitem__(self, action: Action) -> int:
        return self.ranks[self.placement.rank(action.stage)].slot[action]

    def in_slot_order(self) -> list[Action]:
        every = [(t, r, a) for r, row in enumerate(self.ranks) for a, t in row.slot.items()]
        return [a for _, _, a in sorted(every, key=lambda e: (e[0], e[1]))]

    def ready(self, action: Action) -> int:
        """The first slot after every pass ``action`` needs (same-kind passes keep their order)."""
        last_stage = self.placement.num_stages - 1
        stage, j = action.stage, action.microbatch
        needs = []
        if action.kind is OpKind.W:
            needs.append(I(stage, j))
        elif action.kind is OpKind.F and stage > 0:
            needs.append(F(stage - 1, j))
        elif action.kind is OpKind.I:
            needs.append(I(stage + 1, j) if stage < last_stage else F(stage, j))
        if j > 0:
            needs.append(Action(action.kind, stage, j - 1))
        return max((self[n] + 1 for n in needs), default=0)

    def move_up(self, action: Action, cap: int, refill_after: int | None = None) -> None:
        """Move ``action`` to the earliest free slot before its own, after its inputs, where its
        rank's peak stays within ``cap``; leave it where it is if there is none."""
        row = self.ranks[self.placement.rank(action.stage)]
        start = self.ready(action)
        current = row.take(action)
        for slot in range(start, current):
            if slot in row.at:
                continue
            row.put(action, slot)
            if row.peak(refill_after) <= cap:
                return
            row.take(action)
        row.put(action, current)
