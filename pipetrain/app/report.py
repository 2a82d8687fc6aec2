"""What ``pipetrain train`` shows: the progress line while it trains, then the end-of-run report —
the loss trend, the measured step next to the simulator's prediction from the measured per-stage
F/I/W/B times, the measured step drawn in the terminal and written as SVG.

Apart from the loop because it reads only numbers and timelines, no torch: the measured and the
simulated step are the same ``Timeline`` type, so predicted against measured is the simulator and
the renderers applied to what the runtime measured (docs/design.md, "The idea").
"""

from __future__ import annotations

import os
import shutil
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import fmean
from typing import Any

from pipetrain.schedule.action import OpKind
from pipetrain.schedule.program import describe_shape
from pipetrain.schedule.timeline import Timeline
from pipetrain.sim.costs import mean_durations, measured_costs

LOSS_WINDOW = 5  # first/last steps averaged to say whether the loss went down


class Progress:
    """One updating line on a TTY; otherwise a line every tenth of the run."""

    def __init__(self, total: int, enabled: bool, start: int = 0) -> None:
        self.total, self.enabled, self.start = total, enabled, start
        self.tty = enabled and sys.stdout.isatty()
        self.every = max(1, total // 10)
        self.rates: list[float] = []

    def update(
        self, step: int, loss: float, tokens_per_s: float, grad_norm: float | None = None
    ) -> None:
        if not self.enabled:
            return
        self.rates = [*self.rates[-9:], tokens_per_s]  # smooth over the last 10 steps
        rate = fmean(self.rates) if step > self.start + 1 else tokens_per_s
        done = int(30 * step / self.total)
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * done}{'.' * (30 - done)}] "
            f"loss {loss:.4f}  {rate:,.0f} tok/s"
        )
        if grad_norm is not None:
            line += f"  grad norm {grad_norm:.3f}"
        if self.tty:
            print(f"\r{line}\x1b[K", end="", flush=True)  # \x1b[K: clear the rest of the line
        elif step % self.every == 0 or step in (self.start + 1, self.total):
            print(line, flush=True)

    def note(self, text: str) -> None:
        """A line of its own under the progress line (an evaluation's loss)."""
        if self.enabled:
            print(("\n" if self.tty else "") + text, flush=True)

    def close(self) -> None:
        if self.tty:
            print(flush=True)


def _costs_table(timelines: Sequence[Timeline], num_stages: int) -> str:
    """Mean measured ms per (stage, kind); kinds the schedule never ran are left out."""
    mean = mean_durations(timelines)
    kinds = [k for k in OpKind if any((k, s) in mean for s in range(num_stages))]
    names = {OpKind.OVERLAP_F_B: "F&B"}
    head = "".join(f"{names.get(k, k.value):>8}" for k in kinds)
    lines = [f"mean time per action in that step (ms)\n  stage{head}"]
    for s in range(num_stages):
        cells = (mean.get((k, s)) for k in kinds)
        lines.append(f"  {s:>5}" + "".join("       -" if c is None else f"{c:8.2f}" for c in cells))
    return "\n".join(lines)


