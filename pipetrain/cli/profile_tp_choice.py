"""Which of ``pipetrain profile --tp``'s degrees are measured on a real group and which derived
(``--tp-measure``), decided before anything is timed, and the report's line saying so.

A degree ``t`` above 1 is measured on ``t`` worker processes
(``runtime.profile.profile_tp_measured``) where the machine can run it: on a GPU node with ``t``
GPUs visible (``auto`` and ``processes``); on a CPU only when asked (``processes``), since ``t``
gloo processes on a CPU time a CPU, which the planner of a GPU job should not take for a GPU —
it is how the tests exercise the measuring path. Every other degree is derived from the
degree-1 profile (``runtime.profile.profile_tp.with_tp``), and ``meta["tp"]["why_derived"]``
says why. Under ``auto`` a degree the model cannot be split at (a family without a
tensor-parallel plan, a head count the degree does not divide) is derived; under ``processes``
it is refused, as is a degree above the visible GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from pipetrain.cli.flags import Option, int_list, positive_float
from pipetrain.planner.costs_file import ModelCosts
from pipetrain.planner.costs_file_tp import TpCost

#: ``--tp-measure``'s values
TP_MEASURE = ("auto", "derive", "processes")


@dataclass
class TpChoice:
    """The degrees to measure and, for each derived one, why it is not measured."""

    measured: list[int]
    why_derived: dict[int, str]
    #: GB/s the derived degrees' collectives are priced at (``None``: none derived, none given)
    link_gbs: float | None
    #: how a measured degree ran, for the file and the report
    group: str = ""
    #: per measured degree, each layer's allocator peak per rank (GPU only)
    peak_gib: dict[int, list[float]] = field(default_factory=dict)
    #: per measured degree, the windows of ``--context`` layers its times were scaled by
    windows: dict[int, list[dict]] = field(default_factory=dict)

    def measure(
        self, args: argparse.Namespace, seq_len: int, device: Any, layers: int
    ) -> dict[int, list[TpCost]]:
        """Each measured degree's entries, one per layer."""
        if not self.measured:
            return {}
        from pipetrain.cli.profile_models import parallelized
        from pipetrain.runtime.profile.profile_tp_measured import measure_degree

        build = functools.partial(parallelized, args, seq_len)
        out = {}
        for t in self.measured:
            entries, peaks, windows = measure_degree(
                build,
                t,
                device.type,
                repeats=args.repeats,
                optimizer=args.optimizer,
                context=args.context,
            )
            if len(entries) != layers:  # the workers built another model than the profile's
                raise ValueError(
                    f"tensor-parallel degree {t}: the workers measured {len(entries)} layers, "
                    f"the profile {layers}"
                )
            out[t] = entries
            self.windows[t] = windows
            if peaks is not None:
                self.peak_gib[t] = peaks
        return out

    def annotate(self, costs: ModelCosts) -> ModelCosts:
        """``costs`` with the choice in ``meta["tp"]``: how the measured degrees ran, why the
        derived ones were derived, the measured layers' allocator peaks."""
        tp = dict(costs.meta["tp"])
        if self.measured:
            tp["measured_on"] = self.group
        if self.why_derived:
            tp["why_derived"] = {str(t): why for t, why in sorted(self.why_derived.items())}
        if self.peak_gib:
            tp["peak_gib"] = {str(t): peaks for t, peaks in sorted(self.peak_gib.items())}
        if any(self.windows.values()):
            tp["windows"] = {str(t): w for t, w in sorted(self.windows.items())}
        return dataclasses.replace(costs, meta={**costs.meta, "tp": tp})


def tp_options() -> tuple[Option, ...]:
    """``profile``'s tensor-parallel flags."""
    return (
        Option(
            ("--tp",),
            type=int_list,
            default=[1],
            metavar="T1,T2,...",
            help="tensor-parallel degrees to write per layer (1,2,4,8: each layer's compute, "
            "collectives and memory per rank at each; each entry above 1 measured or derived, "
            "as --tp-measure says, and marked so)",
            shown_default="1",
        ),
        Option(
            ("--tp-measure",),
            default="auto",
            choices=TP_MEASURE,
            help="how the --tp degrees above 1 are had: auto measures each on that many GPUs "
            "where they are visible and derives the rest (all of them on a CPU); derive: all "
            "derived from one process; processes: all measured on that many worker processes "
            "(gloo on a CPU: it times the CPU, for tests)",
        ),
        Option(
            ("--link-gbs",),
            type=positive_float,
            metavar="GB/s",
            help="GB/s one GPU sends at inside a tensor-parallel group, to price the derived "
            "degrees' collectives (needed on a GPU where some degree is derived; on a CPU "
            "default the profiler's gloo model)",
            shown_default="",
        ),
    )


def tp_choice(args: argparse.Namespace, model: Any, device: Any) -> TpChoice:
    """``--tp-measure`` applied to ``--tp``'s degrees on ``device`` for ``model`` (which says
    ``tp_refusal(degree)``); ``ValueError`` for what cannot be done as asked."""
    import torch

    extra = sorted({t for t in args.tp if t > 1})
    mode = args.tp_measure
    if mode != "auto" and not extra:
        raise ValueError(f"--tp-measure {mode} applies to --tp degrees above 1; give --tp 1,2,...")
    cuda = device.type == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    why: dict[int, str] = {}
    for t in extra:
        refusal = model.tp_refusal(t)
        if mode == "derive":
            why[t] = "--tp-measure derive"
        elif refusal is not None:
            why[t] = refusal
        elif cuda and t > gpus:
            why[t] = f"needs {t} GPUs, {gpus} visible"
        elif args.timing == "device":
            why[t] = "--timing device (a group is timed with the wall clock)"
        elif not cuda and mode == "auto":
            why[t] = "on a CPU (--tp-measure processes to measure on gloo processes anyway)"
        if mode == "processes" and t in why:
            raise ValueError(
                f"--tp-measure processes: degree {t}: {why[t]}; --tp-measure auto derives it"
            )
    measured = [t for t in extra if t not in why]
    link = args.link_gbs
    if why and link is None:
        if cuda:
            raise ValueError(
                f"--tp degrees {', '.join(map(str, sorted(why)))} are derived on this GPU node "
                "and their collectives priced at --link-gbs: give the GB/s one GPU sends at "
                "within a node (e.g. NVLink's)"
            )
        from pipetrain.runtime.profile.profile_layers import CPU_BANDWIDTH

        link = CPU_BANDWIDTH / 1e9
    group = f"{'NCCL on GPUs' if cuda else 'gloo on CPU processes'}, one process per rank"
    return TpChoice(measured=measured, why_derived=why, link_gbs=link, group=group)


def tp_line(costs: ModelCosts) -> str | None:
    """The report's line: which degrees were measured (and on what) and which derived (and
    why); ``None`` without tensor-parallel entries."""
    tp = costs.meta.get("tp")
    if not tp:
        return None
    parts = []
    if tp.get("measured"):
        on = f" ({tp['measured_on']})" if "measured_on" in tp else ""
        parts.append(f"{', '.join(map(str, tp['measured']))} measured{on}")
    if tp.get("derived"):
        why = sorted(set(tp.get("why_derived", {}).values()))
        link = f", collectives at {costs.tp_link_gbs:g} GB/s" if costs.tp_link_gbs else ""
        reason = f": {'; '.join(why)}" if why else ""
        parts.append(f"{', '.join(map(str, tp['derived']))} derived (products split{link}){reason}")
    degrees = ", ".join(map(str, costs.tp_degrees))
    return f"tensor parallel: degrees {degrees} per layer; {'; '.join(parts)}"
