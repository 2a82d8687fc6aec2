"""``--prefetch-batches 0``: ``prefetch(source, 0)`` iterates in the caller's thread, item by item
as asked for, and closes its source like ``Prefetch`` does."""

from __future__ import annotations

import threading

import pytest

from pipetrain.app.data.prefetch import InLine, Prefetch, prefetch


def test_zero_ahead_builds_each_item_when_asked_in_the_callers_thread() -> None:
    built: list[tuple[int, str]] = []
    closed = threading.Event()

    def source():
        try:
            for i in range(5):
                built.append((i, threading.current_thread().name))
                yield i
        finally:
            closed.set()

    with prefetch(source(), 0) as batches:
        assert isinstance(batches, InLine)
        assert built == []  # nothing built before the loop asks
        assert next(batches) == 0 and len(built) == 1  # nothing built ahead
        assert next(batches) == 1 and len(built) == 2
    assert closed.is_set()  # leaving the block closed the generator
    assert {name for _, name in built} == {threading.current_thread().name}


def test_one_or_more_ahead_is_the_threaded_prefetch_in_the_same_order() -> None:
    for ahead in (1, 2):
        batches = prefetch(iter(range(6)), ahead)
        assert isinstance(batches, Prefetch)
        assert list(batches) == list(range(6))
        batches.close()
    with pytest.raises(ValueError, match="ahead must be"):
        prefetch(iter(()), -1)
