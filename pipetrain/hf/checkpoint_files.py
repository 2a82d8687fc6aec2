"""The safetensors files of a Hugging Face model folder: which file holds which tensor, reading
one tensor at a time, and writing a rank's shard and the index.

A folder holds ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
(``weight_map``: tensor name → file). Other weight formats (``pytorch_model.bin``) are refused:
reading them means unpickling whole files, not the tensors a rank needs.

Each tensor is read with its own ``safe_open``: the file is memory-mapped, and the pages a read
touches stay resident, counted in the process's memory, until the mapping is closed — so reading
a rank's tensors from one open file would hold a second copy of them. One tensor per open keeps a
rank's host memory at its own layers plus the tensor being copied.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipetrain.hf.folder_check import INDEX

#: safetensors' dtype names for the floating types a model is stored in
FLOATING = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


@dataclass(frozen=True)
class ModelFiles:
    """A model folder's tensors: name → the file (in ``folder``) that holds it."""

    folder: Path
    where: Mapping[str, str]
    #: each tensor's shape, from its file's header
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def open(cls, folder: str | Path) -> ModelFiles:
        """The folder's tensors, every safetensors file's header and size and the index checked
        first (``folder_check``: a ``ValueError`` naming the file at fault)."""
        from pipetrain.hf.folder_check import folder_tensors

        path = require_folder(folder)
        where, entries = folder_tensors(path)
        return cls(path, where, {n: e.shape for n, e in entries.items()})

    def key_for(self, name: str, source: str | None, prefix: str) -> str:
        """The file's key for parameter ``name``: ``source`` instead where ``name`` is tied to
        it (the file may lack the tied copy), either without the base model's ``prefix``
        (checkpoints of the bare model, such as GPT-2's, name ``h.0...`` for
        ``transformer.h.0...``). A ``KeyError`` names what was looked for."""
        candidates = [source if source is not None else name]
        if prefix and candidates[0].startswith(prefix + "."):
            candidates.append(candidates[0][len(prefix) + 1 :])
        for key in candidates:
            if key in self.where:
                return key
        raise KeyError(
            f"{self.folder} holds no tensor {name!r} (looked for {', '.join(candidates)}); is it "
            "a checkpoint of this model? pipetrain.hf loads tensors under the model's own names"
        )

    def read(self, key: str) -> torch.Tensor:
        """One tensor, on the CPU (see the module docstring for why one open per tensor)."""
        from safetensors import safe_open

        with safe_open(str(self.folder / self.where[key]), framework="pt", device="cpu") as f:
            return f.get_tensor(key)

    def stored_dtype(self) -> torch.dtype | None:
        """The dtype of the first floating tensor stored (``None`` if there is none)."""
        from safetensors import safe_open

        for file in dict.fromkeys(self.where.values()):
            with safe_open(str(self.folder / file), framework="pt") as f:
                for key in f.keys():
                    dtype = FLOATING.get(f.get_slice(key).get_dtype())
                    if dtype is not None:
                        return dtype
        return None


def require_folder(folder: str | Path) -> Path:
    """``folder`` as a path, or a ``FileNotFoundError`` where it is not a local folder (before
    ``transformers`` would take its name for a model to download)."""
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{folder} is not a folder; pipetrain.hf.from_pretrained reads a local model "
            "folder (config.json and safetensors files; download it first)"
        )
    return path


def shard_name(number: int, count: int) -> str:
    """``transformers``' name for shard ``number`` (from 1) of ``count``."""
    return f"model-{number:05d}-of-{count:05d}.safetensors"


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write one safetensors file; a failed write (a full disk) is an ``OSError`` with its errno
    and ``path`` (safetensors raises its own error, the errno only in its text)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        found = re.search(r"os error (\d+)", str(e))
        number = int(found.group(1)) if found else errno.EIO
        raise OSError(number, os.strerror(number), str(path)) from None


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
