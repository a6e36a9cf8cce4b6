"""The reply item a feed is writing: taken from its outbox, kept across reconnects, counted once.

Rules:
- One ``HeldReply`` per feed, IO loop only: the one place that takes an ``Outgoing`` from the feed's outbox
  (stamping ``PICKED``), counts the frames written, and, once the item is written whole, observes its write latency
  and hops (``WRITTEN``).
- The item and how many of its frames were written survive a lost connection: nothing taken is forgotten.
- ``take_held()`` gives the item up (the stop's count); ``held_frames()`` is read by another thread: the item
  first, then its written count, which is set before a new item is (``_took``), so a read is one item's count.
- Sends with a deadline (io_loop/sends.py): the feed's ``SendWatch`` is asked before a sent item is handed out;
  one given up is skipped, never written. An item half written and given back is watched again until its deadline.
- ``ReplyBatch`` is its public face (``ctx.replies()``): one object per feed, its own async iterator (a batch costs
  one await, no allocation). ``wrote(n)`` takes an int from 0 to the frames left, else raises and counts nothing.
  It implements ``SinkBatch``: a batch of answers written whole signals the run's ``Acknowledged``.
- ``Outbound`` is a source runner's whole outbound side: the two above, ``outgoing()``'s frame-at-a-time form, and
  once the source's ``run`` returned, the count of what still comes for it (logged once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from itertools import groupby
from typing import Any

import janus

from forkless.io_loop.counters import IOStats
from forkless.io_loop.crossing import PICKED, WRITTEN, Outgoing
from forkless.io_loop.sends import WRITTEN_OUT, SendWatch, SentBytes, SentText

__all__ = ["HeldReply", "Outbound", "ReplyBatch"]

log = logging.getLogger("forkless.source")


class HeldReply:
    """The item being written for one feed (see the module rules)."""

    def __init__(self, outbox: Any, stats: IOStats, acknowledged: Any = None, *,
                 sends: Callable[[HeldReply], SendWatch] | None = None,
                 on_written: Callable[[Any, Any], None] | None = None) -> None:
        self.outbox = outbox
        self.stats = stats
        self.acknowledged = acknowledged  # io_loop/sinks/sink.py's Acknowledged: told as answers are written
        self.item: Outgoing | None = None
        self.offset = 0  # frames of ``item`` written
        self.drained = False  # the outbox was shut down and every item taken
        self.sends = sends(self) if sends is not None else None  # the feed's sends with deadlines (io_loop/sends.py)
        # a source that declares send_answered: told of each send written (its id, what was written), to await its
        # answer (io_loop/source.py)
        self.on_written = on_written

    async def next(self) -> Outgoing | None:
        """The item to write (the held one, or the next from the outbox, waiting for it); None
        once the outbox is shut down and empty."""
        while self.item is None or not self._usable(self.item):
            try:
                self._took(await self.outbox.get())
            except janus.AsyncQueueShutDown:
                self.drained = True
                return None
        return self.item

    def poll(self) -> None:
        """Take the next item if one is waiting (a feed that is down, stopping: it notices the
        outbox has ended without a connection to write on)."""
        while not self.drained and (self.item is None or not self._usable(self.item)):
            try:
                self._took(self.outbox.get_nowait())
            except asyncio.QueueEmpty:
                return
            except janus.AsyncQueueShutDown:
                self.drained = True

    def _usable(self, item: Outgoing) -> bool:
        """False for a send given up (now or before; no longer held): skip it (io_loop/sends.py)."""
        if not item.sent or self.sends is None:
            return True
        if self.sends.usable(item):
            return True
        if self.item is item:
            self.item, self.offset = None, 0
        return False

    def _took(self, item: Outgoing) -> Outgoing:
        self.offset = 0  # before the item: another thread's held_frames reads the item, then the offset
        self.item = item
        if item.sent:
            item.take_up()
        if item.traces:
            picked = time.monotonic_ns()
            for trace in item.traces:
                trace.ns[PICKED] = picked
        return item

    def wrote(self, stop: int) -> None:
        """Frames ``offset:stop`` of the item were written (also when stopped part-way)."""
        item, start = self.item, self.offset
        assert item is not None  # called with an item in hand
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
        assert item is not None  # called with an item in hand
        if item.answers and self.acknowledged is not None:
            self.acknowledged.notify()
        if item.received_ns:
            now = time.monotonic_ns()
            stats = self.stats
            observe = stats.write_latency.observe_each
            for arrived, run in groupby(item.received_ns):  # a chunk's frames share one: one observation
                observe((now - arrived) * 1e-9, len(list(run)))
            for trace in item.traces:
                trace.ns[WRITTEN] = now
                stats.observe_hops(trace.hops_s())

    def held_frames(self) -> int:
        """Frames taken from the outbox but not yet written; from any thread (the module rules: the item read
        once, as the IO thread may give it up between two reads, then the offset, kept within its frames)."""
        item = self.item
        if item is None:
            return 0
        frames = len(item.frames)
        return frames - min(max(self.offset, 0), frames)

    def take_held(self) -> tuple[Outgoing | None, int]:
        """Give the item up: it and how many of its frames were written; nothing is held after."""
        held = self.item, self.offset
        self.item, self.offset = None, 0
        return held


class ReplyBatch:
    """The replies a source writes, a batch at a time (``ctx.replies()``): iterate it to get the
    next batch (it yields itself), write ``frames`` (the frames still to write, in order), then
    say how many were written with ``wrote(n)``. A batch not wholly written (the connection was
    lost) is handed again first, with only its unwritten frames; the iteration ends once the
    main thread has sent its last reply (the stop). One per feed; IO loop only."""

    __slots__ = ("_held",)

    def __init__(self, held: HeldReply) -> None:
        self._held = held

    def __aiter__(self) -> ReplyBatch:
        return self

    async def __anext__(self) -> ReplyBatch:
        held = self._held
        while True:
            item = held.item
            if item is None:
                if held.drained:
                    raise StopAsyncIteration
                try:  # held.next() inlined: one await a batch, as before
                    item = held._took(await held.outbox.get())
                except janus.AsyncQueueShutDown:
                    held.drained = True
                    raise StopAsyncIteration from None
            if item.sent and not held._usable(item):  # a send given up: never written
                continue
            if held.offset < len(item.frames):
                item.hand_out(True)
                if item.sent and held.sends is not None:
                    held.sends.handed(item)
                return self
            held.finish()  # nothing (left) to write in it

    @property
    def _item(self) -> Outgoing:
        item = self._held.item
        if item is None:
            raise RuntimeError("this ReplyBatch is done (written whole or dropped): the next batch is the next one "
                               "ctx.replies() yields")
        return item

    @property
    def frames(self) -> list[str | bytes]:
        """The frames of this batch still to write (all of them, unless handed again after a
        lost connection). A frame is ``str``, or ``bytes`` holding UTF-8 text."""
        held, item = self._held, self._item
        return item.frames if not held.offset else item.frames[held.offset:]

    @property
    def items(self) -> list[str | bytes]:
        """``frames``, by the name of io_loop/sinks/sink.py's ``SinkBatch``."""
        return self.frames

    @property
    def positions(self) -> list[Any] | None:
        """For each frame of ``frames``, the ``Origin`` (``seq``: the position of the message it
        answers, ``index``: its place there) that names it, as a replayable source publishes it
        (an id a duplicate window recognises); None when the batch has none (no positions given)."""
        held = self._held
        origin = self._item.origin
        return origin if origin is None or not held.offset else origin[held.offset:]

    @property
    def answers(self) -> bool:
        """True when the batch answers messages (results and their error replies); False for
        error replies to bad input and frames the main thread sent on its own."""
        return self._item.answers

    @property
    def deadline(self) -> float | None:
        """For frames the main thread sent (``Controller.send``), the ``time.monotonic()`` by which they
        are written or never (io_loop/sends.py); None: no deadline (and for replies)."""
        return self._item.deadline

    @property
    def send_id(self) -> Any:
        """For frames the main thread sent, the send's id (``Controller.send``'s return value); None for replies."""
        return self._item.send_id

    def drop(self, reason: str) -> None:
        """Give the rest of the batch up unwritten (the source may not write it): its frames
        counted in ``dropped`` by ``reason`` (a send's in ``sent_failed``, reported to the main
        thread as ``SendFailed``); the batch is done."""
        held = self._held
        item = held.item
        if item is None:
            return
        if item.sent and held.sends is not None:
            held.sends.fail(item, reason)
            return
        held.stats.dropped[reason] += len(item.frames) - held.offset
        held.take_held()

    def wrote(self, n: int) -> None:
        """``n`` more frames of ``frames`` were written (counted; call it also when the writing
        stopped part-way). Once every frame is written the batch is done. ``n`` is an int from 0
        to ``len(frames)``: anything else raises (``TypeError``, ``ValueError``) and counts nothing.
        After the batch was given up (the stop took it, counted as unsent) it does nothing."""
        if isinstance(n, bool) or not hasattr(n, "__index__"):  # a float, None, text: not a count of frames
            raise TypeError(f"ReplyBatch.wrote(n) takes the int count of frames written, not {type(n).__name__}: {n!r}")
        n = n.__index__()
        held = self._held
        left = 0 if held.item is None else len(held.item.frames) - held.offset
        if n < 0 or (n > left and held.item is not None):
            raise ValueError(f"ReplyBatch.wrote(n): n counts frames of this batch's {left} frames that were written "
                             f"(0 to {left}), not {n}")
        item = held.item
        written = item.frames[held.offset:held.offset + n] if item is not None and item.sent and n else None
        self._wrote(n)
        if written and item is not None and held.on_written is not None:
            held.on_written(item.send_id, written[0] if len(item.frames) == 1 else written)
        if item is not None and held.item is item:  # given back half written: watched again (a send's deadline)
            item.hand_out(False)
            if item.sent and held.sends is not None:
                held.sends.put_back(item)

    def _wrote(self, n: int) -> None:
        """``wrote`` without the checks (``Outbound``'s own calls, 1 at a time)."""
        held = self._held
        if held.item is None or not n:
            return
        held.wrote(held.offset + n)
        if held.offset >= len(held.item.frames):
            held.finish()


