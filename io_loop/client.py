"""FeedClient: the reconnect loop around one WebSocket connection at a time, for one feed.

Rules:
- Runs in the IO thread's loop only. One reader task and one writer task per connection.
  With several feeds (io_loop/feeds.py) there is one FeedClient per feed on the same loop.
- Reader: frame -> ``codec.decode`` -> good messages to the ``Handover`` (which puts them on
  ``inbound`` as chunks stamped with this feed's index, see io_loop/handover.py), error
  replies to this feed's ``outbox`` (so every frame sent goes through the one writer). Only
  with ``"replies": "all"``: otherwise they are not even encoded (nor when ``encode_error``
  returns None); each is counted in ``replies_declined`` by reason, logged once per reason.
- Writer: takes ``Outgoing`` items from ``outbox`` (the bridge's outbound queue with one
  feed; this feed's own queue with several) and sends their frames in order, each item in
  one socket write (io_loop/aiohttp_compat.py). The item being sent and its position survive
  a lost connection and are resumed on the next one; nothing taken is forgotten.
- On each new connection the feed's ``subscribe`` text, then the on-connect hook's frames
  (io_loop/on_connect.py), are sent before anything else; a hook that fails fails the attempt
  like a failed connect.
- Before each attempt's handshake the before-connect hook (io_loop/before_connect.py), if
  given, says the attempt's URL and headers; a hook that fails fails the attempt like a failed
  connect.
- Reconnect on any loss (refused, reset, TLS, handshake timeout, 5xx, close frame,
  heartbeat timeout, stale feed) with ``Backoff``; an HTTP 4xx handshake (but 408/429, and
  401/403 when a before-connect hook can give new credentials) or used-up tries raise
  ``FeedFatal``.
- Orderly stop (``stop_reading``): the reader is never cancelled while handing a chunk over,
  so no received frame is lost (the caller shuts ``inbound`` down once every feed has
  stopped). The writer sends everything until ``outbox`` is shut down and empty, then the
  socket is closed with code 1000.
- Secrets (token, headers) are never logged; URLs are logged without query or credentials.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import ssl
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from io_loop import aiohttp_compat
from io_loop.backoff import Backoff
from io_loop.before_connect import BeforeConnect, call_before_connect
from io_loop.connect import (
    ConnectFailed,
    HandshakeRefused,
    handshake_headers,
    make_ssl_context,
    new_session,
    open_feed,
    redact_url,
    short,
)
from io_loop.counters import IOStats
from io_loop.crossing import Outgoing
from io_loop.decoding import FrameDecoder
from io_loop.errors import FeedFatal
from io_loop.handover import Handover
from io_loop.on_connect import HookFailed, OnConnect, call_hook
from io_loop.settings import FeedSpec, IOSettings
from io_loop.writer import HeldReply

__all__ = ["End", "FeedClient", "FeedControl", "Outcome"]

log = logging.getLogger("forkless.client")

CLOSE_TIMEOUT_S = 2.0  # how long an orderly close waits for the server's close frame
GIVE_UP_CLOSE_S = 0.25  # how long closing a connection that is being given up may take
MAX_LOGGED_REASONS = 1000  # declined replies: reasons logged (once each), then only counted
# refused handshakes a before-connect hook may answer with new credentials (an expired token)
CREDENTIALS_REFUSED = (401, 403)


class Outcome(enum.Enum):
    """How a reader, a writer or a whole connection ended."""

    DRAINED = "outbound shut down and every item sent"  # writer
    STOPPED = "stopped reading on request"  # reader
    CLOSED = "closed with 1000 after sending every result"  # connection
    LOST = "connection lost"  # any of them; ``End.reason`` says why


@dataclass(frozen=True)
class End:
    outcome: Outcome
    reason: str = ""


async def pause_before_reconnect(feed: FeedControl, delay: float) -> None:
    """Sleep ``delay`` seconds before a feed's next attempt; while it is stopping, notice when
    nothing is left to send (its ``held`` reply drained)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + delay
    while True:
        left = end - loop.time()
        if left <= 0:
            return
        if feed._stopping:
            feed.held.poll()
            if feed.held.drained:
                return
        await asyncio.sleep(min(left, 0.05))


