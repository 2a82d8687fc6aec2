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
  reach ``.grad`` through ``AccumulateGrad``, so post-accumulate-grad hooks fire once per
  accumulation, as in a plain backward.
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
Graph walking is Python, once per (stage, micro-batch); it is linear in the graph size.
"""

from __future__ import annotations

from collections import defaultdict, deque
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


def _children(node: Node) -> list[Node]:
    return [c for c, _ in node.next_functions if c is not None]


def _parents_of(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Reverse edges of the graph reachable from ``roots`` (every reached node is a key)."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    queue = deque(dict.fromkeys(roots))
    for r in queue:
        parents[r]
    while queue:
        node = queue.popleft()
        for child in _children(node):
            if child not in parents:
                queue.append(child)
            parents[child].append(node)
    return parents


def _upward(starts: Sequence[Node], parents: dict[Node, list[Node]], stop: set[Node]):
    """Nodes reachable from ``starts`` along reverse edges, not entering ``stop`` (returned apart)."""
    seen, hit = set(starts), set()
    queue = deque(starts)
    while queue:
        for p in parents.get(queue.popleft(), ()):
            if p in stop:
                hit.add(p)
            elif p not in seen:
                seen.add(p)
                queue.append(p)
    return seen, hit


def _plan(roots, grads, inputs, params) -> tuple[list[_Group], WeightWork]:
    """Find ``P``, the boundary groups and the roots outside ``P`` (see the module docstring)."""
    parents = _parents_of([e.node for e in roots])
    input_nodes = [n for n in (get_gradient_edge(x).node for x in inputs) if n in parents]
    on_path, _ = _upward(input_nodes, parents, set()) if input_nodes else (set(), set())
    by_node: dict[Node, _Group] = {}
    groups: list[_Group] = []
    root_nodes = {e.node for e in roots}
    outside_params: list[torch.Tensor] = []
    for p in params:
        node = get_gradient_edge(p).node
        if node not in parents:
            continue  # not used by this micro-batch's forward
        region, boundary = _upward([node], parents, on_path)
        if region & root_nodes:
            outside_params.append(p)
        if not boundary:
            continue
        merged = {id(by_node[b]): by_node[b] for b in boundary if b in by_node}
        group = _Group(nodes=[b for b in boundary if b not in by_node], params=[p])
        for other in merged.values():
            group.nodes += other.nodes
            group.params += other.params
            groups.remove(other)
        groups.append(group)
        for b in group.nodes:
            by_node[b] = group
    outside = [(e, g) for e, g in zip(roots, grads) if e.node not in on_path]
    work = WeightWork(
        groups=groups,
        roots=[e for e, _ in outside] if outside_params else [],
        root_grads=[g for _, g in outside] if outside_params else [],
        root_params=outside_params,
    )
    return groups, work


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
            found = torch.autograd.grad(
                list(roots),
                list(inputs),
                list(grads),
                retain_graph=not work.empty,
                allow_unused=True,
            )
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


def backward_weight(work: WeightWork) -> None:
    """``W``: accumulate weight gradients into ``.grad``; the caller drops ``work`` afterwards."""
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
                torch.autograd.backward(edges, values, retain_graph=True, inputs=group.params)
        finally:
            for h in handles:
                h.remove()
    if work.roots:
        torch.autograd.backward(
            work.roots, work.root_grads, retain_graph=True, inputs=work.root_params
        )


def backward_full(
    roots: Sequence[GradientEdge],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
) -> list[torch.Tensor | None]:
    """``B``: one ordinary backward; weight gradients accumulate, input gradients are returned."""
    if not roots:
        return [None] * len(inputs)
    for x in inputs:
        x.grad = None
    torch.autograd.backward(list(roots), list(grads))
    found = [x.grad for x in inputs]
    for x in inputs:
        x.grad = None
    return found
