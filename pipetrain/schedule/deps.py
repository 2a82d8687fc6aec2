"""The one dependency rule: what each action produces and needs, and what crosses ranks.

Communication injection, validation, the simulator and the runtime all ask this module; nothing
else re-derives it. Values are named by ``Key = (Token, stage, microbatch)``:

* ``F(s, j)`` needs the activation of ``(s − 1, j)`` (none for stage 0: it reads the input) and
  produces the activation of ``(s, j)``. The last stage's ``F`` also computes the loss.
* ``B(s, j)`` and ``I(s, j)`` need the activation of ``(s, j)`` (same rank: the saved graph) and the
  input gradient of ``(s + 1, j)`` (none for the last stage: it starts from the loss). Both produce
  the input gradient of ``(s, j)``; ``B`` also produces its weight gradient.
* ``W(s, j)`` needs the input gradient of ``(s, j)`` from ``I`` — i.e. that ``I`` ran — and
  produces the weight gradient.

* ``OFFLOAD(s, j)`` and ``RELOAD(s, j)`` (``schedule.offload``) move the activation of ``(s, j)``
  to host memory and back on its own rank; they need and produce no value of the rule above.
  Their order is a rank's own: ``OFFLOAD`` after ``F(s, j)``, ``RELOAD`` after the ``OFFLOAD``,
  the ``B``/``I`` of ``(s, j)`` after the ``RELOAD`` — ``offload.check_copies`` checks it, and
  the simulator's copy engine (``execute``) and the runtime wait on it.

Stages are counted within a chain (``Placement.stages_per_chain``, every stage unless the
placement holds several copies of the model, as DualPipe does): "stage 0" is a chain's first
stage, "the last stage" its last.

A value crosses ranks when its producer and consumer stages live on different ranks; then it
travels as ``SEND_F(s, j)`` → ``RECV_F(s + 1, j)`` (forward) or ``SEND_B(s, j)`` →
``RECV_B(s − 1, j)`` (backward), the pairing torch.distributed.pipelining uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache
from typing import NamedTuple

from pipetrain.schedule.action import COMM_KINDS, SEND_KINDS, Action, OpKind
from pipetrain.schedule.placement import Placement


class Token(IntEnum):
    ACTIVATION = 0
    INPUT_GRAD = 1
    WEIGHT_GRAD = 2


Key = tuple[Token, int, int]


def produces(action: Action) -> tuple[Key, ...]:
    """Values that exist on the action's rank once it has finished."""
    out: list[Key] = []
    for a in action.compute_parts:
        s, j = a.stage, a.microbatch
        match a.kind:
            case OpKind.F:
                out.append((Token.ACTIVATION, s, j))
            case OpKind.B:
                out += [(Token.INPUT_GRAD, s, j), (Token.WEIGHT_GRAD, s, j)]
            case OpKind.I:
                out.append((Token.INPUT_GRAD, s, j))
            case OpKind.W:
                out.append((Token.WEIGHT_GRAD, s, j))
            case OpKind.OFFLOAD | OpKind.RELOAD:
                pass  # a copy moves a value within its rank (see the module docstring)
            case _:
                raise TypeError(f"not a compute part: {a}")
    return tuple(out)


def requires(action: Action, stages_per_chain: int) -> tuple[Key, ...]:
    """Values that must exist (locally or received) before the compute action can start."""
    out: list[Key] = []
    for a in action.compute_parts:
        s, j = a.stage, a.microbatch
        match a.kind:
            case OpKind.F:
                if s % stages_per_chain:
                    out.append((Token.ACTIVATION, s - 1, j))
            case OpKind.B | OpKind.I:
                out.append((Token.ACTIVATION, s, j))
                if (s + 1) % stages_per_chain:
                    out.append((Token.INPUT_GRAD, s + 1, j))
            case OpKind.W:
                out.append((Token.INPUT_GRAD, s, j))
            case OpKind.OFFLOAD | OpKind.RELOAD:
                pass  # a copy moves a value within its rank (see the module docstring)
            case _:
                raise TypeError(f"not a compute part: {a}")
    return tuple(out)


