"""ResultSinks: a controller's sinks (``Controller(sinks=[...])``) handed each stepped batch's results on the IO loop.

Rules:
- The results cross on the one outbound queue, on their batch's ``Outgoing`` (``for_sinks``): no third queue. With
  sinks the feed set always routes outbound: its router hands each item's results to every sink (``hand``), in the
  order of the steps, then its frames to the outboxes.
- Each ``ResultSink`` is run by a ``SinkRunner`` (the same books and error rule as a record sink) and reads its own
  bounded ``ResultQueue`` as ``ctx.batches()``.
- Backpressure, as a slow socket's: a sink ``capacity`` batches behind holds the router, outbound fills, the main
  thread's put waits, and each source's overflow applies. Nothing is dropped for a slow sink while the run goes on.
- The books (``SinkStats``, IO loop only): a batch a sink will never take (it returned early, or the stop ended its
  queue) is counted taken and dropped at once by reason, and logged: taken = written + dropped + held, always.
- The stop: ``begin_stop`` sets each sink's ``ctx.stopping``; once outbound is drained every queue ends, and each
  sink finishes what it holds, bounded by the stop's deadline (then what is held is counted unwritten).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence

import janus

from forkless.io_loop.crossing import Outgoing, Results
from forkless.io_loop.loopthread import run_all
from forkless.io_loop.sinks.sink import UNWRITTEN, ResultContext, ResultSink, SinkRunner, SinkStats

__all__ = ["ResultQueue", "ResultSinks"]

log = logging.getLogger("forkless.sink")

SINK_ENDED = "sink ended"


class ResultQueue:
    """One sink's batches of results: bounded, one putter (the router) and one getter (the sink's
    context). ``end()``: once what is queued is taken, ``get``/``get_nowait`` raise
    ``janus.AsyncQueueShutDown`` (as the bridge's queues do); ``close()``: the sink is gone, every
    put from then on returns False, what was queued is returned. IO loop only."""

    def __init__(self, capacity: int) -> None:
        self._items: deque[Results] = deque()
        self._capacity = max(1, capacity)
        self._ended = self._closed = False
        self._ready = asyncio.Event()
        self._room = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, item: Results) -> bool:
        """Queue ``item``, waiting while the queue is full; False when the sink is gone (``close``)."""
        while len(self._items) >= self._capacity and not self._closed:
            self._room.clear()
            await self._room.wait()
        if self._closed:
            return False
        self._items.append(item)
        self._ready.set()
        return True

    async def get(self) -> Results:
        while not self._items:
            if self._ended:
                raise janus.AsyncQueueShutDown
            self._ready.clear()
            await self._ready.wait()
        return self._take()

    def get_nowait(self) -> Results:
        if self._items:
            return self._take()
        if self._ended:
            raise janus.AsyncQueueShutDown
        raise asyncio.QueueEmpty

    def _take(self) -> Results:
        item = self._items.popleft()
        self._room.set()
        return item

    def end(self) -> None:
        """Nothing more will be put: the getter takes what is queued, then sees the end."""
        self._ended = True
        self._ready.set()

    def close(self) -> list[Results]:
        """The getter is gone: what is queued, taken out; every later put returns False."""
        self._closed = self._ended = True
        self._room.set()
        left = list(self._items)
        self._items.clear()
        return left


class ResultSinks:
    """The controller's sinks on the IO loop (see the module rules): ``sinks`` in order, the
    feeds' names (``ResultBatch.feeds``), each sink's queue ``capacity`` batches."""

    def __init__(self, sinks: Sequence[ResultSink], feed_names: Sequence[str], capacity: int) -> None:
        self.runners = [SinkRunner(sink, feed_names, context=ResultContext) for sink in sinks]
        names = [runner.name for runner in self.runners]
        if len(set(names)) < len(names):
            raise ValueError(f"two sinks are named alike ({', '.join(map(repr, names))}): each sink needs a name "
                             "of its own (its books are shown by it)")
        self.queues = [ResultQueue(capacity) for _ in self.runners]
        self._logged: set[tuple[str, str]] = set()

    async def hand(self, results: Results) -> None:
        """One batch's results to every sink, in order, awaiting room in each (the backpressure)."""
        for i, (runner, queue) in enumerate(zip(self.runners, self.queues)):
            try:
                put = await queue.put(results)
            except asyncio.CancelledError:  # the abort: this sink and those after it never get them
                for later in self.runners[i:]:
                    self._lost(later, len(results), UNWRITTEN)
                raise
            if not put:
                self._lost(runner, len(results), SINK_ENDED)

    def end(self) -> None:
        """Outbound has ended: no more results; each sink's ``batches()`` ends after what it has queued."""
        for queue in self.queues:
            queue.end()

    def begin_stop(self) -> None:
        for runner in self.runners:
            runner.begin_stop()

    async def run(self) -> None:
        """Run every sink until each has returned; the first to fail ends the rest and is raised (``FeedFatal``)."""
        await run_all({f"forkless-sink-{runner.name}": self._run_one(runner, queue)
                       for runner, queue in zip(self.runners, self.queues)})

    async def _run_one(self, runner: SinkRunner, queue: ResultQueue) -> None:
        try:
            await runner.run(queue)
        finally:  # returned, failed or cancelled: what it never took is counted, and no more is queued for it
            left = sum(len(results) for results in queue.close())
            if left:
                self._lost(runner, left, UNWRITTEN if runner.ctx is None or runner.ctx.ended or
                           runner.ctx.stopping.is_set() else SINK_ENDED)

    def count_unsent(self, items: Sequence[Outgoing | None]) -> None:
        """Items left on outbound when the IO thread ends (an abort): their results, never handed to
        the sinks, counted unwritten for each."""
        n = sum(len(item.for_sinks) for item in items if item is not None and item.for_sinks is not None)
        if n:
            for runner in self.runners:
                self._lost(runner, n, UNWRITTEN)

    def _lost(self, runner: SinkRunner, n: int, reason: str) -> None:
        """``n`` results the sink will never take: counted taken and dropped by ``reason`` (see the rules)."""
        runner.stats.never_taken(n, reason)
        if (runner.name, reason) not in self._logged:
            self._logged.add((runner.name, reason))
            log.error("sink %r: %d results it did not take were dropped (%r; counted in its books, logged once "
                      "per reason)", runner.name, n, reason)

    def snapshots(self) -> tuple[tuple[str, SinkStats], ...]:
        """Each sink's name and books, copied (the IO loop writes them; read from any thread)."""
        return tuple((runner.name, runner.stats.snapshot()) for runner in self.runners)

