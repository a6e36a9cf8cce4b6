"""The network half of ``--check``: can the metrics address be bound, and does the feed answer?

Rules:
- Each probe raises ``ProbeFailed(reason)`` with one human sentence, or prints what it found
  through ``say`` and returns. The exit status each failure maps to is the preflight's
  business (controller/commands/check.py), not this module's.
- The feed probe asks each feed's source to try itself (its ``probe``, io_loop/capabilities.py),
  the sources handed in, made as every run's are (controller/ioside.py's ``feed_sources``): this
  module knows no kind of feed and imports none of their modules (they import it, for ``ProbeFailed``
  and ``probe_websocket``). A WebSocket feed's (io_loop/connectors/websocket/client.py) is ``probe_websocket``:
  ONE connection with the configured TLS, headers, token and timeouts (io_loop/connectors/websocket/connect.py, the
  same code the client uses), a brief wait for a first frame, a close with 1000. A JetStream feed's connects to
  its server, reads its stream and finds the stream storing its results subject, warning when
  that stream's duplicate window is shorter than a restart needs (its connector's room's probe). The
  embedded demo feed's (io_loop/connectors/websocket/demo_source.py), when no feed is configured, serves it
  and connects once. With several feeds (``FORKLESS_FEEDS``) every feed is probed and the probe
  fails if any of them does, naming them.
- A feed with a unix-domain socket is probed through it (``new_session``); the demo feed with
  ``FORKLESS_DEMO_UNIX_SOCKET`` serves and is probed on that socket; a metrics address
  ``unix:/path`` is bound and removed as the server would (io_loop/net/unixsocket.py). No TCP socket
  is opened for any of them.
- The probes run on a loop of their own in a thread of their own ("forkless-check",
  io_loop/loopthread.py's ``run_in_thread``): the caller's thread keeps its event loop, and
  ``--check`` may be called from inside a running one; what a probe raises is raised in the caller.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import aiohttp
from forkless.io_loop.capabilities import capability
from forkless.io_loop.connectors.websocket.connect import (
    ConnectFailed,
    HandshakeRefused,
    handshake_headers,
    new_session,
    open_feed,
    shown_target,
)
from forkless.io_loop.decoding import FrameDecoder
from forkless.io_loop.loopthread import run_in_thread
from forkless.io_loop.net.netaddr import parse_host_port, unix_address, unix_label
from forkless.io_loop.net.tls import make_ssl_context
from forkless.io_loop.net.unixsocket import listen_unix
from forkless.io_loop.settings import Credentials, FeedSpec, Timeouts, TlsSettings
from forkless.io_loop.source import Source

__all__ = ["FIRST_FRAME_WAIT_S", "ProbeFailed", "WebSocketTarget", "check_metrics_addr", "probe_feed",
           "probe_websocket"]

FIRST_FRAME_WAIT_S = 2.0


class ProbeFailed(Exception):
    """One probe failed; ``str`` is the reason, fit to print."""


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


def check_metrics_addr(addr: str, say: Callable[[str], None]) -> None:
    """Bind (and release) the metrics address, as the metrics server will."""
    try:
        path = unix_address(addr)
    except ValueError as exc:
        raise ProbeFailed(f"cannot listen on FORKLESS_METRICS_ADDR={addr}: {exc}") from None
    if path is not None:
        _check_unix_listener(path, "FORKLESS_METRICS_ADDR")
        say(f"  {addr}: free; /metrics, /healthz, /readyz and /startedz will be served on that unix-domain socket")
        return
    try:
        host, port = parse_host_port(addr)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
    except (OSError, ValueError) as exc:
        raise ProbeFailed(f"cannot listen on FORKLESS_METRICS_ADDR={addr}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    say(f"  {addr}: free; /metrics, /healthz, /readyz and /startedz will be served there")


def _check_unix_listener(path: str, variable: str) -> None:
    """The unix-domain socket ``path`` can be listened on (io_loop/net/unixsocket.py's rules): bound once,
    then removed (a stale socket file found there is removed too, as the server would)."""
    try:
        listen_unix(path).close()
    except OSError as exc:
        raise ProbeFailed(f"cannot listen on {variable}={unix_label(path)}: {exc.strerror or exc}") from None


def probe_feed(feeds: Sequence[FeedSpec], sources: Sequence[Source], codec: FrameDecoder,
               say: Callable[[str], None], *, dedupe_window_s: float = 180.0) -> None:
    """Connect once to each feed (or the embedded demo feed): ``sources``, one per spec of ``feeds``, each
    probes itself; see the module rules. ``dedupe_window_s``: the duplicate window a JetStream feed's
    results stream should have."""
    if len(sources) != len(feeds):
        raise ValueError(f"probe_feed needs one source per feed: {len(feeds)} feeds, {len(sources)} sources")
    run_in_thread(lambda: _probe_feed(feeds, sources, codec, say, dedupe_window_s), name="forkless-check")


async def _probe_feed(feeds: Sequence[FeedSpec], sources: Sequence[Source], codec: FrameDecoder,
                      say: Callable[[str], None], dedupe_window_s: float) -> None:
    if len(feeds) == 1:
        await _probe_source(sources[0], codec, say, dedupe_window_s)
        return
    failed = []
    for feed, source in zip(feeds, sources):
        say(f"  {feed.label}{'' if feed.required else ' (not required)'}:")
        try:
            await _probe_source(source, codec, lambda line: say("  " + line), dedupe_window_s)
        except ProbeFailed as exc:
            say(f"    FAILED: {exc}")
            failed.append(f"feed {feed.name!r}")
    if failed:
        raise ProbeFailed(f"{len(failed)} of {len(feeds)} feeds failed: {', '.join(failed)} (see above)")


async def _probe_source(source: Any, codec: FrameDecoder, say: Callable[[str], None], dedupe_window_s: float) -> None:
    """One feed's source tries itself (its ``probe``, io_loop/capabilities.py); one without is said and passed."""
    probe = capability(source, "probe")
    if probe is None:
        say(f"  source {source.name!r} declares no probe(): not tried")
        return
    await probe(codec, say, dedupe_window_s=dedupe_window_s)


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
