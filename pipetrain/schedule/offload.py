"""Activation offload as data: where a program copies saved activations to host memory and back.

PipeOffload (Wan et al. 2025, arXiv 2503.01328) observes that in a pipeline schedule a
micro-batch's activations sit idle on a stage between its forward and its backward, often for
many other actions, so they can travel to host memory over the copy engine and come back in time,
overlapped with compute. This module writes that decision into the program: ``OFFLOAD(s, j)``
right after the action that runs ``F(s, j)`` and ``RELOAD(s, j)`` before the action that runs its
backward (``B`` or ``I``: ``W`` reads what ``I`` left on the device).

Where the reload goes is one of two rules:

* **just in time** (``timing``: a ``ReloadTiming``): as late as the program allows, so that the
  compute actions between the reload and its backward last at least the reload's ``need`` — its
  copy time, less what the backward can run before it reads the copied layers (a stage that
  offloads layer by layer and keeps its last layers reloads its first layers while it runs the
  backward of the kept ones: Megatron-Core's and torchtitan's per-module offload). Issuing later
  would make the backward wait; issuing earlier would hold the reloaded bytes on the device
  longer, and could bring back two micro-batches' activations where one suffices.
* **a fixed lead** per stage: ``lead`` compute actions before the backward (``reload_leads``
  reduces the just-in-time rule to one lead per stage, the largest any micro-batch needed: what a
  plan records, ``planner.layout``).

Either way a reload stands after at least one compute action that follows its forward (no
earlier: the copy out would have nothing to overlap), and before its backward; where the wait is
too short for the copies, the backward waits for them (the simulator says how long, and the
planner weighs that against the memory saved: the warm-up's micro-batches, whose reloads cannot
hide, are the ones that set 1F1B's peak). A micro-batch whose backward directly follows its
forward (every micro-batch of 1F1B's last stage) stays on the device. A copy is issued at its
position in the row and runs on the rank's copy engine, one queue per direction, beside compute
(``copy_engine``); the backward of ``(s, j)`` waits for what ``RELOAD(s, j)`` brings back (the
simulator's ``schedule.execute`` and the runtime's executor both wait there).

``check_copies`` states what a program with copies must satisfy; ``validate`` calls it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipetrain.schedule.action import COPY_KINDS, Action, OpKind
from pipetrain.schedule.copy_engine import has_copies
from pipetrain.schedule.program import Program, ScheduleError

_BACKWARDS = (OpKind.B, OpKind.I)

#: layers of an offloaded micro-batch that per-layer offload holds on the device at once, beyond
#: those it keeps: the one a forward or backward is working on and the one on the copy engine
#: (``runtime.host_offload`` prefetches one layer ahead in the backward; ``sim.offload_model``)
RESIDENT_LAYERS = 2


def offloaded_layers(fraction: float, num_layers: int) -> int:
    """How many of a stage's ``num_layers`` layers offload at ``fraction``: the first
    ⌈fraction · layers⌉ (the last ones are read first by the backward, so they are the ones worth
    keeping). The runtime and the simulator both count with this."""
    if fraction <= 0:
        return 0
    return min(num_layers, math.ceil(fraction * num_layers - 1e-9))


@dataclass(frozen=True)
class ReloadTiming:
    """What the just-in-time rule reads, in one time unit: how long a compute action takes
    (``duration``), and how long before a backward piece (``B`` or ``I``, given as that part)
    starts its reload must start (``need``)."""

    duration: Callable[[Action], float]
    need: Callable[[Action], float]


@dataclass(frozen=True)
class OffloadSpec:
    """What a pipeline offloads (``Pipeline(offload=...)``): per stage its fraction, and how many
    compute actions ahead of its backward its reloads are issued (``reload_leads``: what a plan
    records; empty: 1 for every stage)."""

    fractions: tuple[float, ...]
    reload_lead: tuple[int, ...] = ()

    def leads(self, num_stages: int) -> tuple[int, ...]:
        return check_leads(self.reload_lead or 1, num_stages)


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


def check_leads(lead: int | Sequence[int], num_stages: int) -> tuple[int, ...]:
    """A reload lead per stage (one number: every stage); ``ValueError`` names a bad value."""
    values = [lead] * num_stages if isinstance(lead, int) else list(lead)
    if len(values) != num_stages:
        raise ValueError(
            f"reload lead has {len(values)} values; give one number or one per stage ({num_stages})"
        )
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"a reload's lead is a number of compute actions >= 0, got {value!r}")
    return tuple(values)


def offloadable_stages(
    program: Program, lead: int | Sequence[int] = 1, timing: ReloadTiming | None = None
) -> frozenset[int]:
    """The stages with at least one micro-batch ``insert_offload`` would offload (same rule)."""
    everything = (1.0,) * program.num_stages
    leads = check_leads(lead, program.num_stages)
    found: set[int] = set()
    for row in program.actions:
        found |= {s for s, _ in _placements(row, everything, leads, timing)[0]}
    return frozenset(found)


def insert_offload(
    program: Program,
    fractions: Sequence[float],
    lead: int | Sequence[int] = 1,
    timing: ReloadTiming | None = None,
) -> Program:
    """``program`` with an OFFLOAD/RELOAD pair for every (stage, micro-batch) of a stage whose
    fraction is > 0 and whose activations wait long enough, each reload placed just in time
    (``timing``) or ``lead`` compute actions ahead of its backward (module docstring).

    Raises ``ValueError`` for a fraction outside [0, 1], a bad ``lead``, a program that already
    has copies, or a stage with a fraction > 0 none of whose micro-batches can be offloaded.
    """
    fractions = check_fractions(fractions, program.num_stages)
    leads = check_leads(lead, program.num_stages)
    if has_copies(program):
        raise ValueError("the program already has OFFLOAD/RELOAD actions; insert them once")
    rows: list[list[Action]] = []
    offloaded: set[int] = set()
    for row in program.actions:
        placed, _ = _placements(row, fractions, leads, timing)
        rows.append(_with_copies(row, placed))
        offloaded |= {s for s, _ in placed}
    idle = [s for s, f in enumerate(fractions) if f > 0 and s not in offloaded]
    if idle:
        how = (
            "long enough for the copies" if timing else f"more than {min(leads)} compute action(s)"
        )
        raise ValueError(
            f"stage(s) {', '.join(map(str, idle))} have an offload fraction > 0 but no "
            f"micro-batch whose activations wait {how} between forward and backward: nothing to "
            "offload there; set their fraction to 0"
        )
    return program.with_actions(rows)


def reload_leads(
    program: Program, fractions: Sequence[float], timing: ReloadTiming
) -> tuple[int, ...]:
    """Per stage, the fewest compute actions ahead of its backward that a reload can be issued
    at and still be on time for every micro-batch the just-in-time rule offloads there (the
    largest lead any of them needed; 1 for a stage that offloads nothing): the fixed leads that
    ``insert_offload`` places the way a plan records them."""
    fractions = check_fractions(fractions, program.num_stages)
    leads = [0] * program.num_stages
    found: set[int] = set()
    for row in program.actions:
        _, needed = _placements(row, fractions, check_leads(1, program.num_stages), timing)
        for stage, count in needed.items():
            leads[stage] = max(leads[stage], count)
            found.add(stage)
    return tuple(lead if s in found else 1 for s, lead in enumerate(leads))


#: (stage, micro-batch) -> (compute index its OFFLOAD follows, compute index its RELOAD precedes)
_Placed = dict[tuple[int, int], tuple[int, int]]


def _placements(
    row: Sequence[Action],
    fractions: Sequence[float],
    leads: Sequence[int],
    timing: ReloadTiming | None,
) -> tuple[_Placed, dict[int, int]]:
    """One rank's copies as compute indices, and per stage the largest lead (in compute actions)
    a reload got."""
    compute = [a for a in row if a.is_compute]
    durations = [timing.duration(a) for a in compute] if timing else []
    forward_at: dict[tuple[int, int], int] = {}  # (stage, mb) -> compute index of its F
    placed: _Placed = {}
    leads_used: dict[int, int] = {}
    for k, action in enumerate(compute):
        for part in action.compute_parts:
            key = (part.stage, part.microbatch)
            if part.kind is OpKind.F and fractions[part.stage] > 0:
                forward_at[key] = k
            elif part.kind in _BACKWARDS and key in forward_at:
                f = forward_at.pop(key)
                if k < f + 2:
                    continue  # the backward follows the forward: keep these on the device
                if timing is None:
                    issue = max(k - leads[part.stage], f + 2)
                else:
                    issue = _just_in_time(durations, f, k, part, timing)
                placed[key] = (f, issue)
                leads_used[part.stage] = max(leads_used.get(part.stage, 0), k - issue)
    return placed, leads_used


def _just_in_time(
    durations: Sequence[float], f: int, k: int, backward: Action, timing: ReloadTiming
) -> int:
    """The compute index to issue the reload of ``backward`` (at ``k``, forward at ``f``) before:
    the latest one whose compute until ``k`` lasts ``need``, never before ``f + 2``."""
    need = max(0.0, timing.need(backward))
    issue, covered = k, 0.0
    while covered + 1e-12 < need and issue > f + 2:
        issue -= 1
        covered += durations[issue]
    return issue


def _with_copies(row: Sequence[Action], placed: _Placed) -> list[Action]:
    after: dict[int, list[Action]] = {}  # compute index -> copies issued right after it
    before: dict[int, list[Action]] = {}  # compute index -> copies issued right before it
    for (stage, mb), (f, issue) in placed.items():
        after.setdefault(f, []).append(Action(OpKind.OFFLOAD, stage, mb))
        before.setdefault(issue, []).append(Action(OpKind.RELOAD, stage, mb))
    out: list[Action] = []
    k = 0
    for action in row:
        if action.is_compute:
            out += before.get(k, ())
            out.append(action)
            out += after.get(k, ())
            k += 1
        else:
            out.append(action)
    return out


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
