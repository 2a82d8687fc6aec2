"""The costs file's mixture-of-experts fields (version 3, optional) and how they price a stage's
expert all-to-all.

Per layer, ``dispatched_bytes``: the bytes the layer's token dispatch moves over the
expert-parallel link per micro-batch on each rank (its tokens' hidden states sent to the experts
their router picked on other ranks: tokens × top-k × hidden × bytes per element, less what stays
local); 0 or absent for a dense layer. Per file, ``ep_link_gbs``: the GB/s each rank sends at
over that link (what ``pipetrain profile --ep E`` measures on a group of E processes, with the
bytes, where it runs one; ``--ep-link-gbs`` on ``plan`` and ``simulate`` gives or overrides
it). Without a link speed nothing is priced: one rank holds every expert and there is no
all-to-all.

A layer's forward waits for a dispatch and a combine (the experts' outputs sent back: the same
tokens and width, so the same bytes), and its backward for their gradients (the same bytes
again, in the other direction): ``all_to_all_ms`` each way. The simulator sums them per stage
(``sim.costs``: ``all_to_all``), a lone action waiting for its own and an overlapped F&B pair
hiding each half's under the other's compute (``sim.costs.overlapped_pair``). The numbers are
bandwidth terms only: the all-to-all's latency and its imbalance between ranks (a hot expert) are
not modelled, so a measured ``forward_backward`` or a measured step is the check.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from pipetrain.planner.costs_file import LayerCost, ModelCosts

#: dispatch and combine: each moves the layer's dispatched bytes
TRANSFERS_PER_PASS = 2


def all_to_all_ms(dispatched_bytes: float, link_gbs: float) -> float:
    """A layer's all-to-all time per micro-batch in one pass (ms): its dispatch and its combine,
    each ``dispatched_bytes`` at ``link_gbs`` GB/s (10⁹ bytes per second)."""
    return TRANSFERS_PER_PASS * dispatched_bytes / (link_gbs * 1e6)


def stage_all_to_all_ms(costs: ModelCosts, layers: Sequence[LayerCost]) -> float:
    """The expert all-to-all of a stage of ``layers`` per micro-batch in the forward (ms; the
    backward moves the same again): 0 without ``costs.ep_link_gbs``."""
    link = costs.ep_link_gbs
    return sum(all_to_all_ms(x.dispatched_bytes or 0.0, link) for x in layers) if link else 0.0


def has_experts(costs: ModelCosts) -> bool:
    """Whether some layer of ``costs`` dispatches tokens (``dispatched_bytes`` > 0)."""
    return any(layer.dispatched_bytes for layer in costs.layers)


def with_ep_link(costs: ModelCosts, link_gbs: float | None) -> ModelCosts:
    """``costs`` with ``link_gbs`` (``--ep-link-gbs``; None: the file's) as its expert link;
    ``ValueError`` where a link is given for a model without experts (it would price nothing)."""
    if link_gbs is None:
        return costs
    if not has_experts(costs):
        raise ValueError(
            "--ep-link-gbs: no layer of the costs file has dispatched_bytes (a dense model has no "
            "expert all-to-all); drop the flag, or profile the mixture-of-experts model"
        )
    return dataclasses.replace(costs, ep_link_gbs=link_gbs)


def unpriced_note(costs: ModelCosts) -> str:
    """What to say where the costs give dispatched bytes but no link to price them at."""
    if costs.ep_link_gbs is None and has_experts(costs):
        return (
            "the costs file gives dispatched_bytes but no ep_link_gbs: the expert all-to-all is "
            "not priced (give --ep-link-gbs GB/s to plan expert parallel)"
        )
    return ""


def dispatched_bytes(tokens: int, top_k: int, hidden: int, element_size: int, ep: int) -> float:
    """A layer's ``dispatched_bytes`` at expert-parallel degree ``ep``: each of ``tokens`` sent to
    its ``top_k`` experts as ``hidden`` values of ``element_size`` bytes, the share
    ``(ep - 1) / ep`` of those copies crossing to another rank (the experts spread evenly over
    the ranks and the routing balanced: what a balancing loss or bias aims at)."""
    if ep < 1:
        raise ValueError(f"--ep must be >= 1, got {ep}")
    return tokens * top_k * hidden * element_size * (ep - 1) / ep


def with_dispatch(
    costs: ModelCosts,
    per_layer: Mapping[int, float],
    ep: int,
    link_gbs: float | None,
    how: Mapping[str, object],
) -> ModelCosts:
    """``costs`` with ``per_layer`` dispatched bytes (by layer index), ``link_gbs`` as the expert
    link where given, and ``meta["ep"]``: the degree and ``how`` (each value measured, derived
    or given, as ``pipetrain profile --ep`` had it)."""
    layers = tuple(
        dataclasses.replace(x, dispatched_bytes=per_layer[i]) if i in per_layer else x
        for i, x in enumerate(costs.layers)
    )
    meta = {**costs.meta, "ep": {"degree": ep, **how}}
    link = costs.ep_link_gbs if link_gbs is None else link_gbs
    return dataclasses.replace(costs, layers=layers, ep_link_gbs=link, meta=meta)
