"""The public sink protocols: where what the sources hand over (``RecordSink``) or a controller's results
(``ResultSink``) leave, on the IO thread's loop. Their contract: docs/embedding/sinks.md.

Rules:
- Two protocols on one machinery (``SinkContext``, the books, ``SinkRunner``): a ``RecordSink`` runs in the main
  thread's place as the reader of what the sources hand over (a source → sink run: the relay, ``SinkRun``), its
  ``ctx.batches()`` ``MessageBatch``es and ``EventBatch``es in the sources' order; a ``ResultSink`` is a
  controller's, its batches ``ResultBatch``es in the order of the steps. Both are an object with ``name`` and
  ``run``: which one is said by where it is handed and by ``run``'s annotation.
- The books: every item taken is *held* until ``batch.wrote(n)`` or ``batch.drop(reason)``; ``wrote`` takes an int
  from 0 to the items left, else raises and counts nothing. taken = written + dropped + held, always.
- Backpressure: a batch is taken only when the sink asks for the next, so a sink that holds what it has stops the
  sources (inbound fills, each source's overflow applies).
- The stop: ``ctx.stopping`` is set; ``ctx.batches()`` ends once the sources stopped and all they handed over was
  taken. What is still held when ``run`` returns or is cancelled is counted ``unwritten`` and dropped ("unwritten
  at the stop"), and logged. A ``run`` that swallows its cancellation is given up after ``CANCEL_GRACE_S``, its
  batches counting nothing from then on.
- A ``run`` that raises ends the run as a feed that gave up does: ``FeedFatal`` naming the sink, its exception as
  the cause.
- ``ReplyBatch`` (io_loop/writer.py) is the per-feed implementation of ``SinkBatch``; a batch of answers written
  whole signals ``Acknowledged``, which a checkpoint waiting for its replies waits on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import janus
import numpy as np

from forkless.io_loop.crossing import Chunk, Events, Results
from forkless.io_loop.errors import FeedFatal
from forkless.io_loop.loopthread import cancel_bounded

__all__ = ["Acknowledged", "EventBatch", "MessageBatch", "RecordContext", "RecordSink", "ResultBatch", "ResultContext",
           "ResultSink", "SinkBatch", "SinkContext", "SinkRunner", "SinkStats"]

log = logging.getLogger("forkless.sink")

UNWRITTEN = "unwritten at the stop"


@runtime_checkable
class SinkBatch(Protocol):
    """What a sink (or a source's reply writer) is handed: ``items`` in order, ``positions`` (what
    names each, or None), ``wrote(n)`` and ``drop(reason)`` (see the module rules)."""

    @property
    def items(self) -> Sequence[Any]: ...

    @property
    def positions(self) -> Sequence[Any] | None: ...

    def wrote(self, n: int) -> None: ...

    def drop(self, reason: str) -> None: ...


@dataclass
class SinkStats:
    """A sink's books, written on the IO loop only (``snapshot`` copies them for any thread)."""

    taken: int = 0  # items taken from inbound (messages and events)
    written: int = 0  # of those, written (acknowledged) as the sink said
    dropped: Counter = field(default_factory=Counter)  # given up, by reason (the stop's included)
    unwritten: int = 0  # held when the sink returned or was cancelled (also in dropped)
    batches: int = 0
    # the sink's run is over (returned, failed, cancelled or given up): what it held is counted, and a batch it
    # still has (a sink given up on goes on until its loop closes) changes nothing more
    _closed: bool = field(default=False, init=False, repr=False, compare=False)

    @property
    def held(self) -> int:
        return self.taken - self.written - sum(self.dropped.values())

    def never_taken(self, n: int, reason: str) -> None:
        """``n`` items handed to the sink that it will never take (io_loop/sinks/results.py): counted
        taken and dropped by ``reason`` at once ("unwritten at the stop": in ``unwritten`` too)."""
        self.taken += n
        self.dropped[reason] += n
        if reason == UNWRITTEN:
            self.unwritten += n

    def snapshot(self) -> SinkStats:
        """A copy for any thread, ``taken`` read last: an item is counted taken before it is counted written
        or dropped, so no copy shows more written and dropped than taken (a negative ``held``)."""
        written, dropped, unwritten, batches = self.written, Counter(self.dropped), self.unwritten, self.batches
        return SinkStats(self.taken, written, dropped, unwritten, batches)


