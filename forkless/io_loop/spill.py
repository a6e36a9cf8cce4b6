"""A source's own buffer in front of the shared inbound queue: overflow is a property of each source.

Rules:
- IO loop only. Every source's hand-over puts its chunks and events here, never on inbound itself: with nothing of
  the source waiting an item goes straight on; while inbound is full its items wait here, in order, and one pump
  task per source moves them on as room frees (the item in the pump's hand is never dropped).
- ``bound``: how many messages and events may wait here (memory: ``bound`` plus one item). Within it an emit never
  waits, so a source keeps reading and answering its heartbeat through a stalled main loop. Beyond it its
  ``overflow``: ``block`` awaits room (TCP pushes back); ``drop_oldest`` drops the source's OWN oldest waiting items,
  counted by reason. Nothing of another source is touched. A bound of 0 is the queue's bound alone.
- Consecutive waiting events are gathered into one ``Events`` item (at most ``EVENTS_PER_ITEM``).
- Drops are logged once per episode (the first, then the totals); a full buffer under ``block`` too.
- The books: every message here was counted in and is unanswered until answered or dropped; ``discard`` (an aborted
  stop) gives them up and returns how many; ``drained`` waits until nothing waits (the orderly stop).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

from forkless.io_loop.capabilities import declarations
from forkless.io_loop.counters import IOStats
from forkless.io_loop.crossing import Events
from forkless.io_loop.settings import Limits

__all__ = ["Spill", "source_policy"]

log = logging.getLogger("forkless.source")

OVERFLOW_REASON = "inbound overflow (drop_oldest)"
STOP_REASON = "not processed before the stop"
# the most events gathered into one waiting ``Events`` item: after a stall the main thread takes them in a few queue
# trips, and one item stays a bounded piece of its work (on_event runs per event, between batches). Not the
# micro-batch's size (events never enter a batch), and no setting: it changes nothing a user sees
EVENTS_PER_ITEM = 256


def source_policy(source: object, spec: Any, limits: Limits) -> tuple[bool, int]:
    """(drop_oldest, bound) of one source: its own declared ``overflow`` and ``buffer``
    (io_loop/capabilities.py, checked there), else its feed entry's (FORKLESS_FEEDS), else
    FORKLESS_OVERFLOW and FORKLESS_SOURCE_BUFFER. A replayable source never drops, whatever
    FORKLESS_OVERFLOW says."""
    declared = declarations(source, spec.name)
    overflow: str = declared.overflow or getattr(spec, "overflow", "") or limits.overflow
    buffer = declared.buffer
    if buffer is None:
        buffer = getattr(spec, "buffer", None)
    if buffer is None:
        buffer = limits.source_buffer
    return overflow == "drop_oldest" and not declared.replayable, buffer


def _sizes(item: Any) -> tuple[int, int]:
    """(messages, events) of one inbound item."""
    return (0, len(item.items)) if type(item) is Events else (len(item), 0)


class Spill:
    """One source's buffer in front of ``queue`` (see the module rules)."""

    def __init__(self, queue: Any, bound: int, *, drop_oldest: bool, stats: IOStats | None = None,
                 name: str = "") -> None:
        self.queue = queue
        self.bound = bound
        self.drop_oldest = drop_oldest
        self.stats = stats if stats is not None else IOStats()
        self.name = name
        self._items: deque[Any] = deque()
        self.waiting = 0  # messages and events in _items
        self._hand = (0, 0)  # (messages, events) of the item the pump is putting
        self._pump: asyncio.Task[None] | None = None
        self._room: asyncio.Event | None = None  # made by an emit waiting for room (block)
        self._episode = [0, 0]  # messages, events dropped since the buffer last drained
        self._full_logged = False

    @property
    def empty(self) -> bool:
        """Nothing of the source waits here or is being put."""
        return self._pump is None and not self._items

    @property
    def over(self) -> bool:
        """True when an emit must wait for room (``block``, more than ``bound`` waiting)."""
        return not self.drop_oldest and self.buffered > self.bound

    @property
    def buffered(self) -> int:
        """Messages and events waiting here, the pump's item included."""
        return self.waiting + sum(self._hand)

    def put(self, item: Any) -> None:
        """Hand ``item`` over: onto inbound now if nothing of the source waits and there is room,
        else into the buffer (the policy applies beyond the bound). Never waits."""
        if self._pump is None:
            try:
                self.queue.put_nowait(item)
                return
            except asyncio.QueueFull:
                pass
            self._hand = _sizes(item)
            self._pump = asyncio.ensure_future(self._run(item))
            self._note()
            return
        items = self._items
        if type(item) is Events and items and type(items[-1]) is Events and len(items[-1].items) < EVENTS_PER_ITEM:
            items[-1].items.extend(item.items)  # events waiting together cross in one item
        else:
            items.append(item)
        self.waiting += sum(_sizes(item))
        if self.drop_oldest:
            self._drop_over_bound()
        elif self.buffered > self.bound and not self._full_logged:
            self._full_logged = True
            log.warning("source %r: the inbound queue is full and %d messages and events wait in its buffer "
                        "(its bound, FORKLESS_SOURCE_BUFFER or its own): its emits wait (logged once until it "
                        "drains)", self.name, self.buffered)
        self._note()

    async def wait_room(self) -> None:
        """Wait while the buffer is over its bound (``block``); at once otherwise."""
        while self.over:
            if self._room is None:
                self._room = asyncio.Event()
            await self._room.wait()

    async def drained(self) -> None:
        """Wait until everything of the source is on inbound (the orderly stop)."""
        while self._pump is not None:
            await asyncio.wait([self._pump])

    def discard(self) -> int:
        """At an aborted stop: give up what waits and the item being put; the messages given up
        (the caller counts them), the events counted here."""
        messages, events = self._hand
        for item in self._items:
            m, e = _sizes(item)
            messages, events = messages + m, events + e
        self._items.clear()
        self.waiting, self._hand = 0, (0, 0)
        if self._pump is not None:
            self._pump.cancel()  # its put has not happened: a cancelled put leaves nothing on the queue
            self._pump = None
        if events:
            self.stats.events_dropped[STOP_REASON] += events
            log.error("source %r: %d events were not handed to the main thread before the stop", self.name, events)
        self._note()
        return messages

    # ---- internals ------------------------------------------------------------------------------

    async def _run(self, item: Any) -> None:
        """The pump: put the items in order as room frees."""
        try:
            while True:
                await self.queue.put(item)
                self._hand = (0, 0)
                self._wake()
                if not self._items:
                    break
                item = self._items.popleft()
                self._hand = _sizes(item)
                self.waiting -= sum(self._hand)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # inbound shut down under it (an aborted stop): counted, never silent
            self._pump = None
            left = self.discard()
            self.stats.dropped[STOP_REASON] += left
            log.error("source %r: %d messages could not be put on the inbound queue (%r)", self.name, left, exc)
            return
        self._pump = None
        self._wake()
        self._drained_now()

    def _drop_over_bound(self) -> None:
        items, stats = self._items, self.stats
        while self.buffered > self.bound and items:
            oldest = items[0]
            if type(oldest) is Events and len(oldest.items) > 1:
                del oldest.items[0]
                messages, events = 0, 1
            else:
                items.popleft()
                messages, events = _sizes(oldest)
            self.waiting -= messages + events
            if messages:
                stats.dropped[OVERFLOW_REASON] += messages
            if events:
                stats.events_dropped[OVERFLOW_REASON] += events
            if self._episode == [0, 0]:
                log.warning("source %r: the inbound queue is full and its buffer holds %d messages and events: "
                            "dropping its oldest (overflow drop_oldest; logged once until it drains)",
                            self.name, self.bound)
            self._episode[0] += messages
            self._episode[1] += events

    def _wake(self) -> None:
        if self._room is not None and not self.over:
            self._room.set()
            self._room = None
        self._note()

    def _note(self) -> None:
        stats = self.stats
        stats.buffered = self.buffered
        if stats.buffered > stats.buffered_peak:
            stats.buffered_peak = stats.buffered

    def _drained_now(self) -> None:
        """Everything waiting is on inbound: an episode of drops (or of a full buffer) ends."""
        messages, events = self._episode
        if messages or events:
            log.warning("source %r: its buffer drained; %d messages and %d events were dropped while the inbound "
                        "queue was full (counted in its dropped and events_dropped)", self.name, messages, events)
        self._episode = [0, 0]
        self._full_logged = False
