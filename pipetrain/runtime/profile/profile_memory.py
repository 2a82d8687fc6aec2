"""What a profiled layer holds in memory: the tensors its forward saves for its backward
(``saved_tensors_hooks``), with the layer checkpointed as a plan's recompute runs it, and its
static bytes (parameters, gradients, optimizer state) — the profiler's memory half
(``runtime.profile.profile_layers`` times the layers and writes the costs file).
"""

from __future__ import annotations

import torch
from torch import nn

from pipetrain.runtime import torch_compat
from pipetrain.runtime.backward.activation_checkpoint import Recomputed
from pipetrain.runtime.named_layers import Stage
from pipetrain.runtime.stage import StageRunner

GIB = float(1 << 30)
#: optimizer states per parameter element
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0, "none": 0}
#: parameter-sized temporaries the optimizer's update allocates while it runs: torch's default
#: multi-tensor AdamW and Adam make the denominator (the square root of the second moments) for
#: every parameter at once; SGD, with or without momentum, updates in place. A fused
#: (``fused=True``) update allocates none: there the count is an upper bound
OPTIMIZER_TEMPORARIES = {"adamw": 1, "adam": 1, "sgd-momentum": 0, "sgd": 0, "none": 0}


def checkpointed_bytes(
    index: int, layer: nn.Module, is_last: bool, loss_fn, args, target, mode: str
) -> int:
    """What one micro-batch's forward holds with ``layer`` recomputed as ``mode``, the loss
    included on the last layer: the ``saved_tensors_hooks`` count, as for ``activation``, and
    under selective recompute the outputs it caches (the saved ops', counted at dispatch)."""
    stage = Stage([("layer", Recomputed(layer, mode))])
    runner = StageRunner(index, stage, is_last, loss_fn if is_last else None)
    runner.begin_step()
    saved = SavedBytes(stage)
    cached = torch_compat.saved_by_selective_recompute() if mode == "selective" else []
    with (
        torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack),
        torch_compat.count_output_bytes(cached) as outputs,
    ):
        runner.forward(0, args, target, 1.0)  # the runner and what it holds go with this call
    return saved.bytes + outputs[0]


class SavedBytes:
    """Counts the distinct storages a forward saves for backward, parameters excluded."""

    def __init__(self, module: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.seen: set[tuple[int, torch.device]] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if storage.data_ptr() not in self.params and key not in self.seen:
            self.seen.add(key)
            self.bytes += storage.nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def static_bytes(layer: nn.Module, seen: set[int], states: int) -> tuple[int, int]:
    """Bytes of the layer's parameters with their gradients and ``states`` optimizer states
    (trainable ones), and of its trainable parameters alone; a parameter ``seen`` before counts
    on its first layer only."""
    total = trained = 0
    for p in layer.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        size = p.numel() * p.element_size()
        total += size * (1 + (1 + states if p.requires_grad else 0))
        trained += size if p.requires_grad else 0
    return total, trained
