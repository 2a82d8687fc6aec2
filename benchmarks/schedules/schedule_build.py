"""Time to build, lower, validate and simulate every schedule, next to torch.distributed.pipelining.

For each schedule and (ranks, micro-batches) shape this measures pipetrain's four steps

* build: ``registry.build_schedule`` (stages per rank = the family's default);
* lower: ``lower.lower`` (SEND/RECV injection);
* validate: ``validate.validate`` of the lowered program (placement, counts, pairing, blocking
  batched P2P execution);
* simulate: ``simulate.simulate`` with default ``Costs()`` plus the headline metrics (makespan,
  bubble fraction, peak activations per rank),

and, where torch has the schedule, torch's equivalent steps, each timed on its own:

* generation: the schedule class's constructor with lowering switched off, which builds
  ``pipeline_order`` for *every* rank (each process does this), fed light stand-in stage objects
  that carry only the attributes the constructor reads (no modules, no process group);
* validation: ``_validate_schedule`` (counts and order per stage, stage -> rank map);
* comms: ``_add_send_recv`` on the compute actions (bubbles and REDUCE_GRAD dropped first; the
  FSDP passes ``_add_unshard_reshard`` / ``_add_reduce_grad`` are left out: pipetrain has no
  counterpart, and leaving them out only flatters torch);
* simulation: ``_simulate_comms_compute`` (a step-count dry run: no costs, no memory);

and, separately, torch's schedule constructor as a user calls it (``ScheduleZBVZeroBubble(stages,
n_microbatches)``): generation plus its whole lowering (``_add_unshard_reshard``,
``_add_reduce_grad``, ``_add_send_recv``), which every rank pays before its first step whether or
not FSDP is in use. The "speed-up" column compares like-for-like steps; the "vs constructor"
column compares what each library needs before a runnable program exists (pipetrain: build +
lower + validate).

Each case is timed best of ``--repeat`` (by total); a torch case slower than 5 s runs once, and a
torch step is stopped after 60 s. Usage::

    python benchmarks/schedules/schedule_build.py [--quick] [--no-torch] [--json PATH] [--repeat N]

The scale targets (128 ranks × 1,024 micro-batches): ``schedule_scale.py`` beside this file.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from types import SimpleNamespace

from pipetrain.schedule.lower import lower
from pipetrain.schedule.registry import FAMILIES, build_schedule
from pipetrain.schedule.validate import validate
from pipetrain.sim.costs import Costs
from pipetrain.sim.simulate import simulate

SHAPES = ((8, 64), (32, 256), (64, 1024))
QUICK_SHAPES = ((8, 64),)

# pipetrain family -> torch.distributed.pipelining schedule name (``get_schedule_class``).
# zb-h1 and zb-h2 have no torch class (its zero-bubble schedules are interleaved or V).
TORCH_NAMES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "looped-bfs": "LoopedBFS",
    "interleaved-zb": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}

TORCH_STEP_LIMIT_S = 60.0
TORCH_REPEAT_BELOW_S = 5.0


@dataclass
class Timing:
    """Seconds per step, in order; ``error`` says which step failed and why (its time is left out)."""

    phases: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    @property
    def total(self) -> float:
        return sum(self.phases.values())


@dataclass
class Case:
    schedule: str
    ranks: int
    microbatches: int
    stages_per_rank: int
    pipetrain: Timing
    torch_schedule: str | None = None
    torch: Timing | None = None
    torch_constructor: Timing | None = None


# --- pipetrain --------------------------------------------------------------------------------


def time_pipetrain(name: str, ranks: int, microbatches: int, clock: Callable[[], float]) -> Timing:
    timing = Timing()
    t0 = clock()
    program = build_schedule(name, ranks, microbatches)
    t1 = clock()
    lowered = lower(program)
    t2 = clock()
    validate(lowered)
    t3 = clock()
    timeline = simulate(lowered, Costs())
    _ = (timeline.makespan, timeline.bubble_fraction, timeline.peak_activations)
    t4 = clock()
    timing.phases = {"build": t1 - t0, "lower": t2 - t1, "validate": t3 - t2, "simulate": t4 - t3}
    return timing


# --- torch --------------------------------------------------------------------------------------


class _StepTimeout(Exception):
    pass


def _on_alarm(signum: int, frame: object) -> None:
    raise _StepTimeout


def _stand_in_stages(schedules: object, cls: type, ranks: int, stages_per_rank: int) -> list:
    """Rank 0's stages as plain objects with the attributes the schedule constructors read."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    num_stages = ranks * stages_per_rank
    v_shaped = cls in (schedules.ScheduleZBVZeroBubble, schedules.ScheduleDualPipeV)
    rank_of = generate_stage_to_rank_mapping(ranks, num_stages, style="v" if v_shaped else "loop")
    return [
        SimpleNamespace(
            num_stages=num_stages,
            stage_index=s,
            group_rank=0,
            group_size=ranks,
            submod=None,  # read only by the torch.compile check
            is_first=s == 0,
            is_last=s == num_stages - 1,
        )
        for s in range(num_stages)
        if rank_of[s] == 0
    ]


