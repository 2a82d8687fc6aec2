"""Looped schedules: v chunks per rank, stage = chunk·p + rank (``placement.looped``).

* **interleaved-1f1b** — Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
  GPU Clusters Using Megatron-LM" (arXiv 2104.04473) §2.2, Fig. 4; Megatron-LM's
  ``forward_backward_pipelining_with_interleaving`` with ``get_schedule_table`` and
  ``get_pp_rank_microbatches``; torch.distributed.pipelining ``ScheduleInterleaved1F1B``.
* **looped-bfs** — Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism" (arXiv 2211.05953);
  torch.distributed.pipelining ``ScheduleLoopedBFS``.
* **interleaved-zb** — the interleaved order with each backward split into I and W, W deferred
  (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, applied to looped
  chunks); torch.distributed.pipelining ``ScheduleInterleavedZeroBubble``.

Depth-first order (Megatron's schedule table). Micro-batches are cut into groups of ``g``
(the micro-batch group size); the last group holds the remainder. Within a group the forward
slots run chunk 0 on every micro-batch of the group, then chunk 1, …, chunk v − 1; then the next
group. With equal groups, forward slot k runs chunk ``(k // g) mod v`` on micro-batch
``(k // (g·v))·g + k mod g``; backward slot k walks the same table with the chunks reversed,
``v − 1 − (k // g) mod v``. Every rank walks the same table; a rank differs only in its warm-up.

Legal group sizes (``legal_group_sizes``), Megatron's rule: p ≤ g ≤ m, and the last group empty
or ≥ p. Megatron says a shorter last group "introduces dependency bubbles"; it can be worse —
rank 0's warm-up takes a last-group forward that rank p − 1 only runs after a backward that waits
on rank 0, a deadlock (e.g. p = 4, v = 3, m = 5, g = 4; about 1 in 10 such shapes). Unset,
g is the smallest legal size: p when p divides m, else the next size whose remainder is 0 or ≥ p
(g = m at worst) — so every m ≥ 1 builds, and where torch's rounds rule (g = m // max(1, m // p))
accepts a shape it picks the same g (checked for p ≤ 16, m ≤ 128). With m < p no g ≥ p exists; we run the
only depth-first group, g = m (Megatron refuses; torch does the same via one round).
"""

from __future__ import annotations

from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.builders.common import B, F, make_program, require_positive
from pipetrain.schedule.placement import looped
from pipetrain.schedule.program import Program

# (chunk, microbatch) — a rank-local view; the stage is chunk·p + rank
Slot = tuple[int, int]


def legal_group_sizes(num_ranks: int, num_microbatches: int) -> list[int]:
    """Group sizes g whose order runs: p ≤ g ≤ m with m mod g = 0 or ≥ p; just m when m < p."""
    p, m = num_ranks, num_microbatches
    if m < p:
        return [m]
    return [g for g in range(p, m + 1) if m % g == 0 or m % g >= p]


def resolve_group_size(
    family: str, num_ranks: int, num_microbatches: int, requested: int | None
) -> int:
    """``requested`` if legal, else (unset) the smallest legal size; ValueError names the legal
    values."""
    legal = legal_group_sizes(num_ranks, num_microbatches)
    if requested is None:
        return legal[0]
    if requested not in legal:
        shown = ", ".join(map(str, legal[:12])) + (", …" if len(legal) > 12 else "")
        raise ValueError(
            f"{family} with {num_ranks} ranks and {num_microbatches} micro-batches takes "
            f"microbatch_group_size in {{{shown}}} (ranks ≤ g ≤ micro-batches, and the last group, "
            f"micro-batches mod g, either 0 or ≥ ranks; with fewer micro-batches than ranks, g = "
            f"micro-batches), got {requested!r}"
        )
    return requested


def schedule_table(num_microbatches: int, num_chunks: int, group_size: int) -> list[Slot]:
    """Megatron's ``get_schedule_table``: the forward order as (chunk, microbatch) per slot.

    Groups of ``group_size`` micro-batches; each group runs chunk 0 on all its micro-batches,
    then chunk 1, …; the last group holds whatever remains (possibly fewer).
    """
    table: list[Slot] = []
    for first in range(0, num_microbatches, group_size):
        group = range(first, min(first + group_size, num_microbatches))
        table += [(chunk, j) for chunk in range(num_chunks) for j in group]
    return table


