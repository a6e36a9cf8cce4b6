"""The reply item a feed is writing: taken from its outbox, kept across reconnects, counted once.

Rules:
- One ``HeldReply`` per feed (a WebSocket client, a JetStream feed, a user's source), on the IO
  loop only. It is the one place that takes an ``Outgoing`` from the feed's outbox (stamping the
  sampled messages' ``PICKED``), counts the frames written (results, error replies, frames the
  main thread sent on its own), and, once the item is written whole, observes its write latency
  and the sampled messages' hops (``WRITTEN``).
- The item and how many of its frames were written survive a lost connection: the next
  connection goes on from there, so nothing taken from the outbox is forgotten.
- ``take_held()`` gives the item up (the stop's count, a feed that gave up); ``held_frames()``
  is the feed's unsent count.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import janus

from io_loop.counters import IOStats
from io_loop.crossing import PICKED, WRITTEN, Outgoing

__all__ = ["HeldReply"]


class HeldReply:
    """The item being written for one feed (see the module rules)."""

    def __init__(self, outbox: Any, stats: IOStats) -> None:
        self.outbox = outbox
        self.stats = stats
        self.item: Outgoing | None = None
        self.offset = 0  # frames of ``item`` written
        self.drained = False  # the outbox was shut down and every item taken

    async def next(self) -> Outgoing | None:
        """The item to write (the held one, or the next from the outbox, waiting for it); None
        once the outbox is shut down and empty."""
        if self.item is None:
            try:
                self._took(await self.outbox.get())
            except janus.AsyncQueueShutDown:
                self.drained = True
                return None
        return self.item

    def poll(self) -> None:
        """Take the next item if one is waiting (a feed that is down, stopping: it notices the
        outbox has ended without a connection to write on)."""
        if self.item is not None or self.drained:
            return
        try:
            self._took(self.outbox.get_nowait())
        except asyncio.QueueEmpty:
            pass
        except janus.AsyncQueueShutDown:
            self.drained = True

    def _took(self, item: Outgoing) -> None:
        self.item, self.offset = item, 0
        if item.traces:
            picked = time.monotonic_ns()
            for trace in item.traces:
                trace.ns[PICKED] = picked

    def wrote(self, stop: int) -> None:
        """Frames ``offset:stop`` of the item were written (also when stopped part-way)."""
        item, start = self.item, self.offset
        stats = self.stats
        if item.sent:
            stats.sent_out += stop - start
        else:
            errors = item.errors_between(start, stop)
            stats.results_out += stop - start - errors
            stats.errors_out += errors
            if item.answers:
                stats.answer_errors_out += errors
        self.offset = stop

    def finish(self) -> None:
        """The item is written whole: its latency and sampled hops observed, the next one is taken next."""
        item, self.item = self.item, None
        if item.received_ns:
            now = time.monotonic_ns()
            stats = self.stats
            stats.write_latency.observe_many([(now - r) * 1e-9 for r in item.received_ns])
            for trace in item.traces:
                trace.ns[WRITTEN] = now
                stats.observe_hops(trace.hops_s())

    def held_frames(self) -> int:
        """Frames taken from the outbox but not yet written."""
        return 0 if self.item is None else len(self.item.frames) - self.offset

    def take_held(self) -> tuple[Outgoing | None, int]:
        """Give the item up: it and how many of its frames were written; nothing is held after."""
        held = self.item, self.offset
        self.item, self.offset = None, 0
        return held
