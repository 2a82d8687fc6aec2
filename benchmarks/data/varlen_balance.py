"""Length-aware micro-batches against fixed packing, priced by the simulator.

Packed documents make micro-batches of one shape cost unequal time: the dense layers see
``rows x seq_len`` tokens whatever is packed (padding included), but causal attention costs about
``n²`` per document of ``n`` tokens, so a micro-batch holding one long document is slower than
one holding many short ones, and every pipeline stage waits behind the slowest (WLB-LLM, Wang et
al. 2025). This script draws long-tailed document lengths (log-normal, median ``seq_len / 8``,
clipped to ``seq_len``, seeded), packs each step with ``planner.varlen`` five ways (``PACKINGS``)
— fixed (next-fit in order); fixed, arranged (``arrange_microbatches``: the micro-batches dealt
to the replicas to match their sums, each replica's lightest first — the order alone); balanced
on the same documents (the fixed packing's, reassigned by ``pack_step``: the balance alone);
balanced and arranged; and ``pack_step`` as it is meant to run (the same documents balanced, the
rows' gaps filled from a look-ahead of the stream), arranged — prices each step's micro-batches
with the simulator's per-micro-batch weights, and reports the mean step time, real tokens per
time, and the max/mean micro-batch cost.

Cost coefficients, from FLOP counts of one Llama-3-8B-like layer (hidden ``h`` = 4096, 32 query
and 8 key/value heads of 128, MLP 14336): the layer's weights are ``2h²`` (q, o) + ``2·h·h/4``
(k, v) + ``3·h·3.5h`` (gate, up, down) = ``13h²``, so its dense forward costs ``2·13h² = 26h²``
FLOPs per token, its input gradient and its weight gradient as much again each (``52h²``).
Causal attention of a document of ``n`` tokens: query ``i`` scores ``i + 1`` keys (``2h``
FLOPs each over all heads) and mixes as many values (``2h`` more): ``4h · n(n+1)/2 ≈ 2h·n²``
forward; FlashAttention's backward recomputes the scores and runs four more products, ``2.5x``
the forward, ``5h·n²``, all of it input gradient (attention has no weights). Per micro-batch
with ``S = Σ n²`` over its documents and ``T = rows · seq_len`` tokens::

    F = 26h²·T + 2h·S      I = 52h²·T + 5h·S      W = 52h²·T

so the simulator's stage costs are the dense part (F : I : W = 1 : 2 : 2) and each micro-batch
weighs ``1 + 2h·S / (26h²·T)`` on F, ``1 + 5h·S / (52h²·T)`` on I and 1 on W. Attention equals
the dense forward of a document only at ``n = 13h`` (53248 tokens), which is why the gain grows
with ``seq_len``. The packer balances ``LengthCost(per_token=130h², per_token_sq=7h)``, the
whole step's F + I + W of a document. No communication time; with ``--replicas R`` a step packs
``R`` data-parallel replicas' micro-batches at once (the arranged packings deal them with
``arrange_microbatches``) and lasts as long as the slowest replica's pipeline. Step times are in
units of one rank's dense forward of a micro-batch.

Run (under a minute on 2 CPU cores)::

    python benchmarks/data/varlen_balance.py            # table on stdout, JSON in out/
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from pipetrain.planner.varlen import LengthCost, StepPack, arrange_microbatches, pack_step
from pipetrain.schedule.registry import build_schedule
from pipetrain.sim.costs import Costs
from pipetrain.sim.simulate import simulate

HIDDEN = 4096
DENSE_F = 26 * HIDDEN**2  # forward FLOPs per token of the layer's weights
ATTN_F = 2 * HIDDEN  # causal attention forward FLOPs per n² of a document
ATTN_I = 5 * HIDDEN  # its backward (input gradient) FLOPs per n²
COST = LengthCost(per_token=5 * DENSE_F, per_token_sq=ATTN_F + ATTN_I)
SCHEDULES = {"1f1b": 1, "zbv": 2}  # family: stages per rank
SIGMA = 1.0  # log-normal shape: a long tail past the median


@dataclass(frozen=True)
class Shape:
    ranks: int
    rows: int
    seq_len: int
    #: data-parallel replicas, each a pipeline of ``ranks`` running its own micro-batches
    replicas: int = 1

    @property
    def microbatches(self) -> int:
        """Per replica."""
        return 2 * self.ranks

    @property
    def step_microbatches(self) -> int:
        return self.replicas * self.microbatches


def document_lengths(seq_len: int, rng: random.Random):  # type: ignore[no-untyped-def]
    """An endless stream of log-normal lengths, median ``seq_len / 8``, clipped to 1..seq_len."""
    median = seq_len / 8
    while True:
        yield max(1, min(seq_len, round(median * rng.lognormvariate(0.0, SIGMA))))


PACKINGS = ("fixed", "fixed, arranged", "balanced", "balanced, arranged", "look-ahead, arranged")


def steps(
    shape: Shape, num_steps: int, seed: int, packing: str
) -> list[tuple[StepPack, list[int]]]:
    """Each step's packing of the stream: documents carried over first, then new ones up to a
    look-ahead of twice the step's capacity in tokens (``PACKINGS``)."""
    stream = document_lengths(shape.seq_len, random.Random(seed))
    capacity = shape.step_microbatches * shape.rows * shape.seq_len
    kw = {"microbatches": shape.step_microbatches, "rows": shape.rows, "seq_len": shape.seq_len}
    carried: list[int] = []
    out = []
    for _ in range(num_steps):
        lengths = list(carried)
        while sum(lengths) < 2 * capacity:
            lengths.append(next(stream))
        pack = pack_step(lengths, cost=COST, balanced=packing.startswith("look-ahead"), **kw)
        if packing.startswith("balanced"):  # the fixed packing takes a prefix: balance just that
            taken = len(pack.packed())
            balanced = pack_step(lengths[:taken], cost=COST, balanced=True, **kw)
            pack = StepPack(balanced.microbatches, pack.left_over)
        if packing.endswith("arranged"):
            pack = arrange_microbatches(
                pack, lengths, COST, seq_len=shape.seq_len, replicas=shape.replicas
            )
        out.append((pack, lengths))
        carried = [lengths[i] for i in pack.left_over]
    return out


