"""The network half of ``--check``: can the metrics address be bound, and does the feed answer?

Rules:
- Each probe raises ``ProbeFailed(reason)`` with one human sentence, or prints what it found
  through ``say`` and returns. The exit status each failure maps to is the preflight's
  business (controller/check.py), not this module's.
- The feed probe makes ONE connection per feed with the configured TLS, headers, token and
  timeouts (io_loop/connect.py, the same code the client uses), waits briefly for a first
  frame, and closes with 1000. A JetStream feed's probe connects to its server, reads its
  stream and finds the stream storing its results subject, warning when that stream's
  duplicate window is shorter than a restart needs (io_loop/jsprobe.py). With several
  feeds (``FORKLESS_FEEDS``) every feed is probed and the probe fails if any of them does,
  naming them. When no feed is configured it starts
  the embedded demo feed and probes that.
- A feed with a unix-domain socket is probed through it (``new_session``); the demo feed with
  ``FORKLESS_DEMO_UNIX_SOCKET`` serves and is probed on that socket; a metrics address
  ``unix:/path`` is bound and removed as the server would (io_loop/unixsocket.py). No TCP socket
  is opened for any of them.
- The probes run on a loop of their own in a thread of their own ("forkless-check",
  io_loop/loopthread.py's ``run_in_thread``): the caller's thread keeps its event loop, and
  ``--check`` may be called from inside a running one; what a probe raises is raised in the caller.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import Callable
from typing import Any

import aiohttp
from forkless.io_loop.connect import (
    ConnectFailed,
    HandshakeRefused,
    handshake_headers,
    make_ssl_context,
    new_session,
    open_feed,
    shown_target,
)
from forkless.io_loop.decoding import FrameDecoder
from forkless.io_loop.demo_feed import DemoFeed
from forkless.io_loop.demo_feed import log as demo_log
from forkless.io_loop.loopthread import run_in_thread
from forkless.io_loop.netaddr import parse_host_port, unix_address, unix_label
from forkless.io_loop.settings import FeedSpec, IOSettings
from forkless.io_loop.unixsocket import listen_unix

__all__ = ["FIRST_FRAME_WAIT_S", "ProbeFailed", "check_metrics_addr", "probe_feed"]

FIRST_FRAME_WAIT_S = 2.0


class ProbeFailed(Exception):
    """One probe failed; ``str`` is the reason, fit to print."""


def check_metrics_addr(addr: str, say: Callable[[str], None]) -> None:
    """Bind (and release) the metrics address, as the metrics server will."""
    try:
        path = unix_address(addr)
    except ValueError as exc:
        raise ProbeFailed(f"cannot listen on FORKLESS_METRICS_ADDR={addr}: {exc}") from None
    if path is not None:
        _check_unix_listener(path, "FORKLESS_METRICS_ADDR")
        say(f"  {addr}: free; /metrics, /healthz and /readyz will be served on that unix-domain socket")
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
    say(f"  {addr}: free; /metrics, /healthz and /readyz will be served there")


def _check_unix_listener(path: str, variable: str) -> None:
    """The unix-domain socket ``path`` can be listened on (io_loop/unixsocket.py's rules): bound once,
    then removed (a stale socket file found there is removed too, as the server would)."""
    try:
        listen_unix(path).close()
    except OSError as exc:
        raise ProbeFailed(f"cannot listen on {variable}={unix_label(path)}: {exc.strerror or exc}") from None


def probe_feed(settings: IOSettings, codec: FrameDecoder, say: Callable[[str], None], *,
               dedupe_window_s: float = 180.0) -> None:
    """Connect once to the feed (or the embedded demo feed); see the module rules.
    ``dedupe_window_s``: the duplicate window a JetStream feed's results stream should have."""
    run_in_thread(lambda: _probe_feed(settings, codec, say, dedupe_window_s), name="forkless-check")


async def _probe_feed(settings: IOSettings, codec: FrameDecoder, say: Callable[[str], None],
                      dedupe_window_s: float = 180.0) -> None:
    demo = None
    try:
        if settings.uses_demo_feed:
            # its per-connection INFO lines would only clutter the check's own report
            demo_log.setLevel(logging.WARNING)  # "forkless.demo_feed" (the module name is not the logger's)
            demo = DemoFeed(rate_hz=settings.demo_rate, streams=settings.demo_streams,
                            features=settings.features, warmup=settings.demo_warmup,
                            unix_socket=settings.demo_unix_socket)
            try:
                url = await demo.start()
            except OSError as exc:
                where = (f"FORKLESS_DEMO_UNIX_SOCKET={settings.demo_unix_socket}" if settings.demo_unix_socket
                         else "loopback TCP")
                raise ProbeFailed(f"cannot serve the demo feed on {where}: {exc.strerror or exc}") from None
            say(f"  FORKLESS_WS_URL is unset: started the embedded demo feed on {shown_target(url, demo.unix_socket)}")
            feed = dataclasses.replace(settings.feed_specs[0], unix_socket=demo.unix_socket)
            await _connect_once(settings, codec, url, say, feed)
            return
        feeds = settings.feed_specs
        if len(feeds) == 1:
            await _probe_one(settings, codec, say, feeds[0], dedupe_window_s)
            return
        failed = []
        for feed in feeds:
            say(f"  {feed.label}{'' if feed.required else ' (not required)'}:")
            try:
                await _probe_one(settings, codec, lambda line: say("  " + line), feed, dedupe_window_s)
            except ProbeFailed as exc:
                say(f"    FAILED: {exc}")
                failed.append(f"feed {feed.name!r}")
        if failed:
            raise ProbeFailed(f"{len(failed)} of {len(feeds)} feeds failed: {', '.join(failed)} (see above)")
    finally:
        if demo is not None:
            await demo.stop()


async def _probe_one(settings: IOSettings, codec: FrameDecoder, say: Callable[[str], None], feed: FeedSpec,
                     dedupe_window_s: float) -> None:
    """One configured feed: a WebSocket connection, or a JetStream feed's server, stream and results."""
    if feed.jetstream is None:
        await _connect_once(settings, codec, feed.url, say, feed)
        return
    # only with a JetStream feed: it imports nats-py, an optional extra (pip install ".[nats]")
    from forkless.io_loop.jsprobe import probe_jetstream

    problems = await probe_jetstream(settings, feed, say, dedupe_window_s)
    if problems:
        raise ProbeFailed("; ".join(problems))


async def _connect_once(settings: IOSettings, codec: FrameDecoder, url: str, say: Callable[[str], None],
                        feed: FeedSpec) -> None:
    shown = shown_target(url, feed.unix_socket)
    headers = handshake_headers(settings, feed)
    if headers:
        say(f"  handshake headers: {', '.join(sorted(headers))} (values hidden)")
    ssl_ctx = make_ssl_context(settings) if url.startswith("wss:") else None
    if ssl_ctx is not None:
        say(f"  TLS: system trust store{' + ' + settings.ca_file if settings.ca_file else ''}"
            f"{', verification OFF (FORKLESS_TLS_INSECURE=1)' if settings.tls_insecure else ''}")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with new_session(feed.unix_socket) as session:
        try:
            ws = await open_feed(session, url, settings, ssl_ctx, heartbeat=False, feed=feed)
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
                say(f"  sent {'its subscribe message' if settings.feeds_from_list else 'FORKLESS_SUBSCRIBE'}"
                    f" ({len(feed.subscribe)} characters)")
            wait_s = min(FIRST_FRAME_WAIT_S, settings.connect_timeout_s)
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
