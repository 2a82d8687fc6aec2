"""Whole-step CUDA graphs (``runtime.cuda_graph``) as far as a CPU can hold them: what is refused,
when a step must be captured again, and how a replay's gradients reach ``.grad`` — each
accumulation case against eager autograd's. Capture and replay themselves need GPUs:
``benchmarks/runtime/cuda_graph_gpu.py --part exact`` compares them with eager steps in float64 on
NCCL (docs/benchmarks.md, "Whole-step CUDA graphs")."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from torch import nn

from pipetrain.runtime import cuda_graph
from pipetrain.runtime.cuda_graph import StepGraph
from pipetrain.runtime.microbatch import split

CPU = torch.device("cpu")


def graph_of(*modules: nn.Module, losses=None) -> StepGraph:
    return StepGraph(CPU, list(modules), losses)


def micro(rows: int = 4, m: int = 2, targets=True):
    x = torch.randn(rows, 3)
    return split(x, torch.randn(rows, 3) if targets else None, m)


def test_construction_refuses_what_a_capture_cannot_run(monkeypatch):
    for name in cuda_graph.ALLOCATOR_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    cuda_graph.check(False, CPU, None, None, None)  # off: nothing to check
    with pytest.raises(ValueError, match="captures the step on a CUDA device; .* runs on cpu"):
        cuda_graph.check(True, CPU, None, None, None)
    cuda = torch.device("cuda", 0)
    for given, name in ((("ddp", None, None), "data_parallel"), ((None, "mesh", None), "mesh")):
        with pytest.raises(ValueError, match=f"cuda_graph=True with {name} is not supported"):
            cuda_graph.check(True, cuda, *given)
    with pytest.raises(ValueError, match="with offload is not supported.*plan --cuda-graph"):
        cuda_graph.check(True, cuda, None, None, [0.5, 0.0])
    cuda_graph.check(True, cuda, None, None, [0.0, 0.0])  # a plan that offloads nothing


@pytest.mark.parametrize("name", cuda_graph.ALLOCATOR_SETTINGS)
def test_expandable_segments_are_refused_until_verified(monkeypatch, name):
    cuda = torch.device("cuda", 0)
    for other in cuda_graph.ALLOCATOR_SETTINGS:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, "max_split_size_mb:128")
    cuda_graph.check(True, cuda, None, None, None)
    monkeypatch.setenv(name, "garbage_collection_threshold:0.8, expandable_segments:True")
    with pytest.raises(ValueError, match="expandable_segments:True is set"):
        cuda_graph.check(True, cuda, None, None, None)


def test_a_timeline_of_a_replay_needs_the_timing_events_captured_with_it():
    cuda = torch.device("cuda", 0)
    with pytest.raises(
        ValueError, match="cuda_graph must be one of False, True, 'timed'; got 'on'"
    ):
        cuda_graph.check("on", cuda, None, None, None)
    plain = cuda_graph.build(True, CPU, [nn.Linear(3, 3)], None, rank=0)
    timed = cuda_graph.build("timed", CPU, [nn.Linear(3, 3)], None, rank=1)
    assert cuda_graph.build(False, CPU, [nn.Linear(3, 3)], None, rank=0) is None
    assert plain is not None and plain.recorder is None
    with pytest.raises(ValueError, match="timeline=True .* cuda_graph='timed' .* cuda_graph=False"):
        cuda_graph.check_step(plain, timeline=True)
    cuda_graph.check_step(plain, timeline=False)
    cuda_graph.check_step(None, timeline=True)  # eager: every step has its timeline
    assert timed is not None and timed.recorder is not None
    cuda_graph.check_step(timed, timeline=True)
    # its recorder records inside a capture: no barrier, no host clock; and not while none runs
    assert timed.recorder.captured and timed.recorder.rank == 1
    assert timed.capturing_recorder() is None and plain.capturing_recorder() is None


def test_the_key_changes_with_what_a_captured_step_baked_in():
    layer = nn.Linear(3, 3)
    g = graph_of(layer)
    mbs = micro()
    key = g._key_of(mbs, ())
    assert g._key_of(micro(), ()) == key  # new values, same shapes: replay
    assert g._key_of(micro(rows=6), ()) != key  # new shapes
    layer.weight.requires_grad_(False)
    assert g._key_of(mbs, ()) != key
    layer.weight.requires_grad_(True)
    layer.train(False)
    assert g._key_of(mbs, ()) != key
    layer.train(True)
    assert g._key_of(mbs, ()) == key
    layer.weight.data = layer.weight.data.clone()  # new storage: the graph reads the old one
    assert g._key_of(mbs, ()) != key
    side = ({"causal": True}, {"causal": True})
    assert g._key_of(mbs, side) != g._key_of(mbs, ({"causal": False}, {"causal": False}))


def test_what_a_replay_could_not_see_change_is_refused():
    g = graph_of(nn.Linear(3, 3))
    mbs = split(torch.randn(4, 3), None, 2)
    odd = type(mbs)(mbs.inputs, ("labels", "labels"), mbs.weights, mbs.batch_size)
    with pytest.raises(ValueError, match="needs targets as tensors"):
        g._key_of(odd, ())
    with pytest.raises(ValueError, match="side input 'spans' is a list"):
        g._key_of(mbs, ({"spans": [1, 2]}, {"spans": [3]}))


def test_a_batch_tensor_shared_by_micro_batches_gets_one_static_buffer():
    g = graph_of(nn.Linear(3, 3))
    mbs = micro(targets=False)
    whole = torch.ones(5)
    found = g._tensors_of(mbs, ({"bias": whole}, {"bias": whole}))
    assert len(found) == 3 and found[-1] is whole


class FakeGraph:
    """Stands in for a captured graph: a replay rewrites the gradient buffers and adds into the
    kept ``.grad`` tensors in place, as the captured kernels do."""

    def __init__(self, buffers: list[torch.Tensor], values: list[torch.Tensor], adds=()) -> None:
        self.buffers, self.values, self.adds = buffers, values, list(adds)

    def replay(self) -> None:
        for b, v in zip(self.buffers, self.values):
            b.copy_(v)
        for into, v in self.adds:
            into.add_(v)


def test_a_replay_hands_its_buffer_over_where_grad_was_none():
    p = nn.Parameter(torch.zeros(3))
    g = graph_of(nn.ParameterList([p]))
    buffer, step = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
    g._graph = FakeGraph([buffer], [step])  # type: ignore[assignment]
    g._grads = {p: buffer}
    g._replay()
    assert p.grad is buffer and torch.equal(p.grad, step)  # no copy where nothing accumulates
    assert g.replays == 1


def test_a_kept_grad_is_accumulated_in_place_and_stays_the_only_copy():
    """A ``.grad`` kept between steps (``zero_grad(set_to_none=False)``, or accumulation) is
    captured as it is: the replay adds into that tensor, as ``AccumulateGrad`` does, and the
    graph holds no gradient buffer of its own beside it."""
    p = nn.Parameter(torch.zeros(3))
    g = graph_of(nn.ParameterList([p]))
    p.grad = torch.tensor([10.0, 20.0, 30.0])
    held, step = p.grad, torch.tensor([1.0, 2.0, 3.0])
    g._graph = FakeGraph([], [], adds=[(held, step)])  # type: ignore[assignment]
    g._grads = {}
    g._replay()
    assert p.grad is held and torch.equal(p.grad, torch.tensor([11.0, 22.0, 33.0]))
    held.zero_()  # zero_grad(set_to_none=False)
    g._replay()
    assert p.grad is held and torch.equal(p.grad, step)


def test_the_key_follows_grad_storage_not_its_values():
    layer = nn.Linear(3, 3)
    g = graph_of(layer)
    mbs = micro()
    none = g._key_of(mbs, ())
    layer.weight.grad = torch.ones(3, 3)
    kept = g._key_of(mbs, ())
    assert kept != none  # None became kept: the graph would write a buffer, not add
    layer.weight.grad.zero_()
    assert g._key_of(mbs, ()) == kept  # zeroed in place: the same tensor the graph adds into
    layer.weight.grad = torch.ones(3, 3)
    assert g._key_of(mbs, ()) != kept  # a new tensor: the graph would add into the old one


def test_a_step_that_finds_the_buffer_kept_copies_it_out_and_captures_again(monkeypatch):
    """After a replay handed its buffer over, a loop that keeps it (``set_to_none=False``) gives
    the next step another key: the graph is dropped, warms up and captures again — the buffer
    copied out first (same values), so that no ``.grad`` keeps the dropped graph's pool."""
    p = nn.Parameter(torch.zeros(3))
    g = graph_of(nn.ParameterList([p]))
    buffer, step = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
    mbs = micro()
    g._key = g._key_of(mbs, ())
    g._graph = FakeGraph([buffer], [step])  # type: ignore[assignment]
    g._grads = {p: buffer}
    g._replay()
    assert p.grad is buffer
    ran = []
    g.step(mbs, (), lambda: None, lambda m, s: ran.append("eager"))  # type: ignore[arg-type]
    assert ran == ["eager"] and not g.captured and g._grads == {}
    assert p.grad is not buffer and torch.equal(p.grad, step)
    assert g._key == g._key_of(mbs, ())  # keyed on the copy: the next step warms up on


