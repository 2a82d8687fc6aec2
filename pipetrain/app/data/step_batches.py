"""Each training step's batch, the same from ``(seed, step)`` however the run got there; and a
fixed list of eval batches.

Documents are read as a stream: epoch ``e`` is a permutation of all documents drawn from
``(seed, e)``, and the epochs follow each other. A step offers the planner the documents the
previous step left over, first, then the next ones of the stream until they hold a whole
step's tokens; ``pipetrain.planner.varlen.pack_step`` decides which go into which micro-batch and
row (length-aware when ``balanced``, next-fit in order otherwise; balanced micro-batches are then
dealt to the replicas so their costs match and each replica runs its lightest first,
``arrange_microbatches``), and the rest is left over for the next step. Planning reads only lengths, so step ``s`` is found by replaying the plans of
steps ``0 .. s-1`` (cheap) and building only the rows of ``s``: a resumed run sees exactly the
batches of the uninterrupted one.

A step's batch is ``dp x microbatches`` micro-batches of ``microbatch_size`` rows, in that
order: replica ``r`` takes rows ``r*M*mbs .. (r+1)*M*mbs - 1`` (its micro-batches ``r*M ..
r*M+M-1``). Under a ``TokenBudget`` a step is offered its budget's tokens instead of its
shape's slots, and ``M`` is the step's own: the count its documents fill, one the schedule
accepts (``app.data.token_budget``). With ``packing="none"`` each row holds the next document of the stream, nothing is
left over, and ``balanced`` changes nothing (a padded row costs its full length whatever it
holds).

Eval batches are planned the same way from the documents in file order, no shuffle, until every
document is packed once: the same batches, of the training shape, at every eval.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipetrain.app.data.data_options import DataOptions
from pipetrain.app.data.packing import packed_rows, padded_rows
from pipetrain.app.data.token_budget import TokenBudget
from pipetrain.app.data.token_cache import TokenCorpus
from pipetrain.planner.varlen import LengthCost, arrange_microbatches, pack_step

#: the default cost: a document costs its tokens (what balances rows when attention is cheap)
LINEAR = LengthCost()
#: a step's rows, each the indices of the documents it holds (an empty row holds none)
RowPlan = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class BatchShape:
    """A step's shape: ``dp`` replicas, each running ``microbatches`` micro-batches of
    ``microbatch_size`` rows."""

    dp: int
    microbatches: int
    microbatch_size: int

    def __post_init__(self) -> None:
        for name in ("dp", "microbatches", "microbatch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def groups(self) -> int:
        """Micro-batches over all replicas."""
        return self.dp * self.microbatches

    @property
    def rows(self) -> int:
        """Rows over all replicas."""
        return self.groups * self.microbatch_size


@dataclass(frozen=True)
class StepBatch:
    """One step's batch for every replica (see the module docstring for the row order):
    ``pipe.step(inputs, targets, side=side)`` after each replica takes its rows.

    ``rows`` are the document indices of each row; ``real_tokens`` the document tokens in the
    inputs, ``predicted_tokens`` the targets not ignored (what ``token_mean`` divides by),
    ``padding_tokens`` the rest; ``microbatch_costs`` each micro-batch's cost as a fixed shape
    pays it (``LengthCost`` of its documents, padding at the linear rate)."""

    step: int
    #: micro-batches per replica (the shape's, or the step's own under a token budget)
    microbatches: int
    inputs: torch.Tensor
    targets: torch.Tensor
    side: dict[str, torch.Tensor]
    rows: RowPlan
    real_tokens: int
    predicted_tokens: int
    padding_tokens: int
    microbatch_costs: tuple[float, ...]


def transformer_cost(hidden: int) -> LengthCost:
    """A decoder layer's forward cost per document of ``n`` tokens, in units of one token
    through its dense layers: ``n + n² / (6 · hidden)``, from Megatron-LM's count of
    ``24·h²`` multiply-adds per token in the dense layers and ``4·n·h`` in attention
    (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters")."""
    if hidden < 1:
        raise ValueError(f"hidden must be >= 1, got {hidden}")
    return LengthCost(per_token=1.0, per_token_sq=1.0 / (6 * hidden))


def epoch_order(documents: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch ``epoch``'s permutation of ``documents`` document indices, drawn from
    ``(seed, epoch)`` alone."""
    return np.random.default_rng([seed, epoch]).permutation(documents)


@dataclass(frozen=True)
class StepPlan:
    """One step's plan: its ``rows`` (document indices), the documents ``left_over`` for the
    next step, how many documents of the stream had been read by then (``consumed``), and the
    micro-batches per replica its rows fill."""

    rows: RowPlan
    left_over: tuple[int, ...]
    consumed: int
    microbatches: int


def step_plans(
    lengths: Sequence[int] | np.ndarray,
    options: DataOptions,
    shape: BatchShape,
    *,
    seed: int,
    cost: LengthCost = LINEAR,
    budget: TokenBudget | None = None,
) -> Iterator[StepPlan]:
    """Every step's plan, from step 0 on, drawn from the shuffled stream (lengths only); with
    a ``budget``, each step holds its tokens in as many micro-batches as they fill
    (``app.data.token_budget``), else ``shape.microbatches``."""
    lengths = _checked_lengths(lengths, options.seq_len)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    stream = _Stream(len(lengths), seed)
    if options.packing == "none":
        if budget is not None:
            raise ValueError("a token budget packs documents: use packing='documents'")
        while True:
            rows: RowPlan = tuple((next(stream),) for _ in range(shape.rows))
            yield StepPlan(rows, (), stream.consumed, shape.microbatches)
    left: list[int] = []
    while True:
        rows, left, count = _plan(lengths, left, stream, options, shape, cost, budget)
        yield StepPlan(rows, tuple(left), stream.consumed, count)


def train_batches(
    corpus: TokenCorpus,
    options: DataOptions,
    shape: BatchShape,
    *,
    seed: int,
    start: int = 0,
    cost: LengthCost = LINEAR,
    budget: TokenBudget | None = None,
) -> Iterator[StepBatch]:
    """Endless training batches from step ``start`` on (steps before it are planned, not
    built): step ``s``'s batch is the same whatever ``start`` is. ``budget``: as
    ``step_plans``."""
    plans = step_plans(corpus.lengths, options, shape, seed=seed, cost=cost, budget=budget)
    for step, plan in enumerate(plans):
        if step >= start:
            own = dataclasses.replace(shape, microbatches=plan.microbatches)
            yield build_batch(corpus, options, own, plan.rows, step, cost)


def eval_batches(
    corpus: TokenCorpus,
    options: DataOptions,
    shape: BatchShape,
    *,
    cost: LengthCost = LINEAR,
) -> list[StepBatch]:
    """Batches covering every document once, in file order (see the module docstring). Each is
    built when the list is made; give an eval corpus of a size that fits in memory."""
    lengths = _checked_lengths(corpus.lengths, options.seq_len)
    plans: list[RowPlan] = []
    if options.packing == "none":
        for first in range(0, len(lengths), shape.rows):
            plans.append(tuple((i,) for i in range(first, min(first + shape.rows, len(lengths)))))
    else:
        stream = iter(range(len(lengths)))
        left: list[int] = []
        while True:
            rows, left, _ = _plan(lengths, left, stream, options, shape, cost, None)
            if not any(rows):
                break
            plans.append(rows)
    return [build_batch(corpus, options, shape, rows, i, cost) for i, rows in enumerate(plans)]


def build_batch(
    corpus: TokenCorpus,
    options: DataOptions,
    shape: BatchShape,
    rows: RowPlan,
    step: int,
    cost: LengthCost,
) -> StepBatch:
    """The tensors of one step's planned ``rows`` (fewer rows than the shape's: empty rows added)."""
    rows = tuple(rows) + ((),) * (shape.rows - len(rows))
    if options.packing == "none":
        built = padded_rows(corpus, [row[0] if row else None for row in rows], options.seq_len)
    else:
        built = packed_rows(corpus, rows, options.seq_len)
    per_row = []
    for row in rows:
        sizes = [len(corpus.document(i)[0]) for i in row]
        per_row.append(sum(map(cost.of, sizes)) + cost.per_token * (options.seq_len - sum(sizes)))
    size = shape.microbatch_size
    costs = tuple(sum(per_row[m * size : (m + 1) * size]) for m in range(shape.groups))
    return StepBatch(
        step=step,
        microbatches=shape.microbatches,
        inputs=built.inputs,
        targets=built.targets,
        side=built.side,
        rows=rows,
        real_tokens=built.real_tokens,
        predicted_tokens=built.predicted_tokens,
        padding_tokens=built.padding_tokens,
        microbatch_costs=costs,
    )


def _plan(
    lengths: np.ndarray,
    left: list[int],
    stream: Iterator[int],
    options: DataOptions,
    shape: BatchShape,
    cost: LengthCost,
    budget: TokenBudget | None,
) -> tuple[RowPlan, list[int], int]:
    """One step's rows from the left-over documents and as many more of ``stream`` as hold a
    step's tokens (the shape's slots; or the ``budget``'s tokens, which choose the count, then
    as many more as fill that count's slots); what is left over after it; and the micro-batches
    per replica the rows fill."""
    offered = list(left)
    step_tokens = shape.rows * options.seq_len if budget is None else budget.tokens
    room = step_tokens - sum(int(lengths[i]) for i in offered)
    while room > 0:
        index = next(stream, None)
        if index is None:
            break
        offered.append(index)
        room -= int(lengths[index])
    offered_lengths = [int(lengths[i]) for i in offered]
    if budget is not None:
        count = budget.count_for(offered_lengths)
        shape = dataclasses.replace(shape, microbatches=count)
        # the count's rows offered documents enough to fill them, as a fixed count's are: the
        # packer fills the gaps the budget's documents leave from these (the rest carried over)
        room = count * budget.tokens_per_count - sum(offered_lengths)
        while room > 0:
            index = next(stream, None)
            if index is None:
                break
            offered.append(index)
            offered_lengths.append(int(lengths[index]))
            room -= int(lengths[index])
    pack = pack_step(
        offered_lengths,
        microbatches=shape.groups,
        rows=shape.microbatch_size,
        seq_len=options.seq_len,
        cost=cost,
        balanced=options.balanced,
    )
    if options.balanced:  # replicas of equal cost, each running its lightest micro-batch first
        pack = arrange_microbatches(
            pack, offered_lengths, cost, seq_len=options.seq_len, replicas=shape.dp
        )
    rows = tuple(tuple(offered[k] for k in row) for mb in pack.microbatches for row in mb)
    return rows, [offered[k] for k in pack.left_over], shape.microbatches


class _Stream:
    """The documents, epoch after epoch, each epoch in its own order (``epoch_order``)."""

    def __init__(self, documents: int, seed: int) -> None:
        self.documents, self.seed, self.consumed = documents, seed, 0
        self._order = epoch_order(documents, seed, 0)

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        epoch, at = divmod(self.consumed, self.documents)
        if at == 0 and epoch:
            self._order = epoch_order(self.documents, self.seed, epoch)
        self.consumed += 1
        return int(self._order[at])


def _checked_lengths(lengths: Sequence[int] | np.ndarray, seq_len: int) -> np.ndarray:
    """The lengths as an int64 array (a Python int per document would not fit a large corpus in
    memory), each within ``seq_len``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if not len(lengths):
        raise ValueError("the corpus holds no documents")
    longest = int(lengths.max())
    if longest > seq_len:
        raise ValueError(
            f"the corpus holds a document of {longest} tokens, longer than seq_len {seq_len}: "
            "prepare it with the same seq_len"
        )
    return lengths
