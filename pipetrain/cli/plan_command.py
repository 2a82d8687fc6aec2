"""``pipetrain plan``: read a costs file, search, print the pick (JSON, or its timeline, its
memory per rank over the step against the budget, and a table of each family's best; an SVG on
request). ``--ranks P`` plans the pipeline alone on P ranks; ``--gpus N`` plans pp × tp × dp on N
GPUs (``planner.nd_search``) and prints each shape's best beside the pick. ``--explain`` says why
the pick beat the runner-up (``planner.nd_explain``). Bad input raises ``ValueError`` (the
command line exits 2 with it); so does a budget nothing fits, not even with full recompute
(``NoPlanFits``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from pipetrain.cli import synthesize_command
from pipetrain.cli.budget_flags import BUDGET, COSTS
from pipetrain.cli.flags import Command, Option, int_list, one_positive_int, positive_float
from pipetrain.planner.costs_file import ModelCosts, load_costs
from pipetrain.planner.costs_file_moe import unpriced_note, with_ep_link
from pipetrain.planner.judge import Candidate, stage_costs
from pipetrain.planner.nd_explain import explain, shape_table, title
from pipetrain.planner.nd_search import (
    DATA_PARALLEL,
    Cluster,
    NdPlan,
    NdSearch,
    Shape,
    nd_search,
    shape_costs,
)
from pipetrain.planner.recompute_modes import describe, stage_recompute
from pipetrain.planner.search import NoPlanFits, Search, search
from pipetrain.planner.synthesize import Synthesis, synthesize_plan
from pipetrain.schedule.registry import build_schedule
from pipetrain.sim.all_to_all import all_to_all_share
from pipetrain.sim.costs import per_rank


def milliseconds(text: str) -> float:
    """A finite number of milliseconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of ms >= 0, got {text!r}")
    return value


OPTIONS = (
    COSTS,
    Option(
        ("--ranks", "-p"),
        type=one_positive_int,
        metavar="P",
        help="plan the pipeline alone on P ranks (give --ranks or --gpus)",
    ),
    Option(
        ("--gpus",),
        type=one_positive_int,
        metavar="N",
        help="plan pipeline x tensor x data parallel on N GPUs (give --ranks or --gpus)",
    ),
    Option(
        ("--gpus-per-node",),
        type=one_positive_int,
        default=8,
        metavar="G",
        help="with --gpus: GPUs per node (a tensor-parallel group stays in one)",
    ),
    Option(
        ("--link-gbs",),
        type=positive_float,
        metavar="GB/s",
        help="with --gpus: GB/s one GPU sends at within a node (data-parallel sync inside a node; "
        "default: the costs file's tp_link_gbs, else 100)",
        shown_default="",
    ),
    Option(
        ("--node-link-gbs",),
        type=positive_float,
        default=25.0,
        metavar="GB/s",
        help="with --gpus: GB/s one GPU sends at to other nodes (data-parallel sync across nodes)",
    ),
    Option(
        ("--data-parallel",),
        default="fsdp",
        choices=DATA_PARALLEL,
        help="with --gpus: how replicas sync, as train --data-parallel (fsdp shards the "
        "optimizer state over dp)",
    ),
    *BUDGET,
    Option(
        ("--microbatches", "-m"),
        type=int_list,
        metavar="M1,M2,...",
        help="micro-batch counts to try (default: 1, 2 and 4 x ranks)",
    ),
    Option(
        ("--schedules",),
        metavar="A,B,...",
        help="families to search (default: every family Pipeline runs; see `pipetrain schedules`)",
    ),
    Option(("--global-batch",), type=one_positive_int, metavar="B", help="fixed global batch"),
    Option(
        ("--micro-batch-size",),
        type=one_positive_int,
        metavar="b",
        help="micro-batch size (with B)",
    ),
    Option(
        ("--cuda-graph",),
        switch=True,
        help="plan a run replayed as a CUDA graph (train --cuda-graph): no activation offload, "
        "which a captured step refuses; no host times; recomputing stages split their backward "
        "as a captured step runs them; profile its costs with --timing device",
    ),
    Option(
        ("--ep-link-gbs",),
        type=positive_float,
        metavar="GB/s",
        help="GB/s each rank sends at over the expert-parallel link: prices each MoE layer's "
        "dispatch and combine all-to-all from the costs file's dispatched_bytes, forward and "
        "backward, as a resource an overlapped F&B pair hides (DualPipeV); overrides the costs "
        "file's ep_link_gbs",
        shown_default="the costs file's, else not priced",
    ),
    Option(
        ("--host-action-ms",),
        type=milliseconds,
        metavar="MS",
        help="eager plans: the pipeline runtime's own host time per action on the host that "
        "will train (what `pipetrain train` prints on its host: line); overrides the costs "
        "file's host_action_ms",
    ),
    Option(("--json",), switch=True, help="print the pick as one JSON object"),
    Option(
        ("--explain",),
        switch=True,
        help="say why the pick beat the runner-up: compute, collectives, recompute, bubble, "
        "data-parallel sync and memory, in ms per global micro-batch",
    ),
    Option(
        ("--synthesized",),
        switch=True,
        help="with --ranks: also synthesize a schedule for these costs under the same budget "
        "and show it beside the pick; with --json, print it instead where it is faster "
        "(docs/synthesis.md; `pipetrain synthesize` writes it)",
    ),
    Option(
        ("--svg",),
        metavar="FILE",
        help="write the pick's simulated step as an SVG, with memory per rank against the budget",
    ),
    Option(
        ("--width",),
        type=one_positive_int,
        default=100,
        metavar="COLS",
        help="timeline width",
        shown_default="",
    ),
)