def fake_capture(monkeypatch, g: StepGraph) -> None:
    """``_capture``'s CUDA calls as no-ops: the step runs once, eagerly, in their place."""

    class Stream:
        def wait_stream(self, other) -> None:
            pass

    @contextlib.contextmanager
    def capture(*args, **kwargs):
        yield

    g.stream = Stream()  # type: ignore[assignment]
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "graph", capture)


def test_a_capture_keeps_existing_grads_and_takes_buffers_for_the_rest(monkeypatch):
    kept, fresh = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    kept.grad = torch.ones(2)
    held = kept.grad
    g = graph_of(nn.ParameterList([kept, fresh]))
    fake_capture(monkeypatch, g)

    def run(mbs, side) -> None:  # what the backward paths do: add in place, or set a first one
        assert kept.grad is held  # not set aside
        kept.grad.add_(1.0)
        fresh.grad = torch.full((2,), 5.0)

    g._capture(micro(), (), run)
    assert kept.grad is held and fresh.grad is None  # the buffer is handed over by a replay
    assert list(g._grads) == [fresh] and torch.equal(g._grads[fresh], torch.full((2,), 5.0))

    def replaces(mbs, side) -> None:
        kept.grad = kept.grad + 1.0

    g.release()
    with pytest.raises(ValueError, match="replaced 1 existing .grad .* cuda_graph=False"):
        g._capture(micro(), (), replaces)
    assert kept.grad is held and not g.captured


