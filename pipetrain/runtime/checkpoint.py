"""Checkpoints that reshard: model and optimizer state keyed by global parameter name.

A pipeline's stages name their parameters by the model's global names (``pipetrain.split``), so
the union of every rank's state is the unsplit model's state, whatever the cut. The optimizer's
state is keyed the same way — torch keys it by position in ``param_groups``, which depends on the
cut — so a checkpoint written at one pipeline size loads at any other, or into the plain model.

``save_checkpoint(dir, pipe, optimizer)`` writes with ``torch.distributed.checkpoint`` (DCP):
every rank writes its own tensors (replicas, e.g. data-parallel ones, once), and
``load_checkpoint`` reads each rank's tensors in place from the checkpoint's metadata, whatever
layout wrote it. Flat keys:

* ``model.<name>`` — parameters and buffers (``embed.weight``, ``blocks.3.lin.bias``);
* ``optim.<param>.<key>`` — a parameter's optimizer state (``exp_avg``, ``step``), saved under
  each name the parameter has (a tied weight under each of its names);
* ``optim_group.<param>.<key>`` — its parameter group's settings (``lr``, ``betas``).

Loading is all or nothing: it checks the folder (``runtime.checkpoint_disk``), that the
checkpoint holds every key the target needs with the same shapes and dtypes, and (``strict``)
no model key that no rank's stages hold, naming the first key otherwise; then DCP reads every
tensor into new memory, and only once every process read all of its share are the model and
the optimizer written. Where one rank refuses, every rank of the checkpoint raises (none waits
in DCP's collectives). A checkpoint appears under its name only once complete: DCP writes it as
``<path>.partial``, renamed when every process is done.

Data parallel (``runtime.parallel.data_parallel``) changes who takes part, not the format. Under FSDP2
every parameter is a ``DTensor`` sharded over the replicas, and so is each optimizer state shaped
like it (AdamW's moments), so every process of the ``(dp, pp)`` mesh writes its shards: DCP
records each key's global shape and every shard's offset, and a load reads whatever slice each
target needs — a shard of another size, a whole tensor for DDP or the plain model — from shards
or whole tensors alike. Under DDP every replica holds the same tensors; all of them call too and
DCP's planner writes each key once. A DTensor parameter's optimizer state is loaded into a
DTensor with the parameter's placement (``empty_like``), a scalar such as ``step`` into a plain
tensor, as the optimizer made them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from pipetrain.runtime import checkpoint_disk, checkpoint_write, checksums

MODEL, OPTIM, GROUP = "model.", "optim.", "optim_group."

T = TypeVar("T")


def modules_of(target) -> list[nn.Module]:
    """The local modules of a ``Pipeline`` (its stages), or ``[module]``."""
    if isinstance(target, nn.Module):
        return [target]
    modules = getattr(target, "modules", None)
    if isinstance(modules, Mapping):
        return [modules[s] for s in sorted(modules)]
    raise TypeError(f"expected a Pipeline or an nn.Module, got {type(target).__name__}")


def model_state(modules: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """Every local parameter and buffer by global name (tensors share the modules' storage)."""
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        for name, value in module.state_dict().items():
            if name in out and _storage(out[name]) != _storage(value):
                raise ValueError(
                    f"two different tensors are named {name!r}; stage names must be global "
                    "(pipetrain.split keeps each layer's model name)"
                )
            out[name] = value
    return out


def _storage(tensor: torch.Tensor) -> int:
    """Where a tensor's data lives (a DTensor's: its local shard's)."""
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).data_ptr()


