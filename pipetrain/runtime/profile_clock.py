"""How the profiler reads a time: what a piece of work costs depends on how the step will run it.

An eager step pays the host too. Each action is Python and kernel launches; where a layer's
kernels are short the device waits for them, so the time from an action's first kernel to its
last includes those waits. The ``"wall"`` clock measures that: CUDA events around the work on a
GPU (``perf_counter`` on a CPU), after a synchronisation, so the device starts idle.

A step replayed as one CUDA graph (``Pipeline(cuda_graph=True)``) issues no Python and no
launches: the device runs its kernels back to back, and a piece costs the device's busy time
alone. The ``"device"`` clock measures that: the work runs under ``torch.profiler`` and the time
is the union of the intervals its kernels and copies occupied on the device (overlapping
intervals, from several streams, counted once). A profile for a graphed run takes this clock;
one taken with the wall clock predicts a graphed step slow by the host time it no longer pays.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

#: the clocks ``profile`` takes (``timing=``)
TIMINGS = ("wall", "device")


class Clock:
    """Milliseconds of a callable from its start to its end: CUDA events on a GPU,
    ``perf_counter`` on a CPU (the ``"wall"`` timing)."""

    timing = "wall"

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

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
    """Milliseconds the device was busy running a callable's kernels and copies (the
    ``"device"`` timing; CUDA only)."""

    timing = "device"

    def __init__(self, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity

        super().__init__(device)
        probe = torch.ones(256, 256, device=device)
        # the device's activity alone where the profiler records it so (far fewer events to
        # collect and read back than with every host operator), else with the host's too
        for activities in ([ProfilerActivity.CUDA], [ProfilerActivity.CPU, ProfilerActivity.CUDA]):
            self.activities = activities
            if self.time(lambda: probe @ probe)[0] > 0:
                return
        raise RuntimeError(
            'timing="device": torch.profiler recorded no device activity for a matrix product '
            '(is CUPTI available?); profile with timing="wall"'
        )

    def time(self, fn: Callable[[], object]) -> tuple[float, object]:
        from torch.autograd import DeviceType
        from torch.profiler import profile

        torch.cuda.synchronize()
        with profile(activities=self.activities) as prof:
            result = fn()
            torch.cuda.synchronize()
        spans = [
            (e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == DeviceType.CUDA
        ]
        return busy_us(spans) / 1e3, result


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
