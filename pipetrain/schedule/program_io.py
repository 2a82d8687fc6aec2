"""Programs to and from files: CSV (torch.distributed.pipelining's layout) and JSON.

CSV is what ``_PipelineScheduleRuntime._dump_csv`` writes and ``_load_csv`` reads: one row per
rank, one action per cell in torch's notation, empty cells for its ``None`` bubbles. It carries no
placement or micro-batch count, so loading infers them: the stages are 0..max, each stage lives on
the rank whose row runs it, and the micro-batches are 0..max. JSON carries both explicitly.
torch's ``compute_comms`` dumps also hold FSDP and gradient-reduction housekeeping cells
(``0UNSHARD``, ``0RESHARD``, ``0REDUCE_GRAD``); they say nothing about pipeline order, so loading
skips them (pipetrain's runtime accumulates gradients itself).
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipetrain.schedule.action import Action, format_action, parse_action
from pipetrain.schedule.placement import Placement, infer_kind
from pipetrain.schedule.program import Program

_TORCH_HOUSEKEEPING = re.compile(r"\d+(UNSHARD|RESHARD|REDUCE_GRAD)")


def _is_action_cell(cell: str) -> bool:
    cell = cell.strip()
    return bool(cell) and cell != "None" and not _TORCH_HOUSEKEEPING.fullmatch(cell)


def to_csv(program: Program) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for row in program.actions:
        writer.writerow([format_action(a) for a in row])
    return buf.getvalue()


def from_csv(text: str, name: str = "csv") -> Program:
    rows: list[list[Action]] = []
    for line_no, cells in enumerate(csv.reader(io.StringIO(text)), start=1):
        try:
            rows.append([parse_action(c) for c in cells if _is_action_cell(c)])
        except ValueError as e:
            raise ValueError(f"line {line_no} (rank {line_no - 1}): {e}") from None
    while rows and not rows[-1]:  # trailing blank lines
        rows.pop()
    if not rows:
        raise ValueError(
            "program file is empty: expected one line of comma-separated actions per rank"
        )
    empty = [i for i, row in enumerate(rows) if not row]
    if empty:
        raise ValueError(
            f"line {empty[0] + 1} (rank {empty[0]}) holds no action; every rank runs at least one"
        )
    return _infer_program(rows, name)


def _infer_program(rows: list[list[Action]], name: str) -> Program:
    stage_rank: dict[int, int] = {}
    stages_of_mb: dict[int, set[int]] = {}
    num_microbatches = 0
    for rank, row in enumerate(rows):
        for action in row:
            for part in action.compute_parts if action.is_compute else (action,):
                num_microbatches = max(num_microbatches, part.microbatch + 1)
                if not action.is_compute:
                    continue
                stages_of_mb.setdefault(part.microbatch, set()).add(part.stage)
                other = stage_rank.setdefault(part.stage, rank)
                if other != rank:
                    raise ValueError(
                        f"stage {part.stage} runs on ranks {other} and {rank}; a stage lives on one rank"
                    )
    num_stages = max(stage_rank, default=-1) + 1
    missing = [s for s in range(num_stages) if s not in stage_rank]
    if missing or not num_stages:
        raise ValueError(f"program file runs no compute for stages {missing or [0]}")
    rank_of_stage = tuple(stage_rank[s] for s in range(num_stages))
    chain_length = _infer_chain_length(stages_of_mb, num_stages)
    kind = infer_kind(rank_of_stage, len(rows), chain_length)
    placement = Placement(rank_of_stage, len(rows), kind, chain_length)
    return Program(placement, num_microbatches, tuple(tuple(r) for r in rows), name)


def _infer_chain_length(stages_of_mb: dict[int, set[int]], num_stages: int) -> int | None:
    """Several copies of the model (DualPipe) show as micro-batches that each run one contiguous,
    equally long run of stages; ``None`` when every micro-batch runs every stage (one chain)."""
    lengths = {len(stages) for stages in stages_of_mb.values()}
    if len(lengths) != 1 or (length := lengths.pop()) == num_stages or num_stages % length:
        return None
    for stages in stages_of_mb.values():
        first = min(stages)
        if first % length or stages != set(range(first, first + length)):
            return None
    return length


def to_json(program: Program) -> str:
    return json.dumps(program_to_dict(program), indent=1)


def program_to_dict(program: Program) -> dict[str, object]:
    """``to_json``'s object before it is written: what a plan file embeds as its ``program``
    (``planner.layout``), so a plan and a program file spell a program alike."""
    return {
        "name": program.name,
        "num_microbatches": program.num_microbatches,
        "rank_of_stage": list(program.placement.rank_of_stage),
        "chain_length": program.placement.chain_length,
        "actions": [[format_action(a) for a in row] for row in program.actions],
    }


#: what a program's JSON object holds (named when one does not)
_EXPECTED = (
    "expected an object with name (text), num_microbatches (integer >= 1), rank_of_stage "
    "(list of ranks), chain_length (optional integer) and actions (one list of action "
    "strings per rank)"
)


def from_json(text: str) -> Program:
    """Read ``to_json``'s format; ``ValueError`` names the field that is missing or wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"program JSON does not parse ({e}); {_EXPECTED}") from None
    return program_from_dict(data)


def program_from_dict(data: object) -> Program:
    """``program_to_dict``'s object read back (a plan file's ``program``); ``ValueError`` names
    the field that is missing or wrong."""
    expected = _EXPECTED
    if not isinstance(data, dict):
        raise ValueError(f"program JSON is a {type(data).__name__}; {expected}")

    def field(key: str, ok: Callable[[object], bool], what: str) -> Any:
        if key not in data:
            raise ValueError(f"program JSON lacks {key!r}; {expected}")
        if not ok(data[key]):
            raise ValueError(f"program JSON field {key!r} must be {what}, got {data[key]!r}")
        return data[key]

    def int_list(v: object) -> bool:
        return isinstance(v, list) and all(isinstance(x, int) for x in v)

    def action_rows(v: object) -> bool:
        return isinstance(v, list) and all(
            isinstance(row, list) and all(isinstance(a, str) for a in row) for row in v
        )

    num_microbatches = field("num_microbatches", lambda v: isinstance(v, int), "an integer")
    rank_of_stage = tuple(field("rank_of_stage", int_list, "a list of integer ranks"))
    rows = [
        [parse_action(a) for a in row] for row in field("actions", action_rows, "lists of strings")
    ]
    chain_length = data.get("chain_length")
    if chain_length is not None and not isinstance(chain_length, int):
        raise ValueError(
            f"program JSON field 'chain_length' must be an integer, got {chain_length!r}"
        )
    num_ranks = len(rows)
    kind = infer_kind(rank_of_stage, num_ranks, chain_length)
    placement = Placement(rank_of_stage, num_ranks, kind, chain_length)
    return Program(
        placement, num_microbatches, tuple(map(tuple, rows)), str(data.get("name", "json"))
    )


def save_program(program: Program, path: str | Path) -> None:
    """Write ``program`` as JSON if ``path`` ends in .json, else as torch-compatible CSV."""
    path = Path(path)
    path.write_text(to_json(program) if path.suffix == ".json" else to_csv(program))


def load_program(path: str | Path) -> Program:
    """Read a program written by ``save_program`` or by torch's ``_dump_csv``."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read program file {str(path)!r}: {e.strerror}") from None
    if path.suffix == ".json":
        return from_json(text)
    return from_csv(text, name=path.stem)
