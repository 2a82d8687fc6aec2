"""Extra loss terms a stage's layers produce in their forward (a router's load-balancing loss,
its z-loss): recorded by the layer, added to what its stage backpropagates, reported beside the
main loss.

The contract, for any module in a stage's layers (or a submodule of one):

* In its forward it calls ``record_extra_loss(self, name, value)`` with ``value`` a scalar tensor
  carrying its autograd graph, already times its coefficient and already normalised for *one*
  micro-batch (a router's balancing loss over that micro-batch's counted tokens).
* The step's objective is then ``main_loss + (1/M) Σ_micro-batches Σ_terms value`` with ``M``
  the step's micro-batches: exactly the unsplit model trained by gradient accumulation over the
  same micro-batches, each adding its terms divided by ``M`` (Megatron-Core's and torchtitan's
  per-layer, per-micro-batch form of a router's auxiliary loss). With data parallel the average
  runs over every replica's micro-batches (``term_weight``): a replica weighs its terms ``1/M``
  where replicas average their gradients (``loss_reduction="mean"``) and ``1/(M·dp)`` where they
  sum them (``"sum"``, ``"token_mean"``), so either way the reference is the unsplit model with
  gradient accumulation over all ``M·dp`` micro-batches of the global batch.
* The stage adds the micro-batch's terms to what it backpropagates: on the last stage into its
  weighted loss, on the others as one more root of the backward
  (``autograd.backward([outputs..., weighted terms], [output grads..., 1])``), whichever way the
  stage's backward runs (``B``; ``I`` then ``W``, by either split; per-layer checkpoints; a stage
  recomputed as a whole).
* ``Pipeline.step`` leaves each name's value in ``Pipeline.extra_losses`` (``dict[str, float]``):
  summed over layers and stages, averaged over micro-batches (and replicas), the same number on
  every rank.

Where records go. A ``StageRunner`` puts its pipeline's ``Sink`` on every submodule of its stage
(each step); a record made during the stage's own forward joins that micro-batch's terms. A
record made inside a backward — a per-layer checkpoint's recompute, in a pipeline or not — is
dropped: the forward's term already holds the graph the backward runs (recomputed tensors
included), and keeping the recompute's would hold recomputed activations. A stage recomputed as
a whole keeps its gradient-free forward's terms for the report and backpropagates its
recompute's (same values, counted once). Any other record (a plain forward of the unsplit model,
``pipetrain profile``, ``eval_step``) is kept on the recording module until
``take_extra_losses`` on it or an ancestor takes it, or until that module's next forward starts
(a forward pre-hook the first record installs): an untaken term holds its graph one forward at
most. So a plain forward of the unsplit model, then ``take_extra_losses(model)``, gives the terms
of that forward; a module run twice in one plain forward keeps only its last run's terms.

Not supported: a step captured as a CUDA graph (refused at the first record: a replay runs no
Python, so nothing would be recorded), and a record inside a ``torch.compile``d region (call it
from eager code: a compiled trace would fix the sink it saw).
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.runtime import losses, torch_compat
from pipetrain.runtime.comm.failures import PipelineRefused

if TYPE_CHECKING:
    from pipetrain.runtime.comm.agreement import Agreement
    from pipetrain.runtime.parallel.data_parallel import DataParallel

#: the attribute (in a module's ``__dict__``) that holds the sink of the stage running it
SINK = "_pipetrain_extra_loss_sink"
#: the attribute that holds a plain forward's terms until they are taken
KEPT = "_pipetrain_extra_losses"

Term = tuple[str, torch.Tensor]


def record_extra_loss(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Record ``value`` (a scalar tensor: coefficient and micro-batch normalisation applied) as
    the extra loss term ``name`` of ``module``'s current forward (module docstring). Terms of the
    same name from several layers add up."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"record_extra_loss: name must be a non-empty string, got {name!r}")
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"record_extra_loss({name!r}): value must be a scalar tensor, got {shape}; reduce "
            "it over the micro-batch first (e.g. its mean over counted tokens)"
        )
    if not (value.is_floating_point() or value.is_complex()):
        raise ValueError(
            f"record_extra_loss({name!r}): value must be floating point, got {value.dtype}"
        )
    sink = module.__dict__.get(SINK)
    if sink is not None and sink.active is not None:
        sink.active.append((name, value.reshape(())))
        return
    if torch_compat.in_backward():
        return  # a checkpoint's recompute: the forward's term already holds the graph
    kept = module.__dict__.get(KEPT)
    if kept is None:
        kept = module.__dict__[KEPT] = _Kept()
        module.register_forward_pre_hook(_drop_untaken)
    kept.append((name, value.reshape(())))


def take_extra_losses(module: nn.Module) -> dict[str, torch.Tensor]:
    """The terms recorded outside a pipeline by ``module`` and its submodules since they were
    last taken (in practice: in its last forward), summed by name, graphs kept; they are cleared.
    ``{}`` where nothing was recorded (or every record went to a pipeline's stage)."""
    terms: list[Term] = []
    for m in module.modules():
        kept = m.__dict__.get(KEPT)
        if kept:
            terms.extend(kept)
            kept.clear()
    return summed(terms)


def summed(terms: Iterable[Term]) -> dict[str, torch.Tensor]:
    """``terms`` added up by name (names in first-record order)."""
    total: dict[str, torch.Tensor] = {}
    for name, value in terms:
        total[name] = value if name not in total else total[name] + value
    return total


class _Kept(list):
    """A plain forward's terms on the recording module; a copy of the module starts with none
    (``copy.deepcopy`` cannot copy a tensor that carries a graph), and so does a pickled one."""

    def __deepcopy__(self, memo: dict) -> _Kept:
        return _Kept()

    def __reduce__(self):
        return (_Kept, ())


def _drop_untaken(module: nn.Module, args: object) -> None:
    """A forward pre-hook: terms of an earlier forward nobody took are let go (their graphs) —
    but not by a checkpoint's recompute inside a backward, which records nothing itself."""
    kept = module.__dict__.get(KEPT)
    if kept and not torch_compat.in_backward():
        kept.clear()


class Sink:
    """Where the records of a pipeline's stages go while one of its stages' forward collects
    (``collecting``); at other times a record goes where a plain forward's would. One per
    pipeline (a module in two local stages reaches the one collecting); a copy of a module
    carries none."""

    def __init__(self) -> None:
        self.active: list[Term] | None = None

    def install(self, module: nn.Module) -> None:
        """Put this sink on ``module`` and every submodule (again each step: cheap, and a module
        added between steps is covered)."""
        for m in module.modules():
            m.__dict__[SINK] = self

    def uninstall(self, module: nn.Module) -> None:
        """Take this sink off ``module``'s tree (where no other has replaced it)."""
        for m in module.modules():
            if m.__dict__.get(SINK) is self:
                del m.__dict__[SINK]

    @contextlib.contextmanager
    def collecting(self) -> Iterator[list[Term]]:
        """While inside, records join the list yielded (one micro-batch's forward)."""
        terms: list[Term] = []
        before, self.active = self.active, terms
        try:
            yield terms
        finally:
            self.active = before

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self):
        return (_none, ())