def run(args: argparse.Namespace) -> int:
    if (args.ranks is None) == (args.gpus is None):
        raise ValueError(
            "give exactly one of --ranks P (the pipeline alone on P ranks) and --gpus N "
            "(pipeline x tensor x data parallel on N GPUs)"
        )
    costs = load_costs(args.costs)
    costs = with_ep_link(costs, args.ep_link_gbs)
    if unpriced_note(costs):
        print(f"note: {unpriced_note(costs)}", file=sys.stderr)
    if args.host_action_ms is not None:
        costs = dataclasses.replace(costs, host_action_ms=args.host_action_ms)
    note = timing_note(costs.meta.get("timing", "wall"), args.cuda_graph, costs)
    if args.cuda_graph:  # a replay issues nothing per action; recomputing stages split
        costs = costs.for_captured_step()
    if args.gpus is not None:
        if args.synthesized:
            raise ValueError("--synthesized plans the pipeline alone: give --ranks, not --gpus")
        if note:
            print(f"note: {note}", file=sys.stderr)
        return run_nd(args, costs)
    found = search(
        costs,
        num_ranks=args.ranks,
        memory_gib=args.memory_gib,
        headroom=args.headroom,
        microbatches=args.microbatches,
        schedules=[s.strip() for s in args.schedules.split(",")] if args.schedules else None,
        global_batch=args.global_batch,
        micro_batch_size=args.micro_batch_size,
        offload=not args.cuda_graph,
    )
    if note:
        print(f"note: {note}", file=sys.stderr)
    best = found.best  # NoPlanFits (a ValueError) when nothing fits: exit 2
    _write_svg(args, costs, best)
    synthesized = _synthesized(costs, found) if args.synthesized else None
    if args.json:
        plan = best.plan.to_json()
        if synthesized is not None and _faster(synthesized, best):
            plan = synthesize_command.plan_json(synthesized)
        print(json.dumps(plan))
        return 0
    _draw(args, costs, best)
    print()
    print(format_plan(found))
    print_all_to_all(costs, best)
    if args.explain:
        others = [c for c in found.best_per_family() if c.plan.fits and c is not best]
        pair = [_alone(c) for c in (best, *others[:1])]
        print("\n".join(["", *explain(pair[0], pair[1] if others else None, costs)]))
    if synthesized is not None:
        written = "the synthesized plan" if _faster(synthesized, best) else "the pick (no faster)"
        print("\n" + synthesize_command.describe(synthesized))
        print(f"--json writes {written}: `pipetrain train --plan` runs it")
    if args.svg:
        print(f"wrote {args.svg}")
    return 0


def _synthesized(costs: ModelCosts, found: Search) -> Synthesis | None:
    """``--synthesized``: a schedule synthesized for these costs at the counts searched; None,
    said on standard error, where only offloading plans fit (the synthesis plans no offload)."""
    try:
        return synthesize_plan(costs, found)
    except NoPlanFits as e:
        print(f"note: --synthesized: nothing synthesized ({e})", file=sys.stderr)
        return None


def _faster(synthesized: Synthesis, pick: Candidate) -> bool:
    """Whether the synthesized plan beats the pick per micro-batch (a tie keeps the family's)."""
    return synthesized.ms_per_microbatch < pick.plan.ms_per_microbatch * (1 - 1e-9)


def _alone(c: Candidate) -> NdPlan:
    """A pipeline-only candidate as an N-D plan of tp 1 and dp 1 (no sync)."""
    ranks = c.plan.ranks
    return NdPlan(
        shape=Shape(ranks, 1, 1), candidate=c, sync_ms=(0.0,) * ranks, step_ms=c.plan.step_ms
    )


