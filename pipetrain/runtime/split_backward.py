"""Split backward: ``I`` computes input gradients only, ``W`` weight gradients only, and no part
of the backward graph runs twice except the few nodes where the two halves meet.

How (the idea of torch.distributed.pipelining's ``_backward.py``, written afresh):

* Call ``P`` the autograd nodes on a path from the stage outputs to the stage inputs. ``I`` is
  ``torch.autograd.grad(outputs, inputs, retain_graph=True)``; torch executes exactly ``P`` and in
  each node computes only the outputs that lead to the inputs (e.g. ``dx`` of a matmul, not ``dW``).
* A **boundary** node is a node of ``P`` with a child outside ``P`` that leads to a trainable
  parameter (a matmul's weight branch). During ``I`` a pre-hook captures the gradient flowing into
  each boundary node.
* ``W`` replays only those nodes: ``torch.autograd.backward`` from ``GradientEdge(node, k)`` with the
  captured gradients and ``inputs=params``. Boundary nodes are grouped by the parameters they reach
  (one call per group), so a call never flows through ``P`` into another group's boundary. Gradients
  reach ``.grad`` through ``AccumulateGrad`` in a stage's last backward piece of the step; the
  earlier pieces add into ``.grad`` directly (``accumulate_quietly``), so post-accumulate-grad
  hooks fire once per parameter per step and see the step's whole gradient.
* Output nodes outside ``P`` (an output that depends on parameters only, or every node of a stage
  whose inputs need no gradient, like the first stage) have nothing to split: ``W`` runs them from
  the output gradients. Backward is linear in its incoming gradient, so splitting the roots over
  several calls sums to exactly the unsplit result.
* A parameter used by several boundary nodes on one path (weights tied *inside* a stage) puts two
  boundary nodes of one group on a ``P`` path; there a pre-hook pins each boundary node's incoming
  gradient to its captured value, which keeps the result exact at the price of re-running the ``P``
  nodes between them.

Limits: a boundary node is re-run in ``W`` for its weight outputs only, which for built-in ops
costs what the weight half costs. A custom ``autograd.Function`` cannot tell which outputs are
wanted (``ctx.needs_input_grad`` reflects ``requires_grad``, not the engine's plan), so its
``backward`` computes everything in ``I`` and again in ``W``: results stay exact, time does not.

Host cost: the plan is a function of the graph's *shape* only (its edges, which nodes are the
inputs' and the parameters' gradient nodes, which are the roots), and a stage builds the same shape
for every micro-batch. So each call does one cheap walk (breadth-first from the roots, children in
``next_functions`` order) that numbers the nodes and writes the shape down as a tuple of those
numbers; the plan is computed once per distinct shape, in node numbers, and cached under that
tuple. The tuple encodes the whole reachable graph, so an equal tuple means an identical plan and a
different graph (another ``requires_grad`` pattern, other control flow; tensor shapes do not matter)
gets its own plan.
The engine is entered directly (``torch.autograd.graph._engine_run_backward``, what
``torch.autograd.grad``/``backward`` call after their argument checks) where every root has a
gradient tensor; the engine still validates root gradients against the roots' metadata.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _Group:
    """Boundary nodes that share parameters, with the gradients captured for them in ``I``."""

    nodes: list[Node]
    params: list[torch.Tensor]
    captured: dict[int, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class WeightWork:
    """What ``W`` needs: the groups and the output roots outside ``P``. Dropping it frees the graph."""

    groups: list[_Group]
    roots: list[GradientEdge]
    root_grads: list[torch.Tensor]
    root_params: list[torch.Tensor]

    @property
    def empty(self) -> bool:
        return not self.groups and not self.roots


try:  # the engine entry point behind torch.autograd.grad / backward (skips their checks)
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - other torch versions
    _engine_run_backward = None


@dataclass(frozen=True)
class _Plan:
    """A plan in node numbers (positions in ``_walk`` order) and parameter positions."""

    groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (boundary nodes, params)
    outside_roots: tuple[int, ...]  # positions in ``roots`` of the roots outside P
    outside_params: tuple[int, ...]  # positions in ``params`` that W reaches from those roots


_PLANS: dict[tuple[int, ...], _Plan] = {}
_PLANS_MAX = 256  # distinct graph shapes kept (a stage normally has one or two)
plan_stats = {"hits": 0, "misses": 0}


def _walk(roots, inputs, params) -> tuple[list[Node], tuple[int, ...]]:
    """Number the nodes reachable from ``roots`` (breadth-first, children in order) and describe
    the graph in those numbers: root nodes, then each node's children ending with -1, then the
    inputs' and the parameters' gradient nodes (-1 where unreached). Equal descriptions mean
    isomorphic graphs with the inputs, parameters and roots at the same places.

    A leaf tensor's gradient node is its ``AccumulateGrad``, found here as a childless node whose
    ``variable`` is the tensor (what ``get_gradient_edge`` returns while a graph holds it, at a
    fraction of the cost)."""
    index: dict[Node, int] = {}
    order: list[Node] = []
    key: list[int] = []
    for edge in roots:
        index.setdefault(edge.node, len(index))
        key.append(index[edge.node])
    order.extend(index)  # dicts keep insertion order: numbers are positions
    key.append(-1)
    append = key.append  # the loop below is the per-micro-batch host cost of I: kept tight
    leaf_at: dict[int, int] = {}  # id(leaf tensor) -> its AccumulateGrad's number
    pos = 0
    while pos < len(order):
        children = order[pos].next_functions
        if not children:
            var = getattr(order[pos], "variable", None)
            if var is not None:
                leaf_at[id(var)] = pos
        for child, _ in children:
            if child is not None:
                i = index.get(child)
                if i is None:
                    i = index[child] = len(order)
                    order.append(child)
                append(i)
        append(-1)
        pos += 1
    key.extend(_node_of(x, index, leaf_at) for x in inputs)
    key.append(-1)
    key.extend(_node_of(q, index, leaf_at) for q in params)
    return order, tuple(key)


def _node_of(t: torch.Tensor, index: dict[Node, int], leaf_at: dict[int, int]) -> int:
    """Number of ``t``'s gradient node in the walk, -1 if unreached."""
    if t.grad_fn is None:
        return leaf_at.get(id(t), -1)
    return index.get(get_gradient_edge(t).node, -1)