def _none() -> None:
    return None


def weighted_root(terms: list[Term], weight: float) -> torch.Tensor | None:
    """``weight · Σ terms``, the scalar a stage backpropagates for them (``None``: no term needs
    a gradient)."""
    graphed = [v for _, v in terms if v.requires_grad]
    if not graphed:
        return None
    return sum(graphed[1:], graphed[0]) * weight


def add_to_report(report: dict[str, torch.Tensor], terms: list[Term]) -> None:
    """Add ``terms`` (detached, float64) into a stage's step report, by name."""
    for name, value in terms:
        v = value.detach().to(torch.float64)
        report[name] = v if name not in report else report[name] + v


def refuse_captured(terms: list[Term], stage: int) -> None:
    if terms:
        names = ", ".join(sorted({n for n, _ in terms}))
        raise PipelineRefused(
            f"stage {stage} records extra loss terms ({names}), which a step captured as a CUDA "
            "graph cannot (a replay runs no Python to record them); pass cuda_graph=False"
        )


def term_weight(num_microbatches: int, data_parallel: DataParallel | None) -> float:
    """What a replica weighs each micro-batch's terms by (module docstring): ``1/M``, or
    ``1/(M·dp)`` where the replicas sum their gradients rather than average them."""
    if data_parallel is None or data_parallel.reduction == "mean":
        return 1.0 / num_microbatches
    return 1.0 / (num_microbatches * data_parallel.size)