def check_count(n: Any, left: int, what: str) -> int:
    """``n`` as the int count of items written, 0 to ``left``; else ``TypeError``/``ValueError``."""
    if isinstance(n, bool) or not hasattr(n, "__index__"):  # a float, None, text: not a count
        raise TypeError(f"{what}.wrote(n) takes the int count of items written, not {type(n).__name__}: {n!r}")
    n = n.__index__()
    if not 0 <= n <= left:
        raise ValueError(f"{what}.wrote(n): n counts items of this batch's {left} left that were written "
                         f"(0 to {left}), not {n}")
    return n


def check_sink(sink: Any, kind: str) -> None:
    """``TypeError`` unless ``sink`` is an object with a non-empty str ``name`` and ``run`` (a ``kind``)."""
    name = getattr(sink, "name", None)
    if not isinstance(name, str) or not name or not callable(getattr(sink, "run", None)):
        raise TypeError(f"a sink is an object with a name (a non-empty str) and async run(ctx): {sink!r} is not "
                        f"(forkless.{kind}, docs/embedding/sinks.md)")


class _BatchBooks:
    """The part every sink batch shares: its books, how many of its items are left, and their updates."""

    __slots__ = ("_left", "_stats")

    def __init__(self, stats: SinkStats, n: int) -> None:
        self._stats = stats
        self._left = n

    @property
    def left(self) -> int:
        """Items of the batch neither written nor dropped."""
        return self._left

    def wrote(self, n: int) -> None:
        """``n`` more items of the batch were written (stored): an int from 0 to ``left``."""
        n = check_count(n, self._left, type(self).__name__)
        if self._stats._closed:  # counted unwritten when the sink's run ended: never twice
            return
        self._left -= n
        self._stats.written += n

    def drop(self, reason: str) -> None:
        """Give up the batch's items not written, counted in ``dropped`` by ``reason``."""
        if self._left and not self._stats._closed:
            self._stats.dropped[str(reason)] += self._left
            self._left = 0


class MessageBatch(_BatchBooks):
    """A feed's decoded messages (one hand-over of its), column-wise: ``seq``, ``stream``, ``x``
    (float rows, ``features`` wide), ``positions`` (a replayable source's, else None), ``feed``
    (its name), ``connection`` (the source's connection they were read on; 0: it counts none),
    ``received_ns`` (when their frame arrived). ``items`` is ``(seq, stream, x row)`` a message."""

    __slots__ = ("_parts", "connection", "feed", "index", "positions", "received_ns", "seq", "stream")

    def __init__(self, chunk: Chunk, feed: str, stats: SinkStats) -> None:
        super().__init__(stats, len(chunk))
        self.feed, self.index, self.connection = feed, chunk.feed, chunk.connection
        self.seq, self.stream, self.positions = chunk.seq, chunk.stream, chunk.origin
        self.received_ns = chunk.received_ns
        self._parts = chunk.x_parts()

    def __len__(self) -> int:
        return len(self.seq)

    def x_parts(self) -> list[Any]:
        """The arrays holding ``x``'s rows in order (no copy)."""
        return self._parts

    @property
    def x(self) -> Any:
        parts = self._parts
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    @property
    def items(self) -> list[tuple[Any, str, Any]]:
        return list(zip(self.seq, self.stream, self.x))


class EventBatch(_BatchBooks):
    """Objects a source handed over with ``emit_event`` (``items``, as they are), from ``feed``."""

    __slots__ = ("feed", "index", "items", "received_ns")

    positions = None

    def __init__(self, events: Events, feed: str, stats: SinkStats) -> None:
        super().__init__(stats, len(events.items))
        self.feed, self.index, self.items, self.received_ns = feed, events.feed, events.items, events.received_ns

    def __len__(self) -> int:
        return len(self.items)


