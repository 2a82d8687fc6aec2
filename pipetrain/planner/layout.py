"""What a plan says to run: the ``Layout`` — schedule family, pipeline ranks, stages per rank,
micro-batches, layers per stage, what each stage recomputes and what share of its activations it
offloads to host memory — and the default cut when no plan is given.

One type for every reader: the planner's ``Plan`` is a layout and its prediction, ``pipetrain
plan --json`` writes a layout's fields, ``Pipeline.from_plan`` and ``pipetrain train --plan`` read
them back through ``Layout.from_json``, which checks them once and names the first missing or bad
field. Plans written before recompute or offload (no ``recompute`` or ``offload`` key) read as
recomputing and offloading nothing; plans without ``reload_lead`` reload 1 compute action ahead.
An N-D plan (``planner.nd_search``) also says the job's tensor- and data-parallel sizes
(``tp``, ``dp``), which ``pipetrain train --plan`` holds its ``--tp`` and ``--dp`` to; a
pipeline-only plan leaves them out (``None``: the run chooses them);
``ep`` (expert parallel) is kept for the expert-parallel runtime and is 1 until it exists.
A synthesized schedule (``planner.synthesize``: no family's program) travels inside its plan as
``program``, spelled as a program file's JSON (``schedule.program_io``), and its ``schedule`` is
the program's name: what ``Pipeline.from_plan`` and ``pipetrain train --plan`` run is then that
program, checked here (deadlock-free, one copy of the model, its ranks, stages and micro-batches
the plan's). Pure data, standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from pipetrain.planner.recompute_modes import Recompute, parse_modes
from pipetrain.schedule.lower import lower
from pipetrain.schedule.offload import OffloadSpec, check_fractions, check_leads
from pipetrain.schedule.program import Program
from pipetrain.schedule.program_io import program_from_dict, program_to_dict
from pipetrain.schedule.validate import validate


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A pipeline layout: which schedule runs, on how many ranks, and how the layers are cut."""

    schedule: str
    ranks: int
    stages_per_rank: int
    microbatches: int
    #: layers per stage, in stage order (for DualPipe's two model copies: one copy's stages)
    stage_layers: tuple[int, ...]
    #: per stage, in the order of ``stage_layers``: ``"none"``, ``"selective"`` or ``"full"``, or
    #: ``"selective:K"`` / ``"full:K"`` for the stage's first K layers
    #: (``planner.recompute_modes.StageRecompute``); empty: ``"none"`` for every stage
    recompute: tuple[str, ...] = ()
    #: per stage, in the order of ``stage_layers``: the share of its activations held in host
    #: memory between forward and backward — its first ⌈share × layers⌉ layers, moved layer by
    #: layer (``schedule.offload``, ``runtime.host_offload``); empty: none
    offload: tuple[float, ...] = ()
    #: per stage, in the order of ``stage_layers``: how many compute actions ahead of its backward
    #: its reloads are issued (``schedule.offload.reload_leads``, the just-in-time rule reduced to
    #: one number per stage); empty: 1 for every stage
    reload_lead: tuple[int, ...] = ()
    #: tensor-parallel ranks per stage (each layer split over them, Megatron-LM's way);
    #: ``None``: not planned (a pipeline-only plan)
    tp: int | None = None
    #: data-parallel replicas of the whole pipeline; ``None``: not planned
    dp: int | None = None
    #: expert-parallel ranks (1: none; expert parallel is not run yet)
    ep: int = 1
    #: the compute-only program to run where no family builds it (a synthesized schedule),
    #: named by ``schedule``; ``None``: the family ``schedule`` names builds it
    program: Program | None = None

    #: the JSON fields every layout gives, in the order ``pipetrain plan --json`` prints them
    FIELDS: ClassVar[tuple[str, ...]] = (
        "schedule",
        "ranks",
        "stages_per_rank",
        "microbatches",
        "stage_layers",
    )

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "ep"):
            value = getattr(self, name)
            if value is None and name != "ep":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"the plan's {name!r} must be an integer >= 1, got {value!r}")
        if self.ep != 1:
            raise ValueError(f"the plan's 'ep' is {self.ep}: expert parallel is not run yet; use 1")
        if self.program is not None:
            _check_program(self)
        modes = self.recompute or (Recompute.NONE.value,) * len(self.stage_layers)
        parsed = parse_modes(modes, len(self.stage_layers), "recompute", self.stage_layers)
        object.__setattr__(self, "recompute", tuple(map(str, parsed)))
        fractions = self.offload or (0.0,) * len(self.stage_layers)
        object.__setattr__(self, "offload", check_fractions(fractions, len(self.stage_layers)))
        if self.reload_lead:
            leads = check_leads(self.reload_lead, len(self.stage_layers))
            object.__setattr__(self, "reload_lead", leads)
        why = {
            Recompute.WHOLE: "a stage recomputed as a whole keeps no activations to offload; "
            "drop one of the two there",
            Recompute.SELECTIVE: "not run together (a selective checkpoint's saved outputs "
            "cannot be read twice under offload's hooks); use 'full' recompute with offload, or "
            "no offload there",
        }
        for mode, reason in why.items():
            both = [
                s for s, (m, f) in enumerate(zip(parsed, self.offload)) if m.mode is mode and f > 0
            ]
            if both:
                raise ValueError(
                    f"stage(s) {', '.join(map(str, both))} recompute '{mode.value}' and offload: "
                    + reason
                )

    @classmethod
    def of_program(
        cls, program: Program, stage_layers: Sequence[int], recompute: Sequence[str] = ()
    ) -> Layout:
        """The layout that runs ``program`` (a synthesized one: ``planner.synthesize``'s
        ``Synthesis.program``, ``stage_layers`` and ``recompute``) on its own ranks, stages
        and micro-batches."""
        ranks, stages = program.num_ranks, program.num_stages
        return cls(
            schedule=program.name,
            ranks=ranks,
            stages_per_rank=stages // ranks,
            microbatches=program.num_microbatches,
            stage_layers=tuple(stage_layers),
            recompute=tuple(recompute),
            program=program,
        )

    @property
    def pipeline_schedule(self) -> str | Program:
        """What ``Pipeline(schedule=...)`` takes to run this layout: its program where it
        carries one, else its family's name."""
        return self.program if self.program is not None else self.schedule

    @property
    def offloads(self) -> bool:
        """Whether some stage offloads activations."""
        return any(f > 0 for f in self.offload)

    @property
    def offload_spec(self) -> OffloadSpec | None:
        """What ``Pipeline(offload=...)`` takes to run this layout's offload (``None``: none)."""
        return OffloadSpec(self.offload, self.reload_lead) if self.offloads else None

    @property
    def recomputes(self) -> bool:
        """Whether some stage recomputes."""
        return any(m != Recompute.NONE for m in self.recompute)

    @property
    def num_gpus(self) -> int:
        """The job's ranks: pipeline × tensor × data parallel (those not planned: 1)."""
        return self.ranks * (self.tp or 1) * (self.dp or 1) * self.ep

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    @property
    def num_layers(self) -> int:
        return sum(self.stage_layers)

    def to_json(self) -> dict[str, object]:
        """The JSON fields (``reload_lead`` only where the layout offloads and gives them;
        ``tp`` and ``dp`` where planned, ``ep`` only where it is not 1)."""
        out: dict[str, object] = {
            "schedule": self.schedule,
            "ranks": self.ranks,
            "stages_per_rank": self.stages_per_rank,
            "microbatches": self.microbatches,
            "stage_layers": list(self.stage_layers),
            "recompute": list(self.recompute),
            "offload": list(self.offload),
        }
        if self.tp is not None:
            out["tp"] = self.tp
        if self.dp is not None:
            out["dp"] = self.dp
        if self.ep != 1:
            out["ep"] = self.ep
        if self.offloads and self.reload_lead:
            out["reload_lead"] = list(self.reload_lead)
        if self.program is not None:
            out["program"] = program_to_dict(self.program)
        return out

    @classmethod
    def from_json(cls, raw: object) -> Layout:
        """The layout in ``raw`` (what ``pipetrain plan --json`` prints; other keys, such as
        ``predicted``, are ignored), checked: a ``ValueError`` names the first missing or bad
        field and the legal values. ``recompute`` and ``offload`` are optional (a plan from
        before them: none); so is ``program`` (a plan of a family: none), which is checked
        deadlock-free here, before any process starts."""
        if not isinstance(raw, Mapping):
            raise ValueError(
                f"a plan is a pipetrain Plan or the dict `pipetrain plan --json` prints, got "
                f"{type(raw).__name__}"
            )
        for name in cls.FIELDS:
            if name not in raw:
                raise ValueError(
                    f"the plan has no {name!r}; a plan gives {', '.join(cls.FIELDS)} "
                    "(`pipetrain plan --json` prints them)"
                )
        schedule = raw["schedule"]
        if not isinstance(schedule, str):
            raise ValueError(f"the plan's 'schedule' must be a name, got {schedule!r}")
        counts = {
            name: _positive(raw, name) for name in ("ranks", "stages_per_rank", "microbatches")
        }
        stage_layers = raw["stage_layers"]
        if not isinstance(stage_layers, list | tuple) or not all(
            isinstance(c, int) and not isinstance(c, bool) for c in stage_layers
        ):
            raise ValueError(
                f"the plan's 'stage_layers' must be a list of layer counts, got {stage_layers!r}"
            )
        expected = counts["ranks"] * counts["stages_per_rank"]
        if len(stage_layers) != expected:
            raise ValueError(
                f"the plan's 'stage_layers' has {len(stage_layers)} stages but ranks × "
                f"stages_per_rank = {expected}"
            )
        recompute = raw.get("recompute", [Recompute.NONE.value] * len(stage_layers))
        modes = parse_modes(
            recompute, len(stage_layers), "the plan's 'recompute'", tuple(stage_layers)
        )
        offload = raw.get("offload", [0.0] * len(stage_layers))
        if not isinstance(offload, list | tuple):
            raise ValueError(
                f"the plan's 'offload' must be one fraction in [0, 1] per stage "
                f"({len(stage_layers)}), got {offload!r}"
            )
        leads = raw.get("reload_lead", [])
        if not isinstance(leads, list | tuple):
            raise ValueError(
                f"the plan's 'reload_lead' must be one whole number >= 0 per stage "
                f"({len(stage_layers)}), got {leads!r}"
            )
        sizes = {name: _positive(raw, name) for name in ("tp", "dp", "ep") if name in raw}
        return cls(
            schedule=schedule,
            **counts,
            **sizes,
            stage_layers=tuple(stage_layers),
            recompute=tuple(map(str, modes)),
            offload=check_fractions(offload, len(stage_layers)),
            reload_lead=check_leads(leads, len(stage_layers)) if leads else (),
            program=_read_program(raw["program"]) if "program" in raw else None,
        )


