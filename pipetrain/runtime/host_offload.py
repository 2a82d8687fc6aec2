"""Activation offload on one stage: saved tensors to host memory while they wait for their
backward, back before the backward reads them, as the program's OFFLOAD/RELOAD actions say
(``schedule.offload``).

PipeOffload (Wan et al. 2025, arXiv 2503.01328): a stage's activations wait between its forward
and its backward while other micro-batches run, so they can live in host memory meanwhile. The
forward of an offloaded micro-batch runs under ``torch.autograd.graph.saved_tensors_hooks``: each
tensor autograd saves is wrapped in a ``_Packed`` entry, except what moving would not free —
parameters and views of them (by identity and storage, as Megatron-Core and torchtitan check),
other leaves (the stage's inputs and buffers, which someone else holds anyway), tensor subclasses
and tensors under ``min_bytes``.

**Layer by layer** (a stage of several layers: ``pipetrain.split``'s ``Stage``, an
``nn.Sequential``): as in Megatron-Core's and torchtitan's per-module offload, what each of the
first ⌈fraction · layers⌉ layers saved (``schedule.offload.offloaded_layers``) leaves for host
memory as soon as that layer's forward ends, on a device-to-host stream, while the next layers
compute; the last layers are kept, as the backward reads them first. ``OFFLOAD`` only completes
the micro-batch's bookkeeping. ``RELOAD`` brings back the last offloaded layer; inside the
backward, the first read of a layer's saved tensors starts the reload of the layer below
(``PREFETCH`` layers ahead) on a host-to-device stream, so about ``RESIDENT_LAYERS`` layers of a
micro-batch are on the device at once. **In one piece** (any other module): ``OFFLOAD`` moves the
first saved entries until at least ``fraction`` of the saved bytes has moved (whole tensors: never
less than planned) and ``RELOAD`` brings them all back.

On CUDA each direction has its stream (the GPU's copy engines run one each, and one stream would
serialise them), ordered by events: an offload waits for the compute stream's work so far, the
device tensor is marked used on the copy stream (``record_stream``) before it is dropped so the
caching allocator cannot hand its memory out while the copy reads it; host buffers are pinned (the
caching host allocator keeps a pinned block until the copies using it are done); a reload waits
for its layer's offload, allocates on the compute stream that reads and frees the tensors, and the
backward's stream waits for the reload's event before reading them. On CPU a copy is a plain copy
into separate storage, so a float64 run is exact and shows the tensors really moved
(``moved_bytes``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from pipetrain.runtime.backward.activation_checkpoint import Recomputed
from pipetrain.runtime.named_layers import Stage
from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.offload import RESIDENT_LAYERS, offloaded_layers

#: saved tensors smaller than this stay where they are (biases, norms' statistics): a copy of
#: them frees little and costs a copy's fixed overhead
MIN_BYTES = 1 << 20
#: layers reloaded ahead of the one the backward reads
PREFETCH = RESIDENT_LAYERS - 1


class _Group:
    """What one layer's forward saved (in one piece: the entries an OFFLOAD moves), and where it
    is. Its entries refer to it; it lets go of them once their reload is issued, so from then on
    only the autograd graph holds them (and frees them as the backward goes)."""

    __slots__ = ("by_id", "entries", "in_event", "index", "micro", "offloaded", "out_event", "read")

    def __init__(self, index: int, micro: _Micro) -> None:
        self.index, self.micro = index, micro
        self.entries: list[_Packed] = []
        self.by_id: dict[int, _Packed] = {}  # one entry per tensor saved several times
        self.offloaded = False
        self.out_event: torch.cuda.Event | None = None
        self.in_event: torch.cuda.Event | None = None
        #: ids of the streams that waited for ``in_event``; None: not reloaded yet
        self.read: set[int] | None = None


class _Packed:
    """One saved tensor: on the device, or in host memory (a view of its ``blob``) between its
    offload and reload."""

    __slots__ = ("blob", "device", "group", "nbytes", "view")

    def __init__(self, tensor: torch.Tensor, group: _Group) -> None:
        self.device: torch.Tensor | None = tensor
        self.nbytes = tensor.numel() * tensor.element_size()
        self.group = group
        self.blob: _Blob | None = None
        #: (dtype, size, stride, storage offset) of the tensor over its blob's bytes
        self.view: tuple[torch.dtype, torch.Size, tuple[int, ...], int] | None = None


class _Blob:
    """Bytes copied to host memory in one piece: a saved tensor's whole storage where the saved
    views cover at least half of it (SwiGLU's gate and up, the chunks of one product, move as one
    contiguous copy), else one view's elements."""

    __slots__ = ("device", "host")

    def __init__(self, host: torch.Tensor) -> None:
        self.host: torch.Tensor | None = host
        self.device: torch.Tensor | None = None


