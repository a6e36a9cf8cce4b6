"""The public ``Source`` protocol: a user's own client of a feed, run on the IO thread's loop.

Rules:
- A source is any object with a ``name`` and ``async run(ctx)``; it owns its connections (a
  login, a WebSocket, heartbeats, reconnects) and talks to the rest only through its
  ``SourceContext``: ``emit`` a frame for the codec, ``emit_rows`` messages already decoded,
  ``emit_event`` any object for the main thread as it is (a fill, a book), ``outgoing()`` the
  frames the main thread sends it (replies to its messages, ``Controller.send``), ``stopping``.
- Backpressure, never a silent drop: every ``emit*`` awaits while inbound is full (the source
  stops reading; TCP pushes back), and nothing a source emitted is lost once the call returned.
- Positions (exactly-once for any replayable source): ``emit(frame, position=p)`` tags the
  frame's messages; a checkpoint records where the state is, and after a restart
  ``ctx.resume_from`` is the position of the last frame the state holds (wholly or in part).
  The source replays from that frame *inclusive*; the context drops the messages of it the
  state already holds. A position is an ``int`` or a ``str`` (it goes into the checkpoint).
- The stop: ``ctx.stopping`` is set when the orderly stop begins; from then ``emit*`` raise
  ``SourceStopped`` (the frame is not taken: a replayable source replays it next time).
  ``outgoing()`` ends once the main thread has sent its last frame; then ``run`` returns.
  A ``run`` that returns earlier means the source has no more messages; replies that still
  come for it are counted as dropped ("source ended"). A ``run`` that raises gives the feed
  up as a failed connection would (``FeedFatal``, the traceback kept as its cause).
- ``SourceRunner`` is the IO thread's side of one source, with the same face as the built-in
  feeds' clients (``run``, ``stop_reading``, ``held_frames``, ``take_held``, ``handover``,
  ``stats``): the feed set (io_loop/feeds.py) does not know which kind it runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from io_loop.counters import IOStats
from io_loop.crossing import Events, Origin, Outgoing
from io_loop.decoding import FrameDecoder
from io_loop.errors import FeedFatal, ForklessError
from io_loop.handover import Handover
from io_loop.settings import FeedSpec, IOSettings
from io_loop.writer import HeldReply

__all__ = ["Source", "SourceContext", "SourceRunner", "SourceStopped"]

log = logging.getLogger("forkless.source")


class SourceStopped(ForklessError):
    """Raised by ``SourceContext.emit*`` once the stop has begun: the message was not taken."""


@runtime_checkable
class Source(Protocol):
    """A source of messages written by the user (see the module rules). Optional attributes:
    ``replies`` (``"all"``, ``"results"`` or ``"none"``: what the main thread sends back to its
    messages, default ``"all"``) and ``required`` (readiness waits for it, default True)."""

    name: str

    async def run(self, ctx: SourceContext) -> None: ...


@dataclass
class _Rows:
    """Messages a source decoded itself, in the shape the hand-over takes (``DecodedFrame``)."""

    seq: list[Any]
    stream: list[str]
    x: Any
    errors: list[tuple[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seq)

    def error_counts(self) -> list[tuple[str, int]]:
        return []


def _check_position(position: Any) -> None:
    if position is not None and type(position) not in (int, str):
        raise TypeError(f"a position is an int or a str (it is written into the checkpoint), not "
                        f"{type(position).__name__}")


class SourceContext:
    """What a source is handed (see the module rules). IO loop only, like the source itself."""

    def __init__(self, runner: SourceRunner, resume_from: Any, skip: int | None) -> None:
        self._runner = runner
        self.name = runner.feed.name
        self.resume_from = resume_from  # the position to replay from, inclusive (None: from the start)
        self._skip = skip  # messages of the frame at resume_from the state holds (None: all of them)
        self._resume_pending = resume_from is not None
        self.stopping = asyncio.Event()  # set when the orderly stop begins

    @property
    def features(self) -> int:
        """How many values a message's ``x`` holds (``FORKLESS_FEATURES``)."""
        return self._runner.settings.features

    async def emit(self, frame: str | bytes, position: int | str | None = None) -> int:
        """Hand one frame to the codec (decoded on this thread, like a built-in feed's frames);
        its good messages go to the main thread, its bad parts are counted (and answered, under
        the source's reply policy). Awaits while inbound is full. Returns the good messages taken."""
        runner = self._runner
        runner.enter()
        try:
            received = time.monotonic_ns()
            runner.stats.frames_in += 1
            decoded = runner.codec.decode(frame)
            return await runner.take(decoded, received, self._origins(decoded, position))
        finally:
            runner.leave()

    async def emit_rows(self, seq: list[Any], stream: list[str], x: Any, position: int | str | None = None) -> int:
        """Hand messages already decoded: ``seq`` and ``stream`` one per message, ``x`` [n, features],
        made an array of the processor's input dtype (float32, or float64: never through float32)."""
        runner = self._runner
        runner.enter()
        try:
            x = np.asarray(x, dtype=getattr(runner.codec, "dtype", np.float32))
            if x.ndim != 2 or x.shape != (len(seq), self.features) or len(stream) != len(seq):
                raise ValueError(f"emit_rows takes seq and stream of one length n and x of shape (n, {self.features}); "
                                 f"got {len(seq)}, {len(stream)} and {x.shape}")
            rows = _Rows(list(seq), [str(s) for s in stream], x)
            return await runner.take(rows, time.monotonic_ns(), self._origins(rows, position))
        finally:
            runner.leave()

    async def emit_event(self, event: Any) -> None:
        """Hand any object to the main thread as it is (``Controller(on_event=...)`` gets it, in
        order with this source's other events). Awaits while inbound is full."""
        runner = self._runner
        runner.enter()
        try:
            await runner.take_event(event)
        finally:
            runner.leave()

    def outgoing(self) -> AsyncIterator[str | bytes]:
        """The frames the main thread sends this source, in order: replies to its messages and
        frames sent with ``Controller.send``. Ends once the main thread has sent its last one
        (the stop). A frame is ``str``, or ``bytes`` holding UTF-8 text (the JSON codec's replies).
        A frame counts as delivered when the next one is asked for."""
        return self._runner.frames()

    def count(self, what: str, n: int = 1) -> None:
        """Count something the source did on its own (``"heartbeats answered"``): it shows in
        the source's figures (``counts``), never as an error."""
        self._runner.stats.counts[what] += n

    def set_connected(self, connected: bool, reason: str = "") -> None:
        """Tell the books and /readyz whether the source is connected now (it counts as
        connected while ``run`` runs unless told otherwise); ``reason`` says why it is not."""
        stats = self._runner.stats
        if connected and not stats.connected:
            stats.connects += 1
            if stats.connects > 1:
                stats.reconnects += 1
        stats.connected = connected
        stats.state_since = time.time()
        if not connected and reason:
            stats.last_error = reason

    def _origins(self, decoded: Any, position: Any) -> list[Origin] | None:
        """One ``Origin`` per good message of a frame at ``position`` (None without one); the
        frame at ``resume_from`` loses the messages the restored state already holds."""
        if position is None:
            return None
        _check_position(position)
        n = len(decoded)
        if self._resume_pending:
            self._resume_pending = False
            if position == self.resume_from:
                drop = n if self._skip is None else min(n, self._skip)
                if drop:  # indices stay the frame's own, so a later checkpoint inside it resumes right
                    self._runner.stats.counts["replayed messages skipped"] += drop
                    _drop_first(decoded, drop)
                    return [Origin(position, i, i == n - 1) for i in range(drop, n)]
            else:
                log.warning("source %r resumed at %r, not at the position the checkpoint recorded (%r): "
                            "messages between may be missing or applied twice", self.name, position,
                            self.resume_from)
        return [Origin(position, i, i == n - 1) for i in range(n)]


