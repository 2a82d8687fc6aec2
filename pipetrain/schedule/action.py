"""Actions: one instruction on one rank, and their text notation.

The notation is torch.distributed.pipelining's (``_Action.__repr__`` / ``_Action.from_str``):
``<stage><KIND><microbatch>`` — ``2F0``, ``0I3``, ``1W3``, ``0SEND_F3``, ``1RECV_B2``, and
pipetrain's own copies ``0OFFLOAD3``, ``0RELOAD3`` — and for an
overlapped forward & backward pair (DualPipe) ``(0F7;7B3)OVERLAP_F_B``. ``format`` and ``parse``
round-trip. This module owns the vocabulary of op kinds and the category sets the rest dispatch on;
what an action *needs* lives in ``deps``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class OpKind(StrEnum):
    """What an action does. Values are the spellings used in the text notation."""

    F = "F"  # forward
    B = "B"  # full backward: input gradient and weight gradient together
    I = "I"
    W = "W"  # backward, weight-gradient half
    OVERLAP_F_B = "OVERLAP_F_B"  # a forward and a backward of other micro-batches run together
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    OFFLOAD = "OFFLOAD"  # copy a forward's saved activations to host memory (``schedule.offload``)
    RELOAD = "RELOAD"  # copy them back before the backward that reads them


# module constants for the checks below: reading a member off the enum class is slow
_F, _OVERLAP_F_B, _PAIRED_BACKWARDS = OpKind.F, OpKind.OVERLAP_F_B, (OpKind.B, OpKind.I)

COMPUTE_KINDS = frozenset({OpKind.F, OpKind.B, OpKind.I, OpKind.W, OpKind.OVERLAP_F_B})
BACKWARD_KINDS = frozenset({OpKind.B, OpKind.I, OpKind.W})
COMM_KINDS = frozenset({OpKind.SEND_F, OpKind.RECV_F, OpKind.SEND_B, OpKind.RECV_B})
SEND_KINDS = frozenset({OpKind.SEND_F, OpKind.SEND_B})
RECV_KINDS = frozenset({OpKind.RECV_F, OpKind.RECV_B})
#: copies between device and host memory: neither compute nor communication (``schedule.offload``)
COPY_KINDS = frozenset({OpKind.OFFLOAD, OpKind.RELOAD})


@dataclass(init=False, slots=True, unsafe_hash=True)
class Action:
    """One instruction: ``kind`` on ``stage`` for ``microbatch``.

    An ``OVERLAP_F_B`` action carries its two parts in ``parts`` (a forward, then a ``B`` or ``I``);
    its own ``stage`` and ``microbatch`` are those of the forward part, so sorting and grids still
    work, but every consumer that cares about meaning must look at ``compute_parts``.

    An action is a value: it is hashed (programs, plans and the runtime key dicts by it), so never
    assign to a field of one. It is not declared ``frozen`` only for speed: a build and a lowering
    each make ~10^6 actions, and a frozen dataclass's ``__init__`` (every field through
    ``object.__setattr__``) costs about twice this one; for the same reason ``__init__`` is
    written here with its check inline, not as a generated one calling ``__post_init__``.
    """

    kind: OpKind
    stage: int
    microbatch: int
    parts: tuple[Action, ...] = ()

    def __init__(
        self, kind: OpKind, stage: int, microbatch: int, parts: tuple[Action, ...] = ()
    ) -> None:
        if (kind is _OVERLAP_F_B) != bool(parts):
            raise ValueError(
                f"{kind} with parts {parts}: an OVERLAP_F_B action needs its two parts "
                "(use overlap(forward, backward)) and other kinds have none"
            )
        self.kind = kind
        self.stage = stage
        self.microbatch = microbatch
        self.parts = parts

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def compute_parts(self) -> tuple[Action, ...]:
        """The plain F/B/I/W actions this action performs (itself, or an overlapped pair's parts)."""
        return self.parts if self.parts else (self,)

    def __str__(self) -> str:
        return format_action(self)

    def __repr__(self) -> str:
        return format_action(self)


def overlap(forward: Action, backward: Action) -> Action:
    """An overlapped pair: ``forward`` (an F) and ``backward`` (a B or I) of another micro-batch."""
    if forward.kind is not _F or backward.kind not in _PAIRED_BACKWARDS:
        raise ValueError(f"an overlapped pair is an F and a B or I, got {forward} and {backward}")
    return Action(_OVERLAP_F_B, forward.stage, forward.microbatch, (forward, backward))


def format_action(action: Action) -> str:
    if action.parts:
        return "(" + ";".join(format_action(p) for p in action.parts) + ")" + action.kind.value
    return f"{action.stage}{action.kind.value}{action.microbatch}"


_KINDS_PATTERN = "|".join(
    sorted((k.value for k in OpKind if k is not OpKind.OVERLAP_F_B), key=len, reverse=True)
)
_SIMPLE = re.compile(rf"(\d+)({_KINDS_PATTERN})(\d+)")
_PAIR = re.compile(r"\((.+);(.+)\)OVERLAP_F_B")


def parse_action(text: str) -> Action:
    """Parse one action in torch.distributed.pipelining's notation; raises ``ValueError``."""
    text = text.strip()
    if m := _SIMPLE.fullmatch(text):
        return Action(OpKind(m.group(2)), int(m.group(1)), int(m.group(3)))
    if m := _PAIR.fullmatch(text):
        return overlap(parse_action(m.group(1)), parse_action(m.group(2)))
    raise ValueError(
        f"cannot parse action {text!r}: expected <stage><kind><microbatch> with kind one of "
        f"{', '.join(k.value for k in OpKind if k is not OpKind.OVERLAP_F_B)} (e.g. 2F0, 1SEND_B3), "
        "or (<F action>;<B or I action>)OVERLAP_F_B"
    )
