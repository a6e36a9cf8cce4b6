"""The aiohttp WebSocket client: socket -> codec -> inbound, outbound -> socket; reconnects.

Rules:
- Runs in the IO thread's loop only. One reader task and one writer task per connection.
- Reader: frame -> ``codec.decode`` -> good messages to ``inbound`` as one ``Chunk``, error
  replies to ``outbound`` (so every frame sent goes through the one writer). When
  ``inbound`` is full the reader waits (``overflow=block``: TCP pushes back on the server)
  or drops the oldest chunk and counts it (``overflow=drop_oldest``).
- Writer: takes ``Outgoing`` items and sends their frames in order. The item being sent
  and its position survive a lost connection and are resumed on the next one; nothing
  taken from ``outbound`` is forgotten.
- Reconnect on any loss (refused, reset, TLS, handshake timeout, 5xx, close frame,
  heartbeat timeout, stale feed) with ``Backoff``; an HTTP 4xx handshake (but 408/429) or
  used-up tries raise ``FeedFatal``.
- Orderly stop (``stop_reading``): the reader is never cancelled while handing a chunk over,
  so no received frame is lost; then ``inbound`` is shut down. The writer sends everything
  until ``outbound`` is shut down and empty, then the socket is closed with code 1000.
- Secrets (token, headers) are never logged; URLs are logged without query or credentials.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import janus
import numpy as np

from controller.batching import Chunk
from controller.codec import Codec
from controller.config import Config
from controller.stats import IOStats
from io_loop.backoff import Backoff
from io_loop.bridge import Bridge, Outgoing

log = logging.getLogger("forkless.client")

RETRYABLE_4XX = (408, 429)
CLOSE_TIMEOUT_S = 2.0  # how long an orderly close waits for the server's close frame


class _CorkedTransport:
    """Stands in for one connection's socket transport inside aiohttp's frame writer, so the
    frames of one ``Outgoing`` item leave in a single ``write`` (one syscall) instead of one
    each. Writes pass straight through unless corked (pongs and close frames included).

    It also remembers how many frames each of its recent writes held, so that frames still
    waiting in the transport's buffer when a connection is given up can be counted."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._held: list[bytes] = []
        self._writes: deque[tuple[int, int]] = deque(maxlen=4096)  # (bytes, frames), newest last
        self.corked = False

    def write(self, data: bytes) -> None:
        if self.corked:
            self._held.append(data)
        else:
            self._transport.write(data)

    def uncork(self, frames: int) -> None:
        self.corked = False
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            self._transport.write(data)
            self._writes.append((len(data), frames))

    def frames_unflushed(self) -> int:
        """Frames (from the newest writes) still in the transport's buffer, i.e. not yet
        handed to the kernel; an upper estimate when a write was partly flushed."""
        try:
            waiting = self._transport.get_write_buffer_size()
        except Exception:  # a closed transport: nothing left to count
            return 0
        frames = 0
        for size, count in reversed(self._writes):
            if waiting <= 0:
                break
            frames += count
            waiting -= size
        return frames

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _cork(ws: aiohttp.ClientWebSocketResponse) -> _CorkedTransport | None:
    """Install the corked transport in aiohttp's writer; None (plain writes) if its layout changed."""
    writer = getattr(ws, "_writer", None)
    if writer is None or not hasattr(writer, "transport"):
        return None
    cork = _CorkedTransport(writer.transport)
    writer.transport = cork
    return cork


class FeedFatal(Exception):
    """The feed cannot be used (4xx handshake, tries used up); the program should exit non-zero."""


class _Retry(Exception):
    """A connection attempt failed in a way that is worth retrying."""


