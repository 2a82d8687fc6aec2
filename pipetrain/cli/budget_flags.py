"""The flags of the commands that plan from a costs file under a memory budget (``pipetrain
plan``, ``pipetrain synthesize``), declared once: both read the costs file and the budget alike,
so a synthesized schedule and the planner's pick it is set beside are judged under one cap.

Their validators (a budget in GiB, a share kept free) live here too: no other command takes them.
"""

from __future__ import annotations

import argparse

from pipetrain.cli.flags import Option
from pipetrain.planner.search import DEFAULT_HEADROOM


def gib(text: str) -> float:
    """A finite number of GiB > 0 (a memory budget)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of GiB > 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1) (a share kept free)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


COSTS = Option(
    ("--costs",), required=True, metavar="FILE", help="costs file (JSON, version 1 to 3)"
)
MEMORY_GIB = Option(
    ("--memory-gib",),
    type=gib,
    required=True,
    metavar="G",
    help="memory budget per rank (GiB)",
)
HEADROOM = Option(
    ("--headroom",),
    type=fraction,
    default=DEFAULT_HEADROOM,
    metavar="F",
    help="share of --memory-gib kept free for what the costs file cannot see: allocator "
    "fragmentation, NCCL buffers, optimizer temporaries",
)
#: the budget, in the order both commands list it
BUDGET = (MEMORY_GIB, HEADROOM)