def consumer_stage(key: Key, stages_per_chain: int) -> int | None:
    """The stage that consumes a value on another stage, or None if it stays on its stage."""
    token, s, _ = key
    if token is Token.ACTIVATION:
        return s + 1 if (s + 1) % stages_per_chain else None
    if token is Token.INPUT_GRAD:
        return s - 1 if s % stages_per_chain else None
    return None


def crosses_ranks(key: Key, placement: Placement) -> bool:
    dst = consumer_stage(key, placement.stages_per_chain)
    if dst is None or not 0 <= dst < placement.num_stages:
        return False
    return placement.rank(dst) != placement.rank(key[1])


def transfer(key: Key) -> tuple[Action, Action]:
    """The (send, receive) pair that moves ``key`` to its consumer stage."""
    token, s, j = key
    if token is Token.ACTIVATION:
        return Action(OpKind.SEND_F, s, j), Action(OpKind.RECV_F, s + 1, j)
    if token is Token.INPUT_GRAD:
        return Action(OpKind.SEND_B, s, j), Action(OpKind.RECV_B, s - 1, j)
    raise TypeError(f"weight gradients never travel: {key}")


def comm_key(action: Action) -> Key:
    """The value a SEND ships out or a RECV brings in."""
    s, j = action.stage, action.microbatch
    match action.kind:
        case OpKind.SEND_F:
            return (Token.ACTIVATION, s, j)
        case OpKind.RECV_F:
            return (Token.ACTIVATION, s - 1, j)
        case OpKind.SEND_B:
            return (Token.INPUT_GRAD, s, j)
        case OpKind.RECV_B:
            return (Token.INPUT_GRAD, s + 1, j)
        case _:
            raise TypeError(f"not a communication action: {action}")


def peer(action: Action) -> Action:
    """The matching half of a SEND or RECV."""
    send, recv = transfer(comm_key(action))
    return recv if action.kind in (OpKind.SEND_F, OpKind.SEND_B) else send


# --- The same rule, compiled for the hot loops ---------------------------------------------------
#
# Lowering, validation and simulation each walk ~10^5 actions; hashing (token, stage, microbatch)
# tuples and re-deriving the rule per action cost more than the work itself. ``CompiledRule`` asks
# the functions above once per (kind, stage) at micro-batch 0 and stores the answers as integers.
# That is sound because no dependency crosses micro-batches: the values of micro-batch j are those
# of micro-batch 0 shifted by j (``compile_rule`` asserts that the rule, asked about micro-batch 0,
# names only micro-batch 0). The rule itself stays stated once, above.

_PLAIN_COMPUTE = (OpKind.F, OpKind.B, OpKind.I, OpKind.W)


class Need(NamedTuple):
    """A value an action needs, at micro-batch 0: its integer, and where and what it is."""

    value: int
    producer_rank: int
    token: Token
    stage: int


class Transfer(NamedTuple):
    """A cross-rank value, as a template at micro-batch 0: who sends it and who receives it."""

    value: int
    send: Action
    recv: Action
    recv_rank: int


class Post(NamedTuple):
    """A SEND or RECV as the lowered-program checks see it, at micro-batch 0.

    ``id`` names this half of a transfer and ``counterpart`` the other half, as integers distinct
    for every value and direction; add ``microbatch · CompiledRule.post_stride`` to both for
    another micro-batch (and ``microbatch · stride`` to ``value``).
    """

    id: int
    counterpart: int
    value: int
    is_send: bool


