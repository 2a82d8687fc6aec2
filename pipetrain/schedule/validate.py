"""Validation: is a program complete, placed right, paired and runnable?

``validate`` checks, in order, and raises ``ScheduleError`` (grid drawn, bad cells marked) at the
first failure:

1. every action's stage and micro-batch exist and the stage lives on the action's rank;
2. each (stage, micro-batch) has exactly one ``F`` and either one ``B`` or one ``I`` and one ``W``;
3. for a lowered program, every cross-rank value travels exactly once (one SEND on the producer's
   rank, one RECV on the consumer's) and nothing else is sent;
4. execution completes. A compute-only program runs on dependencies alone. A lowered program runs
   with *blocking batched* P2P: a run of consecutive SEND/RECV actions on a rank is posted at once,
   and the rank waits until each of them has its counterpart posted — what ``batch_isend_irecv``
   followed by ``wait`` does, and (with runs of length one) what blocking send/recv does.

A program with OFFLOAD/RELOAD copies is also checked by ``offload.check_copies`` (after step 2):
each offload reloaded exactly once, every reload before the backward that reads it.

The dependency rule is ``deps``; a deadlock reports each stuck rank, its action and what it waits
for.
"""

from __future__ import annotations

from itertools import chain
from operator import add, attrgetter

from pipetrain.schedule.action import COPY_KINDS, Action, OpKind
from pipetrain.schedule.execute import run, unit_duration
from pipetrain.schedule.gc_pause import without_gc
from pipetrain.schedule.offload import check_copies
from pipetrain.schedule.posted_p2p import check_channels, run_posted
from pipetrain.schedule.program import Program, ScheduleError, microbatch_chains
from pipetrain.schedule.transfer_checks import check_pairing, execute_lowered
from pipetrain.schedule.transfer_scan import scan_lowered

P2P_MODELS = ("blocking", "posted")


@without_gc
def validate(program: Program, p2p: str = "blocking") -> Program:
    """Raise ``ScheduleError`` if ``program`` is malformed or cannot run; return it otherwise.

    ``p2p`` is how a lowered program's transfers are played: ``"blocking"`` (step 4 above, what
    torch's executor needs) or ``"posted"``, pipetrain runtime's own transport
    (``posted_p2p``: sends never wait, receives are waited where they are read), which accepts
    receives posted right before their reader.
    """
    if p2p not in P2P_MODELS:
        raise ValueError(f"p2p must be one of {', '.join(P2P_MODELS)}, got {p2p!r}")
    _check_placement(program)
    chains, copies = _check_counts(program)
    if copies:
        check_copies(program)
    if program.is_lowered:
        scans = scan_lowered(program)
        check_pairing(program, None if scans is None else scans.rows, chains)
        assert scans is not None, "check_pairing refuses a program whose scan found no value"
        if scans.channels_filled:
            scans.channels.check()
        else:
            check_channels(program)
        if p2p == "blocking":
            execute_lowered(program, scans.rows)
        else:
            for scan in scans.rows:
                if scan.failure is not None:
                    raise scan.failure()
            run_posted(program)
    else:
        run(program, unit_duration)
    return program


_stage = attrgetter("stage")
_microbatch = attrgetter("microbatch")
_parts = attrgetter("parts")


def _check_placement(program: Program) -> None:
    # A quick scan finds the first bad row; the per-cell loop then finds its first bad cell and
    # _placement_error says exactly what is wrong. The quick scan reads columns through ``map``
    # (C speed): every action's and every overlapped pair's part's stage lives on the row's rank
    # and its micro-batch is in range. (The cell loop checks a pair by its parts only, so a row
    # the quick scan doubts may still pass.)
    rank_of = dict(enumerate(program.placement.rank_of_stage))  # .get: no wrap-around at -1
    stages_of_rank: list[set[int]] = [set() for _ in program.actions]
    for stage, rank in rank_of.items():
        stages_of_rank[rank].add(stage)
    m = program.num_microbatches
    for rank, row in enumerate(program.actions):
        cells = [*row, *chain.from_iterable(map(_parts, row))] if any(map(_parts, row)) else row
        microbatches = set(map(_microbatch, cells))
        if stages_of_rank[rank].issuperset(map(_stage, cells)) and (
            not microbatches or (min(microbatches) >= 0 and max(microbatches) < m)
        ):
            continue
        for step, action in enumerate(row):
            for part in action.compute_parts:  # a comm action is its own single part
                if rank_of.get(part.stage) != rank or not 0 <= part.microbatch < m:
                    raise _placement_error(program, rank, step, action)