def _torch_schedule_inputs(torch_name: str, ranks: int):
    """torch's schedules module, the class, whether it is single-stage, and stand-in stages."""
    import torch.distributed.pipelining.schedules as S

    cls = S.get_schedule_class(torch_name)
    single = issubclass(cls, S.PipelineScheduleSingle)
    return S, cls, single, _stand_in_stages(S, cls, ranks, 1 if single else 2)


def time_torch(
    torch_name: str, ranks: int, microbatches: int, clock: Callable[[], float]
) -> Timing:
    S, cls, single, stages = _torch_schedule_inputs(torch_name, ranks)
    num_stages = stages[0].num_stages

    def no_lowering(self: object, actions: object, format: str = "compute_only") -> None:
        pass  # generation only: the lowering steps are timed one by one below

    generate_only = type(cls.__name__, (cls,), {"_prepare_schedule_with_comms": no_lowering})
    timing = Timing()

    def step(name: str, fn: Callable[[], object]) -> object:
        signal.setitimer(signal.ITIMER_REAL, TORCH_STEP_LIMIT_S)
        start = clock()
        try:
            return fn()
        except _StepTimeout:
            timing.error = f"{name}: > {TORCH_STEP_LIMIT_S:g} s, stopped"
            raise
        except Exception as e:  # torch's own failure: report it, keep the steps that ran
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
            timing.error = f"{name}: {type(e).__name__} {first_line}"[:160]
            raise
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            if timing.error is None:
                timing.phases[name] = clock() - start

    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        schedule = step(
            "generate",
            lambda: generate_only(stages[0] if single else stages, microbatches),
        )
        order = {
            rank: [a for a in actions if a is not None and a.computation_type != S.REDUCE_GRAD]
            for rank, actions in schedule.pipeline_order.items()
        }
        rank_of = step(
            "validate", lambda: S._validate_schedule(order, ranks, num_stages, microbatches)
        )
        with_comms = step(
            "comms",
            lambda: S._add_send_recv(
                {r: list(a) for r, a in order.items()}, lambda s: rank_of[s], num_stages
            ),
        )
        step(
            "simulate",
            lambda: S._simulate_comms_compute(with_comms, lambda s: rank_of[s], num_stages),
        )
    except Exception:
        pass  # recorded in timing.error
    finally:
        signal.signal(signal.SIGALRM, previous)
    return timing


def time_torch_constructor(
    torch_name: str, ranks: int, microbatches: int, clock: Callable[[], float]
) -> Timing:
    """torch's unmodified constructor: what a rank pays before its schedule can run."""
    _, cls, single, stages = _torch_schedule_inputs(torch_name, ranks)
    timing = Timing()
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, TORCH_STEP_LIMIT_S)
    start = clock()
    try:
        cls(stages[0] if single else stages, microbatches)
        timing.phases["constructor"] = clock() - start
    except _StepTimeout:
        timing.error = f"constructor: > {TORCH_STEP_LIMIT_S:g} s, stopped"
    except Exception as e:  # torch's own failure
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        timing.error = f"constructor: {type(e).__name__} {first_line}"[:160]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return timing


def _quiet_torch() -> None:
    """Import torch up front (not inside a timed step); silence its per-class log notes."""
    import logging

    import torch.distributed.pipelining.schedules  # noqa: F401

    logging.getLogger("torch.distributed.pipelining").setLevel(logging.ERROR)


# --- scale targets --------------------------------------------------------------------------------

#: (schedule, ranks, micro-batches, CPU seconds it must stay under); memory under SCALE_MIB
# --- driver -------------------------------------------------------------------------------------


def best_of(run: Callable[[], Timing], repeat: int, once_above_s: float = float("inf")) -> Timing:
    gc.collect()  # start each run with no garbage left by the previous one
    best = run()
    for _ in range(repeat - 1):
        if best.error is not None or best.total > once_above_s:
            break
        gc.collect()
        t = run()
        if t.total < best.total:
            best = t
    return best