class _Micro:
    """A micro-batch's groups, in forward order."""

    def __init__(self) -> None:
        self.groups: list[_Group] = []
        self.saved_bytes = 0
        self.kept: set[int] = set()  # ids of the kept layers' saved tensors (counted once)
        self.reload_issued = False


class StageOffload:
    """What one stage offloads: its first ⌈``fraction`` · layers⌉ layers' saved tensors, layer by
    layer, where ``layers`` has more than one; else ``fraction`` of the saved bytes in one piece.

    ``microbatches`` are those the program offloads on this stage (the others run unhooked).
    ``moved_bytes`` counts the bytes copied to host memory, ``saved_bytes`` those the offloaded
    micro-batches saved (offloadable or not); both this object's own counters.
    """

    def __init__(
        self,
        stage: int,
        fraction: float,
        microbatches: frozenset[int],
        device: torch.device,
        min_bytes: int = MIN_BYTES,
        layers: Sequence[nn.Module] = (),
        params: Sequence[torch.Tensor] = (),
    ) -> None:
        self.stage, self.fraction, self.microbatches = stage, fraction, microbatches
        self.device, self.min_bytes = device, min_bytes
        self.layers = tuple(layers) if len(layers) > 1 else ()
        #: groups (layers) offloaded per micro-batch: the first ones; in one piece, group 0
        self.offloaded_groups = offloaded_layers(fraction, len(self.layers)) if self.layers else 1
        self.params = tuple(params)
        self.cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.micro: dict[int, _Micro] = {}
        self.moved_bytes = 0
        self.saved_bytes = 0

    @property
    def per_layer(self) -> bool:
        return bool(self.layers)

    # -- forward --------------------------------------------------------------------------------

    def capture(self, mb: int) -> AbstractContextManager[object]:
        """Around micro-batch ``mb``'s forward: wrap what autograd saves (if it is offloaded),
        and offload each offloaded layer's as its forward ends."""
        if mb not in self.microbatches or not torch.is_grad_enabled():  # eval saves nothing
            return nullcontext()
        micro = self.micro[mb] = _Micro()
        micro.groups.append(_Group(0, micro))
        return self._capturing(micro)

    @contextmanager
    def _capturing(self, micro: _Micro) -> Iterator[None]:
        params = _storages(self.params)
        pack = functools.partial(self._pack, micro, params)
        done = functools.partial(self._layer_done, micro)
        once = {id(layer): layer for layer in self.layers}.values()  # a layer used twice: one hook
        handles = [layer.register_forward_hook(done) for layer in once]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                yield
        finally:
            for handle in handles:
                handle.remove()

    def _pack(self, micro: _Micro, params: frozenset[int], tensor: torch.Tensor) -> object:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < self.min_bytes or _stays(tensor, params):
            return tensor
        group = micro.groups[-1]
        if self.per_layer and group.index >= self.offloaded_groups:
            if id(tensor) not in micro.kept:  # alive (the graph holds it): its id is its own
                micro.kept.add(id(tensor))
                micro.saved_bytes += nbytes
            return tensor  # a kept layer's: nothing to do in the backward either
        entry = group.by_id.get(id(tensor))
        if entry is None:
            entry = group.by_id[id(tensor)] = _Packed(tensor, group)
            group.entries.append(entry)
            micro.saved_bytes += nbytes
        return entry

    def _layer_done(self, micro: _Micro, _module: nn.Module, _args: object, _out: object) -> None:
        group = micro.groups[-1]
        if group.index < self.offloaded_groups:
            self._offload_group(group)
        micro.groups.append(_Group(group.index + 1, micro))

    def _offload_group(self, group: _Group) -> None:
        group.by_id.clear()  # ids of freed tensors may be reused: only the entries count now
        group.offloaded = True
        if not group.entries:
            return
        sources = self._blob_sources(group.entries)  # on the compute stream: any .contiguous()
        with self._on(self.d2h):
            for source, entries in sources:
                host = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=self.cuda)
                host.copy_(source, non_blocking=self.cuda)
                if self.d2h is not None:
                    source.record_stream(self.d2h)
                blob = _Blob(host)
                for entry in entries:
                    entry.blob, entry.device = blob, None
                self.moved_bytes += source.numel()
            group.out_event = self._record(self.d2h)

    @staticmethod
    def _blob_sources(entries: list[_Packed]) -> list[tuple[torch.Tensor, list[_Packed]]]:
        """The bytes to copy, each with the entries it holds (their ``view`` set over it)."""
        by_storage: dict[int, list[_Packed]] = {}
        for entry in entries:
            assert entry.device is not None
            by_storage.setdefault(entry.device.untyped_storage().data_ptr(), []).append(entry)
        out = []
        for shared in by_storage.values():
            first = shared[0].device
            assert first is not None
            storage = first.untyped_storage()
            if 2 * sum(e.nbytes for e in shared) >= storage.nbytes():
                whole = torch.empty(0, dtype=torch.uint8, device=first.device)
                whole.set_(storage, 0, (storage.nbytes(),), (1,))  # type: ignore[call-overload]
                for e in shared:
                    t = e.device
                    assert t is not None
                    offset = int(t.storage_offset())  # in elements of its dtype
                    e.view = (t.dtype, t.shape, t.stride(), offset)
                out.append((whole, shared))
                continue
            for e in shared:  # a small view of a large storage: only its elements
                t = e.device
                assert t is not None
                dense = t.contiguous()
                e.view = (t.dtype, t.shape, dense.stride(), 0)
                out.append((dense.reshape(-1).view(torch.uint8), [e]))
        return out

    def offload(self, mb: int) -> None:
        """``OFFLOAD``: layer by layer, the offloaded layers have left already (any whose forward
        did not end in a hook leaves now); in one piece, copy at least ``fraction`` of the saved
        bytes to host memory."""
        micro = self.micro[mb]
        self.saved_bytes += micro.saved_bytes
        if self.per_layer:
            for group in micro.groups:
                if group.index < self.offloaded_groups and not group.offloaded:
                    self._offload_group(group)
                group.by_id.clear()
            return
        (everything,) = micro.groups
        everything.by_id.clear()
        budget = self.fraction * sum(e.nbytes for e in everything.entries)
        moved, kept = _Group(0, micro), _Group(1, micro)
        total = 0
        for entry in everything.entries:  # whole tensors: at least the fraction, as planned
            if total < budget:
                moved.entries.append(entry)
                entry.group = moved
                total += entry.nbytes
            else:
                entry.group = kept
        micro.groups = [moved, kept]
        self._offload_group(moved)

    # -- backward -------------------------------------------------------------------------------

    def reload(self, mb: int) -> None:
        """``RELOAD``: bring back what the backward reads first (the last offloaded layer, or
        everything moved in one piece); the backward brings back the rest (``_unpack``)."""
        micro = self.micro[mb]
        micro.reload_issued = True
        offloaded = [g for g in micro.groups if g.offloaded]
        if offloaded:
            self._reload_group(offloaded[-1])

    def _reload_group(self, group: _Group) -> None:
        if group.read is not None:
            return
        group.read = set()
        blobs = list({id(e.blob): e.blob for e in group.entries if e.blob is not None}.values())
        # allocated on the compute stream, which reads and frees them: the caching allocator
        # keeps a pool per stream, and blocks made on a copy stream would never be reused by
        # compute (measured on CUDA: the peak rose instead of falling)
        for blob in blobs:
            assert blob.host is not None
            blob.device = torch.empty_like(blob.host, device=self.device)
        with self._on(self.h2d):
            if self.h2d is not None and group.out_event is not None:
                self.h2d.wait_event(group.out_event)
            for blob in blobs:
                assert blob.device is not None and blob.host is not None
                blob.device.copy_(blob.host, non_blocking=self.cuda)
                if self.h2d is not None:
                    blob.device.record_stream(self.h2d)
                blob.host = None  # pinned: its block is reused only after the copy is done
            group.in_event = self._record(self.h2d)
        for entry in group.entries:
            assert entry.blob is not None and entry.blob.device is not None
            assert entry.view is not None
            dtype, size, stride, offset = entry.view
            tensor = torch.empty(0, dtype=dtype, device=self.device)
            storage = entry.blob.device.untyped_storage()
            entry.device = tensor.set_(storage, offset, size, stride)  # type: ignore[call-overload]
            entry.blob = None
        group.entries = []  # from here on only the autograd graph holds them

    def _unpack(self, saved: object) -> torch.Tensor:
        if not isinstance(saved, _Packed):
            assert isinstance(saved, torch.Tensor)
            return saved
        group = saved.group
        if group.offloaded:
            if group.read is None:
                if not group.micro.reload_issued:
                    raise RuntimeError(
                        "a saved activation was read while offloaded (no RELOAD before it)"
                    )
                self._reload_group(group)  # the prefetch from the layer above missed it
            self._prefetch(group)
            self._wait(group)
        assert saved.device is not None
        return saved.device

    def _prefetch(self, group: _Group) -> None:
        """The first read of ``group``'s tensors: start reloading the ``PREFETCH`` layers below."""
        groups = group.micro.groups
        for index in range(group.index - 1, max(-1, group.index - 1 - PREFETCH), -1):
            if groups[index].offloaded:
                self._reload_group(groups[index])

    def _wait(self, group: _Group) -> None:
        """The reading stream waits for ``group``'s reload (once per stream)."""
        if group.in_event is None or group.read is None:
            return
        stream = torch.cuda.current_stream(self.device)
        if stream.stream_id not in group.read:
            stream.wait_event(group.in_event)
            group.read.add(stream.stream_id)

    def ready(self, mb: int) -> None:
        """Before micro-batch ``mb``'s backward: its RELOAD was issued (the validator's order)."""
        micro = self.micro.pop(mb, None)
        if micro is None:
            return
        if not micro.reload_issued and any(g.offloaded for g in micro.groups):
            raise RuntimeError(
                f"stage {self.stage} micro-batch {mb}: its backward runs before its RELOAD"
            )
        for group in micro.groups:
            if not group.offloaded:
                group.entries = []  # kept: only the autograd graph holds them now

    def release(self) -> None:
        """Drop every micro-batch's entries (a step that failed part-way, or ``close``)."""
        for micro in self.micro.values():
            for group in micro.groups:
                group.entries = []
        self.micro.clear()

    # -- streams --------------------------------------------------------------------------------

    def _on(self, stream: torch.cuda.Stream | None) -> AbstractContextManager[object]:
        if stream is None:
            return nullcontext()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    @staticmethod
    def _record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event


