"""Schedules as data: the IR, builders for every family, lowering, validation, file formats.

Standard library only; nothing here imports torch.
"""

from pipetrain.schedule.action import Action, OpKind, format_action, overlap, parse_action
from pipetrain.schedule.lower import lower, post_receives_late
from pipetrain.schedule.placement import Placement, looped, one_per_rank, v_shape
from pipetrain.schedule.program import Program, ScheduleError
from pipetrain.schedule.timeline import Span, Timeline
from pipetrain.schedule.validate import validate

__all__ = [
    "Action",
    "OpKind",
    "Placement",
    "Program",
    "ScheduleError",
    "Span",
    "Timeline",
    "format_action",
    "looped",
    "lower",
    "one_per_rank",
    "overlap",
    "parse_action",
    "post_receives_late",
    "v_shape",
    "validate",
]
