"""Ranks agree on what they run, or are refused together with one message naming the difference.

Every rank must build its ``Pipeline`` from the same arguments and step it with the same batches.
A rank that differs (another micro-batch count, schedule or stage count; inputs of another shape)
would otherwise run a different program and wait for transfers that never come, until
``timeout``. So the ranks exchange a small record of what they are about to run, once when a
pipeline is built and once at the first step of each new input shape, and compare it field by
field; the first field that differs is refused on every rank, naming the field, both values and
the ranks.

The exchange goes through the process group's key-value store: each rank writes its record under
the pipeline's keys and polls for the others' until ``timeout``, or until a failure notice says a
peer will never write (``failures``). Object collectives (``all_gather_object``) would not do:
gloo runs them under the group's own timeout (30 minutes by default), not the pipeline's. A
pipeline's keys are ``pipetrain/<n>/...`` where ``n`` counts the pipelines this rank built on the
group (kept in the store, so nothing is process-global here): the ``n``-th pipeline of every rank
meets the ``n``-th of every other.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from pipetrain.runtime.comm.failures import (
    Failures,
    PipelineRefused,
    first_notice,
    notice_of,
    peer_error,
)
from pipetrain.runtime.comm.p2p import PipelineTimeoutError
from pipetrain.runtime.torch_compat import store_of
from pipetrain.schedule.program import Program


class RankMismatchError(PipelineRefused):
    """Ranks were given different arguments (every rank must pass the same)."""


def pipeline_prefix(group, rank: int) -> str:
    """Store-key prefix of this rank's next pipeline on ``group``: ``pipetrain/<n>``."""
    n = store_of(group).add(f"pipetrain/count/{rank}", 1)
    return f"pipetrain/{n}"


def fail_next_pipeline(error: BaseException, group=None) -> None:
    """Tell the peers that this rank failed with ``error`` before building its next pipeline on
    ``group`` (cutting, loading or placing its layers): their pipeline's first exchange reads
    the notice and raises at once, naming this rank and ``error`` (``PipelineRefused`` for a
    ``ValueError``, as construction's own refusals), instead of waiting ``timeout`` for a record
    this rank never writes. A notice for a pipeline nobody builds is never read, so calling this
    after any failure is harmless; it never raises (the store may have gone with a peer)."""
    try:
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        if world_size < 2:
            return
        failures = Failures(group, rank, world_size, pipeline_prefix(group, rank))
        refused = isinstance(error, ValueError)
        failures.post(getattr(error, "origin", rank), notice_of(error), refused)
    except Exception:  # no process group, or its store is gone: nobody is left to tell
        pass


