"""``--check``'s try of a WebSocket feed (its source's ``probe``, io_loop/connectors/websocket/client.py): ONE
connection, as the feed would open it, its first frame described, closed with 1000.

Rules:
- The connection is the client's own code (io_loop/connectors/websocket/connect.py): the configured TLS, headers,
  token, timeouts and unix-domain socket (``new_session``: a feed with one is probed through it, the demo feed with
  ``FORKLESS_DEMO_UNIX_SOCKET`` on that socket, no TCP socket opened), the subscribe message sent as on every
  connection. Then a brief wait for a first frame (``FIRST_FRAME_WAIT_S``, at most the connect timeout; a quiet
  feed is not an error), decoded by the run's codec to say what the controller would make of it.
- What fails raises ``ProbeFailed`` (io_loop/probe.py) with one sentence: a refused handshake, a connection that
  cannot be made. What it finds is said through ``say``; header values and tokens never are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import aiohttp

from forkless.io_loop.connectors.websocket.connect import (
    ConnectFailed,
    HandshakeRefused,
    handshake_headers,
    new_session,
    open_feed,
    shown_target,
)
from forkless.io_loop.connectors.websocket.settings import Credentials
from forkless.io_loop.decoding import FrameDecoder
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.net.tls import make_ssl_context
from forkless.io_loop.probe import ProbeFailed
from forkless.io_loop.settings import Timeouts, TlsSettings

__all__ = ["FIRST_FRAME_WAIT_S", "WebSocketTarget", "probe_websocket"]

FIRST_FRAME_WAIT_S = 2.0


class WebSocketTarget(Protocol):
    """What ``probe_websocket`` reads of a WebSocket feed's source (io_loop/connectors/websocket/client.py's
    ``WebSocketSource`` is one): where it connects and with which settings."""

    feed: FeedSpec
    url: str
    tls: TlsSettings
    credentials: Credentials
    timeouts: Timeouts
    max_msg_bytes: int
    feeds_from_list: bool


async def probe_websocket(source: WebSocketTarget, codec: FrameDecoder, say: Callable[[str], None]) -> None:
    """One WebSocket connection of ``source`` (to its ``url``, with its settings), its first frame described,
    closed with 1000."""
    feed, url, tls = source.feed, source.url, source.tls
    shown = shown_target(url, feed.unix_socket)
    headers = handshake_headers(source.credentials, feed)
    if headers:
        say(f"  handshake headers: {', '.join(sorted(headers))} (values hidden)")
    ssl_ctx = make_ssl_context(tls) if url.startswith("wss:") else None
    if ssl_ctx is not None:
        say(f"  TLS: system trust store{' + ' + tls.ca_file if tls.ca_file else ''}"
            f"{', verification OFF (FORKLESS_TLS_INSECURE=1)' if tls.insecure else ''}")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with new_session(feed.unix_socket) as session:
        try:
            ws = await open_feed(session, url, ssl_ctx, headers=headers, timeouts=source.timeouts,
                                 max_msg_bytes=source.max_msg_bytes, heartbeat=False)
        except HandshakeRefused as exc:
            raise ProbeFailed(str(exc)) from None
        except ConnectFailed as exc:
            raise ProbeFailed(f"cannot connect to {shown}: {exc}") from None
        took_ms = (loop.time() - t0) * 1000
        try:
            say(f"  connected to {shown} in {took_ms:.1f} ms (HTTP 101"
                f"{', subprotocol ' + ws.protocol if ws.protocol else ''})")
            if feed.subscribe:
                await ws.send_str(feed.subscribe)
                say(f"  sent {'its subscribe message' if source.feeds_from_list else 'FORKLESS_SUBSCRIBE'}"
                    f" ({len(feed.subscribe)} characters)")
            wait_s = min(FIRST_FRAME_WAIT_S, source.timeouts.connect_timeout_s)
            try:
                msg = await asyncio.wait_for(ws.receive(), wait_s)
            except TimeoutError:
                say(f"  no frame within {wait_s:g}s (a quiet feed is not an error)")
            else:
                _describe_frame(msg, codec, loop.time() - t0, say)
        finally:
            await ws.close(code=aiohttp.WSCloseCode.OK, message=b"forkless --check done")
        say("  closed the connection (code 1000)")


def _describe_frame(msg: Any, codec: FrameDecoder, after_s: float, say: Callable[[str], None]) -> None:
    if msg.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
        say(f"  the feed ended the connection before any frame: {msg.type.name}"
            f"{f' (code {msg.data})' if isinstance(msg.data, int) else ''}")
        return
    decoded = codec.decode(msg.data)
    found = f"{len(decoded)} good message(s)"
    if len(decoded):
        found += f", first stream {decoded.stream[0]!r}"
    if decoded.errors:
        reasons = sorted({reason for reason, _ in decoded.errors})
        found += f", {len(decoded.errors)} the controller would refuse ({'; '.join(reasons)})"
    say(f"  first frame after {after_s * 1000:.0f} ms, {len(msg.data)} bytes: {found}")