class Outbound:
    """What the main thread sends one source: the held item, its ``ReplyBatch`` and
    ``outgoing()``'s frames (see the module rules). IO loop only."""

    def __init__(self, outbox: Any, stats: IOStats, *, name: str = "", acknowledged: Any = None,
                 sends: Callable[[HeldReply], SendWatch] | None = None,
                 on_written: Callable[[Any, Any], None] | None = None) -> None:
        self.stats = stats
        self.name = name  # the source's, for the log
        # the item being written, kept across reconnects; ``sends`` makes its SendWatch (io_loop/sends.py)
        self.held = HeldReply(outbox, stats, acknowledged, sends=sends, on_written=on_written)
        self.batch = ReplyBatch(self.held)  # ctx.replies()
        self._handed = False  # frames(): a frame was handed out and not yet counted delivered
        self._logged_unsendable = False  # what came after the source's run returned: logged once

    async def frames(self) -> AsyncIterator[str | bytes]:
        """``outgoing()``: ``replies()`` a frame at a time; a frame counts as delivered when the
        next is asked for (or when the source's ``run`` returns)."""
        batch, held = self.batch, self.held
        async for _ in batch:
            item = batch._item
            while held.item is item and held.offset < len(item.frames):
                if held.offset and not held._usable(item):  # a send's deadline passed between its frames
                    break
                frame = item.frames[held.offset]
                self._handed = True
                yield frame
                self._handed = False
                self._delivered(frame)

    def _delivered(self, frame: Any) -> None:
        """``outgoing()``'s frame in hand counts as written; a send's frame the source gave up meanwhile
        (``ctx.send_failed``) was counted in ``sent_failed`` instead."""
        self.batch._wrote(1)
        if isinstance(frame, (SentText, SentBytes)):
            if not frame.settle(WRITTEN_OUT):
                self.stats.sent_out -= 1  # given up meanwhile: counted in sent_failed
            elif self.held.on_written is not None:
                self.held.on_written(frame.send_id, frame)

    def ended(self) -> bool:
        """True once the main thread has sent its last frame and every one was handed out."""
        held = self.held
        held.poll()
        return held.drained

    async def drain_after_end(self) -> None:
        """The source's ``run`` returned: what still comes for it is counted, until outbound ends."""
        if self._handed:  # outgoing()'s last frame counts as delivered
            self._handed = False
            held = self.held
            if held.item is not None and held.offset < len(held.item.frames):
                self._delivered(held.item.frames[held.offset])
        item, written = self.held.take_held()
        while True:
            if item is not None:
                self._count_unsendable(item, written)
            item, written = await self.held.next(), 0
            if item is None:  # outbound ended: the stop
                return
            self.held.take_held()

    def _count_unsendable(self, item: Outgoing, written: int) -> None:
        left = len(item.frames) - written
        stats = self.stats
        if left and not self._logged_unsendable:
            self._logged_unsendable = True
            log.error("source %r has ended (its run returned): %d frames (%s) could not be written; what comes "
                      "for it until the stop is counted (Controller.send frames in sent_unsent, replies as "
                      "dropped 'source ended'), logged once", self.name, left,
                      "sent with Controller.send" if item.sent else "replies")
        if item.sent:
            stats.sent_unsent += left
        elif item.answers:
            errors = item.errors_between(written, len(item.frames))
            stats.dropped["source ended"] += left - errors
            stats.error_replies_unsent += errors
        else:
            stats.error_replies_unsent += left

    def held_frames(self) -> int:
        return self.held.held_frames()

    def take_held(self) -> tuple[Outgoing | None, int]:
        self._handed = False
        return self.held.take_held()