class ResultBatch(_BatchBooks):
    """One stepped batch's results (a controller's sinks), as ``OnResults`` got them: ``seq``,
    ``stream``, ``outputs`` (output name -> numpy array whose leading axis is the messages, in
    arrival order; read them, do not write them: every sink is handed the same arrays) and
    ``feeds`` (each message's feed or source name). ``items`` is ``(feed, seq, stream, {output
    name: row})`` a message; ``positions`` is None."""

    __slots__ = ("feeds", "outputs", "seq", "stream")

    positions = None

    def __init__(self, results: Results, names: Sequence[str], stats: SinkStats) -> None:
        super().__init__(stats, len(results))
        self.seq, self.stream, self.outputs = results.seq, results.stream, results.outputs
        self.feeds = [names[i] if 0 <= i < len(names) else str(i) for i in results.feed]

    def __len__(self) -> int:
        return len(self.seq)

    @property
    def items(self) -> list[tuple[str, Any, str, dict[str, Any]]]:
        outputs = self.outputs
        return [(feed, seq, stream, {name: rows[i] for name, rows in outputs.items()})
                for i, (feed, seq, stream) in enumerate(zip(self.feeds, self.seq, self.stream))]


B = TypeVar("B", MessageBatch | EventBatch, ResultBatch)


class SinkContext(Generic[B]):
    """What a sink is handed (see the module rules), the machinery both kinds share: the batches in
    order, ``stopping``, the books. ``RecordContext`` and ``ResultContext`` say which batches come.
    IO loop only, like the sink itself."""

    def __init__(self, name: str, inbound: Any, feed_names: Sequence[str], stats: SinkStats) -> None:
        self.name = name
        self.stopping = asyncio.Event()  # set when the orderly stop begins
        self.stats = stats
        self._inbound = inbound
        self._feed_names = list(feed_names)
        self._ended = False

    @property
    def held(self) -> int:
        """Items taken and neither written nor dropped."""
        return self.stats.held

    @property
    def ended(self) -> bool:
        """True once ``batches()`` has ended: nothing more comes."""
        return self._ended

    async def batches(self) -> AsyncIterator[B]:
        """The batches, in order, until the stop has taken the last."""
        while True:
            batch = await self.next_batch()
            if batch is None:
                return
            yield batch

    async def next_batch(self) -> B | None:
        """The next batch (waiting for it); None once the sources have stopped and all was taken."""
        if self._ended:
            return None
        try:
            item = await self._inbound.get()
        except janus.AsyncQueueShutDown:
            self._ended = True
            self.stopping.set()
            return None
        return self._taken(self._batch(item))

    def next_ready(self) -> B | None:
        """The next batch if one waits now, else None (no await: what is queued, taken at once)."""
        if self._ended:
            return None
        try:
            item = self._inbound.get_nowait()
        except asyncio.QueueEmpty:
            return None
        except janus.AsyncQueueShutDown:
            self._ended = True
            self.stopping.set()
            return None
        return self._taken(self._batch(item))

    def _feed_name(self, index: int) -> str:
        names = self._feed_names
        return names[index] if 0 <= index < len(names) else str(index)

    def _batch(self, item: Any) -> B:
        raise NotImplementedError  # each kind of context makes its own batches

    def _taken(self, batch: B) -> B:
        self.stats.taken += len(batch)
        self.stats.batches += 1
        return batch


class RecordContext(SinkContext[MessageBatch | EventBatch]):
    """A ``RecordSink``'s context: what the sources handed over, as ``MessageBatch``es and ``EventBatch``es."""

    def _batch(self, item: Chunk | Events) -> MessageBatch | EventBatch:
        name = self._feed_name(item.feed)
        return EventBatch(item, name, self.stats) if isinstance(item, Events) else MessageBatch(item, name, self.stats)