def _storages(params: Sequence[torch.Tensor]) -> frozenset[int]:
    """The storages of ``params`` (their views are saved as often as they are: a transposed
    weight by a matrix product), skipping tensor subclasses, which have no storage of their own."""
    found = set()
    for p in params:
        if type(p) in (torch.Tensor, nn.Parameter):
            found.add(p.untyped_storage().data_ptr())
    return frozenset(found)


def _stays(tensor: torch.Tensor, params: frozenset[int]) -> bool:
    """Whether moving ``tensor`` would free nothing: a parameter or a view of one, a leaf (the
    stage's input, which the stage or the step's batch holds anyway; a buffer), or a tensor
    subclass (a DTensor's copy to host is not a plain copy)."""
    if isinstance(tensor, nn.Parameter) or tensor.grad_fn is None:
        return True
    if type(tensor) is not torch.Tensor:
        return True
    return tensor.untyped_storage().data_ptr() in params


def stage_layers(module: nn.Module) -> list[nn.Module]:
    """The layers offload goes by: a ``pipetrain.split`` stage's call list, an ``nn.Sequential``'s
    children; otherwise none (the stage moves in one piece)."""
    if isinstance(module, Stage):
        return [layer for layer, _ in module.chain]
    if isinstance(module, nn.Sequential):
        return list(module)
    return []


