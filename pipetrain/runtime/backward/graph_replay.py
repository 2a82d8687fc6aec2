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

Opaque nodes: a boundary node is re-run in ``W`` for its weight outputs only, which for built-in
ops costs what the weight half costs. A custom ``autograd.Function`` — a ``torch.compile``d
region's whole backward, a float8 linear's — cannot tell which outputs are wanted
(``ctx.needs_input_grad`` reflects ``requires_grad``, not the engine's plan): its ``backward``
computes every output whenever it runs, so replaying it in ``W`` would run it twice. And a
compiled backward that donates its buffers refuses to run under ``retain_graph``, which replay
needs. So a graph with such a boundary node is not split: ``I`` computes the stage's weight
gradients too and frees the graph. Where no hook needs them added quietly they go through
``AccumulateGrad`` as the engine produces them, as a ``B``'s do (collected first and added after
the engine ended, the stage's whole gradient would exist twice at the backward's peak);
otherwise they are collected and added into ``.grad`` quietly at once — or, for the step's last
weight piece, handed to ``W`` to pass through ``AccumulateGrad``. Exact,
nothing runs twice; such a stage's ``W`` has no work to fill a zero-bubble schedule's bubbles
with (``deferred_wgrad`` does split a compiled stage's plain linears).

Recomputed layers (activation checkpointing): their saved tensors are recomputed whenever a
backward unpacks them, so replaying their nodes in ``W`` would run their forwards a second
time and keep what ``I`` recomputed alive until ``W`` (measured: several times the step's cost
and a higher peak than no recompute at all). A stage whose layers recompute is therefore not
split either (``GraphReplay(whole=True)``: ``I`` takes the weight gradients as above).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.autograd.function import BackwardCFunction

from pipetrain.runtime.torch_compat import (
    GradientEdge,
    Node,
    accumulate_grad_variable,
    add_lists_,
    engine_run_backward,
    get_gradient_edge,
)


class GraphShape(NamedTuple):
    """A backward graph in node numbers (positions in the walk's breadth-first order).

    Equal shapes mean isomorphic graphs with the roots, inputs and parameters at the same places,
    so they share a plan."""

    roots: tuple[int, ...]  # each root's node
    children: tuple[tuple[int, ...], ...]  # per node, its children in ``next_functions`` order
    inputs: tuple[int | None, ...]  # each input's gradient node; None: this graph never reaches it
    params: tuple[int | None, ...]  # each parameter's gradient node; None: unused by this forward


class GroupPlan(NamedTuple):
    """Boundary nodes that lead to the same parameters (one engine call in ``W``)."""

    nodes: tuple[int, ...]  # node numbers
    params: tuple[int, ...]  # positions in the stage's parameter list


class Plan(NamedTuple):
    """What to capture in ``I`` and replay in ``W`` for one graph shape."""

    groups: tuple[GroupPlan, ...]
    outside_roots: tuple[int, ...]  # positions in ``roots`` of the roots outside P
    outside_params: tuple[int, ...]  # positions in ``params`` that W reaches from those roots


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
    #: parameters whose gradients ``I`` computes (a graph with opaque nodes), and with
    #: ``last_piece`` those gradients, held for ``W``'s ``AccumulateGrad``
    taken: list[torch.Tensor] = field(default_factory=list)
    held: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """Whether ``W`` needs nothing of the graph."""
        return not self.groups and not self.roots


def walk(roots, inputs, params) -> tuple[list[Node], GraphShape]:
    """Number the nodes reachable from ``roots`` (breadth-first, children in order) and describe
    the graph in those numbers.

    A leaf tensor's gradient node is its ``AccumulateGrad``, found here as a childless node whose
    ``variable`` is the tensor (what ``get_gradient_edge`` returns while a graph holds it, at a
    fraction of the cost)."""
    index: dict[Node, int] = {}
    for edge in roots:
        index.setdefault(edge.node, len(index))
    root_nodes = tuple(index[edge.node] for edge in roots)
    order: list[Node] = list(index)  # dicts keep insertion order: numbers are positions
    children: list[tuple[int, ...]] = []
    add_children = children.append  # the loop below is the per-micro-batch host cost of I
    leaf_at: dict[int, int] = {}  # id(leaf tensor) -> its AccumulateGrad's number
    pos = 0
    while pos < len(order):
        nexts = order[pos].next_functions
        if not nexts:
            var = accumulate_grad_variable(order[pos])
            if var is not None:
                leaf_at[id(var)] = pos
            add_children(())
            pos += 1
            continue
        kids = []
        for child, _ in nexts:
            if child is not None:
                i = index.get(child)
                if i is None:
                    i = index[child] = len(order)
                    order.append(child)
                kids.append(i)
        add_children(tuple(kids))
        pos += 1
    shape = GraphShape(
        roots=root_nodes,
        children=tuple(children),
        inputs=tuple(_node_of(x, index, leaf_at) for x in inputs),
        params=tuple(_node_of(q, index, leaf_at) for q in params),
    )
    return order, shape


def _node_of(t: torch.Tensor, index: dict[Node, int], leaf_at: dict[int, int]) -> int | None:
    """Number of ``t``'s gradient node in the walk, None if unreached."""
    if t.grad_fn is None:
        return leaf_at.get(id(t))
    return index.get(get_gradient_edge(t).node)


def compute_plan(shape: GraphShape) -> Plan:
    """Find ``P``, the boundary groups and the roots outside ``P`` (see the module docstring)."""
    parents: list[list[int]] = [[] for _ in shape.children]
    for node, kids in enumerate(shape.children):
        for child in kids:
            parents[child].append(node)

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

    starts = [i for i in shape.inputs if i is not None]
    on_path, _ = upward(starts, set()) if starts else (set(), set())
    root_nodes = set(shape.roots)
    by_node: dict[int, list] = {}
    groups: list[list] = []  # [boundary nodes, param positions]
    outside_params: list[int] = []
    for j, pnode in enumerate(shape.params):
        if pnode is None:
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
    outside = tuple(k for k, r in enumerate(shape.roots) if r not in on_path)
    return Plan(
        groups=tuple(GroupPlan(tuple(g[0]), tuple(g[1])) for g in groups),
        outside_roots=outside if outside_params else (),
        outside_params=tuple(outside_params),
    )


@dataclass
class PlanCache:
    """Plans by graph shape, for one stage (a stage normally builds one or two shapes)."""

    max_size: int = 256
    plans: dict[GraphShape, Plan] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def get(self, shape: GraphShape) -> Plan:
        plan = self.plans.get(shape)
        if plan is not None:
            self.hits += 1
            return plan
        self.misses += 1
        plan = compute_plan(shape)
        if len(self.plans) >= self.max_size:
            del self.plans[next(iter(self.plans))]
        self.plans[shape] = plan
        return plan


def run_engine(roots, grads, inputs, *, retain_graph: bool, accumulate: bool):
    """One engine call (see ``torch_compat.engine_run_backward``)."""
    return engine_run_backward(
        roots, grads, inputs, retain_graph=retain_graph, accumulate=accumulate
    )


class GraphReplay:
    """The ``BackwardSplit`` that splits any module by replaying graph nodes (module docstring).

    Holds this stage's plan cache; the module itself is never touched."""

    defers_linear_weights = False
    #: its quiet pieces capture every weight gradient, then copy or add them into ``.grad``
    plain_accumulation = True

    def __init__(self, whole: bool = False) -> None:
        self.plans = PlanCache()
        #: never split: ``I`` takes every weight gradient (a stage whose layers recompute)
        self.whole = whole

    def call(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...]):
        return module(*args)

    def backward_full(self, roots, grads, inputs, params, hooks: bool) -> list[torch.Tensor | None]:
        return backward_full(roots, grads, inputs, params, hooks)

    def backward_input(
        self,
        roots: Sequence[GradientEdge],
        grads: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
        last_piece: bool = False,
        through_autograd: bool = False,
    ) -> tuple[list[torch.Tensor | None], WeightWork]:
        """``I``: gradients of ``inputs`` (``None`` where unused) and the work ``W`` will finish.
        Where the graph has opaque nodes, or the stage recomputes (``whole``), the weight
        gradients too: with ``through_autograd`` (no hook needs a quiet add) through
        ``AccumulateGrad`` as the engine produces them, as ``B`` does; else collected from the
        engine and added into ``.grad`` quietly once it ends, or with ``last_piece`` kept in the
        work for ``W`` to pass through ``AccumulateGrad``. (Collected, the stage's whole weight
        gradient exists twice at the end of the backward: parameter-sized memory the planner's
        model does not see, measured on GPUs under zero-bubble schedules.)"""
        as_b = through_autograd and not last_piece
        if as_b and self.whole:  # nothing to split, nothing to hold: no walk of the graph
            return _as_b(roots, grads, inputs, params)
        groups, work = self._bind(roots, grads, inputs, params)
        if as_b and work.empty:
            return _as_b(roots, grads, inputs, params)
        handles = []
        for group in groups:
            for i, node in enumerate(group.nodes):
                handles.append(node.register_prehook(_capture(group, i)))
        wanted = [*inputs, *work.taken]
        try:
            if wanted and roots:
                found = run_engine(
                    roots, grads, wanted, retain_graph=not work.empty, accumulate=False
                )
            else:
                found = (None,) * len(wanted)
        finally:
            for h in handles:
                h.remove()
        n = len(inputs)
        if last_piece:
            work.held = [(p, g) for p, g in zip(work.taken, found[n:]) if g is not None]
        else:
            accumulate_quietly(work.taken, found[n:])
        return list(found[:n]), work

    def backward_weight(self, work: WeightWork, hooks: bool = True) -> None:
        """``W``: weight gradients into ``.grad`` (through ``AccumulateGrad`` and its hooks only
        with ``hooks``); the caller drops ``work`` afterwards."""
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
            _weights(work.roots, work.root_grads, work.root_params, hooks, retain=False)
        if work.held:
            taken = [p for p, _ in work.held]
            found = [g for _, g in work.held]
            if hooks:
                torch.autograd.backward(taken, found)
            else:
                accumulate_quietly(taken, found)

    def _bind(self, roots, grads, inputs, params) -> tuple[list[_Group], WeightWork]:
        """The plan for this graph (cached by its shape), bound to this micro-batch's nodes."""
        order, shape = walk(roots, inputs, params)
        plan = self.plans.get(shape)
        opaque = any(isinstance(order[i], BackwardCFunction) for g in plan.groups for i in g.nodes)
        if opaque or self.whole:  # I takes every weight gradient; W at most accumulates them
            reached = {j for g in plan.groups for j in g.params} | set(plan.outside_params)
            return [], WeightWork([], [], [], [], taken=[params[j] for j in sorted(reached)])
        groups = [
            _Group(nodes=[order[i] for i in g.nodes], params=[params[j] for j in g.params])
            for g in plan.groups
        ]
        work = WeightWork(
            groups=groups,
            roots=[roots[k] for k in plan.outside_roots],
            root_grads=[grads[k] for k in plan.outside_roots],
            root_params=[params[j] for j in plan.outside_params],
        )
        return groups, work


def _as_b(roots, grads, inputs, params) -> tuple[list[torch.Tensor | None], WeightWork]:
    """An ``I`` run as ``B`` runs: one backward through ``AccumulateGrad``, nothing left for
    ``W``."""
    return backward_full(roots, grads, inputs, params, hooks=True), WeightWork([], [], [], [])


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
        add_lists_(into, adds)  # one launch loop in C++, not one Python call per weight


def _weights(roots, grads, params, hooks: bool, retain: bool = True) -> None:
    """One ``W`` engine call; ``retain``: another call of this ``W`` still needs the graph
    (the last one frees it: a compiled backward that donates buffers refuses to be retained)."""
    if hooks:
        run_engine(roots, grads, params, retain_graph=retain, accumulate=True)
    else:
        accumulate_quietly(
            params, run_engine(roots, grads, params, retain_graph=retain, accumulate=False)
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
