"""Helpers for the torch.distributed.pipelining interop tests (``test_interop_torch.py``).

* ``torch_schedule`` builds one of torch's schedule classes without a process group or real
  modules: its constructors only read ``num_stages``, ``group_size``, ``group_rank``,
  ``stage_index`` and ``submod`` of the stage objects (and set ``stage_index_to_group_rank`` on
  them), and every rank's ``pipeline_order`` is computed on every rank, so stand-ins for rank 0's
  stages give the whole program.
* ``dump_torch_csv`` writes what torch's ``_dump_csv`` writes.
* ``run_torch_csv_in_pipetrain`` and ``run_pipetrain_csv_in_torch`` run inside the gloo processes
  of ``runtime_harness.launch`` and compare with ``runtime_cases.reference`` (unsplit, float64).
"""

from __future__ import annotations

from types import SimpleNamespace

from runtime_cases import batch, build_stages, close, loss_fn, reference

#: torch schedule classes whose stages sit in a V (rank r holds r and 2p − 1 − r)
V_CLASSES = frozenset({"ScheduleZBVZeroBubble", "ScheduleDualPipeV"})
#: torch schedule classes with one stage per rank (``PipelineScheduleSingle``)
SINGLE_CLASSES = frozenset({"Schedule1F1B", "ScheduleGPipe"})


def torch_stage_indices(cls_name: str, num_ranks: int, stages_per_rank: int, rank: int):
    if cls_name in V_CLASSES:
        return [rank, 2 * num_ranks - 1 - rank]
    return [rank + k * num_ranks for k in range(stages_per_rank)]


def torch_schedule(cls_name: str, num_ranks: int, stages_per_rank: int, num_microbatches: int):
    """torch's schedule ``cls_name`` built on stand-in stages for rank 0 (see module docstring)."""
    import torch
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, cls_name)
    num_stages = num_ranks * stages_per_rank
    stages = [
        SimpleNamespace(
            stage_index=s,
            num_stages=num_stages,
            group_size=num_ranks,
            group_rank=0,
            submod=torch.nn.Identity(),
        )
        for s in torch_stage_indices(cls_name, num_ranks, stages_per_rank, 0)
    ]
    if cls_name in SINGLE_CLASSES:
        return cls(stages[0], num_microbatches, loss_fn=loss_fn)
    return cls(stages, num_microbatches, loss_fn=loss_fn)


def dump_torch_csv(schedule, path, format: str = "compute_only") -> None:
    """torch's ``_dump_csv``. ``PipelineScheduleSingle`` (1F1B, GPipe) has none, although it has a
    ``pipeline_order``; there we call ``PipelineScheduleMulti._dump_csv`` on it, the same writer."""
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        _PipelineScheduleRuntime,
    )

    if isinstance(schedule, _PipelineScheduleRuntime):
        schedule._dump_csv(str(path), format=format)
    else:
        PipelineScheduleMulti._dump_csv(schedule, str(path))


def run_torch_csv_in_pipetrain(rank: int, world: int, cases: list[tuple[str, str]]) -> list[str]:
    """``Pipeline(stages, schedule=load_program(csv))``: two steps (an uneven batch), loss and
    every local gradient against the unsplit float64 reference."""
    import pipetrain
    from pipetrain.schedule.program_io import load_program

    failures = []
    for label, path in cases:
        program = load_program(path)
        num_stages, m = program.num_stages, program.num_microbatches
        stages = build_stages(num_stages)
        pipe = pipetrain.Pipeline(stages, schedule=program, loss_fn=loss_fn)
        inputs, y = batch(2 * m + 1)
        losses = [pipe.step(inputs, y) for _ in range(2)]
        ref_loss, ref_grads = reference(num_stages, inputs, y, steps=2)
        failures += [
            f"{label}: step {i} loss {loss.item()} != {ref_loss.item()}"
            for i, loss in enumerate(losses)
            if not close(loss, ref_loss)
        ]
        failures += _gradient_failures(label, rank, program, stages, ref_grads, scale=1)
    return failures


def run_pipetrain_csv_in_torch(
    rank: int, world: int, cases: list[tuple[str, str, str]]
) -> list[str]:
    """torch ``PipelineStage``s for our stages, ``_PipelineScheduleRuntime._load_csv(path,
    format)``, one ``step``; loss and every local gradient against the unsplit reference.

    ``compute_only``: torch lowers the file itself and appends ``REDUCE_GRAD`` after each stage's
    last backward, which divides the gradients by m (``scale_grads=True``) as a mean loss wants.
    ``compute_comms``: torch runs the file's SEND/RECV as written and adds nothing, so no
    ``REDUCE_GRAD`` runs and the gradients stay summed over micro-batches: m × the reference.
    """
    import torch
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from pipetrain.schedule.program_io import load_program

    failures = []
    for label, path, fmt in cases:
        program = load_program(path)
        num_stages, m = program.num_stages, program.num_microbatches
        modules = build_stages(num_stages)
        stages = [
            PipelineStage(modules[s], s, num_stages, torch.device("cpu"))
            for s in program.placement.stages_of_rank(rank)
        ]
        schedule = _PipelineScheduleRuntime(stages, m, loss_fn=loss_fn)
        # The stage -> rank map is inferred from the file (it overrides the looped default).
        schedule._load_csv(path, format=fmt)
        inputs, y = batch(2 * m)  # torch splits evenly only; even chunks keep 1/m exact
        losses: list = []
        schedule.step(*inputs, target=y, losses=losses)
        ref_loss, ref_grads = reference(num_stages, inputs, y, steps=1)
        if program.num_stages - 1 in program.placement.stages_of_rank(rank):
            loss = torch.stack(losses).mean()
            if len(losses) != m or not close(loss, ref_loss):
                failures.append(f"{label}: loss {loss.item()} != {ref_loss.item()}")
        scale = m if fmt == "compute_comms" else 1
        failures += _gradient_failures(label, rank, program, modules, ref_grads, scale)
    return failures


def _gradient_failures(label, rank, program, modules, ref_grads, scale) -> list[str]:
    failures = []
    compared = 0
    for s in program.placement.stages_of_rank(rank):
        for n, p in modules[s].named_parameters():
            grad = None if p.grad is None else p.grad / scale
            compared += grad is not None
            if not close(grad, ref_grads[(s, n)]):
                failures.append(f"{label}: stage {s} {n} gradient differs from the reference")
    if not compared:
        failures.append(f"{label}: rank {rank} has no gradient at all")
    return failures