def test_a_replay_restores_the_last_stage_losses_the_loss_agreement_pops():
    losses: dict[int, torch.Tensor] = {}
    g = graph_of(nn.Linear(3, 3), losses=losses)
    g._graph = FakeGraph([], [])  # type: ignore[assignment]
    g._captured_losses = {0: torch.tensor(1.0), 1: torch.tensor(2.0)}
    g._replay()
    assert sorted(losses) == [0, 1]
    losses.clear()  # what losses.agree does
    g._replay()
    assert sorted(losses) == [0, 1]
    g.release()
    assert not g.captured and g._grads == {} and g._captured_losses == {}


def test_the_exit_hook_releases_a_live_graph_and_keeps_none_alive():
    """NCCL's ``destroy_process_group`` waits forever on a communicator a live graph holds
    transfers of: a pipeline dropped before it must take its graph along, so the exit hook
    registered at capture holds the graph weakly."""
    g = graph_of(nn.Linear(3, 3))
    g._graph = FakeGraph([], [])  # type: ignore[assignment]
    hook = cuda_graph._release_at_exit(g)
    hook()
    assert not g.captured
    g._graph = FakeGraph([], [])  # type: ignore[assignment]
    watched = weakref.ref(g)
    hook = cuda_graph._release_at_exit(g)
    del g
    gc.collect()
    assert watched() is None  # the hook did not keep the graph
    hook()  # and does nothing once it is gone


def test_the_ranks_meet_once_after_a_capture_before_its_first_replay(monkeypatch):
    """A rank whose capture failed never replays; a peer replaying at once would wait on the
    device for its transfers for good. So every rank meets (the store-based exchange, which
    hears of failures) after capturing, and only then replays — once per capture, not per
    step."""
    g = graph_of(nn.Linear(3, 3))
    events: list[str] = []

    def capture(mbs, side, run) -> None:
        events.append("capture")
        g._graph = FakeGraph([], [])  # type: ignore[assignment]

    monkeypatch.setattr(g, "_capture", capture)
    monkeypatch.setattr(g, "_fill", lambda mbs, side: None)
    monkeypatch.setattr(g, "_replay", lambda: events.append("replay"))
    mbs = micro()

    class Agreement:  # what the step tells the peers, and the meeting after a capture
        graph_step = ""

        def captured(self) -> None:
            events.append("met")

    agreement = Agreement()
    told = []
    for _ in range(cuda_graph.WARMUP + 3):
        run = lambda m, s: events.append("eager")  # noqa: E731
        g.step(mbs, (), lambda: events.append("announce"), run, agreement=agreement)  # type: ignore[arg-type]
        told.append(agreement.graph_step)
    warm = ["eager"] * cuda_graph.WARMUP
    assert events == [*warm, "capture", "met", "replay", *["announce", "replay"] * 2]
    assert told == [*warm, "capture", "replay", "replay"]


def test_a_step_that_cannot_be_captured_is_refused_naming_why(monkeypatch):
    """A stage that waits for the host inside the capture (``.item()``) makes CUDA refuse the
    capture; the pipeline says so as a refusal, and every ``.grad`` set aside comes back."""
    layer = nn.Linear(3, 3)
    layer.weight.grad = torch.ones(3, 3)
    g = graph_of(layer)
    fake_capture(monkeypatch, g)

    def run(mbs, side) -> None:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    with pytest.raises(ValueError, match="could not be captured .* cuda_graph=False"):
        g._capture(micro(), (), run)
    assert not g.captured and torch.equal(layer.weight.grad, torch.ones(3, 3))

    def other(mbs, side) -> None:
        raise RuntimeError("shapes do not match")

    with pytest.raises(RuntimeError, match="shapes do not match"):
        g._capture(micro(), (), other)


def test_a_captured_recorder_never_waits_on_its_peers_inside_the_capture(monkeypatch):
    from pipetrain.runtime import timing
    from pipetrain.schedule.action import Action, OpKind

    def no_barrier(group, cuda):
        raise AssertionError("a barrier inside a capture")

    monkeypatch.setattr(timing, "align", no_barrier)
    recorder = timing.Recorder(0, CPU, True, captured=True)
    for _ in range(2):  # a capture again (a new key) starts from no marks
        recorder.begin(None)
        recorder.stop(Action(OpKind.F, 0, 0), recorder.start())
        assert len(recorder.spans()) == 1
    assert recorder.host_bound_idle(recorder.spans()) is None
    with pytest.raises(AssertionError, match="a barrier"):  # an eager timed step lines up
        timing.Recorder(0, CPU, True).begin(None)
