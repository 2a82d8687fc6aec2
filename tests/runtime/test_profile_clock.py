"""The profiler's clocks (``runtime.profile.profile_clock``): which one a timing names, what is refused,
and the device clock's busy time — the union of the device's intervals — from a stubbed
``torch.profiler`` (the real one needs a GPU: ``benchmarks/planner/plan_gpu.py --cuda-graph``)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.autograd import DeviceType

from pipetrain.cli import profile_command
from pipetrain.runtime.profile import profile_clock, profile_replay
from pipetrain.runtime.profile.profile_clock import (
    Clock,
    DeviceClock,
    busy_us,
    clock_for,
    gap_per_kernel,
    slowdown,
)
from pipetrain.runtime.profile.profile_layers import profile
from pipetrain.runtime.profile.profile_replay import window_work

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("spans", "want"),
    [
        ([], 0.0),
        ([(0, 2), (5, 6)], 3.0),  # apart: both
        ([(0, 4), (1, 2)], 4.0),  # nested: once
        ([(3, 6), (0, 4)], 6.0),  # overlapping, out of order
        ([(0, 1), (1, 2)], 2.0),  # touching
    ],
)
def test_busy_time_counts_time_covered_by_any_interval_once(spans, want):
    assert busy_us(spans) == want


def test_a_timing_names_its_clock_and_the_device_clock_needs_cuda():
    assert type(clock_for(CPU, "wall")) is Clock
    with pytest.raises(ValueError, match="timing must be one of wall, device, got 'gpu'"):
        clock_for(CPU, "gpu")
    with pytest.raises(ValueError, match='busy time of a CUDA device .* use timing="wall"'):
        clock_for(CPU, "device")
    with pytest.raises(ValueError, match="CUDA device"):
        profile([nn.Linear(2, 2)], torch.randn(3, 2), repeats=1, warmup=0, timing="device")
    assert profile_command.TIMINGS == profile_clock.TIMINGS  # the parser's copy, without torch


def stub_profiler(monkeypatch, spans_per_call, device_alone=True, gap_us=0.0, annotations=()):
    """``torch.profiler.profile`` recording, per use, the given device spans (µs) beside a host
    event that must not count; without ``device_alone``, nothing unless the host is profiled too
    (the fallback a profiler that needs both takes). A replay's gap per kernel: ``gap_us`` (the
    real one captures a CUDA graph)."""
    calls = iter(spans_per_call)
    monkeypatch.setattr(profile_clock, "replay_gap_us", lambda device, clock, work: gap_us)
    monkeypatch.setattr(profile_clock, "sustained_slowdown", lambda device, work: 1.0)

    @contextlib.contextmanager
    def fake_profile(activities):
        spans = next(calls) if device_alone or len(activities) > 1 else []

        def at(start, end, kind, annotation=False):
            return SimpleNamespace(
                time_range=SimpleNamespace(start=start, end=end), device_type=kind,
                is_user_annotation=annotation,
            )  # fmt: skip

        host = at(0.0, 1e6, DeviceType.CPU)
        marks = [at(a, b, DeviceType.CUDA, annotation=True) for a, b in annotations]
        kernels = [at(a, b, DeviceType.CUDA) for a, b in spans]
        yield SimpleNamespace(events=lambda: [host, *marks, *kernels])

    monkeypatch.setattr(torch.profiler, "profile", fake_profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_the_device_clock_reads_the_device_spans_alone(monkeypatch):
    # the probe at construction, then one timed call: kernels on two streams, overlapping
    stub_profiler(monkeypatch, [[(0.0, 10.0)], [(0.0, 300.0), (200.0, 500.0), (900.0, 1000.0)]])
    clock = DeviceClock(CPU)
    ms, result = clock.time(lambda: "done")
    assert ms == pytest.approx(0.6) and result == "done"
    assert clock.timing == "device"


def test_the_device_clock_adds_a_replays_gap_per_kernel_and_copy(monkeypatch):
    # a replayed graph starts each kernel a little after the one before it ends: three spans,
    # two of them overlapping on two streams, each pays the gap once
    stub_profiler(monkeypatch, [[(0.0, 10.0)], [(0.0, 300.0), (200.0, 500.0), (900.0, 1000.0)]],
                  gap_us=2.0)  # fmt: skip
    clock = DeviceClock(CPU)
    assert clock.replay_gap_us == 2.0
    assert clock.time(lambda: None)[0] == pytest.approx((600.0 + 3 * 2.0) / 1e3)
    # a user annotation on the device's track (a span over kernels of its own) is no work
    spans = [[(0.0, 10.0)], [(0.0, 300.0), (900.0, 1000.0)]]
    stub_profiler(monkeypatch, spans, gap_us=2.0, annotations=[(0.0, 2000.0)])
    assert DeviceClock(CPU).time(lambda: None)[0] == pytest.approx((400.0 + 2 * 2.0) / 1e3)


def test_the_device_clock_profiles_the_host_too_only_where_it_must(monkeypatch):
    from torch.profiler import ProfilerActivity

    stub_profiler(monkeypatch, [[(0.0, 10.0)]])
    assert DeviceClock(CPU).activities == [ProfilerActivity.CUDA]
    stub_profiler(monkeypatch, [[(0.0, 10.0)], [(0.0, 250.0)]], device_alone=False)
    clock = DeviceClock(CPU)
    assert len(clock.activities) == 2 and clock.time(lambda: None)[0] == pytest.approx(0.25)


def test_a_profiler_that_sees_no_device_work_is_refused_at_once(monkeypatch):
    stub_profiler(monkeypatch, [[], []])
    with pytest.raises(RuntimeError, match='recorded no device activity .* timing="wall"'):
        DeviceClock(CPU)


def test_plan_says_when_the_costs_were_timed_for_the_other_kind_of_step():
    from pipetrain.cli.plan_command import timing_note

    assert timing_note("wall", cuda_graph=False) == timing_note("device", cuda_graph=True) == ""
    assert "runs faster than predicted; profile with --timing device" in timing_note("wall", True)
    assert "runs slower than predicted; add --cuda-graph" in timing_note("device", False)


def test_the_host_link_names_its_directions():
    from pipetrain.runtime.profile.host_link import link_gbs

    with pytest.raises(ValueError, match="directions must be some of down, up, got"):
        link_gbs(CPU, 1 << 10, 1, ("sideways",))
    with pytest.raises(ValueError, match="directions must be some of down, up"):
        link_gbs(CPU, 1 << 10, 1, ())


def test_a_replays_gap_is_its_time_beyond_the_busy_time_shared_by_its_kernels():
    # 1 ms replayed over three kernels busy 100 + 200 µs (two overlap: busy counts once)
    assert gap_per_kernel(1.0, [(0.0, 100.0), (50.0, 150.0), (500.0, 650.0)]) == pytest.approx(
        (1000.0 - 300.0) / 3
    )
    assert gap_per_kernel(0.1, [(0.0, 300.0)]) == 0.0  # a replay faster than busy: no gap
    assert gap_per_kernel(1.0, []) == 0.0


def test_the_clock_measures_its_gap_again_on_the_models_layers_or_says_why_not(monkeypatch):
    stub_profiler(monkeypatch, [[(0.0, 10.0)], [(0.0, 10.0)]])
    # the stub's gap: 0.5 µs on the chain of small kernels, on other work what the work returns
    monkeypatch.setattr(
        profile_clock,
        "replay_gap_us",
        lambda device, clock, work: 0.5 if work.__name__ == "chain" else work(),
    )
    monkeypatch.setattr(profile_clock, "sustained_slowdown", lambda device, work: 1.06)
    clock = DeviceClock(CPU)
    assert clock.replay_gap_us == 0.5 and "chain of 512" in clock.gap_measured_on
    assert clock.sustained == 1.0  # the chain stands for no stage's power draw
    clock.calibrate(lambda: 1.75, "layers 2..5")
    assert clock.replay_gap_us == 1.75 and clock.gap_measured_on == "layers 2..5"
    assert clock.sustained == 1.06

    def uncapturable():
        raise RuntimeError("operation not permitted when stream is capturing")

    clock = DeviceClock(CPU)
    clock.calibrate(uncapturable, "layers 2..5")
    assert clock.replay_gap_us == 0.5 and clock.sustained == 1.0  # the chain's, no slowdown
    assert clock.gap_measured_on.endswith("(layers 2..5 could not be captured: RuntimeError)")


def test_the_calibrating_window_is_a_middle_one_run_as_a_stage_runs_it():
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(8)]
    work, what = window_work(layers, (torch.randn(2, 4),), context=4, in_flight=3)
    assert what == "layers 2..5, 3 micro-batches forward then backward"
    for layer in layers:
        layer.weight.grad = None
    work()
    with_grad = [i for i, layer in enumerate(layers) if layer.weight.grad is not None]
    assert with_grad == [2, 3, 4, 5]
    assert window_work(layers[:2], (torch.randn(2, 4),), context=4, in_flight=3) is None
    # the profiler gives the layers back with the gradients they had
    for layer in layers:
        layer.weight.grad = None
    ran = []
    # a wall clock (an eager profile's) measures its slowdown under sustained load there
    fake = SimpleNamespace(measure_sustained=lambda work, what: ran.append(work()))
    profile_replay.calibrate(fake, layers, (torch.randn(2, 4),), 4, 2)
    assert ran and all(layer.weight.grad is None for layer in layers)


def test_a_device_under_sustained_load_scales_every_time_the_clock_reads(monkeypatch):
    # three kernels, 600 µs busy, a gap of 2 µs each: 0.606 ms at the paused clock; a device
    # whose replays run 6% slower back to back prices the same work 6% higher
    stub_profiler(monkeypatch, [[(0.0, 10.0)], [(0.0, 300.0), (200.0, 500.0), (900.0, 1000.0)]],
                  gap_us=2.0)  # fmt: skip
    clock = DeviceClock(CPU)
    clock.sustained = 1.06
    assert clock.time(lambda: None)[0] == pytest.approx(1.06 * 0.606)


def test_the_slowdown_is_the_settled_back_to_back_replays_over_the_paused_ones():
    paused = [10.0, 10.2, 9.9, 10.1, 10.0]
    # the first replays run at the paused clock, then the clock falls and the replays settle
    back_to_back = [10.0, 10.3, 10.5] + [10.6] * 6
    assert slowdown(paused, back_to_back) == pytest.approx(1.06)
    assert slowdown(paused, [9.8] * 9) == 1.0  # a device that keeps its clock: never below 1


class _SplitClock(Clock):
    """A GPU's eager clock, stubbed: each piece 8 ms from an idle start, 4 of them the host's
    to issue, 2 for the device with its kernels queued ahead."""

    def __init__(self) -> None:
        super().__init__(CPU)
        self.issue_times = True
        self.leads: list[float] = []

    def issue(self, fn):
        return 8.0, 4.0, fn()

    def queued(self, fn, host_ms):
        self.leads.append(host_ms)
        fn()
        return 2.0

    def measure_sustained(self, work, what):
        self.sustained, self.sustained_on = 1.05, what


def test_an_eager_gpu_profile_splits_each_piece_into_host_and_device(monkeypatch) -> None:
    """Every piece is timed from an idle start (its wall time, and the host's issue time) and
    again queued behind the host's issue time, per micro-batch; the file carries both, and the
    planner then paces each rank by its host and its device."""
    from pipetrain.runtime.profile import profile_layers

    clock = _SplitClock()
    monkeypatch.setattr(profile_layers, "clock_for", lambda device, timing: clock)
    layers = [nn.Linear(4, 4) for _ in range(3)]
    costs = profile(
        layers, torch.randn(2, 4), repeats=2, warmup=1, in_flight=2, context=1,
        loss_fn=lambda y, t: (y**2).mean(),
    )  # fmt: skip
    assert costs.has_issue_times
    # the device's slowdown under sustained load, measured on the window a graphed profile
    # calibrates on
    assert costs.meta["sustained_slowdown"] == 1.05
    assert costs.meta["sustained_on"].startswith("layers 1..")
    assert costs.meta["queued_late"] == 0  # no piece measured with the device there too early
    for layer in costs.layers:
        for piece in ("forward", "backward", "backward_input", "backward_weight"):
            assert getattr(layer, piece) == 4.0  # 8 ms over 2 micro-batches
            assert getattr(layer, f"host_{piece}") == 2.0
            assert getattr(layer, f"device_{piece}") == 1.0
    # the queued pass leads by the same round's issue time; recompute's timings skip it
    assert set(clock.leads) == {4.0}
    assert len(clock.leads) == 3 * 3 * 5  # layers × rounds × (F, B; F, I, W)
