"""One lowered program per micro-batch count, so that one ``Pipeline`` steps batches whose count
of micro-batches changes from step to step.

Packed variable-length training fixes a step's tokens, not its micro-batches
(``pipetrain train --global-batch-tokens``): every rank derives each step's count from (seed,
step) alike (``app.data.step_batches``) and passes it to ``Pipeline.step(...,
num_microbatches=n)``. ``n``'s program is built, lowered and validated the first time ``n`` is
asked for and kept; the ranks agree on it then, once (one store exchange of its fingerprint,
``comm.agreement``), and never per transfer: per-transfer shape handshakes are where Megatron-LM's
variable-length pipelines deadlocked. Transfer shapes are learnt, and a step's shapes agreed on,
once per count too (each count keeps its own caches and agreed shapes), so steps that alternate
between counts rediscover and re-agree nothing.

What depends on the count is switched with the program: each stage's last weight-gradient piece
(where gradient hooks fire), each stage's last use (where data-parallel syncs start), the extra
loss terms' weight ``1/M``, the dropout keys' first global micro-batch (``replica × M``), and the
forward-only program of ``eval_step``.

A program given as a ``Program`` fixes its count, a captured CUDA graph replays one shape, and
host offload picks its micro-batches in the program: those refuse another count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipetrain.runtime import resolve
from pipetrain.runtime.comm.agreement import Agreement, program_fingerprint
from pipetrain.runtime.dropout_rng import DropoutKeys
from pipetrain.runtime.executor import MetaCache
from pipetrain.runtime.extra_losses import StepTerms, term_weight
from pipetrain.schedule.action import Action
from pipetrain.schedule.program import Program


@dataclass
class CountProgram:
    """One count's program and what this rank derives from it."""

    program: Program
    #: the stages whose last compute action each action is (data-parallel syncs start there)
    last_uses: dict[Action, tuple[int, ...]]
    #: per stage, the micro-batch of its last weight-gradient piece (gradient hooks fire there)
    weight_pieces: dict[int, int]
    #: per mode, the transfer shapes learnt for this count (``executor.cache_for``)
    caches: dict[str, MetaCache] = field(default_factory=dict)
    #: per mode, the step shapes the ranks agreed on at this count (``Agreement.step_records``)
    agreed: dict[str, dict] = field(default_factory=dict)
    #: the forward-only program, built at the first ``eval_step`` of this count
    eval_program: Program | None = None

    def forward_only(self, rank: int, receive_lead: int | None) -> tuple[Action, ...]:
        """This rank's row of the forward-only program (``resolve.forward_only``, built once)."""
        if self.eval_program is None:
            self.eval_program = resolve.forward_only(self.program, receive_lead)
        return self.eval_program.actions[rank]

    @classmethod
    def of(cls, program: Program, rank: int) -> CountProgram:
        row = program.actions[rank]
        return cls(program, resolve.last_uses(row), resolve.last_weight_pieces(row))


class ProgramsByCount:
    """A pipeline's programs by micro-batch count (see the module docstring).

    ``build``: the program of a count (the schedule's, lowered and validated as at construction);
    ``fixed``: why this pipeline runs only its first count (None: it runs any the schedule
    accepts). ``terms`` (its runners) and ``keys`` are what ``select`` switches besides."""

    def __init__(
        self,
        first: Program,
        build: Callable[[int], Program],
        fixed: str | None,
        agreement: Agreement,
        terms: StepTerms,
        keys: DropoutKeys,
    ) -> None:
        self.default = first.num_microbatches
        self.build, self.fixed, self.agreement = build, fixed, agreement
        self.rank, self.terms, self.keys = agreement.rank, terms, keys
        self.replica = keys.microbatch_offset // self.default  # the keys start at replica × M
        self.programs = {self.default: CountProgram.of(first, self.rank)}
        self.programs[self.default].agreed = agreement.step_records
        self.split = resolve.split_backward_stages(first.actions[self.rank])
        self.active = self.programs[self.default]

    def select(self, count: int | None) -> CountProgram:
        """The program of ``count`` micro-batches (None: the pipeline's own count), built and
        agreed on when new, and made the active one."""
        n = self.default if count is None else count
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_microbatches must be an integer >= 1, got {n!r}")
        if n not in self.programs:
            self.programs[n] = self._new(n)
        chosen = self.programs[n]
        if chosen is not self.active:
            self._switch(chosen)
        return chosen

    def clear(self) -> None:
        """Forget every count's learnt transfer shapes (the pipeline closed)."""
        for entry in self.programs.values():
            entry.caches.clear()

    def _new(self, n: int) -> CountProgram:
        if self.fixed is not None:
            raise ValueError(
                f"num_microbatches={n}, but this pipeline runs only {self.default}: {self.fixed}"
            )
        program = self.build(n)
        if resolve.split_backward_stages(program.actions[self.rank]) != self.split:
            raise ValueError(
                f"{program.name} with {n} micro-batches splits the backward of other stages than "
                f"with {self.default}: give counts whose programs split alike"
            )
        record = {"num_microbatches": n, "program": program_fingerprint(program)}
        self.agreement.exchange(f"the first step of {n} micro-batches", record)
        return CountProgram.of(program, self.rank)

    def _switch(self, chosen: CountProgram) -> None:
        n = chosen.program.num_microbatches
        weight = term_weight(n, self.terms.data_parallel)
        for runner in self.terms.runners:
            runner.last_weight_microbatch = chosen.weight_pieces.get(runner.index)
            runner.extra_weight = weight
        self.terms.num_microbatches = n
        self.keys.microbatch_offset = self.replica * n
        self.agreement.step_records = chosen.agreed
        self.active = chosen


def for_pipeline(
    first: Program,
    spec: tuple,
    schedule: str | Program,
    cuda_graph: object,
    offload: Sequence[float] | None,
    *held: Any,
) -> ProgramsByCount:
    """A ``Pipeline``'s programs, ``first`` its own: ``spec`` is ``resolve.resolve_program``'s
    arguments after the schedule (``first``'s), ``held`` the agreement, terms and dropout keys."""

    def build(n: int) -> Program:
        return resolve.resolve_program(schedule, n, *spec[1:])

    return ProgramsByCount(first, build, fixed_reason(schedule, bool(cuda_graph), offload), *held)


def fixed_reason(schedule: object, cuda_graph: bool, offload: Sequence[float] | None) -> str | None:
    """Why a pipeline cannot change its micro-batch count (None: it can); ``offload``: the
    per-stage fractions (``resolve.offload_fractions``)."""
    if isinstance(schedule, Program):
        return "a Program fixes its count; build the Pipeline from a schedule name to vary it"
    if cuda_graph:
        return "a captured CUDA graph replays one shape; build it with cuda_graph=False"
    if offload and any(offload):
        return "host offload picks its micro-batches per program; build it without offload"
    return None


__all__ = ["CountProgram", "ProgramsByCount", "fixed_reason", "for_pipeline"]
