"""torch.compile'd blocks and torchao float8 linears under every schedule and both ways of
splitting the backward, exact in float64 against the unsplit model (tests/support/compile_cases)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from pipetrain.runtime.backward.deferred_wgrad import DeferredLinears
from pipetrain.runtime.backward.graph_replay import GraphReplay
from pipetrain.schedule.registry import FAMILIES
from tests.support.compile_cases import run_cases
from tests.support.runtime_harness import launch

NAMES = [str(n) for n in FAMILIES if n != "dualpipe"]


def test_compiled_float8_blocks_are_exact_under_every_schedule_and_split():
    """Every schedule once, the (split, float8) pairs rotating over them so each pair meets
    several families (zero-bubble and V among them); inductor itself once, eager float8 twice."""
    pairs = [(True, False), (False, True), (False, False), (True, True)]
    cases = [(name, *pairs[i % 4], "aot_eager") for i, name in enumerate(NAMES)]
    cases += [
        ("zbv", None, True, "inductor"),
        ("zbv", False, True, None),
        ("1f1b", True, True, None),
    ]
    failures = launch(2, run_cases, cases, timeout=280)
    assert failures == [[], []]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.a, self.b = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.b(torch.nn.functional.gelu(self.a(self.ln(x))))


def _net():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block()).double()


@pytest.mark.parametrize("split_kind", ["deferred", "replay"])
def test_a_compiled_block_splits_exactly_and_runs_its_backward_once(split_kind):
    """Deferral reaches the linears of a compiled block (the graph breaks around each deferred
    linear, so W has the weight GEMMs); graph replay takes the compiled region's weight
    gradients in I instead of running its backward again in W."""
    net, ref = _net(), _net()
    for block in net:
        block.compile(backend="aot_eager")
    x0 = torch.randn(4, 8, dtype=torch.float64)
    g = torch.randn(4, 8, dtype=torch.float64)
    xr = x0.clone().requires_grad_()
    ref(xr).backward(g)
    split = DeferredLinears(net) if split_kind == "deferred" else GraphReplay()
    params = list(net.parameters())
    x = x0.clone().requires_grad_()
    out = split.call(net, (x,))
    (dx,), work = split.backward_input([get_gradient_edge(out)], [g], [x], params)
    if split_kind == "deferred":
        assert len(work.entries) == 4, "the compiled block's linears were not deferred"
        assert net[0].a.weight.grad is None
    else:
        assert work.empty and net[0].a.weight.grad is not None
    split.backward_weight(work)
    assert torch.allclose(dx, xr.grad, rtol=1e-12, atol=0)  # other kernels than eager's
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=0)


def test_a_fullgraph_block_is_refused_where_its_linears_are_deferred(caplog):
    from pipetrain import PipelineRefused
    from pipetrain.runtime.backward.interface import choose_split

    net = _net()
    for block in net:
        block.compile(backend="aot_eager", fullgraph=True)
    with pytest.raises(PipelineRefused, match="fullgraph=True.*defer_weight_grads=False"):
        choose_split(net, True, 0).call(net, (torch.randn(2, 8, dtype=torch.float64),))
    caplog.set_level("INFO", logger="pipetrain.runtime.backward.interface")
    split = choose_split(net, None, 0)  # a compiled stage's default: the way out named
    assert isinstance(split, GraphReplay)
    assert "compiled regions, whose graphs deferral would break" in caplog.text
    assert "compiled regions: their whole backward runs in I" in caplog.text
    x = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    (dx,), work = split.backward_input(
        [get_gradient_edge(split.call(net, (x,)))], [torch.ones(2, 8, dtype=torch.float64)], [x], []
    )
    assert dx is not None and work.empty
