"""Pausing Python's cyclic garbage collector while a program of ~10^6 actions is built or read.

Building, lowering, validating and simulating a large program allocate millions of long-lived
container objects (actions, rows, spans) and no reference cycles. Each time the youngest
generation fills, the collector promotes them, and every time the survivors grow by a quarter it
walks *every* tracked object again: on 128 ranks × 1,024 micro-batches that walking costs more
than the work itself. Reference counting frees everything these functions drop, so the collector
is paused for their duration and resumed after, as ``timeit`` does for the code it times.

Pausing nests and is thread-tolerant: only the outermost pause that found the collector running
turns it back on, so a pause never leaves the collector off.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off inside the block, back on after it if it was on before."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def without_gc(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """``function`` run under ``gc_paused``."""

    @wraps(function)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with gc_paused():
            return function(*args, **kwargs)

    return paused