class FeedControl:
    """What the IO thread asks of a built-in feed's client (a ``FeedClient``, a ``JetStreamFeed``;
    a user's source has its own, io_loop/source.py): stop reading without losing a message half
    handed over, and the reply item being written (``held``, io_loop/writer.py). A client sets
    ``handover``, ``held``, ``_stopping``, ``_reader_task`` and ``_reader_in_handover``."""

    handover: Handover
    held: HeldReply
    _stopping: bool
    _reader_task: asyncio.Task | None
    _reader_in_handover: bool

    async def stop_reading(self, deadline: float | None = None) -> None:
        """Stop taking messages, without losing one half handed over (then ``inbound`` may be shut);
        ``deadline`` (monotonic) bounds the closing handshake that follows."""
        self.stop_deadline = deadline
        self._stopping = True
        task = self._reader_task
        if task is not None and not task.done():
            if not self._reader_in_handover:
                task.cancel()
            await asyncio.wait([task])
        if not self.handover.idle:
            await self.handover.flush()

    def held_frames(self) -> int:
        """Frames taken from ``outbound`` but not yet written (or not yet acknowledged)."""
        return self.held.held_frames()

    def take_held(self) -> tuple[Outgoing | None, int]:
        """Give up the item being written (for the stop's count, or a feed that gave up): the
        item and how many of its frames were written; it is not held any more."""
        return self.held.take_held()


