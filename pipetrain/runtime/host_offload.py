"""Activation offload on one stage: saved tensors to host memory after the forward, back before
the backward, as the program's OFFLOAD/RELOAD actions say (``schedule.offload``).

PipeOffload (Wan et al. 2025, arXiv 2503.01328): a stage's activations wait between its forward
and its backward while other micro-batches run, so they can live in host memory meanwhile. The
forward of an offloaded micro-batch runs under ``torch.autograd.graph.saved_tensors_hooks``: each
tensor autograd saves is wrapped in a ``_Packed`` entry (parameters and tensors under
``min_bytes`` are left as they are: moving them saves nothing). ``OFFLOAD`` copies the first
entries, in the order they were saved, until at least ``fraction`` of the saved bytes are moved
(whole tensors: never less than the planner counted on), into host memory and drops the device
copy; ``RELOAD`` copies them back; the backward's unpack hook hands autograd the
reloaded tensor.

On CUDA the copies run on a copy stream of their own, ordered by events: the offload waits for
the forward's work on the compute stream, the device tensor is marked used on the copy stream
(``record_stream``) before it is dropped so the allocator cannot hand its memory out while the copy
reads it, host buffers are pinned, and the backward's stream waits for the reload's event (the
reloaded tensors are marked used on it too). On CPU a copy is a plain copy into separate storage,
so a float64 run is exact and shows the tensors really moved (``moved_bytes``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from pipetrain.schedule.action import Action, OpKind

#: saved tensors smaller than this stay where they are (biases, norms' statistics)
MIN_BYTES = 1024


class _Packed:
    """One saved tensor: on the device, or in host memory between OFFLOAD and RELOAD."""

    __slots__ = ("device", "host", "nbytes")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device: torch.Tensor | None = tensor
        self.host: torch.Tensor | None = None
        self.nbytes = tensor.numel() * tensor.element_size()


class _Micro:
    """A micro-batch's saved entries and the events that order its copies."""

    def __init__(self) -> None:
        self.entries: list[_Packed] = []
        self.by_id: dict[int, _Packed] = {}  # one entry per tensor saved several times
        self.moved: list[_Packed] = []
        self.event: torch.cuda.Event | None = None


class StageOffload:
    """What one stage offloads: ``fraction`` of each offloaded micro-batch's saved bytes.

    ``microbatches`` are those the program offloads on this stage (the others run unhooked).
    ``moved_bytes`` counts the bytes copied to host memory (this object's own counter).
    """

    def __init__(
        self,
        stage: int,
        fraction: float,
        microbatches: frozenset[int],
        device: torch.device,
        min_bytes: int = MIN_BYTES,
    ) -> None:
        self.stage, self.fraction, self.microbatches = stage, fraction, microbatches
        self.device, self.min_bytes = device, min_bytes
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.micro: dict[int, _Micro] = {}
        self.moved_bytes = 0
        #: bytes of the tensors the offloaded micro-batches saved (offloadable or not)
        self.saved_bytes = 0

    def capture(self, mb: int) -> AbstractContextManager[object]:
        """Around micro-batch ``mb``'s forward: wrap what autograd saves (if it is offloaded)."""
        if mb not in self.microbatches or not torch.is_grad_enabled():  # eval saves nothing
            return nullcontext()
        micro = self.micro[mb] = _Micro()

        def pack(tensor: torch.Tensor) -> object:
            if isinstance(tensor, nn.Parameter) or tensor.numel() * tensor.element_size() < (
                self.min_bytes
            ):
                return tensor
            entry = micro.by_id.get(id(tensor))
            if entry is None:
                entry = micro.by_id[id(tensor)] = _Packed(tensor)
                micro.entries.append(entry)
            return entry

        return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)

    def offload(self, mb: int) -> None:
        """``OFFLOAD``: copy at least ``fraction`` of the saved bytes to host memory."""
        micro = self.micro[mb]
        micro.by_id.clear()  # ids of freed tensors may be reused: only the entries count now
        budget = self.fraction * sum(e.nbytes for e in micro.entries)
        chosen, total = [], 0
        for entry in micro.entries:  # whole tensors: at least the fraction, so memory is as planned
            if total >= budget:
                break
            chosen.append(entry)
            total += entry.nbytes
        with self._on_copy_stream():
            for entry in chosen:
                source = entry.device
                assert source is not None
                entry.host = torch.empty_like(source, device="cpu", pin_memory=self.cuda)
                entry.host.copy_(source, non_blocking=self.cuda)
                if self.cuda:
                    source.record_stream(self._copy_stream())
                entry.device = None
            micro.event = self._record()
        micro.moved = chosen
        self.moved_bytes += total
        self.saved_bytes += sum(e.nbytes for e in micro.entries)

    def reload(self, mb: int) -> None:
        """``RELOAD``: copy the micro-batch's offloaded tensors back to the device."""
        micro = self.micro[mb]
        # allocated on the compute stream, which reads and frees them: the caching allocator
        # keeps a pool per stream, and blocks made on the copy stream would never be reused by
        # compute (measured on CUDA: the peak rose instead of falling)
        for entry in micro.moved:
            assert entry.host is not None
            entry.device = torch.empty_like(entry.host, device=self.device)
        with self._on_copy_stream():
            if micro.event is not None:
                self._copy_stream().wait_event(micro.event)
            for entry in micro.moved:
                assert entry.device is not None and entry.host is not None
                entry.device.copy_(entry.host, non_blocking=self.cuda)
                if self.cuda:
                    entry.device.record_stream(self._copy_stream())
            micro.event = self._record()

    def ready(self, mb: int) -> None:
        """Before micro-batch ``mb``'s backward: its reloads are done, as the compute stream sees."""
        micro = self.micro.pop(mb, None)
        if micro is None:
            return
        if any(entry.device is None for entry in micro.moved):
            raise RuntimeError(
                f"stage {self.stage} micro-batch {mb}: its backward runs before its RELOAD"
            )
        if self.cuda and micro.event is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(micro.event)
            for entry in micro.moved:
                assert entry.device is not None
                entry.device.record_stream(main)
        for entry in micro.moved:
            entry.host = None

    def release(self) -> None:
        """Drop every micro-batch's entries (a step that failed part-way, or ``close``)."""
        self.micro.clear()

    def _copy_stream(self) -> torch.cuda.Stream:
        assert self.stream is not None
        return self.stream

    def _on_copy_stream(self) -> AbstractContextManager[object]:
        if not self.cuda:
            return nullcontext()
        stream = self._copy_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    def _record(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._copy_stream())
        return event


def _unpack(saved: object) -> torch.Tensor:
    if isinstance(saved, _Packed):
        if saved.device is None:
            raise RuntimeError("a saved activation was read while offloaded (no RELOAD before it)")
        return saved.device
    assert isinstance(saved, torch.Tensor)
    return saved


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
            runner.offload = StageOffload(s, fractions[s], frozenset(chosen.get(s, ())), device)


def _refuse_selective(module: nn.Module, stage: int) -> None:
    """Selective checkpoints (``torch.utils.checkpoint`` with a policy) raise when a backward
    reads their saved outputs under saved-tensor hooks a second time, as a split backward does;
    refused here rather than at the first ``W``."""
    from pipetrain.runtime.backward.activation_checkpoint import Recomputed

    if any(isinstance(m, Recomputed) and m.mode == "selective" for m in module.modules()):
        raise ValueError(
            f"stage {stage} recomputes 'selective' and offloads: not run together; use 'full' "
            "recompute with offload, or no offload on that stage"
        )
