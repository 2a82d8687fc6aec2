"""What a rank holds during a step: no sent buffer outlives its transfer, no stage input outlives
its micro-batch's backward (``runtime_memory_cases``)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from runtime_harness import launch
from runtime_memory_cases import run_held

from pipetrain.runtime.comm.p2p import Pending, PipelineTimeoutError, Transport
from pipetrain.schedule.action import Action, OpKind


class FakeWork:
    def __init__(self, state: bool | None) -> None:
        self.state = state  # True finished, False running, None: the check raises
        self.waits = 0

    def is_completed(self) -> bool:
        if self.state is None:
            raise RuntimeError("connection closed")
        return self.state

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        return True


def _transport_with(
    *states: bool | None, peers: tuple[int, ...] = ()
) -> tuple[Transport, list[Pending], list[FakeWork]]:
    transport = Transport(0, None, torch.device("cpu"), timedelta(seconds=1))
    works = [FakeWork(s) for s in states]
    peers = peers or (1,) * len(works)
    pendings = [
        Pending(Action(OpKind.SEND_F, 0, j), peer, [torch.zeros(2)], [w])
        for j, (w, peer) in enumerate(zip(works, peers, strict=True))
    ]
    transport._sends = list(pendings)
    return transport, pendings, works


def test_reap_waits_each_finished_send_once_and_keeps_the_running_ones() -> None:
    """A finished send is waited before it is let go: a backend that stashes an async op's
    tensors keeps them until ``wait()`` (or its watchdog's next sweep)."""
    transport, pendings, works = _transport_with(True, False, None)
    transport.reap()
    assert [w.waits for w in works] == [1, 0, 0]
    assert transport._sends == pendings[1:]  # behind a running send to its peer: not checked
    works[1].state = True
    transport.reap()
    assert [w.waits for w in works] == [1, 1, 0]  # a failed check is dropped unwaited
    assert transport._sends == []


def test_reap_checks_a_send_only_once_every_earlier_send_to_its_peer_has_finished() -> None:
    """One peer's sends finish in the order posted, so a running one holds back the checks of
    the later ones to that peer (a sweep per action stays short however many are in flight),
    not those to another peer."""
    transport, pendings, works = _transport_with(False, True, True, peers=(1, 1, 2))
    checked = []
    for w in works:
        w.is_completed = lambda w=w: (checked.append(w), w.state)[1]  # type: ignore[method-assign]
    transport.reap()
    assert checked == [works[0], works[2]]
    assert [w.waits for w in works] == [0, 0, 1]
    assert transport._sends == pendings[:2]


def test_reap_names_a_finished_send_whose_wait_fails() -> None:
    transport, _, works = _transport_with(True)
    works[0].wait = lambda timeout=None: False  # type: ignore[method-assign]
    with pytest.raises(PipelineTimeoutError, match="waited on rank 1"):
        transport.reap()


CASES = [("1f1b", 1, 8), ("interleaved-1f1b", 2, 8), ("zbv", 2, 8)]


@pytest.fixture(scope="module")
def held_per_rank() -> list[list[dict]]:
    return launch(4, run_held, CASES)


def test_no_transfer_buffer_is_left_to_the_backend(held_per_rank) -> None:
    """With NCCL's rule emulated on gloo (a transfer's tensors live until it is waited), the
    runtime never lets go of a transfer the backend still holds: at every compute action of
    every rank, nothing activation-sized is held by the stash alone."""
    for rank, results in enumerate(held_per_rank):
        for result in results:
            left = [(a, c["stashed"]) for a, c in result["actions"] if c["stashed"]]
            assert not left, f"rank {rank}, {result['case']}: buffers left stashed {left[:5]}"


def test_1f1b_keeps_only_the_inputs_of_micro_batches_in_flight(held_per_rank) -> None:
    """1F1B: rank r of p has at most p - r micro-batches between forward and backward, so
    holds at most that many stage inputs (rank 0's inputs are the data, never activations)."""
    world = len(held_per_rank)
    for rank, results in enumerate(held_per_rank):
        (result,) = [r for r in results if r["case"][0] == "1f1b"]
        most = max(c["saved"] for _, c in result["actions"])
        assert most == (0 if rank == 0 else world - rank), (rank, most)


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.waited_for: list[FakeStream] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited_for.append(other)


class FakeBuffer:
    def __init__(self) -> None:
        self.used_by: list[FakeStream] = []

    def record_stream(self, stream: FakeStream) -> None:
        self.used_by.append(stream)


def test_cuda_sends_are_let_go_of_at_posting_behind_the_send_stream(monkeypatch) -> None:
    """On CUDA a posted send is dropped at once: waited on the transport's send stream (not the
    compute stream), its buffer marked as used by that stream, so the allocator keeps its block
    until the transfer ends; the step's end orders the compute stream after the send stream."""
    current: list[FakeStream] = [FakeStream("compute")]

    class StreamContext:
        def __init__(self, stream: FakeStream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            current.append(self.stream)

        def __exit__(self, *exc) -> None:
            current.pop()

    waited_on: list[tuple[str, str]] = []

    class Work(FakeWork):
        def __init__(self, name: str) -> None:
            super().__init__(False)
            self.name = name

        def wait(self, timeout=None) -> bool:
            waited_on.append((self.name, current[-1].name))
            return True

    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    transport = Transport(0, None, torch.device("cpu"), timedelta(seconds=1))
    transport.send_stream = send_stream = FakeStream("sends")  # type: ignore[assignment]
    works = {"send": Work("send"), "recv": Work("recv")}
    monkeypatch.setattr(transport, "_post", lambda ops: [works[kind] for kind, _, _ in ops])
    sent, received = FakeBuffer(), FakeBuffer()
    send = Pending(Action(OpKind.SEND_F, 0, 0), 1, [sent], [])  # type: ignore[list-item]
    recv = Pending(Action(OpKind.RECV_B, 0, 0), 1, [received], [])  # type: ignore[list-item]
    transport.post([("send", send, sent), ("recv", recv, received)])  # type: ignore[list-item]
    assert waited_on == [("send", "sends")]
    assert sent.used_by == [send_stream] and received.used_by == []
    assert transport._sends == [] and send.works == [] and recv.works == [works["recv"]]
    transport.drain()
    assert current[0].waited_for == [send_stream]
