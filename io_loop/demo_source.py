"""The embedded demo feed as one of the feed set's clients: its loopback server and the built-in
WebSocket client pointed at it, together.

Rules:
- Made by the feed set (io_loop/feeds.py) for the feed whose url is empty when the demo feed runs
  (``IOSettings.uses_demo_feed``), with the face every feed's client has (``run``,
  ``stop_reading``, ``held_frames``, ``take_held``, ``handover``, ``stats``): the IO thread does not
  know the demo feed is there.
- ``run()`` starts the server (``DemoFeed``, io_loop/demo_feed.py) on the IO loop, then serves a
  ``FeedClient`` connected to it, and stops the server once the client has ended.
- The stop: the server stops sending, the frames already on the loopback wire are answered (when
  the feed is sent replies), then the client stops reading as any feed does; so the demo's tally
  is complete.
- Imported only when the demo feed runs: the server and aiohttp's web side cost 3.7 MiB of resident
  memory a real deployment never uses (measured 2026-11-30, /proc/self/statm).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from io_loop.before_connect import BeforeConnect
from io_loop.client import FeedClient
from io_loop.counters import IOStats
from io_loop.crossing import Outgoing
from io_loop.decoding import FrameDecoder
from io_loop.demo_feed import DemoFeed
from io_loop.handover import Handover
from io_loop.on_connect import OnConnect
from io_loop.settings import FeedSpec, IOSettings

__all__ = ["DemoRunner"]

log = logging.getLogger("forkless.io")

STOP_CLEANUP_S = 0.2  # how long stopping the server may take once the client was cancelled (an abort)


class DemoRunner:
    """The demo feed's server and its client (see the module rules)."""

    def __init__(self, settings: IOSettings, codec: FrameDecoder, stats: IOStats, feed: FeedSpec, *, inbound: Any,
                 outbox: Any, index: int, on_connect: OnConnect | None = None,
                 before_connect: BeforeConnect | None = None) -> None:
        self.settings = settings
        self.feed = feed
        self.stats = stats
        self.demo = DemoFeed(rate_hz=settings.demo_rate, streams=settings.demo_streams, features=settings.features,
                             warmup=settings.demo_warmup)
        self._client_args = dict(inbound=inbound, outbox=outbox, index=index, on_connect=on_connect,
                                 before_connect=before_connect)
        self._codec = codec
        self._client: FeedClient | None = None  # made once the server listens (its url is known then)
        self._stopping = False

    async def run(self) -> None:
        cfg = self.settings
        try:
            url = await self.demo.start()
            log.info("demo feed listening on %s (%d streams, %g msg/s)", url, cfg.demo_streams, cfg.demo_rate)
            self._client = FeedClient(cfg, self._codec, self.stats, self.feed, url=url, **self._client_args)
            if self._stopping:  # the stop came while the server started: nothing was read
                await self._client.stop_reading()
            await self._client.run()
        finally:
            cancelled = asyncio.current_task().cancelling() if asyncio.current_task() else 0
            try:
                async with asyncio.timeout(STOP_CLEANUP_S if cancelled else None):
                    await self.demo.stop()
            except TimeoutError:
                log.warning("the demo feed's server did not stop within %.1fs", STOP_CLEANUP_S)

    async def stop_reading(self, deadline: float | None = None) -> None:
        """Let what the demo feed already sent be answered, then stop reading as any feed does."""
        self._stopping = True
        self.demo.stop_sending()
        if self._client is None:
            return
        if self.feed.replies != "none":  # with "none" no reply ever comes
            await self.demo.wait_replies(timeout=min(2.0, self.settings.shutdown_timeout_s / 2))
        await self._client.stop_reading(deadline)

    @property
    def handover(self) -> Handover | _NoHandover:
        return self._client.handover if self._client is not None else _NoHandover()

    def held_frames(self) -> int:
        return self._client.held_frames() if self._client is not None else 0

    def take_held(self) -> tuple[Outgoing | None, int]:
        return self._client.take_held() if self._client is not None else (None, 0)


class _NoHandover:
    """Before the client exists nothing was gathered."""

    idle = True

    def discard(self) -> int:
        return 0
