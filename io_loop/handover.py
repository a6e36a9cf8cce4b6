"""The hand-over: decoded frames gathered into ``Chunk``s and put on the inbound queue.

Rules:
- Runs on the IO loop only; the queue is anything with asyncio.Queue's ``put``,
  ``put_nowait`` and ``get_nowait`` (the bridge's ``inbound``, or a plain ``asyncio.Queue``
  in tests).
- Frames that arrive together (one socket read holds many) cross to the main thread as one
  chunk: ``add`` gathers and schedules a put for when the loop next turns (``call_soon``),
  instead of one cross-thread wake-up per frame. Latency is counted from the first frame of
  a chunk. The reader calls ``flush`` at once when ``should_flush()`` says so (``max_batch``
  messages gathered, or an earlier put still waiting for room).
- Order is kept: a chunk is never put while an earlier one is still waiting for room.
- A chunk carries the reader's ``connection`` (set by the feed at each new connection) as it was
  when its first frame was gathered; a connection's frames are put before the next one opens
  (a put is scheduled for the loop's next turn, and opening a connection takes more than one).
- One message in ``SAMPLE_EVERY`` carries a ``Trace`` (io_loop/crossing.py): the chunk
  holding it is stamped with its first frame's read and decode times, and just before its put.
- Queue full: ``block`` waits for room (so the reader stops reading and TCP pushes back on
  the server); ``drop_oldest`` drops the oldest queued chunk and reports how many messages
  it held through ``on_dropped``. Nothing else is ever dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from io_loop.crossing import INBOUND, SAMPLE_EVERY, Chunk, Origin, Trace
from io_loop.decoding import DecodedFrame

__all__ = ["Handover", "InboundQueue"]


class InboundQueue(Protocol):
    async def put(self, item: Chunk) -> None: ...

    def put_nowait(self, item: Chunk) -> None: ...

    def get_nowait(self) -> Chunk: ...


class Handover:
    """Gathers decoded frames and puts them on ``queue`` as chunks (see the module rules)."""

    def __init__(self, queue: InboundQueue, max_batch: int, *, drop_oldest: bool,
                 on_dropped: Callable[[int], None], feed: int = 0) -> None:
        self.queue = queue
        self.feed = feed  # stamped on every chunk: the replies go back to that feed's connection
        self.max_batch = max_batch
        self.drop_oldest = drop_oldest
        self.on_dropped = on_dropped
        self._parts: list[DecodedFrame] = []
        self._origins: list[Origin] | None = None  # of the messages in _parts (a replayable source's)
        self._gathered = 0  # messages in _parts
        self._first_ns = 0
        self._scheduled = False
        self._pending: asyncio.Future[None] | None = None  # a put waiting for room
        self._pending_messages = 0  # messages in that put
        self._in_put = 0  # messages in a put flush() is waiting on
        self._first_decoded_ns = 0
        self._until_sample = 1  # the first chunk is sampled, then one message in SAMPLE_EVERY
        self.connection = 0  # the feed's current connection (connection_opened), stamped on chunks
        self._gathered_connection = 0  # the connection of the messages in _parts

    def connection_opened(self, connection: int) -> None:
        """The feed's connection ``connection`` is up: the messages gathered from now on carry it
        (``SourceContext.connection_opened``)."""
        self.connection = connection

    def __len__(self) -> int:
        """Messages gathered and not yet put (not counting a put that waits for room)."""
        return self._gathered

    @property
    def idle(self) -> bool:
        """True when nothing is gathered and no put is waiting."""
        return not self._parts and self._pending is None

    def add(self, decoded: DecodedFrame, received_ns: int, decoded_ns: int = 0,
            origin: list[Origin] | None = None) -> None:
        """Gather one frame's good messages (read at ``received_ns``, decoded at ``decoded_ns``,
        monotonic ns; ``origin``: one per message, from a replayable source, which gives it for
        every frame); a put is scheduled for the loop's next turn."""
        if not len(decoded):
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
        self._gathered += len(decoded)

    def should_flush(self) -> bool:
        """True when the reader should ``await flush()`` before reading on."""
        return self._gathered >= self.max_batch or self._pending is not None

    async def flush(self) -> None:
        """Put everything gathered now, in order (waiting for room unless ``drop_oldest``)."""
        if self._pending is not None:
            await self._pending
        chunk = self._take_to_put()
        if chunk is not None:
            self._in_put = len(chunk)  # until it is on the queue: an aborted stop counts it
            await self.queue.put(chunk)
            self._in_put = 0

    # ---- internals --------------------------------------------------------------------------

    def _take_to_put(self) -> Chunk | None:
        """What was gathered, as one chunk stamped on its way inbound, for the caller to put;
        None when nothing was gathered, or when it was put here already (``drop_oldest``)."""
        chunk = self._take()
        if chunk is None:
            return None
        if chunk.trace is not None:
            chunk.trace.ns[INBOUND] = time.monotonic_ns()
        if self.drop_oldest:
            self._put_dropping_oldest(chunk)
            return None
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
        for part in parts:
            seq.extend(part.seq)
            stream.extend(part.stream)
        return Chunk(seq, stream, np.concatenate([part.x for part in parts]), self._first_ns, self.feed, trace, origin,
                     self._gathered_connection)

    def _put_soon(self) -> None:
        """Loop callback: put what was gathered without waiting. If the queue is full, a task
        waits for room, and ``should_flush`` makes the reader wait for it before more."""
        self._scheduled = False
        if self._pending is not None:
            return  # the reader puts after the pending put (see flush)
        chunk = self._take_to_put()
        if chunk is None:
            return
        try:
            self.queue.put_nowait(chunk)
        except asyncio.QueueFull:
            self._pending = asyncio.ensure_future(self._put_later(chunk))

    async def _put_later(self, chunk: Chunk) -> None:
        self._pending_messages = len(chunk)
        try:
            await self.queue.put(chunk)
            self._pending_messages = 0
        finally:
            self._pending = None

    def discard(self) -> int:
        """At an aborted stop: drop what is gathered and any put still waiting for room;
        how many messages that was (the caller counts them)."""
        dropped = self._gathered + self._in_put
        self._parts, self._gathered, self._in_put, self._origins = [], 0, 0, None
        if self._pending is not None:
            self._pending.cancel()
            dropped += self._pending_messages
            self._pending_messages = 0
        return dropped

    def _put_dropping_oldest(self, chunk: Chunk) -> None:
        queue = self.queue
        while True:
            try:
                queue.put_nowait(chunk)
                return
            except asyncio.QueueFull:
                try:
                    old = queue.get_nowait()
                except asyncio.QueueEmpty:
                    continue
                self.on_dropped(len(old))
