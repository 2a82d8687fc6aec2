"""The profiler's tensor-parallel entries: each layer at each degree of ``pipetrain profile --tp``,
measured on a group of that many processes where the machine can run one
(``profile_tp_measured``, handed in as ``measured``), else derived from what one process
measures of the layer (``planner.costs_file_tp.derive`` states the model).

Per layer this measures, on one forward at degree 1 (``TpShape``):

* its matrix products' time: every ``nn.Linear`` the forward calls is timed alone on an input of
  the shape it saw (``F.linear``, back to back, the median of ``repeats`` rounds) — the part of the
  layer tensor parallel divides;
* its collectives' bytes, by Megatron-LM's split (Shoeybi et al., 2019): a row-split product
  (``ROW_SPLIT``: attention's output projection, the MLP's down projection) closes a parallel
  region whose output is all-reduced in the forward and whose input gradient is all-reduced in
  the backward; a head (a product named as one, ``HEAD_NAMES``, or to more than ``HEAD_WIDTH`` × the
  hidden size: the vocabulary)
  is split by columns, its logits gathered in the forward and its input gradient all-reduced in
  the backward; the largest ``nn.Embedding`` is split by vocabulary rows, its output all-reduced
  in the forward;
* which parameters split (every product's weight, the largest embedding) and which saved
  tensors split: those whose last dimension is not the hidden size (heads, MLP features, logits);
  those of the hidden size (norms' inputs, the residual stream) stay whole, as without sequence
  parallel.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.planner.costs_file import ModelCosts
from pipetrain.planner.costs_file_tp import TpCost, TpShape, derive
from pipetrain.runtime.profile.profile_clock import Clock

#: the last name of a product that closes a parallel region (Llama's, GPT-2's, the built-in
#: GPT's, Falcon's and Mixtral's names)
ROW_SPLIT = ("o_proj", "down_proj", "proj", "c_proj", "out_proj", "dense_4h_to_h", "fc2", "w2")
#: a product wider than this many hidden sizes, or of one of these names, is a head over the
#: vocabulary (an MLP's widest product is 8 hidden sizes in the widest families)
HEAD_WIDTH = 8
HEAD_NAMES = ("lm_head", "head", "output")
#: products timed back to back per round
IN_FLIGHT = 4


def with_tp(
    costs: ModelCosts,
    layers: Sequence[nn.Module],
    sample_input: tuple[torch.Tensor, ...],
    degrees: Sequence[int],
    link_gbs: float | None,
    repeats: int = 5,
    measured: Mapping[int, Sequence[TpCost]] | None = None,
) -> ModelCosts:
    """``costs`` (the layers' degree-1 profile) with an entry per layer at every degree of
    ``degrees`` above 1: ``measured``'s where it gives the degree (one entry per layer,
    ``profile_tp_measured``), the others derived here, priced at ``link_gbs`` (needed only
    when some degree is derived); ``meta["tp"]`` lists which are which."""
    measured = measured or {}
    extra = sorted({t for t in degrees if t > 1})
    derived = [t for t in extra if t not in measured]
    if not extra:
        return costs
    if derived and link_gbs is None:
        raise ValueError(
            f"tensor-parallel degrees {', '.join(map(str, derived))} are derived: give "
            "--link-gbs to price their collectives"
        )
    for t, entries in measured.items():
        if len(entries) != len(costs.layers) or any(e.degree != t for e in entries):
            raise ValueError(f"measured tensor-parallel degree {t}: one entry per layer needed")
    clock = Clock(sample_input[0].device)
    inputs = sample_input
    out = []
    for n, (layer, cost) in enumerate(zip(layers, costs.layers, strict=True)):
        gradients = costs.gradient_gib(cost)
        tp = {t: entries[n] for t, entries in measured.items()}
        if derived:
            shape, inputs = measure(layer, inputs, clock, repeats, name=cost.name)
            base = {
                "forward": cost.forward,
                "backward_input": cost.backward_input if cost.split_backward else cost.backward / 2,
                "backward_weight": cost.backward_weight
                if cost.split_backward
                else cost.backward / 2,
                "activation": cost.activation,
                "params": cost.params,
                "gradients": gradients,
            }
            assert link_gbs is not None
            tp |= {t: derive(t, **base, shape=shape, link_gbs=link_gbs) for t in derived}  # type: ignore[arg-type]
        out.append(dataclasses.replace(cost, gradients=gradients, tp=tuple(tp[t] for t in extra)))
    meta = {
        **costs.meta,
        "tp": {
            "degrees": [1, *extra],
            "measured": sorted(measured),
            "derived": derived,
            "method": __name__,
        },
    }
    return dataclasses.replace(costs, layers=tuple(out), tp_link_gbs=link_gbs, meta=meta)


def measure(
    layer: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    clock: Clock,
    repeats: int,
    name: str = "",
) -> tuple[TpShape, tuple[torch.Tensor, ...]]:
    """One layer's ``TpShape`` (the module docstring) and its outputs (the next layer's input).
    ``name``: the layer's own name in the model (a layer that is itself a product, such as
    Llama's ``lm_head``, is named by it)."""
    calls: list[tuple[str, nn.Linear, torch.Size, int]] = []
    names = {id(m): n for n, m in layer.named_modules(prefix=name)}

    def seen(module: nn.Module, args: tuple, output: object) -> None:
        if isinstance(module, nn.Linear) and isinstance(output, torch.Tensor):
            calls.append((names.get(id(module), ""), module, args[0].shape, output.nbytes))

    hooks = [m.register_forward_hook(seen) for m in layer.modules() if isinstance(m, nn.Linear)]
    embeddings = [m for m in layer.modules() if isinstance(m, nn.Embedding)]
    largest = max(embeddings, key=lambda m: m.weight.numel(), default=None)
    gathered: list[int] = []
    if largest is not None:
        hooks.append(largest.register_forward_hook(lambda m, a, o: gathered.append(o.nbytes)))
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    try:
        args = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(*args)
    finally:
        for h in hooks:
            h.remove()
    outputs = out if isinstance(out, tuple) else (out,)
    # the residual stream's width: the input's, or an embedding's output's
    hidden = (inputs[0] if inputs[0].is_floating_point() else outputs[0]).shape[-1]
    reduce_fwd = reduce_bwd = gather = 0.0
    for name, module, seen_shape, nbytes in calls:
        last = name.rsplit(".", 1)[-1]
        if module.out_features > HEAD_WIDTH * hidden or last in HEAD_NAMES:  # over the vocabulary
            gather += nbytes
            reduce_bwd += seen_shape.numel() * module.weight.element_size()
        elif last in ROW_SPLIT:
            reduce_fwd += nbytes
            reduce_bwd += nbytes
    reduce_fwd += sum(gathered)
    split = [m.weight for _, m, _, _ in calls] + ([largest.weight] if largest is not None else [])
    split_bytes = sum(p.nbytes for p in {id(p): p for p in split}.values())
    all_bytes = sum(p.nbytes for p in layer.parameters())
    params_id = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    kept = {t.untyped_storage().data_ptr(): t for t in saved if torch.is_tensor(t)}
    kept = {k: t for k, t in kept.items() if k not in params_id}
    saved_bytes = sum(t.untyped_storage().nbytes() for t in kept.values())
    split_saved = sum(
        t.untyped_storage().nbytes() for t in kept.values() if t.dim() and t.shape[-1] != hidden
    )
    measured = TpShape(
        gemm_forward=_gemm_ms([(m, s) for _, m, s, _ in calls], clock, repeats),
        split_params=split_bytes / all_bytes if all_bytes else 0.0,
        split_activation=split_saved / saved_bytes if saved_bytes else 0.0,
        forward_all_reduce=reduce_fwd,
        backward_all_reduce=reduce_bwd,
        forward_all_gather=gather,
    )
    return measured, tuple(o.detach() for o in outputs)


def _gemm_ms(calls: list[tuple[nn.Linear, torch.Size]], clock: Clock, repeats: int) -> float:
    """ms the products take alone, per forward: each on a random input of the shape it saw."""
    if not calls:
        return 0.0
    with torch.no_grad():
        work = [
            (torch.randn(s, dtype=m.weight.dtype, device=m.weight.device), m.weight, m.bias)
            for m, s in calls
        ]

        def run() -> None:
            for _ in range(IN_FLIGHT):
                for x, w, b in work:
                    F.linear(x, w, b)

        run()  # warm-up
        times = [clock.time(run)[0] / IN_FLIGHT for _ in range(repeats)]
    return statistics.median(times)