def _compute_plan(key: tuple[int, ...], n_roots: int, n_inputs: int, n_params: int) -> _Plan:
    """Find ``P``, the boundary groups and the roots outside ``P`` (see the module docstring),
    from the description ``_walk`` wrote."""
    root_idx = key[:n_roots]
    pos = n_roots + 1
    parents: list[list[int]] = [[] for _ in set(root_idx)]  # roots are numbered 0, 1, ...
    node = 0
    while node < len(parents):  # one child list per node; a new child takes the next number
        while key[pos] != -1:
            child = key[pos]
            if child == len(parents):
                parents.append([])
            parents[child].append(node)
            pos += 1
        pos += 1
        node += 1
    input_idx = key[pos : pos + n_inputs]
    param_idx = key[pos + n_inputs + 1 : pos + n_inputs + 1 + n_params]

    def upward(starts, stop):
        seen, hit = set(starts), set()
        queue = deque(starts)
        while queue:
            for q in parents[queue.popleft()]:
                if q in stop:
                    hit.add(q)
                elif q not in seen:
                    seen.add(q)
                    queue.append(q)
        return seen, hit

    starts = [i for i in input_idx if i >= 0]
    on_path, _ = upward(starts, set()) if starts else (set(), set())
    root_nodes = set(root_idx)
    by_node: dict[int, list] = {}
    groups: list[list] = []  # [boundary nodes, param positions]
    outside_params: list[int] = []
    for j, pnode in enumerate(param_idx):
        if pnode < 0:
            continue  # not used by this forward
        region, boundary = upward([pnode], on_path)
        if region & root_nodes:
            outside_params.append(j)
        if not boundary:
            continue
        merged = {id(by_node[b]): by_node[b] for b in boundary if b in by_node}
        group = [sorted(b for b in boundary if b not in by_node), [j]]
        for other in merged.values():
            group[0] += other[0]
            group[1] += other[1]
            groups.remove(other)
        groups.append(group)
        for b in group[0]:
            by_node[b] = group
    outside = tuple(k for k, r in enumerate(root_idx) if r not in on_path)
    return _Plan(
        groups=tuple((tuple(g[0]), tuple(g[1])) for g in groups),
        outside_roots=outside if outside_params else (),
        outside_params=tuple(outside_params),
    )


def _plan(roots, grads, inputs, params) -> tuple[list[_Group], WeightWork]:
    """The plan for this graph (cached by its shape), bound to this micro-batch's nodes."""
    order, description = _walk(roots, inputs, params)
    # the counts first: -1 both ends a section and marks an unreached input or parameter
    key = (len(roots), len(inputs), len(params), *description)
    plan = _PLANS.get(key)
    if plan is None:
        plan_stats["misses"] += 1
        plan = _compute_plan(description, len(roots), len(inputs), len(params))
        if len(_PLANS) >= _PLANS_MAX:
            del _PLANS[next(iter(_PLANS))]
        _PLANS[key] = plan
    else:
        plan_stats["hits"] += 1
    groups = [
        _Group(nodes=[order[i] for i in nodes], params=[params[j] for j in ps])
        for nodes, ps in plan.groups
    ]
    work = WeightWork(
        groups=groups,
        roots=[roots[k] for k in plan.outside_roots],
        root_grads=[grads[k] for k in plan.outside_roots],
        root_params=[params[j] for j in plan.outside_params],
    )
    return groups, work


