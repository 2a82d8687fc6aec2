"""Tied weights: one parameter used by several stages (GPT-2's token embedding and LM head).

Unsplit, autograd sums the gradients of every use of a shared weight. Cut into stages, each use
sits on a stage — the same ``Parameter`` object where the stages share a rank (V placements put
the first and the last stage on rank 0), one replica per rank otherwise — and each stage sees only
its own uses. So pipetrain, once per step, after the rank's last backward piece:

* sums the local replicas' gradients, then all-reduces that sum over a process group of the
  owning ranks (made here, with ``new_group``; none where one rank owns them all),
* writes the total into every replica's ``.grad`` (added to what ``.grad`` held before the step,
  so gradient accumulation across steps stays exact), and
* fires the replicas' post-accumulate-grad hooks once — the stages never fire them (``quiet``):
  a data-parallel wrapper's hook sees the whole gradient, once per step (the Megatron-LM way of
  summing embedding gradients across the first and last stage, Shoeybi et al. 2019 / Narayanan
  et al. 2021, with the hooks held back until the sum is known).

Replicas start equal: construction broadcasts the first owner's value to the others. Since they
then get equal gradients, any deterministic optimizer keeps them equal.

Under data parallel (``runtime.parallel.data_parallel``) the group spans the owners of every replica and
the wrappers leave tied parameters alone (DDP ignores them, FSDP2 keeps them whole, unsharded):
the one all-reduce sums the uses and the replicas together (divided by the replica count where
the replicas are averaged), so each gradient is reduced exactly once, on the whole ``.grad``,
and no wrapper's hook fires on a tied parameter.

Tied sets come from three places, merged by name: ``Pipeline(tied=[("embed.weight",
"head.weight")])`` (global names as the stages name their parameters: ``pipetrain.split``'s
stages use the model's names), ``split``'s detection (one ``Parameter`` object in two stages of
the list it cut: ``Stage.tied_names``), and one ``Parameter`` object in two of this rank's stages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pipetrain.runtime.backward.interface import fire_hooks


@dataclass
class TiedSet:
    """One tied parameter: its names, this rank's replicas (distinct objects) and the group."""

    names: tuple[str, ...]
    owners: tuple[int, ...]  # pipeline-group ranks holding a replica
    local: list[nn.Parameter]
    group: Any = None  # the owners (× data-parallel replicas) as a group; None: one rank
    source: int = 0  # the global rank whose value every replica starts from

    @property
    def first_owner(self) -> int:
        return self.owners[0]


def named_parameters_everywhere(
    modules: Mapping[int, nn.Module],
) -> tuple[dict[str, nn.Parameter], set[str]]:
    """Every local parameter by every name it has (shared ones under each of their names), and
    the names that two different parameters of this rank's stages carry (hand-cut stages often
    reuse local names; such a name cannot be tied)."""
    out: dict[str, nn.Parameter] = {}
    ambiguous: set[str] = set()
    for module in modules.values():
        for name, p in module.named_parameters(remove_duplicate=False):
            if name in out and out[name] is not p:
                ambiguous.add(name)
            out[name] = p
    return out, ambiguous


def shared_across(modules: Sequence[nn.Module]) -> list[tuple[str, ...]]:
    """Names of each parameter object that appears in more than one of ``modules``."""
    seen: dict[int, list[tuple[int, str]]] = {}
    for s, module in enumerate(modules):
        for name, p in module.named_parameters(remove_duplicate=False):
            seen.setdefault(id(p), []).append((s, name))
    return [
        tuple(sorted({n for _, n in uses}))
        for uses in seen.values()
        if len({s for s, _ in uses}) > 1
    ]


def merge(sets: Iterable[Sequence[str]]) -> list[tuple[str, ...]]:
    """Union of overlapping name sets, each sorted, in a deterministic order."""
    merged: list[set[str]] = []
    for given in sets:
        names = set(given)
        if not names:
            raise ValueError("a tied set needs at least one name")
        overlapping = [m for m in merged if m & names]
        for m in overlapping:
            names |= m
            merged.remove(m)
        merged.append(names)
    return sorted(tuple(sorted(m)) for m in merged)