class FeedClient(FeedControl):
    """Connects to one feed and serves connections until stopped and drained (see the rules).

    ``inbound``: where chunks go (the bridge's); ``outbox``: where this feed's replies come
    from and its reader's error replies go (asyncio-queue-like, ending with
    ``janus.AsyncQueueShutDown``); ``stats``: this feed's own counters; ``url`` overrides
    ``feed.url`` (the embedded demo feed's address); ``index`` is stamped on its chunks;
    ``on_connect`` computes frames to send first on each connection (io_loop/on_connect.py);
    ``before_connect`` each attempt's URL and headers (io_loop/before_connect.py)."""

    def __init__(self, settings: IOSettings, codec: FrameDecoder, stats: IOStats, feed: FeedSpec, *, inbound: Any,
                 outbox: Any, index: int = 0, url: str | None = None, on_connect: OnConnect | None = None,
                 before_connect: BeforeConnect | None = None) -> None:
        self.settings = settings
        self.codec = codec
        self.feed = feed
        self.outbox = outbox
        self.stats = stats
        self.url = url = url or feed.url
        self.shown_url = redact_url(url)
        self.subscribe = feed.subscribe
        self.on_connect = on_connect
        self.before_connect = before_connect
        self._attempt = 0  # attempts since the feed started or a connection was served (before_connect's count)
        self._logged_hook_failures: set[str] = set()
        # TLS: made now for a configured wss:// URL (a CA file OpenSSL refuses fails at once), else at the
        # first wss:// URL a before-connect hook gives
        self._ssl_context = make_ssl_context(settings) if url.startswith("wss:") else None
        self.handover = Handover(inbound, settings.max_batch, drop_oldest=settings.overflow == "drop_oldest",
                                 on_dropped=self._count_dropped_oldest, feed=index)
        self._stopping = False
        self.held = HeldReply(outbox, stats)  # the reply item being sent; survives reconnects
        self._reader_task: asyncio.Task | None = None
        self._reader_in_handover = False
        self._last_frame_at = 0.0
        self._connection_id = 0
        self._cork: aiohttp_compat.CorkedTransport | None = None
        self.stop_deadline: float | None = None  # monotonic; the stop's, given to stop_reading
        self.send_errors = feed.replies == "all"  # error replies to bad input (the feed's reply policy)
        self._declined_logged: set[str] = set()

    # ---- the connection loop ----------------------------------------------------------------

    async def run(self) -> None:
        """Connect, serve, reconnect, until stopped and every result is sent (or FeedFatal)."""
        cfg = self.settings
        backoff = Backoff.from_settings(cfg)
        async with new_session() as session:
            while not self.held.drained:
                self._attempt += 1
                try:
                    url, headers = await self._handshake()
                    tls = self._ssl(url)
                    if tls is not None and cfg.tls_insecure:
                        log.warning("TLS certificate verification is OFF for %s (FORKLESS_TLS_INSECURE=1)",
                                    self.shown_url)
                    ws = await open_feed(session, url, cfg, tls, feed=self.feed, headers=headers)
                    first = await self._first_frames(ws)
                except (ConnectFailed, HandshakeRefused) as exc:
                    if not isinstance(exc, HandshakeRefused):
                        reason = str(exc)
                    elif exc.status in CREDENTIALS_REFUSED and self.before_connect is not None:
                        # an expired token, say: the next attempt asks the hook again (after the backoff)
                        reason = f"handshake refused with HTTP {exc.status}: asking before_connect for new credentials"
                    elif exc.fatal:
                        raise FeedFatal(str(exc)) from None
                    else:
                        reason = f"handshake failed with HTTP {exc.status}"
                    self.stats.connect_failures += 1
                    self.stats.last_error = reason
                    delay = backoff.failed()
                    if delay is None:
                        raise FeedFatal(f"giving up on {self.shown_url} after {backoff.failures} "
                                        f"failed attempts in a row: {reason}") from None
                    log.warning("connecting to %s failed: %s; retrying in %.2fs", self.shown_url, reason, delay)
                    await pause_before_reconnect(self, delay)
                    continue
                backoff.connected(time.monotonic())
                self._attempt = 0
                end = await self._serve(ws, first)
                backoff.disconnected(time.monotonic())
                if end.outcome is not Outcome.CLOSED:
                    self.stats.last_error = end.reason
                if self.held.drained:
                    break
                delay = backoff.failed()
                if delay is None:
                    raise FeedFatal(f"giving up on {self.shown_url} after {backoff.failures} "
                                    f"lost connections in a row: {end.reason}")
                log.warning("connection %d to %s lost: %s; reconnecting in %.2fs",
                            self._connection_id, self.shown_url, end.reason, delay)
                self.stats.reconnects += 1
                await pause_before_reconnect(self, delay)

    async def _handshake(self) -> tuple[str, dict[str, str] | None]:
        """This attempt's URL and headers (``None``: the configured ones): without a before-connect
        hook the configured URL; with one, what it says. A hook that fails raises ``ConnectFailed``."""
        if self.before_connect is None:
            return self.url, None
        try:
            url, headers = await call_before_connect(self.before_connect, self.feed.name, self._attempt,
                                                     self.settings.connect_timeout_s, self.url,
                                                     handshake_headers(self.settings, self.feed))
        except HookFailed as exc:
            self._log_hook_failure(exc)
            raise ConnectFailed(str(exc)) from None
        self.shown_url = redact_url(url)
        return url, headers

    def _ssl(self, url: str) -> ssl.SSLContext | None:
        """The TLS context for ``url``: None for ws://, one made once for every wss:// attempt."""
        if not url.startswith("wss:"):
            return None
        if self._ssl_context is None:
            self._ssl_context = make_ssl_context(self.settings)
        return self._ssl_context

    def _log_hook_failure(self, exc: HookFailed) -> None:
        """A hook's failure: its traceback logged once per distinct error (the retry's warning says the rest)."""
        key = str(exc)
        if key not in self._logged_hook_failures and len(self._logged_hook_failures) < 100:
            self._logged_hook_failures.add(key)
            log.error("%s on %s; the attempt counts as a failed connect (logged once per distinct error)",
                      key, self.shown_url, exc_info=exc.__cause__)

    async def _first_frames(self, ws: aiohttp.ClientWebSocketResponse) -> list[str | bytes]:
        """The frames sent first on a new connection: the feed's ``subscribe`` text, then what the
        on-connect hook returns; a hook that fails closes ``ws`` (1011) and raises ``ConnectFailed``."""
        frames: list[str | bytes] = [self.subscribe] if self.subscribe else []
        if self.on_connect is None:
            return frames
        try:
            return frames + await call_hook(self.on_connect, self.feed.name, self._connection_id + 1,
                                            self.settings.connect_timeout_s)
        except HookFailed as exc:
            self._log_hook_failure(exc)
            try:
                async with asyncio.timeout(GIVE_UP_CLOSE_S):
                    await ws.close(code=aiohttp.WSCloseCode.INTERNAL_ERROR)
            except TimeoutError:
                aiohttp_compat.drop(ws)
            raise ConnectFailed(str(exc)) from None

    async def _serve(self, ws: aiohttp.ClientWebSocketResponse, first: list[str | bytes]) -> End:
        """Run one connection until it is lost or everything is sent; ``first`` is sent before anything."""
        conn = self._opened(ws)
        written_before = self.stats.results_out + self.stats.errors_out
        tasks: set[asyncio.Task] = set()
        clean = False
        try:
            for frame in first:  # the subscription: FORKLESS_SUBSCRIBE's text, the on-connect hook's frames
                if type(frame) is bytes:
                    await ws.send_frame(frame, aiohttp.WSMsgType.TEXT)
                else:
                    await ws.send_str(frame)
            writer, reader = self._start_tasks(ws, tasks)
            end, clean = await self._until_ended(ws, tasks, writer, reader)
            return end
        except (ConnectionError, aiohttp.ClientError) as exc:
            return End(Outcome.LOST, f"{exc.__class__.__name__}: {short(exc)}")
        finally:
            await self._closed(ws, conn, tasks, clean, written_before)

    def _opened(self, ws: aiohttp.ClientWebSocketResponse) -> int:
        """A new connection counted, corked and logged; its id (the hand-over stamps it on chunks)."""
        self._connection_id += 1
        conn = self.handover.connection = self._connection_id
        stats = self.stats
        stats.connects += 1
        stats.connected = True
        stats.state_since = time.time()
        self._cork = aiohttp_compat.cork(ws)
        self._last_frame_at = asyncio.get_running_loop().time()
        log.info("connection %d to %s open", conn, self.shown_url, extra={"connection": conn})
        return conn

    def _start_tasks(self, ws: aiohttp.ClientWebSocketResponse,
                     tasks: set[asyncio.Task]) -> tuple[asyncio.Task, asyncio.Task | None]:
        """The writer, the reader (none once stopping), the stale watch (FORKLESS_STALE_S), each put in ``tasks``."""
        writer = asyncio.create_task(self._write(ws), name="forkless-writer")
        tasks.add(writer)
        reader = None
        if not self._stopping:
            reader = self._reader_task = asyncio.create_task(self._read(ws), name="forkless-reader")
            tasks.add(reader)
        if self.settings.stale_s > 0:
            tasks.add(asyncio.create_task(self._watch_stale(), name="forkless-stale"))
        return writer, reader

    async def _until_ended(self, ws: aiohttp.ClientWebSocketResponse, tasks: set[asyncio.Task], writer: asyncio.Task,
                           reader: asyncio.Task | None) -> tuple[End, bool]:
        """How the connection ended (the writer drained and closed it, the reader lost it, or it went stale),
        and whether the server answered our close (so it read every reply written)."""
        while True:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if writer in done:
                end = writer.result()
                if end.outcome is not Outcome.DRAINED:
                    return end, False
                # the server's answering close means it read every frame written before ours
                return End(Outcome.CLOSED), await self._close_after_drain(ws)
            if reader is not None and reader in done:
                tasks.discard(reader)
                if reader.cancelled() or reader.result().outcome is Outcome.STOPPED:
                    continue  # stopping: keep writing until outbound is drained
                return reader.result(), False
            return End(Outcome.LOST, f"no frame for {self.settings.stale_s}s (FORKLESS_STALE_S)"), False

    async def _closed(self, ws: aiohttp.ClientWebSocketResponse, conn: int, tasks: set[asyncio.Task], clean: bool,
                      written_before: int) -> None:
        """However it ended: its tasks cancelled, the replies not confirmed by the server's closing
        handshake counted, the socket closed (bounded), the feed counted as disconnected."""
        stats = self.stats
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        unconfirmed = stats.results_out + stats.errors_out - written_before
        if not clean and unconfirmed:  # the peer may not have read them: counted, never silent
            stats.written_unconfirmed += unconfirmed
            log.warning("connection %d ended without the server's closing handshake: the %d reply frames "
                        "written to it may not all have been read", conn, unconfirmed, extra={"connection": conn})
        current = asyncio.current_task()
        if not ws.closed and current is not None and current.cancelling():
            aiohttp_compat.drop(ws)  # an aborted stop: no closing handshake, no waiting
        if not ws.closed:
            try:  # a peer that never reads cannot hold this: GOING_AWAY is a courtesy
                async with asyncio.timeout(GIVE_UP_CLOSE_S):
                    await ws.close(code=aiohttp.WSCloseCode.GOING_AWAY)
            except TimeoutError:
                log.warning("connection %d dropped without a closing handshake", conn, extra={"connection": conn})
        stats.connected = False
        stats.state_since = time.time()

    async def _close_after_drain(self, ws: aiohttp.ClientWebSocketResponse) -> bool:
        """Close with 1000 and wait (bounded) for the server's close before dropping TCP: True when it came.

        aiohttp marks a connection whose ``receive()`` was cancelled (``stop_reading``) as an
        abnormal closure, and ``close()`` then drops the TCP connection right after our close
        frame. With frames we never read still in the socket buffer, the kernel answers with
        RST, and the server may lose our last replies and the close frame. So that mark is
        cleared: ``close()`` then reads and discards frames until the server's close, within
        ``CLOSE_TIMEOUT_S``.
        """
        if self._stopping:
            aiohttp_compat.clear_abnormal_close(ws)
        limit = min(CLOSE_TIMEOUT_S, self.settings.shutdown_timeout_s)
        if self.stop_deadline is not None:  # the stop's work deadline: the rest is the process's
            limit = max(0.05, min(limit, self.stop_deadline - time.monotonic()))
        try:
            async with asyncio.timeout(limit):
                await ws.close(code=aiohttp.WSCloseCode.OK, message=b"done")
            conn = self._connection_id
            log.info("connection %d closed with code 1000 after sending every result", conn, extra={"connection": conn})
            return True
        except TimeoutError:
            log.warning("the server did not answer our close within %.1fs; connection dropped", limit)
            return False

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> End:
        stats = self.stats
        codec = self.codec
        outbound = self.outbox
        handover = self.handover
        loop = asyncio.get_running_loop()
        while True:
            msg = await ws.receive()
            kind = msg.type
            if kind is aiohttp.WSMsgType.TEXT or kind is aiohttp.WSMsgType.BINARY:
                received = time.monotonic_ns()
                self._last_frame_at = loop.time()
                stats.frames_in += 1
                decoded = codec.decode(msg.data)
                decoded_ns = time.monotonic_ns()
                self._reader_in_handover = True
                try:
                    if decoded.errors:
                        for reason, count in decoded.error_counts():
                            stats.errors[reason] += count
                            log.warning("bad input on connection %d: %s", self._connection_id, reason,
                                        extra={"connection": self._connection_id})
                        if self.send_errors:
                            frames = [codec.encode_error(reason, seq) for reason, seq in decoded.errors]
                            if None in frames:  # the codec declined some
                                self._decline([counted for frame, counted in zip(frames, decoded.error_counts())
                                               if frame is None], "the codec's encode_error returned None")
                                frames = [frame for frame in frames if frame is not None]
                            if frames:
                                await outbound.put(Outgoing(frames, answers=False))
                        else:
                            self._decline(decoded.error_counts(), f"the feed's replies are {self.feed.replies!r}")
                    if len(decoded):
                        stats.messages_in += len(decoded)
                        handover.add(decoded, received, decoded_ns)
                        if handover.should_flush():
                            await handover.flush()
                finally:
                    self._reader_in_handover = False
                if self._stopping:
                    return End(Outcome.STOPPED)
            elif kind is aiohttp.WSMsgType.ERROR:
                # aiohttp puts a protocol error (e.g. 1009, frame too big) in msg.data and
                # only other failures (e.g. a missing pong) in ws.exception()
                exc = msg.data if isinstance(msg.data, BaseException) else ws.exception()
                if isinstance(exc, aiohttp.WebSocketError) and exc.code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG:
                    stats.errors["frame too large"] += 1
                    return End(Outcome.LOST, f"frame larger than FORKLESS_MAX_MSG_BYTES "
                                             f"({self.settings.max_msg_bytes}), closed with 1009")
                return End(Outcome.LOST, f"connection error: {exc.__class__.__name__}: {short(exc)}")
            elif kind in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
                return End(Outcome.LOST, f"closed by the server (code {ws.close_code})")

    def _decline(self, counts: list[tuple[str, int]], why: str) -> None:
        """Error replies to bad input not sent: counted by reason, each reason logged once."""
        declined = self.stats.replies_declined
        for reason, count in counts:
            declined[reason] += count
            if reason not in self._declined_logged and len(self._declined_logged) < MAX_LOGGED_REASONS:
                self._declined_logged.add(reason)
                log.info("feed %r (%s): error replies for %r are not sent (%s); counted in replies_declined, "
                         "logged once per reason", self.feed.name, self.shown_url, reason, why)

    def _count_dropped_oldest(self, messages: int) -> None:
        self.stats.dropped["inbound overflow (drop_oldest)"] += messages
        log.warning("inbound queue full: dropped the oldest %d messages (FORKLESS_OVERFLOW=drop_oldest)", messages)

    async def _write(self, ws: aiohttp.ClientWebSocketResponse) -> End:
        held = self.held
        cork = self._cork
        while True:
            item = await held.next()
            if item is None:
                return End(Outcome.DRAINED)
            frames = item.frames
            if cork is not None:
                cork.corked = True
            written = held.offset
            try:
                while written < len(frames):
                    frame = frames[written]
                    if type(frame) is bytes:  # UTF-8 JSON from the codec: send as a text frame as is
                        await ws.send_frame(frame, aiohttp.WSMsgType.TEXT)
                    else:
                        await ws.send_str(frame)
                    written += 1
            except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
                return End(Outcome.LOST, f"send failed: {exc.__class__.__name__}: {short(exc)}")
            finally:
                if cork is not None:
                    cork.uncork()
                held.wrote(written)  # also when stopped part-way
            held.finish()

    async def _watch_stale(self) -> None:
        loop = asyncio.get_running_loop()
        limit = self.settings.stale_s
        while loop.time() - self._last_frame_at < limit:
            await asyncio.sleep(min(limit / 4, 1.0))
