"""V-Half and V-Min: V schedules with controllable memory (Qi, Wan, Amar, Lin, "Pipeline
Parallelism with Controllable Memory", NeurIPS 2024, arXiv 2405.15362).

The paper builds a schedule in four steps — building block, repeating, squeezing, reordering —
and designs V-shaped building blocks whose memory it controls (its Fig. 4 draws the full V-Min,
V-Half and V-ZB schedules). The **building block** is where each pass of one micro-batch runs.
Here it is four passes per rank: the forward and the input-gradient backward (I) of each of the
rank's two V chunks (rank r holds chunk 0 = stage r and chunk 1 = stage 2p − 1 − r). With unit
passes it **repeats** every ``INTERVAL = 6`` slots, one micro-batch's work on one rank
(2 chunks × F, I, W); the weight-gradient passes W are not part of the block and fill each rank's
free slots, oldest I first. The offsets (slots, rank r, p ranks), as the authors' reference
implementation (sail-sg/zero-bubble-pipeline-parallelism) lays out its stable patterns:

=======  ============  ================  =====================  ===================
block    F chunk 0     F chunk 1         I chunk 1              I chunk 0
=======  ============  ================  =====================  ===================
V-Min    r             2p − 1 − r        2p + g + r             4p − 1 + g − r
V-Half   2r            3p − 2 − r        3p − 1 + g + 2r        6p − 2 + g − r
=======  ============  ================  =====================  ===================

with a gap ``g`` (V-Min: 2 when p % 3 == 0; V-Half: 3 when p is even; else 0) that keeps a rank's
four offsets distinct modulo 6, so that repeated blocks never collide.

**Lifespan.** A stage's activation lives from its F to its W; a block repeated every T holds about
``lifespan / T`` micro-batches of it at once, so a rank's peak is set by the sum of its stages'
lifespans (weighted by activation size). 1F1B's block keeps rank 0's activation — two chunk-units,
a whole rank's share — for the round trip down and back, about 6p slots: 12p unit-slots, peak p
shares. V-Min's chunk-0 and chunk-1 lifespans (F to I) on rank r are 4p − 1 + g − 2r and 2r + 1 + g,
a total of 4p + 2g on every rank: a third of 1F1B's, and balanced. V-Half spaces its chunk-0
forwards and chunk-1 backwards two slots apart: 6p − 2 + g − 3r and 3r + 1 + g, total 6p − 1 + 2g,
a half. The authors' summary table states the peaks as ``⌊(p + 4)/3⌋`` (V-Min) and
``⌊(p + 2)/2⌋`` (V-Half) micro-batches of a rank's share against 1F1B's p, and the bubble rates at
F = I = W as about 2p/3m and p/2m against p/m; here that is 2⌊(p + 4)/3⌋ and 2⌊(p + 2)/2⌋
chunk-units, and a bubble (longest rank span − 6m) within 2/3 and 1/2 of 1F1B's 6(p − 1) (the
tests check both by simulation).

Building a program follows the four steps:

1. **repeat** the block: micro-batch j's passes at ``offset + 6j``, then W into free slots;
2. **squeeze**: a rank runs its passes in slot order as soon as their inputs are ready (the
   simulator and the runtime both execute that way, so the order is all the program records);
3. **reorder** the warm-up and cool-down, where memory is below the steady state's peak: each
   pass outside the steady state moves to the earliest free slot after its inputs where its rank
   stays within the block's peak; then, in the cool-down, the W are taken out, the F and I moved
   up the same way, and the W put back into the free slots (as the reference implementation's
   two greedy passes do).

Any p >= 1 and m >= 1 build: no dependency crosses micro-batches, so a schedule with fewer
micro-batches than the block is deep simply never reaches its steady state (lower peak, larger
bubble).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import accumulate

from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.builders.common import F, I, W, make_program, require_positive
from pipetrain.schedule.placement import Placement, v_shape
from pipetrain.schedule.program import Program

# module constants: reading a member off the enum class is slow, and these loops run ~10^6 times
_F, _I, _W = OpKind.F, OpKind.I, OpKind.W

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
        row.fill_weight_grads(after=-1)
    cap = max(max(row.held_per_slot()) for row in ranks)
    steady_start = ranks[0].slot[I(0, 0)]  # the first micro-batch has come back to stage 0
    steady_end = ranks[0].slot[F(0, m - 1)]  # the last micro-batch enters the pipeline
    slots = _Slots(placement, ranks)
    _reorder_ramps(slots, cap, steady_start, steady_end)  # step 3
    _reorder_cool_down(slots, cap, steady_end)
    # step 2, squeezing, is what executing each rank's passes in slot order does
    rows = [[row.at[t] for t in sorted(row.at)] for row in ranks]
    return make_program(name, placement, m, rows)


def _reorder_ramps(slots: _Slots, cap: int, steady_start: int, steady_end: int) -> None:
    """Warm-up and cool-down passes, W included, to the earliest slot within the peak ``cap``."""
    held = [row.held_per_slot() for row in slots.ranks]
    for action in slots.in_slot_order(lambda t: not steady_start <= t <= steady_end):
        slots.move_up(action, lambda rank, a, to, now: _fits(held[rank], a, to, now, cap))


def _reorder_cool_down(slots: _Slots, cap: int, steady_end: int) -> None:
    """The cool-down again: its W taken out, its F and I moved up within ``cap`` (the W going
    into the free slots behind them), then the W put back into the free slots."""
    ranks = slots.ranks
    for row in ranks:
        row.drop_weight_grads(after=steady_end)
    start = []  # per rank: last slot, activations held and W waiting after the steady state
    for row in ranks:
        held_after, waiting = row.state_after(steady_end)
        start.append((max(row.at), held_after, len(waiting)))
    for action in slots.in_slot_order(lambda t: t > steady_end):
        slots.move_up(
            action,
            lambda rank, *_: ranks[rank].fits_after(steady_end, *start[rank], cap),
            earliest=steady_end + 1,
        )
    for row in ranks:
        row.fill_weight_grads(after=steady_end)


def _fits(held: list[int], action: Action, to: int, now: int, cap: int) -> bool:
    """Whether moving ``action`` from slot ``now`` up to ``to`` keeps ``held`` (activations held
    per slot) within ``cap``; if so, ``held`` is updated. Only an F moved up holds more."""
    if action.kind is _F:
        if max(held[to:now]) + 1 > cap:
            return False
        for t in range(to, now):
            held[t] += 1
    elif action.kind is _W:  # freed sooner
        for t in range(to + 1, now + 1):
            held[t] -= 1
    return True


class _Rank:
    """One rank's passes by slot (``at``: slot → action, ``slot``: action → slot)."""

    def __init__(self, stages: tuple[int, ...]) -> None:
        self.chunk0, self.chunk1 = stages
        self.at: dict[int, Action] = {}
        self.slot: dict[Action, int] = {}
        # ``fits_after``'s last walk: its arguments, the (held, waiting) before each slot it
        # passed from ``after + 1`` on, its answer, and the first and last slot changed since
        self.walk: tuple[int, int, int, int, int] | None = None
        self.states: list[tuple[int, int]] = []
        self.answer = True
        self.changed = (0, -1)

    def put(self, action: Action, slot: int) -> None:
        self.at[slot] = action
        self.slot[action] = slot
        if self.walk is not None:
            self.changed = (min(self.changed[0], slot), max(self.changed[1], slot))

    def take(self, action: Action) -> int:
        slot = self.slot.pop(action)
        del self.at[slot]
        if self.walk is not None:
            self.changed = (min(self.changed[0], slot), max(self.changed[1], slot))
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

    def held_per_slot(self) -> list[int]:
        """Activations (chunk-units) held while each slot runs: an F's from its slot on, until
        the end of its W's slot. The list runs one slot past the last pass."""
        held = [0] * (max(self.at) + 2)
        for slot, action in self.at.items():
            if action.kind is _F:
                held[slot] += 1
            elif action.kind is _W:
                held[slot + 1] -= 1
        return list(accumulate(held))

    def drop_weight_grads(self, after: int) -> None:
        for action in [a for a, t in self.slot.items() if t > after and a.kind is _W]:
            self.take(action)

    def state_after(self, slot: int) -> tuple[int, list[Action]]:
        """Activations held after ``slot`` and the W still to place there, oldest I first."""
        held = 0
        waiting: list[Action] = []
        placed = set()
        for t in range(slot + 1):
            action = self.at.get(t)
            if action is None:
                continue
            if action.kind is _F:
                held += 1
            elif action.kind is _I:
                waiting.append(action)
            else:
                held -= 1
                placed.add((action.stage, action.microbatch))
        return held, [
            W(a.stage, a.microbatch) for a in waiting if (a.stage, a.microbatch) not in placed
        ]

    def with_weight_grads(
        self, after: int, waiting: Iterable[Action] = ()
    ) -> Iterator[tuple[int, Action]]:
        """The passes after slot ``after`` in slot order, with the W of ``waiting`` and of each
        I here, oldest first, in the free slots (and after the last pass)."""
        queue = deque(waiting)
        last = max(self.at)
        for slot in range(after + 1, last + 1):
            action = self.at.get(slot)
            if action is None:
                if queue:
                    yield slot, queue.popleft()
                continue
            if action.kind is _I:
                queue.append(W(action.stage, action.microbatch))
            yield slot, action
        yield from enumerate(queue, start=last + 1)

    def fill_weight_grads(self, after: int) -> None:
        """Put the W of every I after slot ``after`` (and of those waiting at it) into free slots."""
        _, waiting = self.state_after(after)
        for slot, action in list(self.with_weight_grads(after, waiting)):
            if action.kind is _W:
                self.put(action, slot)

    def fits_after(self, after: int, end: int, held: int, waiting: int, cap: int) -> bool:
        """Whether the activations held from slot ``after`` to ``end`` (at least the last pass)
        stay within ``cap`` with the W placed as ``fill_weight_grads`` would, from ``held`` held
        and ``waiting`` W unplaced after ``after``.

        The cool-down asks this for every slot it tries, each try changing a slot or two, so a
        walk starts from the last state before the first slot changed since the previous walk,
        and once past the last changed slot, where its state equals the previous walk's, the
        rest is the previous walk's: the same answer, without walking the unchanged slots."""
        args = (after, end, held, waiting, cap)
        if self.walk != args:
            self.walk, self.states, self.changed = args, [(held, waiting)], (after + 1, end + 1)
        low, high = self.changed
        if low > high:
            return self.answer  # nothing changed since the last walk
        self.changed = (end + 1, after)
        states, answer = self.states, self.answer
        index = min(max(low - after - 1, 0), len(states) - 1)  # the state before a changed slot
        held, waiting = states[index]
        for slot, action in enumerate(
            map(self.at.get, range(after + 1 + index, end + 1)), start=after + 1 + index
        ):
            if action is None:
                if waiting:  # a W: freed before the next slot's F
                    waiting -= 1
                    held -= 1
            elif action.kind is _F:
                held += 1
                if held > cap:
                    del states[slot - after :]  # the states up to before this slot hold
                    self.answer = False
                    return False
            elif action.kind is _I:
                waiting += 1
            index = slot - after  # the state before the next slot
            if index < len(states):
                if slot >= high and states[index] == (held, waiting):
                    return answer  # the previous walk from here on, over the same slots
                states[index] = (held, waiting)
            else:
                states.append((held, waiting))
        self.answer = True
        return True


