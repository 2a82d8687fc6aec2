"""Activation checkpointing inside stages: ``torch.utils.checkpoint`` with ``use_reentrant=False``
is exact under every schedule; the reentrant variant is refused at the first step.

Non-reentrant checkpointing (saved-tensor hooks: a checkpointed region's saved tensors are
recomputed when a backward unpacks them) keeps the region's nodes in the stage's autograd graph,
so ``B``, and the ``I``/``W`` split of either kind, run through it like through any other nodes.
The reentrant variant hides the region behind one ``CheckpointFunction`` node whose backward runs
a nested ``torch.autograd.backward`` over the recomputed region: that nested call accumulates
weight gradients during ``I`` (through ``AccumulateGrad``, hooks included) and cannot be split,
so it would put gradients in the wrong piece of the step — refused.

Cost (measured in docs/training.md): each backward engine call that reaches a checkpointed node
recomputes its region once. Deferred weight gradients (``defer_weight_grads=True``) need one —
``I`` recomputes, ``W`` uses the inputs the deferred linears stashed — so a micro-batch runs the
region's forward twice. Graph replay's ``W`` calls the engine again (once per group of boundary
nodes), each recomputing: more forward runs, same numbers.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.autograd.graph import Node

REENTRANT_NODE = "CheckpointFunctionBackward"


def refuse_reentrant(roots: Iterable[Node], stage: int) -> None:
    """Walk the stage's graph from ``roots`` (once per stage: its inputs are leaves, so the
    walk stays inside the stage) and refuse a reentrant checkpoint node."""
    seen: set[Node] = set()
    todo = [r for r in roots if r is not None]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == REENTRANT_NODE:
            raise ValueError(
                f"stage {stage} uses torch.utils.checkpoint with use_reentrant=True, whose "
                "backward cannot be split or held back for the schedule; pass "
                "use_reentrant=False (exact under every schedule)"
            )
        todo.extend(child for child, _ in node.next_functions if child is not None)
