"""How the profiler reads a time: what a piece of work costs depends on how the step will run it.

An eager step pays the host too. Each action is Python and kernel launches; where a layer's
kernels are short the device waits for them, so the time from an action's first kernel to its
last includes those waits. The ``"wall"`` clock measures that: CUDA events around the work on a
GPU (``perf_counter`` on a CPU), after a synchronisation, so the device starts idle.

The wall clock on a GPU also splits the two (``issue_times``): the host's time to issue the
work (``perf_counter`` until the call returns, the device starting idle) and the device's time
for it with its kernels queued ahead (the work issued behind ``QUEUE_LEAD`` of a spinning kernel,
so the host has issued everything before the device reaches it, timed by events around it).
An eager step's simulation runs each rank as a host and a device with them (``sim.costs``): a
wall time alone counts host time that a device busy with earlier work hides, and misses none
that it waits for only where the host is the slower of the two.

A step replayed as one CUDA graph (``Pipeline(cuda_graph=True)``) issues no Python and no
launches: the device runs its kernels back to back, and a piece costs the device's busy time
alone — nearly: a replay still starts each kernel a little after the one before it ends, which
over the thousands of short kernels of a step adds up. The ``"device"`` clock measures what a
replay pays: the work runs under ``torch.profiler``; the time is the union of the intervals its
kernels and copies occupied on the device (overlapping intervals, from several streams, counted
once) plus, per kernel or copy, the replay's gap between dependent kernels, measured once per
clock (``replay_gap_us``: work captured as a graph, its replay against the same kernels' busy
time). The work is first a chain of small dependent kernels; ``DeviceClock.calibrate`` then
measures it again on the model's own layers run as a stage (``runtime.profile.profile_replay``): the
gap depends on the kernels' sizes and on what is in flight, so it is measured on the work the
clock will time. A profile for a graphed run takes this clock; one taken with the wall clock
predicts a graphed step slow by the host time it no longer pays.

A replayed step also keeps the device busy for as long as the step lasts, and a GPU at its power
limit lowers its clock under such load: back-to-back replays of the same graph run slower than
replays after an idle pause, by the same share for light and heavy work. The profiler's timed
pieces are short, with the device idle between them, so they run at the high clock. The same
calibration therefore also replays the model's window back to back for ``SUSTAIN_S`` and after
pauses, and the clock scales every time it reads by the ratio (``sustained``, never below 1;
1 where no window was measured). An eager step's device-bound ranks keep their devices as busy,
so the wall clock measures the same ratio on the same window and scales the device's queued
times by it (not the wall or host times: a rank that waits for its host idles its device).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from pipetrain.runtime import torch_compat

#: the clocks ``profile`` takes (``timing=``)
TIMINGS = ("wall", "device")


class Clock:
    """Milliseconds of a callable from its start to its end: CUDA events on a GPU,
    ``perf_counter`` on a CPU (the ``"wall"`` timing)."""

    timing = "wall"

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        #: whether ``issue`` and ``queued`` split a time into host and device (a GPU's eager
        #: step; on a CPU the host is the device)
        self.issue_times = self.cuda and self.timing == "wall"
        self._cycles_per_ms = 0.0
        self._lead = QUEUE_LEAD
        #: pieces whose device time was measured with the device reaching them before the host
        #: had issued them all (a spin too short: ``queued``'s lead doubles after each)
        self.late = 0
        #: how much slower the device runs under sustained load than after a pause (1:
        #: unmeasured), and on what; scales the device's times (``queued``, ``DeviceClock.time``)
        self.sustained = 1.0
        self.sustained_on = "not measured"

    def measure_sustained(self, work: Callable[[], object], what: str) -> None:
        """``sustained`` measured on ``work`` (capturable; the module docstring); where it
        cannot be captured it stays 1 and ``sustained_on`` says why."""
        try:
            self.sustained, self.sustained_on = sustained_slowdown(self.device, work), what
        except Exception as error:  # not capturable
            torch.cuda.synchronize(self.device)
            self.sustained_on = f"{what} could not be captured: {type(error).__name__}"

    def issue(self, fn: Callable[[], object]) -> tuple[float, float, object]:
        """(ms from start to end, ms the host took to issue ``fn``, its result), the device
        starting idle (where the clock does not split them: its time twice)."""
        if not self.issue_times:
            ms, result = self.time(fn)
            return ms, ms, result
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        begin = time.perf_counter()
        result = fn()
        host = (time.perf_counter() - begin) * 1e3
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end), host, result

    def queued(self, fn: Callable[[], object], host_ms: float) -> float:
        """Ms the device takes for ``fn`` with its kernels queued ahead: issued behind a spinning
        kernel longer than the host's ``host_ms`` to issue it by ``QUEUE_LEAD`` (where the clock
        does not split them: its time)."""
        if not self.issue_times:
            return self.time(fn)[0]
        if not self._cycles_per_ms:
            self._cycles_per_ms = _spin_rate()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        lead = self._lead * (host_ms + 1.0)
        torch_compat.device_spin(int(self._cycles_per_ms * lead))
        start.record()
        fn()
        if start.query():  # the device got there before the host had issued everything
            self.late += 1
            self._lead *= 2  # the next pieces lead by more (this one cannot run again)
        end.record()
        torch.cuda.synchronize()
        return self.sustained * start.elapsed_time(end)

    def time(self, fn: Callable[[], object]) -> tuple[float, object]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            result = fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end), result
        begin = time.perf_counter()
        result = fn()
        return (time.perf_counter() - begin) * 1e3, result


class DeviceClock(Clock):
    """Milliseconds a replayed graph spends on a callable's kernels and copies: the device's busy
    time plus ``replay_gap_us`` per kernel or copy, times ``sustained`` (the ``"device"`` timing;
    CUDA only)."""

    timing = "device"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.activities = self._activities(device)
        #: µs a replayed graph leaves between one kernel's end and the next one's start, and the
        #: work it was measured on
        self.replay_gap_us = replay_gap_us(device, self, kernel_chain(device))
        self.gap_measured_on = f"a chain of {CHAIN_KERNELS} small kernels"

    def calibrate(self, work: Callable[[], object], what: str) -> None:
        """Measure the replay's gap and its slowdown under sustained load on ``work``
        (capturable: static shapes, no host synchronisation), the kernels the clock will time.
        Where ``work`` cannot be captured the chain's gap and no slowdown stay, and
        ``gap_measured_on`` says why."""
        try:
            gap = replay_gap_us(self.device, self, work)
            self.sustained, self.sustained_on = sustained_slowdown(self.device, work), what
            self.replay_gap_us, self.gap_measured_on = gap, what
        except Exception as error:  # not capturable: keep the chain's gap, say so
            torch.cuda.synchronize(self.device)
            self.gap_measured_on += f" ({what} could not be captured: {type(error).__name__})"

    def _activities(self, device: torch.device) -> list:
        """The device's activity alone where the profiler records it so (far fewer events to
        collect and read back than with every host operator), else with the host's too."""
        from torch.profiler import ProfilerActivity

        probe = torch.ones(256, 256, device=device)
        for activities in ([ProfilerActivity.CUDA], [ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            self.activities = activities
            if self.spans(lambda: probe @ probe)[0]:
                return activities
        raise RuntimeError(
            'timing="device": torch.profiler recorded no device activity for a matrix product '
            '(is CUPTI available?); profile with timing="wall"'
        )

    def spans(self, fn: Callable[[], object]) -> tuple[list[tuple[float, float]], object]:
        """The device intervals (µs) of ``fn``'s kernels and copies, and its result."""
        from torch.autograd import DeviceType
        from torch.profiler import profile

        torch.cuda.synchronize()
        with profile(activities=self.activities) as prof:
            result = fn()
            torch.cuda.synchronize()
        spans = [  # a user annotation spans kernels of its own: not a piece of work
            (e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
        return spans, result

    def time(self, fn: Callable[[], object]) -> tuple[float, object]:
        spans, result = self.spans(fn)
        busy = busy_us(spans) + len(spans) * self.replay_gap_us
        return self.sustained * busy / 1e3, result


#: how much longer than the host's issue time the device is kept busy before work is timed
#: queued (the issue time varies from round to round)
QUEUE_LEAD = 2.0


def _spin_rate() -> float:
    """The device's spin cycles per ms (``torch_compat.device_spin``), measured."""
    cycles = 1 << 22
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch_compat.device_spin(cycles)  # the first launch pays its own set-up
    torch.cuda.synchronize()
    start.record()
    torch_compat.device_spin(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / max(start.elapsed_time(end), 1e-3)


#: kernels in the chain the clock first measures a replay's gap on
CHAIN_KERNELS = 512


def kernel_chain(device: torch.device) -> Callable[[], None]:
    """``CHAIN_KERNELS`` small dependent kernels."""
    x = torch.zeros(4096, device=device)

    def chain() -> None:
        for _ in range(CHAIN_KERNELS):
            x.add_(1.0)

    return chain


def replay_gap_us(device: torch.device, clock: DeviceClock, work: Callable[[], object]) -> float:
    """What a replayed CUDA graph adds per kernel or copy to the busy time of ``work``: captured
    once, its replay timed by CUDA events (the median of five) against the same work's busy time
    launched one kernel at a time (the median of three), over its count of kernels and copies.
    Never below 0. A difference of two near times: a few per cent of noise in either moves it by
    tenths of a µs."""
    with torch.cuda.device(device):  # capture and replay on ``device``, whichever is current
        graph = _captured(device, work)
        replays = sorted(Clock(device).time(graph.replay)[0] for _ in range(5))
        launched = sorted((clock.spans(work)[0] for _ in range(3)), key=busy_us)
        del graph
    return gap_per_kernel(replays[2], launched[1])


#: seconds of back-to-back replays that bring a GPU to the clock it holds under sustained load
#: (its clock falls within a tenth of a second at its power limit), and the idle pause before
#: each of ``PAUSED_REPLAYS`` replays that lets it recover
SUSTAIN_S = 0.6
PAUSE_S = 0.3
PAUSED_REPLAYS = 5


def sustained_slowdown(device: torch.device, work: Callable[[], object]) -> float:
    """How much slower ``work``, captured once, replays under sustained load than after an idle
    pause: replays back to back for ``SUSTAIN_S`` against ``PAUSED_REPLAYS`` replays each after
    ``PAUSE_S`` of idle device (``slowdown``)."""
    with torch.cuda.device(device):
        graph = _captured(device, work)
        paused = []
        for _ in range(PAUSED_REPLAYS):
            time.sleep(PAUSE_S)
            paused.append(Clock(device).time(graph.replay)[0])
        each = statistics.median(paused)
        count = max(6, math.ceil(SUSTAIN_S * 1e3 / max(each, 1e-3)))
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
        torch.cuda.synchronize(device)
        marks[0].record()
        for mark in marks[1:]:
            graph.replay()
            mark.record()
        torch.cuda.synchronize(device)
        back_to_back = [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
        del graph
    return slowdown(paused, back_to_back)


def slowdown(paused_ms: Sequence[float], back_to_back_ms: Sequence[float]) -> float:
    """The median of the last third of back-to-back replays (the device by then at the clock it
    holds) over the median paused replay; never below 1 (a device that keeps its clock measures
    1 within noise)."""
    last = back_to_back_ms[len(back_to_back_ms) * 2 // 3 :]
    return max(1.0, statistics.median(last) / statistics.median(paused_ms))


def _captured(device: torch.device, work: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``work`` warmed up on a side stream (as ``torch.cuda.graph`` asks) and captured."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            work()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    return graph


def gap_per_kernel(replay_ms: float, spans: list[tuple[float, float]]) -> float:
    """µs a replay taking ``replay_ms`` spent per kernel beyond the busy time of ``spans``."""
    if not spans:
        return 0.0
    return max(0.0, (replay_ms * 1e3 - busy_us(spans)) / len(spans))


def busy_us(spans: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: time covered by at least one."""
    total, reach = 0.0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def clock_for(device: torch.device, timing: str) -> Clock:
    """The profiler's clock for ``timing`` on ``device``; ``ValueError`` names the legal ones."""
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {', '.join(TIMINGS)}, got {timing!r}")
    if timing == "wall":
        return Clock(device)
    if device.type != "cuda":
        raise ValueError(
            f'timing="device" reads the busy time of a CUDA device (a graphed run\'s costs); the '
            f'layers are on {device.type}: use timing="wall"'
        )
    return DeviceClock(device)
