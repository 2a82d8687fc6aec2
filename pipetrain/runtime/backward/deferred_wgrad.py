"""Deferred weight gradients for ``nn.Linear``: ``I`` runs the whole backward except the linear
layers' weight-gradient GEMMs, which it stashes; ``W`` is those GEMMs and nothing else.

Why a second way to split the backward. ``graph_replay`` splits *any* module exactly by replaying
graph nodes, but its ``W`` enters the autograd engine once per parameter group — six calls per
transformer block — and that costs more host time per block than the device spends on its GEMMs
(measured: ``docs/performance.md``): with a few layers per stage, the zero-bubble schedules' ``W``
actions are host-bound and a slow host stretches them. The zero-bubble paper's own implementation
(Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024; Megatron-LM's ``WeightGradStore``)
defers only the linear layers' weight gradients: a linear layer's ``dW = dYᵀ X`` needs nothing but
its input ``X`` (saved by the forward anyway) and its output gradient ``dY`` (known once ``I`` has
passed it), and it is where almost all of ``W``'s work is. Here:

* ``DeferredLinears(module)`` (one per stage) finds the module's plain ``nn.Linear`` layers and,
  only while the stage's own forward runs (``call``), routes each through ``_LinearFunction``: an
  instance ``forward`` is set for the call and removed after it, so the module's classes, state
  dict and behaviour outside the pipeline are never changed. Its backward computes ``dX`` and,
  while the stage's ``I`` is collecting (``backward_input`` below), records
  ``(weight, bias, X, dY)`` instead of computing ``dW`` and ``db``. Outside a stage's backward
  (plain ``loss.backward()``) it computes everything, as ``nn.Linear`` does. Under saved-tensor
  hooks (activation checkpointing, offload) it is two functions, ``_SavedInput`` then
  ``_Product``, so that ``X`` is packed before the product runs (``_SavedInput`` says why). Under
  autocast it casts as autocast would and saves the casts (the pair saves the cast ``X`` and
  casts the weight again in its backward); ``.grad`` keeps the parameter's dtype. What the
  backward does is the ``DeferredLinears`` object's ``mode``, which the graph reaches through
  the autograd context: nothing is shared between stages or pipelines.
* ``backward_input`` is one engine call for the stage inputs' *and every parameter's* gradient
  (LayerNorms, embeddings, anything not deferred are finished in ``I``, as in the paper); the graph
  is freed right after, so between ``I`` and ``W`` a micro-batch holds only the stashed ``X`` and
  ``dY`` — less than ``graph_replay``'s retained graph plus captured gradients.
* ``backward_weight`` runs the stashed GEMMs, accumulating straight into ``.grad`` with
  ``addmm_`` (no engine, no temporaries). The stage's last weight piece of a step instead passes
  the micro-batch's gradients (the deferred ones and those its ``I`` held back) through
  ``AccumulateGrad`` with one ``torch.autograd.backward`` on the parameters, so post-accumulate-grad
  hooks fire once per parameter per step and see the step's whole gradient, as with ``B``. ``I``
  holds its gradients back only where such a hook exists (``StageRunner.hooked``): a held
  gradient is parameter-sized and, in a zero-bubble schedule, waits for the step's last ``W``.
* ``backward_full`` without ``hooks`` is a ``B`` that is not the step's last weight piece: the deferred
  linears add ``dW`` straight into ``.grad`` (one ``addmm_`` where plain autograd runs a GEMM into
  a temporary, then ``AccumulateGrad``'s add — Megatron-LM's gradient-accumulation fusion), so the
  1F1B family and DualPipeV's pairs gain too.

Which stages defer (``worth_deferring``): those whose plain ``nn.Linear`` layers hold at least half
of the trainable parameter elements. Elsewhere (convolutions, custom layers, ``nn.Linear``
subclasses) ``I`` would be the whole backward and ``W`` next to nothing, leaving a zero-bubble
schedule no work to fill its bubbles with: such stages keep the graph-replay split.

Exact: every gradient is the sum of the same terms unsplit training computes (a weight used by
several linears, or by a linear and another op, gets each use's term). Not always the same bits:
``addmm_`` adds ``.grad`` inside the GEMM, where graph replay and plain autograd round the GEMM
first and add after, and a BLAS that folds ``.grad`` into its sums (MKL on some x86 CPUs) rounds
the two differently. So a run whose layout defers other stages than another run's agrees with it
to round-off, not bit for bit; the same layout repeats its bits.

Under ``torch.compile`` (a block compiled on its own, as torchtitan compiles them) the deferred
linear's forward is kept out of the trace (``torch.compiler.disable``): the mode is Python state
a compiled backward would have fixed at trace time, deferring nothing. Dynamo breaks the graph
around each deferred linear, so the linears run as here and the code between them compiles in
pieces. Only on request (``defer_weight_grads=True``): a compiled stage defaults to graph replay,
which takes a compiled region's weight gradients in ``I``. A module compiled with
``fullgraph=True`` forbids the breaks: refused at the first step, naming both ways out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.runtime.backward.graph_replay import accumulate_quietly, backward_full, run_engine
from pipetrain.runtime.comm.failures import PipelineRefused
from pipetrain.runtime.torch_compat import GradientEdge, graph_break_refused, saved_tensors_hooked

#: ``DeferredLinears.mode`` during a quiet ``B``: add ``dW``/``db`` into ``.grad`` at once (one
#: ``addmm_`` instead of a GEMM, a temporary and an add: Megatron-LM's gradient-accumulation
#: fusion). The other modes: ``None`` — return them, as ``nn.Linear`` does; a list — the stash of
#: the ``I`` being run.
ACCUMULATE = "accumulate"

Entry = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]


@dataclass
class DeferredWork:
    """One micro-batch's ``W``: ``(weight, bias, X, dY)`` per deferred linear use (``None`` for a
    parameter that needs no gradient) and, for the step's last weight piece, the gradients its
    ``I`` computed but held back for ``AccumulateGrad``."""

    entries: list[Entry] = field(default_factory=list)
    held: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class _LinearFunction(torch.autograd.Function):
    """``F.linear`` whose backward defers ``dW``/``db`` while its stage's ``I`` is collecting, or
    adds them straight into ``.grad`` during a quiet ``B`` (the owner's ``mode``)."""

    @staticmethod
    def forward(ctx, owner, x, weight, bias):
        ctx.owner = owner  # a plain attribute: the graph keeps its stage's DeferredLinears alive
        ctx.params = (weight, bias)
        x, weight, bias, cast = _autocast(x, weight, bias)
        with cast:
            out = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        _, need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = grad_out.matmul(weight) if need_x else None
        return None, grad_x, *_weight_half(ctx.owner, ctx.params, need_w, need_b, x, grad_out)


class _Link:
    """What a deferred linear's two halves share (``_SavedInput``, ``_Product``): the owner, and
    ``dY`` from the product's backward until the input's backward takes it."""

    __slots__ = ("grad_out", "owner")

    def __init__(self, owner: DeferredLinears) -> None:
        self.owner = owner
        self.grad_out: torch.Tensor | None = None


class _SavedInput(torch.autograd.Function):
    """A deferred linear's first half where saved-tensor hooks are active (activation
    checkpointing, offload): saves ``X`` and hands it on, so the hook packs ``X`` as this returns,
    before the product runs. A checkpoint's recompute stops once the last tensor its region saved
    is packed again (torch's early stop), so a recomputed layer skips its last linear's product,
    as with ``nn.Linear``, whose ``addmm`` saves its inputs before computing; one function that
    saved after its product would run that product for nothing. Its backward is the weight half
    (``_weight_half``) with ``dY`` from ``_Product``'s backward, which runs first (this function's
    output feeds only the product)."""

    @staticmethod
    def forward(ctx, link, x, weight, bias):
        ctx.link, ctx.params = link, (weight, bias)
        ctx.set_materialize_grads(False)  # an input that needs no gradient gets none from below
        x, _, _, _ = _autocast(x, weight, bias)
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        (x,) = ctx.saved_tensors
        link = ctx.link
        dy, link.grad_out = link.grad_out, None
        _, need_x, need_w, need_b = ctx.needs_input_grad
        weight_half = _weight_half(link.owner, ctx.params, need_w, need_b, x, dy)
        return None, grad_x if need_x else None, *weight_half


class _Product(torch.autograd.Function):
    """A deferred linear's second half: ``F.linear`` on the saved input; its backward leaves
    ``dY`` for ``_SavedInput`` and computes ``dX`` from the weight itself (a parameter, held
    anyway: nothing saved), cast as autocast cast it."""

    @staticmethod
    def forward(ctx, link, x, weight, bias, input_needs_grad):
        ctx.link, ctx.weight, ctx.input_needs_grad = link, weight, input_needs_grad
        x, weight, bias, cast = _autocast(x, weight, bias)
        with cast:
            return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        ctx.link.grad_out = grad_out
        if not ctx.input_needs_grad:
            return None, None, None, None, None
        weight = ctx.weight.to(grad_out.dtype)  # the parameter, or its autocast cast again
        return None, grad_out.matmul(weight), None, None, None


def _autocast(x, weight, bias):
    """``x``, ``weight``, ``bias`` cast as autocast would cast them for ``F.linear`` (unchanged
    without it), and the context to compute in (autocast off once cast)."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, weight, bias, contextlib.nullcontext()
    dtype = torch.get_autocast_dtype(device)
    bias = bias.to(dtype) if bias is not None else None
    return x.to(dtype), weight.to(dtype), bias, torch.autocast(device, enabled=False)


def _weight_half(owner, params, need_w: bool, need_b: bool, x, dy):
    """A deferred linear's ``dW``, ``db`` as its owner's ``mode`` says: stashed for ``W`` or added
    into ``.grad`` (both returning ``None, None``), else returned, as ``nn.Linear`` would."""
    if not (need_w or need_b):
        return None, None
    mode = owner.mode
    if mode is not None:
        w, b = params
        # detached: the saved input carries its grad_fn, and W must record no history
        entry = (w if need_w else None, b if need_b else None, x.detach(), dy)
        if mode is ACCUMULATE:
            _accumulate(*entry)
        else:
            mode.append(entry)
        return None, None
    dy2, xs = _rows(dy), _rows(x)
    return (dy2.t().mm(xs) if need_w else None), (dy2.sum(0) if need_b else None)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a matrix of rows (every leading dimension folded), as ``F.linear`` sees it."""
    return t.reshape(-1, t.shape[-1])


def _plain_linear(m: nn.Module) -> bool:
    """An ``nn.Linear`` itself (not a subclass, whose ``forward`` may differ) with no instance
    ``forward`` of its own."""
    return type(m) is nn.Linear and "forward" not in m.__dict__


def plain_linears(module: nn.Module) -> list[nn.Linear]:
    """The plain ``nn.Linear`` layers in ``module`` (each once)."""
    return [m for m in module.modules() if isinstance(m, nn.Linear) and _plain_linear(m)]


def linear_share(module: nn.Module) -> tuple[int, int]:
    """(trainable parameter elements in ``module``'s plain ``nn.Linear`` layers, all its trainable
    parameter elements), each parameter counted once."""
    trainable = {id(p): p.numel() for p in module.parameters() if p.requires_grad}
    in_linears = {
        id(p): p.numel()
        for m in plain_linears(module)
        for p in m.parameters(recurse=False)
        if p.requires_grad
    }
    return sum(in_linears.values()), sum(trainable.values())


def worth_deferring(module: nn.Module) -> bool:
    """Whether plain ``nn.Linear`` layers hold at least half of ``module``'s trainable parameter
    elements (``linear_share``), so deferring their weight GEMMs leaves ``W`` the bulk of the
    weight-gradient work."""
    in_linears, total = linear_share(module)
    return total > 0 and 2 * in_linears >= total


class DeferredLinears:
    """The ``BackwardSplit`` that defers the linear layers' weight GEMMs to ``W`` (module
    docstring), for the stage ``module``. Holds what its linears' backward does (``mode``)."""

    defers_linear_weights = True
    #: its quiet ``B`` is the fused accumulation (the deferred GEMMs add straight into ``.grad``)
    plain_accumulation = False

    def __init__(self, module: nn.Module) -> None:
        self.mode: list[Entry] | str | None = None
        self.linears = plain_linears(module)
        compiled = has_compiled_parts(module)
        self._forwards = [self._deferred_forward(m, compiled) for m in self.linears]

    def _deferred_forward(
        self, linear: nn.Linear, compiled: bool
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            weight, bias = linear.weight, linear.bias
            wants = weight.requires_grad or (bias is not None and bias.requires_grad)
            if not (wants and torch.is_grad_enabled()):
                return F.linear(x, weight, bias)
            if saved_tensors_hooked():  # ``_SavedInput`` says why
                link = _Link(self)
                x_in = _SavedInput.apply(link, x, weight, bias)
                return _Product.apply(link, x_in, weight, bias, x.requires_grad)
            return _LinearFunction.apply(self, x, weight, bias)

        # Inside a compiled module, not traced: the mode must be read when the backward runs.
        # (Only there: disable imports dynamo, which a run that compiles nothing never needs.)
        return torch.compiler.disable(forward) if compiled else forward

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """While inside, the stage's plain linears run ``_LinearFunction`` (an instance
        ``forward`` shadows the class's; removed on the way out, whatever happens)."""
        for m, f in zip(self.linears, self._forwards):
            m.__dict__["forward"] = f
        try:
            yield
        finally:
            for m in self.linears:
                m.__dict__.pop("forward", None)

    def call(self, module: nn.Module, args: tuple[torch.Tensor, ...]):
        with self.deferring():
            try:
                return module(*args)
            except Exception as e:
                if not (graph_break_refused(e) and "_deferred_forward" in str(e)):
                    raise
                raise PipelineRefused(
                    "a module compiled with fullgraph=True holds linear layers whose weight "
                    "gradients this stage defers (the graph must break around each); compile "
                    "it without fullgraph=True, or pass defer_weight_grads=False (a compiled "
                    "stage's default)"
                ) from e

    def backward_full(
        self,
        roots: Sequence[GradientEdge],
        grads: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
        hooks: bool,
    ) -> list[torch.Tensor | None]:
        """``B``. With ``hooks`` (the step's last weight piece) an ordinary backward through
        ``AccumulateGrad``; without, ``graph_replay.backward_full``'s quiet ``B`` with the
        deferred linears adding their weight gradients straight into ``.grad``."""
        # Inside ``deferring``: activation checkpointing recomputes the forward during the
        # backward, and must run the same linears the forward ran (same saved tensors).
        with self.deferring():
            if hooks:
                return backward_full(roots, grads, inputs, params, hooks=True)
            with self._in_mode(ACCUMULATE):
                return backward_full(roots, grads, inputs, params, hooks=False)

    def backward_input(
        self,
        roots: Sequence[GradientEdge],
        grads: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
        last_piece: bool = False,
        through_autograd: bool = False,
    ) -> tuple[list[torch.Tensor | None], DeferredWork]:
        """``I``: the inputs' gradients (returned) and every parameter gradient but the deferred
        linears' (accumulated quietly into ``.grad``, or with ``last_piece`` kept in the work for
        ``W`` to pass through ``AccumulateGrad``); the graph is freed."""
        work = DeferredWork()
        if not roots or not (inputs or params):
            return [None] * len(inputs), work
        with self.deferring(), self._in_mode(work.entries):  # deferring: see backward_full
            found = run_engine(
                roots, grads, [*inputs, *params], retain_graph=False, accumulate=False
            )
        n = len(inputs)
        if last_piece:
            work.held = [(p, g) for p, g in zip(params, found[n:]) if g is not None]
        else:
            accumulate_quietly(params, found[n:])
        return list(found[:n]), work

    @torch.no_grad()
    def backward_weight(self, work: DeferredWork, hooks: bool = True) -> None:
        """``W``: the stashed GEMMs into ``.grad`` (through ``AccumulateGrad`` and its hooks only
        with ``hooks``, together with the gradients ``I`` held back). Under ``no_grad``: ``.grad``
        must get no autograd history (it would keep every micro-batch's stashed tensors alive)."""
        if not hooks:
            for entry in work.entries:
                _accumulate(*entry)
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

    @contextlib.contextmanager
    def _in_mode(self, mode: list[Entry] | str) -> Iterator[None]:
        self.mode = mode
        try:
            yield
        finally:
            self.mode = None


@torch.no_grad()
def _accumulate(weight, bias, x, dy) -> None:
    """One deferred linear use's ``dW``/``db`` into ``.grad`` (no autograd history)."""
    dy2 = _rows(dy)
    if weight is not None:
        _add_into(weight, dy2.t(), _rows(x))
    if bias is not None:
        _add_into(bias, dy2.sum(0), None)


def _add_into(p: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None) -> None:
    """``p.grad += a @ b`` (or ``+= a`` without ``b``) in one kernel where ``.grad`` exists and
    the dtypes agree (under autocast the GEMM runs in the autocast dtype, ``.grad`` keeps the
    parameter's)."""
    if p.grad is None:
        p.grad = (a.mm(b) if b is not None else a).to(p.dtype)  # fresh: nobody else's tensor
    elif b is not None and a.dtype == p.grad.dtype:
        p.grad.addmm_(a, b)
    else:
        p.grad.add_(a.mm(b) if b is not None else a)


def _sum_into(total: dict[int, list], p: torch.Tensor, g: torch.Tensor) -> None:
    g = g.to(p.dtype)
    slot = total.get(id(p))
    if slot is None:
        total[id(p)] = [p, g]
    else:
        slot[1] = slot[1] + g


def has_compiled_parts(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule was compiled in place (``module.compile()``) or is
    ``torch.compile``'s wrapper (``OptimizedModule``, which keeps ``_orig_mod``)."""
    return any(
        getattr(m, "_compiled_call_impl", None) is not None or hasattr(m, "_orig_mod")
        for m in module.modules()
    )
