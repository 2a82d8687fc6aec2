"""Interop with torch.distributed.pipelining (torch 2.13): the runtime issue's §1 promise.

torch → pipetrain: a CSV written by torch's ``_dump_csv(path, format="compute_only")`` loads with
``load_program`` (the stage → rank map and micro-batch count are inferred), passes ``validate``
after ``lower``, simulates, equals our builder's program for the same shape (one documented
exception) and trains exactly under ``pipetrain.Pipeline``.

pipetrain → torch: ``save_program(program, "x.csv")`` loads into ``_PipelineScheduleRuntime`` with
``_load_csv(path)`` (compute-only; torch adds its own SEND/RECV and REDUCE_GRAD) and, for a lowered
program, ``_load_csv(path, format="compute_comms")`` (torch runs our SEND/RECV as written). Nothing
else is needed: torch infers ``stage_index_to_group_rank`` from the file in both formats, so a V
placement needs no ``style="v"``; each rank passes ``PipelineStage``s for the stages its row runs.
Every family we build, at 2 ranks, runs in torch's runtime with gradients equal to the unsplit
float64 reference within 1e-10 — including zbv and dualpipev, whose own torch classes have
limits (no forward-only run; DualPipeV needs m ≥ 2p), none of which touch ``_load_csv`` + ``step``.

What does not interoperate, pinned here so a change on either side shows up:

* torch's 1F1B and GPipe are ``PipelineScheduleSingle``: no ``_dump_csv``, and their
  ``pipeline_order`` (the IR the same writer would dump) ends every row with ``<stage>REDUCE_GRAD``
  and, for 1F1B, has a malformed last rank (``F1 … Fm``, no ``F0``; its runtime ignores the IR).
  With REDUCE_GRAD skipped on load, GPipe and 1F1B's other ranks equal ours; 1F1B's last rank is rejected
  by ``validate``.
* ``_PipelineScheduleRuntime._dump_csv``'s *default* format is ``compute_comms``, whose rows carry
  ``<stage>UNSHARD``, ``<stage>RESHARD`` and ``<stage>REDUCE_GRAD`` (no micro-batch index);
  pipetrain's loader skips those housekeeping cells and keeps the pipeline order.
* ``interleaved-zb`` with fewer micro-batches than ranks: torch defers each W by r input-gradient
  slots even when no forward is left to fill; ours caps the lag there (builders/interleaved.py,
  ``zero_bubble_lag``). Same F/I order, same makespan at unit costs, Ws placed differently.
"""

from __future__ import annotations

import pytest
from interop_cases import (
    SINGLE_CLASSES,
    dump_torch_csv,
    run_pipetrain_csv_in_torch,
    run_torch_csv_in_pipetrain,
    torch_schedule,
)
from runtime_harness import launch

from pipetrain.schedule import ScheduleError, lower, validate
from pipetrain.schedule.action import OpKind
from pipetrain.schedule.program_io import load_program, save_program
from pipetrain.schedule.registry import FAMILIES, build_schedule
from pipetrain.sim import simulate

pytest.importorskip("torch.distributed.pipelining")

#: torch class -> our family
OURS = {
    "Schedule1F1B": "1f1b",
    "ScheduleGPipe": "gpipe",
    "ScheduleInterleaved1F1B": "interleaved-1f1b",
    "ScheduleLoopedBFS": "looped-bfs",
    "ScheduleInterleavedZeroBubble": "interleaved-zb",
    "ScheduleZBVZeroBubble": "zbv",
    "ScheduleDualPipeV": "dualpipev",
}

#: (torch class, ranks, stages per rank, micro-batches): shapes torch's constructors accept
SHAPES = [
    ("ScheduleInterleaved1F1B", 2, 2, 4),
    ("ScheduleInterleaved1F1B", 4, 2, 8),
    ("ScheduleInterleaved1F1B", 4, 2, 10),
    ("ScheduleInterleaved1F1B", 4, 2, 3),
    ("ScheduleInterleaved1F1B", 2, 3, 4),
    ("ScheduleLoopedBFS", 2, 2, 4),
    ("ScheduleLoopedBFS", 3, 2, 7),
    ("ScheduleLoopedBFS", 4, 3, 8),
    ("ScheduleInterleavedZeroBubble", 2, 2, 4),
    ("ScheduleInterleavedZeroBubble", 4, 2, 8),
    ("ScheduleInterleavedZeroBubble", 4, 2, 10),
    ("ScheduleInterleavedZeroBubble", 2, 3, 4),
    ("ScheduleInterleavedZeroBubble", 4, 2, 3),
    ("ScheduleInterleavedZeroBubble", 2, 2, 1),
    ("ScheduleZBVZeroBubble", 2, 2, 1),
    ("ScheduleZBVZeroBubble", 2, 2, 4),
    ("ScheduleZBVZeroBubble", 3, 2, 7),
    ("ScheduleZBVZeroBubble", 4, 2, 16),
    ("ScheduleDualPipeV", 2, 2, 4),
    ("ScheduleDualPipeV", 3, 2, 7),
    ("ScheduleDualPipeV", 4, 2, 16),
]


