"""One stage on this rank: forward with its graph kept, then B, or I and W, per micro-batch.

The stage owns what a micro-batch leaves behind between its forward and its last backward piece:
the input leaves (to read their gradients), the gradient edges of its outputs (never the output
tensors themselves: an activation that was sent can be freed while its graph stays — Megatron's
``deallocate_pipeline_outputs`` without touching ``.data``), and after ``I`` the work for ``W``.
Each piece pops what it consumed, so after a micro-batch's last piece nothing of it is left. A
stage recomputed as a whole owns its inputs instead, and builds the rest at its first backward
piece (``whole_stage_recompute``).
Communication and ordering belong to the executor; the split itself to the stage's
``BackwardSplit`` (``interface``): ``graph_replay``'s graph replay (any module) or
``deferred_wgrad``'s deferred linear weight GEMMs (the zero-bubble paper's way).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipetrain.runtime import extra_losses, side_inputs
from pipetrain.runtime.backward import activation_checkpoint
from pipetrain.runtime.backward import whole_stage_recompute as whole
from pipetrain.runtime.backward.interface import BackwardSplit, choose_split, fire_hooks
from pipetrain.runtime.comm.failures import PipelineRefused
from pipetrain.runtime.comm.p2p import TensorMeta
from pipetrain.runtime.host_offload import StageOffload
from pipetrain.runtime.torch_compat import (
    GradientEdge,
    get_gradient_edge,
    post_accumulate_grad_hooks,
)


@dataclass
class _Saved:
    """A micro-batch between its forward and its backward."""

    inputs: list[torch.Tensor]  # input leaves that need a gradient, in input order
    roots: list[GradientEdge]  # outputs that need a gradient (the weighted loss on the last stage)
    root_metas: list[TensorMeta]  # of the roots whose gradients arrive (all on the last stage)
    device: torch.device
    #: the weighted extra loss terms, the last root of a stage that is not the last
    #: (``runtime.extra_losses``); its gradient is one
    extra: TensorMeta | None = None


def arity(module: nn.Module) -> tuple[int, float]:
    """(fewest, most) positional arguments ``module.forward`` accepts; (0, inf) if unknown."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return 0, math.inf
    lo, hi = 0, 0.0
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            hi = math.inf
        elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            hi += 1
            lo += p.default is p.empty
    return lo, hi