def _read_program(raw: object) -> Program:
    """A plan's ``program``, read and checked deadlock-free: a ``ValueError`` of one line, the
    checker's first (``validate(lower(program))`` raises it with the whole grid drawn)."""
    try:
        program = program_from_dict(raw)
        validate(lower(program))
    except ValueError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"the plan's 'program' cannot run: {first}") from None
    return program


def _check_program(layout: Layout) -> None:
    """A carried program must be the one the plan's other fields describe: named by its
    ``schedule``, on its ranks, stages and micro-batches, one copy of the model."""
    program = layout.program
    assert program is not None
    if layout.schedule != program.name:
        raise ValueError(
            f"the plan's 'schedule' is {layout.schedule!r} but its program is named "
            f"{program.name!r}; a plan that carries a program names it"
        )
    told = (layout.ranks, layout.ranks * layout.stages_per_rank, layout.microbatches)
    found = (program.num_ranks, program.num_stages, program.num_microbatches)
    if told != found or len(layout.stage_layers) != program.num_stages:
        raise ValueError(
            "the plan says {} ranks, {} stages ({} stage_layers), {} micro-batches but its "
            "program runs {} ranks, {} stages, {} micro-batches; write the plan from the "
            "program (Layout.of_program)".format(
                told[0], told[1], len(layout.stage_layers), told[2], *found
            )
        )
    held = [len(program.placement.stages_of_rank(r)) for r in range(program.num_ranks)]
    if set(held) != {layout.stages_per_rank}:
        raise ValueError(
            f"the plan's program places {held} stages on its ranks; a plan runs "
            f"stages_per_rank ({layout.stages_per_rank}) on every rank"
        )
    if program.placement.num_chains > 1:
        raise ValueError(
            f"the plan's program runs {program.placement.num_chains} copies of the model; the "
            "runtime runs programs with one copy"
        )