def run_cases(
    shapes: tuple[tuple[int, int], ...], with_torch: bool, repeat: int, clock: Callable[[], float]
) -> list[Case]:
    cases = []
    for ranks, microbatches in shapes:
        for fam in FAMILIES.values():
            name = str(fam.name)
            try:
                build_schedule(name, ranks, microbatches)
            except ValueError:
                continue  # the family refuses this shape
            pt = best_of(partial(time_pipetrain, name, ranks, microbatches, clock), repeat)
            case = Case(name, ranks, microbatches, fam.default_stages_per_rank, pt)
            torch_name = TORCH_NAMES.get(name)
            if with_torch and torch_name is not None:
                case.torch_schedule = torch_name
                case.torch = best_of(
                    partial(time_torch, torch_name, ranks, microbatches, clock),
                    repeat,
                    once_above_s=TORCH_REPEAT_BELOW_S,
                )
                case.torch_constructor = best_of(
                    partial(time_torch_constructor, torch_name, ranks, microbatches, clock),
                    repeat,
                    once_above_s=TORCH_REPEAT_BELOW_S,
                )
            cases.append(case)
            print(_row(case), file=sys.stderr, flush=True)
    return cases


def _phases(t: Timing) -> str:
    return " / ".join(f"{v:.3f}" for v in t.phases.values())


def _row(case: Case) -> str:
    pt = case.pipetrain
    cells = [
        case.schedule,
        f"{case.ranks} × {case.microbatches}",
        f"**{pt.total:.3f}** ({_phases(pt)})",
    ]
    if case.torch is None:
        cells += ["—", "—", "—", "—", "—"]
    else:
        t = case.torch
        if t.error is None:
            cells += [
                case.torch_schedule or "",
                f"**{t.total:.3f}** ({_phases(t)})",
                f"{t.total / pt.total:.1f}×",
            ]
        else:
            done = f" after {t.total:.3f} s ({_phases(t)})" if t.phases else ""
            cells += [case.torch_schedule or "", f"failed: {t.error}{done}", "—"]
        c = case.torch_constructor
        runnable = pt.total - pt.phases.get("simulate", 0.0)  # build + lower + validate
        if c is None or c.error is not None:
            cells += [f"failed: {c.error}" if c is not None else "—", "—"]
        else:
            cells += [f"{c.total:.3f}", f"{c.total / runnable:.1f}×"]
    return "| " + " | ".join(cells) + " |"


def markdown(cases: list[Case]) -> str:
    lines = [
        "| schedule | ranks × micro-batches | pipetrain s (build / lower / validate / simulate) "
        "| torch schedule | torch s (generate / validate / comms / simulate) | speed-up "
        "| torch constructor s | vs constructor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(c) for c in cases]
    return "\n".join(lines)


def environment(clock_name: str, repeat: int) -> dict[str, object]:
    env: dict[str, object] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "clock": clock_name,
        "repeat": repeat,
    }
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:
        env["torch"] = None
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: only (8 ranks, 64 micro-batches)"
    )
    parser.add_argument(
        "--no-torch", action="store_true", help="time pipetrain only (torch is not imported)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per case, best kept (default: 3)"
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="measure with time.process_time (CPU seconds) instead of time.perf_counter (wall)",
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    clock_name = "process_time" if args.cpu_time else "perf_counter"
    clock = time.process_time if args.cpu_time else time.perf_counter
    if not args.no_torch:
        _quiet_torch()
    # Freeze what is alive now (torch's modules, when imported) out of the cyclic collector's
    # view: otherwise every collection during a timed run rescans torch's large heap, which
    # slows whichever library allocates more, and the cost belongs to neither.
    gc.collect()
    gc.freeze()
    cases = run_cases(QUICK_SHAPES if args.quick else SHAPES, not args.no_torch, args.repeat, clock)
    env = environment(clock_name, args.repeat)
    print(
        f"{env['date']}, Python {env['python']}, torch {env['torch']}, {env['cpus']} CPUs, "
        f"{clock_name}, best of {args.repeat}\n"
    )
    print(markdown(cases))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "environment": env,
                    "cases": [
                        {**asdict(c), "pipetrain_total": c.pipetrain.total}
                        | ({"torch_total": c.torch.total} if c.torch else {})
                        for c in cases
                    ],
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
