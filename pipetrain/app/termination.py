"""SIGTERM in a worker: every rank stops after the same step, writes a checkpoint, and exits with
``TERMINATED``, so that a requeued job resumes where this one stopped.

Slurm (at a job's time limit, on preemption, on ``scancel``) and Kubernetes (on eviction) send
SIGTERM, wait a grace period, then SIGKILL. With ``--checkpoint-on-term`` a worker catches
SIGTERM instead of dying of it: the handler only notes it (a Python handler runs between
bytecodes, so a rank inside a collective finishes it first), and once per step every rank
takes the MAX of its note over the default group — one all-reduce of one number, so every rank
decides at the same step, also when the signal reached only some of them or reached them in
different steps. The ranks then write the step's checkpoint together (unless the step's periodic
one was just written) and leave the loop with ``Terminated``. Megatron-LM's
``--exit-signal-handler`` stops the same way; torchtitan relies on its periodic checkpoints.

Without ``--checkpoint-on-term`` SIGTERM keeps its default action: every process ends at once
and the run resumes from its last periodic checkpoint. Either way the launcher (``app.
processes``, or torchrun's agent with ``--shutdown-timeout``) kills what is left after the
grace period (``--term-grace``), so a step longer than the grace is abandoned, never waited for.

``TERMINATED`` is 75, ``EX_TEMPFAIL`` of BSD's ``sysexits.h`` ("a temporary failure; the
user is invited to retry"): distinct from 0 (trained), 1 (stopped or failed), 2 (refused) and
128 + a signal (killed), so a batch script can requeue on it alone.

torch is imported inside functions only, so ``pipetrain --help`` stays fast.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipetrain.app.config import TrainConfig

if TYPE_CHECKING:
    import torch

#: the exit status of a run that stopped on SIGTERM after writing its checkpoint (EX_TEMPFAIL)
TERMINATED = 75


class Terminated(Exception):
    """Every rank stopped after ``step`` on SIGTERM (``checkpoint``: the folder written then)."""

    def __init__(self, step: int, total: int, checkpoint: Path | None, waited: float) -> None:
        self.step, self.checkpoint = step, checkpoint
        kept = (
            f"checkpoint {checkpoint}; a restart resumes from it (--resume)"
            if checkpoint is not None
            else "no checkpoint (no --checkpoint-dir)"
        )
        super().__init__(
            f"stopped by SIGTERM after step {step} of {total} ({waited:.1f} s after the signal), "
            f"every rank at the same step; {kept}"
        )


class TermWatch:
    """A worker's SIGTERM, noted by a handler and agreed on once per step (see the module
    docstring). Inactive without ``--checkpoint-on-term``: SIGTERM then ends the process."""

    def __init__(self, config: TrainConfig, device: torch.device) -> None:
        self.active = config.checkpoint_on_term
        self.device = device
        self.asked_at: float | None = None
        self._previous: object = None
        if self.active:
            self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, _signum: int, _frame: object) -> None:
        if self.asked_at is None:
            self.asked_at = time.monotonic()

    def agreed(self) -> bool:
        """Whether any rank has had SIGTERM: the same answer on every rank (collective over the
        default group when active; False at once otherwise)."""
        if not self.active:
            return False
        import torch
        import torch.distributed as dist

        flag = torch.tensor([0.0 if self.asked_at is None else 1.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def stopped(self, step: int, total: int, checkpoint: Path | None) -> Terminated:
        """The exception that leaves the loop after ``step`` (a peer's signal: waited 0)."""
        waited = 0.0 if self.asked_at is None else time.monotonic() - self.asked_at
        return Terminated(step, total, checkpoint, waited)

    def close(self) -> None:
        """Give SIGTERM its previous handler back."""
        if self.active and self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]
            self._previous = None

    def __enter__(self) -> TermWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_termination(config: TrainConfig) -> None:
    """``--checkpoint-on-term`` writes into ``--checkpoint-dir`` (``ValueError`` without it)."""
    if config.checkpoint_on_term and config.checkpoint_dir is None:
        raise ValueError(
            "--checkpoint-on-term writes a checkpoint on SIGTERM: give --checkpoint-dir DIR"
        )


__all__ = ["TERMINATED", "TermWatch", "Terminated", "check_termination"]