class StepTerms:
    """A pipeline's extra-loss bookkeeping: the sink its stages share, each stage's weight, and
    the names its ranks agreed on (kept between steps: new names cost one store exchange)."""

    def __init__(
        self,
        runners: Iterable,
        num_microbatches: int,
        data_parallel: DataParallel | None,
        agreement: Agreement,
        last_rank: int,
    ) -> None:
        self.runners = list(runners)
        self.last_rank = last_rank  # the loss's rank
        self.num_microbatches = num_microbatches
        self.data_parallel = data_parallel
        self.agreement = agreement
        self.names: tuple[str, ...] = ()
        self._report: dict[str, torch.Tensor] = {}  # this step's, until it is agreed
        sink, weight = Sink(), term_weight(num_microbatches, data_parallel)
        for runner in self.runners:
            runner.use_sink(sink)
            runner.extra_weight = weight

    def local(self, device: torch.device) -> tuple[torch.Tensor, tuple[str, ...]]:
        """This rank's vector ``[new names?, Σ per agreed name...]`` (its stages' step reports,
        taken) and the names it recorded."""
        report: dict[str, torch.Tensor] = {}
        for runner in self.runners:
            for name, value in runner.take_extra_report().items():
                report[name] = value if name not in report else report[name] + value
        self._report = report
        if not report and not self.names:  # a model without extra losses: no work for them
            return torch.zeros(1, dtype=torch.float64, device=device), ()
        mine = tuple(sorted(report))
        vector = torch.zeros(1 + len(self.names), dtype=torch.float64, device=device)
        vector[0] = float(not set(mine) <= set(self.names))
        for i, name in enumerate(self.names):
            if name in report:
                vector[1 + i] = report[name]
        return vector, mine

    def agree(self, weights, transport) -> tuple[torch.Tensor, dict[str, float]]:
        """The step's loss (``losses.agree``: ``Σ_j w_j · loss_j`` from the last stage) and its
        extra terms by name (``finish``), the same on every rank, agreed in the loss's collective
        unless some rank recorded a name not agreed yet."""
        last = [r.losses for r in self.runners if r.is_last]
        held = last[0] if last else None
        vector, mine = self.local(transport.device)
        last_rank, world_size = self.last_rank, self.agreement.world_size
        loss, totals = losses.agree(held, weights, transport, last_rank, world_size, vector)
        assert totals is not None  # an extra vector was given
        if totals[0] > 0:  # the same on every rank: it is a sum over them
            totals = self.relayout(mine, transport.device)
            if world_size > 1:
                losses.sum_over_ranks(totals, transport, last_rank, "the extra loss agreement")
        else:
            totals = totals[1:]
        return loss, self.finish(totals)

    def relayout(self, mine: tuple[str, ...], device: torch.device) -> torch.Tensor:
        """After some rank recorded a name not agreed yet: every rank's names (a store
        exchange), their union as the new layout, and this rank's vector in it. Names only
        join: a name once recorded is reported every later step (0 where nothing recorded it)."""
        records = self.agreement.gather("extra loss names", {"names": list(mine)})
        self.names = tuple(sorted({n for r in records for n in r["names"]}))
        vector = torch.zeros(len(self.names), dtype=torch.float64, device=device)
        for i, name in enumerate(self.names):
            if name in self._report:
                vector[i] = self._report[name]
        return vector

    def finish(self, totals: torch.Tensor) -> dict[str, float]:
        """Each name's value from the pipeline's sums (``totals``, in ``names`` order): averaged
        over micro-batches and, with data parallel, over replicas (collective over them)."""
        self._report = {}
        values = totals.to(torch.float64) / self.num_microbatches
        dp = self.data_parallel
        # every step, names or none: a replica cannot know that the others recorded nothing
        if dp is not None and dp.size > 1:
            values = _replica_mean(values, self.names, dp.group, dp.size)
        return dict(zip(self.names, values.tolist(), strict=True))


def _replica_mean(values: torch.Tensor, names: tuple[str, ...], group, size: int) -> torch.Tensor:
    """The mean of ``values`` over the replicas, after checking they recorded the same names (a
    sum of (count, checksum) that is not ``size`` times this rank's means some replica differs)."""
    mine = [float(len(names)), float(zlib.crc32("\0".join(names).encode()))]
    check = torch.tensor(mine, dtype=torch.float64, device=values.device)
    dist.all_reduce(check, group=group)
    if check.tolist() != [size * v for v in mine]:
        raise PipelineRefused(
            f"data-parallel replicas recorded different extra loss names (this one: "
            f"{', '.join(names)}); every replica's layers must record the same names each step"
        )
    if not names:
        return values
    total = values.clone()
    dist.all_reduce(total, group=group)
    return total / size
