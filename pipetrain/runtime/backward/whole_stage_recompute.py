"""Recomputing a whole stage: ``F`` runs the stage's forward without autograd and keeps only its
inputs; the backward piece that needs the graph (``B``, or ``I``) first runs the forward again,
with autograd, then goes on as a stage without recompute does.

Why beside per-layer checkpoints (``activation_checkpoint``). ``torch.utils.checkpoint``'s
non-reentrant form — the one whose backward a pipeline can split — packs every saved tensor
through a Python hook and recomputes through frames of its own: several times the host work of
the layer's plain forward and backward (``benchmarks/recompute/checkpoint_host.py``). An eager stage whose
host path is the longest one pays all of it. Recomputed as one region, the stage costs its host
one gradient-free forward more than no recompute, as the reentrant checkpoint and Megatron-LM's
full recompute of a chunk of layers do (Chen et al. 2016, "Training Deep Nets with Sublinear
Memory Cost"), and the graph the backward splits is the real one: recomputed once, at the start
of ``I`` (or ``B``), with ``W`` running on what ``I`` left (the deferred linears' stash, or graph
replay's retained graph) — no second recompute, whichever split the stage uses.

Memory: between ``F`` and its backward a micro-batch holds only the stage's inputs and side
inputs; from the recompute to the end of its backward, the whole stage's activations for that one
micro-batch, as a stage without recompute holds them for each micro-batch in flight.

Which outputs the next stage differentiates is decided without a graph: floating-point outputs
of a stage with an input or a parameter that needs a gradient. An output the recompute finds
independent of both (a constant passed along) gets its received gradient dropped, which is what
its gradient contributes. Exact: the same forward on the same inputs, with ``F``'s random-number
state restored around the recompute (as ``torch.utils.checkpoint`` does), so dropout masks match
and the random stream afterwards is the one a run without recompute sees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

from pipetrain.runtime.comm.p2p import TensorMeta


@dataclass
class RandomState:
    """The CPU generator's state and each device generator's that a stage's tensors live on."""

    cpu: torch.Tensor
    devices: list
    states: list

    @classmethod
    def capture(cls, tensors: tuple[torch.Tensor, ...]) -> RandomState:
        devices, states = get_device_states(*tensors)
        return cls(torch.get_rng_state(), devices, states)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run with this state; the generators are left as they were found."""
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu)
            set_device_states(self.devices, self.states)
            yield


@dataclass
class Held:
    """What ``F`` keeps of a micro-batch for its recompute: the stage's arguments, side inputs,
    target and loss weight (last stage), random state, and which outputs need a gradient
    (``root_metas``: their shapes, for the receive buffers of those gradients)."""

    args: tuple[torch.Tensor, ...]
    side: dict | None
    target: object
    weight: float | torch.Tensor
    random: RandomState
    needs_grad: tuple[bool, ...]
    root_metas: list[TensorMeta]


def outputs_needing_grad(
    outputs: tuple[torch.Tensor, ...], args: tuple[torch.Tensor, ...], has_params: bool
) -> tuple[bool, ...]:
    """Which of a gradient-free forward's outputs the next stage differentiates (module doc)."""
    upstream = has_params or any(a.requires_grad for a in args)
    return tuple(upstream and (o.is_floating_point() or o.is_complex()) for o in outputs)


def as_sent(outputs: tuple[torch.Tensor, ...], needs: tuple[bool, ...]) -> tuple[torch.Tensor, ...]:
    """The gradient-free outputs as the next stage must see them: leaves that need a gradient
    where the stage's graph would have given them one."""
    return tuple(o.detach().requires_grad_(n) for o, n in zip(outputs, needs))