def _positive(raw: Mapping[str, object], name: str) -> int:
    value = raw[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"the plan's {name!r} must be an integer >= 1, got {value!r}")
    return value


def default_cut(
    num_blocks: int, num_stages: int, *, first: int = 1, last: int = 1
) -> tuple[int, ...]:
    """Layers per stage of ``[first extra layers, num_blocks blocks, last extra layers]`` when
    no plan says: the blocks split as evenly as counts go (the earlier stages take the
    remainder), the ``first`` layers (the embedding) added to the first stage and the ``last``
    (the final norm and the head) to the last — Megatron-LM's default; a stage left empty takes
    a layer from the fullest.

    (torchtitan's rule, "the first and last stage hold one block fewer" because the embedding
    and the head count as one layer each, is an even cut of the whole list.)"""
    total = first + num_blocks + last
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"the stage count must be an integer >= 1, got {num_stages!r}")
    if num_blocks < 0 or first < 0 or last < 0:
        raise ValueError("layer counts must be >= 0")
    if num_stages > total:
        raise ValueError(
            f"{num_stages} stages for {total} layers: every stage needs a layer; use at most "
            f"{total} stages or more layers"
        )
    base, extra = divmod(num_blocks, num_stages)
    counts = [base + (s < extra) for s in range(num_stages)]
    counts[0] += first
    counts[-1] += last
    for s in range(num_stages):
        if counts[s] == 0:
            donor = max(range(num_stages), key=lambda i: counts[i])
            counts[donor] -= 1
            counts[s] += 1
    return tuple(counts)


class HasLayout(Protocol):
    """Anything that carries a layout, as the planner's ``Plan`` does (a layout and its
    prediction): what the runtime reads of a plan, so it never imports the search that made
    one."""

    @property
    def layout(self) -> Layout: ...


#: what a plan may be given as: a layout, anything that has one, or ``pipetrain plan --json``'s
#: dict
PlanLike = Layout | HasLayout | Mapping[str, Any]


def layout_of(plan: PlanLike | object) -> Layout:
    """The ``Layout`` of a ``Plan`` (or anything with a ``layout``), a ``Layout``, or a plan dict
    (checked)."""
    if isinstance(plan, Layout):
        return plan
    inner = getattr(plan, "layout", None)
    if isinstance(inner, Layout):
        return inner
    return Layout.from_json(plan)
