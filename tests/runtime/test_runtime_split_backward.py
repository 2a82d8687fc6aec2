"""Split backward in one process: I then W equals one backward, nothing runs twice, graph freed."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from pipetrain.runtime.backward.graph_replay import GraphReplay, PlanCache, backward_full


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def run_split(split, net, x, g, count, refs=None):
    x = x.detach().requires_grad_(x.requires_grad)
    h = net[1](net[0](x))
    h.register_hook(lambda grad: count.append(1))
    out = net[2](h)
    if refs is not None:
        refs += [weakref.ref(x), weakref.ref(h)]
    params = [p for p in net.parameters() if p.requires_grad]
    found, work = split.backward_input(
        [get_gradient_edge(out)], [g], [x] if x.requires_grad else [], params
    )
    return found, work


def test_input_then_weight_equals_full_backward_and_skips_repeats():
    net, ref = model(), model()
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, dtype=torch.float64)
    xr = x.detach().requires_grad_()
    ref(xr).backward(g)
    fired = {n: 0 for n, _ in net.named_parameters()}
    for n, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: fired.__setitem__(n, fired[n] + 1))
    count: list[int] = []
    split = GraphReplay()
    (dx,), work = run_split(split, net, x, g, count)
    assert torch.allclose(dx, xr.grad, rtol=1e-12)
    assert all(p.grad is None for p in net.parameters()), "I must not touch weight gradients"
    assert len(count) == 1
    split.backward_weight(work)
    assert len(count) == 1, "W re-ran the input-gradient path"
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12), n
    assert all(v == 1 for v in fired.values()), fired


def test_first_stage_puts_everything_in_w_and_frees_the_graph():
    net, ref = model(), model()
    net[0].bias.requires_grad_(False)
    ref[0].bias.requires_grad_(False)
    x = torch.randn(2, 4, dtype=torch.float64)
    g = torch.randn(2, 3, dtype=torch.float64)
    ref(x).backward(g)
    refs: list[weakref.ref] = []
    split = GraphReplay()
    found, work = run_split(split, net, x, g, [], refs)
    assert found == [] and all(r() is not None for r in refs), "W needs the saved activations"
    split.backward_weight(work)
    del work
    gc.collect()
    assert all(r() is None for r in refs), "the graph outlived W"
    assert net[0].bias.grad is None
    for p, q in zip(net.parameters(), ref.parameters()):
        if q.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=1e-12)


class Square(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * x * w

    @staticmethod
    def backward(ctx, g):
        Square.calls += 1
        x, w = ctx.saved_tensors
        return 2 * x * w * g, (x * x * g).sum(0)


@pytest.mark.parametrize("last_piece", [False, True])
def test_custom_function_runs_once_and_parameter_free_stage_stays_exact(last_piece):
    """An opaque node (custom Function, a compiled region) computes every output whenever it
    runs: its parameters' gradients are taken in I (quietly, or held for W's AccumulateGrad in
    the step's last piece), never replayed."""
    w = nn.Parameter(torch.rand(3, dtype=torch.float64))
    fired = []
    w.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, dtype=torch.float64)
    out = Square.apply(x, w)
    split = GraphReplay()
    Square.calls = 0
    (dx,), work = split.backward_input([get_gradient_edge(out)], [g], [x], [w], last_piece)
    assert (w.grad is None) == last_piece
    assert work.empty, "nothing of the graph is left for W"
    split.backward_weight(work, hooks=last_piece)
    assert Square.calls == 1, "the custom backward ran twice"
    assert fired == ([1] if last_piece else [])
    assert torch.allclose(dx, 2 * x * w * g)
    assert torch.allclose(w.grad, (x * x * g).sum(0))
    y = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    (dy,), work = split.backward_input([get_gradient_edge(y.sin())], [g], [y], [])
    assert work.empty and torch.allclose(dy, y.cos() * g)


def test_full_backward_returns_input_gradients():
    net = model()
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, dtype=torch.float64)
    (dx,) = backward_full([get_gradient_edge(net(x))], [g], [x])
    assert dx is not None and x.grad is None and net[0].weight.grad is not None


