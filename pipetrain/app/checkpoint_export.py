"""``pipetrain export``: any complete checkpoint of a ``--model-dir`` run as a Hugging Face folder,
without training, without the original folder and without GPUs.

A checkpoint holds the model's state by global name (``runtime.checkpoint``: ``model.<name>``,
DCP shards of any layout) and copies of the folder's config and tokenizer files (``hf/``,
``app.checkpoints``), each listed in its ``SHA256SUMS``. Exporting verifies every file, reads
the ``model.`` keys into whole CPU tensors in this one process (DCP reassembles each from
whichever ranks' shards hold it, as a resume at another layout does), and writes them as
``--export`` does (``pipetrain.hf.export.write_pretrained``): the same tensors under the same
names, tied copies left out, ``config.json`` with the stored dtype, the tokenizer, ``SHA256SUMS``,
the folder renamed into place when whole.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from pipetrain.app.checkpoints import (
    FOLDER_COPIES,
    LATEST,
    checked_step,
    checkpoint_folders,
    latest_complete,
    latest_pointer,
    make_writable_folder,
)
from pipetrain.app.folder_lock import FolderLock, sibling_lock_file
from pipetrain.app.model_folder import TOKENIZER_FILES
from pipetrain.runtime.checkpoint_disk import PARTIAL


def chosen_checkpoint(given: Path) -> Path:
    """The step folder ``given`` names: itself, or for a checkpoint root (a ``latest`` pointer or
    ``step-*`` folders inside) its latest complete checkpoint that verifies; a ``ValueError``
    naming the folder otherwise."""
    if not given.is_dir():
        raise ValueError(f"--checkpoint {given}: no such folder")
    root = (given / LATEST).exists() or any(
        not p.name.endswith(PARTIAL) for p in checkpoint_folders(given)
    )
    if not root:
        checked_step(given, hashes=True)
        return given
    pointed = latest_pointer(given)
    if pointed is not None and pointed.is_dir():
        try:
            checked_step(pointed, hashes=True)
            return pointed
        except ValueError as e:
            good = latest_complete(given, before=pointed)
            hint = f"; export {good} instead" if good is not None else ""
            raise ValueError(f"{e}{hint}") from None
    good = latest_complete(given)
    if good is None:
        raise ValueError(f"--checkpoint {given} holds no complete checkpoint that verifies")
    return good


def export_checkpoint(checkpoint: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write the checkpoint ``chosen_checkpoint(checkpoint)`` as a Hugging Face folder at ``out``
    (see the module docstring); the step folder exported. ``ValueError`` for a damaged or
    incomplete checkpoint, one without the folder's files, or an ``out`` that is not empty
    (``overwrite`` replaces it)."""
    step = chosen_checkpoint(Path(checkpoint))
    copies = step / FOLDER_COPIES
    if not (copies / "config.json").is_file():
        raise ValueError(
            f"checkpoint {step} has no copy of a model folder's config.json ({copies}): only "
            "checkpoints of `pipetrain train --model-dir` runs export"
        )
    target = Path(out)
    flag = f"--out {target}"
    if target.resolve() == step.resolve() or step.resolve() in target.resolve().parents:
        raise ValueError(f"{flag} is inside the checkpoint: export to another folder")
    make_writable_folder(target, flag)
    if any(target.iterdir()) and not overwrite:
        raise ValueError(
            f"{flag} is not empty; name an empty or new folder, or replace what it holds with "
            "--overwrite"
        )
    config, tokenizer = _folder_files(copies)
    state = read_model_state(step)
    from pipetrain.hf.export import write_pretrained

    with FolderLock(sibling_lock_file(target), flag):
        write_pretrained(state, target, config, tokenizer)
    return step


def read_model_state(step: Path) -> dict[str, Any]:
    """Every ``model.<name>`` tensor of a checkpoint, whole, on the CPU, by its global name."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from pipetrain.runtime.checkpoint import MODEL
    from pipetrain.runtime.checkpoint_disk import read_failure, verify

    stored = verify(step).state_dict_metadata
    state = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in stored.items()
        if key.startswith(MODEL) and isinstance(meta, TensorStorageMetadata)
    }
    if not state:
        raise ValueError(f"checkpoint {step} holds no model tensors (no {MODEL!r} keys)")
    try:
        with warnings.catch_warnings():  # DCP warns that it reads in one process: it should
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=step, no_dist=True)
    except Exception as e:
        raise read_failure(step, e) from None
    return {key[len(MODEL) :]: tensor for key, tensor in state.items()}


def _folder_files(copies: Path) -> tuple[Any, Any]:
    """The model's ``transformers`` config and its tokenizer (None where the folder had none),
    from the checkpoint's copies."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(copies)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{copies / 'config.json'} cannot be read ({e})") from None
    if not any((copies / name).is_file() for name in TOKENIZER_FILES):
        return config, None
    try:
        return config, AutoTokenizer.from_pretrained(copies)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"the tokenizer copied into {copies} cannot be loaded ({e})") from None


__all__ = ["chosen_checkpoint", "export_checkpoint", "read_model_state"]
