"""The hand-over: decoded frames gathered into ``Chunk``s and put on the inbound queue.

Rules:
- IO loop only; the queue is anything with asyncio.Queue's ``put``, ``put_nowait`` and ``get_nowait``.
- Frames that arrive together cross as one chunk: ``add`` gathers and schedules one put for the loop's next turn,
  not one cross-thread wake-up per frame; the reader ``flush``es at once when ``should_flush()`` says so. Latency
  is counted from a chunk's first frame.
- Order is kept: chunks and events go through the source's own ``Spill``, which puts them in order.
- A chunk carries the reader's ``connection`` as it was at its first frame; a connection's frames are put before
  the next one opens.
- A chunk of several frames holds their own ``x`` arrays: the main thread copies them once, into the padded batch.
- One message in ``SAMPLE_EVERY`` carries a ``Trace``, stamped with its first frame's read and decode times and
  just before its put.
- Queue full: the source's own buffer (io_loop/spill.py) takes what cannot be put, then its ``overflow`` applies.
  Nothing of another source is ever dropped.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from forkless.io_loop.counters import IOStats
from forkless.io_loop.crossing import INBOUND, SAMPLE_EVERY, Chunk, Events, Origin, Trace
from forkless.io_loop.decoding import DecodedFrame
from forkless.io_loop.spill import Spill

__all__ = ["Handover", "InboundQueue"]


class InboundQueue(Protocol):
    async def put(self, item: Chunk) -> None: ...

    def put_nowait(self, item: Chunk) -> None: ...

    def get_nowait(self) -> Chunk: ...


class Handover:
    """Gathers decoded frames and puts them on ``queue`` as chunks (see the module rules)."""

    def __init__(self, queue: InboundQueue, max_batch: int, *, drop_oldest: bool = False, buffer: int = 0,
                 stats: IOStats | None = None, name: str = "", feed: int = 0) -> None:
        self.queue = queue
        self.feed = feed  # stamped on every chunk: the replies go back to that feed's connection
        self.max_batch = max_batch
        self.drop_oldest = drop_oldest
        # the source's own buffer in front of the queue: its overflow policy applies there only
        self.spill = Spill(queue, buffer, drop_oldest=drop_oldest, stats=stats, name=name)
        self._parts: list[DecodedFrame] = []
        self._origins: list[Origin] | None = None  # of the messages in _parts (a replayable source's)
        self._gathered = 0  # messages in _parts
        self._first_ns = 0
        self._scheduled = False
        self._first_decoded_ns = 0
        self._until_sample = 1  # the first chunk is sampled, then one message in SAMPLE_EVERY
        self.connection = 0  # the feed's current connection (connection_opened), stamped on chunks
        self._gathered_connection = 0  # the connection of the messages in _parts

    def connection_opened(self, connection: int) -> None:
        """The feed's connection ``connection`` is up: the messages gathered from now on carry it
        (``SourceContext.connection_opened``)."""
        self.connection = connection

    def __len__(self) -> int:
        """Messages gathered and not yet put (not counting what waits in the source's buffer)."""
        return self._gathered

    @property
    def idle(self) -> bool:
        """True when nothing is gathered and nothing of the source waits to be put."""
        return not self._parts and self.spill.empty

    def add(self, decoded: DecodedFrame, received_ns: int, decoded_ns: int = 0,
            origin: list[Origin] | None = None) -> None:
        """Gather one frame's good messages (read at ``received_ns``, decoded at ``decoded_ns``,
        monotonic ns; ``origin``: one per message, from a replayable source, which gives it for
        every frame); a put is scheduled for the loop's next turn."""
        n = len(decoded)
        if not n:
            return
        if origin is not None:
            if self._origins is None:
                self._origins = []
            self._origins.extend(origin)
        if not self._parts:
            self._gathered_connection = self.connection
            self._first_ns = received_ns
            self._first_decoded_ns = decoded_ns or received_ns
            if not self._scheduled:
                self._scheduled = True
                asyncio.get_running_loop().call_soon(self._put_soon)
        self._parts.append(decoded)
        self._gathered += n

    def should_flush(self) -> bool:
        """True when the reader should ``await flush()`` before reading on."""
        return self._gathered >= self.max_batch or self.spill.over

    async def flush(self) -> None:
        """Hand over everything gathered now, in order; waits while the source's buffer is over
        its bound (``block``), never under ``drop_oldest``."""
        chunk = self._take_to_put()
        if chunk is not None:
            self.spill.put(chunk)
        await self.spill.wait_room()

    async def put_event(self, events: Events) -> None:
        """Hand over a source's events after what it gathered before them (in order); waits as
        ``flush`` does."""
        if self.hand_event(events):
            await self.spill.wait_room()

    def hand_event(self, events: Events) -> bool:
        """``put_event`` without its wait: True when the caller must ``await wait_room()`` (the
        source's buffer is over its bound under ``block``). An emit within the bound awaits
        nothing: no coroutine is made for it (one event a wake-up is an exchange session's
        common case, bench/docs/exchange-session-cost.md)."""
        spill = self.spill
        if self._parts:
            chunk = self._take_to_put()
            if chunk is not None:
                spill.put(chunk)
        spill.put(events)
        return spill.over

    async def wait_room(self) -> None:
        """Wait while the source's buffer is over its bound (``block``); at once otherwise."""
        await self.spill.wait_room()

    async def drained(self) -> None:
        """Hand over what is gathered and wait until everything of the source is on the queue."""
        chunk = self._take_to_put()
        if chunk is not None:
            self.spill.put(chunk)
        await self.spill.drained()

    # ---- internals --------------------------------------------------------------------------

    def _take_to_put(self) -> Chunk | None:
        """What was gathered, as one chunk stamped on its way inbound, for the caller to put;
        None when nothing was gathered."""
        chunk = self._take()
        if chunk is not None and chunk.trace is not None:
            chunk.trace.ns[INBOUND] = time.monotonic_ns()
        return chunk

    def _take(self) -> Chunk | None:
        parts = self._parts
        if not parts:
            return None
        gathered = self._gathered
        origin, self._origins = self._origins, None
        self._parts = []
        self._gathered = 0
        trace = None
        self._until_sample -= gathered
        if self._until_sample <= 0:
            self._until_sample = SAMPLE_EVERY
            trace = Trace(self.feed, self._first_ns, self._first_decoded_ns)
        if len(parts) == 1:
            return Chunk(parts[0].seq, parts[0].stream, parts[0].x, self._first_ns, self.feed, trace, origin,
                         self._gathered_connection)
        seq: list[Any] = []
        stream: list[str] = []
        xs = []  # the frames' own arrays: the main thread copies them once, into the padded batch
        for part in parts:
            seq += part.seq
            stream += part.stream
            xs.append(part.x)
        return Chunk(seq, stream, xs, self._first_ns, self.feed, trace, origin, self._gathered_connection)

    def _put_soon(self) -> None:
        """Loop callback: hand over what was gathered without waiting (the source's buffer takes
        it if the queue is full; ``should_flush`` makes the reader wait when that is over its bound)."""
        self._scheduled = False
        chunk = self._take_to_put()
        if chunk is not None:
            self.spill.put(chunk)

    def discard(self) -> int:
        """At an aborted stop: drop what is gathered and what waits in the source's buffer; how
        many messages that was (the caller counts them; the events are counted in ``stats``)."""
        dropped = self._gathered
        self._parts, self._gathered, self._origins = [], 0, None
        return dropped + self.spill.discard()