class Agreement:
    """The exchanges of one pipeline (see the module docstring)."""

    def __init__(
        self, group, rank: int, world_size: int, timeout: timedelta, failures: Failures
    ) -> None:
        self.store = store_of(group)
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.failures = failures
        self.rounds = 0
        self.steps = 0
        #: how this rank runs its next train step under ``cuda_graph=True`` (``StepGraph`` sets
        #: it): ``"eager"``, ``"capture"`` or ``"replay"``; announced with the step's shapes
        self.graph_step = "eager"
        self.step_records: dict[str, dict] = {}  # per mode, the last shapes all ranks agreed on

    def let_go(self) -> None:
        """Drop the store (the pipeline is closed, or the interpreter exits; see ``Failures``)."""
        del self.store

    def exchange(self, what: str, record: dict, stepping: dict | None = None) -> list[dict]:
        """Write ``record``, read every rank's (rank order), refuse the first differing field.

        ``stepping``: this step's shapes; a peer that announced other shapes for this step (it
        knew its shapes and went on into the step) is refused at once, not after ``timeout``."""
        records = self.gather(what, record, stepping)
        _refuse_differences(what, records)
        return records

    def gather(self, what: str, record: dict, stepping: dict | None = None) -> list[dict]:
        """Every rank's ``record`` (JSON-able), rank order, within ``timeout``: the store-based
        all-gather behind ``exchange``, for records that differ by design (what a rank holds)."""
        self.rounds += 1
        prefix = f"{self.failures.prefix}/agree/{self.rounds}"
        self.store.set(f"{prefix}/{self.rank}", json.dumps(record))
        if self.world_size == 1:
            return [record]
        keys = [f"{prefix}/{r}" for r in range(self.world_size)]

        def missing() -> list[int]:
            if self.store.check(keys):
                return []
            return [r for r, k in enumerate(keys) if not self.store.check([k])]

        between = None if stepping is None else lambda: self._refuse_announced(what, stepping)
        self._wait(
            what, missing, between, " (did they fail, stop, or step with inputs of another shape?)"
        )
        return [json.loads(self.store.get(k)) for k in keys]

    def hand_on(self, name: str, record: object) -> None:
        """Leave ``record`` (JSON-able) under ``name`` for the one peer that ``receive``s it."""
        self.store.set(f"{self.failures.prefix}/hand/{name}", json.dumps(record))

    def receive(self, name: str, what: str, sender: int) -> object:
        """The record ``sender`` handed on under ``name``, within ``timeout`` (or its failure)."""
        key = f"{self.failures.prefix}/hand/{name}"
        self._wait(what, lambda: [] if self.store.check([key]) else [sender])
        return json.loads(self.store.get(key))

    def construction(self, program: Program, local_arities: dict[int, tuple[int, float]]):
        """Agree on the program (construction); returns every stage's arity, stage order."""
        record = {
            "schedule": program.name,
            "num_microbatches": program.num_microbatches,
            "num_stages": program.num_stages,
            "world_size": program.num_ranks,
            "placement": [
                list(program.placement.stages_of_rank(r)) for r in range(self.world_size)
            ],
            "program": program_fingerprint(program),
            "torch": torch.__version__,
            "*arities": {str(s): [lo, _finite(hi)] for s, (lo, hi) in local_arities.items()},
        }
        records = self.exchange("building the Pipeline", record)
        table: dict[int, tuple[int, float]] = {}
        for r in records:
            for s, (lo, hi) in r["*arities"].items():
                table[int(s)] = (lo, float("inf") if hi is None else hi)
        return [table[s] for s in range(program.num_stages)]

    def step(self, mode: str, inputs, targets, batch_size: int) -> None:
        """Before a step: if the inputs' or targets' shapes are new to this rank, agree on them and
        on a fingerprint of their values (read only then: a step with known shapes costs one
        comparison of small tuples here, nothing on the device)."""
        shapes = {
            "mode": mode,
            "batch size": batch_size,
            "input shapes and dtypes per micro-batch": [_metas(x) for x in inputs],
            "target shapes and dtypes per micro-batch": [_metas(t) for t in targets],
        }
        self.steps += 1
        # One store write per step: a peer whose shapes are new to it finds these shapes here
        # (see ``exchange``) if this rank thinks nothing changed.
        announced = [self.steps, shapes, self.graph_step]
        self.store.set(self._announce_key(self.rank), json.dumps(announced))
        if shapes == self.step_records.get(mode):
            return
        record = {
            **shapes,
            "input values (fingerprint)": _fingerprint([t for x in inputs for t in x]),
            "target values (fingerprint)": _fingerprint([t for y in targets for t in _tensors(y)]),
        }
        self.exchange(f"the first {mode} step with these shapes", record, shapes)
        self.step_records[mode] = shapes

    def captured(self) -> None:
        """After this rank captured its step as a CUDA graph, before the first replay: wait for
        every peer that captures the same step to have captured it, or fail with the first
        failure notice. A peer whose capture failed never replays, and this rank, replaying,
        would wait on the device for its transfers for good. Peers that run this step eagerly
        or replay an older graph (their own parameters changed, or did not) are not waited for:
        they run the same transfers."""
        step, prefix = self.steps, self.failures.prefix
        self.store.set(f"{prefix}/captured/{step}/{self.rank}", "1")

        def waited_for(r: int) -> bool:
            if r == self.rank or self.store.check([f"{prefix}/captured/{step}/{r}"]):
                return False
            if not self.store.check([self._announce_key(r)]):
                return True  # not started this step yet
            theirs, _, how = json.loads(self.store.get(self._announce_key(r)))
            return theirs < step or (theirs == step and how == "capture")

        def missing() -> list[int]:
            return [r for r in range(self.world_size) if waited_for(r)]

        self._wait("capturing the step as one CUDA graph", missing)

    def _wait(
        self,
        what: str,
        missing: Callable[[], list[int]],
        between: Callable[[], None] | None = None,
        hint: str = "",
    ) -> None:
        """Poll until ``missing()`` names no rank, within ``timeout``; a peer's failure notice
        ends the wait at once with its error (unless nothing is missing by then: a peer may have
        done its part, then failed). ``between``: a check run each round."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        pause = 0.001
        while missing():
            notices = self.failures.read(timedelta(0))
            if notices and missing():
                notice = first_notice(notices)
                # the notice names its own phase; this rank's wait (``what``) would mislead
                text = f"rank {self.rank} stopped: rank {notice[0]} failed: {notice[1]}"
                raise peer_error(text, notice)
            if between is not None:
                between()
            if time.monotonic() >= deadline:
                raise PipelineTimeoutError(
                    f"rank {self.rank}: {what}: rank(s) {missing()} did not arrive within "
                    f"{self.timeout.total_seconds():g} s{hint}"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _announce_key(self, rank: int) -> str:
        return f"{self.failures.prefix}/step/{rank}"

    def _refuse_announced(self, what: str, shapes: dict) -> None:
        for r in range(self.world_size):
            key = self._announce_key(r)
            if r == self.rank or not self.store.check([key]):
                continue
            step, theirs, _ = json.loads(self.store.get(key))
            if step == self.steps and theirs != shapes:
                records = [shapes, theirs] if self.rank < r else [theirs, shapes]
                ranks = sorted((self.rank, r))
                _refuse_differences(what, records, ranks)


def _finite(x: float) -> float | None:
    return None if x == float("inf") else x


def program_fingerprint(program: Program) -> str:
    """A short hash of every rank's actions: equal programs, equal fingerprints."""
    text = repr([[str(a) for a in row] for row in program.actions])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _metas(value) -> object:
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype).removeprefix("torch.")]
    if isinstance(value, (tuple, list)):
        return [_metas(v) for v in value]
    return type(value).__name__