def attach(
    runners: Mapping[int, Any],
    fractions: Sequence[float] | None,
    row: Sequence[Action],
    device: torch.device,
) -> None:
    """Give each of this rank's stage runners whose fraction is > 0 its ``StageOffload``, for the
    micro-batches that ``row`` (this rank's program row) has an OFFLOAD for."""
    if not fractions:
        return
    chosen: dict[int, set[int]] = {}
    for action in row:
        if action.kind is OpKind.OFFLOAD:
            chosen.setdefault(action.stage, set()).add(action.microbatch)
    for s, runner in runners.items():
        if fractions[s] > 0:
            _refuse_selective(runner.module, s)
            module = runner.module
            runner.offload = StageOffload(
                s,
                fractions[s],
                frozenset(chosen.get(s, ())),
                device,
                layers=stage_layers(module),
                params=list(module.parameters()),
            )


def _refuse_selective(module: nn.Module, stage: int) -> None:
    """Selective checkpoints (``torch.utils.checkpoint`` with a policy) raise when a backward
    reads their saved outputs under saved-tensor hooks a second time, as a split backward does;
    refused here rather than at the first ``W``."""
    if any(isinstance(m, Recomputed) and m.mode == "selective" for m in module.modules()):
        raise ValueError(
            f"stage {stage} recomputes 'selective' and offloads: not run together; use 'full' "
            "recompute with offload, or no offload on that stage"
        )
