"""Python's garbage collector on the training loop's schedule, not its own.

The cyclic collector runs when allocations outnumber frees by a threshold, so in a training step
it fires at arbitrary points, and a full collection walks every live Python object — a model's
modules, parameters and autograd bookkeeping among them. On a step whose host issues the device's
work (an eager step, short kernels) that pause stalls the device and makes step times wander, and
on several ranks the slowest rank's pause sets everyone's step. torchtitan's recipe
(``torchtitan/tools/utils.py``, ``GarbageCollection``): switch automatic collection off for the
run, collect the young generation every ``N`` steps at the same step on every rank, and switch it
back on at the end. Cycles made during the run go at the next collection; cycles among objects
that had already survived one (the oldest generation) wait for the end of the run.
"""

from __future__ import annotations

import gc


class GarbageCollection:
    """``every`` > 0: collect generation 1 every ``every`` steps and never in between;
    0: leave Python's automatic collection as it is. A context manager: the collector's state
    is restored on exit."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> GarbageCollection:
        if self.every > 0:
            gc.disable()
            gc.collect(1)
        return self

    def step(self, step: int) -> None:
        """After step ``step`` (1-based) finished: collect when one is due."""
        if self.every > 0 and step % self.every == 0:
            gc.collect(1)

    def __exit__(self, *exc: object) -> None:
        if self.every > 0 and self._was_enabled:
            gc.enable()
