"""Discrete-event simulation of a program under a cost model.

The model (the one the ZB paper, Qi et al. 2024 §2 and Table 2, uses to state its bubbles):

* each rank runs its compute actions in program order, one at a time;
* an action starts when its rank is free and every value it needs (``deps.requires``) has
  arrived; it lasts its stage's cost (``F``, ``B``, ``I``, ``W``; an overlapped pair lasts
  ``forward_backward`` of its forward stage, default its forward plus its backward);
* a value produced on one rank and needed on another arrives ``comm`` (of the producing stage)
  after its producer ends: the latency is paid on every dependency that crosses ranks — F→F
  downstream, B/I→B/I upstream — and on nothing that stays on a rank (the last stage's F→B turn,
  the V turn between a rank's two stages);
* SEND/RECV actions in a lowered program cost nothing themselves: communication is the latency
  above, so the same program simulates the same lowered or not;
* OFFLOAD/RELOAD copies (``schedule.offload``) run on the rank's copy engine, one queue per
  direction, beside compute (``schedule.copy_engine``: PipeOffload, arXiv 2503.01328); how long
  each lasts, when the backward of an offloaded micro-batch may start, and what the copies free
  and take back (``Timeline``) is ``sim.offload_model``'s: the share in one copy after the
  forward, or layer by layer where a stage has ``layers`` > 1;
* with ``host`` and ``device`` costs (an eager GPU step), each rank is a host that issues its
  actions one after another and a device that runs them as they come (``schedule.execute``);
* with ``microbatch_weights`` (and its ``_i``, ``_w``), an F, I or W of micro-batch ``m`` lasts
  its stage's cost times that kind's weight of ``m``, a B its I and W shares so weighted, an
  overlapped pair its parts so weighted (a measured pair's time scaled alike): a step of
  unequal micro-batches (packed documents of unequal attention work, ``planner.varlen``) is
  priced as such; memory and copies are not weighted (``sim.costs``);
* with ``all_to_all`` (a mixture-of-experts stage's expert all-to-all), a lone F, B or I also
  waits for its stage's, and an overlapped pair hides each half's under the other half's compute
  (``sim.costs.overlapped_pair``); how much each rank hides is ``sim.all_to_all``'s.

Activations are accounted by the ``Timeline`` (held from the start of F to the end of the last
backward piece, times the stage's activation size). The event loop is ``schedule.execute``, the
same one lowering uses; this module supplies the durations and latencies.
"""

from __future__ import annotations

from statistics import fmean

from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.execute import run
from pipetrain.schedule.gc_pause import without_gc
from pipetrain.schedule.offload import ReloadTiming
from pipetrain.schedule.program import Program
from pipetrain.schedule.timeline import Timeline
from pipetrain.sim.costs import Costs, StageCosts, overlapped_pair
from pipetrain.sim.offload_model import offload_stages, stage_offload


def duration(action: Action, costs: StageCosts) -> float:
    """How long a compute action takes under ``costs``: its compute plus the all-to-all it waits
    for (``all_to_all_of``); an overlapped pair's measured time, else ``overlapped_pair`` of its
    halves."""
    match action.kind:
        case OpKind.F | OpKind.B | OpKind.I | OpKind.W:
            return compute_of(action, costs) + all_to_all_of(action, costs)
        case OpKind.OFFLOAD:
            return stage_offload(costs, action.stage).plan.offload
        case OpKind.RELOAD:
            return stage_offload(costs, action.stage).plan.reload
        case OpKind.OVERLAP_F_B:
            pair = costs.forward_backward[action.stage]
            if pair is not None:
                return pair
            forward, backward = action.parts
            return overlapped_pair(
                compute_of(forward, costs),
                all_to_all_of(forward, costs),
                compute_of(backward, costs),
                all_to_all_of(backward, costs),
            )
        case _:
            raise TypeError(f"communication has no duration of its own: {action}")


def compute_of(action: Action, costs: StageCosts) -> float:
    """A plain F, B, I or W's compute time, without the all-to-all it waits for."""
    match action.kind:
        case OpKind.F:
            return costs.forward[action.stage]
        case OpKind.B:
            return costs.backward[action.stage]
        case OpKind.I:
            return costs.backward_input[action.stage]
        case OpKind.W:
            return costs.backward_weight[action.stage]
        case _:
            raise TypeError(f"not a plain compute action: {action}")


def all_to_all_of(action: Action, costs: StageCosts) -> float:
    """The expert all-to-all a plain action waits for: its stage's forward one for F, the
    backward one for B and I (the input gradient goes back through combine and dispatch), none
    for W (weight gradients are local)."""
    match action.kind:
        case OpKind.F:
            return costs.forward_all_to_all(action.stage)
        case OpKind.B | OpKind.I:
            return costs.backward_all_to_all(action.stage)
        case _:
            return 0.0


