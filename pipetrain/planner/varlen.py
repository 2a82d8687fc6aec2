"""Which packed documents go to which micro-batch, so that micro-batches cost alike.

Packed training data puts several documents in one row of ``seq_len`` tokens, with attention
block-diagonal per document. Every micro-batch has the same shape (``rows x seq_len``), so the
dense layers cost the same on each, but attention costs about ``n²`` per document of ``n``
tokens: a micro-batch holding one long document costs more than one holding many short ones,
and in a pipeline every stage waits for the slowest micro-batch. WLB-LLM (Wang et al. 2025,
"WLB-LLM: Workload-Balanced 4D Parallelism for LLM Training") balances micro-batches by this
cost; here shapes stay fixed and only the assignment of documents to micro-batches changes.

``pack_step(..., balanced=False)`` is the packing every packer does (documents in order, next-fit
into rows); ``balanced=True`` packs at least the same documents so that the most expensive
micro-batch costs as little as it can find (longest-processing-time first, Graham 1969, into the
cheapest micro-batch with room, best-fit row), falling back to moving the fixed packing's whole
rows between micro-batches when the document-level assignment cannot fit them all, then fills
the rows' remaining room with later documents that do not raise the most expensive micro-batch.

``arrange_microbatches`` then deals a step's micro-batches to data-parallel replicas so that
their sums match (each replica runs its own pipeline and the step waits for the slowest) and
orders each replica's lightest first: in the simulator, micro-batches of unequal cost in random
order stall a pipeline's steady state where similar neighbours do not, and lightest first suits
both 1F1B and ZBV (``benchmarks/data/varlen_balance.py`` measures it).

``fit_length_cost`` finds the two coefficients from times measured at several lengths (least
squares, never negative), and ``with_length_costs`` writes each layer's into a costs file
(``pipetrain profile --seq-lens``).

The balance is judged on the cost a fixed shape pays (``StepPack.costs(..., padded_to=seq_len)``):
padding runs through the dense layers like any token, so only the quadratic part differs between
micro-batches of one step. Costs are in the caller's time units; nothing here knows seconds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipetrain.planner.costs_file import ModelCosts

Rows = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class LengthCost:
    """A document of n tokens costs per_token * n + per_token_sq * n * n (time units)."""

    per_token: float = 1.0
    per_token_sq: float = 0.0

    def __post_init__(self) -> None:
        for name in ("per_token", "per_token_sq"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"LengthCost.{name} must be a finite number >= 0, got {value!r}")

    def of(self, n: int) -> float:
        """What one document of ``n`` tokens costs."""
        return self.per_token * n + self.per_token_sq * n * n


@dataclass(frozen=True)
class StepPack:
    """One step's documents, packed: every micro-batch has exactly ``rows`` rows (a row may be
    empty, then it is all padding), so shapes never change between steps."""

    #: per micro-batch, its rows; each row the indices (into `lengths`) of the documents packed
    #: in it, in order; every row's documents sum to <= seq_len
    microbatches: tuple[Rows, ...]
    #: indices of documents that did not fit this step, in their given order (carried over)
    left_over: tuple[int, ...]

    def costs(
        self, lengths: Sequence[int], cost: LengthCost, *, padded_to: int | None = None
    ) -> tuple[float, ...]:
        """Per micro-batch, the sum of its documents' costs. With ``padded_to`` (the row length),
        each row also pays the linear part for its padding: what a fixed shape really runs."""
        out = []
        for rows in self.microbatches:
            total = 0.0
            for row in rows:
                total += sum(cost.of(lengths[i]) for i in row)
                if padded_to is not None:
                    tokens = sum(lengths[i] for i in row)
                    if tokens > padded_to:
                        raise ValueError(
                            f"a row holds {tokens} tokens, more than padded_to={padded_to}: "
                            "pass the row length the documents were packed into"
                        )
                    total += cost.per_token * (padded_to - tokens)
            out.append(total)
        return tuple(out)

    def packed(self) -> tuple[int, ...]:
        """Every packed document's index, ascending."""
        return tuple(sorted(i for rows in self.microbatches for row in rows for i in row))


