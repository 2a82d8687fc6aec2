"""One stage's offload in one process: saved tensors leave for separate storage and come back,
the backward is exact, a backward before its reload is refused, non-reentrant activation
checkpointing composes (what a checkpointed region saves is its own), parameters (and views of
them) and the stage's inputs are never copied, and a stage of layers moves layer by layer — each
offloaded layer's tensors gone as soon as its forward ends, its first ⌈f·L⌉ layers moved, the
backward reloading one layer ahead of the one it reads (Megatron-Core's and torchtitan's
per-module offload)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipetrain.runtime.host_offload import StageOffload, stage_layers
from pipetrain.runtime.named_layers import Stage

ROWS, WIDTH = 16, 64
#: one float64 activation of a micro-batch, in bytes
UNIT = ROWS * WIDTH * 8


class Block(nn.Module):
    """Saves three activations of ``UNIT`` bytes: its input, ``tanh``'s output, ``b``'s output
    (and ``a``'s and ``b``'s transposed weights, which offload must leave alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        return torch.sin(self.b(torch.tanh(self.a(h)))) + h


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Sigmoid()).double()


def _offload(module: nn.Module, fraction: float, layers=()) -> StageOffload:
    return StageOffload(0, fraction, frozenset({0}), torch.device("cpu"), min_bytes=0,
                        layers=layers, params=list(module.parameters()))  # fmt: skip


def _input() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, WIDTH, dtype=torch.float64, generator=g)