@dataclass(frozen=True, eq=False)
class CompiledRule:
    """The dependency rule for one placement, with values and posts as integers.

    Value ``(token, stage, microbatch)`` is the integer ``microbatch · stride + token · S + stage``
    (S stages, ``stride`` = 3S): distinct for every micro-batch, negative ones included, so no
    micro-batch count is needed. A post (one SEND or RECV, ``Post``) of value v is ``2·v + 1``
    for the SEND and ``2·v`` for the RECV. These two encodings live here only: every other module
    reads the named records below and shifts them by micro-batch.

    Tables are indexed ``[kind][stage]`` and hold the answer for micro-batch 0. Plain compute
    kinds only: an overlapped pair is looked up through its ``compute_parts``. One dict per op
    kind, not one keyed by (kind, stage): a hot loop then looks an action up with two cheap
    subscripts instead of building and hashing a tuple per action. Every kind has a dict (empty
    where the table has nothing to say), so ``table[kind].get(stage)`` is None for any kind or
    stage the rule does not cover.
    """

    placement: Placement
    stride: int
    #: [kind][stage] -> the values the action needs
    needs: dict[OpKind, dict[int, tuple[Need, ...]]]
    #: [kind][stage] -> the values the action produces that some action needs: what a loop must
    #: record. A weight gradient is produced but needed by none, so it is left out.
    awaited: dict[OpKind, dict[int, tuple[int, ...]]]
    #: [kind][stage] -> the transfers of the produced values that cross ranks
    transfers: dict[OpKind, dict[int, tuple[Transfer, ...]]]
    #: [kind][stage] of a SEND/RECV -> its post; absent when the value it moves cannot exist
    posts: dict[OpKind, dict[int, Post]]

    @property
    def post_stride(self) -> int:
        """What a post's ``id`` and ``counterpart`` move by from one micro-batch to the next."""
        return 2 * self.stride

    def value(self, key: Key) -> int:
        token, stage, microbatch = key
        return microbatch * self.stride + token * self.placement.num_stages + stage

    def key(self, value: int) -> Key:
        microbatch, rest = divmod(value, self.stride)
        token, stage = divmod(rest, self.placement.num_stages)
        return (Token(token), stage, microbatch)

    def post_id(self, comm: Action) -> int:
        """The ``Post.id`` of a SEND or RECV at its own micro-batch."""
        return 2 * self.value(comm_key(comm)) + (comm.kind in SEND_KINDS)


@lru_cache(maxsize=64)
def compile_rule(placement: Placement) -> CompiledRule:
    """The rule above as integer tables for ``placement`` (cached: tables are O(stages))."""
    num_stages = placement.num_stages
    stride = len(Token) * num_stages
    rank_of_stage = placement.rank_of_stage

    def value(key: Key) -> int:
        assert key[2] == 0 and 0 <= key[1] < num_stages, key  # micro-batch 0, a real stage
        return key[0] * num_stages + key[1]

    needs: dict[OpKind, dict[int, tuple[Need, ...]]] = {kind: {} for kind in OpKind}
    awaited: dict[OpKind, dict[int, tuple[int, ...]]] = {kind: {} for kind in OpKind}
    transfers: dict[OpKind, dict[int, tuple[Transfer, ...]]] = {kind: {} for kind in OpKind}
    posts: dict[OpKind, dict[int, Post]] = {kind: {} for kind in OpKind}
    needed = {  # every value some action needs, at micro-batch 0
        value(k)
        for stage in range(num_stages)
        for kind in _PLAIN_COMPUTE
        for k in requires(Action(kind, stage, 0), placement.stages_per_chain)
    }
    for stage in range(num_stages):
        for kind in _PLAIN_COMPUTE:
            action = Action(kind, stage, 0)
            needs[kind][stage] = tuple(
                Need(value(k), rank_of_stage[k[1]], k[0], k[1])
                for k in requires(action, placement.stages_per_chain)
            )
            made = produces(action)
            awaited[kind][stage] = tuple(value(k) for k in made if value(k) in needed)
            transfers[kind][stage] = tuple(
                Transfer(value(k), *transfer(k), rank_of_stage[consumer])
                for k in made
                if crosses_ranks(k, placement)
                and (consumer := consumer_stage(k, placement.stages_per_chain)) is not None
            )
        for kind in COMM_KINDS:
            key = comm_key(Action(kind, stage, 0))
            if 0 <= key[1] < num_stages:
                is_send = kind in SEND_KINDS
                recv_post = 2 * value(key)
                posts[kind][stage] = (
                    Post(recv_post + 1, recv_post, value(key), True)
                    if is_send
                    else Post(recv_post, recv_post + 1, value(key), False)
                )
    return CompiledRule(placement, stride, needs, awaited, transfers, posts)
