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

Loading first checks that the checkpoint holds every key the target needs, with the same shapes,
and names the first missing key otherwise; nothing is read before that.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

MODEL, OPTIM, GROUP = "model.", "optim.", "optim_group."


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
            if name in out and out[name].data_ptr() != value.data_ptr():
                raise ValueError(
                    f"two different tensors are named {name!r}; stage names must be global "
                    "(pipetrain.split keeps each layer's model name)"
                )
            out[name] = value
    return out


def load_model_state(modules: list[nn.Module], state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` (which may hold other ranks' names too) into the local modules."""
    need = model_state(modules)
    _require(need, state, lambda k: f"the state dict has no {k!r}")
    with torch.no_grad():
        for name, tensor in need.items():
            if tuple(state[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name!r} has shape {tuple(state[name].shape)} in the state dict but "
                    f"{tuple(tensor.shape)} in the model"
                )
            tensor.copy_(state[name])


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


def save_checkpoint(path: str | os.PathLike, target, optimizer=None) -> None:
    """Write ``target``'s (a ``Pipeline`` or a module) model and optimizer state with DCP.

    Collective over the pipeline's process group: every rank of it calls this."""
    modules = modules_of(target)
    state: dict[str, object] = {MODEL + k: v for k, v in model_state(modules).items()}
    if optimizer is not None:
        state.update(optimizer_state(optimizer, modules))
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path, **_dist_args(target))


def load_checkpoint(path: str | os.PathLike, target, optimizer=None) -> None:
    """Read what ``target`` (a ``Pipeline`` at any size, or the plain model) and ``optimizer``
    (built over its parameters, before its first step) need from a checkpoint of any layout.

    Collective over the pipeline's process group, like ``save_checkpoint``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    modules = modules_of(target)
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
    state: dict[str, object] = {MODEL + k: v for k, v in model.items()}
    chosen: dict[int, str] = {}
    if optimizer is not None:
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
                chosen[id(p)] = found[0]
        for name in chosen.values():
            for key, meta in stored.items():
                if key.startswith((f"{OPTIM}{name}.", f"{GROUP}{name}.")):
                    state[key] = (
                        torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
                        if isinstance(meta, TensorStorageMetadata)
                        else None
                    )
    dcp.load(state, checkpoint_id=path, **_dist_args(target))
    if optimizer is not None:
        optimizer.load_state_dict(_torch_optimizer_state(optimizer, chosen, state))


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


def _dist_args(target) -> dict:
    """A pipeline saves over its group; a plain module, or no process group, locally."""
    if isinstance(target, nn.Module) or not (dist.is_available() and dist.is_initialized()):
        return {"no_dist": True}
    return {"process_group": target.group}
