"""Where no hook needs a step's whole gradient, graph replay's backward pieces accumulate through
``AccumulateGrad`` as unsplit training does (no captured copy of every weight gradient); where a
post-accumulate-grad hook is registered, it still fires once per step on the whole gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.runtime.backward import graph_replay
from pipetrain.runtime.stage import StageRunner

MICROBATCHES = 4


class _OpaqueLinear(nn.Linear):
    """A linear layer through a custom autograd function: its weight gradient comes out of an
    opaque node, as a compiled region's or a float8 linear's does."""

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w, g.t() @ x

    def forward(self, x):
        return self._Fn.apply(x, self.weight) + self.bias


def _net(opaque: bool = False) -> nn.Module:
    torch.manual_seed(0)
    last = (_OpaqueLinear if opaque else nn.Linear)(16, 8)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), last).double()


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, dtype=torch.float64, generator=g) for _ in range(MICROBATCHES)]


def _step_pieces(runner: StageRunner, ref: nn.Module, backward) -> None:
    """One step's forwards on ``runner`` (its last weight piece the last micro-batch's), each
    followed by ``backward(mb, output gradient)``, and the same micro-batches through ``ref``."""
    runner.last_weight_microbatch = MICROBATCHES - 1
    runner.begin_step()
    for mb, x in enumerate(_inputs()):
        (out,) = runner.forward(mb, (x.requires_grad_(),), None, 1.0)
        backward(mb, [torch.ones_like(out)])
        ref(x.detach()).backward(torch.ones_like(out))


@pytest.mark.parametrize("piece", ["B", "whole I", "opaque I"])
@pytest.mark.parametrize("hooked", [False, True])
def test_pieces_accumulate_through_autograd_unless_a_hook_needs_the_whole_gradient(
    monkeypatch, hooked, piece
):
    """``B``, and an ``I`` that takes the weight gradients itself (a recomputing stage's, one
    whose graph has an opaque node): without a hook the weight gradients go through
    ``AccumulateGrad`` as the engine produces them, never all held at once for a quiet add
    after the engine ends (measured on GPUs: that held a parameter-sized copy at the backward's
    peak under zero-bubble schedules); with one, every piece but the last accumulates quietly
    and the hook fires once."""
    quiet: list[int] = []
    real = graph_replay.accumulate_quietly
    monkeypatch.setattr(
        graph_replay, "accumulate_quietly", lambda *a: (quiet.append(1), real(*a))[1]
    )
    net, ref = _net(opaque=piece == "opaque I"), _net()
    seen: list[torch.Tensor] = []
    if hooked:
        net[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    if piece == "B":
        runner = StageRunner(0, net, False, None, defer_weight_grads=False)
        _step_pieces(runner, ref, runner.backward)
        assert runner.unhooked is not hooked
    else:
        split = graph_replay.GraphReplay(whole=piece == "whole I")
        runner = StageRunner(0, net, False, None, split=split)
        _step_pieces(runner, ref, runner.backward_input)
        for mb in range(MICROBATCHES):
            runner.backward_weight(mb)  # nothing left to do
        assert runner.leftovers() == 0
    assert len(quiet) == (MICROBATCHES - 1 if hooked else 0)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-14, atol=0)
    assert len(seen) == (1 if hooked else 0)
    if hooked:
        assert torch.allclose(seen[0], ref[0].weight.grad, rtol=1e-14, atol=0)


@pytest.mark.parametrize("split", ["deferred", "whole"])
@pytest.mark.parametrize("hooked", [False, True])
def test_the_last_piece_holds_its_gradients_for_w_only_when_a_hook_needs_them(split, hooked):
    """A split backward's last weight piece passes ``I``'s weight gradients through
    ``AccumulateGrad`` in ``W`` only where a hook needs the step's whole gradient; otherwise its
    ``I`` accumulates them at once, so nothing parameter-sized waits for a late ``W`` (in a
    zero-bubble schedule the last ``W`` comes at the step's end). The gradients ``I`` takes:
    those not deferred (the LayerNorm's), or every one where the backward runs whole in ``I``
    (a recomputing stage). Gradients are the same either way."""
    net, ref = _net(), _net()
    net.insert(0, nn.LayerNorm(8).double())  # finished in I under either split
    ref.insert(0, nn.LayerNorm(8).double())
    seen: list[torch.Tensor] = []
    if hooked:
        net[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    if split == "deferred":
        runner = StageRunner(0, net, False, None, defer_weight_grads=True)
    else:
        runner = StageRunner(0, net, False, None, split=graph_replay.GraphReplay(whole=True))
    _step_pieces(runner, ref, runner.backward_input)
    held = runner.weight_work[MICROBATCHES - 1].held
    assert (len(held) > 0) is hooked
    for mb in range(MICROBATCHES):
        runner.backward_weight(mb)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=0)
    assert len(seen) == (1 if hooked else 0)
    if hooked:
        assert torch.allclose(seen[0], ref[0].weight.grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize("hooked", [False, True])
def test_a_whole_i_walks_its_graph_only_where_a_hook_needs_the_last_piece_held(monkeypatch, hooked):
    """A recomputing stage's ``I`` runs the whole backward: with nothing to split, it walks its
    autograd graph (Python, per node: host time an eager step waits for) only for the last piece
    that a hook needs held; without a hook never."""
    walks: list[int] = []
    real = graph_replay.walk
    monkeypatch.setattr(graph_replay, "walk", lambda *a: (walks.append(1), real(*a))[1])
    net, ref = _net(), _net()
    if hooked:
        net[0].weight.register_post_accumulate_grad_hook(lambda p: None)
    runner = StageRunner(0, net, False, None, split=graph_replay.GraphReplay(whole=True))
    _step_pieces(runner, ref, runner.backward_input)
    for mb in range(MICROBATCHES):
        runner.backward_weight(mb)
    assert len(walks) == (MICROBATCHES if hooked else 0)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-14, atol=0)
