"""Deferred weight gradients for ``nn.Linear``: ``I`` runs the whole backward except the linear
layers' weight-gradient GEMMs, which it stashes; ``W`` is those GEMMs and nothing else.

Why a second way to split the backward. ``split_backward`` splits *any* module exactly by replaying
graph nodes, but its ``W`` enters the autograd engine once per parameter group — six calls per
transformer block — and on an H200 host that costs ~1 ms per block against ~0.7 ms of GEMMs on
the device (``docs/performance.md``): with a few layers per stage, the zero-bubble schedules' ``W``
actions are host-bound and a slow host stretches them. The zero-bubble paper's own implementation
(Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024; Megatron-LM's ``WeightGradStore``)
defers only the linear layers' weight gradients: a linear layer's ``dW = dYᵀ X`` needs nothing but
its input ``X`` (saved by the forward anyway) and its output gradient ``dY`` (known once ``I`` has
passed it), and it is where almost all of ``W``'s work is. Here:

* ``defer_linear_weight_grads(module)`` turns the module's plain ``nn.Linear`` layers into
  ``DeferredLinear`` (same parameters, same state dict, still ``isinstance(m, nn.Linear)``); its
  backward computes ``dX`` and, while a stage's ``I`` is collecting (``backward_input`` below),
  records ``(weight, bias, X, dY)`` instead of computing ``dW`` and ``db``. Outside ``I`` (a full
  ``B``, plain ``loss.backward()``) it computes everything, as ``nn.Linear`` does.
* ``backward_input`` is one engine call for the stage inputs' *and every parameter's* gradient
  (LayerNorms, embeddings, anything not deferred are finished in ``I``, as in the paper); the graph
  is freed right after, so between ``I`` and ``W`` a micro-batch holds only the stashed ``X`` and
  ``dY`` — less than ``split_backward``'s retained graph plus captured gradients.
* ``backward_weight`` runs the stashed GEMMs, accumulating straight into ``.grad`` with
  ``addmm_`` (no engine, no temporaries). The stage's last weight piece of a step instead passes
  the micro-batch's gradients (the deferred ones and those its ``I`` held back) through
  ``AccumulateGrad`` with one ``torch.autograd.backward`` on the parameters, so post-accumulate-grad
  hooks fire once per parameter per step and see the step's whole gradient, as with ``B``.

Exact: every gradient is the sum of the same terms unsplit training computes (a weight used by
several linears, or by a linear and another op, gets each use's term). Not for modules run under
autocast (``DeferredLinear`` then falls back to ``F.linear``, and the engine computes that layer's
weight gradient in ``I``: still exact, just not deferred) or traced by ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge

from pipetrain.runtime.split_backward import accumulate_quietly, run_engine

#: the stash of the ``I`` being run, or ``None`` (then ``DeferredLinear`` computes everything).
#: A module global, not thread-local: on CUDA the engine runs backward functions on its own
#: device threads while the calling thread waits.
_collecting: list | None = None


@dataclass
class DeferredWork:
    """One micro-batch's ``W``: ``(weight, bias, X, dY)`` per deferred linear use (``None`` for a
    parameter that needs no gradient) and, for the step's last weight piece, the gradients its
    ``I`` computed but held back for ``AccumulateGrad``."""

    entries: list[tuple] = field(default_factory=list)
    held: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.entries and not self.held


class _LinearFunction(torch.autograd.Function):
    """``F.linear`` whose backward defers ``dW``/``db`` while a stage's ``I`` is collecting."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.params = (weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = grad_out.matmul(weight) if need_x else None
        stash = _collecting
        if stash is not None and (need_w or need_b):
            w, b = ctx.params
            # detached: the saved input carries its grad_fn, and W must record no history
            stash.append((w if need_w else None, b if need_b else None, x.detach(), grad_out))
            return grad_x, None, None
        dy, xs = _rows(grad_out), _rows(x)
        grad_w = dy.t().mm(xs) if need_w else None
        grad_b = dy.sum(0) if need_b else None
        return grad_x, grad_w, grad_b


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a matrix of rows (every leading dimension folded), as ``F.linear`` sees it."""
    return t.reshape(-1, t.shape[-1])


class DeferredLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient ``W`` computes (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wants = self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)
        if not (wants and torch.is_grad_enabled()) or torch.is_autocast_enabled(x.device.type):
            return F.linear(x, self.weight, self.bias)
        return _LinearFunction.apply(x, self.weight, self.bias)


def defer_linear_weight_grads(module: nn.Module) -> int:
    """Make every plain ``nn.Linear`` in ``module`` a ``DeferredLinear`` in place; returns how
    many. Subclasses of ``nn.Linear`` are left alone (their ``forward`` may differ)."""
    count = 0
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = DeferredLinear
            count += 1
    return count


def backward_input(
    roots: Sequence[GradientEdge],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    hold: bool,
) -> tuple[list[torch.Tensor | None], DeferredWork]:
    """``I``: the inputs' gradients (returned) and every parameter gradient but the deferred
    linears' (accumulated quietly into ``.grad``, or kept in the work with ``hold`` for the
    step's last weight piece); the graph is freed."""
    global _collecting
    work = DeferredWork()
    if not roots or not (inputs or params):
        return [None] * len(inputs), work
    _collecting = work.entries
    try:
        found = run_engine(roots, grads, [*inputs, *params], retain_graph=False, accumulate=False)
    finally:
        _collecting = None
    n = len(inputs)
    if hold:
        work.held = [(p, g) for p, g in zip(params, found[n:]) if g is not None]
    else:
        accumulate_quietly(params, found[n:])
    return list(found[:n]), work


@torch.no_grad()
def backward_weight(work: DeferredWork, hooks: bool) -> None:
    """``W``: the stashed GEMMs into ``.grad`` (through ``AccumulateGrad`` and its hooks only with
    ``hooks``, together with the gradients ``I`` held back). Under ``no_grad``: ``.grad`` must get
    no autograd history (it would keep every micro-batch's stashed tensors alive)."""
    if not hooks:
        for weight, bias, x, dy in work.entries:
            dy2 = _rows(dy)
            if weight is not None:
                _add_into(weight, dy2.t(), _rows(x))
            if bias is not None:
                _add_into(bias, dy2.sum(0), None)
        return
    total: dict[int, list] = {}  # id(param) -> [param, gradient]; a tied weight sums its uses
    for weight, bias, x, dy in work.entries:
        dy2 = _rows(dy)
        if weight is not None:
            _sum_into(total, weight, dy2.t().mm(_rows(x)))
        if bias is not None:
            _sum_into(total, bias, dy2.sum(0))
    for p, g in work.held:
        _sum_into(total, p, g)
    if total:
        params, values = zip(*total.values())
        torch.autograd.backward(list(params), list(values))


def _add_into(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None) -> None:
    """``p.grad += a @ b`` (or ``+= a`` without ``b``) in one kernel where ``.grad`` exists."""
    if p.grad is None:
        p.grad = a.mm(b) if b is not None else a  # fresh tensors, nobody else's
    elif b is not None:
        p.grad.addmm_(a, b)
    else:
        p.grad.add_(a)


def _sum_into(total: dict[int, list], p: torch.Tensor, g: torch.Tensor) -> None:
    slot = total.get(id(p))
    if slot is None:
        total[id(p)] = [p, g]
    else:
        slot[1] = slot[1] + g