class ResultContext(SinkContext[ResultBatch]):
    """A ``ResultSink``'s context: each stepped batch's results, as ``ResultBatch``es (io_loop/sinks/results.py)."""

    def _batch(self, item: Results) -> ResultBatch:
        return ResultBatch(item, self._feed_names, self.stats)


@runtime_checkable
class RecordSink(Protocol):
    """A sink of records, written by the user (see the module rules): a ``name`` and ``async run(ctx)``,
    handed ``MessageBatch``es and ``EventBatch``es (``forkless.SinkRun``, the relay)."""

    name: str

    async def run(self, ctx: RecordContext) -> None: ...


@runtime_checkable
class ResultSink(Protocol):
    """A sink of results, written by the user (see the module rules): a ``name`` and ``async run(ctx)``,
    handed ``ResultBatch``es (``Controller(sinks=...)``)."""

    name: str

    async def run(self, ctx: ResultContext) -> None: ...


class SinkRunner:
    """The IO thread's side of one sink of either kind (io_loop/thread.py, io_loop/sinks/results.py): ``await
    run(inbound)`` runs it with a ``context`` (``RecordContext`` or ``ResultContext``), keeps its books and
    turns its failure into ``FeedFatal`` (see the module rules)."""

    def __init__(self, sink: RecordSink | ResultSink, feed_names: Sequence[str], stats: SinkStats | None = None, *,
                 context: type[RecordContext | ResultContext] = RecordContext) -> None:
        check_sink(sink, "ResultSink" if context is ResultContext else "RecordSink")
        self.sink = sink
        self.name: str = sink.name
        self.feed_names = list(feed_names)
        self.stats = stats if stats is not None else SinkStats()
        self._context = context
        self.ctx: RecordContext | ResultContext | None = None

    def begin_stop(self) -> None:
        """The orderly stop began (on the loop): ``ctx.stopping`` is set."""
        if self.ctx is not None:
            self.ctx.stopping.set()

    async def run(self, inbound: Any) -> None:
        self.ctx = ctx = self._context(self.name, inbound, self.feed_names, self.stats)
        try:  # its own task: a sink that swallows its cancellation is given up after a grace (loopthread.py)
            await cancel_bounded(self.sink.run(ctx),  # type: ignore[arg-type]  # sink and context: of one kind
                                 name=f"forkless-sink-{self.name}-run", what=f"sink {self.name!r}")
        except FeedFatal:
            raise
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException as exc:  # SystemExit, KeyboardInterrupt, a BaseException of its own: a failure too
            raise FeedFatal(f"sink {self.name!r} failed: {exc!r}") from exc
        finally:
            self._count_held()

    def _count_held(self) -> None:
        stats = self.stats
        stats._closed = True  # its batches count nothing more (module rules)
        held = stats.held
        if held > 0:
            stats.unwritten += held
            stats.dropped[UNWRITTEN] += held
            log.error("sink %r: %d items taken were not written before the stop (counted in dropped, %r)",
                      self.name, held, UNWRITTEN)


class Acknowledged:
    """A signal from the IO loop to any thread: replies were acknowledged (a batch of answers
    written whole; for a JetStream feed, stored by its results stream). ``notify()`` on the loop
    (a lock and a wake-up, once a batch), ``wait_for(predicate, timeout)`` elsewhere: no poll, the
    waiter checks again only after an acknowledgement. The predicate is called without the lock
    held (it may copy the IO side's snapshot), and no acknowledgement between two checks is missed:
    each wait is for the count to move past the one read before the check."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.count = 0  # acknowledgements signalled so far (written under the lock)

    def notify(self) -> None:
        with self._cond:
            self.count += 1
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``predicate()`` is true, checked now and after each ``notify``, at most
        ``timeout`` seconds; its last value."""
        deadline = time.monotonic() + timeout
        cond = self._cond
        while True:
            with cond:
                seen = self.count
            if predicate():
                return True
            with cond:
                while self.count == seen:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    cond.wait(left)