def _fingerprint(tensors: Sequence[torch.Tensor]) -> list[str]:
    """Two sums per tensor (plain and position-weighted), read in one transfer: equal inputs give
    equal sums bit for bit; different inputs almost surely do not (as text: NaN equals NaN)."""
    if not tensors:
        return []
    sums = []
    for t in tensors:
        flat = t.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
        sums += [flat.sum(), (flat * weights).sum() / max(flat.numel(), 1)]
    return [repr(v) for v in torch.stack(sums).cpu().tolist()]


def _refuse_differences(what: str, records: list[dict], ranks: list[int] | None = None) -> None:
    """Raise ``RankMismatchError`` for the first field on which some rank differs from the first
    (``ranks``: whose records they are; default 0, 1, ...; fields starting with ``*`` are per-rank
    by design)."""
    ranks = ranks if ranks is not None else list(range(len(records)))
    first = records[0]
    for field in first:
        if field.startswith("*"):
            continue
        for r, record in zip(ranks[1:], records[1:]):
            if record.get(field) != first[field]:
                raise RankMismatchError(
                    f"ranks disagree on {field} ({what}): rank {ranks[0]} has "
                    f"{_short(first[field])}, rank {r} has {_short(record.get(field))}; every rank "
                    "must pass the same arguments to Pipeline and to each step"
                )


def _short(value: object, limit: int = 160) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."
