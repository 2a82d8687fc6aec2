"""Auxiliary-loss-free load balancing: each router's per-expert bias, moved after every optimizer
step towards the experts that received fewer tokens than the mean.

DeepSeek-V3 (arXiv 2412.19437, §2.1.2; Wang et al. 2024, arXiv 2408.15664) balances its experts
without a loss term: a bias ``b_e`` is added to each expert's affinity for the top-k choice only
(the gating weights use the unbiased affinities), and "at the end of each step" the bias of an
overloaded expert decreases by ``γ``, that of an underloaded one increases by ``γ`` (the "bias
update speed"; 0.001 for most of its training). ``transformers`` holds that bias as the router's
persistent buffer ``e_score_correction_bias`` but never moves it; torchtitan moves its
``expert_bias`` in a hook after the optimizer step (``load_balance_coeff``). This module does the
same for ``pipetrain.hf``'s layers:

* ``ExpertLoad`` counts, while its decoder layer runs, the tokens its router sends to each
  expert. It counts each micro-batch once: only forwards that build a graph and do not run inside
  a backward count, so a per-layer checkpoint's recompute (inside the backward) and a stage
  recomputed as a whole (its gradient-free forward does not count, its recompute does) add
  nothing twice, and an evaluation under ``torch.no_grad`` adds nothing. Padding tokens (0 in a
  ``(rows, T)`` attention mask) are not counted: they carry no data, and where they fall (left
  or right padding) would otherwise move the bias.
* ``update_expert_biases`` sums each layer's counts over the step's micro-batches (they
  accumulate) and over the data-parallel group given (one all-reduce for every layer of the
  stage; the expert-parallel group joins it once experts are sharded: it is an argument), then
  moves every bias by ``rate · sign(mean load − load)``, centred. Centred as torchtitan does
  (the step's mean removed): adding one constant to every bias changes neither the top-k choice
  nor the group-limited choice (each group's score is a sum of two biased affinities, so every
  group moves alike), so the routing is the uncentred rule's exactly, and the biases keep a mean
  of zero instead of drifting by ``rate`` every step an expert sits at the mean (a drifting
  float32 buffer would lose the ``rate``-sized steps to rounding). The load comparison is made
  in integers (``Σ loads − E · load``), so ties with the mean are exact.

The counts live outside the module's state (not buffers): they are a step's scratch, in no
checkpoint, and the bias itself is the persistent buffer every checkpoint and export carries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.runtime import torch_compat

#: the bias buffer of DeepSeek-V3's router (``DeepseekV3TopkRouter``) in ``transformers``
BIAS = "e_score_correction_bias"
#: DeepSeek-V3's bias update speed γ for most of its pre-training (§4.2)
PAPER_RATE = 0.001


class ExpertLoad:
    """Counts the tokens ``router`` sends to each expert while ``counting`` (a forward hook on
    the router; ``indices_at``: where the router's output holds the chosen experts,
    ``(tokens, top_k)``). ``bias`` is the router's buffer ``update_expert_biases`` moves;
    ``name`` the layer's global name, by which loads are reported and ordered."""

    def __init__(self, router: nn.Module, name: str, indices_at: int = 2, bias: str = BIAS) -> None:
        self.router = router
        #: the layer's name in the model (``model.layers.3``): the same on every replica
        self.name = name
        self.bias_name = bias
        self.num_experts = int(getattr(router, bias).numel())
        self.indices_at = indices_at
        #: tokens per expert since the last update (``None``: none counted yet)
        self.counts: torch.Tensor | None = None
        self._keep: torch.Tensor | None = None
        self._armed = False
        router.register_forward_hook(self._count)

    @property
    def bias(self) -> torch.Tensor:
        return getattr(self.router, self.bias_name)

    @contextlib.contextmanager
    def counting(self, attention_mask: torch.Tensor | None) -> Iterator[None]:
        """Count the router's choices during the block, tokens weighed by ``attention_mask``
        (``(rows, T)``, 0 for padding; ``None``: every token). Not inside a backward (a
        checkpoint's recompute) nor without autograd (module docstring)."""
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                f"the expert load counts the tokens of a (rows, T) attention_mask; got one of "
                f"shape {tuple(attention_mask.shape)}, which does not say which tokens are "
                "padding: pass the 2-D 0/1 mask"
            )
        armed = torch.is_grad_enabled() and not torch_compat.in_backward()
        self._armed = armed
        self._keep = None if attention_mask is None else attention_mask.reshape(-1) != 0
        try:
            yield
        finally:
            self._armed, self._keep = False, None

    def _count(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._armed:
            return
        chosen = output[self.indices_at].detach()
        ones = torch.ones_like(chosen, dtype=torch.int64)
        if self._keep is not None:
            if self._keep.numel() != chosen.shape[0]:
                raise ValueError(
                    f"the attention mask marks {self._keep.numel()} tokens but the router saw "
                    f"{chosen.shape[0]}; give the micro-batch's own (rows, T) mask"
                )
            ones = ones * self._keep.to(chosen.device, torch.int64).unsqueeze(-1)
        if self.counts is None or self.counts.device != chosen.device:
            self.counts = torch.zeros(self.num_experts, dtype=torch.int64, device=chosen.device)
        # index_add_, not bincount: no wait for the device (bincount sizes its output on the host)
        self.counts.index_add_(0, chosen.reshape(-1), ones.reshape(-1))

    def reset(self) -> None:
        """Forget what was counted (a step whose update was skipped)."""
        self.counts = None


def expert_loads(modules: nn.Module | Iterable[nn.Module]) -> dict[str, ExpertLoad]:
    """Every ``ExpertLoad`` in ``modules`` (a stage, a pipeline's ``modules.values()``, layers),
    by the global name of the layer that holds it, in name order (the same on every replica)."""
    if isinstance(modules, nn.Module):
        modules = [modules]
    found: dict[str, ExpertLoad] = {}
    for module in modules:
        for sub in module.modules():
            load = getattr(sub, "expert_load", None)
            if isinstance(load, ExpertLoad):
                if found.setdefault(load.name, load) is not load:
                    raise ValueError(f"two expert load counters are named {load.name!r}")
    return dict(sorted(found.items()))


@torch.no_grad()
def update_expert_biases(
    modules: nn.Module | Iterable[nn.Module], rate: float, group: Any = None
) -> dict[str, torch.Tensor]:
    """After an optimizer step: every layer's counted loads summed over ``group`` (a process
    group: data parallel, and expert parallel once it exists; ``None``: this process alone),
    each router's bias moved by ``rate · sign(mean − load)`` centred (module docstring), the
    counts cleared. Returns each layer's summed loads (``(E,)`` int64, by layer name). Every
    process of ``group`` must call it with the same layers (replicas of the same stages) and
    ``rate``. ``rate=0`` only clears the counts."""
    if not rate >= 0 or rate == float("inf"):
        raise ValueError(f"the expert bias rate must be a finite number >= 0, got {rate}")
    loads = expert_loads(modules)
    if not loads:
        return {}
    if rate == 0:
        for load in loads.values():
            load.reset()
        return {}
    device = next(iter(loads.values())).bias.device
    counts = torch.stack(
        [
            load.counts.to(device)
            if load.counts is not None
            else torch.zeros(load.num_experts, dtype=torch.int64, device=device)
            for load in loads.values()
        ]
    )
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    out = {}
    for (name, load), count in zip(loads.items(), counts, strict=True):
        bias = load.bias
        sign = torch.sign(count.sum() - load.num_experts * count).to(bias.dtype)
        step = rate * sign
        bias.add_(step - step.mean())
        load.reset()
        out[name] = count
    return out


def reset_expert_loads(modules: nn.Module | Iterable[nn.Module]) -> None:
    """Forget every layer's counts (a step whose optimizer update was skipped)."""
    for load in expert_loads(modules).values():
        load.reset()