def run_engine(roots, grads, inputs, *, retain_graph: bool, accumulate: bool):
    """``torch.autograd.backward`` (``accumulate``) or ``grad`` (allow_unused), entered directly
    at the engine when every root gradient is a tensor."""
    if _engine_run_backward is None or not all(isinstance(g, torch.Tensor) for g in grads):
        if accumulate:
            return torch.autograd.backward(roots, grads, retain_graph=retain_graph, inputs=inputs)
        return torch.autograd.grad(
            roots, inputs, grads, retain_graph=retain_graph, allow_unused=True
        )
    return _engine_run_backward(
        tuple(roots),
        tuple(grads),
        retain_graph,
        False,
        tuple(inputs),
        allow_unreachable=True,
        accumulate_grad=accumulate,
    )


def backward_input(
    roots: Sequence[GradientEdge],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """``I``: gradients of ``inputs`` (``None`` where unused) and the work ``W`` will finish."""
    groups, work = _plan(roots, grads, inputs, params)
    handles = []
    for group in groups:
        for i, node in enumerate(group.nodes):
            handles.append(node.register_prehook(_capture(group, i)))
    try:
        if inputs and roots:
            found = run_engine(roots, grads, inputs, retain_graph=not work.empty, accumulate=False)
        else:
            found = (None,) * len(inputs)
    finally:
        for h in handles:
            h.remove()
    return list(found), work


def _capture(group: _Group, i: int):
    def hook(grad_outputs):
        group.captured[i] = tuple(grad_outputs)

    return hook


def _pin(captured: tuple[torch.Tensor | None, ...]):
    def hook(grad_outputs):
        return captured

    return hook


def accumulate_quietly(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]
) -> None:
    """Add ``grads`` into ``.grad`` without running ``AccumulateGrad`` (so without its hooks).

    A step's every backward piece but a stage's last accumulates this way; the last goes through
    ``AccumulateGrad``, so post-accumulate-grad hooks — what data-parallel wrappers hang their
    reductions on — fire once per parameter per step and see the step's whole gradient.
    """
    into, adds = [], []
    for p, g in zip(params, grads):
        if g is None:
            continue
        if p.grad is None:
            # Never keep autograd's tensor itself: it may also be another output's gradient
            # (``x + b`` hands the same tensor to x and b), which a later add_ would corrupt.
            p.grad = g.clone()
        else:
            into.append(p.grad)
            adds.append(g)
    if into:
        torch._foreach_add_(into, adds)  # one launch loop in C++, not one Python call per weight


def backward_weight(work: WeightWork, hooks: bool = True) -> None:
    """``W``: weight gradients into ``.grad`` (through ``AccumulateGrad`` and its hooks only with
    ``hooks``); the caller drops ``work`` afterwards."""
    for group in work.groups:
        edges, values, handles = [], [], []
        for i, node in enumerate(group.nodes):
            captured = group.captured.get(i)
            if captured is None:
                continue  # no gradient reached this node in I
            for k, g in enumerate(captured):
                if g is not None:
                    edges.append(GradientEdge(node, k))
                    values.append(g)
            if len(group.nodes) > 1:
                handles.append(node.register_prehook(_pin(captured)))
        try:
            if edges:
                _weights(edges, values, group.params, hooks)
        finally:
            for h in handles:
                h.remove()
    if work.roots:
        _weights(work.roots, work.root_grads, work.root_params, hooks)


def _weights(roots, grads, params, hooks: bool) -> None:
    if hooks:
        run_engine(roots, grads, params, retain_graph=True, accumulate=True)
    else:
        accumulate_quietly(
            params, run_engine(roots, grads, params, retain_graph=True, accumulate=False)
        )


def backward_full(
    roots: Sequence[GradientEdge],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] = (),
    hooks: bool = True,
) -> list[torch.Tensor | None]:
    """``B``: one ordinary backward; weight gradients accumulate (without ``hooks``: quietly, into
    ``params``' ``.grad``), input gradients are returned."""
    if not roots:
        return [None] * len(inputs)
    if not hooks:
        if not inputs and not params:
            return []
        found = run_engine(roots, grads, [*inputs, *params], retain_graph=False, accumulate=False)
        accumulate_quietly(params, found[len(inputs) :])
        return list(found[: len(inputs)])
    for x in inputs:
        x.grad = None
    torch.autograd.backward(list(roots), list(grads))
    found = [x.grad for x in inputs]
    for x in inputs:
        x.grad = None
    return found
