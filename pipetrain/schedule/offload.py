"""Activation offload as data: where a program copies saved activations to host memory and back.

PipeOffload (Wan et al. 2025, arXiv 2503.01328) observes that in a pipeline schedule a
micro-batch's activations sit idle on a stage between its forward and its backward, often for
many other actions, so they can travel to host memory over the copy engine and come back in time,
overlapped with compute. This module writes that decision into the program: ``OFFLOAD(s, j)``
right after the action that runs ``F(s, j)`` (its saved tensors are complete then), and
``RELOAD(s, j)`` ``lead`` compute actions before the action that runs its backward (``B`` or
``I``: ``W`` reads what ``I`` left on the device), so the copy back overlaps those actions.

A copy is issued at its position in the row and runs on the rank's copy engine, one queue per
direction (device to host, host to device), beside compute: it does not hold up the next action.
``RELOAD(s, j)`` needs ``OFFLOAD(s, j)`` done, and the backward of ``(s, j)`` needs
``RELOAD(s, j)`` done (the simulator's ``schedule.execute`` and the runtime's executor both wait
there). A micro-batch whose backward comes too soon after its forward for a copy to help — fewer
than ``lead + 1`` compute actions between them, e.g. every micro-batch of 1F1B's last stage — is
left on the device, as PipeOffload does.

``check_copies`` states what a program with copies must satisfy; ``validate`` calls it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedule.action import COPY_KINDS, Action, OpKind
from pipetrain.schedule.copy_engine import has_copies
from pipetrain.schedule.program import Program, ScheduleError

_BACKWARDS = (OpKind.B, OpKind.I)


def check_fractions(fractions: Sequence[float], num_stages: int) -> tuple[float, ...]:
    """Per-stage offload fractions as a tuple; ``ValueError`` names a bad value and the legal ones."""
    values = list(fractions)
    if len(values) != num_stages:
        raise ValueError(
            f"offload has {len(values)} fractions; give one per stage ({num_stages}), each in [0, 1]"
        )
    for stage, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise ValueError(
                f"offload fraction of stage {stage} must be a number in [0, 1] (the share of its "
                f"saved activation bytes moved to host memory), got {value!r}"
            )
    return tuple(float(v) for v in values)


def offloadable_stages(program: Program, lead: int = 1) -> frozenset[int]:
    """The stages with at least one micro-batch ``insert_offload`` would offload at ``lead``."""
    everything = (1.0,) * program.num_stages
    found: set[int] = set()
    for row in program.actions:
        found |= _row_with_copies(row, everything, lead)[1]
    return frozenset(found)


def insert_offload(program: Program, fractions: Sequence[float], lead: int = 1) -> Program:
    """``program`` with an OFFLOAD/RELOAD pair for every (stage, micro-batch) of a stage whose
    fraction is > 0 and whose activations wait long enough (module docstring).

    Raises ``ValueError`` for a fraction outside [0, 1], a bad ``lead``, a program that already
    has copies, or a stage with a fraction > 0 none of whose micro-batches can be offloaded.
    """
    fractions = check_fractions(fractions, program.num_stages)
    if isinstance(lead, bool) or not isinstance(lead, int) or lead < 0:
        raise ValueError(f"a reload's lead is a number of compute actions >= 0, got {lead!r}")
    if has_copies(program):
        raise ValueError("the program already has OFFLOAD/RELOAD actions; insert them once")
    rows: list[list[Action]] = []
    offloaded: set[int] = set()
    for row in program.actions:
        new_row, stages = _row_with_copies(row, fractions, lead)
        rows.append(new_row)
        offloaded |= stages
    idle = [s for s, f in enumerate(fractions) if f > 0 and s not in offloaded]
    if idle:
        raise ValueError(
            f"stage(s) {', '.join(map(str, idle))} have an offload fraction > 0 but no "
            f"micro-batch whose activations wait more than {lead} compute action(s) between "
            "forward and backward: nothing to offload there; set their fraction to 0"
        )
    return program.with_actions(rows)


def _row_with_copies(
    row: Sequence[Action], fractions: Sequence[float], lead: int
) -> tuple[list[Action], set[int]]:
    """One rank's row with its copies inserted, and the stages that got any."""
    compute = [i for i, a in enumerate(row) if a.is_compute]
    forward_at: dict[tuple[int, int], int] = {}  # (stage, mb) -> compute index of its F
    after: dict[int, list[Action]] = {}  # row index -> copies issued right after it
    before: dict[int, list[Action]] = {}  # row index -> copies issued right before it
    stages: set[int] = set()
    for k, i in enumerate(compute):
        for part in row[i].compute_parts:
            key = (part.stage, part.microbatch)
            if part.kind is OpKind.F and fractions[part.stage] > 0:
                forward_at[key] = k
            elif part.kind in _BACKWARDS and key in forward_at:
                f = forward_at.pop(key)
                issue = k - lead  # the compute index the reload is issued before
                if issue <= f + 1:
                    continue  # the backward follows too soon: keep these on the device
                after.setdefault(compute[f], []).append(Action(OpKind.OFFLOAD, *key))
                before.setdefault(compute[issue], []).append(Action(OpKind.RELOAD, *key))
                stages.add(part.stage)
    new_row: list[Action] = []
    for i, action in enumerate(row):
        new_row += before.get(i, ())
        new_row.append(action)
        new_row += after.get(i, ())
    return new_row, stages


