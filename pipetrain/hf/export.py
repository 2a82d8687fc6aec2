"""``save_pretrained``: a trained pipeline written back as a Hugging Face model folder.

    pipetrain.hf.save_pretrained(pipe, "out")     # every rank of the pipeline (and its replicas)

Collective. Each pipeline rank writes its own stages' tensors, by global name, to one shard
(``model-0000k-of-0000N.safetensors``, numbered over the ranks that hold any), and pipeline rank
0 writes ``model.safetensors.index.json`` and ``config.json``; the folder loads with
``transformers``' ``from_pretrained`` and ``pipetrain.hf.from_pretrained`` alike. As there, a
tied head is not written (it is the embedding), non-persistent buffers are not either, and a
tensor several ranks hold (a tied replica under one name) is written once, by the lowest. A
mixture-of-experts family's fused expert parameters are written per expert under the family's
original names, as ``transformers`` writes them (``stored_layout``).

With data parallel (``Pipeline(mesh=..., data_parallel=...)``) every process calls: under FSDP2
each replica's shards are gathered into whole tensors (an all-gather per tensor over the
data-parallel group), and only the first replica writes. The config comes from stages built by
``pipetrain.hf.from_pretrained`` (``Stage.hf_config``), or ``config=`` — the model's config when
the stages were cut from a model in memory.

The folder appears whole or not at all: it is written as ``<out>.partial`` beside it and renamed
into place once every file and ``SHA256SUMS`` (``runtime.checksums``: each shard hashed by the
rank that wrote it) are there, replacing what ``<out>`` held. A failed write (a full disk)
leaves nothing that looks like a model. ``write_pretrained`` writes a whole state dict the same
way from one process (``pipetrain export``, from a checkpoint).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipetrain.hf import checkpoint_files
from pipetrain.hf.families import family_of
from pipetrain.runtime import checksums
from pipetrain.runtime.checkpoint_disk import partial_path, publish, remove
from pipetrain.runtime.comm.barrier import barrier


def save_pretrained(
    pipe: Any, out_dir: str | Path, *, config: Any = None, tokenizer: Any = None
) -> None:
    """Write ``pipe``'s model to ``out_dir`` as ``transformers`` does (see the module
    docstring); returns once the folder is in place. ``config``: the model's ``transformers``
    config where the stages do not carry one. ``tokenizer``: saved beside the weights (its
    ``save_pretrained``), inside the same atomic write. A write that fails on any rank removes
    the unfinished folder on every rank and raises the ``OSError`` (errno and path) on each."""
    config = _config_of(pipe, config)
    final = Path(out_dir)
    partial = partial_path(final)
    mesh = pipe.mesh_groups
    # data- and tensor-parallel ranks hold the same whole tensors: coordinate 0 of each writes
    first_replica = mesh is None or not any(mesh.coordinates.values())
    lead = first_replica and pipe.rank == 0
    groups = ([pipe.group] if pipe.world_size > 1 else []) + (
        list(mesh.groups.values()) if mesh is not None else []
    )
    skipped = {target for _, target in _tied_pairs(config)}
    tensors = family_of(config).file_state(_whole_tensors(pipe, skipped, first_replica), config)
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
    if lead:
        remove(partial)  # what an export killed earlier left
        partial.mkdir(parents=True)
    for group in groups:
        barrier(group)  # the folder is there before any rank writes into it
    failure, sums = None, {}
    if first_replica:
        ours = {n: t for n, t in tensors.items() if owner[n] == pipe.rank}
        try:
            if ours:
                sums = _write_shard(partial, files[pipe.rank], ours)
        except OSError as e:
            failure = e
    everyone = [(sums, _said(failure))]
    if pipe.world_size > 1:
        everyone = [None] * pipe.world_size  # type: ignore[list-item]
        dist.all_gather_object(everyone, (sums, _said(failure)), group=pipe.group)
    failure = next((OSError(*said) for _, said in everyone if said is not None), None)
    if lead and failure is None:
        sizes = {n: held[r][n] for n, r in owner.items()}
        weight_map = {n: files[r] for n, r in owner.items()}
        try:
            finish_folder(
                partial,
                final,
                {k: v for part, _ in everyone for k, v in part.items()},
                lambda out: _write_rest(out, config, weight_map, sizes, tokenizer),
            )
        except OSError as e:
            failure = e
    _agree_and_clean(groups, failure, partial)


def write_pretrained(
    state: dict[str, torch.Tensor], out_dir: str | Path, config: Any, tokenizer: Any = None
) -> None:
    """Write a whole model's state dict (global names, on the CPU; one process) as a Hugging Face
    folder, as ``save_pretrained`` does: one shard, the index, ``config.json``, ``tokenizer``,
    ``SHA256SUMS``, the folder renamed into place when complete (removed where a write fails)."""
    final = Path(out_dir)
    partial = partial_path(final)
    skipped = {target for _, target in _tied_pairs(config)}
    kept = {n: t.contiguous() for n, t in state.items() if n not in skipped}
    tensors = family_of(config).file_state(kept, config)
    shard = checkpoint_files.shard_name(1, 1)
    sizes = {n: (t.numel() * t.element_size(), t.dtype) for n, t in tensors.items()}
    remove(partial)
    try:
        partial.mkdir(parents=True)
        sums = _write_shard(partial, shard, tensors)
        finish_folder(
            partial,
            final,
            sums,
            lambda out: _write_rest(out, config, dict.fromkeys(tensors, shard), sizes, tokenizer),
        )
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def finish_folder(partial: Path, final: Path, sums: dict[str, str], write: Any) -> None:
    """``write(partial)`` (the small files), then ``SHA256SUMS`` of every file in ``partial``
    (``sums`` holds those hashed by their writers already), then the rename into place."""
    write(partial)
    rest = [
        p.relative_to(partial).as_posix()
        for p in sorted(partial.rglob("*"))
        if p.is_file() and p.relative_to(partial).as_posix() not in sums
    ]
    checksums.write_sums(partial, {**sums, **checksums.hash_files(partial, rest)})
    publish(partial, final)


def _write_shard(folder: Path, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """One shard, hashed right after it is written by the process that wrote it."""
    checkpoint_files.write_shard(folder / name, tensors)
    return checksums.hash_files(folder, [name])


def _write_rest(
    out: Path,
    config: Any,
    weight_map: dict[str, str],
    sizes: dict[str, tuple[int, torch.dtype]],
    tokenizer: Any,
) -> None:
    checkpoint_files.write_index(out, weight_map, sum(b for b, _ in sizes.values()))
    _write_config(config, out, {d for _, d in sizes.values() if d.is_floating_point})
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def _said(failure: OSError | None) -> tuple | None:
    return None if failure is None else (failure.errno, failure.strerror, failure.filename)


def _agree_and_clean(groups: list, failure: OSError | None, partial: Path) -> None:
    """Every process learns the first failure (over the pipeline group, then each mesh group:
    every replica and tensor-parallel peer of a writer); where there is one, every process
    removes the unfinished folder and raises it."""
    for group in groups:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, _said(failure), group=group)
        failure = next((OSError(*said) for said in everyone if said is not None), failure)
    if failure is not None:
        shutil.rmtree(partial, ignore_errors=True)
        raise failure


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
    """The (source, target) names the model of ``config`` ties (its family's row)."""
    return family_of(config).tied_pairs(config)


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
