"""Packed rows and per-step batches, as properties over random corpora and shapes: no target
crosses a document, positions restart, loss masks hold, every document of the stream is packed
exactly once, and a step's batch depends on (seed, step) only."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from data_cases import corpus_of
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.app.data import BatchShape, DataOptions, eval_batches, train_batches
from pipetrain.app.data.packing import packed_rows, padded_rows
from pipetrain.app.data.step_batches import epoch_order, step_plans, transformer_cost
from pipetrain.hf.masks import IGNORE_INDEX, next_token_targets
from pipetrain.planner.varlen import LengthCost

SEQ = 12


@st.composite
def corpora(draw, masked: bool | None = None):
    """Documents of 2..SEQ tokens with ids unique across the corpus (so every token can be
    traced to its document and place), and loss masks or none."""
    lengths = draw(st.lists(st.integers(2, SEQ), min_size=1, max_size=14))
    masked = draw(st.booleans()) if masked is None else masked
    ids = iter(range(2, 10_000))
    documents = [[next(ids) for _ in range(n)] for n in lengths]
    masks = None
    if masked:
        masks = [draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)) for n in lengths]
    return documents, masks


shapes = st.builds(BatchShape, st.integers(1, 2), st.integers(1, 3), st.integers(1, 2))


def check_packed(batch, documents, masks) -> None:
    """Every row holds its documents end to end with positions from 0, each target the next
    token of the same document where its mask is 1, and nothing else."""
    where = {t: (d, k) for d, doc in enumerate(documents) for k, t in enumerate(doc)}
    inputs, targets = batch.inputs.numpy(), batch.targets.numpy()
    positions = batch.side["position_ids"].numpy()
    assert set(batch.side) == {"position_ids", "token_mask"}
    for r, row in enumerate(batch.rows):
        expected = [t for d in row for t in documents[d]]
        n = len(expected)
        assert inputs[r, :n].tolist() == expected
        assert positions[r, :n].tolist() == [k for d in row for k in range(len(documents[d]))]
        assert positions[r, n:].tolist() == list(range(SEQ - n))  # the padding restarts too
        assert batch.side["token_mask"][r].tolist() == [1] * n + [0] * (SEQ - n)
        assert (targets[r, n:] == IGNORE_INDEX).all()
        for i in range(n):
            d, k = where[int(inputs[r, i])]
            follows = k + 1 < len(documents[d]) and (masks is None or masks[d][k + 1] == 1)
            assert targets[r, i] == (documents[d][k + 1] if follows else IGNORE_INDEX)
    real = sum(len(documents[d]) for row in batch.rows for d in row)
    assert batch.real_tokens == real
    assert batch.padding_tokens == inputs.size - real
    assert batch.predicted_tokens == int((targets != IGNORE_INDEX).sum())


@settings(max_examples=40, deadline=None)
@given(corpora(), shapes, st.booleans(), st.integers(0, 3))
def test_packed_steps_keep_documents_apart(corpus, shape, balanced, seed):
    documents, masks = corpus
    data = corpus_of(documents, masks)
    options = DataOptions(seq_len=SEQ, balanced=balanced)
    for batch in itertools.islice(train_batches(data, options, shape, seed=seed), 3):
        assert batch.inputs.shape == batch.targets.shape == (shape.rows, SEQ)
        assert len(batch.microbatch_costs) == shape.groups
        check_packed(batch, documents, masks)


@settings(max_examples=40, deadline=None)
@given(corpora(masked=False), shapes, st.booleans(), st.integers(0, 3), st.integers(1, 6))
def test_every_document_of_the_stream_is_packed_once(corpus, shape, balanced, seed, steps):
    """The documents packed by the first steps, with what the last leaves over, are exactly the
    documents the stream gave (each epoch's permutation in turn): none lost or repeated."""
    documents, _ = corpus
    lengths = [len(d) for d in documents]
    options = DataOptions(seq_len=SEQ, balanced=balanced)
    plans = list(itertools.islice(step_plans(lengths, options, shape, seed=seed), steps))
    stream = np.concatenate(
        [epoch_order(len(lengths), seed, e) for e in range(plans[-1].consumed // len(lengths) + 1)]
    )
    packed = [d for plan in plans for row in plan.rows for d in row]
    assert sorted(packed + list(plans[-1].left_over)) == sorted(stream[: plans[-1].consumed])
    for plan in plans:
        assert len(plan.rows) == shape.rows
        assert all(sum(lengths[d] for d in row) <= SEQ for row in plan.rows)
        # a step reads the stream only while its documents do not fill it
        assert sum(lengths[d] for d in plan.left_over) <= shape.rows * SEQ + SEQ


def test_each_epoch_packs_every_document_once():
    """A corpus that fills whole steps exactly: step s packs the documents of epoch s."""
    documents = [[10 + 4 * i + k for k in range(4)] for i in range(6)]  # 6 x 4 tokens = 2 rows
    shape = BatchShape(dp=1, microbatches=2, microbatch_size=1)
    options = DataOptions(seq_len=SEQ, balanced=False)
    batches = train_batches(corpus_of(documents), options, shape, seed=5)
    for step, batch in enumerate(itertools.islice(batches, 3)):
        packed = [d for row in batch.rows for d in row]
        assert packed == epoch_order(6, 5, step).tolist()


@settings(max_examples=25, deadline=None)
@given(corpora(), shapes, st.booleans(), st.integers(0, 5), st.integers(0, 4))
def test_a_resumed_run_sees_the_same_batches(corpus, shape, balanced, seed, start):
    data = corpus_of(*corpus)
    options = DataOptions(seq_len=SEQ, balanced=balanced)
    whole = list(itertools.islice(train_batches(data, options, shape, seed=seed), start + 2))
    resumed = list(itertools.islice(train_batches(data, options, shape, seed=seed, start=start), 2))
    for a, b in zip(whole[start:], resumed):
        assert a.step == b.step and a.rows == b.rows
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    other = next(train_batches(data, options, shape, seed=seed + 100))
    assert other.step == 0  # another seed plans its own stream (same shape)
    assert other.inputs.shape == whole[0].inputs.shape


@settings(max_examples=30, deadline=None)
@given(corpora(), st.integers(1, 4))
def test_padded_rows_are_todays_rows_with_the_mask(corpus, count):
    documents, masks = corpus
    data = corpus_of(documents, masks)
    picks = [i % len(documents) for i in range(count)]
    built = padded_rows(data, picks, SEQ)
    attention = built.side["attention_mask"]
    expected = next_token_targets(built.inputs, attention_mask=attention)
    for r, d in enumerate(picks):
        n = len(documents[d])
        assert built.inputs[r, :n].tolist() == documents[d]
        assert attention[r].tolist() == [1] * n + [0] * (SEQ - n)
        if masks is not None:
            for k in range(1, n):
                if masks[d][k] == 0:
                    expected[r, k - 1] = IGNORE_INDEX
    assert torch.equal(built.targets, expected)


def test_unpacked_steps_take_one_document_per_row():
    documents = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    options = DataOptions(seq_len=SEQ, packing="none")
    shape = BatchShape(dp=2, microbatches=1, microbatch_size=2)
    batch = next(train_batches(corpus_of(documents), options, shape, seed=1))
    order = epoch_order(3, 1, 0).tolist() + epoch_order(3, 1, 1).tolist()
    assert [row for row in batch.rows] == [(d,) for d in order[:4]]
    assert set(batch.side) == {"attention_mask"}
    assert batch.real_tokens == sum(len(documents[d]) for d in order[:4])


def test_eval_batches_cover_the_set_once_in_file_order():
    documents = [[i * 10 + k for k in range(n)] for i, n in enumerate([5, 7, 3, 12, 2, 9, 4])]
    data = corpus_of(documents)
    shape = BatchShape(dp=1, microbatches=2, microbatch_size=1)
    for packing in ("documents", "none"):
        options = DataOptions(seq_len=SEQ, packing=packing, balanced=False)
        batches = eval_batches(data, options, shape)
        packed = [d for b in batches for row in b.rows for d in row]
        assert packed == list(range(len(documents))), packing
        assert all(b.inputs.shape == (2, SEQ) for b in batches)
        again = eval_batches(data, options, shape)
        assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(batches, again))
    last = eval_batches(data, DataOptions(seq_len=SEQ, packing="none"), shape)[-1]
    assert last.rows[-1] == () and last.side["attention_mask"][-1].tolist()[0] == 1
    assert (last.targets[-1] == IGNORE_INDEX).all()


def test_costs_and_refusals():
    documents = [[1] * 6, [2] * 3, [3] * 3]
    data = corpus_of(documents)
    shape = BatchShape(dp=1, microbatches=1, microbatch_size=1)
    cost = LengthCost(per_token=1.0, per_token_sq=0.5)
    batch = next(
        train_batches(data, DataOptions(seq_len=SEQ, balanced=False), shape, seed=0, cost=cost)
    )
    assert batch.microbatch_costs == (
        SEQ + 0.5 * sum(len(documents[d]) ** 2 for d in batch.rows[0]),
    )
    with pytest.raises(ValueError, match="longer than seq_len 4"):
        next(train_batches(data, DataOptions(seq_len=4), shape, seed=0))
    with pytest.raises(ValueError, match="microbatches must be an integer >= 1"):
        BatchShape(dp=1, microbatches=0, microbatch_size=1)
    with pytest.raises(ValueError, match="longer than 4"):
        packed_rows(data, [(1, 2)], 4)
    assert transformer_cost(64).per_token_sq == pytest.approx(1 / 384)