def check_copies(program: Program) -> None:
    """Raise ``ScheduleError`` unless every OFFLOAD has exactly one RELOAD after it on its rank,
    every RELOAD follows its OFFLOAD, which follows the forward of its (stage, micro-batch), and
    every RELOAD precedes the backward (``B`` or ``I``) that reads what it brings back."""
    for rank, row in enumerate(program.actions):
        state: dict[tuple[int, int], OpKind] = {}  # (stage, mb) -> the last thing that happened
        for step, action in enumerate(row):
            if action.kind in COPY_KINDS:
                _check_copy(program, rank, step, action, state)
                continue
            for part in action.compute_parts if action.is_compute else ():
                key = (part.stage, part.microbatch)
                if part.kind is OpKind.F:
                    state[key] = OpKind.F
                elif part.kind in _BACKWARDS and state.get(key) is OpKind.OFFLOAD:
                    raise ScheduleError(
                        f"rank {rank} step {step}: {action} reads activations of stage "
                        f"{key[0]} micro-batch {key[1]} that were offloaded and not reloaded "
                        "before it",
                        program,
                        [(rank, step)],
                    )
                elif part.kind in _BACKWARDS:
                    state[key] = part.kind
        left = [key for key, kind in state.items() if kind is OpKind.OFFLOAD]
        if left:
            cells = [
                (rank, step)
                for step, a in enumerate(row)
                if a.kind is OpKind.OFFLOAD and (a.stage, a.microbatch) in left
            ]
            raise ScheduleError(
                f"rank {rank}: {len(left)} OFFLOAD(s) never reloaded (every OFFLOAD needs exactly "
                "one RELOAD before its backward)",
                program,
                cells,
            )


def _check_copy(
    program: Program,
    rank: int,
    step: int,
    action: Action,
    state: dict[tuple[int, int], OpKind],
) -> None:
    key = (action.stage, action.microbatch)
    now = state.get(key)
    wanted = OpKind.F if action.kind is OpKind.OFFLOAD else OpKind.OFFLOAD
    if now is not wanted:
        what = "its forward" if wanted is OpKind.F else "its OFFLOAD"
        seen = "nothing" if now is None else now.value
        raise ScheduleError(
            f"rank {rank} step {step}: {action} must come after {what} and before its backward, "
            f"once; the last action of stage {key[0]} micro-batch {key[1]} before it: {seen}",
            program,
            [(rank, step)],
        )
    state[key] = action.kind
