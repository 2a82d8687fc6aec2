"""How a mixture-of-experts family's folders store the experts the model holds fused.

``transformers`` 5 holds a layer's experts as two 3-D parameters (``mlp.experts.gate_up_proj``,
``(E, 2·I, H)``: each expert's gate rows then its up rows; ``mlp.experts.down_proj``,
``(E, H, I)``), while released folders — and ``transformers``' own ``save_pretrained``, which
writes the original format by default — keep one 2-D tensor per expert and projection, under the
family's original names (Mixtral: ``block_sparse_moe.experts.3.w1.weight`` for expert 3's gate;
Qwen-MoE: ``mlp.experts.3.gate_proj.weight``). Its loader fuses them (``conversion_mapping``:
``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``); ``pipetrain.hf`` does the same per
tensor, so a rank still reads only its own experts, and writes the original format back on
export. A folder holding the fused names (``save_original_format=False``) loads as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

#: a decoder layer's MoE block, as the model names it
_BLOCK = re.compile(r"(\.layers\.\d+\.)mlp\.")
_FUSED = re.compile(r"^(.*\.layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class StoredExperts:
    """A family's stored names: the MoE block's (``block``) and each expert's projections."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def file_name(self, name: str) -> str:
        """``name`` as the folder calls it (Mixtral's ``mlp`` is ``block_sparse_moe``)."""
        return _BLOCK.sub(rf"\g<1>{self.block}.", name)

    def parts(self, name: str, num_experts: int) -> list[list[str]] | None:
        """For a fused expert parameter, the stored tensors it is made of: one list per
        projection (gate then up, or down), each in expert order; ``None`` for any other."""
        found = _FUSED.match(name)
        if found is None:
            return None
        base = f"{found[1]}{self.block}.experts."
        projections = [self.gate, self.up] if found[2] == "gate_up_proj" else [self.down]
        return [[f"{base}{e}.{p}.weight" for e in range(num_experts)] for p in projections]

    @staticmethod
    def fuse(parts: list[list[torch.Tensor]]) -> torch.Tensor:
        """The fused parameter from its stored tensors (``transformers``' merge, then concat)."""
        return torch.cat([torch.stack(tensors) for tensors in parts], dim=1)

    @staticmethod
    def fused_shape(shapes: list[list[tuple[int, ...]]]) -> tuple[int, ...] | None:
        """The fused parameter's shape from its stored tensors' shapes, ``None`` where they
        cannot be fused (projections of different shapes)."""
        first = shapes[0][0]
        if any(s != first for group in shapes for s in group) or len(first) != 2:
            return None
        return (len(shapes[0]), first[0] * len(shapes), first[1])

    def unfuse(self, tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
        """A state dict with every fused expert parameter split into its stored tensors (fresh
        contiguous copies: safetensors refuses tensors sharing memory) and every name as the
        folder calls it."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            parts = self.parts(name, num_experts)
            if parts is None:
                out[self.file_name(name)] = tensor
                continue
            for names, piece in zip(parts, tensor.chunk(len(parts), dim=1), strict=True):
                for key, one in zip(names, piece.unbind(0), strict=True):
                    out[key] = one.contiguous().clone()
        return out


@dataclass(frozen=True)
class FolderTensors:
    """A model folder's tensors under the model's names: one stored tensor each, or a fused
    expert parameter's stored tensors (where the family has a ``layout``)."""

    files: Any  # checkpoint_files.ModelFiles
    layout: StoredExperts | None = None
    num_experts: int = 0
    #: the base model's prefix, which checkpoints of the bare model leave out
    prefix: str = ""

    def keys(self, name: str, source: str | None = None) -> list[list[str]]:
        """The stored keys ``name`` is read from (``[[key]]`` for a tensor stored whole;
        ``source``: the tensor ``name`` is tied to). A ``KeyError`` names what is missing."""
        try:
            return [[self.files.key_for(name, source, self.prefix)]]
        except KeyError:
            if self.layout is None:
                raise
        parts = self.layout.parts(name, self.num_experts)
        if parts is None:
            renamed = None if source is None else self.layout.file_name(source)
            return [[self.files.key_for(self.layout.file_name(name), renamed, self.prefix)]]
        missing = [k for group in parts for k in group if k not in self.files.where]
        if missing:
            raise KeyError(
                f"{self.files.folder} holds neither {name!r} nor its experts' tensors "
                f"({missing[0]!r} is missing)"
            )
        return parts

    def shape(self, keys: list[list[str]]) -> tuple[int, ...] | None:
        """The stored shape (fused, for a fused parameter); ``None`` where unknown or the
        parts do not fuse."""
        if len(keys) == 1 and len(keys[0]) == 1:
            stored = self.files.shapes.get(keys[0][0])
            return None if stored is None else tuple(stored)
        shapes = [[tuple(self.files.shapes[k]) for k in group] for group in keys]
        return StoredExperts.fused_shape(shapes)

    def read(self, keys: list[list[str]]) -> torch.Tensor:
        """The tensor, fused from its parts where it is stored per expert."""
        if len(keys) == 1 and len(keys[0]) == 1:
            return self.files.read(keys[0][0])
        return StoredExperts.fuse([[self.files.read(k) for k in group] for group in keys])
