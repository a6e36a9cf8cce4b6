"""A fake IO side for ``controller.loop.Controller``: no thread, no event loop, no socket.

``FakeIO`` has the interface of ``controller.ioside.IOSide`` (the real one is
``io_loop.thread.IOThread``) and is its own ``io_factory``::

    fake = FakeIO()
    with Controller(config, runtime=forkless.Runtime(io_factory=fake)) as ctl:
        fake.inbound.put_nowait(Chunk(...))
        ctl.process_pending()
        replies = drain(fake.outbound)

The queues behave like janus's sync sides as the controller uses them: ``queue.Empty`` and
``queue.Full`` when empty or full, ``janus.SyncQueueShutDown`` once shut down (for ``get``:
once shut down *and* drained). A timed ``get``/``put`` really waits, as the real ones do; with
one thread nothing can arrive meanwhile, so tests use the non-blocking paths except where a
wait until a deadline is the behaviour under test.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable
from queue import Empty, Full
from typing import Any

import janus

from forkless.controller.codec import Codec
from forkless.controller.config import Config
from forkless.controller.stats import StatsSnapshot
from forkless.io_loop.bridge import MainSide
from forkless.io_loop.counters import IOSnapshot, IOStats
from forkless.io_loop.errors import FeedFatal, IOThreadError, MetricsServerError

__all__ = ["EndlessQueue", "FakeIO", "FakeQueue", "drain"]


class FakeQueue:
    """A bounded FIFO with the sync interface the controller uses (``maxsize`` 0: unbounded)."""

    def __init__(self, maxsize: int = 0) -> None:
        self.maxsize = maxsize
        self.is_shutdown = False
        self._items: deque[Any] = deque()
        self._changed = threading.Condition()

    def qsize(self) -> int:
        return len(self._items)

    def _full(self) -> bool:
        return 0 < self.maxsize <= len(self._items)

    def put_nowait(self, item: Any) -> None:
        with self._changed:
            if self.is_shutdown:
                raise janus.SyncQueueShutDown
            if self._full():
                raise Full
            self._items.append(item)
            self._changed.notify_all()

    def put(self, item: Any, timeout: float | None = None) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self.is_shutdown or not self._full(), timeout)
            self.put_nowait(item)

    def get_nowait(self) -> Any:
        with self._changed:
            if self._items:
                item = self._items.popleft()
                self._changed.notify_all()
                return item
            if self.is_shutdown:
                raise janus.SyncQueueShutDown
            raise Empty

    def get(self, timeout: float | None = None) -> Any:
        with self._changed:
            self._changed.wait_for(lambda: self.is_shutdown or self._items, timeout)
            return self.get_nowait()

    def shutdown(self, immediate: bool = False) -> None:
        """Like janus: puts fail from now on; gets return what is left, then fail."""
        with self._changed:
            self.is_shutdown = True
            if immediate:
                self._items.clear()
            self._changed.notify_all()


class EndlessQueue(FakeQueue):
    """An inbound queue whose producer never pauses until it is shut down: every chunk taken is
    replaced by a new one from ``make(n)`` (n counts the chunks made). Fails after ``limit``
    chunks, so a caller that never stops taking fails the test instead of hanging it."""

    def __init__(self, make: Callable[[int], Any], initial: int, limit: int = 1000) -> None:
        super().__init__()
        self.make = make
        self.limit = limit
        self.made = 0
        for _ in range(initial):
            self._refill()

    def _refill(self) -> None:
        if self.made >= self.limit:
            raise AssertionError(f"{self.limit} chunks taken from a producer that never pauses")
        self._items.append(self.make(self.made))
        self.made += 1

    def get_nowait(self) -> Any:
        item = super().get_nowait()
        if not self.is_shutdown:
            self._refill()
        return item


class FakeIO:
    """The IO side as the controller sees it, on ``FakeQueue``s; call it to use it as ``io_factory``.

    ``request_stop()`` shuts ``inbound`` down, which is what the real IO thread does once it
    has stopped reading. ``join()`` returns ``finishes`` (set it False for an IO side that does
    not end in time). Set ``failure`` to make ``raise_if_failed()`` raise, as ``IOThread`` does.
    """

    def __init__(self, inbound: FakeQueue | None = None, outbound: FakeQueue | None = None, *,
                 finishes: bool = True) -> None:
        self.inbound = inbound if inbound is not None else FakeQueue()
        self.outbound = outbound if outbound is not None else FakeQueue()
        self.finishes = finishes
        self.failure: BaseException | None = None
        self.metrics_url: str | None = None
        self.started = False
        self.stop_requested = False
        self.aborted = False
        self.joins: list[float | None] = []  # the timeout of each join() call
        self.config: Config | None = None
        self.codec: Codec | None = None
        self.io_stats: IOStats | None = None
        self.stats_snapshot: Callable[[], StatsSnapshot] | None = None
        self.cpu_clock: Callable[[], float] | None = None  # what cpu_seconds() reads (None: NaN)

    def __call__(self, config: Config, codec: Codec, io_stats: IOStats,
                 stats_snapshot: Callable[[], StatsSnapshot], **more: Any) -> FakeIO:
        """The ``io_factory``: remembers what the controller hands the IO side (``more``: what it
        hands only where there is one, such as the spinning hand-off's ``wait``)."""
        self.config, self.codec, self.io_stats, self.stats_snapshot = config, codec, io_stats, stats_snapshot
        self.more = more
        return self

    def start(self) -> MainSide:
        self.started = True
        return MainSide(self.inbound, self.outbound)  # type: ignore[arg-type]

    def request_stop(self, deadline: float | None = None) -> None:
        self.stop_requested = True
        self.inbound.shutdown()

    def join(self, timeout: float | None = None) -> bool:
        self.joins.append(timeout)
        return self.finishes

    def abort(self) -> None:
        self.aborted = True

    def raise_if_failed(self) -> None:
        failure = self.failure
        if failure is not None:
            if isinstance(failure, (FeedFatal, MetricsServerError, IOThreadError)):
                raise failure
            raise IOThreadError(f"the IO thread died: {failure!r}") from failure

    def summaries(self) -> list[str]:
        return []

    def feed_ended(self, index: int) -> str:
        return ""  # the fake's feeds never end

    def cpu_seconds(self) -> float:
        """The IO side's CPU seconds: ``cpu_clock()`` if set (a test's clock), else NaN (unknown)."""
        return self.cpu_clock() if self.cpu_clock is not None else math.nan

    def snapshot(self) -> IOSnapshot:
        assert self.io_stats is not None, "snapshot() before the controller made the IO side"
        return self.io_stats.snapshot(self.inbound.qsize(), self.outbound.qsize(), 0)


def drain(queue: FakeQueue) -> list[Any]:
    """Everything queued now, in order, without waiting."""
    items = []
    while True:
        try:
            items.append(queue.get_nowait())
        except (Empty, janus.SyncQueueShutDown):
            return items
