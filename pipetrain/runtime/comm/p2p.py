"""Point-to-point transfers: tensor metadata, batched isend/irecv, and waits that time out.

The lowered program fixes the order of transfers per pair of ranks (``schedule.lower``); this
module only posts them. A run of consecutive SEND/RECV actions is posted together (one
``dist.batch_isend_irecv`` on a single group, one by one on two: below); receives are waited right
before the compute that needs them. A sent buffer's memory goes as soon as it can: on NCCL at once
(below), elsewhere when the send is seen to have finished (polled before each compute action; on
gloo, whose sends report finished only once waited, at the end of the step).

On NCCL a sent buffer is let go of right after posting, as Megatron-Core's
``deallocate_pipeline_outputs`` does, without leaving it to the backend to keep it safe: a side
stream of the transport's own waits for each send (``work.wait()`` there orders that stream, not
the compute stream, after the transfer, and lets ProcessGroupNCCL drop any reference it stashed),
and the buffer is marked as used by that stream (``record_stream``), so the caching allocator
hands its block to no other tensor until the transfer has finished. The bytes are the same as
when the buffer was held until the host saw the send finish (the block cannot be reused before),
but that counted them as allocated for as long as the host ran ahead of the GPU — a few
activation-sized buffers per rank, the size of the gap by which pipetrain's peak allocated memory
exceeded Megatron-Core's on the same schedule (measured: docs/incumbents.md) — and
it let the block go only at the next compute action instead of the allocator's next look. The end
of a step orders the compute stream after the side stream, as waiting each send did.

Shapes are discovered, never declared: while discovering (the first step, or a step whose input
shapes changed) every forward transfer is preceded by a fixed-size int64 metadata message, and the
receiver waits for it before posting the payload. That is per-action blocking P2P, which the
lowered program's global order makes deadlock-free. Gradients need no metadata: their shapes are
those of the activations they belong to, which both ends know.

On NCCL every operation between two ranks runs, in the order posted, on one stream of the pair's
communicator, whichever way the data flows. A receive posted early (for a later action) then
holds back every send to that peer posted after it, until the peer's matching send arrives: in
schedules that trade in both directions with a neighbour (the V schedules, DualPipeV's F&B pairs),
a rank's outputs wait a round trip for its next inputs, which the simulator does not model and
which measured as extra bubble on 4 GPUs (docs/performance.md). So transfers to a higher rank and
transfers to a lower rank go through two process groups (``Transport(reverse_group=...)``): two
communicators, two streams, each still in the lowered order, so neither direction waits on the
other. With the directions apart, each transfer is also posted on its own rather than as one
``batch_isend_irecv``: NCCL completes a batch as one group, so a receive needed now, batched with
receives posted early for later actions, was waited for until the latest of them arrived
(DualPipeV's inputs arrived late; measured: docs/performance.md). One stream per direction and peer
carries only sends or only receives, in the lowered order, so posting one by one cannot deadlock;
on one shared group (``reverse_group`` absent) runs of transfers stay batched, which is what
makes opposite transfers between two ranks safe there.

Bool tensors travel as uint8 (gloo has no bool), and every wait is bounded so a rank that died
mid-step yields an error naming the waiting rank, the action and the peer, not a hang. On CPU
(gloo) the wait itself takes the timeout. On CUDA (NCCL) a wait with a timeout would block the host
thread until the transfer lands (ProcessGroupNCCL polls), so the host could no longer queue work
ahead of the GPU; there the wait only orders the compute stream after the transfer, and the bound
is the process group's own timeout and watchdog (``init_process_group(timeout=...)``, which
``pipetrain train`` sets from ``--timeout``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.comm.failures import Failures, closed_connection
from pipetrain.schedule.action import Action

#: a host wait on CUDA: how often it checks its transfer; after how long it starts reading the
#: failure notices (a healthy step's wait reads none), and how often then (s)
POLL_WORK_S = 0.0001
QUIET_WAIT_S = 1.0
POLL_NOTICES_S = 0.05

DTYPES = (  # what travels between stages; a dtype's code is its position
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}
META_LEN = 256


class PipelineTimeoutError(RuntimeError):
    """A wait on a peer did not finish within the pipeline's timeout."""


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(t.shape), t.dtype, bool(t.requires_grad))

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def encode(metas: tuple[TensorMeta, ...], device: torch.device) -> torch.Tensor:
    """Pack metadata into ``META_LEN`` int64s: count, then (dtype, requires_grad, ndim, dims…)."""
    flat = [len(metas)]
    for m in metas:
        if m.dtype not in DTYPE_CODE:
            raise TypeError(f"cannot send a {m.dtype} tensor between stages; legal: {DTYPES}")
        flat += [DTYPE_CODE[m.dtype], int(m.requires_grad), len(m.shape), *m.shape]
    if len(flat) > META_LEN:
        raise ValueError(
            f"a stage output of {len(metas)} tensors needs {len(flat)} metadata words; "
            f"at most {META_LEN} fit (fewer or lower-rank tensors)"
        )
    out = torch.zeros(META_LEN, dtype=torch.int64)
    out[: len(flat)] = torch.tensor(flat, dtype=torch.int64)
    if device.type != "cuda":
        return out.to(device)
    # From pinned memory without blocking: a pageable copy would wait for the device's stream,
    # which may itself wait on a transfer from a peer that failed, so the host would never read
    # that peer's notice.
    return out.pin_memory().to(device, non_blocking=True)


