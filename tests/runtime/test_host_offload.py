"""One stage's offload in one process: saved tensors leave for separate storage at OFFLOAD and
come back at RELOAD, the backward is exact, a backward before its reload is refused, and
non-reentrant activation checkpointing composes (what a checkpointed region saves is its own)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipetrain.runtime.host_offload import StageOffload


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Sigmoid()).double()


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
        micro = offload.micro[0]
        assert micro.moved and all(entry.device is None for entry in micro.moved)  # really left
        offload.reload(0)
        offload.ready(0)
    loss.backward()
    return [x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("fraction", [0.3, 1.0])
def test_offloaded_saved_tensors_give_the_same_gradients(fraction, checkpointed) -> None:
    model = _model()
    x = torch.randn(16, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = _grads(model, x, None, checkpointed)
    offload = StageOffload(0, fraction, frozenset({0}), torch.device("cpu"))
    got = _grads(model, x, offload, checkpointed)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert fraction * offload.saved_bytes <= offload.moved_bytes <= offload.saved_bytes
    assert not offload.micro  # nothing of the micro-batch is left behind


def test_a_backward_before_its_reload_is_refused() -> None:
    model = _model()
    offload = StageOffload(0, 1.0, frozenset({0}), torch.device("cpu"))
    x = torch.randn(16, 64, dtype=torch.float64).requires_grad_()
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