def load_model_state(modules: list[nn.Module], state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` (which may hold other ranks' names too) into the local modules."""
    need = model_state(modules)
    _require(need, state, lambda k: f"the state dict has no {k!r}")
    for name, tensor in need.items():  # every check before the first copy
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(
                f"{name!r} has shape {tuple(state[name].shape)} in the state dict but "
                f"{tuple(tensor.shape)} in the model"
            )
    with torch.no_grad():
        for name, tensor in need.items():
            value = state[name]
            if isinstance(tensor, DTensor) and not isinstance(value, DTensor):
                # a whole tensor into a sharded parameter: each rank keeps its own slice
                value = distribute_tensor(
                    value.to(tensor.device, tensor.dtype),
                    tensor.device_mesh,
                    tensor.placements,
                    src_data_rank=None,
                )
            tensor.copy_(value)


def _require(need: Iterable[str], have, message) -> None:
    for name in need:
        if name not in have:
            raise KeyError(
                f"{message(name)} (first missing key; is it a checkpoint of this model?)"
            )


def parameter_names(modules: Iterable[nn.Module]) -> dict[int, list[str]]:
    """``id(parameter)`` → every name it has in the local modules."""
    names: dict[int, list[str]] = {}
    for module in modules:
        for name, p in module.named_parameters(remove_duplicate=False):
            if name not in names.setdefault(id(p), []):
                names[id(p)].append(name)
    return names


def optimizer_state(optimizer: torch.optim.Optimizer, modules: list[nn.Module]) -> dict:
    """The optimizer's state and group settings under flat global-name keys."""
    names = parameter_names(modules)
    torch_state = optimizer.state_dict()
    out: dict[str, object] = {}
    for group_state, group in zip(torch_state["param_groups"], optimizer.param_groups):
        settings = {k: v for k, v in group_state.items() if k != "params"}
        for index, p in zip(group_state["params"], group["params"]):
            if id(p) not in names:
                raise ValueError(
                    "the optimizer holds a parameter that is not in the model (or this rank's "
                    "stages); build it over pipe.parameters()"
                )
            for name in names[id(p)]:
                for key, value in torch_state["state"].get(index, {}).items():
                    out[f"{OPTIM}{name}.{key}"] = value
                for key, value in settings.items():
                    out[f"{GROUP}{name}.{key}"] = value
    return out


def save_checkpoint(
    path: str | os.PathLike,
    target,
    optimizer=None,
    *,
    files: Mapping[str, str | bytes] | None = None,
    then: Callable[[Path], None] | None = None,
) -> None:
    """Write ``target``'s (a ``Pipeline`` or a module) model and optimizer state with DCP.

    Collective: every rank of the pipeline's group calls this, and with data parallel every
    process of its ``(dp, pp)`` mesh (each FSDP2 replica writes its shards). The folder appears
    under ``path`` only once complete (``runtime.checkpoint_disk``: written as
    ``<path>.partial``, marked ``COMPLETE``, then renamed), replacing one already there, with
    ``SHA256SUMS`` of every file in it (``runtime.checkpoint_write``: each process hashes the
    files it wrote). ``files``: small files (name → text or bytes; a name may hold a subfolder)
    to put in the folder, written before it appears. ``then(path)``: called on the coordinating
    process once the folder is published, before any process returns. A failed write (a full
    disk) removes the unfinished folder and raises the ``OSError`` (its errno and path) on every
    process. ``runtime.checkpoint_async`` writes the same folder in the background."""
    import torch.distributed.checkpoint as dcp

    processes = checkpoint_processes(target)
    state = saved_state(target, optimizer)

    def save(partial: Path) -> None:
        dcp.save(state, checkpoint_id=partial, **processes)

    checkpoint_write.write_folder(Path(path), processes, save, files, then)


def saved_state(target, optimizer=None) -> dict[str, object]:
    """What a checkpoint of ``target`` and ``optimizer`` holds, by flat global key (tensors share
    the model's and the optimizer's storage). Collective like ``save_checkpoint``: where one
    process refuses (two tensors under one name), every one raises."""
    modules = modules_of(target)

    def gather() -> dict[str, object]:
        state: dict[str, object] = {MODEL + k: v for k, v in model_state(modules).items()}
        if optimizer is not None:
            state.update(optimizer_state(optimizer, modules))
        return state

    return _agreed(checkpoint_processes(target), gather)


def load_checkpoint(
    path: str | os.PathLike,
    target,
    optimizer=None,
    *,
    strict: bool = True,
    verify: bool = False,
) -> None:
    """Read what ``target`` (a ``Pipeline`` at any size, with or without data parallel, or the
    plain model) and ``optimizer`` (built over its parameters, before its first step) need from
    a checkpoint of any layout.

    All or nothing: the folder is checked first (``runtime.checkpoint_disk.verify``: metadata,
    every file there and long enough), then every key, shape and dtype the target needs, then
    every tensor is read into new memory; the model and the optimizer change only once all of
    it was read on every process (which costs one more copy of this rank's state meanwhile).
    ``strict``: refuse a checkpoint holding model keys that no rank's stages have (a deeper
    model's, say); ``False`` loads what the target has and ignores the rest. ``verify``: check
    every file against the checkpoint's ``SHA256SUMS`` first (each process hashes a share of
    the files), refusing a damaged one naming the file; off by default, as it adds about 40% to
    a load (docs/results/cpu-2026-12-02-checkpoint-verify).

    Collective over the same processes as ``save_checkpoint``. A refusal (a missing key,
    another shape or dtype, a corrupt file) is raised on every one of them: a ``KeyError`` for
    a missing key, a ``ValueError`` otherwise, one line naming the key or file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    modules = modules_of(target)
    processes = checkpoint_processes(target)

    def prepare() -> tuple[dict, dict[int, str], list[str]]:
        stored = checkpoint_disk.verify(path).state_dict_metadata
        if verify:
            verify_share(Path(path), processes)
        state, chosen = _load_targets(stored, modules, optimizer)
        return state, chosen, sorted(k for k in stored if k.startswith(MODEL))

    state, chosen, stored_model = _agreed(processes, prepare)
    if strict:
        _refuse_unexpected(processes, modules, stored_model, path)
    try:
        dcp.load(state, checkpoint_id=path, **processes)
    except (CheckpointException, Exception) as e:
        raise checkpoint_disk.read_failure(path, e) from None
    with torch.no_grad():  # everything is read: now the model changes
        for name, tensor in model_state(modules).items():
            tensor.copy_(cast(torch.Tensor, state[MODEL + name]))
    if optimizer is not None:
        optimizer.load_state_dict(_torch_optimizer_state(optimizer, chosen, state))


def verify_share(folder: Path, processes: dict) -> None:
    """This process's share of ``folder``'s files checked against its ``SHA256SUMS`` (every
    process of the checkpoint takes every ``size``-th file, so the hashing is spread over
    them); a ``ValueError`` naming the checkpoint and the first damaged file."""
    if processes.get("no_dist"):
        rank, size = 0, 1
    else:
        group = processes["process_group"]
        rank, size = dist.get_rank(group), dist.get_world_size(group)
    try:
        names = sorted(checksums.read_sums(folder))
        checksums.verify(folder, names[rank::size])
    except ValueError as e:
        raise ValueError(f"checkpoint {folder} is damaged: {e}") from None


def _refuse_unexpected(processes: dict, modules: list[nn.Module], stored: list[str], path) -> None:
    """Refuse (on every process alike) a checkpoint whose model keys are not all held by some
    process's modules: a deeper or wider model's would otherwise load its first layers silently."""
    mine = sorted(model_state(modules))
    if processes.get("no_dist"):
        held = set(mine)
    else:
        group = processes["process_group"]
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        held = {k for keys in everyone for k in keys}
    extra = [k[len(MODEL) :] for k in stored if k[len(MODEL) :] not in held]
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise ValueError(
            f"checkpoint {path} holds {extra[0]!r}{more}, which the model does not have (a "
            "checkpoint of a deeper or another model?); load_checkpoint(..., strict=False) "
            "loads what the model has and ignores the rest"
        )


def _load_targets(stored, modules: list[nn.Module], optimizer) -> tuple[dict, dict[int, str]]:
    """Where DCP reads each key this rank needs (the model's own tensors, in place; new ones for
    the optimizer's state), and the name each optimizer parameter is read under; a
    ``KeyError``/``ValueError`` naming the first key the checkpoint lacks or holds otherwise."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model = model_state(modules)
    _require((MODEL + k for k in model), stored, lambda k: f"the checkpoint has no {k!r}")
    for name, tensor in model.items():
        meta = stored[MODEL + name]
        if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != tuple(tensor.shape):
            size = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "no tensor"
            raise ValueError(
                f"{name!r} has shape {size} in the checkpoint but {tuple(tensor.shape)} in the "
                "model; is it a checkpoint of this model?"
            )
        if meta.properties.dtype != tensor.dtype:
            raise ValueError(
                f"{name!r} is {meta.properties.dtype} in the checkpoint but {tensor.dtype} in the "
                "model; build the model in the checkpoint's dtype to load it (then convert it)"
            )
    # new memory (a DTensor placed like the parameter): the model is written only once all of
    # the checkpoint was read
    state: dict[str, object] = {MODEL + k: torch.empty_like(v) for k, v in model.items()}
    chosen: dict[int, str] = {}
    if optimizer is None:
        return state, chosen
    names = parameter_names(modules)
    for group in optimizer.param_groups:
        for p in group["params"]:
            options = names.get(id(p), [])
            found = [n for n in options if any(k.startswith(f"{GROUP}{n}.") for k in stored)]
            if not found:
                first = f"{GROUP}{options[0]}.lr" if options else "an unnamed parameter"
                raise KeyError(
                    f"the checkpoint has no {first!r} (first missing key; was it saved with "
                    "the optimizer?)"
                )
            chosen[id(p)] = name = found[0]
            for key, meta in stored.items():
                if not key.startswith((f"{OPTIM}{name}.", f"{GROUP}{name}.")):
                    continue
                if not isinstance(meta, TensorStorageMetadata):
                    state[key] = None  # a value that is no tensor (betas): DCP fills it in
                elif key.startswith(OPTIM):
                    state[key] = _state_target(p, key, meta)
                else:  # a group setting held in a tensor (lr=torch.tensor(...))
                    state[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    return state, chosen


def _agreed(processes: dict, prepare: Callable[[], T]) -> T:
    """``prepare()`` on every process of a checkpoint; where one of them refuses (each rank
    checks only its own stages), all raise, so none is left waiting in DCP's collectives. The
    others' error names the rank and carries its message and type."""
    if processes.get("no_dist"):
        return prepare()
    group = processes["process_group"]
    try:
        result, refusal = prepare(), None
    except (KeyError, ValueError) as e:
        result, refusal = None, e
    said = None
    if refusal is not None:
        said = (type(refusal).__name__, str(refusal.args[0] if refusal.args else refusal))
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, said, group=group)
    if refusal is not None:
        raise refusal
    for rank, other in enumerate(everyone):
        if other is not None:
            kind = KeyError if other[0] == "KeyError" else ValueError
            raise kind(f"rank {rank} of the checkpoint's processes refused: {other[1]}")
    return cast(T, result)


def _state_target(param: torch.Tensor, key: str, meta) -> torch.Tensor:
    """Where DCP reads one optimizer state of ``param``: for a sharded (``DTensor``) parameter, a
    state of its shape is a DTensor placed like it (how AdamW's moments are made: ``zeros_like``)
    and a scalar (``step``) a plain tensor; a plain parameter's states are plain tensors."""
    size, dtype = tuple(meta.size), meta.properties.dtype
    if not isinstance(param, DTensor) or not size:
        return torch.empty(size, dtype=dtype)
    if size == tuple(param.shape):
        return torch.empty_like(param, dtype=dtype)
    raise ValueError(
        f"{key!r} has shape {size}, neither the sharded parameter's {tuple(param.shape)} nor a "
        "scalar: where its shards go is not known (optimizers whose states are shaped like the "
        "parameter, such as SGD with momentum, Adam and AdamW, are supported)"
    )


def _torch_optimizer_state(optimizer, chosen: dict[int, str], state: dict) -> dict:
    """Back to torch's positional format for ``optimizer``'s own parameter order."""
    out_state: dict[int, dict] = {}
    groups = []
    index = 0
    for group in optimizer.param_groups:
        settings: dict[str, object] = {}
        positions = []
        for p in group["params"]:
            name = chosen[id(p)]
            entry = {
                k[len(f"{OPTIM}{name}.") :]: v
                for k, v in state.items()
                if k.startswith(f"{OPTIM}{name}.")
            }
            if entry:
                out_state[index] = entry
            if not settings:
                settings = {
                    k[len(f"{GROUP}{name}.") :]: v
                    for k, v in state.items()
                    if k.startswith(f"{GROUP}{name}.")
                }
            positions.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, **settings})
        groups[-1]["params"] = positions
    return {"state": out_state, "param_groups": groups}


def checkpoint_processes(target) -> dict:
    """DCP's processes: a plain module (or no process group) reads and writes alone; a pipeline,
    its group; one on a mesh (tensor or data parallel), every process of the mesh. DCP needs one
    group that holds them all, so the mesh must be the whole job (the default group): checked on
    every rank from sizes alone, so each refuses alike and none waits for the others."""
    if isinstance(target, nn.Module) or not (dist.is_available() and dist.is_initialized()):
        return {"no_dist": True}
    mesh = getattr(target, "mesh_groups", None)
    if mesh is None:
        return {"process_group": target.group}
    size = mesh.size
    world = dist.get_world_size()
    if size != world:
        raise ValueError(
            f"checkpoints of a pipeline on a mesh are written by every process of the mesh "
            f"({size}), which must be the whole job, but the job has {world} processes; give "
            "the pipeline a mesh of every process"
        )
    return {"process_group": None}
