"""The next step's batch built while this step runs.

Building a step's batch is host work: planning which documents it packs, copying their tokens
out of the memory-mapped cache into rows, the targets and the position ids. Done between steps,
that time adds to every step while the accelerator waits; PyTorch's ``DataLoader`` prepares
batches ahead (``prefetch_factor``) for the same reason. ``Prefetch`` runs the batch
iterator on one background thread that keeps up to ``ahead`` built items queued for the loop
(and builds the next while they wait: ``ahead + 1`` batches held at most): the loop gets the very
items the iterator yields, in its order (one thread calls it, as the loop would have), so a
prefetched run trains on the batches an unprefetched one does. The thread shares the GIL with
the loop: the batch is built while the loop waits on the accelerator, on transfers or in
kernels (which release it), not alongside the loop's own Python.

``ahead`` is ``pipetrain train --prefetch-batches``; its 0 (``prefetch``) builds each item in the
loop's own thread when the loop asks for it (``InLine``, no thread): the baseline the prefetch's
gain is measured against, and a run to fall back to where a thread is unwelcome.

An exception raised by the iterator is raised by the ``next`` call that would have returned
that item. ``close`` (or leaving the ``with`` block) stops the thread and waits for it: nothing
is left running after a run ends, and nothing waits for good on a queue nobody reads.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Generic, Self, TypeVar

T = TypeVar("T")

#: how long the thread waits for room in the queue before it looks at ``close`` again (s)
_POLL = 0.05


class _End:
    """The iterator ended (``StopIteration``), or raised ``error``."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class InLine(Generic[T]):
    """``source`` iterated in the caller's thread, item by item as asked for, closed with it
    (``close``, or leaving the ``with`` block): ``--prefetch-batches 0``, and what ``Prefetch``
    adds its thread to."""

    def __init__(self, source: Iterator[T]) -> None:
        self._source = source

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> T:
        return next(self._source)

    def close(self) -> None:
        """Close the source (a generator: its ``finally`` blocks run now)."""
        close = getattr(self._source, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


class Prefetch(InLine[T]):
    """Iterate ``source`` on a background thread, up to ``ahead`` items queued in front of the
    caller (see the module docstring)."""

    def __init__(self, source: Iterator[T], ahead: int = 1) -> None:
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1:
            raise ValueError(f"ahead must be an integer >= 1, got {ahead!r}")
        super().__init__(source)
        self._queue: queue.Queue[T | _End] = queue.Queue(maxsize=ahead)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._fill, name="pipetrain-prefetch", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            for item in self._source:
                if not self._put(item):
                    return
            self._put(_End())
        except BaseException as error:  # handed to the caller's ``next``
            self._put(_End(error))

    def _put(self, item: T | _End) -> bool:
        """Queue ``item`` once there is room; False when closed first."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, _End):
            self._done = True
            self._thread.join()
            if item.error is not None:
                raise item.error
            raise StopIteration
        return item

    def close(self) -> None:
        """Stop building ahead and wait for the thread to end (idempotent). The item it is
        building is finished first: a batch is never left half built."""
        self._done = True
        self._stop.set()
        self._thread.join()
        super().close()


def prefetch(source: Iterator[T], ahead: int) -> Prefetch[T] | InLine[T]:
    """``source`` with ``ahead`` items built ahead on a thread (``Prefetch``), or with 0 built in
    the caller's thread when asked for (``InLine``)."""
    if ahead == 0:
        return InLine(source)
    return Prefetch(source, ahead)


__all__ = ["InLine", "Prefetch", "prefetch"]
