"""The simulator's price of a ``pipetrain train --model-dir`` run's own planned steps, from a
costs file of ``pipetrain profile --seq-lens``: what ``varlen_gpu.py`` states before its runs.

Every rank of a run derives each step's plan from (seed, step) alone (``app.data.step_batches``),
so the plan is known before anything runs: which documents each micro-batch packs and how many
micro-batches the step holds. ``StepRun`` names the flags that decide it, and ``plans`` calls the
very planner the run's workers call. A fixed shape runs the same dense work on every micro-batch
(padding included); only attention, about ``n²`` per document of ``n`` tokens, differs. The
profile measured a full row (one document of ``seq_len`` tokens a row, ``rows`` rows): its
stages' F, I and W (``planner.judge.stage_costs`` on the run's cut). The model's fitted length
cost ``a·n + b·n²`` (F + B over every layer, ``planner.varlen.model_length_cost``) says which
share ``α = b·S² / (a·S + b·S²)`` of that row's time is attention; a micro-batch whose documents
hold ``Σ n²`` costs ``T·((1 − α) + α·r)`` with ``r = Σ n² / (rows·S²)``, of which W (no
attention) keeps its profiled time and F and I share the rest by one factor
(``Costs.microbatch_weights`` and ``_i``). Each step is simulated with the program of its own
micro-batch count. No optimizer step and no communication time: the ratio of two runs is the
prediction to compare, more than either's tokens per second.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.planner.costs_file import ModelCosts
from pipetrain.planner.judge import stage_costs
from pipetrain.planner.varlen import LengthCost, model_length_cost
from pipetrain.schedule.program import Program
from pipetrain.schedule.registry import build_schedule
from pipetrain.sim.costs import Costs
from pipetrain.sim.simulate import simulate


@dataclass(frozen=True)
class StepRun:
    """The ``pipetrain train`` flags that decide a run's step plans (one pipeline, ``--dp 1``):
    ``microbatches`` (``-m``) or ``global_batch_tokens``, one of them; ``balanced``:
    ``--microbatch-balance length``; ``cost``: what the planner balances by (``--costs``'s
    fitted length cost, else ``app.data.transformer_cost`` of the model's width)."""

    schedule: str
    ranks: int
    seq_len: int
    microbatch_size: int
    steps: int
    cost: LengthCost
    balanced: bool
    microbatches: int | None = None
    global_batch_tokens: int | None = None
    stages_per_rank: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.microbatches is None) == (self.global_batch_tokens is None):
            raise ValueError("give one of microbatches and global_batch_tokens")


def plans(run: StepRun, lengths: Sequence[int]) -> Iterator[Any]:
    """The run's step plans (``app.data.step_batches.step_plans``), its first ``run.steps``."""
    from pipetrain.app.data import BatchShape, DataOptions, StepCounts, TokenBudget
    from pipetrain.app.data.step_batches import step_plans

    budget = None
    nominal = run.microbatches
    if run.global_batch_tokens is not None:
        counts = StepCounts(run.schedule, run.ranks, run.stages_per_rank)
        budget = TokenBudget(
            run.global_batch_tokens,
            counts,
            dp=1,
            microbatch_size=run.microbatch_size,
            seq_len=run.seq_len,
        )
        nominal = budget.nominal
    assert nominal is not None
    options = DataOptions(seq_len=run.seq_len, balanced=run.balanced)
    shape = BatchShape(1, nominal, run.microbatch_size)
    planned = step_plans(lengths, options, shape, seed=run.seed, cost=run.cost, budget=budget)
    for _, plan in zip(range(run.steps), planned, strict=False):
        yield plan


def predict(
    run: StepRun, lengths: Sequence[int], model: ModelCosts, cut: Sequence[int]
) -> dict[str, Any]:
    """``run``'s steps priced (``lengths``: the corpus's document lengths; ``cut``: layers per
    stage): real tokens, mean simulated step (ms), tokens per second, the mean max/mean
    micro-batch cost, the padding share of the token slots and how many steps ran each
    micro-batch count."""
    if model.num_layers != sum(cut):
        raise ValueError(f"the costs file has {model.num_layers} layers, the cut {sum(cut)}")
    pricing = Pricing(model, run, cut)
    real = makespan = slots = 0.0
    spreads: list[float] = []
    counts: Counter[int] = Counter()
    rows = run.microbatch_size
    for plan in plans(run, lengths):
        groups = [plan.rows[m * rows : (m + 1) * rows] for m in range(plan.microbatches)]
        squares = [sum(int(lengths[i]) ** 2 for row in g for i in row) for g in groups]
        makespan += pricing.step_ms(plan.microbatches, squares)
        real += sum(int(lengths[i]) for row in plan.rows for i in row)
        slots += plan.microbatches * rows * run.seq_len
        padded = [pricing.microbatch_cost(s) for s in squares]
        spreads.append(max(padded) / statistics.fmean(padded))
        counts[plan.microbatches] += 1
    steps = sum(counts.values())
    return {
        "steps": steps,
        "real_tokens": real,
        "step_ms": makespan / steps,
        "tok_per_s": real / (makespan / 1e3),
        "max_over_mean": statistics.fmean(spreads),
        "padding": 1 - real / slots,
        "counts": dict(sorted(counts.items())),
    }


class Pricing:
    """A run's micro-batches priced from the costs file (module docstring)."""

    def __init__(self, model: ModelCosts, run: StepRun, cut: Sequence[int]) -> None:
        self.model, self.run, self.cut = model, run, tuple(cut)
        self.length = model_length_cost(model)
        seq = run.seq_len
        full = self.length.of(seq)
        self.attention = self.length.per_token_sq * seq**2 / full if full > 0 else 0.0
        self._by_count: dict[int, tuple[Program, Costs, float, float, float]] = {}

    def microbatch_cost(self, squares: int) -> float:
        """A micro-batch's F + B as its fixed shape pays it (padding at the per-token rate)."""
        run = self.run
        dense = self.length.per_token * run.microbatch_size * run.seq_len
        return dense + self.length.per_token_sq * squares

    def step_ms(self, count: int, squares: Sequence[int]) -> float:
        """The simulated step of ``count`` micro-batches holding ``squares`` (Σ n² each)."""
        program, costs, f, i, w = self._of(count)
        total = f + i + w
        row = self.run.microbatch_size * self.run.seq_len**2
        factors = [
            (total * ((1 - self.attention) + self.attention * s / row) - w) / (f + i)
            for s in squares
        ]
        weighted = dataclasses.replace(
            costs,
            microbatch_weights=factors,
            microbatch_weights_i=factors,
            microbatch_weights_w=[1.0] * count,
        )
        return float(simulate(program, weighted).makespan)

    def _of(self, count: int) -> tuple[Program, Costs, float, float, float]:
        """``count``'s program, its stage costs and the whole model's F, I and W (once each)."""
        if count not in self._by_count:
            run = self.run
            program = build_schedule(run.schedule, run.ranks, count, run.stages_per_rank)
            costs = stage_costs(self.model, program, self.cut)
            f, i, w = (
                _total(getattr(costs, k)) for k in ("forward", "backward_input", "backward_weight")
            )
            self._by_count[count] = (program, costs, f, i, w)
        return self._by_count[count]


def _total(cost: Any) -> float:
    return float(sum(cost)) if isinstance(cost, list | tuple) else float(cost)


__all__ = ["Pricing", "StepRun", "plans", "predict"]