def _shape_id(shape) -> str:
    cls, p, v, m = shape
    return f"{cls.removeprefix('Schedule')}-p{p}-v{v}-m{m}"


def _torch_program(tmp_path, cls, p, v, m):
    path = tmp_path / f"{cls}_p{p}_v{v}_m{m}.csv"
    dump_torch_csv(torch_schedule(cls, p, v, m), path)
    return path, load_program(path)


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_torch_dump_loads_validates_simulates_and_equals_ours(tmp_path, shape):
    cls, p, v, m = shape
    _, program = _torch_program(tmp_path, cls, p, v, m)
    assert (program.num_ranks, program.num_stages, program.num_microbatches) == (p, p * v, m)
    validate(lower(program))
    assert simulate(program).makespan > 0
    ours = build_schedule(OURS[cls], p, m, stages_per_rank=v)
    assert program.placement.rank_of_stage == ours.placement.rank_of_stage
    if cls == "ScheduleInterleavedZeroBubble" and m < p:
        # The one known difference (module docstring): only where the Ws sit.
        for r in range(p):
            no_w = [
                [a for a in row[r] if a.kind is not OpKind.W]
                for row in (program.actions, ours.actions)
            ]
            assert no_w[0] == no_w[1], f"rank {r}: F/I order differs"
            assert sorted(map(str, program.actions[r])) == sorted(map(str, ours.actions[r]))
        assert program.actions != ours.actions  # if torch caps the lag too, drop this branch
        assert simulate(program).makespan == simulate(ours).makespan
        return
    for r in range(p):
        assert program.actions[r] == ours.actions[r], (
            f"rank {r}\n torch: {' '.join(map(str, program.actions[r]))}"
            f"\n ours:  {' '.join(map(str, ours.actions[r]))}"
        )


@pytest.mark.parametrize("cls", sorted(SINGLE_CLASSES))
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8)])
def test_torch_single_stage_orders(tmp_path, cls, p, m):
    path = tmp_path / "single.csv"
    dump_torch_csv(torch_schedule(cls, p, 1, m), path)
    assert "REDUCE_GRAD" in path.read_text()  # torch's per-stage gradient reduction ...
    program = load_program(path)  # ... is housekeeping, skipped on load
    ours = build_schedule(OURS[cls], p, m)
    for r in range(p - 1):
        assert program.actions[r] == ours.actions[r]
    if program.actions[p - 1] != ours.actions[p - 1]:
        # torch's 1F1B IR on the last rank: F1 … Fm and no F0 (see the module docstring)
        assert cls == "Schedule1F1B"
        with pytest.raises(ScheduleError):
            validate(lower(program))
    else:
        validate(lower(program))


def test_torch_compute_comms_dump_loads(tmp_path):
    path = tmp_path / "zbv_comms.csv"
    dump_torch_csv(torch_schedule("ScheduleZBVZeroBubble", 2, 2, 4), path, format="compute_comms")
    program = load_program(path)
    try:
        validate(program)
    except ScheduleError as e:
        pytest.fail(f"torch's compute_comms program loads but does not validate: {e}")
    assert program.compute_only().actions == build_schedule("zbv", 2, 4).actions


#: torch CSVs that pipetrain's runtime trains on (2 ranks)
TORCH_RUNS = [
    ("ScheduleInterleaved1F1B", 2, 2, 4),
    ("ScheduleLoopedBFS", 2, 2, 3),
    ("ScheduleInterleavedZeroBubble", 2, 2, 4),
    ("ScheduleInterleavedZeroBubble", 2, 2, 1),  # the shape where torch's Ws differ from ours
    ("ScheduleZBVZeroBubble", 2, 2, 3),
    ("ScheduleDualPipeV", 2, 2, 4),
]


@pytest.mark.slow
def test_pipeline_runs_torch_csv_exactly(tmp_path):
    cases = []
    for shape in TORCH_RUNS:
        path, _ = _torch_program(tmp_path, *shape)
        cases.append((_shape_id(shape), str(path)))
    failures = launch(2, run_torch_csv_in_pipetrain, cases, timeout=90)
    problems = [f for rank_failures in failures for f in rank_failures]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_torch_runtime_runs_our_csv_exactly(tmp_path):
    cases = []
    one_copy = [n for n in FAMILIES if n != "dualpipe"]  # torch has no two-copy placement
    for name in one_copy:
        for m in (3, 4):
            try:
                program = build_schedule(name, 2, m)
            except ValueError:
                continue  # dualpipev needs m >= 2p
            compute_only = tmp_path / f"{name}_m{m}.csv"
            save_program(program, compute_only)
            cases.append((f"{name} m={m} compute_only", str(compute_only), "compute_only"))
            lowered = tmp_path / f"{name}_m{m}_lowered.csv"
            save_program(lower(program), lowered)
            cases.append((f"{name} m={m} compute_comms", str(lowered), "compute_comms"))
    assert len(cases) == 4 * len(one_copy) - 2
    failures = launch(2, run_pipetrain_csv_in_torch, cases, timeout=90)
    problems = [f for rank_failures in failures for f in rank_failures]
    assert not problems, "\n".join(problems)
