"""The host link as activation offload uses it: GB/s between a CUDA device and pinned host
memory, device to host, host to device, or both at once on two copy streams.

Offload's steady state runs both directions at once (one micro-batch's activations leave while
another's come back), and each direction then moves more slowly than it does alone (measured:
docs/planning.md, "Offload's price"), so the profiler prices copies at ``link_gbs`` with both
(``profile_layers``: ``host_bandwidth_gbs``).
"""

from __future__ import annotations

import statistics

import torch

from pipetrain.runtime.profile.profile_clock import Clock

#: bytes each way the profiler times: the order of one layer's saved activations, which
#: layer-by-layer offload copies as one piece
LINK_BYTES = 128 << 20
#: what ``host_bandwidth_gbs`` is (the costs file's ``meta.host_bandwidth``)
METHOD = "128 MiB each way, both directions at once (offload's steady state)"
DIRECTIONS = ("down", "up")


def link_gbs(
    device: torch.device,
    nbytes: int = LINK_BYTES,
    repeats: int = 5,
    directions: tuple[str, ...] = DIRECTIONS,
) -> float:
    """GB/s each way of ``nbytes`` copies in ``directions`` (``"down"``: device to host,
    ``"up"``: host to device), all at once, each on a stream of its own; the median of
    ``repeats`` timed runs after one untimed."""
    bad = [d for d in directions if d not in DIRECTIONS]
    if bad or not directions:
        raise ValueError(f"directions must be some of {', '.join(DIRECTIONS)}, got {directions}")
    main = torch.cuda.current_stream(device)
    copies = []
    for d in directions:
        device_side = torch.ones(nbytes, dtype=torch.uint8, device=device)
        host_side = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
        dst, src = (host_side, device_side) if d == "down" else (device_side, host_side)
        copies.append((torch.cuda.Stream(device), dst, src))

    def run() -> None:
        for stream, dst, src in copies:
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        for stream, _, _ in copies:
            main.wait_stream(stream)

    run()
    events = Clock(device)  # elapsed time: overlapping copies count once
    ms = statistics.median(events.time(run)[0] for _ in range(repeats))
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else 0.0