def build(
    declared: Iterable[Sequence[str]],
    modules: Mapping[int, nn.Module],
    group,
    rank: int,
    world: int,
    dp_group=None,
    *,
    gather: Callable[[dict], list[dict]],
    found: Sequence[tuple[str, ...]] = (),
) -> list[TiedSet]:
    """The tied sets of the whole pipeline, with this rank's replicas and the owners' groups.

    Collective over the pipeline group: every rank must call it (``Pipeline`` does, with
    ``gather`` its agreement's store-based all-gather, which honours the pipeline's timeout). Sets named
    by global names (declared, or found by ``split``) are resolved by name on every rank; one
    object in two of this rank's stages is a set of its own, found by identity (its names may
    be local ones that other ranks reuse for other parameters).

    With data parallel (``dp_group``: this rank's replicas of the pipeline), a set's group spans
    its owners in every replica: one all-reduce then both sums the uses and reduces over the
    replicas (``TiedGrads(average_over=...)`` divides where the replicas are averaged); a set
    of one owning rank uses ``dp_group`` itself. Collective over ``dp_group`` too.

    ``found``: sets ``shared_in_stage_list`` found (declared too), which may be one name."""
    for given in declared:  # one name is a tie only when the stage list itself shares it
        if len(set(given)) < 2 and tuple(given) not in found:
            raise ValueError(f"a tied set needs at least two names, got {sorted(set(given))}")
    by_name, ambiguous = named_parameters_everywhere(modules)
    everyone = _gather_names(declared, modules, by_name, world, gather)
    sets = (
        merge(s for part in everyone for s in part["sets"])
        if any(part["sets"] for part in everyone)
        else []
    )
    held = [set(part["names"]) for part in everyone]
    known = set().union(*held)
    sharded_anywhere = {n for part in everyone for n in part["sharded"]}
    out = []
    for names in sets:
        _check_tieable(names, known, ambiguous, sharded_anywhere)
        _refuse_partly_frozen(names, {n for part in everyone for n in part["frozen"]} & known)
        out.append(_named_set(names, by_name, held, world))
    covered = {id(p) for t in out for p in t.local}
    for p in _objects_shared_across(modules):
        if id(p) not in covered:
            names_here = tuple(sorted({n for n, q in by_name.items() if q is p}))
            out.append(TiedSet(names_here, (rank,), [p]))
    _make_groups(out, group, world, dp_group)
    return out


def _gather_names(
    declared: Iterable[Sequence[str]],
    modules: Mapping[int, nn.Module],
    by_name: Mapping[str, nn.Parameter],
    world: int,
    gather: Callable[[dict], list[dict]],
) -> list[dict[str, Any]]:
    """Every pipeline rank's tied sets (declared or found by ``split``), parameter names and
    sharded (DTensor) and frozen parameter names, in pipeline-rank order."""
    local_sets = [tuple(s) for s in declared]
    local_sets += [names for m in modules.values() for names in getattr(m, "tied_names", ())]
    mine: dict[str, Any] = {
        "sets": [list(s) for s in local_sets],
        "names": sorted(by_name),
        "sharded": sorted(n for n, p in by_name.items() if isinstance(p, DTensor)),
        "frozen": sorted(n for n, p in by_name.items() if not p.requires_grad),
    }
    return gather(mine) if world > 1 else [mine]