def pack_step(
    lengths: Sequence[int],
    *,
    microbatches: int,
    rows: int,
    seq_len: int,
    cost: LengthCost,
    balanced: bool,
) -> StepPack:
    """Pack documents of ``lengths`` tokens into ``microbatches`` micro-batches of ``rows`` rows
    of ``seq_len`` tokens; the rest is ``left_over``. ``balanced`` packs at least the tokens the
    fixed packing does, with a most expensive micro-batch (padded cost) no dearer than its. With
    data parallelism, pack the whole step (``replicas × M`` micro-batches) and pass the result
    to ``arrange_microbatches``, which deals them to the replicas."""
    _check(lengths, microbatches, rows, seq_len)
    fixed = _fixed(lengths, microbatches, rows, seq_len)
    if not balanced:
        return fixed
    taken = fixed.packed()
    candidates = [
        c
        for c in (
            _by_document(lengths, taken, microbatches, rows, seq_len, cost),
            _by_row(lengths, fixed, rows, cost),
            fixed,
        )
        if c is not None
    ]
    best = min(candidates, key=lambda c: _score(c, lengths, cost, seq_len))
    return _fill(best, lengths, seq_len, cost)


def arrange_microbatches(
    pack: StepPack, lengths: Sequence[int], cost: LengthCost, *, seq_len: int, replicas: int = 1
) -> StepPack:
    """The same micro-batches, reordered: dealt to ``replicas`` consecutive groups of equal size
    (replica ``r`` runs micro-batches ``r·M .. r·M+M-1``) dearest first to the cheapest group
    still short of ``M``, then each group lightest first (padded costs; ties by index)."""
    count = len(pack.microbatches)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    if count % replicas:
        raise ValueError(
            f"{count} micro-batches do not split evenly over {replicas} replicas: give a "
            "multiple of the replicas"
        )
    per = count // replicas
    costs = pack.costs(lengths, cost, padded_to=seq_len)
    groups: list[list[int]] = [[] for _ in range(replicas)]
    sums = [0.0] * replicas
    for m in sorted(range(count), key=lambda m: (-costs[m], m)):
        g = min((g for g in range(replicas) if len(groups[g]) < per), key=lambda g: (sums[g], g))
        groups[g].append(m)
        sums[g] += costs[m]
    order = [m for group in groups for m in sorted(group, key=lambda m: (costs[m], m))]
    return StepPack(tuple(pack.microbatches[m] for m in order), pack.left_over)


