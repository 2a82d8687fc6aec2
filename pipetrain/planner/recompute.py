"""Activation recompute in the planner: what a stage holds and pays when its layers are
checkpointed, as a transformation of its layers' costs (the simulator stays generic: it sees
only other per-stage numbers).

The runtime checkpoints a recomputed stage **layer by layer**
(``runtime.backward.activation_checkpoint``: each layer its own non-reentrant
``torch.utils.checkpoint`` region), so the transformation is per layer and a stage's costs stay
sums over its layers (``judge.stage_costs``):

* ``"full"``: a layer keeps only its input between its forward and its backward — plus, on the
  last layer, what the loss saves, since the loss runs outside the region. That is the costs
  file's ``recompute_activation``, which the profiler measures (the bytes the forward saves with
  the layer checkpointed); a file without it: ``INPUT_SHARE`` of ``activation``, the share of a
  transformer layer's input (2sbh bytes) in its activations (34sbh bytes, attention scores not
  kept: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  §4.1). The first backward piece to reach the layer (``B``, or ``I`` of a split backward) runs
  its forward again first (``recompute`` ms, which the profiler measures as what checkpointing
  the layer adds to its backward; default its ``forward``), and while it does the layer's
  activations are live again (added to its workspace: one layer is recomputed at a time). Its
  forward costs ``recompute_forward`` more (the checkpoint's bookkeeping: a pack hook per saved
  tensor, measured by the profiler; default 0).
* ``"selective"``: the runtime keeps the outputs of matrix products and fused attention and
  recomputes the rest (pointwise ops, norms: cheap to run, costly to hold), after Korthikanti et
  al.'s selective recompute. It holds the costs file's ``selective_activation``, which the
  profiler measures (the saved tensors and the cached outputs); a file without it: what full
  recompute keeps plus ``SELECTIVE_KEPT`` of the rest. It pays the costs file's
  ``selective_recompute``, which the profiler measures like ``recompute``; a file without it:
  ``SELECTIVE_TIME`` of the recompute time, and its forward ``selective_forward`` more (the
  dispatch mode that picks what to keep sees every operator; default 0). The part it does not
  keep is live again during the backward as above. The model's last layer, which feeds the loss,
  stays plain under selective recompute, at run time and here: its matrix products' outputs are
  its output (a language model's logits), which the loss keeps or casts anyway, so caching them
  would hold a second copy and spare nothing (``layers_under``). ``SELECTIVE_TIME`` and
  ``SELECTIVE_KEPT`` are modelling assumptions where they stand in. The measured sizes are
  checked on CPU (tests/runtime/test_profile.py counts them by hand).

A stage may also recompute as one region (``"whole"``, ``whole_stage``): it holds only its
input between ``F`` and its backward, which runs the forward again first and then splits as a
plain stage's. Priced here, not turned on by the search (``MODES``).

A stage may recompute only its first K layers (``StageRecompute``, written ``"full:K"`` or
``"selective:K"``; Megatron-LM's ``recompute_method="block"`` with ``recompute_num_layers``): the
others hold what they hold without recompute. Memory falls layer by layer, so a rank a little
over its budget pays the recompute of a few layers, not of the whole stage.

How a recomputing stage splits its backward: in an eager step the runtime runs it by graph
replay, unsplit — its ``I`` runs the whole backward (recomputing each layer once) and its ``W``
nothing (``runtime.backward.interface.choose_split``: deferring the linears' weight gradients
would run each recomputed linear through Python autograd functions again, and replaying ``W``
would recompute again). So here a recomputed layer's ``I`` is its whole backward plus the
recompute, its ``W`` costs nothing and holds nothing: zero-bubble schedules get no ``W`` from
such a stage to fill their bubbles with, as at run time. In a step captured as a CUDA graph
(``ModelCosts.captured``) the runtime defers the linears' weight GEMMs there too: ``I`` is the
layer's ``I`` plus the recompute, ``W`` its ``W``, holding what its ``W`` holds.

An eager profile's host and device times (``LayerCost.has_issue_times``) follow the same
transformation: the recompute runs the layer's forward again, so its time divides between host
and device as the forward's does; the checkpoint's bookkeeping is host work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pipetrain.planner.costs_file import LayerCost, ModelCosts
from pipetrain.planner.recompute_modes import Recompute, StageRecompute

#: the modes in the order the planner turns them on (each holds less and costs more)
MODES: tuple[Recompute, ...] = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
#: full recompute without a measured ``recompute_activation``: the input's share of a transformer layer's
#: activations (2sbh of 34sbh bytes; Korthikanti et al. 2022, §4.1)
INPUT_SHARE = 2 / 34
#: selective recompute without a measured ``selective_activation``: share of the activation
#: beyond full recompute's still held (an assumption, see the docstring)
SELECTIVE_KEPT = 0.5
#: selective recompute without a measured ``selective_recompute``: share of the recompute time
#: paid (an assumption, see the docstring)
SELECTIVE_TIME = 0.3


def held_full(layer: LayerCost) -> float:
    """What a fully recomputed layer keeps per micro-batch (GiB): its input (and the loss's
    saved tensors on the last layer), as measured, else ``INPUT_SHARE`` of its activation."""
    kept = layer.recompute_activation
    return min(layer.activation, layer.activation * INPUT_SHARE if kept is None else kept)


def held_selective(layer: LayerCost) -> float:
    """What a layer under selective recompute keeps per micro-batch (GiB), as measured, else
    what full recompute keeps and ``SELECTIVE_KEPT`` of the rest. A measured value may exceed
    the layer's plain activation, and is then kept: where the loss casts the layer's output
    (a language model's head, logits cast to float32 for the softmax) the cached matrix
    product's output is held beside what the loss saves of it."""
    full = held_full(layer)
    kept = layer.selective_activation
    if kept is None:
        return full + (layer.activation - full) * SELECTIVE_KEPT
    return max(full, kept)


def selective_paid(layer: LayerCost) -> float:
    """What selective recompute adds to a layer's backward (ms): as measured, else
    ``SELECTIVE_TIME`` of its full recompute."""
    if layer.selective_recompute is not None:
        return layer.selective_recompute
    return layer.recompute_ms * SELECTIVE_TIME


def recomputed_layer(layer: LayerCost, mode: Recompute, split: bool = False) -> LayerCost:
    """``layer``'s costs when its stage runs ``mode``, its backward whole in ``I`` or, with
    ``split`` (a captured step), split as a plain layer's (module docstring)."""
    if mode is Recompute.NONE:
        return layer
    if mode is Recompute.FULL:
        kept, paid, bookkeeping = held_full(layer), layer.recompute_ms, layer.recompute_forward
    else:
        kept, paid, bookkeeping = (
            held_selective(layer),
            selective_paid(layer),
            layer.selective_forward,
        )
    dropped = max(0.0, layer.activation - kept)
    whole = layer.backward + paid
    if split and layer.backward_input is not None:
        return dataclasses.replace(
            layer,
            forward=layer.forward + (bookkeeping or 0.0),
            backward=whole,
            backward_input=layer.backward_input + paid,
            activation=kept,
            workspace=layer.workspace + dropped,
        )
    return dataclasses.replace(
        layer,
        **_issue_under_recompute(layer, bookkeeping or 0.0, paid),
        forward=layer.forward + (bookkeeping or 0.0),
        backward=whole,
        # the whole backward in I, nothing left for W (module docstring)
        backward_input=None if layer.backward_input is None else whole,
        backward_weight=None if layer.backward_weight is None else 0.0,
        activation=kept,
        activation_for_weight=0.0,
        workspace=layer.workspace + dropped,
    )


def layers_under(
    layers: Sequence[LayerCost],
    recompute: StageRecompute | Recompute,
    start: int,
    num_layers: int,
    split: bool = False,
) -> list[LayerCost]:
    """``layers`` (the model's layers ``start``, ``start + 1``, ... of ``num_layers``) when their
    stage recomputes as ``recompute`` says: each recomputing layer as ``recomputed_layer``
    says. The model's last layer stays plain under selective recompute
    (``StageRecompute.layer_modes``, the rule the runtime's ``recompute_stage`` applies too). A
    plain layer beside recomputing ones has its
    backward run whole in ``I`` with theirs (``backward_whole``); a stage where nothing
    recomputes is a stage of ordinary layers. With ``split`` (a captured step) the backward
    splits as without recompute, plain layers unchanged."""
    spec = recompute if isinstance(recompute, StageRecompute) else StageRecompute(recompute)
    if spec.mode is Recompute.WHOLE:
        if split:
            raise ValueError(
                "a stage recomputed as a whole cannot run in a captured step (the recompute "
                "restores the forward's random state, which a CUDA graph cannot); recompute its "
                "layers ('full' or 'selective') instead"
            )
        return whole_stage(layers)
    modes = spec.layer_modes(len(layers), ends_model=start + len(layers) == num_layers)
    if all(m is Recompute.NONE for m in modes):
        return list(layers)
    if split:
        return [recomputed_layer(layer, m, split=True) for layer, m in zip(layers, modes)]
    return [
        backward_whole(layer) if m is Recompute.NONE else recomputed_layer(layer, m)
        for layer, m in zip(layers, modes)
    ]


def beside_later_layers(stage: Sequence[LayerCost]) -> float:
    """What a stage's ``F``, ``B`` or ``I`` uses beyond the micro-batch's whole activation, which
    the simulator holds from the forward's start to the backward's end: a layer's temporaries
    come while the layers before it hold their activation and the layers after it hold nothing
    yet (forward) or nothing any more (backward), so each counts less the activation of the
    layers after it (a first layer's large temporary, an embedding's dense weight gradient, meets
    little); the largest, at least 0. ``W`` meets only what it still needs: there every layer's
    whole temporary counts (``weight_workspace``)."""
    out = after = 0.0
    for layer in reversed(stage):
        out = max(out, layer.workspace - after)
        after += layer.activation
    return out


def whole_stage(layers: Sequence[LayerCost]) -> list[LayerCost]:
    """A stage recomputed as one region (``runtime.backward.whole_stage_recompute``): between its
    forward and its backward a micro-batch holds only the stage's input (the first layer's
    ``held_full``); the first backward piece (``B`` or ``I``) runs every layer's forward again,
    with autograd as the forward ran (``forward`` ms each, host and device as the forward's: no
    checkpoint bookkeeping, so not the per-layer ``recompute``) and holds the
    stage's whole activation for that micro-batch while it runs, beside the temporaries a plain
    stage's backward meets (``beside_later_layers``): both on the first layer's workspace, which
    ``beside_later_layers`` then counts whole (the later layers hold nothing). The backward
    splits as a plain stage's, ``W`` holding and using what it does there (``judge.stage_costs``
    reads a whole stage's ``W`` workspace off its plain layers). ``F`` is priced as the forward
    with autograd, though it runs without: an upper bound."""
    if not layers:
        return []
    held = held_full(layers[0])
    recomputing = sum(layer.activation for layer in layers) - held + beside_later_layers(layers)
    out = []
    for k, layer in enumerate(layers):
        paid = layer.forward
        out.append(
            dataclasses.replace(
                layer,
                **_issue_recomputed_in_input(layer, paid),
                backward=layer.backward + paid,
                backward_input=None
                if layer.backward_input is None
                else layer.backward_input + paid,
                activation=held if k == 0 else 0.0,
                activation_for_weight=layer.activation
                if layer.activation_for_weight is None
                else layer.activation_for_weight,
                workspace=max(layer.workspace, recomputing) if k == 0 else layer.workspace,
            )
        )
    return out


def _issue_recomputed_in_input(layer: LayerCost, paid: float) -> dict[str, Any]:
    """Host and device times of a layer whose forward runs again at the start of its ``I`` (or
    ``B``): ``paid`` ms shared as its forward's wall time is; {} where it has none."""
    if not layer.has_issue_times:
        return {}
    out: dict[str, Any] = {}
    for worker in ("host", "device"):
        own = getattr(layer, f"{worker}_forward")
        extra = paid * (own / layer.forward if layer.forward > 0 else 1.0)
        out[f"{worker}_backward"] = getattr(layer, f"{worker}_backward") + extra
        if layer.split_backward:
            out[f"{worker}_backward_input"] = getattr(layer, f"{worker}_backward_input") + extra
    return out


def raised(mode: Recompute) -> int:
    """How far ``mode`` raises a stage's recompute, for ranking plans of equal speed (less
    first): the search's order, a stage recomputed as a whole ranking with full recompute."""
    return MODES.index(mode) if mode in MODES else MODES.index(Recompute.FULL)


def backward_whole(layer: LayerCost) -> LayerCost:
    """A plain layer in a recomputing stage: the runtime runs that stage's backward whole in
    ``I`` (module docstring), this layer's included, so nothing of it waits for ``W``."""
    return dataclasses.replace(
        layer,
        **_issue_under_recompute(layer, 0.0, 0.0),
        backward_input=None if layer.backward_input is None else layer.backward,
        backward_weight=None if layer.backward_weight is None else 0.0,
        activation_for_weight=0.0,
    )


def _issue_under_recompute(layer: LayerCost, bookkeeping: float, paid: float) -> dict[str, Any]:
    """The host and device times of ``layer`` in a recomputing stage (module docstring):
    ``bookkeeping`` ms more on the host's forward, ``paid`` ms of recompute in the whole backward
    (all in ``I``), shared as the forward's wall time is; {} where the layer has none."""
    if not layer.has_issue_times:
        return {}
    out: dict[str, Any] = {}
    for worker in ("host", "device"):
        own = getattr(layer, f"{worker}_forward")
        share = own / layer.forward if layer.forward > 0 else 1.0
        whole = getattr(layer, f"{worker}_backward") + paid * share
        out[f"{worker}_backward"] = whole
        if layer.split_backward:
            out[f"{worker}_backward_input"], out[f"{worker}_backward_weight"] = whole, 0.0
    out["host_forward"] = layer.host_forward + bookkeeping  # type: ignore[operator]
    return out


def recomputed_costs(costs: ModelCosts, mode: Recompute) -> ModelCosts:
    """Every layer of ``costs`` under one mode (for the cut searches' weights and memory caps)."""
    if mode is Recompute.NONE:
        return costs
    layers = layers_under(costs.layers, mode, 0, costs.num_layers, costs.captured)
    return dataclasses.replace(costs, layers=tuple(layers))


def uniform(mode: Recompute, num_stages: int) -> tuple[Recompute, ...]:
    return (mode,) * num_stages