def _check_tieable(
    names: tuple[str, ...], known: set[str], ambiguous: set[str], sharded: set[str]
) -> None:
    """Refuse a set whose names are sharded, held by no stage, or ambiguous on this rank."""
    if sharded & set(names):
        raise ValueError(
            f"tied weight {sorted(sharded & set(names))[0]!r} is a sharded DTensor "
            "(tensor parallel or fully_shard applied before the Pipeline); the tied sum adds whole "
            "gradients: leave the tied parameters replicated (a plain tensor under a "
            "tensor-parallel plan, fully_shard(..., ignored_params={the tied parameters})), "
            "or untie them"
        )
    missing = [n for n in names if n not in known]
    if missing:
        raise ValueError(
            f"tied parameter {missing[0]!r} is not a parameter of any stage; tied names are "
            f"the stages' parameter names, e.g. {sorted(known)[:3]}"
        )
    unclear = sorted(ambiguous & set(names))
    if unclear:
        raise ValueError(
            f"two different parameters are named {unclear[0]!r} on this rank, so it cannot "
            "be tied; stage parameter names must be global (pipetrain.split keeps each "
            "layer's model name)"
        )


def _named_set(
    names: tuple[str, ...],
    by_name: Mapping[str, nn.Parameter],
    held: list[set[str]],
    world: int,
) -> TiedSet:
    """One set named by global names: the ranks that hold any of them and this rank's distinct
    replicas, which must have one shape."""
    owners = tuple(r for r in range(world) if held[r] & set(names))
    local: list[nn.Parameter] = []
    for n in names:
        p = by_name.get(n)
        if p is not None and all(p is not q for q in local):
            local.append(p)
    shapes = {tuple(p.shape) for p in local}
    if len(shapes) > 1:
        raise ValueError(f"tied parameters {names} have different shapes {sorted(shapes)}")
    return TiedSet(names, owners, local)


def _make_groups(out: list[TiedSet], group, world: int, dp_group) -> None:
    """Give each set its owners' group and source rank, then make its replicas equal."""
    # the owners' global ranks, in every data-parallel replica (replica 0's first owner first);
    # the replicas' pipelines are alike, so their sets are too
    owner_ranks = [[_global(group, r) for r in t.owners] for t in out]
    replicas: list[Any] = [owner_ranks]
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        replicas = [None] * dist.get_world_size(dp_group)
        dist.all_gather_object(replicas, owner_ranks, group=dp_group)
    # every rank of the job takes part in this pipeline: all make each owners' group (sets of
    # several owners are the same on every rank), in one order
    whole_job = world * len(replicas) == dist.get_world_size()
    for i, tied in enumerate(out):
        ranks = [r for owners in replicas for r in owners[i]]
        tied.source = ranks[0]
        if len(tied.owners) == 1:  # one rank of the pipeline: its replicas are the dp group
            tied.group = dp_group if len(ranks) > 1 else None
        else:
            tied.group = _owners_group(ranks, whole_job)
        _make_equal(tied)


def shared_in_stage_list(stages: Sequence[nn.Module]) -> list[tuple[str, ...]]:
    """The name sets of every ``Parameter`` object that several stages of a stage list hold (a
    tied embedding and head passed as modules): what ``Pipeline(tied=...)`` would declare.

    Every rank holds the whole list, so every rank finds the same sets. A set is resolved by
    name on each rank, so its names must mean that object in every stage; where another stage
    uses one of them for another parameter the list is refused (``pipetrain.split`` gives
    global names)."""
    uses: dict[int, list[tuple[int, str]]] = {}
    objects: dict[int, nn.Parameter] = {}
    for s, module in enumerate(stages):
        for name, p in module.named_parameters(remove_duplicate=False):
            uses.setdefault(id(p), []).append((s, name))
            objects[id(p)] = p
    out = []
    for key, where in uses.items():
        if len({s for s, _ in where}) < 2:
            continue
        names = tuple(sorted({n for _, n in where}))
        for s, module in enumerate(stages):
            for name, p in module.named_parameters(remove_duplicate=False):
                if name in names and p is not objects[key]:
                    raise ValueError(
                        f"stages {sorted({t for t, _ in where})} share one Parameter object "
                        f"(named {list(names)}), but stage {s} names another parameter "
                        f"{name!r}, so the tie cannot be found by name on every rank; cut the "
                        "model with pipetrain.split (global names, ties found), or give the "
                        "shared parameter names no other stage uses"
                    )
        out.append(names)
    return out


