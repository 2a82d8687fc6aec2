"""Steps of a token budget (``--global-batch-tokens``), profiled length costs in the step planner
(``--costs``), and the next batch built ahead (``Prefetch``): each step's micro-batch count is one
the schedule accepts and follows from (seed, step) alone, every document of the stream is packed
once, a costs file's coefficients reach ``pack_step``, and prefetching changes no batch."""

from __future__ import annotations

import dataclasses
import itertools
import threading

import numpy as np
import pytest
import torch
from data_cases import corpus_of, write_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.app.data import BatchShape, DataOptions, StepCounts, TokenBudget, train_batches
from pipetrain.app.data import step_batches as planning
from pipetrain.app.data.prefetch import Prefetch
from pipetrain.app.data.step_batches import epoch_order, step_plans
from pipetrain.planner.varlen import LengthCost

SEQ = 12


def test_step_counts_are_the_schedules_from_the_ranks_up():
    """1F1B runs any count; the budget takes the ranks at least. DualPipeV needs 2 × ranks: the
    registry says so, nothing here hard-codes it. Rounding goes to the nearest, a tie up."""
    one = StepCounts("1f1b", 2)
    assert one.fewest == 2 and not one.accepts(1) and one.accepts(3)
    assert [one.nearest(w) for w in (0.2, 2.4, 2.5, 3.49, 7.0)] == [2, 2, 3, 3, 7]
    v = StepCounts("dualpipev", 2)
    assert v.fewest == 4 and not v.accepts(3) and v.accepts(5)
    assert v.nearest(1.0) == 4 and v.nearest(5.6) == 6
    budget = TokenBudget(200, one, dp=2, microbatch_size=2, seq_len=SEQ)
    assert budget.nominal == one.nearest(200 / (2 * 2 * SEQ))
    with pytest.raises(ValueError, match="less than the fewest micro-batches dualpipev runs on 2"):
        TokenBudget(95, v, dp=1, microbatch_size=2, seq_len=SEQ)  # 4 x 2 x 12 = 96 tokens
    TokenBudget(96, v, dp=1, microbatch_size=2, seq_len=SEQ)
    with pytest.raises(ValueError, match="give at least 192"):
        TokenBudget(191, v, dp=2, microbatch_size=2, seq_len=SEQ)
    with pytest.raises(ValueError, match="unknown schedule"):
        StepCounts("nope", 2)


lengths_strategy = st.lists(st.integers(1, SEQ), min_size=1, max_size=30)


@settings(max_examples=40, deadline=None)
@given(
    lengths_strategy,
    st.sampled_from(["1f1b", "dualpipev"]),
    st.integers(1, 2),
    st.integers(1, 2),
    st.integers(0, 3),
    st.booleans(),
    st.integers(0, 60),
)
def test_budget_steps_pack_the_stream_once_in_accepted_counts(
    lengths, schedule, dp, rows, seed, balanced, extra
):
    counts = StepCounts(schedule, 2)
    least = counts.fewest * dp * rows * SEQ
    budget = TokenBudget(least + extra, counts, dp=dp, microbatch_size=rows, seq_len=SEQ)
    options = DataOptions(seq_len=SEQ, balanced=balanced)
    shape = BatchShape(dp, budget.nominal, rows)
    plans = list(itertools.islice(step_plans(lengths, options, shape, seed=seed, budget=budget), 5))
    epochs = plans[-1].consumed // len(lengths) + 1
    stream = np.concatenate([epoch_order(len(lengths), seed, e) for e in range(epochs)])
    packed = [d for plan in plans for row in plan.rows for d in row]
    assert sorted(packed + list(plans[-1].left_over)) == sorted(stream[: plans[-1].consumed])
    carried = 0
    for plan in plans:
        assert counts.accepts(plan.microbatches)
        assert len(plan.rows) == plan.microbatches * dp * rows
        assert all(sum(lengths[d] for d in row) <= SEQ for row in plan.rows)
        # offered: what was carried over, then the stream read while short of the budget (which
        # picks the count) or of the count's slots (which the packer fills from the documents)
        offered = sum(lengths[d] for row in plan.rows for d in row)
        offered += sum(lengths[d] for d in plan.left_over)
        target = max(budget.tokens, plan.microbatches * dp * rows * SEQ)
        if carried < target:
            assert target <= offered < target + SEQ
        else:
            assert offered == carried
        carried = sum(lengths[d] for d in plan.left_over)