def backward_table(forward: list[Slot], num_chunks: int) -> list[Slot]:
    """Backward slots: the forward table with chunks reversed (Megatron ``get_model_chunk_id``)."""
    return [(num_chunks - 1 - chunk, j) for chunk, j in forward]


def one_f_one_b_order(
    forward: list[Slot], backward: list[Slot], num_warmup: int
) -> list[tuple[str, Slot]]:
    """Warm-up forwards, then (forward, backward) pairs, then the remaining backwards.

    Returns ("F" | "B", slot) pairs; the caller turns them into actions on its own stages.
    """
    total = len(forward)
    num_steady = total - num_warmup
    order = [("F", s) for s in forward[:num_warmup]]  # phase 1: warm-up
    for k in range(num_steady):  # phase 2: steady 1F1B
        order += [("F", forward[num_warmup + k]), ("B", backward[k])]
    order += [("B", s) for s in backward[num_steady:]]  # phase 3: cool-down
    return order


def interleaved_warmup(
    num_ranks: int, rank: int, num_chunks: int, group_size: int, num_microbatches: int
) -> int:
    """Megatron's ``num_warmup_microbatches`` for rank ``rank``, capped at m·v.

    v > 1: 2(p − r − 1) + (v − 1)·g — the last rank runs one group through v − 1 chunks before its
    first backward can start, and each hop away from it costs a forward going down and a backward
    coming back. v = 1: p − r − 1, Megatron's non-interleaved path, i.e. plain 1F1B.
    """
    p, r, v, g = num_ranks, rank, num_chunks, group_size
    num_warmup = (p - r - 1) if v == 1 else 2 * (p - r - 1) + (v - 1) * g
    return min(num_warmup, num_microbatches * v)


def build_interleaved_1f1b(
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int = 2,
    microbatch_group_size: int | None = None,
) -> Program:
    """Interleaved 1F1B, depth-first (Narayanan et al. 2021 §2.2, Fig. 4; Megatron).

    Rank r: ``interleaved_warmup`` forwards, then one forward / one backward, then the remaining
    backwards, walking ``schedule_table`` (see the module docstring). Rank r holds at most
    warm-up + 1 chunk activations. With v = 1 this is exactly ``build_1f1b``.
    Accepts any m ≥ 1 and any ``microbatch_group_size`` in ``legal_group_sizes`` (default the
    smallest: p when p divides m).
    """
    family = "interleaved-1f1b"
    require_positive(
        num_ranks=num_ranks, num_microbatches=num_microbatches, stages_per_rank=stages_per_rank
    )
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    g = resolve_group_size(family, p, m, microbatch_group_size)
    forward = schedule_table(m, v, g)
    backward = backward_table(forward, v)
    rows = []
    for rank in range(p):
        num_warmup = interleaved_warmup(p, rank, v, g, m)
        rows.append(_actions(one_f_one_b_order(forward, backward, num_warmup), p, rank))
    return make_program(family, looped(p, v), m, rows)