def reload_timing(costs: StageCosts, num_stages: int) -> ReloadTiming:
    """The just-in-time rule's numbers (``schedule.offload``) under the same model: each compute
    action's simulated duration and each backward piece's ``need``."""
    stages = offload_stages(costs, num_stages)

    def need(backward: Action) -> float:
        plan = stages[backward.stage].plan
        wait = plan.need_i if backward.kind is OpKind.I else plan.need_b
        return plan.reload if wait is None else wait

    return ReloadTiming(duration=lambda action: duration(action, costs), need=need)


def weight(action: Action, costs: StageCosts) -> float:
    """The factor on a compute action's time from its micro-batch's weights: a B's is its I's and
    W's weights averaged by their costs, an overlapped pair's its parts' averaged by theirs (the
    plain mean where the shares cost nothing). The all-to-all is not weighted (the same tokens
    move): an action's factor applies to its compute alone, a pair's to ``overlapped_pair`` of
    its halves' weighted computes."""
    if action.parts:
        forward, backward = action.parts
        moved = all_to_all_of(forward, costs) + all_to_all_of(backward, costs)
        if moved and costs.forward_backward[action.stage] is None:
            f, fa = compute_of(forward, costs), all_to_all_of(forward, costs)
            b, ba = compute_of(backward, costs), all_to_all_of(backward, costs)
            wf, wb = compute_weight(forward, costs), compute_weight(backward, costs)
            return overlapped_pair(f * wf, fa, b * wb, ba) / overlapped_pair(f, fa, b, ba)
        return _blend([(duration(p, costs), weight(p, costs)) for p in action.parts])
    moved = all_to_all_of(action, costs)
    if not moved:
        return compute_weight(action, costs)
    compute = compute_of(action, costs)
    return (compute * compute_weight(action, costs) + moved) / (compute + moved)


def compute_weight(action: Action, costs: StageCosts) -> float:
    """The factor on a plain action's compute from its micro-batch's weights (``weight``)."""
    mb, stage = action.microbatch, action.stage
    match action.kind:
        case OpKind.W:
            return costs.microbatch_weights_w[mb]
        case OpKind.B:
            return _blend(
                [
                    (costs.backward_input[stage], costs.microbatch_weights_i[mb]),
                    (costs.backward_weight[stage], costs.microbatch_weights_w[mb]),
                ]
            )
        case OpKind.I:
            return costs.microbatch_weights_i[mb]
        case _:
            return costs.microbatch_weights[mb]


def _blend(shares: list[tuple[float, float]]) -> float:
    total = sum(cost for cost, _ in shares)
    if total <= 0:
        return fmean(w for _, w in shares)
    return sum(cost * w for cost, w in shares) / total


@without_gc
def simulate(program: Program, costs: Costs | None = None) -> Timeline:
    """Predict the timeline of one step of ``program``; raises ``ScheduleError`` on deadlock."""
    sc = (costs or Costs()).per_stage(program.num_stages)
    weights = sc.microbatch_weights
    for name, given in (
        ("", weights),
        ("_i", sc.microbatch_weights_i),
        ("_w", sc.microbatch_weights_w),
    ):
        if given and len(given) != program.num_microbatches:
            raise ValueError(
                f"costs microbatch_weights{name} has {len(given)} values; give one per "
                f"micro-batch ({program.num_microbatches})"
            )
    # The event loop asks a plain action's duration and a value's latency once per stage (they
    # depend on kind and stage only), so neither costs a call per action.
    offload = offload_stages(sc, program.num_stages)
    host, device = sc.host, sc.device
    ran = run(
        program,
        lambda action: duration(action, sc),
        lambda key: sc.comm[key[1]],
        lambda stage: offload[stage].plan,
        None
        if host is None or device is None
        else lambda action: (duration(action, host), duration(action, device)),
        None if not weights else lambda action: weight(action, sc),
    )
    return Timeline(
        num_ranks=program.num_ranks,
        spans=tuple(ran.spans()),
        copies=ran.copies,
        offload_memory=tuple(o.memory for o in offload) if ran.copies else None,
        activation_size=sc.activation,
        weight_activation_size=sc.activation_for_weight,
        workspace_size=sc.workspace if any(sc.workspace) or any(sc.weight_workspace) else None,
        weight_workspace_size=sc.weight_workspace or None,
        name=program.name,
        host_spans=ran.host,
    )