def decode(buffer: torch.Tensor) -> tuple[TensorMeta, ...]:
    flat = buffer.tolist()
    metas, i = [], 1
    for _ in range(flat[0]):
        code, rg, ndim = flat[i : i + 3]
        metas.append(TensorMeta(tuple(flat[i + 3 : i + 3 + ndim]), DTYPES[code], bool(rg)))
        i += 3 + ndim
    return tuple(metas)


def wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor as it travels: contiguous, bool viewed as uint8."""
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def unwire(t: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    return t.view(torch.bool) if meta.dtype == torch.bool else t


def recv_buffer(meta: TensorMeta, device: torch.device) -> torch.Tensor:
    dtype = torch.uint8 if meta.dtype == torch.bool else meta.dtype
    return torch.empty(meta.shape, dtype=dtype, device=device)


@dataclass
class Pending:
    """Transfers of one action: receive buffers fill (send buffers may go) once ``works`` end."""

    action: Action
    peer: int
    buffers: list[torch.Tensor]
    works: list
    metas: tuple[TensorMeta, ...] = ()

    def tensors(self) -> list[torch.Tensor]:
        """The received tensors in their own dtypes (call after ``Transport.wait``)."""
        return [unwire(b, m) for b, m in zip(self.buffers, self.metas)]


class Transport:
    """Posts transfers for program rank ``rank`` and waits with a timeout: on ``group`` the
    transfers to higher ranks, on ``reverse_group`` (same ranks; default ``group``) those to lower
    ranks."""

    def __init__(
        self,
        rank: int,
        group,
        device: torch.device,
        timeout: timedelta,
        reverse_group=None,
        failures: Failures | None = None,
    ) -> None:
        self.rank = rank
        self.failures = failures
        self.group = group
        self.reverse_group = group if reverse_group is None else reverse_group
        self.device = device
        self.timeout = timeout
        self._sends: list[Pending] = []
        #: on NCCL (CUDA, two groups), the stream that waits for sends, so that their buffers
        #: can go at once (module docstring); elsewhere sends are reaped once seen finished
        nccl = device.type == "cuda" and reverse_group is not None
        self.send_stream = torch.cuda.Stream(device) if nccl else None

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _group_of(self, kind: str, peer: int):
        """The group of a transfer: by the direction the data flows."""
        to_higher = peer > self.rank if kind == "send" else self.rank > peer
        return self.group if to_higher else self.reverse_group

    def post(self, ops: list[tuple[str, Pending, torch.Tensor]]) -> None:
        """Post ("send"|"recv", owner, tensor) ops: one by one on two groups, as one batch on
        one (see the module docstring); each owner collects its works."""
        if not ops:
            return
        try:
            works = self._post(ops)
        except RuntimeError as e:  # gloo refuses at once to send to a peer that closed
            owner = ops[0][1]
            raise self._failed(
                f"{owner.action} posting to rank {owner.peer}", e, owner.peer
            ) from None
        for (kind, owner, _), work in zip(ops, works):
            owner.works.append(work)
            if kind == "send" and (not self._sends or self._sends[-1] is not owner):
                self._sends.append(owner)
        if self.send_stream is not None:
            self._let_go_of_sends(self.send_stream)

    def _let_go_of_sends(self, stream) -> None:
        """Drop every posted send now; ``stream`` waits for them and holds their buffers' blocks
        until they finish (module docstring)."""
        sends, self._sends = self._sends, []
        if not sends:
            return
        with torch.cuda.stream(stream):
            for pending in sends:
                self.wait(pending)
                for buffer in pending.buffers:
                    buffer.record_stream(stream)

    def _post(self, ops: list[tuple[str, Pending, torch.Tensor]]) -> list[Any]:
        if self.reverse_group is self.group:
            p2p = [
                dist.P2POp(
                    dist.isend if kind == "send" else dist.irecv,
                    t,
                    self._global(o.peer),
                    self.group,
                )
                for kind, o, t in ops
            ]
            batch: list[Any] = dist.batch_isend_irecv(p2p)
            # A backend may coalesce the batch into a single work; then every owner waits on it.
            return batch if len(batch) == len(ops) else [batch[-1]] * len(ops)
        return [
            (dist.isend if kind == "send" else dist.irecv)(
                t, self._global(o.peer), self._group_of(kind, o.peer)
            )
            for kind, o, t in ops
        ]

    def abandon(self) -> None:
        """Drop every transfer in flight without waiting (a failed step): nothing of this
        pipeline's may keep its group's connections open."""
        for pending in self._sends:
            pending.works.clear()
        self._sends = []

    def let_go(self) -> None:
        """Let go of the process groups and of finished sends' works (the pipeline destroys the
        group it owns): nothing of a group may be left for the interpreter's teardown to free."""
        self.abandon()
        self.group = self.reverse_group = None

    def reap(self) -> None:
        """Release sends that have finished, and with them their buffers: each is waited first,
        which costs nothing once it has finished and makes a backend that stashes an async op's
        tensors until ``wait()`` (ProcessGroupNCCL's and ProcessGroupXCCL's stash) let go of them
        now rather than at its watchdog's next sweep. A send whose completion check failed is
        dropped unwaited: the failure surfaces at the next receive. A send is checked only once
        every earlier send to its peer has finished: one peer's sends finish in the order posted
        (one stream per peer and direction on NCCL), and checking every send in flight before
        every action made a step's sweeps quadratic in its sends (on gloo, whose sends finish only
        once waited, all of a step's are in flight; NCCL with two groups lets go of its sends at
        once and has none here)."""
        running: list[Pending] = []
        blocked: set[int] = set()  # peers with an earlier send still running
        for pending in self._sends:
            if pending.peer in blocked:
                running.append(pending)
                continue
            states = [_done(w) for w in pending.works]
            if any(state is False for state in states):
                running.append(pending)
                blocked.add(pending.peer)
                continue
            for work, state in zip(pending.works, states):
                if state is True:
                    self.wait_work(work, str(pending.action), pending.peer)
            pending.works = []
        self._sends = running

    def drain(self) -> None:
        """Wait for every send still in flight (end of step); on CUDA, order the compute stream
        after the sends' stream."""
        sends, self._sends = self._sends, []
        for s in sends:
            self.wait(s)
        if self.send_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.send_stream)

    def wait(self, pending: Pending) -> None:
        works, pending.works = pending.works, []
        while works:
            self.wait_work(works.pop(0), str(pending.action), pending.peer)

    def broadcast(self, tensor: torch.Tensor, root: int, what: str) -> None:
        """``tensor`` from group rank ``root`` to every rank of the transfer group, waited with the
        timeout (a dead ``root`` fails naming it)."""
        group = self.group
        src = root if group is None else dist.get_global_rank(group, root)
        work = dist.broadcast(tensor, src, group=group, async_op=True)
        self.wait_work(work, what, root)

    def wait_work(self, work, what: str, peer: int) -> None:
        """Wait for ``work``; past the timeout, fail naming this rank, ``what`` and ``peer``; a
        peer that failed or closed its connection is named as such (``failures``)."""
        try:
            ok = work.wait() if self.device.type == "cuda" else work.wait(self.timeout)
        except RuntimeError as e:
            del work  # a failed transfer must not keep this pipeline's connections open
            raise self._failed(f"{what} waited on rank {peer}", e, peer) from None
        if ok is False:
            raise PipelineTimeoutError(
                f"rank {self.rank}: {what} waited on rank {peer} for more than "
                f"{self.timeout.total_seconds():g} s"
            )

    def _failed(self, what: str, error: RuntimeError, peer: int) -> Exception:
        """The error for a transfer that failed: a peer's failure where one was posted or the
        peer closed its connection, else a timeout."""
        closed = closed_connection(error)
        if self.failures is not None:
            notices = self.failures.read(timedelta(seconds=1) if closed else timedelta(0))
            if notices or closed:
                return self.failures.explain(f"rank {self.rank}: {what}", peer, error, notices)
        return PipelineTimeoutError(
            f"rank {self.rank}: {what} and failed within {self.timeout.total_seconds():g} s "
            f"(did rank {peer} fail or stop?): {error}"
        )

    def recv_meta(self, action: Action, peer: int) -> tuple[TensorMeta, ...]:
        """Blocking receive of a metadata message (shape discovery). The host needs its
        content, so on CUDA it waits for the transfer itself — polling, not blocking in a device
        synchronisation, so that a peer's failure notice (a peer that failed before sending)
        stops this rank within moments rather than at the process group's timeout."""
        buf = torch.empty(META_LEN, dtype=torch.int64, device=self.device)
        pending = Pending(action, peer, [buf], [])
        self.post([("recv", pending, buf)])
        if self.device.type == "cuda":
            self._poll(pending.works, f"{action} waited on rank {peer} for its shapes", peer)
        self.wait(pending)
        return decode(buf.cpu())

    def _poll(self, works: list[Any], what: str, peer: int) -> None:
        """Until every work in ``works`` has finished (the host needs their result next): after
        the first ``QUIET_WAIT_S``, read the failure notices now and then (a notice: raise the
        peer's error), and stop at the timeout. The wait itself is what a device
        synchronisation would cost, to within ``POLL_WORK_S``."""
        start = time.monotonic()
        deadline = start + self.timeout.total_seconds()
        next_read = start + QUIET_WAIT_S
        while not all(_done(w) is not False for w in works):
            now = time.monotonic()
            if self.failures is not None and now >= next_read:
                notices = self.failures.read(timedelta(0))
                if notices:
                    raise self.failures.explain(
                        f"rank {self.rank}: {what}", peer, RuntimeError("no transfer"), notices
                    )
                next_read = now + POLL_NOTICES_S
            if now >= deadline:
                raise PipelineTimeoutError(
                    f"rank {self.rank}: {what} for more than {self.timeout.total_seconds():g} s"
                )
            time.sleep(POLL_WORK_S)

    def send_meta(self, action: Action, peer: int, metas: tuple[TensorMeta, ...]) -> None:
        buf = encode(metas, self.device)
        self.post([("send", Pending(action, peer, [buf], []), buf)])


def _done(work) -> bool | None:
    """True: finished; False: still running; None: the check itself failed (counts as over)."""
    try:
        return bool(work.is_completed())
    except RuntimeError:
        return None