def build_looped_bfs(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> Program:
    """Looped breadth-first (Lamy-Poirier 2023; torch ``ScheduleLoopedBFS``).

    Rank r: phase 1, for each local chunk in order, the forwards of every micro-batch; phase 2,
    for each local chunk in reverse, the backwards of every micro-batch in reverse (torch's order:
    the last forward on a chunk is the first backward it can start). Any m ≥ 1; every rank holds
    all m·v chunk activations at the turn.
    """
    require_positive(
        num_ranks=num_ranks, num_microbatches=num_microbatches, stages_per_rank=stages_per_rank
    )
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    rows = []
    for rank in range(p):
        phase_1_forward = [F(c * p + rank, j) for c in range(v) for j in range(m)]
        phase_2_backward = [
            B(c * p + rank, j) for c in reversed(range(v)) for j in reversed(range(m))
        ]
        rows.append(phase_1_forward + phase_2_backward)
    return make_program("looped-bfs", looped(p, v), m, rows)


_KINDS = {"F": OpKind.F, "B": OpKind.B, "I": OpKind.I, "W": OpKind.W}


def _actions(order: list[tuple[str, Slot]], num_ranks: int, rank: int) -> list[Action]:
    return [Action(_KINDS[kind], chunk * num_ranks + rank, j) for kind, (chunk, j) in order]


def zero_bubble_warmup(
    num_ranks: int, rank: int, num_chunks: int, group_size: int, num_microbatches: int
) -> int:
    """torch ``_get_warmup_ops(multiply_factor=1)``: (p − r − 1) + (v − 1)·g, capped at m·v.

    One hop per rank instead of interleaved 1F1B's two: the backward coming back is an I, whose
    W waits, so the rank need not cover a full backward with extra forwards. v = 1 gives ZB-H1's
    p − r − 1 (its p − r forwards before the first I, counting the steady phase's first one).
    """
    p, r, v, g = num_ranks, rank, num_chunks, group_size
    return min((p - r - 1) + (v - 1) * g, num_microbatches * v)


def zero_bubble_lag(rank: int, num_chunks: int, num_microbatches: int, num_warmup: int) -> int:
    """How many input-gradient slots rank r defers each W: r, as in ZB-H1 and torch, but at most
    the number of Is that a forward still follows (steady pairs − 1).

    A W is deferred so the next forward can go first; once no forward is left, deferring only
    holds activations longer. This cap is ZB-H1's ("the lag is capped by the forwards left after
    the warm-up"), so v = 1 reproduces ``build_zb_h1``; torch keeps the lag r here. At unit
    costs the two give the same makespan on every shape we swept (p ≤ 8, v ≤ 4, m ≤ 32).
    """
    num_steady = num_microbatches * num_chunks - num_warmup
    return min(rank, max(num_steady - 1, 0))


def defer_weight_gradients(order: list[tuple[str, Slot]], lag: int) -> list[tuple[str, Slot]]:
    """Split every B into I and W; the W of the n-th I runs right after the (n + lag)-th I;
    the last ``lag`` Ws run at the end (torch ``_get_1f1b_rank_ops(enable_zero_bubble=True)``)."""
    out: list[tuple[str, Slot]] = []
    done_inputs: list[Slot] = []
    for kind, slot in order:
        if kind == "F":
            out.append(("F", slot))
            continue
        out.append(("I", slot))
        done_inputs.append(slot)
        if len(done_inputs) > lag:
            out.append(("W", done_inputs[len(done_inputs) - 1 - lag]))
    out += [("W", slot) for slot in done_inputs[max(len(done_inputs) - lag, 0) :]]
    return out


def build_interleaved_zb(
    num_ranks: int, num_microbatches: int, stages_per_rank: int = 2
) -> Program:
    """Interleaved zero bubble (torch ``ScheduleInterleavedZeroBubble``, its "ZB1P"; Qi et al.
    2024 §2.1 applied to looped chunks).

    Rank r: ``zero_bubble_warmup`` forwards, then (F, I) pairs, then the remaining Is, walking the
    same depth-first ``schedule_table`` as interleaved 1F1B (its default g); every W is deferred
    by ``zero_bubble_lag`` (r, fewer when forwards run out) input-gradient slots — the W of the
    n-th I runs right after the (n + lag)-th I, as in ZB-H1 — and the last ``lag`` Ws close the
    rank. Rank r holds at most min(warm-up + 1 + lag, m·v) chunk activations, never more than
    interleaved 1F1B's + r. With v = 1 this is exactly ZB-H1. Any m ≥ 1.
    """
    family = "interleaved-zb"
    require_positive(
        num_ranks=num_ranks, num_microbatches=num_microbatches, stages_per_rank=stages_per_rank
    )
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    g = resolve_group_size(family, p, m, None)
    forward = schedule_table(m, v, g)
    backward = backward_table(forward, v)
    rows = []
    for rank in range(p):
        num_warmup = zero_bubble_warmup(p, rank, v, g, m)
        lag = zero_bubble_lag(rank, v, m, num_warmup)
        order = defer_weight_gradients(one_f_one_b_order(forward, backward, num_warmup), lag)
        rows.append(_actions(order, p, rank))
    return make_program(family, looped(p, v), m, rows)
