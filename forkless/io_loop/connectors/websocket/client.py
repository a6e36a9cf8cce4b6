"""WebSocketSource: the built-in WebSocket feed, a ``Source`` like a user's own client: the reconnect loop around one
WebSocket connection at a time, for one feed.

Rules:
- IO loop only, under a ``SourceRunner`` exactly as a user's source, through its ``SourceContext`` alone. One
  reader task and one writer task per connection.
- Reader: the frames one socket read brought (at most ``READ_PASS_FRAMES``, aiohttp_compat's ``data_ready``) go to
  ``ctx.emit(frames)`` in one await; a close, ping or error behind them in the same read is handled after.
- Writer: ``ctx.replies()``, each batch written in one socket write (aiohttp_compat's ``TextFrames``). A batch
  part-written when a connection is lost is handed again first on the next one.
- On each new connection the feed's ``subscribe`` text, then the on-connect hook's frames, go first; before each
  handshake the before-connect hook gives the URL and headers. A hook that fails fails the attempt.
- Reconnect on any loss with ``Backoff``, by the reconnect driver; an HTTP 4xx handshake (but 408/429, and 401/403
  with a before-connect hook) or used-up tries raise ``FeedFatal``.
- Orderly stop: a reader waiting in ``receive()`` is cancelled, one inside ``ctx.emit`` never is, so no received
  frame is lost half handed over. The writer sends everything until the replies end, then closes with 1000.
- What the server has read: while replies are written the connection pings at most every ``CONFIRM_EVERY_S``; the
  pong confirms every reply written before that ping, the closing handshake all. A connection that ends otherwise
  counts the replies after the last confirmation as ``written_unconfirmed``. So the client answers the server's
  pings itself (``autoping`` off).
- A feed with a unix-domain socket connects through it on every attempt, the URL giving the handshake's path and
  ``Host``.
- Secrets (token, headers) are never logged; URLs are logged without query or credentials.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable

import aiohttp

from forkless.io_loop.backoff import Backoff
from forkless.io_loop.capabilities import SourceCapabilities
from forkless.io_loop.connectors.websocket.before_connect import BeforeConnect, call_before_connect
from forkless.io_loop.connectors.websocket.connect import (
    ConnectFailed,
    ConnectionLost,
    HandshakeRefused,
    handshake_headers,
    mapped_aiohttp_errors,
    new_session,
    open_feed,
    short,
    shown_target,
)
from forkless.io_loop.connectors.websocket.on_connect import OnConnect, call_hook
from forkless.io_loop.connectors.websocket.settings import Credentials
from forkless.io_loop.decoding import FrameDecoder
from forkless.io_loop.errors import FeedFatal
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.hooks import HookFailed
from forkless.io_loop.net import aiohttp_compat
from forkless.io_loop.net.tls import make_ssl_context
from forkless.io_loop.reconnect import LOST_WITHOUT_CLOSE, End, Outcome, closed_how, drive, pause_before_reconnect
from forkless.io_loop.settings import ReconnectSettings, Timeouts, TlsSettings
from forkless.io_loop.source import SourceContext, SourceStopped

__all__ = ["WebSocketSource"]

log = logging.getLogger("forkless.client")

CLOSE_TIMEOUT_S = 2.0  # how long an orderly close waits for the server's close frame
# how often a connection with unconfirmed replies pings the server, whose pong confirms them (module rules): what
# written_unconfirmed can count after a loss is about this long of replies, at one ping frame a second
CONFIRM_EVERY_S = 1.0
MAX_PINGS_AWAITED = 8  # pings whose pong is awaited at once (a server that never answers cannot grow the table)
GIVE_UP_CLOSE_S = 0.25  # how long closing a connection that is being given up may take
READ_PASS_FRAMES = 256  # at most this many frames of one read handed over (and decoded) together
# refused handshakes a before-connect hook may answer with new credentials (an expired token)
CREDENTIALS_REFUSED = (401, 403)


class WebSocketSource(SourceCapabilities):
    """The built-in WebSocket feed as a ``Source`` (io_loop/source.py; see the module rules):
    connects to ``feed.url`` (or ``url``: the embedded demo feed's address) and serves
    connections until stopped and drained. ``on_connect`` computes frames to send first on each
    connection (io_loop/connectors/websocket/on_connect.py); ``before_connect`` each attempt's URL and headers
    (io_loop/connectors/websocket/before_connect.py). It reads the settings groups it is handed (io_loop/settings.py):
    ``timeouts``, ``reconnect``, ``tls``, ``credentials`` and ``max_msg_bytes`` (FORKLESS_MAX_MSG_BYTES);
    ``feeds_from_list`` only says, in ``--check``'s report, where the subscribe message came from."""

    starts_connected = False  # connected once a connection is open (SourceContext.connection_opened)

    def __init__(self, feed: FeedSpec, *, timeouts: Timeouts, reconnect: ReconnectSettings, tls: TlsSettings,
                 credentials: Credentials, max_msg_bytes: int, url: str | None = None,
                 on_connect: OnConnect | None = None, before_connect: BeforeConnect | None = None,
                 feeds_from_list: bool = False) -> None:
        self.name = feed.name
        self.replies = feed.replies
        self.required = feed.required
        self.timeouts = timeouts
        self.reconnect = reconnect
        self.tls = tls
        self.credentials = credentials
        self.max_msg_bytes = max_msg_bytes
        self.feeds_from_list = feeds_from_list
        self.feed = feed
        self.url = url = url or feed.url
        self.unix_socket = feed.unix_socket
        self.shown_url = shown_target(url, self.unix_socket)
        self.subscribe = feed.subscribe
        self.on_connect = on_connect
        self.before_connect = before_connect
        self._attempt = 0  # attempts since the feed started or a connection was served (before_connect's count)
        self._logged_hook_failures: set[str] = set()
        # TLS: made now for a configured wss:// URL (a CA file OpenSSL refuses fails at once), else at the
        # first wss:// URL a before-connect hook gives
        self._ssl_context = make_ssl_context(tls) if url.startswith("wss:") else None
        self._emitting = False  # the reader is inside ctx.emit: the stop lets it finish, never cancels it
        self._last_frame_at = 0.0
        self._connection_id = 0
        self._cork: aiohttp_compat.CorkedTransport | None = None
        # the connection's replies the server is known to have read: the count of replies written (all
        # connections') as of its last pong (module rules), and the pings awaiting one: payload -> that count
        self._confirmed = 0
        self._pings: dict[bytes, int] = {}
        self._pinged = 0
        self._ready: Callable[[], bool] = lambda: False  # aiohttp holds the connection's next data frame already

    async def probe(self, codec: FrameDecoder, say: Callable[[str], None], *, dedupe_window_s: float = 0.0) -> None:
        """``--check``'s try of the feed: one connection (io_loop/connectors/websocket/probe.py)."""
        # only --check probes: a run never loads the probe
        from forkless.io_loop.connectors.websocket.probe import probe_websocket

        await probe_websocket(self, codec, say)

    # ---- the connection loop ----------------------------------------------------------------

    async def run(self, ctx: SourceContext) -> None:
        """Connect, serve, reconnect (io_loop/reconnect.py), until stopped and every result is sent
        (or FeedFatal)."""
        self._ctx = ctx
        async with new_session(self.unix_socket) as session:
            await drive(_Link(self, ctx, session), Backoff.of(self.reconnect))

    async def _open(self, session: aiohttp.ClientSession) -> tuple[aiohttp.ClientWebSocketResponse, list[str | bytes]]:
        """One attempt: the handshake (the before-connect hook's URL and headers), then the frames to
        send first. Raises ``ConnectFailed``, ``HandshakeRefused``."""
        self._attempt += 1
        url, headers = await self._handshake()
        tls = self._ssl(url)
        if tls is not None and self.tls.insecure:
            log.warning("TLS certificate verification is OFF for %s (FORKLESS_TLS_INSECURE=1)", self.shown_url,
                        extra={"feed": self.name})
        ws = await open_feed(session, url, tls, headers=handshake_headers(self.credentials, self.feed)
                             if headers is None else headers, timeouts=self.timeouts, max_msg_bytes=self.max_msg_bytes,
                             autoping=False)  # pongs confirm what the server read (module rules)
        return ws, await self._first_frames(ws)

    def _failed(self, exc: ConnectFailed | HandshakeRefused) -> str:
        """A failed attempt counted; why it failed (``FeedFatal`` when retrying cannot help)."""
        if not isinstance(exc, HandshakeRefused):
            reason = str(exc)
        elif exc.status in CREDENTIALS_REFUSED and self.before_connect is not None:
            # an expired token, say: the next attempt asks the hook again (after the backoff)
            reason = f"handshake refused with HTTP {exc.status}: asking before_connect for new credentials"
        elif exc.fatal:
            raise FeedFatal(str(exc)) from None
        else:
            reason = f"handshake failed with HTTP {exc.status}"
        self._ctx.connect_failed(reason)
        return reason

    async def _handshake(self) -> tuple[str, dict[str, str] | None]:
        """This attempt's URL and headers (``None``: the configured ones): without a before-connect
        hook the configured URL; with one, what it says. A hook that fails raises ``ConnectFailed``."""
        if self.before_connect is None:
            return self.url, None
        try:
            url, headers = await call_before_connect(self.before_connect, self.feed.name, self._attempt,
                                                     self.timeouts.connect_timeout_s, self.url,
                                                     handshake_headers(self.credentials, self.feed))
        except HookFailed as exc:
            self._log_hook_failure(exc)
            raise ConnectFailed(str(exc)) from None
        self.shown_url = shown_target(url, self.unix_socket)
        return url, headers

    def _ssl(self, url: str) -> ssl.SSLContext | None:
        """The TLS context for ``url``: None for ws://, one made once for every wss:// attempt."""
        if not url.startswith("wss:"):
            return None
        if self._ssl_context is None:
            self._ssl_context = make_ssl_context(self.tls)
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
                                            self.timeouts.connect_timeout_s)
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
        tasks: set[asyncio.Task] = set()
        end, clean = End(Outcome.LOST, "connection ended"), False
        try:
            with mapped_aiohttp_errors():
                for frame in first:  # the subscription: FORKLESS_SUBSCRIBE's text, the on-connect hook's frames
                    if isinstance(frame, bytes):
                        await ws.send_frame(frame, aiohttp.WSMsgType.TEXT)
                    else:
                        await ws.send_str(frame)
                writer, reader, stop_watch = self._start_tasks(ws, tasks)
                end, clean = await self._until_ended(ws, tasks, writer, reader, stop_watch)
            return end
        except ConnectionLost as exc:
            end = End(Outcome.LOST, str(exc))
            return end
        finally:
            await self._closed(ws, conn, tasks, clean, end)

    def _opened(self, ws: aiohttp.ClientWebSocketResponse) -> int:
        """A new connection counted, corked and logged; its id (the hand-over stamps it on chunks)."""
        conn = self._connection_id = self._ctx.connection_opened()
        self._cork = aiohttp_compat.cork(ws)
        self._ready = aiohttp_compat.data_ready(ws)
        self._last_frame_at = asyncio.get_running_loop().time()
        self._confirmed, self._pings = self._ctx.replies_written, {}
        log.info("connection %d to %s open", conn, self.shown_url, extra=self._fields())
        return conn

    def _fields(self) -> dict[str, str | int]:
        """The context of this feed's log lines: its name and its connection now (JSON logs' fields)."""
        return {"feed": self.name, "connection": self._connection_id}

    def _start_tasks(self, ws: aiohttp.ClientWebSocketResponse,
                     tasks: set[asyncio.Task]) -> tuple[asyncio.Task, asyncio.Task | None, asyncio.Task | None]:
        """The writer, the reader and the stop's watch (none once stopping), the stale watch
        (FORKLESS_STALE_S), each put in ``tasks``."""
        writer = asyncio.create_task(self._write(ws), name="forkless-writer")
        tasks.add(writer)
        tasks.add(asyncio.create_task(self._confirm(ws), name="forkless-confirm"))  # never ends by itself
        reader = stop_watch = None
        if not self._ctx.stopping.is_set():
            reader = asyncio.create_task(self._read(ws), name="forkless-reader")
            stop_watch = asyncio.create_task(self._ctx.stopping.wait(), name="forkless-stopping")
            tasks |= {reader, stop_watch}
        if self.timeouts.stale_s > 0:
            tasks.add(asyncio.create_task(self._watch_stale(), name="forkless-stale"))
        return writer, reader, stop_watch

    async def _until_ended(self, ws: aiohttp.ClientWebSocketResponse, tasks: set[asyncio.Task], writer: asyncio.Task,
                           reader: asyncio.Task | None, stop_watch: asyncio.Task | None) -> tuple[End, bool]:
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
                    reader = None
                    continue  # stopping: keep writing until outbound is drained
                return reader.result(), False
            if stop_watch is None or stop_watch not in done:
                return End(Outcome.LOST, f"no frame for {self.timeouts.stale_s}s (FORKLESS_STALE_S)"), False
            tasks.discard(stop_watch)
            stop_watch = None
            # the stop: a reader waiting for a frame ends now; one inside ctx.emit finishes it and
            # ends by itself (the frame is handed over whole, never lost half-way)
            if reader is not None and not self._emitting:
                reader.cancel()

    async def _closed(self, ws: aiohttp.ClientWebSocketResponse, conn: int, tasks: set[asyncio.Task], clean: bool,
                      end: End) -> None:
        """However it ended: its tasks cancelled, the replies written after the server last confirmed
        what it read counted (module rules), the socket closed (bounded), the feed counted as disconnected."""
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        ctx = self._ctx
        unconfirmed = ctx.replies_written - self._confirmed
        if not clean and unconfirmed:  # the peer may not have read them: counted, never silent
            ctx.unconfirmed(unconfirmed)
            log.warning("connection %d ended before the server confirmed the last %d reply frames written to it (by "
                        "a pong, or by answering our close): they may not all have been read", conn, unconfirmed,
                        extra=self._fields())
        current = asyncio.current_task()
        if not ws.closed and current is not None and current.cancelling():
            aiohttp_compat.drop(ws)  # an aborted stop: no closing handshake, no waiting
        if not ws.closed:
            try:  # a peer that never reads cannot hold this: GOING_AWAY is a courtesy
                async with asyncio.timeout(GIVE_UP_CLOSE_S):
                    await ws.close(code=aiohttp.WSCloseCode.GOING_AWAY)
            except TimeoutError:
                log.warning("connection %d dropped without a closing handshake", conn, extra=self._fields())
        ctx.connection_closed("" if end.outcome is Outcome.CLOSED else end.reason, code=end.code)

    async def _close_after_drain(self, ws: aiohttp.ClientWebSocketResponse) -> bool:
        """Close with 1000 and wait (bounded) for the server's close before dropping TCP: True when it came.

        aiohttp marks a connection whose ``receive()`` was cancelled (the stop) as an abnormal
        closure, and ``close()`` then drops the TCP connection right after our close frame.
        With frames we never read still in the socket buffer, the kernel answers with RST, and
        the server may lose our last replies and the close frame. So that mark is cleared:
        ``close()`` then reads and discards frames until the server's close, within
        ``CLOSE_TIMEOUT_S``.
        """
        ctx = self._ctx
        if ctx.stopping.is_set():
            aiohttp_compat.clear_abnormal_close(ws)
        limit = min(CLOSE_TIMEOUT_S, self.timeouts.shutdown_timeout_s)
        if ctx.stop_deadline is not None:  # the stop's work deadline: the rest is the process's
            limit = max(0.05, min(limit, ctx.stop_deadline - time.monotonic()))
        try:
            async with asyncio.timeout(limit):
                await ws.close(code=aiohttp.WSCloseCode.OK, message=b"done")
            log.info("connection %d closed with code 1000 after sending every result", self._connection_id,
                     extra=self._fields())
            return True
        except TimeoutError:
            log.warning("the server did not answer our close within %.1fs; connection %d dropped", limit,
                        self._connection_id, extra=self._fields())
            return False

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> End:
        """Frames to the codec and over (``ctx.emit(frames)``: those one socket read brought, in one
        pass) until the connection ends or the stop."""
        emit = self._ctx.emit
        stopping = self._ctx.stopping
        loop = asyncio.get_running_loop()
        ready = self._ready
        text, binary = aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY
        held = None  # a message that ended a read's frames: handled once they are handed over
        while True:
            msg, held = held or await ws.receive(), None
            kind = msg.type
            if kind is text or kind is binary:
                received = time.monotonic_ns()
                frames = [msg.data]
                # the data frames aiohttp parsed from the same read: receive() hands each out at once
                while len(frames) < READ_PASS_FRAMES and ready():
                    more = await ws.receive()
                    if more.type is text or more.type is binary:
                        frames.append(more.data)
                    else:
                        held = more
                        break
                self._last_frame_at = loop.time()
                self._emitting = True
                try:
                    await emit(frames, received_ns=received)
                except SourceStopped:  # the stop began while these were read: not taken, as if unread
                    return End(Outcome.STOPPED)
                finally:
                    self._emitting = False
                if stopping.is_set():
                    return End(Outcome.STOPPED)
            elif kind is aiohttp.WSMsgType.PING:  # answered here: autoping is off, so that pongs reach us
                await ws.pong(msg.data)
            elif kind is aiohttp.WSMsgType.PONG:
                self._ponged(msg.data)
            elif kind is aiohttp.WSMsgType.ERROR:
                # aiohttp puts a protocol error (e.g. 1009, frame too big) in msg.data and
                # only other failures (e.g. a missing pong) in ws.exception()
                exc = msg.data if isinstance(msg.data, BaseException) else ws.exception()
                if isinstance(exc, aiohttp.WebSocketError) and exc.code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG:
                    self._ctx.count_error("frame too large")
                    return End(Outcome.LOST, f"frame larger than FORKLESS_MAX_MSG_BYTES "
                                             f"({self.max_msg_bytes}), closed with 1009")
                why = "no exception given" if exc is None else f"{exc.__class__.__name__}: {short(exc)}"
                return End(Outcome.LOST, f"connection error: {why}", ws.close_code)
            elif kind in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
                return End(Outcome.LOST, closed_how(ws.close_code, "the server"), ws.close_code)

    async def _write(self, ws: aiohttp.ClientWebSocketResponse) -> End:
        """Each reply batch in one socket write, until the main thread's last one: framed by
        ``aiohttp_compat.TextFrames``, or, on a connection that compresses, by aiohttp's
        ``send_frame`` a frame at a time under the cork."""
        framer, cork = aiohttp_compat.text_frames(ws), self._cork
        async for batch in self._ctx.replies():
            frames = batch.frames
            written = 0
            try:
                with mapped_aiohttp_errors():
                    if framer is not None:
                        framer.write(frames)  # every frame handed to the transport, or none
                        written = len(frames)
                        await framer.drained()
                    else:
                        if cork is not None:
                            cork.cork()
                        try:
                            for frame in frames:
                                if isinstance(frame, bytes):  # UTF-8 JSON (the codec's, a send's): a text frame as is
                                    await ws.send_frame(frame, aiohttp.WSMsgType.TEXT)
                                else:
                                    await ws.send_str(frame)
                                written += 1
                        finally:
                            if cork is not None:
                                cork.uncork()
            except ConnectionLost as exc:
                return _lost_writing(ws, str(exc))
            except RuntimeError as exc:
                return _lost_writing(ws, f"{exc.__class__.__name__}: {short(exc)}")
            finally:
                batch.wrote(written)  # also when stopped part-way
        return End(Outcome.DRAINED)

    async def _confirm(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Every ``CONFIRM_EVERY_S`` while replies written are not yet confirmed: a ping, whose pong
        confirms them (module rules). A failed ping is the reader's to find out: this task goes on."""
        while True:
            await asyncio.sleep(CONFIRM_EVERY_S)
            written = self._ctx.replies_written
            if written == self._confirmed or ws.closed:
                continue
            self._pinged += 1
            payload = b"forkless %d" % self._pinged
            self._pings[payload] = written
            if len(self._pings) > MAX_PINGS_AWAITED:
                del self._pings[next(iter(self._pings))]  # the oldest: a later pong confirms more anyway
            try:
                await ws.ping(payload)
            except (ConnectionError, RuntimeError, aiohttp.ClientError):
                pass

    def _ponged(self, payload: bytes) -> None:
        """A pong: if it answers one of our pings, every reply written before that ping is confirmed."""
        written = self._pings.get(payload)
        if written is None:  # unsolicited (a server's own heartbeat), or one we stopped waiting for
            return
        self._confirmed = max(self._confirmed, written)
        for sent in list(self._pings):  # that ping and those before it (a pong answers the latest, RFC 6455)
            del self._pings[sent]
            if sent == payload:
                break

    async def _watch_stale(self) -> None:
        loop = asyncio.get_running_loop()
        limit = self.timeouts.stale_s
        while loop.time() - self._last_frame_at < limit:
            await asyncio.sleep(min(limit / 4, 1.0))


class _Link:
    """A ``WebSocketSource`` run's side of the reconnect driver (io_loop/reconnect.py): its attempts,
    connections, counters, warnings and give-up texts."""

    failures = (ConnectFailed, HandshakeRefused)

    def __init__(self, source: WebSocketSource, ctx: SourceContext, session: aiohttp.ClientSession) -> None:
        self.source, self.ctx, self.session = source, ctx, session

    def more(self) -> bool:  # the main thread's last reply is taken: no reason to connect again
        return not self.ctx.replies_ended()

    async def connect(self) -> tuple[aiohttp.ClientWebSocketResponse, list[str | bytes]]:
        return await self.source._open(self.session)

    def attempt_failed(self, exc: BaseException) -> str:
        return self.source._failed(exc)  # type: ignore[arg-type]  # one of ``failures``: drive catches only those

    def retrying(self, reason: str, delay: float) -> None:
        log.warning("connecting to %s failed: %s; retrying in %.2fs", self.source.shown_url, reason, delay,
                    extra={"feed": self.source.name})

    async def serve(self, conn: tuple[aiohttp.ClientWebSocketResponse, list[str | bytes]]) -> str:
        self.source._attempt = 0
        return (await self.source._serve(*conn)).reason

    def reconnecting(self, reason: str, delay: float) -> None:
        log.warning("connection %d to %s lost: %s; reconnecting in %.2fs", self.source._connection_id,
                    self.source.shown_url, reason, delay, extra=self.source._fields())
        self.ctx.reconnecting()

    def gave_up(self, reason: str, failures: int, lost: bool) -> FeedFatal:
        return FeedFatal(f"giving up on {self.source.shown_url} after {failures} "
                         f"{'lost connections' if lost else 'failed attempts'} in a row: {reason}")

    async def pause(self, delay: float) -> None:
        await pause_before_reconnect(delay, self.ctx.replies_ended)


def _lost_writing(ws: aiohttp.ClientWebSocketResponse, why: str) -> End:
    """A write found the connection gone: no close frame came before it (else the reader would have
    ended it), so it was lost without one, 1006, as a read that finds it so."""
    code = ws.close_code if ws.close_code is not None else LOST_WITHOUT_CLOSE
    return End(Outcome.LOST, f"send failed: {why}; {closed_how(code, 'the server')}", code)
