"""Which kernel a mixture-of-experts layer's experts run on: a grouped GEMM or a loop over experts,
chosen by a fixed rule from the device and the dtype, never by timing.

``transformers`` 5 decorates its experts classes with ``use_experts_implementation``
(``transformers.integrations.moe``): each experts module reads ``config._experts_implementation``
on every call. Its default is ``"grouped_mm"`` whatever the device (``from_config`` picks it for
any model whose experts carry the decorator). That path sorts the (token, expert) pairs by
expert, runs the gate/up and down projections as one grouped GEMM each over the per-expert
offsets, and un-permutes; the GEMM is ``torch.nn.functional.grouped_mm`` where
``transformers`` thinks the device has one (any CUDA device of compute capability 8.0 or more,
and the CPU from torch 2.9), else its own fallback (``transformers::grouped_mm_fallback``: one
``torch.mm`` per expert's slice of the sorted rows, the same products the loop computes, in a
different order of rows). ``"eager"`` is the per-expert loop: one ``nonzero`` per expert hit, a
gather, two ``linear`` calls and an ``index_add_``. ``"batched_mm"`` gathers every token's
expert weights, a ``(tokens·top_k, 2·I, H)`` tensor (in bf16, for 4,096 tokens, top-8, I 768
and H 2048: 4096·8·1536·2048·2 bytes, 192 GiB), so pipetrain never picks it.

The rule (:func:`experts_implementation`): the grouped GEMM where torch has a real kernel for it,
the loop elsewhere. torch's CUDA kernel (CUTLASS, ``aten/src/ATen/native/cuda/GroupedBlas.cpp``)
is taken for bf16 operands on compute capability 9.0 or more (Hopper, Blackwell); any other
dtype or an older GPU goes to ATen's own fallback, a loop of ``mm`` after copying the offsets
to the host — the loop again, under another name. The CPU kernel takes float32 and bf16 but not
float64 (the exact tests' dtype) and is no faster than the loop there. So: CUDA, bf16, compute
capability ≥ 9.0 and ``grouped_mm`` present → ``"grouped_mm"``; otherwise ``"eager"``. fp16 is
left on the loop on purpose (no CUTLASS path for it). ``"grouped"`` and ``"loop"`` override the
rule (``pipetrain train --experts``); ``"grouped"`` in float64 is refused, since no kernel takes
it. torchtitan (``torchtitan/models/moe``) and Megatron-Core (``GroupedMLP`` /
``TEGroupedMLP``) likewise run experts as grouped GEMMs on Hopper in bf16.

The choice is made per call from the hidden states' device and dtype, by
``router_losses.MoeDecoderLayer``, and handed to the layer's experts through an
:class:`ExpertsSetting` that stands in for their config: each layer carries its own, so two
models (or a float64 reference beside a bf16 run) never share a setting.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: the values of ``pipetrain train --experts`` and of ``MoeDecoderLayer``'s ``experts``
EXPERTS_CHOICES = ("auto", "grouped", "loop")
#: ``transformers``' names of the two implementations pipetrain runs
GROUPED_MM, LOOP = "grouped_mm", "eager"
#: the oldest compute capability with torch's CUTLASS grouped GEMM (Hopper)
MIN_CAPABILITY = (9, 0)


def grouped_kernel_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether torch runs a real grouped GEMM for experts of ``dtype`` on ``device``: CUDA,
    bf16, compute capability 9.0 or more, ``grouped_mm`` in this torch (module docstring)."""
    device = torch.device(device)
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def check_choice(choice: str) -> str:
    """``choice`` if it is one of :data:`EXPERTS_CHOICES`, else a one-line ``ValueError``."""
    if choice not in EXPERTS_CHOICES:
        raise ValueError(
            f"experts={choice!r}; legal: {', '.join(EXPERTS_CHOICES)} (auto: a grouped GEMM on "
            "CUDA bf16 with compute capability >= 9.0, the loop over experts elsewhere)"
        )
    return choice


def experts_implementation(choice: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """``transformers``' experts implementation (``"grouped_mm"`` or ``"eager"``) for experts of
    ``dtype`` on ``device`` under ``choice`` (``"auto"``: the rule of the module docstring;
    ``"grouped"``, ``"loop"``: that one). ``"grouped"`` in float64 is a ``ValueError``."""
    check_choice(choice)
    if choice == "loop":
        return LOOP
    if choice == "grouped":
        if dtype == torch.float64:
            raise ValueError(
                "experts='grouped' in float64: no grouped GEMM takes float64; use 'loop' or "
                "'auto' (the loop, exact)"
            )
        return GROUPED_MM
    return GROUPED_MM if grouped_kernel_available(device, dtype) else LOOP


def describe(choice: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """One line saying which experts kernel runs and why (what a launcher logs once)."""
    device = torch.device(device)
    chosen = experts_implementation(choice, device, dtype)
    name = "grouped GEMM (grouped_mm)" if chosen == GROUPED_MM else "loop over experts (eager)"
    where = f"{device.type} {str(dtype).removeprefix('torch.')}"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where += f", compute capability {major}.{minor}"
    if choice != "auto":
        return f"experts: {name} on {where} (--experts {choice})"
    why = "" if chosen == GROUPED_MM else "; the grouped kernel needs CUDA bf16, capability >= 9.0"
    return f"experts: {name} on {where} (--experts auto{why})"


class ExpertsSetting:
    """What a ``use_experts_implementation`` experts module reads of its config: its own
    ``_experts_implementation``, every other attribute the model config's. One per MoE layer, so
    choosing a layer's kernel changes no config another layer or model reads."""

    def __init__(self, config: Any, implementation: str | None = LOOP) -> None:
        self._config = config
        self._experts_implementation = implementation

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_config":  # copy/pickle probe before __init__
            raise AttributeError(name)
        return getattr(self._config, name)


def own_setting(experts: nn.Module) -> ExpertsSetting:
    """Give ``experts`` (a ``use_experts_implementation`` module) an :class:`ExpertsSetting` of
    its own in place of its config, starting at the config's implementation; return it."""
    config: Any = experts.config
    setting = ExpertsSetting(config, getattr(config, "_experts_implementation", None))
    object.__setattr__(experts, "config", setting)  # a plain attribute, not a submodule
    return setting


def experts_modules(layer: nn.Module) -> list[nn.Module]:
    """The modules in ``layer`` that ``transformers``' ``use_experts_implementation`` decorates
    (they dispatch on ``config._experts_implementation``)."""
    return [
        m
        for m in layer.modules()
        if hasattr(m, "has_gate") and hasattr(m, "is_transposed") and hasattr(m, "config")
    ]


def use_experts(module: nn.Module, choice: str) -> int:
    """Run the experts of every mixture-of-experts layer in ``module`` (a stage, a layer list's
    container, a model's wrapped layers) under ``choice``; how many layers that set. Layers are
    found by their ``experts_choice`` (``router_losses.MoeDecoderLayer``)."""
    check_choice(choice)
    layers = [m for m in module.modules() if hasattr(m, "experts_choice")]
    for layer in layers:
        setattr(layer, "experts_choice", choice)  # noqa: B010 (found by the attribute)
    return len(layers)