def _placement_error(program: Program, rank: int, step: int, action: Action) -> ScheduleError:
    placement, m = program.placement, program.num_microbatches
    for part in action.compute_parts:
        if not 0 <= part.stage < placement.num_stages:
            return ScheduleError(
                f"rank {rank} step {step}: {action} names stage {part.stage}; "
                f"legal stages are 0..{placement.num_stages - 1}",
                program,
                [(rank, step)],
            )
        if not 0 <= part.microbatch < m:
            return ScheduleError(
                f"rank {rank} step {step}: {action} names micro-batch {part.microbatch}; "
                f"legal micro-batches are 0..{m - 1}",
                program,
                [(rank, step)],
            )
        if placement.rank(part.stage) != rank:
            return ScheduleError(
                f"rank {rank} step {step}: {action} runs stage {part.stage}, which lives on "
                f"rank {placement.rank(part.stage)}",
                program,
                [(rank, step)],
            )
    raise RuntimeError(f"internal: rank {rank} step {step}: {action} passed every placement check")


def _check_counts(program: Program) -> tuple[tuple[int, ...], bool]:
    """Raise unless every (stage, micro-batch) that must run runs completely (``_complete``) and
    no other does; return each micro-batch's chain (``microbatch_chains``), for pairing, and
    whether the program has OFFLOAD/RELOAD copies (seen on the way)."""
    # Tally per kind in flat lists (stage and micro-batch are in range: placement came first);
    # only a failure pays for _counts_error's per-cell bookkeeping.
    m = program.num_microbatches
    tally = {k: [0] * (program.num_stages * m) for k in (OpKind.F, OpKind.B, OpKind.I, OpKind.W)}
    copies = False
    for row in program.actions:
        for action in row:
            if action.parts:
                for p in action.parts:
                    tally[p.kind][p.stage * m + p.microbatch] += 1
            else:
                cells = tally.get(action.kind)  # None: a SEND or RECV, or a copy
                if cells is not None:
                    cells[action.stage * m + action.microbatch] += 1
                elif not copies and action.kind in COPY_KINDS:
                    copies = True
    chains = microbatch_chains(program)
    expected = _expected_cells(program, chains)
    # Cell by cell, ``_complete`` where expected and nothing elsewhere, as whole-list comparisons
    # (C loops): counts are never negative, so F = wanted, B + I = wanted and I = W say exactly
    # that (wanted: 1 where expected, else 0).
    wanted = [int(cell) for cell in expected] if False in expected else [1] * len(expected)
    f, b, i, w = (tally[k] for k in (OpKind.F, OpKind.B, OpKind.I, OpKind.W))
    if not (f == wanted and i == w and list(map(add, b, i)) == wanted):
        _counts_error(program, expected)
    return chains, copies


def _complete(f: int, b: int, i: int, w: int) -> bool:
    """One (stage, micro-batch) runs one F and either one B or one I and one W."""
    return f == 1 and ((b == 1 and i == w == 0) or (b == 0 and i == w == 1))


def _expected_cells(program: Program, chains: tuple[int, ...]) -> list[bool]:
    """For each (stage, micro-batch), flattened as stage·m + micro-batch: must it run? With one
    chain every cell must; with several, a micro-batch runs on its chain's stages only."""
    m, placement = program.num_microbatches, program.placement
    if placement.num_chains == 1:
        return [True] * (program.num_stages * m)
    return [
        placement.chain(stage) == chains[j] for stage in range(program.num_stages) for j in range(m)
    ]


def _counts_error(program: Program, expected: list[bool]) -> None:
    where: dict[tuple[OpKind, int, int], list[tuple[int, int]]] = {}
    for rank, step, action in program.cells():
        if action.is_compute:
            for p in action.compute_parts:
                where.setdefault((p.kind, p.stage, p.microbatch), []).append((rank, step))
    m = program.num_microbatches
    for stage in range(program.num_stages):
        for mb in range(m):
            n = {
                k: len(where.get((k, stage, mb), ()))
                for k in (OpKind.F, OpKind.B, OpKind.I, OpKind.W)
            }
            cells = [c for k in n for c in where.get((k, stage, mb), ())]
            found = ", ".join(f"{v} {k.value}" for k, v in n.items())
            if not expected[stage * m + mb]:
                if cells:
                    raise ScheduleError(
                        f"micro-batch {mb} flows through another chain, but stage {stage} runs "
                        f"it ({found})",
                        program,
                        cells,
                    )
                continue
            if not _complete(n[OpKind.F], n[OpKind.B], n[OpKind.I], n[OpKind.W]):
                raise ScheduleError(
                    f"stage {stage} micro-batch {mb} needs exactly one F and either one B or one I "
                    f"and one W; found {found}",
                    program,
                    cells,
                )
