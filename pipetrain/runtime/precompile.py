"""Compile every rank's compiled stages at once, before the first step of new shapes.

A ``torch.compile``d block compiles when it first runs, its backward when its first backward
runs. In a pipeline stage ``k`` first runs when stage ``k - 1``'s output arrives, so without help
the ranks compile one after another: forwards down the pipeline, backwards back up it, and the
first step costs about one compile per rank in a row where the unsplit model pays one.

``Precompile`` (``Pipeline(precompile=True)``) takes the compiles off that chain. At the first
training step of a new input shape each rank first learns its stages' input shapes from a probe
in stage order — each stage run once on micro-batch 0's shapes with every compiled region run
eagerly (``torch.compiler.set_stance("force_eager")``), the output shapes handed to the next
stage's rank through the store — then, all ranks at once, runs each compiled stage's forward and
backward once on stand-in inputs of those shapes (zeros; stage 0 gets micro-batch 0 itself).
The step's own actions then find their graphs compiled: same shapes, dtypes, ``requires_grad``
and grad mode, so no guard fails.

The stand-in passes leave no trace: gradients are taken with ``torch.autograd.grad`` into the
stand-in inputs and the parameters' gradient edges (captured there, so ``AccumulateGrad`` and the
hooks after it never run and no ``.grad`` changes), buffers are restored, the random number
generators forked. What would still leave one is refused when the pipeline is built: data
parallel and tensor parallel (their passes communicate and reduce gradients), deferred weight
gradients on a compiled stage (a deferred linear's backward writes ``.grad`` itself; an eager
stage has no pass, only the probe's forward), and parameters of a compiled stage with tensor
hooks (``register_hook``: they run on any gradient computed for the parameter).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence

import torch

from pipetrain.runtime.backward.deferred_wgrad import has_compiled_parts
from pipetrain.runtime.backward.graph_replay import GraphReplay
from pipetrain.runtime.comm.agreement import Agreement
from pipetrain.runtime.comm.p2p import DTYPE_CODE, DTYPES, TensorMeta
from pipetrain.runtime.stage import StageRunner, leaves
from pipetrain.runtime.torch_compat import get_gradient_edge, has_tensor_hooks
from pipetrain.schedule.placement import Placement

_log = logging.getLogger(__name__)


class Precompile:
    """The probe and the stand-in passes of one pipeline (see the module docstring)."""

    def __init__(self, agreement: Agreement, runners: Mapping[int, StageRunner]) -> None:
        self.agreement = agreement
        self.runners = runners
        self.rounds = 0
        self.seen: set[tuple] = set()

    @classmethod
    def build(
        cls,
        wanted: bool | None,
        agreement: Agreement,
        runners: Mapping[int, StageRunner],
        wide: bool,
    ) -> Precompile | None:
        """``Pipeline(precompile=wanted)``'s, or ``None``. ``True`` refuses what a stand-in pass
        could not run without a trace (module docstring); ``None`` turns it on where every
        rank's stages allow it and some rank holds compiled ones (the ranks agree through the
        store: all of them run the probe, or none). ``wide``: a mesh or data parallel."""
        if wanted is False:
            return None
        why = _obstacle(runners, wide)
        if wanted is None:
            compiled = any(has_compiled_parts(r.module) for r in runners.values())
            everyone = agreement.gather("precompile", {"obstacle": why, "compiled": compiled})
            why = next((r["obstacle"] for r in everyone if r["obstacle"]), "")
            if why or not any(r["compiled"] for r in everyone):
                _log.info("precompile off: %s", why or "no stage is compiled")
                return None
        elif why:
            raise ValueError(f"precompile=True cannot be used here: {why}")
        return cls(agreement, runners)

    def before_step(
        self, placement: Placement, inputs: Sequence[torch.Tensor], side: dict | None
    ) -> None:
        """At a training step: the probe and the passes if these shapes are new (every rank
        sees the same shapes: ``Agreement.step`` ran first)."""
        key = tuple((tuple(t.shape), t.dtype) for t in inputs) + _side_key(side)
        if key in self.seen:
            return
        self.seen.add(key)
        self.rounds += 1
        shapes = self._probe(placement, tuple(inputs), side)
        for s, runner in self.runners.items():
            if has_compiled_parts(runner.module):
                self._pass(runner, self._stand_ins(s, tuple(inputs), shapes.get(s, ())), side)

    @staticmethod
    def _stand_ins(s: int, inputs: tuple[torch.Tensor, ...], metas) -> tuple:
        """Stage ``s``'s inputs for a pass: micro-batch 0 itself on stage 0, else zeros shaped
        as the probe found, leaves that need a gradient where a received input would."""
        if s == 0:
            return inputs
        device = inputs[0].device if inputs else torch.device("cpu")
        made = tuple(torch.zeros(m.shape, dtype=m.dtype, device=device) for m in metas)
        return leaves(tuple(t.requires_grad_(m.requires_grad) for t, m in zip(made, metas)))

    def _probe(
        self, placement: Placement, inputs: tuple[torch.Tensor, ...], side: dict | None
    ) -> dict[int, tuple]:
        """Each local stage's input metas, in stage order, every compiled region run eagerly."""
        found: dict[int, tuple] = {}
        last = placement.num_stages - 1
        for s in sorted(self.runners):
            if s > 0 and s not in found:
                what = f"precompile: the input shapes of stage {s}"
                sender = placement.rank(s - 1)
                record = self.agreement.receive(self._name(s), what, sender)
                found[s] = tuple(_meta(m) for m in record)  # type: ignore[attr-defined]
            metas = found.get(s, ())
            if s == last:
                continue
            args = self._stand_ins(s, inputs, metas)
            with _quiet(self.runners[s], args), torch.compiler.set_stance("force_eager"):
                outputs = self.runners[s].call(args, side)
            out_metas = tuple(TensorMeta.of(o) for o in outputs)
            if s + 1 in self.runners:
                found[s + 1] = out_metas
            else:
                self.agreement.hand_on(self._name(s + 1), [_record(m) for m in out_metas])
        return found

    @staticmethod
    def _pass(runner: StageRunner, args: tuple, side: dict | None) -> None:
        """One forward and backward of ``runner``'s stage on stand-ins: compiles both."""
        with _quiet(runner, args):
            outputs = runner.call(args, side)
            roots = [o for o in outputs if o.requires_grad]
            params = [p for p in runner.module.parameters() if p.requires_grad]
            wanted = [a for a in args if a.requires_grad] + [get_gradient_edge(p) for p in params]
            if roots and wanted:
                grads = [torch.ones_like(r) for r in roots]
                torch.autograd.grad(roots, wanted, grads, allow_unused=True)

    def _name(self, stage: int) -> str:
        return f"precompile/{self.rounds}/{stage}"