def test_cached_plan_matches_fresh_plan_and_structure_changes_replan():
    from pipetrain.app.models.gpt import Block, GPTConfig

    cfg = GPTConfig(hidden=16, num_heads=2, seq_len=8)

    def stage():
        torch.manual_seed(0)
        return nn.Sequential(Block(cfg), Block(cfg)).double()

    cached, fresh, full = stage(), stage(), stage()
    replay = GraphReplay()

    def split(net, x, g, by):
        x = x.detach().requires_grad_(x.requires_grad)
        out = net(x)
        params = [p for p in net.parameters() if p.requires_grad]
        inputs = [x] if x.requires_grad else []
        found, work = by.backward_input([get_gradient_edge(out)], [g], inputs, params)
        by.backward_weight(work)
        return found

    def check(x, g):
        misses = replay.plans.misses
        got = split(cached, x, g, replay)
        missed = replay.plans.misses - misses
        want = split(fresh, x, g, GraphReplay())  # a fresh cache plans from scratch
        xr = x.detach().requires_grad_(x.requires_grad)
        ref = backward_full([get_gradient_edge(full(xr))], [g], [xr] if x.requires_grad else [])
        for a, b, c in zip(got, want, ref):
            assert torch.equal(a, b) and torch.allclose(a, c, rtol=1e-10, atol=1e-12)
        for (n, p), q, r in zip(cached.named_parameters(), fresh.parameters(), full.parameters()):
            assert (p.grad is None) == (q.grad is None) == (r.grad is None), n
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad), n
                assert torch.allclose(p.grad, r.grad, rtol=1e-10, atol=1e-12), n
        return missed

    def batch(t=8, need=True):
        x = torch.randn(2, t, 16, dtype=torch.float64, requires_grad=need)
        return x, torch.randn(2, t, 16, dtype=torch.float64)

    assert check(*batch()) == 1  # first micro-batch plans
    for _ in range(3):  # same structure, other values: served from the cache
        assert check(*batch()) == 0
    assert check(*batch(t=5)) == 0  # another length, same graph: the plan is structural
    assert check(*batch(need=False)) == 1  # input needs no gradient (a first stage): new plan
    for net in (cached, fresh, full):  # a frozen parameter changes the graph: new plan
        net[0].attn.qkv.weight.requires_grad_(False)
    assert check(*batch()) == 1
    assert check(*batch()) == 0
    assert cached[0].attn.qkv.weight.grad is not None  # accumulated before it was frozen


def test_quiet_accumulation_never_aliases_an_input_gradient():
    """``x + b`` with b shaped like x: autograd hands one tensor to both. Accumulating b's share
    quietly (a step's earlier pieces) must not let a later add_ change x's gradient."""
    b = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    found = []
    for seed in (1, 2):
        x = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        x.requires_grad_(True)
        y = x + b
        g = torch.full((4,), float(seed), dtype=torch.float64)
        found.append(backward_full([get_gradient_edge(y)], [g], [x], [b], hooks=False)[0])
    assert torch.equal(found[0], torch.full((4,), 1.0, dtype=torch.float64))
    assert torch.equal(found[1], torch.full((4,), 2.0, dtype=torch.float64))
    assert torch.equal(b.grad, torch.full((4,), 3.0, dtype=torch.float64))


def test_graph_shapes_are_named_records_and_caches_belong_to_their_owner():
    """The plan cache is per ``GraphReplay`` (one per stage): another one starts empty, and the
    shape it is keyed by reads as fields, not separators."""
    from pipetrain.runtime.backward.graph_replay import GraphShape, walk

    net = model()
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    out = net(x)
    params = list(net.parameters())
    order, shape = walk([get_gradient_edge(out)], [x], params)
    assert isinstance(shape, GraphShape) and shape.roots == (0,)
    assert len(shape.children) == len(order) and None not in shape.params
    assert shape.inputs[0] is not None and not shape.children[shape.inputs[0]]  # x's leaf node
    first, second = GraphReplay(), GraphReplay()
    first.backward_weight(first.backward_input([get_gradient_edge(out)], [out], [x], params)[1])
    assert (first.plans.misses, len(first.plans.plans)) == (1, 1)
    assert (second.plans.misses, len(second.plans.plans)) == (0, 0)
    assert isinstance(first.plans, PlanCache) and first.plans is not second.plans