def _check(lengths: Sequence[int], microbatches: int, rows: int, seq_len: int) -> None:
    for name, value in (("microbatches", microbatches), ("rows", rows), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    for i, n in enumerate(lengths):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= seq_len:
            raise ValueError(
                f"document {i} has length {n!r}; lengths must be integers 1..seq_len={seq_len}"
                " (split longer documents first)"
            )


def _fixed(lengths: Sequence[int], microbatches: int, rows: int, seq_len: int) -> StepPack:
    """Next-fit in the given order; the first document past the last row and all after it are
    left over."""
    packed: list[list[int]] = [[]]
    room = seq_len
    stop = len(lengths)
    for i, n in enumerate(lengths):
        if n > room:
            if len(packed) == microbatches * rows:
                stop = i
                break
            packed.append([])
            room = seq_len
        packed[-1].append(i)
        room -= n
    packed += [[] for _ in range(microbatches * rows - len(packed))]
    grouped = tuple(
        tuple(tuple(packed[m * rows + r]) for r in range(rows)) for m in range(microbatches)
    )
    return StepPack(microbatches=grouped, left_over=tuple(range(stop, len(lengths))))


def _score(
    pack: StepPack, lengths: Sequence[int], cost: LengthCost, seq_len: int
) -> tuple[float, float]:
    """Lower is better: the dearest padded micro-batch, then the dearest unpadded one."""
    return (max(pack.costs(lengths, cost, padded_to=seq_len)), max(pack.costs(lengths, cost)))


def _by_document(
    lengths: Sequence[int],
    taken: Sequence[int],
    microbatches: int,
    rows: int,
    seq_len: int,
    cost: LengthCost,
) -> StepPack | None:
    """Longest first, each into the cheapest micro-batch with a row that has room (ties: fewer
    tokens, then the lower index), its fullest such row; ``None`` when a document finds no room."""
    grid: list[list[list[int]]] = [[[] for _ in range(rows)] for _ in range(microbatches)]
    room = [[seq_len] * rows for _ in range(microbatches)]
    spent = [0.0] * microbatches
    tokens = [0] * microbatches
    for i in sorted(taken, key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        fits = [m for m in range(microbatches) if max(room[m]) >= n]
        if not fits:
            return None
        m = min(fits, key=lambda m: (spent[m], tokens[m], m))
        r = min((r for r in range(rows) if room[m][r] >= n), key=lambda r: (room[m][r], r))
        grid[m][r].append(i)
        room[m][r] -= n
        spent[m] += cost.of(n)
        tokens[m] += n
    return _assemble(grid, lengths, taken)


def _by_row(lengths: Sequence[int], fixed: StepPack, rows: int, cost: LengthCost) -> StepPack:
    """The fixed packing's rows, dearest first, each into the cheapest micro-batch that still
    has fewer than ``rows`` rows: always fits, since the rows did."""
    all_rows = [row for mb in fixed.microbatches for row in mb]
    row_cost = [sum(cost.of(lengths[i]) for i in row) for row in all_rows]
    count = len(fixed.microbatches)
    grid: list[list[list[int]]] = [[] for _ in range(count)]
    spent = [0.0] * count
    for k in sorted(range(len(all_rows)), key=lambda k: (-row_cost[k], k)):
        m = min((m for m in range(count) if len(grid[m]) < rows), key=lambda m: (spent[m], m))
        grid[m].append(list(all_rows[k]))
        spent[m] += row_cost[k]
    taken = [i for row in all_rows for i in row]
    return _assemble(grid, lengths, taken)


def _fill(pack: StepPack, lengths: Sequence[int], seq_len: int, cost: LengthCost) -> StepPack:
    """Later documents, in order, into the cheapest micro-batch with room (best-fit row) when
    that keeps the dearest padded micro-batch where it is."""
    grid = [[list(row) for row in mb] for mb in pack.microbatches]
    room = [[seq_len - sum(lengths[i] for i in row) for row in mb] for mb in grid]
    spent = list(pack.costs(lengths, cost, padded_to=seq_len))
    ceiling = max(spent)
    tokens = [sum(lengths[i] for row in mb for i in row) for mb in grid]
    for i in pack.left_over:
        n = lengths[i]
        fits = [m for m in range(len(grid)) if max(room[m]) >= n]
        if not fits:
            continue
        m = min(fits, key=lambda m: (spent[m], tokens[m], m))
        extra = cost.per_token_sq * n * n  # the linear part is already paid as padding
        if spent[m] + extra > ceiling:
            continue
        r = min((r for r in range(len(grid[m])) if room[m][r] >= n), key=lambda r: (room[m][r], r))
        grid[m][r].append(i)
        room[m][r] -= n
        spent[m] += extra
        tokens[m] += n
    taken = [i for mb in grid for row in mb for i in row]
    return _assemble(grid, lengths, taken)


def _assemble(
    grid: list[list[list[int]]], lengths: Sequence[int], taken: Sequence[int]
) -> StepPack:
    chosen = set(taken)
    return StepPack(
        microbatches=tuple(tuple(tuple(sorted(row)) for row in mb) for mb in grid),
        left_over=tuple(i for i in range(len(lengths)) if i not in chosen),
    )


def fit_length_cost(lengths: Sequence[int], times: Sequence[float]) -> LengthCost:
    """The ``LengthCost`` whose ``of(n)`` best fits ``times`` measured at ``lengths`` (least
    squares, no intercept: a row of no tokens costs nothing); a coefficient the unconstrained fit
    makes negative (noise on a term too small to see) is held at 0 and the other refitted."""
    if len(lengths) != len(times):
        raise ValueError(f"{len(lengths)} lengths for {len(times)} times")
    if len(set(lengths)) < 2 or any(n < 1 for n in lengths):
        raise ValueError(
            f"fitting a length cost needs times at two or more distinct lengths >= 1, got "
            f"{list(lengths)}"
        )
    if any(not math.isfinite(t) or t < 0 for t in times):
        raise ValueError(f"times must be finite and >= 0, got {list(times)}")
    top = max(lengths)
    xs = [n / top for n in lengths]  # scaled so that n, n² are of one size: a well-posed system
    s2, s3, s4 = (sum(x**k for x in xs) for k in (2, 3, 4))
    t1 = sum(x * t for x, t in zip(xs, times, strict=True))
    t2 = sum(x * x * t for x, t in zip(xs, times, strict=True))
    det = s2 * s4 - s3 * s3
    a, b = (t1 * s4 - t2 * s3) / det, (s2 * t2 - s3 * t1) / det
    if a < 0 or b < 0:
        candidates = [(t1 / s2, 0.0), (0.0, t2 / s4)]
        a, b = min(candidates, key=lambda c: _residual(c, xs, times))
    return LengthCost(per_token=a / top, per_token_sq=b / (top * top))


def _residual(
    coefficients: tuple[float, float], xs: Sequence[float], times: Sequence[float]
) -> float:
    a, b = coefficients
    return sum((a * x + b * x * x - t) ** 2 for x, t in zip(xs, times, strict=True))


def with_length_costs(by_length: Mapping[int, ModelCosts], *, at: int, rows: int) -> ModelCosts:
    """The costs measured at sequence length ``at``, each layer given the ``per_token`` and
    ``per_token_sq`` fitted to its forward + backward per row (``rows`` rows per micro-batch) over
    every length in ``by_length``: what a document of ``n`` tokens adds to a micro-batch."""
    if at not in by_length:
        raise ValueError(f"no costs measured at sequence length {at}: {sorted(by_length)}")
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    lengths = sorted(by_length)
    base = by_length[at]
    if any(by_length[n].num_layers != base.num_layers for n in lengths):
        raise ValueError("costs measured at different lengths have different layer counts")
    layers = []
    for i, layer in enumerate(base.layers):
        measured = [by_length[n].layers[i] for n in lengths]
        per_row = [(m.forward + m.backward) / rows for m in measured]
        fit = fit_length_cost(lengths, per_row)
        layers.append(
            dataclasses.replace(layer, per_token=fit.per_token, per_token_sq=fit.per_token_sq)
        )
    meta = {**base.meta, "length_cost": {"seq_lens": lengths, "rows": rows, "at": at}}
    return dataclasses.replace(base, layers=tuple(layers), meta=meta)


def model_length_cost(costs: ModelCosts) -> LengthCost:
    """What a document of ``n`` tokens costs the whole model (every layer's fit summed, ms): the
    cost to balance micro-batches by; ``ValueError`` when the file has no fit (profile it with
    ``--seq-lens``)."""
    missing = [x.name for x in costs.layers if x.per_token is None or x.per_token_sq is None]
    if missing:
        raise ValueError(
            f"the costs file has no per_token/per_token_sq for layer {missing[0]!r}: profile "
            "with pipetrain profile --seq-lens N1,N2,..."
        )
    return LengthCost(
        per_token=sum(x.per_token or 0.0 for x in costs.layers),
        per_token_sq=sum(x.per_token_sq or 0.0 for x in costs.layers),
    )
