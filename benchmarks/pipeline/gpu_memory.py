"""The memory prediction of ``gpu_pipeline.py``, also for saved runs (``memory_model_check.py``).

Predicted peak per rank = what is resident before the step (parameters, gradients, optimizer
state) + the simulator's peak of ``Costs.activation`` (one micro-batch's forward bytes, measured per
stage in the limit run), ``Costs.activation_for_weight`` (what the runtime's split still holds
after a micro-batch's I, before its W) and, for the second prediction, ``Costs.workspace`` (how
far one micro-batch's F, I and W alone took the allocator's peak above what they hold: temporaries
such as the loss's float32 logits), each placed on the step's timeline simulated from the measured
mean F/I/W/B/pair times. The simulator needs no torch.
"""

from __future__ import annotations

from pipetrain.schedule.action import OpKind
from pipetrain.schedule.program import Program
from pipetrain.sim.costs import costs_from_means
from pipetrain.sim.simulate import simulate

GIB = 2**30


def per_stage_gib(table: dict | None, num_stages: int) -> list[float]:
    """``{"0": bytes, ...}`` from the limit run as GiB per stage (0 where unmeasured)."""
    table = table or {}
    return [table.get(str(s), 0) / GIB for s in range(num_stages)]


def predicted_peaks(
    program: Program,
    mean: dict[tuple[OpKind, int], float],
    resident_gib: list[float],
    limit: dict,
    comm_ms: float,
    replay: bool,
) -> dict[str, list[float]]:
    """``pred_peak_gib`` (activations) and ``pred_peak_gib_with_workspace`` per rank; empty
    where the limit run measured no held bytes (no CUDA)."""
    n = program.num_stages
    held = limit.get("replay_after_input_bytes" if replay else "runtime_after_input_bytes")
    if not held or not limit.get("activation_bytes"):
        return {}
    work = limit.get("replay_transient_bytes" if replay else "transient_bytes")
    sizes = dict(
        comm=comm_ms,
        activation=per_stage_gib(limit["activation_bytes"], n),
        activation_for_weight=per_stage_gib(held, n),
    )
    plain = simulate(program, costs_from_means(mean, n, **sizes))
    with_work = simulate(
        program, costs_from_means(mean, n, workspace=per_stage_gib(work, n), **sizes)
    )
    return {
        "pred_peak_gib": [r + p for r, p in zip(resident_gib, plain.peak_activations)],
        "pred_peak_gib_with_workspace": [
            r + p for r, p in zip(resident_gib, with_work.peak_activations)
        ],
    }


def parse_means(mean_action_ms: dict[str, float]) -> dict[tuple[OpKind, int], float]:
    """A saved row's ``mean_action_ms`` (``{"F0": ms, "OVERLAP_F_B3": ms}``) as ``mean_durations``."""
    out = {}
    for key, ms in mean_action_ms.items():
        kind = key.rstrip("0123456789")
        out[OpKind(kind), int(key[len(kind) :])] = ms
    return out
