"""Diagnostic variants of pipetrain's runtime for ``gpu_pipeline.py``: each puts back, for one
measurement, a behaviour the runtime had before a change, so one run shows that change's before
and after. ``DIAGNOSTICS`` maps the row name (``gpu_report``) to its context manager.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist
from gpu_report import BATCHED, HOSTWAIT, ONEGROUP


@contextlib.contextmanager
def host_blocking_waits():
    """Diagnostic of the OLD runtime behaviour, for the ``pipetrain-hostwait`` rows only.

    Before commit ded2659 ``Transport.wait_work`` passed its timeout to ``Work.wait`` on every
    backend; on NCCL that makes ProcessGroupNCCL block the host thread, polling until the transfer
    lands (a host sync per receive), so the host can no longer queue work ahead of the GPU. The
    runtime now waits without a timeout on CUDA (the wait only orders the compute stream). This
    restores the old host-blocking wait for one measurement and puts the fix back afterwards, so
    one run shows the before (``pipetrain-hostwait``) and after (``pipetrain``) of that change.
    """
    from pipetrain.runtime import p2p

    fixed = p2p.Transport.wait_work

    def old_wait_work(self, work, what: str, peer: int) -> None:
        try:
            ok = work.wait(self.timeout)  # host-blocking on NCCL: the pre-fix code, verbatim
        except RuntimeError as e:
            raise p2p.PipelineTimeoutError(
                f"rank {self.rank}: {what} waited on rank {peer} and failed within "
                f"{self.timeout.total_seconds():g} s (did rank {peer} fail or stop?): {e}"
            ) from e
        if ok is False:
            raise p2p.PipelineTimeoutError(
                f"rank {self.rank}: {what} waited on rank {peer} for more than "
                f"{self.timeout.total_seconds():g} s"
            )

    p2p.Transport.wait_work = old_wait_work
    try:
        yield
    finally:
        p2p.Transport.wait_work = fixed


@contextlib.contextmanager
def one_group():
    """Diagnostic for the ``pipetrain-onegroup`` rows: the runtime without its second NCCL group
    (transfers both ways between two ranks on one communicator, so on one stream in posting order,
    as before the change that added the group); put back afterwards."""
    from pipetrain.runtime import pipeline

    fixed = pipeline._reverse_group
    pipeline._reverse_group = lambda group: None
    try:
        yield
    finally:
        pipeline._reverse_group = fixed


@contextlib.contextmanager
def batched_transfers():
    """Diagnostic for the ``pipetrain-batched`` rows: ``Transport.post`` as it was before
    transfers on two groups were posted one by one (one batch per group); put back afterwards."""
    from pipetrain.runtime import p2p

    fixed = p2p.Transport.post

    def old_post(self, ops) -> None:
        batches: dict[int, list] = {}
        groups = {}
        for op in ops:
            group = self._group_of(op[0], op[1].peer)
            groups[id(group)] = group
            batches.setdefault(id(group), []).append(op)
        for key, batch in batches.items():
            group = groups[key]
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(
                        dist.isend if kind == "send" else dist.irecv,
                        t,
                        self._global(o.peer),
                        group,
                    )
                    for kind, o, t in batch
                ]
            )
            if len(works) != len(batch):
                works = [works[-1]] * len(batch)
            for (kind, owner, _), work in zip(batch, works):
                owner.works.append(work)
                if kind == "send" and (not self._sends or self._sends[-1] is not owner):
                    self._sends.append(owner)

    p2p.Transport.post = old_post
    try:
        yield
    finally:
        p2p.Transport.post = fixed


DIAGNOSTICS = {
    HOSTWAIT: host_blocking_waits,
    ONEGROUP: one_group,
    BATCHED: batched_transfers,
}