def _grads(model, x, offload: StageOffload | None, checkpointed: bool):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()

    def run():
        y = checkpoint(model, x, use_reentrant=False) if checkpointed else model(x)
        return (y * y).sum()

    if offload is None:
        loss = run()
    else:
        with offload.capture(0):
            loss = run()
        offload.offload(0)
        moved = [e for g in offload.micro[0].groups if g.offloaded for e in g.entries]
        assert moved and all(e.device is None and e.blob.host is not None for e in moved)
        offload.reload(0)
        offload.ready(0)
    loss.backward()
    return [x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("fraction", [0.3, 1.0])
def test_offloaded_saved_tensors_give_the_same_gradients(fraction, checkpointed) -> None:
    """A module without layers moves in one piece: the first saved tensors, at least the
    fraction of the saved bytes."""
    model = _model()
    expected = _grads(model, _input(), None, checkpointed)
    offload = _offload(model, fraction)  # no layers given: one piece
    assert not offload.per_layer
    got = _grads(model, _input(), offload, checkpointed)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert fraction * offload.saved_bytes <= offload.moved_bytes <= offload.saved_bytes
    assert not offload.micro  # nothing of the micro-batch is left behind


def test_parameters_their_views_and_the_stage_input_are_never_copied() -> None:
    """``Linear`` on a matrix saves its weight transposed (a view of the parameter): moving it
    would free nothing and cost a weight's copy per micro-batch."""
    layer = nn.Linear(WIDTH, WIDTH).double()
    offload = _offload(layer, 1.0)
    x = _input().requires_grad_()
    with offload.capture(0):
        (torch.tanh(layer(x)) ** 2).sum()
    offload.offload(0)
    # saved: x (the input leaf: kept), the weight's transpose (kept), tanh's output (moved)
    assert offload.saved_bytes == offload.moved_bytes == UNIT


def test_views_of_one_storage_move_as_one_copy_and_small_views_alone() -> None:
    """SwiGLU saves both halves of one product (``silu(gate) * up``): one copy of the product's
    storage, both views rebuilt over it on the way back; a small slice of a large tensor moves
    its own elements only."""
    w = nn.Linear(WIDTH, 2 * WIDTH).double()
    big = nn.Linear(WIDTH, 8 * WIDTH).double()

    def run(x):
        gate, up = w(x).chunk(2, dim=-1)  # non-contiguous views of one storage
        corner = big(x)[:, :8]  # a small view: 1/64 of its storage
        return (torch.nn.functional.silu(gate) * up).sum() + torch.sin(corner).sum()

    x = _input().requires_grad_()
    expected = torch.autograd.grad(run(x), [x, *w.parameters(), *big.parameters()])
    offload = _offload(w, 1.0)
    offload.params = (*w.parameters(), *big.parameters())
    with offload.capture(0):
        loss = run(x)
    offload.offload(0)
    # saved: gate and up (views of the 2-UNIT product: one copy), silu(gate) (1 UNIT), the corner
    # (ROWS x 8 float64: its own bytes, not its 8-UNIT storage)
    assert offload.moved_bytes == 3 * UNIT + ROWS * 8 * 8
    offload.reload(0)
    offload.ready(0)
    got = torch.autograd.grad(loss, [x, *w.parameters(), *big.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize(("fraction", "moved"), [(0.25, 1), (0.5, 2), (0.6, 3), (1.0, 4)])
def test_layers_leave_as_their_forward_ends(fraction, moved, checkpointed) -> None:
    torch.manual_seed(0)
    model = Stage([(f"layers.{i}", Block().double()) for i in range(4)])
    if checkpointed:  # the checkpoints' inputs are what autograd saves outside them: they move
        from pipetrain.runtime.backward.activation_checkpoint import recompute_stage

        recompute_stage(model, "full", 0)
    expected = _grads(model, _input(), None, False)
    layers = stage_layers(model)
    assert len(layers) == 4
    offload = _offload(model, fraction, layers)
    seen: list[list[str]] = []  # the groups' places when each layer's forward ends

    def look(*_) -> None:  # registered first: runs before offload's own hook on the same layer
        seen.append([_where(g) for g in offload.micro[0].groups])

    probes = [layer.register_forward_hook(look) for layer in layers]
    model.zero_grad(set_to_none=True)
    x = _input().requires_grad_()
    with offload.capture(0):
        out = model(x)
    for probe in probes:
        probe.remove()
    for k, places in enumerate(seen):  # the layers before k are gone if they are offloaded ones
        gone = min(k, moved)
        assert places == ["host"] * gone + ["device"] * (k + 1 - gone), (k, places)
    per_layer = [2 * UNIT, 3 * UNIT, 3 * UNIT, 3 * UNIT]  # layer 0's input: the stage holds it
    if checkpointed:
        per_layer = [0, UNIT, UNIT, UNIT]  # only each checkpoint's input is saved outside it
    assert offload.moved_bytes == sum(per_layer[:moved])
    groups = offload.micro[0].groups
    offload.offload(0)
    offload.reload(0)  # brings back the last offloaded layer only
    assert [_where(g) for g in groups[:moved]] == ["host"] * (moved - 1) + ["back"]
    offload.ready(0)
    (out * out).sum().backward()
    got = [x.grad, *(p.grad for p in model.parameters())]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert all(g.read is not None for g in groups[:moved]) and not offload.micro


def _where(group) -> str:
    if not group.offloaded:
        return "device"
    return "host" if group.read is None else "back"


def test_reloads_follow_the_backward_one_layer_ahead() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block().double() for _ in range(6)])
    offload = _offload(model, 1.0, stage_layers(model))
    x = _input().requires_grad_()
    seen: list[tuple[int, list[str]]] = []
    with offload.capture(0):
        h, outputs = x, []
        for layer in model:
            h = layer(h)
            outputs.append(h)
    groups = offload.micro[0].groups
    for k, y in enumerate(outputs):
        y.register_hook(lambda g, k=k: seen.append((k, [_where(gr) for gr in groups[:6]])))
    offload.offload(0)
    offload.reload(0)
    offload.ready(0)
    (h * h).sum().backward()
    # layer k's output gradient is ready when layer k+1's backward has run: its first read
    # reloaded layer k, nothing below it yet
    for k, state in seen:
        assert state[k + 1 :] == ["back"] * (5 - k), (k, state)
        if k >= 1:
            assert state[:k] == ["host"] * k, (k, state)
    assert [k for k, _ in seen] == [5, 4, 3, 2, 1, 0]


def test_a_backward_before_its_reload_is_refused() -> None:
    model = _model()
    offload = _offload(model, 1.0)
    x = _input().requires_grad_()
    with offload.capture(0):
        loss = model(x).sum()
    offload.offload(0)
    with pytest.raises(RuntimeError, match="its backward runs before its RELOAD"):
        offload.ready(0)
    with pytest.raises(RuntimeError, match="read while offloaded"):
        loss.backward()


def test_micro_batches_not_offloaded_run_unhooked() -> None:
    offload = StageOffload(0, 1.0, frozenset({1}), torch.device("cpu"))
    with offload.capture(0):
        pass
    assert not offload.micro
    with torch.no_grad(), offload.capture(1):  # eval: nothing saved, nothing kept
        pass
    assert not offload.micro
