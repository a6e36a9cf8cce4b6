"""The embedded demo feed as a ``Source``: its loopback server and the built-in WebSocket source pointed at it,
together.

Rules:
- Made by the WebSocket connector for the feed with no url when the demo feed runs, and run by a ``SourceRunner`` as
  any source is: the IO thread and the feed set do not know it is there.
- ``run(ctx)`` starts the server (``DemoFeed``) on the IO loop, runs the ``WebSocketSource`` made by the ``client``
  it is handed (with the configured timeouts, TLS, credentials and hooks) against it on the same ``ctx``, and stops
  the server once that ended. With ``FORKLESS_DEMO_UNIX_SOCKET`` both ends use that socket.
- The stop (``before_stop``): the server stops sending, the frames on the wire are answered, then the source stops
  reading as any does; so the demo's tally is complete. ``summary()`` is that tally in one line.
- ``--check`` (``probe``): the server started, one connection to it, the server stopped; its per-connection INFO
  lines held back meanwhile.
- Imported only when the demo feed runs: the server and aiohttp's web side cost resident memory a real deployment
  never uses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from forkless.io_loop.capabilities import SourceCapabilities
from forkless.io_loop.connectors.websocket.connect import shown_target
from forkless.io_loop.connectors.websocket.demo_feed import DemoFeed
from forkless.io_loop.connectors.websocket.demo_feed import log as demo_log
from forkless.io_loop.connectors.websocket.settings import DemoSettings
from forkless.io_loop.decoding import FrameDecoder
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.settings import Timeouts
from forkless.io_loop.source import SourceContext

__all__ = ["DemoSource"]

log = logging.getLogger("forkless.io")

STOP_CLEANUP_S = 0.2  # how long stopping the server may take once the source was cancelled (an abort)
REPLIES_WAIT_S = 2.0  # how long the stop waits for the replies to what the server sent (at most)


class DemoSource(SourceCapabilities):
    """The demo feed's server and its WebSocket source (see the module rules)."""

    starts_connected = False  # connected once the WebSocket source's connection is open

    def __init__(self, feed: FeedSpec, demo: DemoSettings, *, timeouts: Timeouts,
                 client: Callable[[FeedSpec, str], Any], features: int, warmup: int) -> None:
        self.name = feed.name
        self.replies = feed.replies
        self.required = feed.required
        self.demo_settings = demo
        self.timeouts = timeouts
        self.feed = feed
        self.server = DemoFeed(rate_hz=demo.rate, streams=demo.streams, features=features, warmup=warmup,
                               unix_socket=demo.unix_socket)
        self._client = client  # (feed, url) -> the WebSocketSource reading the server (the connector's)
        self._listening = False

    async def run(self, ctx: SourceContext) -> None:
        cfg = self.demo_settings
        try:
            url = await self.server.start()
            self._listening = True
            log.info("demo feed listening on %s (%d streams, %g msg/s)", shown_target(url, self.server.unix_socket),
                     cfg.streams, cfg.rate)
            # a stop that came while the server started: ctx.stopping is set, so nothing is read
            feed = dataclasses.replace(self.feed, unix_socket=self.server.unix_socket)
            await self._client(feed, url).run(ctx)
        finally:
            current = asyncio.current_task()
            cancelled = current.cancelling() if current is not None else 0
            try:
                async with asyncio.timeout(STOP_CLEANUP_S if cancelled else None):
                    await self.server.stop()
            except TimeoutError:
                log.warning("the demo feed's server did not stop within %.1fs", STOP_CLEANUP_S)

    async def probe(self, codec: FrameDecoder, say: Callable[[str], None], *, dedupe_window_s: float = 0.0) -> None:
        """``--check``'s try of the demo feed: its server started, one connection to it, the server stopped."""
        from forkless.io_loop.probe import ProbeFailed  # only --check probes: a run never loads it

        cfg = self.demo_settings
        level = demo_log.level  # its per-connection INFO lines would only clutter the check's own report
        demo_log.setLevel(logging.WARNING)  # "forkless.demo_feed" (the module name is not the logger's)
        try:
            try:
                url = await self.server.start()
            except OSError as exc:
                where = (f"FORKLESS_DEMO_UNIX_SOCKET={cfg.unix_socket}" if cfg.unix_socket
                         else "loopback TCP")
                raise ProbeFailed(f"cannot serve the demo feed on {where}: {exc.strerror or exc}") from None
            say(f"  FORKLESS_WS_URL is unset: started the embedded demo feed on "
                f"{shown_target(url, self.server.unix_socket)}")
            feed = dataclasses.replace(self.feed, unix_socket=self.server.unix_socket)
            await self._client(feed, url).probe(codec, say)
        finally:
            await self.server.stop()
            demo_log.setLevel(level)

    def summary(self) -> str:
        """The demo run's tally in one line (``DemoSummary.line``); final once the source has ended."""
        return self.server.summary().line()

    async def before_stop(self, ctx: SourceContext) -> None:
        """Let what the demo feed already sent be answered; then the source stops reading as any does."""
        self.server.stop_sending()
        if self._listening and self.feed.replies != "none":  # with "none" no reply ever comes
            await self.server.wait_replies(timeout=min(REPLIES_WAIT_S, self.timeouts.shutdown_timeout_s / 2))