def weights(pack: StepPack, lengths: list[int], shape: Shape) -> tuple[list[float], list[float]]:
    """Per micro-batch, its factor on F and on I over the dense part alone (module docstring)."""
    tokens = shape.rows * shape.seq_len
    squares = [sum(lengths[i] ** 2 for row in mb for i in row) for mb in pack.microbatches]
    forward = [1 + ATTN_F * s / (DENSE_F * tokens) for s in squares]
    backward_input = [1 + ATTN_I * s / (2 * DENSE_F * tokens) for s in squares]
    return forward, backward_input


def step_time(program, v: int, forward: list[float], backward_input: list[float]) -> float:  # type: ignore[no-untyped-def]
    """The simulated step: stage costs are the dense part (F : I : W = 1 : 2 : 2 per rank, split
    over its ``v`` stages), each micro-batch's F and I weighted by its attention, W not."""
    costs = Costs(
        forward=1.0 / v,
        backward_input=2.0 / v,
        backward_weight=2.0 / v,
        microbatch_weights=forward,
        microbatch_weights_i=backward_input,
        microbatch_weights_w=[1.0] * len(forward),
    )
    return float(simulate(program, costs).makespan)


def replica_step_time(program, v: int, pack: StepPack, lengths: list[int], shape: Shape) -> float:  # type: ignore[no-untyped-def]
    """The step: every replica's pipeline on its micro-batches (replica ``r`` runs ``r·M ..
    r·M+M-1``), the slowest one's time (the gradients' all-reduce waits for it)."""
    per = shape.microbatches
    times = []
    for r in range(shape.replicas):
        mine = StepPack(pack.microbatches[r * per : (r + 1) * per], ())
        times.append(step_time(program, v, *weights(mine, lengths, shape)))
    return max(times)


def bound_step_time(program, v: int, pack: StepPack, lengths: list[int], shape: Shape) -> float:  # type: ignore[no-untyped-def]
    """The step if every micro-batch of it cost the mean of them, on F and on I: perfect balance
    of these documents over the step's micro-batches (and replicas), what no reassignment of
    them beats with every micro-batch in the same place. (An order can still do better at the
    fill and drain, running the lightest micro-batches where a rank waits: ``arranged``.)"""
    forward, backward_input = weights(pack, lengths, shape)
    m = shape.microbatches
    f, i = statistics.fmean(forward), statistics.fmean(backward_input)
    return step_time(program, v, [f] * m, [i] * m)


def spread(pack: StepPack, lengths: list[int], shape: Shape) -> float:
    """The dearest micro-batch's cost (the fixed shape's, padding included) over the mean's."""
    costs = pack.costs(lengths, COST, padded_to=shape.seq_len)
    return max(costs) / statistics.fmean(costs)