def _drop_first(decoded: Any, drop: int) -> None:
    decoded.seq = decoded.seq[drop:]
    decoded.stream = decoded.stream[drop:]
    decoded.x = decoded.x[drop:]


class SourceRunner:
    """The IO thread's side of one user ``Source`` (see the module rules)."""

    def __init__(self, source: Source, settings: IOSettings, codec: FrameDecoder, stats: IOStats, feed: FeedSpec,
                 *, inbound: Any, outbox: Any, index: int, resume: Origin | None = None) -> None:
        self.source = source
        self.settings = settings
        self.codec = codec
        self.stats = stats
        self.feed = feed
        self.inbound = inbound
        self.outbox = outbox
        self.index = index
        self.handover = Handover(inbound, settings.max_batch, drop_oldest=settings.overflow == "drop_oldest",
                                 on_dropped=self._count_dropped_oldest, feed=index)
        if resume is None:
            self.ctx = SourceContext(self, None, None)
        else:  # the frame at resume.seq: its messages up to resume.index are in the state
            self.ctx = SourceContext(self, resume.seq, None if resume.last else resume.index + 1)
        self.send_errors = feed.replies == "all"
        self._stopping = False
        self._busy = 0  # emit calls in progress
        self._idle = asyncio.Event()
        self._idle.set()
        self.held = HeldReply(outbox, stats)  # the item whose frames outgoing() hands out (io_loop/writer.py)
        self._handed = False  # a frame of it was handed out and not yet counted delivered

    # ---- the source's side ----------------------------------------------------------------------

    def enter(self) -> None:
        if self._stopping:
            raise SourceStopped(f"source {self.feed.name!r} is stopping: nothing more is taken")
        self._busy += 1
        self._idle.clear()

    def leave(self) -> None:
        self._busy -= 1
        if not self._busy:
            self._idle.set()

    async def take(self, decoded: Any, received_ns: int, origin: list[Origin] | None) -> int:
        stats = self.stats
        if decoded.errors:
            for reason, count in decoded.error_counts():
                stats.errors[reason] += count
            log.warning("bad input from source %r: %s", self.feed.name, decoded.errors[0][0])
            if self.send_errors:
                frames = [self.codec.encode_error(reason, seq) for reason, seq in decoded.errors]
                frames = [frame for frame in frames if frame is not None]
                if frames:
                    await self.outbox.put(Outgoing(frames, answers=False, feed=self.index))
            else:
                for reason, count in decoded.error_counts():
                    stats.replies_declined[reason] += count
        n = len(decoded)
        if n:
            stats.messages_in += n
            handover = self.handover
            handover.add(decoded, received_ns, time.monotonic_ns(), origin)
            if handover.should_flush():
                await handover.flush()
        return n

    async def take_event(self, event: Any) -> None:
        handover = self.handover
        if not handover.idle:  # rows emitted before it go first
            await handover.flush()
        self.stats.events_in += 1
        await self.inbound.put(Events(self.index, [event], time.monotonic_ns()))

    async def frames(self) -> AsyncIterator[str | bytes]:
        held = self.held
        while True:
            self._delivered()
            item = await held.next()
            if item is None:
                return
            if held.offset < len(item.frames):
                self._handed = True
                yield item.frames[held.offset]

    def _delivered(self) -> None:
        """The frame handed out last counts as delivered; an item wholly delivered is done."""
        held = self.held
        if held.item is None:
            return
        if self._handed:
            self._handed = False
            held.wrote(held.offset + 1)
        if held.offset >= len(held.item.frames):
            held.finish()

    def _count_dropped_oldest(self, messages: int) -> None:
        self.stats.dropped["inbound overflow (drop_oldest)"] += messages

    # ---- the IO thread's side (the face every feed's client has) --------------------------------

    async def run(self) -> None:
        stats = self.stats
        stats.connected = True
        stats.connects += 1
        stats.state_since = time.time()
        try:
            await self.source.run(self.ctx)
        except (asyncio.CancelledError, SourceStopped):
            if not self._stopping:
                raise
        except Exception as exc:
            stats.last_error = f"{type(exc).__name__}: {exc}"
            log.error("source %r failed", self.feed.name, exc_info=exc)
            raise FeedFatal(f"source {self.feed.name!r} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            stats.connected = False
            stats.state_since = time.time()
        await self._drain_after_end()

    async def _drain_after_end(self) -> None:
        """``run`` returned: what still comes for the source is counted, until outbound ends."""
        self._delivered()
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
        if item.sent:
            self.stats.sent_unsent += left
        elif item.answers:
            self.stats.dropped["source ended"] += left - item.errors_between(written, len(item.frames))
            self.stats.error_replies_unsent += item.errors_between(written, len(item.frames))
        else:
            self.stats.error_replies_unsent += left

    async def stop_reading(self, deadline: float | None = None) -> None:
        """The stop: no more emits are taken; one in progress finishes; the hand-over is flushed."""
        self._stopping = True
        self.ctx.stopping.set()
        await self._idle.wait()
        if not self.handover.idle:
            await self.handover.flush()

    def held_frames(self) -> int:
        return self.held.held_frames()

    def take_held(self) -> tuple[Outgoing | None, int]:
        self._handed = False
        return self.held.take_held()