def run_nd(args: argparse.Namespace, costs: ModelCosts) -> int:
    """``--gpus``: the pp × tp × dp search, the pick drawn as for ``--ranks``, each shape's best."""
    cluster = Cluster(
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        link_gbs=args.link_gbs or costs.tp_link_gbs or 100.0,
        node_link_gbs=args.node_link_gbs,
    )
    found = nd_search(
        costs,
        cluster,
        memory_gib=args.memory_gib,
        headroom=args.headroom,
        data_parallel=args.data_parallel,
        microbatches=args.microbatches,
        global_batch=args.global_batch,
        micro_batch_size=args.micro_batch_size,
        schedules=[s.strip() for s in args.schedules.split(",")] if args.schedules else None,
        offload=not args.cuda_graph,
        keep=2 if args.explain else 1,
    )
    best = found.best  # NoPlanFits when no shape has a plan: exit 2
    at = shape_costs(costs, best.shape, args.data_parallel)
    _write_svg(args, at, best.candidate)
    if args.json:
        print(json.dumps(best.to_json()))
        return 0
    _draw(args, at, best.candidate)
    print()
    print(format_nd(found, costs))
    print_all_to_all(at, best.candidate)
    if args.explain:
        print("\n".join(["", *explain(best, found.runner_up, costs)]))
    if args.svg:
        print(f"wrote {args.svg}")
    return 0


def print_all_to_all(costs: ModelCosts, c: Candidate) -> None:
    """The pick's expert all-to-all per rank and the share its pairs hide, where it is priced."""
    if not costs.ep_link_gbs:
        return
    plan = c.plan
    program = build_schedule(plan.schedule, plan.ranks, plan.microbatches, plan.stages_per_rank)
    share = all_to_all_share(program, stage_costs(costs, program, plan.stage_layers))
    per_rank = " ".join(f"{t:.2f}" for t in share.total)
    at = f"all-to-all at {costs.ep_link_gbs:g} GB/s: ms per rank {per_rank}, "
    print(at + f"{share.hidden_share:.1%} hidden under compute by overlapped F&B pairs")


def format_nd(found: NdSearch, costs: ModelCosts) -> str:
    """The pick with its predicted step, tokens per second and per-rank peak, then each shape's
    best."""
    best = found.best
    p = best.plan
    tokens = best.tokens_per_s
    degrees = ",".join(map(str, costs.tp_degrees))
    lines = [
        f"plan: {title(best)}, stage_layers {list(p.stage_layers)}",
        f"predicted: step {best.step_ms:.3f} ms (pipeline {p.step_ms:.3f} + data-parallel sync "
        f"{best.step_ms - p.step_ms:.3f}), {best.ms_per_global_microbatch:.4f} ms per global "
        "micro-batch"
        + ("" if tokens is None else f", {tokens:,.0f} tokens/s")
        + f", bubble {p.bubble_fraction:.1%}, peak GiB per rank "
        + " ".join(f"{x:.2f}" for x in p.peak_gib)
        + f" (budget {p.memory_gib:g}, {p.usable_gib:.3g} after {p.headroom:.0%} headroom)",
        f"data parallel: {found.data_parallel}; tensor-parallel degrees in the costs file: {degrees}",
        "",
        "best plan of each pp x tp x dp shape:",
        *shape_table(found),
    ]
    return "\n".join(lines)


def _write_svg(args: argparse.Namespace, costs: ModelCosts, best: Candidate) -> None:
    if not args.svg:
        return
    from pipetrain.render.svg import render_svg

    Path(args.svg).write_text(
        render_svg(
            best.timeline,
            title=f"plan: {best.plan.schedule}, stage_layers {list(best.plan.stage_layers)}",
            memory=True,
            static=static_per_rank(costs, best),
            limit=best.plan.usable_gib,
        )
    )


def _draw(args: argparse.Namespace, costs: ModelCosts, best: Candidate) -> None:
    """The pick's timeline and its memory per rank against the budget."""
    from pipetrain.render.memory_chart import render_memory_text
    from pipetrain.render.text import render_text

    print(render_text(best.timeline, width=args.width, color=False))
    print(
        render_memory_text(
            best.timeline,
            width=args.width,
            static=static_per_rank(costs, best),
            limit=best.plan.usable_gib,
            unit="GiB",
        )
    )


def timing_note(timing: object, cuda_graph: bool, costs: ModelCosts | None = None) -> str:
    """What to say where the costs were timed for another kind of step than the one planned
    (``runtime.profile.profile_clock``: wall time is an eager step's, device time a graphed one's), or
    where an eager plan's host model lacks the runtime's own host time per action."""
    if cuda_graph and timing != "device":
        return (
            "--cuda-graph with costs timed on the wall clock (host waits included): a replayed "
            "step pays the device's time alone and runs faster than predicted; profile with "
            "--timing device"
        )
    if not cuda_graph and timing == "device":
        return (
            "costs timed as the device's busy time (for a graphed run): an eager step also "
            "waits for the host and runs slower than predicted; add --cuda-graph, or profile "
            "with --timing wall"
        )
    if not cuda_graph and costs is not None and costs.has_issue_times and not costs.host_action_ms:
        return (
            "the costs give each piece's host and device time but no host_action_ms (the "
            "pipeline runtime's own host time per action, read off a measured eager step on the "
            "host that will train): taken as 0, so host-bound eager steps run slower than "
            "predicted"
        )
    return ""


