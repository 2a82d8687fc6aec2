"""The ``Program``: placement + micro-batch count + one ordered action tuple per rank.

A program is the single artefact every other part reads: builders make one (compute only),
passes (``lower``) return new ones, the simulator and the runtime execute one. Bubbles are time,
not actions, so there is no ``None`` placeholder. ``ScheduleError`` draws the program grid with the
offending cells marked, because a list of action names is unreadable past a handful of ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter

from pipetrain.schedule.action import COMM_KINDS, COMPUTE_KINDS, Action
from pipetrain.schedule.placement import Placement

_kind = attrgetter("kind")


@dataclass(frozen=True, slots=True)
class Program:
    """Per-rank action lists for one training step.

    ``name`` is informational (the schedule that built it, or the file it came from).
    """

    placement: Placement
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if len(self.actions) != self.placement.num_ranks:
            raise ValueError(
                f"program has {len(self.actions)} rank rows but its placement has "
                f"{self.placement.num_ranks} ranks"
            )

    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @property
    def is_lowered(self) -> bool:
        """True when the program carries its own SEND/RECV actions."""
        # each row's kinds read in C (``map``), stopping at the first SEND/RECV: this runs on
        # every lower() and validate() of 10^5 actions
        return any(not COMM_KINDS.isdisjoint(map(_kind, row)) for row in self.actions)

    def cells(self) -> Iterable[tuple[int, int, Action]]:
        """(rank, step, action) for every action, rank by rank."""
        for rank, row in enumerate(self.actions):
            for step, action in enumerate(row):
                yield rank, step, action

    def compute_only(self) -> Program:
        """The same program with its communication actions removed."""
        rows = tuple(tuple(a for a in row if a.is_compute) for row in self.actions)
        return Program(self.placement, self.num_microbatches, rows, self.name)

    def with_actions(self, rows: Iterable[Iterable[Action]]) -> Program:
        return Program(
            self.placement, self.num_microbatches, tuple(tuple(r) for r in rows), self.name
        )

    def count(self) -> dict[str, int]:
        """How many actions of each kind (by notation name) the program holds."""
        counts: dict[str, int] = {}
        for row in self.actions:
            for a in row:
                counts[a.kind.value] = counts.get(a.kind.value, 0) + 1
        return counts

    def grid(self, marked: Iterable[tuple[int, int]] = (), max_columns: int = 0) -> str:
        """The program as text: one row per rank, one column per step, ``>cell<`` marked."""
        return format_grid(self.actions, marked=set(marked), max_columns=max_columns)


def format_grid(
    rows: Sequence[Sequence[Action]],
    marked: Iterable[tuple[int, int]] = (),
    max_columns: int = 0,
) -> str:
    """Draw rows of actions as an aligned grid; ``marked`` holds (rank, step) cells to highlight.

    With ``max_columns`` > 0, only a window of that many steps is drawn, centred on the first
    marked cell, so an error in a 1000-step program still fits a terminal.
    """
    marked = set(marked)
    width = max((len(str(a)) for row in rows for a in row), default=2) + 2
    num_steps = max((len(row) for row in rows), default=0)
    lo, hi = 0, num_steps
    if max_columns and num_steps > max_columns:
        centre = min((step for _, step in marked), default=0)
        lo = max(0, min(centre - max_columns // 2, num_steps - max_columns))
        hi = lo + max_columns
    label = len(f"rank {len(rows) - 1}")
    header = " " * (label + 2) + "".join(f"{s:<{width}}" for s in range(lo, hi))
    lines = [header.rstrip()]
    for rank, row in enumerate(rows):
        cells = []
        for step in range(lo, hi):
            if step >= len(row):
                cells.append(" " * width)
                continue
            text = str(row[step])
            cell = f">{text}<" if (rank, step) in marked else f" {text} "
            cells.append(f"{cell:<{width}}")
        prefix = "… " if lo > 0 else "  "
        suffix = " …" if hi < len(row) else ""
        lines.append(f"{f'rank {rank}':<{label}}{prefix}{''.join(cells).rstrip()}{suffix}")
    return "\n".join(lines)


def microbatch_chains(program: Program) -> tuple[int, ...]:
    """Which chain (copy of the model) each micro-batch flows through, read off its actions.

    With one chain every micro-batch is on chain 0. Otherwise a micro-batch's chain is that of the
    stages its compute actions run; one that runs on two chains, or on none, is refused.
    """
    placement, m = program.placement, program.num_microbatches
    if placement.num_chains == 1:
        return (0,) * m
    chain_of = {stage: placement.chain(stage) for stage in range(placement.num_stages)}
    seen: list[set[int]] = [set() for _ in range(m)]
    for row in program.actions:
        for action in row:
            if action.parts:
                parts = action.parts
            elif action.kind in COMPUTE_KINDS:
                parts = (action,)
            else:
                continue
            for p in parts:
                chain = chain_of.get(p.stage)  # None: a stage the placement lacks
                if chain is not None and 0 <= p.microbatch < m:
                    seen[p.microbatch].add(chain)
    bad = [j for j, chains in enumerate(seen) if len(chains) != 1]
    if bad:
        j = bad[0]
        raise ScheduleError(
            f"micro-batch {j} runs on chains {sorted(seen[j])}; with {placement.num_chains} "
            f"chains of {placement.stages_per_chain} stages each micro-batch flows through one",
            program,
        )
    return tuple(chains.pop() for chains in seen)


def plural(count: int, word: str, many: str | None = None) -> str:
    """``1 rank``, ``4 ranks``; ``many`` for irregular plurals."""
    return f"{count} {word if count == 1 else many or word + 's'}"


def describe_shape(name: str, num_ranks: int, stages_per_rank: int | None, num_mb: int) -> str:
    """The one-line shape every command prints: ``zbv: 4 ranks, 2 stages per rank, 8 micro-batches``.

    ``stages_per_rank`` None means the placement gives ranks different numbers of stages.
    """
    per_rank = (
        f"{plural(stages_per_rank, 'stage')} per rank" if stages_per_rank else "uneven stages"
    )
    return f"{name}: {plural(num_ranks, 'rank')}, {per_rank}, {plural(num_mb, 'micro-batch', 'micro-batches')}"


class ScheduleError(ValueError):
    """A program is malformed or cannot run; the message names rank, step and action and draws
    the grid with the offending cells marked."""

    def __init__(
        self,
        message: str,
        program: Program | None = None,
        marked: Iterable[tuple[int, int]] = (),
    ) -> None:
        self.problem = message
        self.marked = tuple(marked)
        text = message
        if program is not None:
            text += "\n\n" + program.grid(self.marked, max_columns=16)
        super().__init__(text)