def measure(shape: Shape, num_steps: int, seed: int) -> list[dict[str, object]]:
    """Every packing of one shape under every schedule: one row per (schedule, packing)."""
    packed = {packing: steps(shape, num_steps, seed, packing) for packing in PACKINGS}
    capacity = shape.step_microbatches * shape.rows * shape.seq_len
    rows: list[dict[str, object]] = []
    for name, v in SCHEDULES.items():
        program = build_schedule(name, shape.ranks, shape.microbatches, v)
        for packing, run in packed.items():
            times = [replica_step_time(program, v, p, lengths, shape) for p, lengths in run]
            bound = [bound_step_time(program, v, p, lengths, shape) for p, lengths in run]
            tokens = [sum(lengths[i] for i in p.packed()) for p, lengths in run]
            rows.append(
                {
                    "schedule": name,
                    "ranks": shape.ranks,
                    "replicas": shape.replicas,
                    "microbatches": shape.microbatches,
                    "rows": shape.rows,
                    "seq_len": shape.seq_len,
                    "packing": packing,
                    "mean_step_time": statistics.fmean(times),
                    "mean_cost_step_time": statistics.fmean(bound),
                    "tokens_per_time": sum(tokens) / sum(times),
                    "padding": 1 - statistics.fmean(tokens) / capacity,
                    "max_over_mean_cost": statistics.fmean(
                        spread(p, lengths, shape) for p, lengths in run
                    ),
                }
            )
    return rows


def table(rows: list[dict[str, object]]) -> str:
    """One line per (shape, schedule): each packing's speed-up over fixed packing (step time on
    the same documents; real tokens per time with the look-ahead, which packs more), the bound
    (every micro-batch at the mean: the most balancing these documents can gain) and how much
    of the bound's gain balanced + arranged reaches, the max/mean micro-batch cost and the
    padding."""
    lines = [
        "| ranks × replicas | schedule | rows × seq_len | step, fixed | arranged | balanced "
        "| balanced + arranged | bound: every micro-batch the mean | of the bound's gain "
        "| look-ahead + arranged: tokens/time "
        "| max/mean cost: fixed → balanced | padding: fixed → look-ahead |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    width = len(PACKINGS)
    for first in range(0, len(rows), width):
        fixed, arranged, balanced, both, ahead = rows[first : first + width]
        t0 = float(fixed["mean_step_time"])  # type: ignore[arg-type]
        speed = [t0 / float(r["mean_step_time"]) for r in (arranged, balanced, both)]  # type: ignore[arg-type]
        bound = t0 / float(fixed["mean_cost_step_time"])  # type: ignore[arg-type]
        tokens = float(ahead["tokens_per_time"]) / float(fixed["tokens_per_time"])  # type: ignore[arg-type]
        lines.append(
            f"| {fixed['ranks']} × {fixed['replicas']} | {fixed['schedule']} | {fixed['rows']} × {fixed['seq_len']} "
            f"| {t0:.2f} | " + " | ".join(f"{x:.3f}×" for x in speed) + f" | {bound:.3f}× "
            f"| {reached(speed[2], bound)} | {tokens:.3f}× "
            f"| {fixed['max_over_mean_cost']:.3f} → {balanced['max_over_mean_cost']:.3f} "
            f"| {fixed['padding']:.1%} → {ahead['padding']:.1%} |"
        )
    return "\n".join(lines)


def reached(speed: float, bound: float) -> str:
    """The share of the bound's gain over fixed packing that ``speed`` gets ("-" where the bound
    gains under 0.1%: nothing to reach)."""
    if bound - 1 < 1e-3:
        return "-"
    return f"{(speed - 1) / (bound - 1):.0%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps per shape (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="document lengths' seed (default 0)")
    parser.add_argument("--ranks", default="4,8", help="pipeline sizes (default 4,8)")
    parser.add_argument("--rows", default="1,2", help="rows per micro-batch (default 1,2)")
    parser.add_argument(
        "--seq-lens",
        default="4096,8192,16384,32768",
        help="row lengths (default 4096,8192,16384,32768)",
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="data-parallel replicas (default 1)"
    )
    parser.add_argument("--out", type=Path, default=Path("out/varlen_balance.json"))
    args = parser.parse_args()
    began = time.perf_counter()
    rows = []
    for ranks in map(int, args.ranks.split(",")):
        for rows_per in map(int, args.rows.split(",")):
            for seq_len in map(int, args.seq_lens.split(",")):
                shape = Shape(ranks, rows_per, seq_len, args.replicas)
                rows += measure(shape, args.steps, args.seed)
    print(table(rows))
    seconds = time.perf_counter() - began
    print(f"\n{args.steps} steps per shape, seed {args.seed}, {seconds:.1f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"rows": rows, "steps": args.steps, "seed": args.seed}, indent=1)
    )


if __name__ == "__main__":
    main()