def test_counts_follow_the_documents_and_a_resumed_run_sees_the_same_batches():
    """Long-tailed lengths: steps of one budget fill different counts of micro-batches; each
    batch has that count's rows, and step s is the same whether the run starts at 0 or at s."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(SEQ / 4), 1.5, 80).astype(int), 1, SEQ)
    ids = iter(range(10, 100_000))
    documents = [[next(ids) for _ in range(n)] for n in lengths]
    data = corpus_of(documents)
    counts = StepCounts("1f1b", 2)
    budget = TokenBudget(6 * SEQ, counts, dp=1, microbatch_size=1, seq_len=SEQ)
    options = DataOptions(seq_len=SEQ)
    shape = BatchShape(1, budget.nominal, 1)
    whole = list(itertools.islice(train_batches(data, options, shape, seed=3, budget=budget), 8))
    assert len({b.microbatches for b in whole}) > 1  # the count does change
    for b in whole:
        assert b.inputs.shape == (b.microbatches, SEQ) and len(b.microbatch_costs) == b.microbatches
    resumed = train_batches(data, options, shape, seed=3, start=5, budget=budget)
    for a, b in zip(whole[5:], resumed):
        assert (a.step, a.microbatches, a.rows) == (b.step, b.microbatches, b.rows)
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    with pytest.raises(ValueError, match="packs documents"):
        next(
            step_plans(
                lengths, DataOptions(seq_len=SEQ, packing="none"), shape, seed=0, budget=budget
            )
        )


def test_a_costs_files_coefficients_reach_pack_step(tmp_path, monkeypatch):
    """``--costs FILE``: the sum of the layers' fitted coefficients is the cost the step planner
    balances with; without it, a transformer's FLOPs at the folder's width."""
    pytest.importorskip("tokenizers")
    from pipetrain.app.batch_source import folder_batches, length_cost
    from pipetrain.app.config import TrainConfig
    from pipetrain.planner.costs_file import save_costs, uniform_costs

    layers = uniform_costs(["embed", "block", "head"])
    fitted = [(0.5, 0.01), (2.0, 0.25), (0.75, 0.0)]
    costs = dataclasses.replace(
        layers,
        layers=tuple(
            dataclasses.replace(x, per_token=a, per_token_sq=b)
            for x, (a, b) in zip(layers.layers, fitted, strict=True)
        ),
    )
    save_costs(costs, tmp_path / "costs.json")
    text = tmp_path / "d.txt"
    text.write_text("".join(f"line {'x' * (i % 9)}\n" for i in range(40)))
    config = TrainConfig(
        model_dir=str(write_tokenizer(tmp_path / "tok")),
        data=str(text),
        seq_len=SEQ * 2,
        microbatch_size=2,
        costs=str(tmp_path / "costs.json"),
        data_cache=str(tmp_path / "cache"),
    )
    seen: list[LengthCost] = []
    real = planning.pack_step
    monkeypatch.setattr(
        planning, "pack_step", lambda *a, **k: (seen.append(k["cost"]), real(*a, **k))[1]
    )
    batch = next(folder_batches(config, 2, 0))
    assert seen == [LengthCost(per_token=3.25, per_token_sq=0.26)]
    assert batch.microbatches is None  # no budget: the pipeline's own count
    assert "0.26 ms per token²" in length_cost(config)[1]
    save_costs(layers, tmp_path / "bare.json")
    with pytest.raises(ValueError, match="has no per_token/per_token_sq .* --seq-lens"):
        length_cost(dataclasses.replace(config, costs=str(tmp_path / "bare.json")))


def test_prefetch_builds_ahead_and_changes_nothing():
    """The same items in the same order; the next one is built before it is asked for; an
    error comes out of the ``next`` that would have returned its item; ``close`` ends it."""
    made: list[int] = []
    second = threading.Event()

    def source():
        for i in range(5):
            made.append(i)
            if i == 1:
                second.set()
            yield i

    with Prefetch(source()) as ahead:
        assert next(ahead) == 0
        assert second.wait(10)  # item 1 built while the caller holds item 0
        assert list(ahead) == [1, 2, 3, 4]
    assert made == [0, 1, 2, 3, 4]

    def failing():
        yield 1
        raise ValueError("bad record 2")

    failed = Prefetch(failing())
    assert next(failed) == 1
    with pytest.raises(ValueError, match="bad record 2"):
        next(failed)
    with pytest.raises(StopIteration):
        next(failed)

    endless = Prefetch(itertools.count(), ahead=2)
    assert [next(endless) for _ in range(3)] == [0, 1, 2]
    endless.close()
    assert not endless._thread.is_alive()
    with pytest.raises(ValueError, match="ahead must be"):
        Prefetch(iter(()), ahead=0)
