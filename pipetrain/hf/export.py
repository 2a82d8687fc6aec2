"""``save_pretrained``: a trained pipeline written back as a Hugging Face model folder.

    pipetrain.hf.save_pretrained(pipe, "out")     # every rank of the pipeline (and its replicas)

Collective. Each pipeline rank writes its own stages' tensors, by global name, to one shard
(``model-0000k-of-0000N.safetensors``, numbered over the ranks that hold any), and pipeline rank
0 writes ``model.safetensors.index.json`` and ``config.json``; the folder loads with
``transformers``' ``from_pretrained`` and ``pipetrain.hf.from_pretrained`` alike. As there, a
tied head is not written (it is the embedding), non-persistent buffers are not either, and a
tensor several ranks hold (a tied replica under one name) is written once, by the lowest.

With data parallel (``Pipeline(mesh=..., data_parallel=...)``) every process calls: under FSDP2
each replica's shards are gathered into whole tensors (an all-gather per tensor over the
data-parallel group), and only the first replica writes. The config comes from stages built by
``pipetrain.hf.from_pretrained`` (``Stage.hf_config``), or ``config=`` — the model's config when
the stages were cut from a model in memory.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipetrain.hf import checkpoint_files
from pipetrain.hf.causal_lm import tied_weights
from pipetrain.runtime.comm.barrier import barrier


def save_pretrained(pipe: Any, out_dir: str | Path, *, config: Any = None) -> None:
    """Write ``pipe``'s model to ``out_dir`` as ``transformers`` does (see the module
    docstring); returns once every rank's file is written. ``config``: the model's
    ``transformers`` config where the stages do not carry one."""
    config = _config_of(pipe, config)
    out = Path(out_dir)
    mesh = pipe.mesh_groups
    # data- and tensor-parallel ranks hold the same whole tensors: coordinate 0 of each writes
    first_replica = mesh is None or not any(mesh.coordinates.values())
    skipped = {target for _, target in _tied_pairs(config)}
    tensors = _whole_tensors(pipe, skipped, keep=first_replica)
    mine = {n: (t.numel() * t.element_size(), t.dtype) for n, t in tensors.items()}
    held: list[dict[str, tuple[int, torch.dtype]]] = [mine]
    if pipe.world_size > 1:
        held = [{} for _ in range(pipe.world_size)]
        dist.all_gather_object(held, mine, group=pipe.group)
    owner: dict[str, int] = {}  # each name written once, by the lowest rank holding it
    for rank, names in enumerate(held):
        for name in names:
            owner.setdefault(name, rank)
    writers = sorted(set(owner.values()))
    files = {r: checkpoint_files.shard_name(i + 1, len(writers)) for i, r in enumerate(writers)}
    if first_replica:
        out.mkdir(parents=True, exist_ok=True)
        ours = {n: t for n, t in tensors.items() if owner[n] == pipe.rank}
        if ours:
            checkpoint_files.write_shard(out / files[pipe.rank], ours)
        if pipe.rank == 0:
            sizes = {n: held[r][n] for n, r in owner.items()}
            weight_map = {n: files[r] for n, r in owner.items()}
            checkpoint_files.write_index(out, weight_map, sum(b for b, _ in sizes.values()))
            _write_config(config, out, {d for _, d in sizes.values() if d.is_floating_point})
    if pipe.world_size > 1:
        barrier(pipe.group)  # every shard is written before any rank returns
    for group in mesh.groups.values() if mesh is not None else ():
        barrier(group)


def _write_config(config: Any, out: Path, floating: set[torch.dtype]) -> None:
    """``config.json``, its ``dtype`` the stored tensors' (``transformers`` loads that by
    default)."""
    saved = copy.deepcopy(config)
    if len(floating) == 1:
        saved.dtype = next(iter(floating))
    saved.save_pretrained(out)


def _config_of(pipe: Any, config: Any) -> Any:
    if config is not None:
        return config
    found = [getattr(m, "hf_config", None) for m in pipe.modules.values()]
    if any(c is None for c in found):
        raise ValueError(
            "the stages carry no transformers config (they were not built by "
            "pipetrain.hf.from_pretrained); pass config=model.config"
        )
    return found[0]


def _tied_pairs(config: Any) -> list[tuple[str, str]]:
    """The (source, target) names the model of ``config`` ties (a meta-device build)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return tied_weights(model)


@torch.no_grad()
def _whole_tensors(pipe: Any, skipped: set[str], keep: bool) -> dict[str, torch.Tensor]:
    """This rank's tensors by global name, whole and on the CPU (none where ``keep`` is false:
    a later data-parallel replica takes part in the gathers only)."""
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in pipe.state_dict().items():
        if name in skipped:
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()  # collective over the replicas, same order on each
        if not keep:
            continue
        value = tensor.detach().to("cpu").contiguous()
        if value.untyped_storage().data_ptr() in storages:
            value = value.clone()  # safetensors refuses tensors that share memory
        storages.add(value.untyped_storage().data_ptr())
        out[name] = value
    return out