class _Slots:
    """Every rank's slots, for moving passes up to the earliest slot their inputs allow."""

    def __init__(self, placement: Placement, ranks: list[_Rank]) -> None:
        self.placement = placement
        self.ranks = ranks

    def __getitem__(self, action: Action) -> int:
        return self.ranks[self.placement.rank(action.stage)].slot[action]

    def in_slot_order(self, keep: Callable[[int], bool]) -> list[Action]:
        """The passes whose slot ``keep`` accepts, by slot, then rank."""
        kept = [
            (t, r, a) for r, row in enumerate(self.ranks) for a, t in row.slot.items() if keep(t)
        ]
        return [a for _, _, a in sorted(kept, key=lambda e: (e[0], e[1]))]

    def ready(self, action: Action) -> int:
        """The first slot after every pass ``action`` needs (same-kind passes keep their order)."""
        kind, stage, j = action.kind, action.stage, action.microbatch
        rank_of, ranks = self.placement.rank_of_stage, self.ranks
        first = -1
        if kind is _W:
            first = ranks[rank_of[stage]].slot[I(stage, j)]
        elif kind is _F and stage > 0:
            first = ranks[rank_of[stage - 1]].slot[F(stage - 1, j)]
        elif kind is _I:
            need = I(stage + 1, j) if stage < len(rank_of) - 1 else F(stage, j)
            first = ranks[rank_of[need.stage]].slot[need]
        if j > 0:
            first = max(first, ranks[rank_of[stage]].slot[Action(kind, stage, j - 1)])
        return first + 1

    def move_up(
        self,
        action: Action,
        fits: Callable[[int, Action, int, int], bool],
        earliest: int = 0,
    ) -> None:
        """Move ``action`` to the earliest free slot from ``earliest`` on, after its inputs and
        before its own, where ``fits(rank, action, slot, own slot)`` (the memory check) holds."""
        rank = self.placement.rank(action.stage)
        row = self.ranks[rank]
        current = row.take(action)
        for slot in range(max(self.ready(action), earliest), current):
            if slot in row.at:
                continue
            row.put(action, slot)
            if fits(rank, action, slot, current):
                return
            row.take(action)
        row.put(action, current)