def report(
    svg: str | os.PathLike,
    losses: Sequence[float],
    measured: Sequence[Timeline],
    program: Any,
    cpu_processes: int = 0,
    planned: Mapping[str, Any] | None = None,
    unmeasured: str = "the runtime returned none",
    trace: str | os.PathLike | None = None,
    extra_losses: Mapping[str, float] | None = None,
    programs: Sequence[Any] | None = None,
    step_counts: Sequence[int] | None = None,
) -> str:
    """The end-of-run text: loss trend, measured vs simulated bubble, pictures (writes the
    measured step as SVG to ``svg``, and as a Chrome/Perfetto trace to ``trace`` if given).

    ``cpu_processes``: how many processes of the run shared this machine's CPU cores (0: they
    ran on GPUs); with more processes than cores the measured times include waiting for a core.
    ``planned``: the ``predicted`` record of the plan the run followed (``pipetrain plan
    --json``), shown next to the measured step. ``unmeasured``: why ``measured`` is empty.
    ``extra_losses``: the last step's extra loss terms (``Pipeline.extra_losses``: a router's
    balancing loss), shown beside its loss. ``programs``: the program each measured step ran,
    in ``measured``'s order (None: ``program`` for every one). Under a token budget
    (``--global-batch-tokens``) each step runs the micro-batch count its documents fill, with the
    pipeline's program of that count (``runtime.microbatch_counts``): the median step is
    simulated with its own program, not the run's nominal one, whose count its timeline may not
    hold. ``step_counts``: every step's micro-batch count, summarised in one line.
    """
    k = max(1, min(LOSS_WINDOW, len(losses) // 4))
    first, last = fmean(losses[:k]), fmean(losses[-k:])
    verdict = (
        f"the loss went DOWN by {100 * (first - last) / first:.0f}%"
        if last < first
        else "the loss did NOT go down"
    )
    lines = [f"loss {first:.4f} → {last:.4f} (mean of the first vs last {k} steps): {verdict}"]
    if extra_losses:
        lines.append(_extra_line(losses[-1], extra_losses))
    if step_counts:
        lines.append(counts_line(step_counts))
    if not measured:
        return "\n".join([*lines, f"(no measured timeline: {unmeasured})"])
    from pipetrain.sim.simulate import simulate

    step, program = _median_step(measured, program, programs)
    title = describe_shape(
        program.name,
        program.num_ranks,
        program.placement.stages_per_rank,
        program.num_microbatches,
    )
    costs = measured_costs([step], program.num_stages)
    predicted = simulate(program, costs)
    lines += [
        f"measured step:   makespan {step.makespan:8.2f} ms   bubble {step.bubble_fraction:6.1%}"
        f"   (the median of the last {len(measured)} steps)",
        _costs_table([step], program.num_stages),
        f"simulated step:  makespan {predicted.makespan:8.2f} ms   bubble "
        f"{predicted.bubble_fraction:6.1%}   (from the measured times above, communication "
        f"taken as free{_count_note(program, step_counts)})",
    ]
    if step.host_spans:
        lines.append(_host_line(step))
    if planned:
        lines.append(_planned_line(planned, step))
    lines += _cpu_note(cpu_processes, planned is not None)
    lines += _pictures(Path(svg), step, title)
    if trace is not None:
        from pipetrain.render.trace import write_trace

        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        write_trace(step, trace)
        lines.append(f"wrote {trace}")
    return "\n".join(lines)


def run_report(config: Any, steps: Any, pipe: Any, cpu_processes: int) -> str:
    """The end-of-run text of ``pipetrain train``'s loop (``app.train``: its ``TrainConfig``, its
    ``Steps`` and its ``Pipeline``): ``report`` on the measured steps, each simulated with the
    program its own micro-batch count ran (``--global-batch-tokens``), then what the run
    skipped, evaluated, wrote and exported."""
    options: dict[str, Any] = {
        "trace": config.trace,
        "extra_losses": pipe.extra_losses,  # the last step's (a router's), beside its loss
        "programs": steps.measured_programs,
        "step_counts": steps.counts,
    }
    if config.cuda_graph:
        options["unmeasured"] = "each step replayed as one CUDA graph"
    planned = _planned(config.plan)
    measured = (config.svg, steps.losses, steps.measured, pipe.program, cpu_processes, planned)
    text = report(*measured, **options)
    skipped = steps.skips.steps
    if skipped:
        shown = ", ".join(map(str, skipped[:10])) + (" ..." if len(skipped) > 10 else "")
        text += f"\nskipped the update of {len(skipped)} step(s) whose loss or gradient norm "
        text += f"was not finite (--on-nonfinite skip): {shown}"
    if steps.evals:
        at, loss = steps.evals[-1]
        text += f"\neval loss {loss:.4f} at step {at} (token mean over --eval-data)"
    if config.metrics is not None:
        from pipetrain.app.metrics_chart import write_chart

        text += f"\nmetrics in {config.metrics}; drawn in {write_chart(config.metrics)}"
    if config.checkpoint_dir:
        text += f"\ncheckpoints in {config.checkpoint_dir} (latest: step {config.steps})"
    if config.export is not None:
        text += f"\nexported to {config.export} (a Hugging Face model folder)"
    return text


def _planned(plan_file: str | None) -> dict[str, Any] | None:
    """The ``predicted`` record of ``--plan FILE`` (checked before launch), if it has one."""
    if plan_file is None:
        return None
    import json

    predicted = json.loads(Path(plan_file).read_text()).get("predicted")
    return predicted if isinstance(predicted, dict) else None


def _median_step(
    measured: Sequence[Timeline], program: Any, programs: Sequence[Any] | None
) -> tuple[Timeline, Any]:
    """The median measured step (by makespan) and the program it ran."""
    ran = list(programs) if programs is not None else [program] * len(measured)
    if len(ran) != len(measured):
        raise ValueError(f"{len(ran)} programs for {len(measured)} measured steps: give one each")
    median = sorted(range(len(measured)), key=lambda i: measured[i].makespan)[len(measured) // 2]
    return measured[median], ran[median]


def counts_line(step_counts: Sequence[int]) -> str:
    """How many steps ran each micro-batch count, fewest micro-batches first: under a token budget
    a step's count follows its documents."""
    tally = Counter(step_counts)
    shown = ", ".join(f"{n} ({tally[n]} step{'s' if tally[n] > 1 else ''})" for n in sorted(tally))
    return f"micro-batches per step: {shown}"


def _count_note(program: Any, step_counts: Sequence[int] | None) -> str:
    """Which count's program simulated the step, where steps ran several."""
    if not step_counts or len(set(step_counts)) < 2:
        return ""
    return f"; with the program of its own {program.num_microbatches} micro-batches"


def _extra_line(loss: float, extra_losses: Mapping[str, float]) -> str:
    """The last step's loss beside the extra terms it trained with: the loss the report follows
    is the model's own, and the terms are what the optimizer minimised besides."""
    terms = "  ".join(f"{name} {value:.6g}" for name, value in extra_losses.items())
    return (
        f"last step:       loss {loss:.4f}  {terms}  (the terms, averaged over micro-batches, "
        "were trained beside the loss)"
    )


def _host_line(step: Timeline) -> str:
    """The hosts' share of an eager GPU step: how long each rank's host took to issue its
    actions, and its mean time between them (the costs file's ``host_action_ms``)."""
    busy = [0.0] * step.num_ranks
    for s in step.host_spans:
        busy[s.rank] += s.duration
    gaps = [gap for row in step.host_gaps for gap in row]
    between = fmean(gaps) if gaps else 0.0
    return (
        f"host:            issuing {max(busy):8.2f} ms on its busiest rank, {between:.3f} ms "
        "between actions (the runtime's own: a costs file's host_action_ms for planning eager "
        "steps)"
    )


def _planned_line(planned: Mapping[str, Any], step: Timeline) -> str:
    """The plan's predicted step next to the measured one."""
    ms = float(planned.get("step_ms", float("nan")))
    bubble = planned.get("bubble_fraction")
    shown = f"   bubble {float(bubble):6.1%}" if bubble is not None else ""
    ratio = f"measured/planned {step.makespan / ms:.2f}" if ms > 0 else "no step time in the plan"
    return (
        f"planned step:    makespan {ms:8.2f} ms{shown}   (the plan's prediction, from its costs "
        f"file; {ratio})"
    )


def _cpu_note(processes: int, planned: bool) -> list[str]:
    """Why measured times on a CPU differ from a profile's and include waiting."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if not processes or not cores:
        return []
    notes = []
    if processes > cores:
        notes.append(
            f"note: {processes} processes share {cores} CPU cores, so measured times include "
            "waiting for a core"
        )
    if planned:
        notes.append(
            f"note: the plan's costs were profiled in one process with the machine's cores to "
            f"itself; here {processes} processes of one thread each share {cores} cores, so its "
            "prediction and the measured step differ on a CPU (on GPUs, a device each, they "
            "agree closely: docs/planning.md)"
        )
    return notes


def _pictures(path: Path, step: Timeline, title: str) -> list[str]:
    from pipetrain.render.svg import render_svg
    from pipetrain.render.text import render_text

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_svg(step, title=f"{title} — measured (ms)"))
    width = shutil.get_terminal_size().columns
    return ["", f"{title} — measured step (ms)", render_text(step, width), f"wrote {path}"]


__all__ = ["LOSS_WINDOW", "Progress", "counts_line", "report", "run_report"]