def static_per_rank(costs: ModelCosts, c: Candidate) -> tuple[float, ...]:
    """Each rank's static memory (GiB), as the planner counted it (the chart draws the step's
    activations above it; the optimizer's update, which may set the peak, comes after the step)."""
    plan = c.plan
    program = build_schedule(plan.schedule, plan.ranks, plan.microbatches, plan.stages_per_rank)
    static = stage_costs(costs, program, plan.stage_layers).per_stage(program.num_stages).static
    return tuple(per_rank(static, program.placement.rank_of_stage, plan.ranks))


def format_plan(found: Search) -> str:
    """The pick in words (what each stage recomputes, when nothing fitted without), then each
    family's best (step ms, bubble, peak GiB, fits, recompute: ``f`` full, ``s`` selective,
    ``-`` none per stage, ``f3`` full on the stage's first 3 layers)."""
    best = found.best.plan
    lines = [
        f"plan: {best.schedule}, {best.ranks} ranks x {best.stages_per_rank} stage(s), "
        f"{best.microbatches} micro-batches, stage_layers {list(best.stage_layers)}",
        f"predicted: step {best.step_ms:.3f} ms ({best.ms_per_microbatch:.3f} ms per micro-batch), "
        f"bubble {best.bubble_fraction:.1%}, peak GiB per rank "
        + " ".join(f"{p:.2f}" for p in best.peak_gib)
        + f" (budget {best.memory_gib:g}"
        + (
            f", {best.usable_gib:.3g} after {best.headroom:.0%} headroom)" if best.headroom else ")"
        ),
    ]
    if found.recompute_tried:
        lines.append(
            "no plan fits without recompute: "
            + (
                f"recompute per stage {list(best.recompute)}"
                if best.layout.recomputes
                else "recompute per stage none"
            )
            + " (full: each layer keeps its input and runs its forward again in the backward; "
            "selective: keeps matmul outputs; full:K, selective:K: the stage's first K layers "
            "only; whole: the stage keeps its input and runs its forward again as one region; "
            "docs/planning.md)"
        )
        if best.layout.offloads:
            lines.append(
                f"offload per stage {list(best.offload)} (the share of its activations each "
                "stage keeps in host memory between forward and backward; docs/runtime.md)"
            )
    names = best.stage_layer_names()
    if names:
        lines.append(
            "stages: "
            + "; ".join(
                f"{s}: {_span(n)}" + _recomputed(n, mode)
                for s, (n, mode) in enumerate(zip(names, best.recompute))
            )
        )
    lines += ["", "best plan of each family:", *_family_table(found)]
    if found.skipped:
        lines.append(
            f"({len(found.skipped)} shapes skipped: not legal for their family, the same "
            "program as an earlier family's (interleaved 1F1B with one stage per rank is 1F1B), "
            "or the family splits the backward and the costs file has no "
            "backward_input/backward_weight)"
        )
    return "\n".join(lines)


def _family_table(found: Search) -> list[str]:
    """One row per family's best plan, the columns padded to their widest cell."""
    header = (
        "schedule",
        "v",
        "M",
        "step ms",
        "ms/mb",
        "bubble",
        "peak GiB",
        "fits",
        "recompute",
        "stage_layers",
    )
    rows = [header]
    for c in found.best_per_family():
        p = c.plan
        rows.append(
            (
                p.schedule,
                str(p.stages_per_rank),
                str(p.microbatches),
                f"{p.step_ms:.3f}",
                f"{p.ms_per_microbatch:.3f}",
                f"{p.bubble_fraction:.1%}",
                f"{max(p.peak_gib):.2f}",
                "yes" if p.fits else "no",
                describe(p.recompute),
                ",".join(map(str, p.stage_layers)),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    return ["  ".join(f"{cell:<{w}}" for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows]


COMMAND = Command(
    name="plan",
    help="pick schedule, micro-batches and cut from a costs file",
    options=lambda: OPTIONS,
    run=run,
)


def _span(names: list[str]) -> str:
    return names[0] + (f"..{names[-1]}" if len(names) > 1 else "")


def _recomputed(names: list[str], mode: str) -> str:
    """Which of a stage's layers recompute, where only its first K do (`` (full: a..b)``)."""
    spec = stage_recompute(mode)
    if spec.layers is None:
        return ""
    return f" ({spec.mode.value}: {_span(names[: spec.layers])})"