def redact_url(url: str) -> str:
    """``scheme://host:port/path`` — no credentials, no query (tokens often live there)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def make_ssl_context(config: Config) -> ssl.SSLContext:
    """System trust store, plus ``ca_file`` if given; verification off only if asked."""
    ctx = ssl.create_default_context()
    if config.ca_file:
        ctx.load_verify_locations(cafile=config.ca_file)
    if config.tls_insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class FeedClient:
    def __init__(self, config: Config, codec: Codec, bridge: Bridge, stats: IOStats, url: str) -> None:
        self.config = config
        self.codec = codec
        self.bridge = bridge
        self.stats = stats
        self.url = url
        self.shown_url = redact_url(url)
        self._ssl = make_ssl_context(config) if url.startswith("wss:") else None
        self._stopping = False
        self._outbound_done = False
        self._reader_task: asyncio.Task | None = None
        self._reader_in_handover = False
        self._gathered: list[Any] = []  # decoded frames not yet handed to the main thread
        self._gathered_n = 0
        self._gathered_at = 0
        self._handover_scheduled = False
        self._pending_put: asyncio.Future | None = None  # a hand-over waiting for room in inbound
        self._current: Outgoing | None = None  # item being sent; survives reconnects
        self._offset = 0  # frames of _current already sent
        self._last_frame_at = 0.0
        self._connection_id = 0
        self._inbound_stopped = False
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self._cork: _CorkedTransport | None = None

    # ---- control (IO loop) ------------------------------------------------------------------

    async def stop_reading(self) -> None:
        """Stop taking frames, without losing one half handed over; then shut ``inbound``."""
        self._stopping = True
        task = self._reader_task
        if task is not None and not task.done():
            if not self._reader_in_handover:
                task.cancel()
            await asyncio.wait([task])
        if self._gathered or self._pending_put is not None:
            await self._hand_over(wait=self.config.overflow != "drop_oldest")
        if not self._inbound_stopped:
            self._inbound_stopped = True
            self.bridge.stop_inbound()

    def held_frames(self) -> int:
        """Frames taken from ``outbound`` but not yet written to a socket."""
        return 0 if self._current is None else len(self._current.frames) - self._offset

    # ---- the connection loop ----------------------------------------------------------------

    async def run(self) -> None:
        """Connect, serve, reconnect, until stopped and every result is sent (or FeedFatal)."""
        cfg = self.config
        backoff = Backoff(cfg.reconnect_min_s, cfg.reconnect_max_s, cfg.reconnect_reset_s,
                          cfg.reconnect_tries)
        async with aiohttp.ClientSession() as session:
            while not self._outbound_done:
                try:
                    ws = await self._connect(session)
                except _Retry as exc:
                    self.stats.connect_failures += 1
                    self.stats.last_error = str(exc)
                    delay = backoff.failed()
                    if delay is None:
                        raise FeedFatal(f"giving up on {self.shown_url} after {backoff.failures} "
                                        f"failed attempts in a row: {exc}") from None
                    log.warning("connecting to %s failed: %s; retrying in %.2fs", self.shown_url, exc, delay)
                    await self._pause(delay)
                    continue
                backoff.connected(time.monotonic())
                reason = await self._serve(ws)
                backoff.disconnected(time.monotonic())
                if reason != "closed":
                    self.stats.last_error = reason
                if self._outbound_done:
                    break
                delay = backoff.failed()
                if delay is None:
                    raise FeedFatal(f"giving up on {self.shown_url} after {backoff.failures} "
                                    f"lost connections in a row: {reason}")
                log.warning("connection %d to %s lost: %s; reconnecting in %.2fs",
                            self._connection_id, self.shown_url, reason, delay)
                self.stats.reconnects += 1
                await self._pause(delay)

    async def _pause(self, delay: float) -> None:
        """Sleep before the next attempt; while stopping, notice when nothing is left to send."""
        end = asyncio.get_running_loop().time() + delay
        while True:
            left = end - asyncio.get_running_loop().time()
            if left <= 0:
                return
            if self._stopping and self._current is None:
                try:
                    self._current = self.bridge.outbound.get_nowait()
                    self._offset = 0
                except asyncio.QueueEmpty:
                    pass
                except janus.AsyncQueueShutDown:
                    self._outbound_done = True
                    return
            await asyncio.sleep(min(left, 0.05))

    async def _connect(self, session: aiohttp.ClientSession) -> aiohttp.ClientWebSocketResponse:
        cfg = self.config
        headers = dict(cfg.headers)
        if cfg.auth_token:
            headers["Authorization"] = f"Bearer {cfg.auth_token}"
        if self._ssl is not None and cfg.tls_insecure:
            log.warning("TLS certificate verification is OFF for %s (FORKLESS_TLS_INSECURE=1)", self.shown_url)
        try:
            async with asyncio.timeout(cfg.connect_timeout_s):
                return await session.ws_connect(
                    self.url,
                    headers=headers,
                    heartbeat=cfg.heartbeat_s or None,
                    ssl=self._ssl if self._ssl is not None else True,
                    max_msg_size=cfg.max_msg_bytes,
                    autoping=True,
                )
        except aiohttp.WSServerHandshakeError as exc:
            if 400 <= exc.status < 500 and exc.status not in RETRYABLE_4XX:
                raise FeedFatal(f"{self.shown_url} refused the WebSocket handshake with HTTP {exc.status}"
                                f" ({_http_hint(exc.status)})") from None
            raise _Retry(f"handshake failed with HTTP {exc.status}") from None
        except aiohttp.ClientConnectorCertificateError as exc:
            raise _Retry(f"TLS certificate verification failed: {exc.certificate_error.__class__.__name__}: "
                         f"{getattr(exc.certificate_error, 'verify_message', exc.certificate_error)} "
                         "(FORKLESS_CA_FILE adds a CA bundle)") from None
        except TimeoutError:
            raise _Retry(f"no handshake within {cfg.connect_timeout_s}s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise _Retry(f"{exc.__class__.__name__}: {_short(exc)}") from None

    async def _serve(self, ws: aiohttp.ClientWebSocketResponse) -> str:
        """Run one connection until it is lost (returns why) or everything is sent."""
        self._connection_id += 1
        conn = self._connection_id
        stats = self.stats
        stats.connects += 1
        stats.connected = True
        stats.state_since = time.time()
        self.ws = ws
        self._cork = _cork(ws)
        self._last_frame_at = asyncio.get_running_loop().time()
        log.info("connection %d to %s open", conn, self.shown_url, extra={"connection": conn})
        tasks: set[asyncio.Task] = set()
        clean = False
        try:
            if self.config.subscribe:
                await ws.send_str(self.config.subscribe)
            writer = asyncio.create_task(self._write(ws), name="forkless-writer")
            tasks.add(writer)
            reader = None
            if not self._stopping:
                reader = self._reader_task = asyncio.create_task(self._read(ws), name="forkless-reader")
                tasks.add(reader)
            if self.config.stale_s > 0:
                tasks.add(asyncio.create_task(self._watch_stale(), name="forkless-stale"))
            while True:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                if writer in done:
                    outcome = writer.result()
                    if outcome == "drained":
                        unflushed = self._cork.frames_unflushed() if self._cork is not None else 0
                        if not await self._close_after_drain(ws) and unflushed:
                            stats.dropped["replies lost with the connection"] += unflushed
                            log.error("about %d reply frames were still unsent when connection %d was dropped",
                                      unflushed, conn, extra={"connection": conn})
                        clean = True
                        log.info("connection %d closed with code 1000 after sending every result", conn,
                                 extra={"connection": conn})
                        return "closed"
                    return outcome
                if reader is not None and reader in done:
                    tasks.discard(reader)
                    if reader.cancelled() or reader.result() == "stopped":
                        continue  # stopping: keep writing until outbound is drained
                    return reader.result()
                return f"no frame for {self.config.stale_s}s (FORKLESS_STALE_S)"
        except (ConnectionError, aiohttp.ClientError) as exc:
            return f"{exc.__class__.__name__}: {_short(exc)}"
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)
            if not clean and self._cork is not None:
                lost = self._cork.frames_unflushed()
                if lost:  # written to a socket that is being given up: counted, never silent
                    stats.dropped["replies lost with the connection"] += lost
                    log.error("connection %d given up with about %d reply frames still unsent", conn, lost,
                              extra={"connection": conn})
            if not ws.closed:
                await ws.close(code=aiohttp.WSCloseCode.GOING_AWAY)
            self.ws = None
            stats.connected = False
            stats.state_since = time.time()

    async def _close_after_drain(self, ws: aiohttp.ClientWebSocketResponse) -> bool:
        """Close with 1000 and wait (bounded) for the server's close before dropping TCP.

        aiohttp marks a connection whose ``receive()`` was cancelled (``stop_reading``) as an
        abnormal closure, and ``close()`` then drops the TCP connection right after our close
        frame. With frames we never read still in the socket buffer, the kernel answers with
        RST, and the server may lose our last replies and the close frame. So that mark (a
        private attribute) is cleared: ``close()`` then reads and discards frames until the
        server's close, within ``CLOSE_TIMEOUT_S``.
        """
        if self._stopping and getattr(ws, "_close_code", None) == aiohttp.WSCloseCode.ABNORMAL_CLOSURE:
            ws._close_code = None
        try:
            async with asyncio.timeout(min(CLOSE_TIMEOUT_S, self.config.shutdown_timeout_s)):
                await ws.close(code=aiohttp.WSCloseCode.OK, message=b"done")
            return True
        except TimeoutError:
            log.warning("the server did not answer our close within %.1fs; connection dropped",
                        min(CLOSE_TIMEOUT_S, self.config.shutdown_timeout_s))
            return False

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> str:
        stats = self.stats
        codec = self.codec
        outbound = self.bridge.outbound
        loop = asyncio.get_running_loop()
        drop_oldest = self.config.overflow == "drop_oldest"
        while True:
            msg = await ws.receive()
            kind = msg.type
            if kind is aiohttp.WSMsgType.TEXT or kind is aiohttp.WSMsgType.BINARY:
                received = time.monotonic_ns()
                self._last_frame_at = loop.time()
                stats.frames_in += 1
                decoded = codec.decode(msg.data)
                self._reader_in_handover = True
                try:
                    if decoded.errors:
                        for reason, _ in decoded.errors:
                            stats.errors[reason] += 1
                            log.warning("bad input on connection %d: %s", self._connection_id, reason,
                                        extra={"connection": self._connection_id})
                        frames = [codec.encode_error(reason, seq) for reason, seq in decoded.errors]
                        await outbound.put(Outgoing(frames))
                    n = len(decoded.seq)
                    if n:
                        stats.messages_in += n
                        self._gather(decoded, received)
                        if self._gathered_n >= self.config.max_batch or self._pending_put is not None:
                            await self._hand_over(wait=not drop_oldest)
                finally:
                    self._reader_in_handover = False
                if self._stopping:
                    return "stopped"
            elif kind is aiohttp.WSMsgType.ERROR:
                # aiohttp puts a protocol error (e.g. 1009, frame too big) in msg.data and
                # only other failures (e.g. a missing pong) in ws.exception()
                exc = msg.data if isinstance(msg.data, BaseException) else ws.exception()
                if isinstance(exc, aiohttp.WebSocketError) and exc.code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG:
                    stats.errors["frame too large"] += 1
                    return f"frame larger than FORKLESS_MAX_MSG_BYTES ({self.config.max_msg_bytes}), closed with 1009"
                return f"connection error: {exc.__class__.__name__}: {_short(exc)}"
            elif kind in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
                return f"closed by the server (code {ws.close_code})"

    # Frames that arrive together (one socket read holds many) cross to the main thread as
    # one chunk: the reader gathers what it decodes and hands it over when the loop next
    # turns (call_soon), or at once when max_batch messages are gathered, instead of one
    # cross-thread wake-up per frame. Latency is counted from the first frame of a chunk.

    def _gather(self, decoded: Any, received_ns: int) -> None:
        if not self._gathered:
            self._gathered_at = received_ns
            if not self._handover_scheduled:
                self._handover_scheduled = True
                asyncio.get_running_loop().call_soon(self._hand_over_soon)
        self._gathered.append(decoded)
        self._gathered_n += len(decoded.seq)

    def _take_gathered(self) -> Chunk | None:
        parts = self._gathered
        if not parts:
            return None
        self._gathered = []
        self._gathered_n = 0
        if len(parts) == 1:
            return Chunk(parts[0].seq, parts[0].stream, parts[0].x, self._gathered_at)
        seq: list[Any] = []
        stream: list[str] = []
        for part in parts:
            seq.extend(part.seq)
            stream.extend(part.stream)
        return Chunk(seq, stream, np.concatenate([part.x for part in parts]), self._gathered_at)

    def _hand_over_soon(self) -> None:
        """Loop callback: put what was gathered without waiting. If ``inbound`` is full, a
        task waits for room, and the reader waits for that task before it hands over more."""
        self._handover_scheduled = False
        if self._pending_put is not None:
            return  # the reader hands over after the pending put (see _hand_over)
        chunk = self._take_gathered()
        if chunk is None:
            return
        if self.config.overflow == "drop_oldest":
            self._put_dropping_oldest(chunk)
            return
        try:
            self.bridge.inbound.put_nowait(chunk)
        except asyncio.QueueFull:
            self._pending_put = asyncio.ensure_future(self._put_later(chunk))

    async def _put_later(self, chunk: Chunk) -> None:
        try:
            await self.bridge.inbound.put(chunk)
        finally:
            self._pending_put = None

    async def _hand_over(self, wait: bool = True) -> None:
        """Put everything gathered now, in order, waiting for room in ``inbound`` if full."""
        pending = self._pending_put
        if pending is not None:
            await pending
        chunk = self._take_gathered()
        if chunk is None:
            return
        if wait:
            await self.bridge.inbound.put(chunk)
        else:
            self._put_dropping_oldest(chunk)

    def _put_dropping_oldest(self, chunk: Chunk) -> None:
        inbound = self.bridge.inbound
        while True:
            try:
                inbound.put_nowait(chunk)
                return
            except asyncio.QueueFull:
                try:
                    old = inbound.get_nowait()
                except asyncio.QueueEmpty:
                    continue
                self.stats.dropped["inbound overflow (drop_oldest)"] += len(old)
                log.warning("inbound queue full: dropped the oldest %d messages (FORKLESS_OVERFLOW=drop_oldest)",
                            len(old))

    async def _write(self, ws: aiohttp.ClientWebSocketResponse) -> str:
        stats = self.stats
        outbound = self.bridge.outbound
        cork = self._cork
        while True:
            if self._current is None:
                try:
                    self._current = await outbound.get()
                except janus.AsyncQueueShutDown:
                    self._outbound_done = True
                    return "drained"
                self._offset = 0
            item = self._current
            frames = item.frames
            if cork is not None:
                cork.corked = True
            start = self._offset
            try:
                while self._offset < len(frames):
                    frame = frames[self._offset]
                    if type(frame) is bytes:  # UTF-8 JSON from the codec: send as a text frame as is
                        await ws.send_frame(frame, aiohttp.WSMsgType.TEXT)
                    else:
                        await ws.send_str(frame)
                    self._offset += 1
            except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
                return f"send failed: {exc.__class__.__name__}: {_short(exc)}"
            finally:
                if cork is not None:
                    cork.uncork(self._offset - start)
            self._current = None
            if item.received_ns:
                now = time.monotonic_ns()
                stats.latency.observe_many([(now - r) * 1e-9 for r in item.received_ns])
            stats.results_out += item.results
            stats.errors_out += len(frames) - item.results

    async def _watch_stale(self) -> None:
        loop = asyncio.get_running_loop()
        limit = self.config.stale_s
        while loop.time() - self._last_frame_at < limit:
            await asyncio.sleep(min(limit / 4, 1.0))


def _http_hint(status: int) -> str:
    return {401: "unauthorised: check FORKLESS_AUTH_TOKEN",
            403: "forbidden: check FORKLESS_AUTH_TOKEN / FORKLESS_HEADERS",
            404: "not found: check the path in FORKLESS_WS_URL"}.get(status, "client error: check FORKLESS_WS_URL")


def _short(exc: BaseException) -> str:
    text = str(exc) or exc.__class__.__name__
    return text if len(text) <= 200 else text[:200] + "…"
