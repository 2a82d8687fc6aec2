"""The device clock's replay gap, measured on the model's own layers run the way a stage runs
them.

``profile_clock.DeviceClock`` prices a replayed CUDA graph as the device's busy time plus a gap
per kernel. The gap depends on the work: on the kernels' sizes and on how much is in flight, so
a chain of small dependent kernels is a stand-in. Before the profiler times anything, a middle
window of ``context`` layers runs as a stage runs it — ``in_flight`` forwards through a
``StageRunner``, then as many backwards from fixed random output gradients — once launched
kernel by kernel under the profiler and once captured and replayed; the clock takes the
difference per kernel (``DeviceClock.calibrate``). The window leaves out the first layer, which
may take token ids, and the last, which may end in a loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from pipetrain.runtime.named_layers import Stage
from pipetrain.runtime.profile.profile_clock import Clock, DeviceClock
from pipetrain.runtime.stage import StageRunner, leaves


def calibrate(
    clock: Clock,
    layers: Sequence[nn.Module],
    inputs: tuple[torch.Tensor, ...],
    context: int,
    in_flight: int,
) -> None:
    """Measure ``clock``'s replay gap on a middle window of ``layers`` (see the module
    docstring) and its slowdown under sustained load — for a wall clock (an eager profile's
    device times) the slowdown alone; the layers keep the gradients they had. A model too short
    for a window keeps the chain's gap and no slowdown."""
    params = [p for layer in layers for p in layer.parameters()]
    grads = [p.grad for p in params]
    window = window_work(layers, inputs, context, in_flight)
    if window is not None:
        (clock.calibrate if isinstance(clock, DeviceClock) else clock.measure_sustained)(*window)
    for p, grad in zip(params, grads):
        p.grad = grad


def window_work(
    layers: Sequence[nn.Module],
    inputs: tuple[torch.Tensor, ...],
    context: int,
    in_flight: int,
) -> tuple[Callable[[], None], str] | None:
    """Layers ``first..end-1`` (a middle window of ``context``) as capturable work, and what it
    is; ``None`` for a model too short to have one. ``inputs``: the model's input, carried to
    the window without gradients."""
    first = max(1, (len(layers) - context) // 2)
    end = min(len(layers) - 1, first + context)
    if first >= end:
        return None
    with torch.no_grad():
        for layer in layers[:first]:
            out = layer(*inputs)
            inputs = out if isinstance(out, tuple) else (out,)
    args = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
    chain = Stage([(f"layer{i}", layers[i]) for i in range(first, end)])
    runner = StageRunner(first, chain, False, None)
    runner.begin_step()
    device = args[0].device
    runner.forward(0, leaves(args), None, 1.0)
    grads = [torch.randn(m.shape, dtype=m.dtype, device=device) for m in runner.grad_metas(0)]
    runner.backward(0, grads)

    def work() -> None:
        runner.begin_step()
        for mb in range(in_flight):
            runner.forward(mb, leaves(args), None, 1.0)
        for mb in range(in_flight):
            runner.backward(mb, grads)

    what = f"layers {first}..{end - 1}, {in_flight} micro-batches forward then backward"
    return work, what