def leaves(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Cut the graph between stages: fresh leaves that need a gradient where the source did."""
    return tuple(t.detach().requires_grad_(t.requires_grad and _grad_dtype(t)) for t in tensors)


def _grad_dtype(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


class StageRunner:
    """Runs stage ``index`` (``module``); the last stage also applies ``loss_fn``.

    ``defer_weight_grads``: split ``I``/``W`` with ``deferred_wgrad`` (the module's plain
    ``nn.Linear`` layers' weight GEMMs deferred while the stage runs; quiet ``B`` pieces fuse
    their accumulation) instead of ``graph_replay``'s graph replay; ``None``: as
    ``interface.choose_split`` says for an eager or a ``captured`` (CUDA graph) step.
    ``split``: a ``BackwardSplit`` of the caller's instead."""

    def __init__(
        self,
        index: int,
        module: nn.Module,
        is_last: bool,
        loss_fn: Callable | None,
        defer_weight_grads: bool | None = None,
        split: BackwardSplit | None = None,
        captured: bool = False,
        splits_backward: bool = True,
    ) -> None:
        self.index = index
        self.module = module
        self.is_last = is_last
        self.loss_fn = loss_fn
        if split is None:
            split = choose_split(module, defer_weight_grads, index, captured, splits_backward)
        self.split = split
        self.defer_weight_grads = self.split.defers_linear_weights
        #: the stage recomputes as a whole (``whole_stage_recompute``): ``F`` without autograd
        self.recomputes_whole = bool(getattr(module, "recompute_whole", False))
        if self.recomputes_whole and captured:
            raise PipelineRefused(
                f"stage {index} recomputes as a whole, which restores the forward's random state "
                "for the recompute: not possible inside a captured CUDA graph; recompute its "
                "layers ('full' or 'selective') or pass cuda_graph=False"
            )
        self.saved: dict[int, _Saved | whole.Held] = {}
        self.weight_work: dict[int, object] = {}
        self.losses: dict[int, torch.Tensor] = {}
        #: the micro-batch whose backward piece is this stage's last weight-gradient work in a
        #: step (set by the pipeline from the program); only that one runs ``.grad`` hooks
        self.last_weight_microbatch: int | None = None
        #: ids of parameters whose hooks this stage never fires (tied ones: ``runtime.parallel.tied``
        #: sums their gradient after the step, then fires their hooks once)
        self.quiet_params: set[int] = set()
        #: whether the pipeline syncs this stage's gradients once per step through its hooks
        #: (data parallel): then no piece but the last may run them
        self.syncs_once = False
        self.params: list[torch.Tensor] = []
        self.side_keywords = side_inputs.keywords(module)
        self.graph_checked = False
        #: the stage's activation offload (``host_offload``), where the program offloads it
        self.offload: StageOffload | None = None
        self.captured = captured
        #: where its layers' extra loss terms go (``runtime.extra_losses``; a pipeline's stages
        #: share one), what each micro-batch's weigh, and their detached sums this step, by name
        self.sink = extra_losses.Sink()
        self.extra_weight = 1.0
        self.extra_report: dict[str, torch.Tensor] = {}
        self.begin_step()

    def begin_step(self) -> None:
        """Note the trainable parameters once per step: ``requires_grad`` may change between
        steps, not within one, and walking the module tree for every backward piece showed up in
        host profiles of a small stage's actions (measured: docs/performance.md)."""
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.sink.install(self.module)
        #: some hook needs the step's whole gradient at once (data parallel's reduction, a
        #: user's post-accumulate-grad hook, tied weights' sum): the last piece runs them
        self.hooked = bool(
            self.quiet_params
            or self.syncs_once
            or any(post_accumulate_grad_hooks(p) for p in self.params)
        )
        #: where the split gains by it, every piece accumulates through ``AccumulateGrad`` when
        #: no hook needs the whole gradient (the summation order is the same)
        self.unhooked = getattr(self.split, "plain_accumulation", False) and not self.hooked

    def forward(
        self,
        mb: int,
        args: tuple[torch.Tensor, ...],
        target: object,
        weight: float | torch.Tensor,
        side: dict | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Run the module; keep what backward needs. Returns the outputs (empty on the last stage)."""
        if self.recomputes_whole and torch.is_grad_enabled():
            return self._forward_held(mb, args, target, weight, side)
        with self.offload.capture(mb) if self.offload is not None else contextlib.nullcontext():
            outputs, terms = self._collecting_call(args, side)
        need = [a for a in args if a.requires_grad]
        if not self.is_last:
            self.saved[mb] = self._saved_outputs(need, outputs, terms, _device(outputs))
            return outputs
        loss = self._loss(mb, outputs, target)
        self.losses[mb] = loss.detach().reshape(())
        self.saved[mb] = self._saved_loss(need, loss, weight, terms)
        return ()

    def _collecting_call(
        self, args: tuple[torch.Tensor, ...], side: dict | None
    ) -> tuple[tuple[torch.Tensor, ...], list[extra_losses.Term]]:
        """The module on ``args``, and the extra loss terms its layers recorded meanwhile (added
        to the step's report)."""
        with self.sink.collecting() as terms:
            outputs = self.call(args, side)
        if self.captured:
            extra_losses.refuse_captured(terms, self.index)
        extra_losses.add_to_report(self.extra_report, terms)
        return outputs, terms

    def _saved_outputs(
        self,
        need: list[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        terms: list[extra_losses.Term],
        device: torch.device,
    ) -> _Saved:
        """What the backward of a stage that is not the last needs: as its roots, its
        ``outputs`` that need a gradient and its weighted extra loss terms."""
        roots = [o for o in outputs if o.requires_grad]
        extra = extra_losses.weighted_root(terms, self.extra_weight)
        edges = [get_gradient_edge(o) for o in (roots if extra is None else [*roots, extra])]
        self._check_graph_once(edges)
        meta = None if extra is None else TensorMeta.of(extra)
        return _Saved(need, edges, _metas(roots), device, meta)

    def _loss(self, mb: int, outputs: tuple[torch.Tensor, ...], target: object) -> torch.Tensor:
        output = outputs[0] if len(outputs) == 1 else outputs
        if self.loss_fn is None:
            raise ValueError(f"stage {self.index} is the last stage and needs a loss_fn")
        try:
            loss = self.loss_fn(output, target)
        except Exception as e:
            raise ValueError(
                f"loss_fn failed on stage {self.index} micro-batch {mb}: the last stage's output "
                f"is {_describe(output)}, the target {_describe(target)}: {type(e).__name__}: {e}"
            ) from e
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn must return a scalar tensor, got {shape} on stage {self.index} "
                f"micro-batch {mb}; reduce it (e.g. reduction='mean')"
            )
        return loss

    def _saved_loss(
        self,
        need: list[torch.Tensor],
        loss: torch.Tensor,
        weight: float | torch.Tensor,
        terms: list[extra_losses.Term],
    ) -> _Saved:
        """The last stage's one root: the weighted loss plus the weighted extra loss terms."""
        scaled = (loss * weight).reshape(())
        extra = extra_losses.weighted_root(terms, self.extra_weight)
        if extra is not None:
            scaled = scaled + extra
        roots = [scaled] if scaled.requires_grad else []
        edges = [get_gradient_edge(r) for r in roots]
        self._check_graph_once(edges)
        return _Saved(need, edges, _metas(roots), scaled.device)

    def _forward_held(
        self,
        mb: int,
        args: tuple[torch.Tensor, ...],
        target: object,
        weight: float | torch.Tensor,
        side: dict | None,
    ) -> tuple[torch.Tensor, ...]:
        """``F`` of a stage that recomputes as a whole: no graph, only what the recompute needs
        (``whole_stage_recompute``)."""
        if self.offload is not None:
            raise PipelineRefused(
                f"stage {self.index} recomputes as a whole and keeps no activations to offload; "
                "offload it or recompute it, not both"
            )
        random = whole.RandomState.capture(args)
        with torch.no_grad():  # its extra loss terms are reported; the recompute's backpropagated
            outputs, _ = self._collecting_call(args, side)
        if self.is_last:
            self.losses[mb] = self._loss(mb, outputs, target).detach().reshape(())
            needs: tuple[bool, ...] = ()
        else:
            needs = whole.outputs_needing_grad(outputs, args, bool(self.params))
            outputs = whole.as_sent(outputs, needs)
        metas = _metas([o for o, n in zip(outputs, needs) if n])
        self.saved[mb] = whole.Held(args, side, target, weight, random, needs, metas)
        return () if self.is_last else outputs

    def _take_saved(
        self, mb: int, grads: list[torch.Tensor] | None
    ) -> tuple[_Saved, list[torch.Tensor] | None]:
        """A micro-batch's saved state for its backward (for a stage that recomputes as a whole,
        its forward run again now, with autograd) and the output gradients that go with it."""
        saved = self.saved.pop(mb)
        if not isinstance(saved, whole.Held):
            return saved, grads
        need = [a for a in saved.args if a.requires_grad]
        with saved.random.restored(), self.sink.collecting() as terms:
            outputs = self.call(saved.args, saved.side)
            if self.is_last:
                loss = self._loss(mb, outputs, saved.target)
        if self.is_last:
            return self._saved_loss(need, loss, saved.weight, terms), grads
        sent = [o for o, n in zip(outputs, saved.needs_grad) if n]
        assert grads is not None and len(grads) == len(sent), "gradient count mismatch"
        # an output that turned out independent of every input and parameter: nothing to add
        kept = [(o, g) for o, g in zip(sent, grads) if o.requires_grad]
        found = self._saved_outputs(need, [o for o, _ in kept], terms, _device(outputs))
        return found, [g for _, g in kept]

    def _check_graph_once(self, edges: list[GradientEdge]) -> None:
        """On the stage's first forward: refuse what its graph holds that pipetrain cannot run
        exactly (``activation_checkpoint.refuse_reentrant``)."""
        if not self.graph_checked:
            activation_checkpoint.refuse_reentrant((e.node for e in edges), self.index)
            self.graph_checked = True

    def call(self, args: tuple[torch.Tensor, ...], side: dict | None = None):
        """The module on ``args`` and the side inputs it takes (``runtime.side_inputs``)."""
        module: Callable = self.module
        if side:
            module = functools.partial(module, **side_inputs.select(side, self.side_keywords))
        out = self.split.call(module, args)  # type: ignore[arg-type]  # the module, bound to side
        outputs = out if isinstance(out, tuple) else (out,)
        for i, o in enumerate(outputs):
            if not isinstance(o, torch.Tensor):
                raise TypeError(
                    f"stage {self.index} returned {type(o).__name__} at output {i}; stages must "
                    "return a tensor or a tuple of tensors (pass masks, position ids and other "
                    "constants as side inputs: pipe.step(..., side={name: value}))"
                )
        # An output that is an input leaf would alias the next stage's graph into this one.
        ids = {id(a) for a in args}
        return tuple(o.view_as(o) if id(o) in ids else o for o in outputs)

    def grad_metas(self, mb: int) -> list[TensorMeta]:
        """Shapes of the output gradients micro-batch ``mb`` expects (for receive buffers)."""
        return self.saved[mb].root_metas

    def backward(self, mb: int, grads: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """``B``: input gradients (zeros where unused) and weight gradients accumulated."""
        if self.offload is not None:
            self.offload.ready(mb)
        saved, grads = self._take_saved(mb, grads)
        root_grads = self._root_grads(saved, grads)
        hooks, fire = self._hook_plan(mb)
        found = self.split.backward_full(saved.roots, root_grads, saved.inputs, self.params, hooks)
        fire_hooks(fire)
        return _fill(found, saved.inputs)

    def _is_last_weight_piece(self, mb: int) -> bool:
        """The step's last weight piece (or no schedule says which) where a hook needs the
        step's whole gradient: it accumulates through ``AccumulateGrad``, so hooks fire once and
        see it. Where none does, no piece is special: the last runs as every other (deferral's
        fused accumulation included), which is also what the profiler times."""
        last = self.last_weight_microbatch
        return self.hooked and (last is None or mb == last)

    def _hook_plan(self, mb: int) -> tuple[bool, list[torch.Tensor]]:
        """(accumulate through ``AccumulateGrad``, parameters whose hooks to fire afterwards):
        with quiet parameters the step's last piece accumulates quietly, then fires the others'
        hooks once (``fire_hooks``). An ``unhooked`` stage's other pieces go through
        ``AccumulateGrad`` too."""
        if not self._is_last_weight_piece(mb):
            return self.unhooked, []
        if not self.quiet_params:
            return True, []
        return False, [p for p in self.params if id(p) not in self.quiet_params]

    def backward_input(self, mb: int, grads: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """``I``: input gradients only; what ``W`` needs is kept until ``backward_weight``.
        Weight gradients ``I`` takes itself (a split that cannot leave them to ``W``: a stage
        that recomputes, an opaque node) go through ``AccumulateGrad`` as they come where the
        stage is ``unhooked``, as ``B``'s do."""
        if self.offload is not None:
            self.offload.ready(mb)
        saved, grads = self._take_saved(mb, grads)
        root_grads = self._root_grads(saved, grads)
        # held from I to W only for a hook that needs the step's whole gradient (the last
        # piece's): otherwise the piece accumulates now, and W holds nothing of I's
        hold = self._is_last_weight_piece(mb) and not self.quiet_params
        found, work = self.split.backward_input(
            saved.roots, root_grads, saved.inputs, self.params, hold, self.unhooked
        )
        self.weight_work[mb] = work
        return _fill(found, saved.inputs)

    def backward_weight(self, mb: int) -> None:
        work = self.weight_work.pop(mb)
        hooks, fire = self._hook_plan(mb)
        self.split.backward_weight(work, hooks)
        fire_hooks(fire)

    def _root_grads(self, saved: _Saved, grads: list[torch.Tensor] | None) -> list[torch.Tensor]:
        if self.is_last:
            return [
                torch.ones(m.shape, dtype=m.dtype, device=saved.device) for m in saved.root_metas
            ]
        assert grads is not None and len(grads) == len(saved.root_metas), "gradient count mismatch"
        if saved.extra is None:
            return grads
        return [*grads, torch.ones((), dtype=saved.extra.dtype, device=saved.device)]

    def use_sink(self, sink: extra_losses.Sink) -> None:
        """Send the layers' extra loss terms to ``sink`` (one a pipeline's stages share)."""
        self.sink.uninstall(self.module)
        self.sink = sink
        sink.install(self.module)

    def take_extra_report(self) -> dict[str, torch.Tensor]:
        """This step's extra loss terms by name, summed over micro-batches (detached, float64)."""
        report, self.extra_report = self.extra_report, {}
        return report

    def release(self) -> None:
        """Drop every micro-batch's held state (a step that failed part-way, or ``close``); the
        layers' extra loss terms go back to their plain-forward keeping."""
        self.saved.clear()
        self.weight_work.clear()
        if self.offload is not None:
            self.offload.release()
        self.losses.clear()
        self.extra_report.clear()
        self.sink.uninstall(self.module)

    def leftovers(self) -> int:
        return len(self.saved) + len(self.weight_work)


def _device(tensors: tuple[torch.Tensor, ...]) -> torch.device:
    return tensors[0].device if tensors else torch.device("cpu")


def _metas(tensors: list[torch.Tensor]) -> list[TensorMeta]:
    return [TensorMeta.of(t) for t in tensors]


def _fill(found: list[torch.Tensor | None], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(x) if g is None else g for g, x in zip(found, inputs)]


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return type(value).__name__
