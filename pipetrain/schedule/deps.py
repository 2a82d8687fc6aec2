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

A value crosses ranks when its producer and consumer stages live on different ranks; then it
travels as ``SEND_F(s, j)`` → ``RECV_F(s + 1, j)`` (forward) or ``SEND_B(s, j)`` →
``RECV_B(s − 1, j)`` (backward), the pairing torch.distributed.pipelining uses.
"""

from __future__ import annotations

from enum import IntEnum

from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.placement import Placement


class Token(IntEnum):
    ACTIVATION = 0
    INPUT_GRAD = 1
    WEIGHT_GRAD = 2


Key = tuple[Token, int, int]


# The rule is pure and every pass (lower, validate, simulate, run) asks it about the same actions;
# remembering the answers makes a question a dict lookup (frozen actions hash cheaply).
_produced_by: dict[Action, tuple[Key, ...]] = {}
_required_by: dict[int, dict[Action, tuple[Key, ...]]] = {}


def produces(action: Action) -> tuple[Key, ...]:
    """Values that exist on the action's rank once it has finished."""
    found = _produced_by.get(action)
    if found is None:
        if len(_produced_by) > _MEMO_LIMIT:
            _produced_by.clear()
        found = _produced_by[action] = _produces(action)
    return found


def requires(action: Action, num_stages: int) -> tuple[Key, ...]:
    """Values that must exist (locally or received) before the compute action can start."""
    memo = _required_by.setdefault(num_stages, {})
    found = memo.get(action)
    if found is None:
        if len(memo) > _MEMO_LIMIT:
            memo.clear()
        found = memo[action] = _requires(action, num_stages)
    return found


_MEMO_LIMIT = 1 << 21


def _produces(action: Action) -> tuple[Key, ...]:
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
            case _:
                raise AssertionError(f"not a compute part: {a}")
    return tuple(out)


def _requires(action: Action, num_stages: int) -> tuple[Key, ...]:
    out: list[Key] = []
    for a in action.compute_parts:
        s, j = a.stage, a.microbatch
        match a.kind:
            case OpKind.F:
                if s > 0:
                    out.append((Token.ACTIVATION, s - 1, j))
            case OpKind.B | OpKind.I:
                out.append((Token.ACTIVATION, s, j))
                if s < num_stages - 1:
                    out.append((Token.INPUT_GRAD, s + 1, j))
            case OpKind.W:
                out.append((Token.INPUT_GRAD, s, j))
            case _:
                raise AssertionError(f"not a compute part: {a}")
    return tuple(out)


def consumer_stage(key: Key) -> int | None:
    """The stage that consumes a value on another stage, or None if it stays on its stage."""
    token, s, _ = key
    if token is Token.ACTIVATION:
        return s + 1
    if token is Token.INPUT_GRAD:
        return s - 1 if s > 0 else None
    return None


def crosses_ranks(key: Key, placement: Placement) -> bool:
    dst = consumer_stage(key)
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
    raise AssertionError(f"weight gradients never travel: {key}")


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
            raise AssertionError(f"not a communication action: {action}")


def peer(action: Action) -> Action:
    """The matching half of a SEND or RECV."""
    send, recv = transfer(comm_key(action))
    return recv if action.kind in (OpKind.SEND_F, OpKind.SEND_B) else send
