"""The training loop's collector: off between collections it runs itself, restored after."""

from __future__ import annotations

import gc

from pipetrain.app.garbage_collection import GarbageCollection


class Cycle:
    def __init__(self) -> None:
        self.me = self


def _cycles_alive() -> int:
    return sum(type(o) is Cycle for o in gc.get_objects())


def test_collections_run_only_on_the_steps_due_and_the_collector_comes_back():
    assert gc.isenabled()
    gc.collect()
    with GarbageCollection(3) as collector:
        assert not gc.isenabled()
        for _ in range(2000):  # far past the automatic threshold: nothing collects them
            Cycle()
        assert _cycles_alive() == 2000
        collector.step(2)
        assert _cycles_alive() == 2000
        collector.step(3)
        assert _cycles_alive() == 0
    assert gc.isenabled()


def test_zero_leaves_python_collecting_as_it_does():
    with GarbageCollection(0) as collector:
        assert gc.isenabled()
        collector.step(1)
    assert gc.isenabled()