def _refuse_partly_frozen(names: Sequence[str], frozen: set[str]) -> None:
    """A tied set is trained or frozen as a whole: a frozen use beside a trainable one would
    hand the frozen one a gradient (and the ranks would disagree on whether to sum)."""
    if frozen & set(names) and not set(names) <= frozen:
        raise ValueError(
            f"tied parameters {sorted(names)} are frozen ({sorted(frozen & set(names))}) on some "
            "stages and trainable on others; freeze every use (requires_grad_(False)) or none"
        )


def _objects_shared_across(modules: Mapping[int, nn.Module]) -> list[nn.Parameter]:
    """Parameter objects that appear in more than one of ``modules``."""
    stages_of: dict[int, set[int]] = {}
    objects: dict[int, nn.Parameter] = {}
    for s, module in modules.items():
        for p in module.parameters():
            stages_of.setdefault(id(p), set()).add(s)
            objects[id(p)] = p
    return [objects[i] for i, stages in stages_of.items() if len(stages) > 1]


def _owners_group(ranks: list[int], everyone: bool):
    """A process group of the owning ranks (global numbering).

    Made by every rank of the job where all of them run this pipeline (``new_group``'s default:
    the group's name comes from a counter every rank advances alike). Otherwise only by its
    members (``use_local_synchronization``), whose name hashes the ranks with the number of
    groups a rank has made so far: it requires the members to have made equally many."""
    if len(ranks) < 2:
        return None
    if everyone:
        made = dist.new_group(sorted(ranks))
        return made if dist.get_rank() in ranks else None
    if dist.get_rank() not in ranks:
        return None
    return dist.new_group(sorted(ranks), use_local_synchronization=True)


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


@torch.no_grad()
def _make_equal(tied: TiedSet) -> None:
    """Replicas start equal: the first owner's first replica, broadcast to the others."""
    if not tied.local:
        return
    source = tied.local[0]
    if tied.group is not None:
        value = source.detach().clone()
        dist.broadcast(value, tied.source, group=tied.group)
        source.copy_(value)
    for p in tied.local[1:]:
        p.copy_(source)


class TiedGrads:
    """Per step: hold the tied replicas' ``.grad`` aside, then sum, reduce and write it back."""

    def __init__(self, sets: list[TiedSet], runners, average_over: int = 1) -> None:
        # a frozen set (every use requires_grad=False, as fine-tuning recipes freeze embeddings)
        # has no gradient to sum and no hook to fire
        self.sets = [t for t in sets if t.local and any(p.requires_grad for p in t.local)]
        #: data-parallel replicas averaged (``reduction="mean"``), else 1 (summed)
        self.average_over = average_over
        ids = {id(p) for t in self.sets for p in t.local}
        for runner in runners.values():
            runner.quiet_params = {id(p) for p in runner.module.parameters() if id(p) in ids}
        self._before: list[list[torch.Tensor | None]] = []

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for t in self.sets for p in t.local]

    def begin_step(self) -> None:
        self._before = []
        for t in self.sets:
            self._before.append([p.grad for p in t.local])
            for p in t.local:
                p.grad = None

    @torch.no_grad()
    def end_step(self, transport=None, rank: int = 0) -> None:
        """Sum this step's gradient over the replicas and owners; fire hooks once each.

        ``transport``: waits go through its timeout (a dead owner fails naming rank and peer)."""
        for t, before in zip(self.sets, self._before):
            step = [p.grad for p in t.local if p.grad is not None]
            total = step[0].clone() if step else torch.zeros_like(t.local[0])
            for g in step[1:]:
                total += g
            if t.group is not None:
                work = dist.all_reduce(total, group=t.group, async_op=True)
                peer = next((r for r in t.owners if r != rank), None)
                if transport is None or peer is None:
                    work.wait()
                else:
                    transport.wait_work(work, f"the all-reduce of tied {t.names[0]}", peer)
            if self.average_over > 1:
                total /= self.average_over
            for p, old in zip(t.local, before):
                p.grad = total.clone() if old is None else old + total
        self._before = []
        fire_hooks(self.parameters)
