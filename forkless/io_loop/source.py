"""The public ``Source`` protocol: a user's own client of a feed, run on the IO thread's loop.

The protocol and its guarantees are docs/embedding/sources.md. The rules this module keeps:
- A source is any object with a ``name`` and ``async run(ctx)``; it owns its connections and talks to the rest
  only through its ``SourceContext``, one way to hand over each kind of thing: ``emit`` frames for the codec,
  ``emit_rows`` messages it decoded itself, ``emit_event`` any object as it is; ``outgoing()``/``replies()`` what
  the main thread sends it. Every public name is used by a built-in source, ``Relogin`` or a documented example.
- Overflow is each source's own (io_loop/spill.py): while inbound is full, what it emits waits in its own buffer;
  beyond it ``block`` makes every ``emit*`` await, ``drop_oldest`` drops its OWN oldest, counted under its name.
  Nothing emitted is lost silently once the call returned; no source's overflow touches another's items.
- Positions (io_loop/emitted.py checks them; a refused emit takes nothing): all of a source's emits carry one or
  none does, each greater than the one before, all of one type. After a restart ``ctx.resume_from`` names the
  last frame the state holds; the source replays from it inclusive and the context drops what the state holds. A
  ``replayable`` source is never dropped from.
- Bad values are bad input however they come: a bad row of ``emit_rows`` is refused, counted and answered by
  reason as ``emit`` refuses a bad element; a wrong shape is ``ValueError``.
- The stop has one mechanism, ``SourceRunner.stop_reading``: ``before_stop(ctx)``, ``ctx.stopping`` (then
  ``emit*`` raise ``SourceStopped``, unless the source declares ``awaiting()``: io_loop/finishing.py), then the
  emits in progress are waited for. A ``run`` that returns early has no more messages (what comes for it is
  counted, ``ended`` tells the main thread); one that raises, or a ``before_stop`` that does, is ``FeedFatal``.
- Connection state changes in one place, ``SourceRunner.connection_state``: the books, and where asked a
  ``ConnectionEvent`` after what the source emitted before. It never waits, and none is handed once the stop began.
- Sends with a deadline (io_loop/sends.py): the source's ``SendWatch`` gives up what is not handed out in time;
  each reaches the main thread as a ``SendFailed``.
- ``SourceRunner`` is the IO thread's side of one source, user's or built-in: the feed set does not know which.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from forkless.io_loop.capabilities import SupportsAwaiting, SupportsBeforeStop, SupportsSendAnswered, declarations
from forkless.io_loop.counters import IOStats
from forkless.io_loop.crossing import ConnectionEvent, Events, Origin, Outgoing
from forkless.io_loop.decoding import DecodedFrame, FrameDecoder
from forkless.io_loop.emitted import Positions, Rows, check_first, checked_rows, drop_first
from forkless.io_loop.emitted import check_position as _check_position
from forkless.io_loop.errors import FeedFatal, ForklessError
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.finishing import finish_awaited
from forkless.io_loop.handover import Handover
from forkless.io_loop.loopthread import cancel_bounded
from forkless.io_loop.renamed import deprecated
from forkless.io_loop.sends import LOST, SendWatch, Unanswered, declared_send_policy
from forkless.io_loop.settings import Limits, Timeouts
from forkless.io_loop.spill import source_policy
from forkless.io_loop.writer import Outbound, ReplyBatch

__all__ = ["Source", "SourceContext", "SourceRunner", "SourceStopped"]

log = logging.getLogger("forkless.source")

# what ``SourceContext.emit`` takes: one frame, the frames of one socket read, or a frame ``decode`` read
Emitted = str | bytes | Sequence[str | bytes] | DecodedFrame

MAX_LOGGED_REASONS = 1000  # declined replies: reasons logged (once each), then only counted


class SourceStopped(ForklessError):
    """Raised by ``SourceContext.emit*`` once the stop has begun: the message was not taken."""


@runtime_checkable
class Source(Protocol):
    """A source of messages written by the user (see the module rules): a ``name`` and ``async run(ctx)``.
    What it may declare besides is listed once, in io_loop/capabilities.py: methods, each a protocol
    checked with ``isinstance`` (``before_stop``, ``awaiting``, ``summary``, ``probe``), and values, typed
    attributes with their defaults on ``SourceCapabilities`` (``replies``, ``required``, ``starts_connected``,
    ``replayable``, ``overflow``, ``buffer``, ``figures``). It subclasses nothing it does not want to."""

    name: str

    async def run(self, ctx: SourceContext) -> None: ...


class SourceContext:
    """What a source is handed (see the module rules). IO loop only, like the source itself."""

    def __init__(self, runner: SourceRunner, resume_from: Any, skip: int | None, *, pending: bool = True) -> None:
        self._runner = runner
        self._name = runner.feed.name
        self.resume_from = resume_from  # the position to replay from, inclusive (None: from the start)
        self._skip = skip  # messages of the frame at resume_from the state holds (None: all of them)
        self._resume_pending = pending and resume_from is not None
        self.stopping = asyncio.Event()  # set when the orderly stop begins
        self.stop_deadline: float | None = None  # monotonic: when the stop's work must be done (None: no bound)
        self._positions = Positions(self._name)  # the position rules, checked at every emit

    @property
    def features(self) -> int:
        """How many values a message's ``x`` holds (``FORKLESS_FEATURES``)."""
        return self._runner.features

    async def emit(self, frame: Emitted, position: int | str | None = None, *, first: int = 0,
                   received_ns: int | None = None) -> int:
        """``await ctx.emit(...)``: hand frames to the codec (decoded on this thread, like a built-in feed's
        frames); their good messages go to the main thread, their bad parts are counted (and answered,
        under the source's reply policy). ``frame``: one frame (``str`` or ``bytes``); a list of the
        frames one socket read brought (no ``position``: each position names one frame), decoded in one
        pass where the codec can; or what ``decode`` read (a filter may have cut it). ``first``: the
        frame's good messages before this one are not handed over (the state holds them: a source that
        does its own resuming), the rest keep their indices at ``position``, which it needs.
        ``received_ns`` (``time.monotonic_ns()``): when the frame was received, for the latencies
        (default: now). Awaits while inbound is full. Returns the good messages taken."""
        # one frame goes on in this coroutine (every frame's path); the other kinds await one of their own
        kind = type(frame)
        if kind is not str and kind is not bytes:  # several frames, or a frame ``decode`` read
            if isinstance(frame, (list, tuple)):
                return await self._emit_frames(frame, position, first, received_ns)
            if hasattr(frame, "error_counts"):  # a DecodedFrame
                return await self._emit_decoded(frame, position, first, received_ns)
        # one frame: str or bytes (or what else a user's codec reads, as ever)
        runner = self._runner
        if first or type(first) is not int:  # the frame's first messages are in the state: as a decoded one
            decoded = runner.codec.decode(frame)  # type: ignore[arg-type]  # one frame (above)
            return await self._emit_decoded(decoded, position, first, received_ns)
        if runner.stopping_now:
            raise SourceStopped(f"source {self._name!r} is stopping: nothing more is taken")
        if position is not None or self._positions.positioned is not False:  # no call for a source without
            self._positions.place(position)  # positions
        runner.busy += 1  # runner.enter() inlined: this is every frame's path
        try:  # one coroutine a frame; an await only to flush or to answer bad input
            if received_ns is None:
                received_ns = time.monotonic_ns()
            runner.stats.frames_in += 1
            decoded = runner.codec.decode(frame)  # type: ignore[arg-type]  # one frame (above)
            if decoded.errors:  # before _origins may cut the messages the restored state holds: the ids
                await runner.bad_input(decoded, position)  # of the error replies count every good one
            origins = None if position is None else self._origins(decoded, position)
            if runner.hand_over(decoded, received_ns, origins):  # runner.take inlined: no second coroutine
                await runner.handover.flush()
            return len(decoded)
        finally:
            runner.busy -= 1
            if runner.idle_wait is not None and not runner.busy:
                runner.idle_wait.set()

    async def _emit_frames(self, frames: Sequence[str | bytes], position: Any, first: Any,
                           received_ns: int | None) -> int:
        """``emit`` of a list of frames: as ``emit`` of each in order, in one call, decoded in one pass
        where the codec can (the built-in JSON codec's good frames: one array for them all; a frame with
        a bad part makes it decode them one at a time, each bad part answered as ``emit`` answers it, its
        good neighbours taken). A position (or ``first``) is refused: each frame names its own."""
        if position is not None or first:
            raise ValueError(f"emit(frames) of {len(frames)} frames takes no position or first (given "
                             f"position={position!r}, first={first!r}): a position names one frame, so emit each "
                             "frame with its own")
        runner = self._runner
        if runner.stopping_now:
            raise SourceStopped(f"source {self._name!r} is stopping: nothing more is taken")
        if self._positions.positioned is not False:
            self._positions.place(None)  # a source with positions is refused: each frame names its own
        runner.busy += 1
        try:
            if received_ns is None:
                received_ns = time.monotonic_ns()
            decode_frames = runner.decode_frames
            decoded = decode_frames(frames) if decode_frames is not None and len(frames) > 1 else None
            stats = runner.stats
            if decoded is not None:  # every frame good: one array for them all
                stats.frames_in += len(frames)
                n, most = len(decoded), runner.handover.max_batch
                if n <= most:
                    if runner.hand_over(decoded, received_ns, None):
                        await runner.handover.flush()
                    return n
                for start in range(0, n, most):  # FORKLESS_MAX_BATCH at a time, as emit's frames would go
                    stop = start + most
                    part = Rows(decoded.seq[start:stop], decoded.stream[start:stop], decoded.x[start:stop])
                    if runner.hand_over(part, received_ns, None):
                        await runner.handover.flush()
                return n
            taken = 0
            decode = runner.codec.decode
            for frame in frames:  # one at a time, as emit
                stats.frames_in += 1
                decoded = decode(frame)
                if decoded.errors:
                    await runner.bad_input(decoded)
                if runner.hand_over(decoded, received_ns, None):
                    await runner.handover.flush()
                taken += len(decoded)
            return taken
        finally:
            runner.busy -= 1
            if runner.idle_wait is not None and not runner.busy:
                runner.idle_wait.set()

    def decode(self, frame: str | bytes) -> Any:
        """The codec's reading of one frame (a ``DecodedFrame``: ``seq``, ``stream``, ``x`` of its
        good messages, ``errors`` of its bad parts), to look at or cut before ``emit`` hands it over.
        Nothing is counted yet."""
        return self._runner.codec.decode(frame)

    async def _emit_decoded(self, decoded: Any, position: Any, first: Any, received_ns: int | None) -> int:
        """``emit`` of a frame ``decode`` read (and the source may have changed: its ``seq``, ``stream`` and
        ``x`` cut alike, bad parts added to ``errors``), or of one with ``first``: counted as one frame in.
        ``first`` needs a position (``ValueError``), and is an int of 0 or more (``TypeError``/``ValueError``)."""
        runner = self._runner
        runner.enter()
        try:
            check_first(first)
            if first and position is None:
                raise ValueError(f"emit(..., first={first}) needs the frame's position: the messages the "
                                 f"state holds are known by their place in a positioned frame")
            if position is not None or self._positions.positioned is not False:
                self._positions.place(position)
            if received_ns is None:
                received_ns = time.monotonic_ns()
            runner.stats.frames_in += 1
            n = len(decoded)
            if decoded.errors:
                await runner.bad_input(decoded, position)
            first = min(first, n)
            if first:
                self._resume_pending = False  # the source does its own resuming
                drop_first(decoded, first)
                assert position is not None  # refused above: ``first`` needs a position
                origins: list[Origin] | None = [Origin(position, i, i == n - 1) for i in range(first, n)]
            else:
                origins = None if position is None else self._origins(decoded, position)
            if runner.hand_over(decoded, received_ns, origins):
                await runner.handover.flush()
            return n - first
        finally:
            runner.leave()

    async def emit_rows(self, seq: list[Any], stream: list[str], x: Any, position: int | str | None = None) -> int:
        """Hand messages already decoded: ``seq`` and ``stream`` one per message, ``x`` [n, features],
        made an array of the processor's input dtype (float32, or float64: never through float32).
        A wrong shape raises ``ValueError`` (nothing taken). A row whose ``x`` holds NaN, an
        infinity, a value beyond ±1e18 (checked before the cast), ``None``, text, a complex number
        with an imaginary part, or is of a bool array, is refused as ``emit`` refuses bad input
        (counted by reason in ``errors``, answered under the reply policy), the other rows handed
        over. Returns the good rows taken."""
        runner = self._runner
        runner.enter()
        try:
            rows = checked_rows(seq, stream, x, self.features, getattr(runner.codec, "dtype", np.float32))
            if position is not None or self._positions.positioned is not False:
                self._positions.place(position)
            received_ns = time.monotonic_ns()
            if rows.errors:  # before _origins may cut the rows the restored state holds (emit's order)
                await runner.bad_input(rows, position)
                rows.errors = []  # answered: take() has nothing more to answer
            return await runner.take(rows, received_ns, self._origins(rows, position))
        finally:
            runner.leave()

    async def emit_event(self, event: Any) -> None:
        """Hand any object to the main thread as it is (``Controller(on_event=...)`` gets it, in
        order with this source's other events). Awaits while inbound is full."""
        runner = self._runner
        runner.enter()
        try:
            if runner.send_answered is not None:  # it says which send this answers: no longer awaited
                runner.answered(event)
            if runner.take_event(event):  # the source's buffer is over its bound (block): wait for room
                await runner.handover.wait_room()
        finally:
            runner.leave()

    def outgoing(self) -> AsyncIterator[str | bytes]:
        """The frames the main thread sends this source, in order: replies to its messages and
        frames sent with ``Controller.send``. Ends once the main thread has sent its last one
        (the stop). A frame is ``str``, or ``bytes`` holding UTF-8 text (the JSON codec's replies).
        A frame counts as delivered when the next one is asked for."""
        return self._runner.out.frames()

    def replies(self) -> ReplyBatch:
        """The same frames a batch at a time (write each batch in one go): ``async for batch in
        ctx.replies()``, write ``batch.frames``, then ``batch.wrote(n)`` with how many were written.
        A batch not wholly written (a lost connection) is handed again first, from its first
        unwritten frame. Ends once the main thread has sent its last one (the stop)."""
        return self._runner.out.batch

    def send_failed(self, frame: str | bytes, reason: str, *, cause: BaseException | None = None) -> None:
        """A frame ``outgoing()`` handed out that the main thread sent (``Controller.send``) and that the
        source will not write (its deadline passed while it held it, say): counted in ``sent_failed``
        by ``reason``, and the main thread's ``on_event`` gets ``SendFailed`` (its id, the frame, the
        reason; ``cause``, what made it fail, as its ``__cause__``). Once per frame; ``TypeError`` for a
        frame the main thread did not send."""
        self._runner.sends.report(frame, reason, cause)

    @property
    def sends_while_disconnected(self) -> str:
        """The source's ``sends_while_disconnected``: ``"hold"`` (the default) or ``"refuse"`` (what the
        main thread sends while it is not connected is given up at once: ``SendFailed``)."""
        return self._runner.send_policy

    def replies_ended(self) -> bool:
        """True once the main thread has sent its last frame and every one was handed out, without
        waiting (a source that is down when the stop comes need not connect again)."""
        return self._runner.out.ended()

    @property
    def replies_written(self) -> int:
        """Reply frames written so far (results and error replies; not ``Controller.send`` frames)."""
        stats = self._runner.stats
        return stats.results_out + stats.errors_out

    def unconfirmed(self, frames: int) -> None:
        """``frames`` reply frames were written to a connection that ended without the peer
        confirming it read them (no closing handshake): counted in ``written_unconfirmed``."""
        self._runner.stats.written_unconfirmed += frames

    def count(self, what: str, n: int = 1) -> None:
        """Count something the source did on its own (``"heartbeats answered"``): it shows in
        the source's figures (``counts``), never as an error."""
        self._runner.stats.counts[what] += n

    def count_error(self, reason: str, n: int = 1) -> None:
        """Count bad input the codec never saw (``"frame too large"``), as ``errors`` by reason."""
        self._runner.stats.errors[reason] += n

    def connection_opened(self) -> int:
        """A new connection is up: counted (``connects``), shown as connected. Returns its id
        (1, 2, …), which the messages emitted from now on carry."""
        runner = self._runner
        runner.connection_id += 1
        runner.handover.connection_opened(runner.connection_id)
        runner.stats.connects += 1
        runner.connection_state(True, new=True)
        return runner.connection_id

    def connection_closed(self, reason: str = "", *, code: int | None = None) -> None:
        """The connection ended (however): shown as not connected; ``reason``, when given (it was
        lost), kept as the last error; ``code``: the WebSocket close code received, if any (both
        in its ``ConnectionEvent``)."""
        runner = self._runner
        if reason:
            runner.stats.last_error = reason
        runner.sends.disconnected()
        runner.connection_state(False, reason, code)

    def connect_failed(self, reason: str) -> None:
        """An attempt to connect failed: counted (``connect_failures``), ``reason`` kept as the last error."""
        stats = self._runner.stats
        stats.connect_failures += 1
        stats.last_error = reason

    def reconnecting(self) -> None:
        """A connection was lost and the source will connect again: counted (``reconnects``)."""
        self._runner.stats.reconnects += 1

    # ---- renamed (io_loop/renamed.py): each warns, naming its new spelling, and does what that does ----------

    async def emit_frames(self, frames: Sequence[str | bytes], *, received_ns: int | None = None) -> int:
        """Deprecated: ``emit(frames)``."""
        deprecated("ctx.emit_frames(frames)", error=AttributeError)
        if isinstance(frames, (str, bytes, bytearray, memoryview)):  # as it always was: one frame is emit's
            raise TypeError(f"emit_frames takes a list of frames, not one {type(frames).__name__} (one frame: emit)")
        return await self._emit_frames(frames, None, 0, received_ns)

    async def emit_decoded(self, decoded: Any, position: int | str | None = None, *, first: int = 0,
                           received_ns: int | None = None) -> int:
        """Deprecated: ``emit(decoded, position, first=..., received_ns=...)``."""
        deprecated("ctx.emit_decoded(decoded, ...)", error=AttributeError)
        return await self._emit_decoded(decoded, position, first, received_ns)

    def set_connected(self, connected: bool, reason: str = "", *, code: int | None = None) -> None:
        """Deprecated: ``connection_opened()`` (when not connected), ``connection_closed(reason, code=...)``."""
        deprecated("ctx.set_connected(flag, reason, code=...)", error=AttributeError)
        if not connected:
            self.connection_closed(reason, code=code)
        elif not self._runner.stats.connected:
            self.connection_opened()

    @property
    def name(self) -> str:
        """Deprecated: the source's own ``name``."""
        deprecated("ctx.name", error=AttributeError)
        return self._name

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
                    drop_first(decoded, drop)
                    return [Origin(position, i, i == n - 1) for i in range(drop, n)]
            else:
                log.warning("source %r resumed at %r, not at the position the checkpoint recorded (%r): "
                            "messages between may be missing or applied twice", self._name, position,
                            self.resume_from)
        return [Origin(position, i, i == n - 1) for i in range(n)]