def _obstacle(runners: Mapping[int, StageRunner], wide: bool) -> str:
    """Why a stand-in pass here would leave a trace, or ``""``."""
    if wide:
        return "its stand-in passes would communicate and reduce gradients"
    for s, runner in runners.items():
        if not has_compiled_parts(runner.module):
            continue
        if not isinstance(runner.split, GraphReplay):
            return (
                f"stage {s} defers its weight gradients (its backward writes .grad itself); "
                "pass defer_weight_grads=False"
            )
        if any(has_tensor_hooks(p) for p in runner.module.parameters()):
            return f"stage {s} has a parameter with a tensor hook (register_hook), which would run"
    return ""


def _side_key(side: dict | None) -> tuple:
    if not side:
        return ()
    return tuple(
        (k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, repr(v))
        for k, v in sorted(side.items())
    )


def _record(m: TensorMeta) -> list:
    return [list(m.shape), DTYPE_CODE[m.dtype], m.requires_grad]


def _meta(record) -> TensorMeta:
    shape, code, requires_grad = record
    return TensorMeta(tuple(shape), DTYPES[code], bool(requires_grad))


@contextlib.contextmanager
def _quiet(runner: StageRunner, args: tuple):
    """Restore the stage's buffers and the random number generators afterwards."""
    buffers = [(b, b.detach().clone()) for b in runner.module.buffers()]
    devices = sorted({a.device for a in args if a.device.type == "cuda"}, key=str)
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