class SourceRunner:
    """The IO thread's side of one ``Source``, a user's or a built-in feed (see the module rules). It reads
    the ``limits`` (the overflow and buffer: io_loop/spill.py), a message's length (``features``), a chunk's bound
    (``max_batch``, FORKLESS_MAX_BATCH) and the stop's bound (``timeouts.shutdown_timeout_s``: io_loop/finishing.py)."""

    def __init__(self, source: Source, limits: Limits, codec: FrameDecoder, stats: IOStats, feed: FeedSpec,
                 *, features: int, max_batch: int, timeouts: Timeouts, inbound: Any, outbox: Any, index: int,
                 resume: Origin | None = None, acknowledged: Any = None, connection_events: bool = False) -> None:
        self.source = source
        self.limits = limits
        self.features = features
        self.timeouts = timeouts
        self.codec = codec
        # the codec's one-pass reading of several frames (GuardedCodec's: the built-in JSON codec's), if any
        self.decode_frames: Callable[[Sequence[Any]], Any] | None = getattr(codec, "decode_frames", None)
        self.stats = stats
        self.feed = feed
        self.inbound = inbound
        self.outbox = outbox
        self.index = index
        drop_oldest, buffer = source_policy(source, feed, limits)  # its own overflow (io_loop/spill.py)
        self.handover = Handover(inbound, max_batch, drop_oldest=drop_oldest, buffer=buffer, stats=stats,
                                 name=feed.name, feed=index)
        if not isinstance(resume, Origin):  # None, or a record the source reads itself (the module rules)
            self.ctx = SourceContext(self, resume, None, pending=False)
        else:  # the frame at resume.seq: its messages up to resume.index are in the state
            self.ctx = SourceContext(self, resume.seq, None if resume.last else resume.index + 1)
        self.send_errors = feed.replies == "all"
        self.connection_id = 0  # the source's current connection (SourceContext.connection_opened)
        self.stopping_now = False  # the stop began: no emit is taken
        self.busy = 0  # emit calls in progress
        self.idle_wait: asyncio.Event | None = None  # made by a stop that waits for them
        # what the main thread sends it (io_loop/writer.py); ``acknowledged`` (io_loop/sinks/sink.py) signalled as its
        # batches of answers are written whole
        self.send_max_age_s, self.send_policy = declared_send_policy(source, feed.name)
        # a source that declares send_answered(event): the sends it wrote, by connection, until their answer (sends.py)
        self.send_answered = source.send_answered if isinstance(source, SupportsSendAnswered) else None
        self.unanswered = Unanswered()
        self.out = Outbound(outbox, stats, name=feed.name, acknowledged=acknowledged,
                            sends=lambda held: SendWatch(stats, name=feed.name, feed=index, held=held,
                                                         events=self.handover.hand_event,
                                                         refuse=self.send_policy == "refuse"),
                            on_written=self._written if self.send_answered is not None else None)
        assert self.out.held.sends is not None  # made from ``sends=`` just above
        self.sends: SendWatch = self.out.held.sends
        self._declined_logged: set[str] = set()
        self._running: asyncio.Task | None = None  # the task of ``run`` (cancelled by a failed before_stop)
        self._stop_failed: FeedFatal | None = None  # what the source's before_stop raised, as FeedFatal
        self.ended = False  # the source's run has returned (or raised): nothing more is written for it
        self.connection_events = connection_events  # hand a ConnectionEvent at each change (connection_state)

    # ---- the source's side ----------------------------------------------------------------------

    def enter(self) -> None:
        if self.stopping_now:
            raise SourceStopped(f"source {self.feed.name!r} is stopping: nothing more is taken")
        self.busy += 1

    def leave(self) -> None:
        self.busy -= 1
        if not self.busy and self.idle_wait is not None:
            self.idle_wait.set()

    async def bad_input(self, decoded: Any, position: Any = None) -> None:
        """A frame's bad parts: counted by reason, answered with error replies under the reply
        policy (those the codec declines, or all of them when the policy sends none, counted in
        ``replies_declined``). At a ``position`` the replies are numbered after the frame's good
        messages (the same ids when it is replayed)."""
        stats = self.stats
        counts = decoded.error_counts()
        for reason, count in counts:
            stats.errors[reason] += count
            log.warning("bad input on connection %d: %s", self.connection_id, reason,  # one text a reason: logs
                        extra={"connection": self.connection_id, "feed": self.feed.name,  # aggregate repeats
                               **({"position": position} if position is not None else {})})
        if not self.send_errors:
            self._decline(counts, f"the feed's replies are {self.feed.replies!r}")
            return
        encoded = [self.codec.encode_error(reason, seq) for reason, seq in decoded.errors]
        if None in encoded:  # the codec declined some
            self._decline([counted for frame, counted in zip(encoded, counts) if frame is None],
                          "the codec's encode_error returned None")
        frames = [frame for frame in encoded if frame is not None]
        if frames:
            if position is not None:
                _check_position(position)
            n = len(decoded)
            origin = None if position is None else [Origin(position, n + k, True) for k in range(len(frames))]
            await self.outbox.put(Outgoing(frames, answers=False, feed=self.index, origin=origin))

    def _decline(self, counts: list[tuple[str, int]], why: str) -> None:
        """Error replies to bad input not sent: counted by reason, each reason logged once."""
        declined = self.stats.replies_declined
        for reason, count in counts:
            declined[reason] += count
            if reason not in self._declined_logged and len(self._declined_logged) < MAX_LOGGED_REASONS:
                self._declined_logged.add(reason)
                log.info("%s: error replies for %r are not sent (%s); counted in replies_declined, "
                         "logged once per reason", self.feed.label, reason, why)

    async def take(self, decoded: Any, received_ns: int, origin: list[Origin] | None) -> int:
        """A decoded frame's bad parts answered or declined, its good messages handed over."""
        if decoded.errors:
            await self.bad_input(decoded, origin[0].seq if origin else None)
        if self.hand_over(decoded, received_ns, origin):
            await self.handover.flush()
        return len(decoded)

    def hand_over(self, decoded: Any, received_ns: int, origin: list[Origin] | None) -> bool:
        """The good messages counted and gathered by the hand-over; True when it must be flushed
        (awaited) before the next frame is taken."""
        n = len(decoded)
        if not n:
            return False
        self.stats.messages_in += n
        handover = self.handover
        handover.add(decoded, received_ns, time.monotonic_ns(), origin)
        return handover.should_flush()

    def connection_state(self, connected: bool, reason: str = "", code: int | None = None, *,
                         new: bool = False) -> None:
        """The source is connected now, or not (``reason``, ``code``: why not): the books change only
        when the state does, or with a ``new`` connection; then, with ``connection_events`` and
        before the stop, its ``ConnectionEvent`` goes after what it emitted before (the module rules)."""
        stats = self.stats
        if stats.connected == connected and not new:
            return
        stats.connected = connected
        stats.state_since = now = time.time()
        if self.connection_events and not self.stopping_now:
            event = ConnectionEvent(self.feed.name, connected, "" if connected else reason or "closed",
                                    None if code is None else int(code), self.connection_id, now)  # not an IntEnum
            self.take_event(event)  # never awaited: the next emit waits if this put the buffer over its bound
        if not connected:
            self._lose_unanswered()  # after its down event

    def _written(self, send_id: Any, what: Any) -> None:
        """A send of the main thread's was written (on the connection up now): its answer is awaited."""
        self.unanswered.left(send_id, self.connection_id, what)

    def answered(self, event: Any) -> None:
        """An event the source emits: the send it answers (its ``send_answered``) is no longer awaited."""
        send_id = self.send_answered(event) if self.send_answered is not None else None
        if send_id is not None:
            self.unanswered.answered(send_id)

    def awaited_answers(self) -> int:
        """The finishing phase's ``awaiting()`` of a source that declares ``send_answered`` and not ``awaiting``."""
        return len(self.unanswered)

    def _lose_unanswered(self) -> None:
        """The connection ended: every send written on it (or before) whose answer has not come is reported."""
        if self.send_answered is None or not len(self.unanswered):
            return
        for send_id, what in self.unanswered.lost(self.connection_id):
            self.sends.unanswered(LOST, send_id, what)

    def take_event(self, event: Any) -> bool:
        """One event handed over after the rows emitted before it (the source's own buffer keeps
        the order); True when the emit must wait for room (``Handover.hand_event``)."""
        self.stats.events_in += 1
        return self.handover.hand_event(Events(self.index, [event], time.monotonic_ns()))

    # ---- the IO thread's side (io_loop/feeds.py) ------------------------------------------------

    async def run(self) -> None:
        if declarations(self.source, self.feed.name).starts_connected:
            self.stats.connects += 1
            self.connection_state(True)
        self._running = running = asyncio.current_task()
        ended = "the source ended"  # why it is no longer connected (its ConnectionEvent's reason)
        try:  # its own task: a source that swallows its cancellation is given up after a grace (loopthread.py)
            await cancel_bounded(self.source.run(self.ctx), name=f"forkless-source-{self.feed.name}-run",
                                 what=f"source {self.feed.name!r}")
            ended = "the source's run returned"
        except (asyncio.CancelledError, SourceStopped):
            if self._stop_failed is not None:
                raise self._stop_failed from self._stop_failed.__cause__
            # the stop's own end of the source is an end; this task cancelled (an abort) is not: it goes on
            if not self.stopping_now or (running is not None and running.cancelling()):
                raise
        except ForklessError as exc:  # FeedFatal, PositionLost: said already, as they are
            ended = f"the source gave up: {exc}"
            raise
        except BaseException as exc:  # SystemExit, KeyboardInterrupt, a BaseException of its own: a failure too
            if isinstance(exc, GeneratorExit):  # the coroutine is being closed, not failed
                raise
            failed = self._failed(exc, "")
            ended = str(failed)
            raise failed from exc
        finally:
            self.ended = True
            self.connection_state(False, ended)
        try:
            if self._stop_failed is None:
                await self.out.drain_after_end()
        except asyncio.CancelledError:
            if self._stop_failed is None:
                raise
        if self._stop_failed is not None:
            raise self._stop_failed from self._stop_failed.__cause__

    def fail_in_stop(self, exc: BaseException, during: str) -> None:
        """A hook raised ``exc`` ``during`` the stop: the source is given up at once (``run`` cancelled, raising it)."""
        fatal = exc if isinstance(exc, FeedFatal) else self._failed(exc, during)
        fatal.__cause__ = exc if fatal is not exc else exc.__cause__
        self._stop_failed = fatal
        if self._running is not None and not self._running.done():
            self._running.cancel()

    def _failed(self, exc: BaseException, during: str) -> FeedFatal:
        """The source's exception (raised by its ``run`` or ``during`` its hook), logged with its
        traceback, as the ``FeedFatal`` that gives the source up (raise it ``from exc``)."""
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        log.error("source %r failed%s", self.feed.name, during, exc_info=exc,
                  extra={"feed": self.feed.name, "connection": self.connection_id})
        return FeedFatal(f"source {self.feed.name!r} failed{during}: {type(exc).__name__}: {exc}")

    async def stop_reading(self, deadline: float | None = None, unrouted: Callable[[], int] = lambda: 0) -> None:
        """The stop: ``before_stop``; ``ctx.stopping``; one that declares ``awaiting()`` hands its replies over
        until it awaits none (io_loop/finishing.py; ``unrouted``: outbound items not yet routed); then the emits
        in progress finish, the hand-over is flushed. ``deadline`` (monotonic) bounds the stop's work."""
        if isinstance(self.source, SupportsBeforeStop) and not self.stopping_now:
            try:
                await self.source.before_stop(self.ctx)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # the source fails as if its run raised it: given up at once
                self.fail_in_stop(exc, " in before_stop")
        awaiting = self.source.awaiting if isinstance(self.source, SupportsAwaiting) else (
            self.awaited_answers if self.send_answered is not None else None)
        if awaiting is None or self.stopping_now or self._stop_failed is not None:
            self.stopping_now = True  # before anything sees ctx.stopping: no emit is taken from then
        self.ctx.stop_deadline = deadline
        self.ctx.stopping.set()
        if awaiting is not None and not self.stopping_now:  # (no awaiting: stopping_now was set above)
            ended_early = await finish_awaited(self, awaiting, deadline, unrouted)
            if ended_early and self.send_answered is not None:  # counted there: each one reported here
                for send_id, what in self.unanswered.left_over():
                    self.sends.unanswered(ended_early, send_id, what, counted=True)
            self.stopping_now = True
        while self.busy:
            self.idle_wait = asyncio.Event()
            await self.idle_wait.wait()
        await self.handover.drained()  # what waits in the source's own buffer goes inbound first

    def held_frames(self) -> int:
        return self.out.held_frames()

    def send_arrived(self, item: Outgoing) -> None:
        """A send of the main thread's for this source crossed (the bridge's wake-up): watched until handed out."""
        self.sends.arrived(item)

    def take_held(self) -> tuple[Outgoing | None, int]:
        return self.out.take_held()
