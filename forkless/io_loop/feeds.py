"""FeedSet: every configured feed's source on the IO loop, and each reply routed back to the connection its message
came from.

Rules:
- Every feed is a ``Source`` run by a ``SourceRunner``. This module knows no kind of feed and imports none of their
  modules: the composition root builds every feed's source; ``feed_client`` is the only call made for a feed. Each
  has its own connection, reconnects, counters; all put their chunks on the one inbound queue, stamped with the
  feed's index, so one micro-batch may mix feeds.
- Replies: with one feed, its client writes straight from outbound (no extra hop). With several, the router takes
  each ``Outgoing`` (a batch that mixed feeds is one bundle: one hand-over per batch) and puts each part on its
  feed's ``Outbox`` without waiting, so a feed that is down holds back nobody else's replies; an outbox is bounded
  by what was unanswered when its feed went down. With a controller's sinks the router always runs and hands each
  item's results to the sinks first (a sink behind holds outbound).
- A feed that gives up (``FeedFatal``) is logged and reported (``given_up``); its replies are counted as dropped
  ("feed given up"). The loop ends with ``FeedFatal`` (exit 3) when every feed has given up, or at the first with
  ``FORKLESS_FEED_FATAL=any``.
- Orderly stop: every feed stops reading (``stop_reading``), then inbound is shut down; once outbound is drained the
  router ends every outbox, and each writer sends what is left and closes with 1000.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import janus

from forkless.io_loop.bridge import Bridge
from forkless.io_loop.capabilities import declarations
from forkless.io_loop.counters import FeedSnapshot, IOStats
from forkless.io_loop.crossing import Outgoing, count_unsent
from forkless.io_loop.decoding import FrameDecoder
from forkless.io_loop.errors import FeedFatal
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.iosettings import IOSettings
from forkless.io_loop.source import Source, SourceRunner

__all__ = ["FeedSet", "Outbox", "feed_client"]

log = logging.getLogger("forkless.feeds")

GIVEN_UP_REASON = "feed given up"


class Outbox(asyncio.Queue):
    """One feed's replies waiting for its writer (several feeds): an unbounded ``asyncio.Queue``
    that ends like the bridge's outbound queue. After ``end()``, once what was queued has been
    taken, ``get``/``get_nowait`` raise ``janus.AsyncQueueShutDown``. ``frames`` counts the
    reply frames queued (the feed's unsent count). IO loop only."""

    _END = object()

    def __init__(self) -> None:
        super().__init__()
        self.frames = 0

    def put_nowait(self, item: Any) -> None:
        super().put_nowait(item)
        if item is not self._END:
            self.frames += len(item.frames)

    def get_nowait(self) -> Any:
        item = super().get_nowait()
        return self._taken(item)

    # no ``get`` of its own: asyncio.Queue.get returns ``self.get_nowait()``, which counts the item (a
    # ``get`` that counted it again made the feed's unsent count go below zero by every frame written)

    def _taken(self, item: Any) -> Any:
        if item is self._END:
            super().put_nowait(item)  # every later get sees the end too
            raise janus.AsyncQueueShutDown
        self.frames -= len(item.frames)
        return item

    def end(self) -> None:
        """No more items will come: the writer sends what is queued, then sees the end."""
        self.put_nowait(self._END)


def feed_client(spec: FeedSpec, index: int, settings: IOSettings, codec: FrameDecoder, source: Source, *,
                inbound: Any, outbox: Any, positions: Mapping[str, Any], acknowledged: Any = None,
                connection_events: bool = False) -> SourceRunner:
    """The IO side of one configured feed: a ``SourceRunner`` for its ready source, handed what
    the restored checkpoint recorded for it (``connection_events``: it hands over a
    ``ConnectionEvent`` at each change of its connection). The feed set calls only this."""
    return SourceRunner(source, settings.limits, codec, IOStats(source=declarations(source, spec.name).figures), spec,
                        features=settings.features, max_batch=settings.max_batch, timeouts=settings.timeouts,
                        inbound=inbound, outbox=outbox, index=index, resume=positions.get(spec.name),
                        acknowledged=acknowledged, connection_events=connection_events)


class FeedSet:
    """The feeds of one IO thread (see the module rules): each feed's client from ``feed_client``
    (a ``SourceRunner`` for each feed's ready source, ``sources`` one per ``settings.feed_specs``)."""

    def __init__(self, settings: IOSettings, codec: FrameDecoder, bridge: Bridge, sources: Sequence[Source], *,
                 positions: Mapping[str, Any] | None = None, acknowledged: Any = None,
                 results: Any = None, connection_events: bool = False) -> None:
        self.settings = settings
        self.bridge = bridge
        self.specs = settings.feed_specs
        self.given_up = [""] * len(self.specs)
        self.results = results  # a controller's sinks (io_loop/sinks/results.py's ResultSinks), or None
        routed = len(self.specs) > 1 or results is not None
        self.outboxes: list[Outbox] = [Outbox() for _ in self.specs] if routed else []
        self.clients: list[SourceRunner] = [
            feed_client(spec, i, settings, codec, source, inbound=bridge.inbound,
                        outbox=self.outboxes[i] if routed else bridge.outbound, positions=positions or {},
                        acknowledged=acknowledged, connection_events=connection_events)
            for i, (spec, source) in enumerate(zip(self.specs, sources, strict=True))]
        self.lost_answers = 0  # replies to messages of given-up feeds, also counted in their stats
        self.lost_errors = 0

    # ---- running ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve every feed until stopped and drained; raises ``FeedFatal`` per the policy."""
        tasks = {asyncio.create_task(client.run(), name=f"forkless-feed-{client.feed.name}"): i
                 for i, client in enumerate(self.clients)}
        router = asyncio.create_task(self._route(), name="forkless-router") if self.outboxes else None
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    exc = task.exception()
                    if exc is None:
                        continue
                    if not isinstance(exc, FeedFatal) or len(self.clients) == 1:
                        raise exc
                    self._give_up(tasks[task], exc)
                    if self.settings.feed_fatal == "any":
                        raise FeedFatal(f"{self.specs[tasks[task]].label} gave up (FORKLESS_FEED_FATAL=any): {exc}")
                    if all(self.given_up):
                        raise FeedFatal("every feed has given up: " + "; ".join(
                            f"{spec.label}: {why}" for spec, why in zip(self.specs, self.given_up)))
        finally:
            leftover = [task for task in pending if not task.done()] + ([router] if router is not None else [])
            for task in leftover:
                task.cancel()
            if leftover:
                await asyncio.wait(leftover)

    async def stop_reading(self, deadline: float | None) -> None:
        """Every feed stops taking frames (see SourceRunner.stop_reading); then inbound is shut.
        With several feeds, what outbound holds is not yet routed to them (io_loop/finishing.py)."""
        unrouted = self.bridge.outbound.qsize if self.outboxes else lambda: 0
        await asyncio.gather(*(client.stop_reading(deadline, unrouted) for client in self.clients))
        self.bridge.stop_inbound()

    async def _route(self) -> None:
        """Several feeds, or sinks: each reply batch to its feed's outbox (never waits on a feed;
        waits for room in a sink's queue)."""
        outbound = self.bridge.outbound
        item = None
        try:
            while True:
                try:
                    item = await outbound.get()
                except janus.AsyncQueueShutDown:
                    return
                if item.for_sinks is not None:
                    await self.results.hand(item.for_sinks)  # the sinks first, in the steps' order
                self._forward(item)
                item = None
        finally:
            # also when cancelled (the abort): the item in hand goes to its feeds (counted there as unsent), and
            # every outbox ends, so a writer waiting on one ends too instead of holding the IO thread
            if item is not None:
                self._forward(item)
            for outbox in self.outboxes:
                outbox.end()
            if self.results is not None:
                self.results.end()

    def _forward(self, item: Outgoing) -> None:
        """An item's frames, each feed's part to its outbox (never waits)."""
        for part in item.unbundled():  # a batch that mixed feeds comes as one bundle
            if not part.frames and item.for_sinks is not None:
                continue  # results for the sinks only: no frame for its feed
            if self.given_up[part.feed]:
                self._count_lost(part.feed, [(part, 0)])
            else:
                self.outboxes[part.feed].put_nowait(part)

    def _give_up(self, index: int, exc: BaseException) -> None:
        """A feed gave up: reported, and the replies it can no longer send counted as dropped."""
        spec = self.specs[index]
        self.given_up[index] = str(exc)
        left = sum(not why for why in self.given_up)
        log.error("%s gave up: %s; %d of %d feeds go on (FORKLESS_FEED_FATAL=%s)", spec.label, exc, left,
                  len(self.specs), self.settings.feed_fatal, extra={"feed": spec.name})
        self._count_lost(index, self.unsent_items(index))

    def _count_lost(self, index: int, items: list[tuple[Outgoing | None, int]]) -> None:
        stats = self.clients[index].stats
        answers, errors, sent = count_unsent(items)
        stats.sent_unsent += sent
        if answers:
            stats.dropped[GIVEN_UP_REASON] += answers
            log.error("%d replies to messages of %s dropped: it gave up", answers, self.specs[index].label,
                      extra={"feed": self.specs[index].name})
        stats.error_replies_unsent += errors

    # ---- the stop's accounting and observing --------------------------------------------------

    def unsent_items(self, index: int) -> list[tuple[Outgoing | None, int]]:
        """Take what feed ``index`` still holds: its writer's item (with how many frames were
        written) and, with several feeds, its outbox (emptied)."""
        items: list[tuple[Outgoing | None, int]] = [self.clients[index].take_held()]
        if self.outboxes:
            outbox = self.outboxes[index]
            while True:
                try:
                    items.append((outbox.get_nowait(), 0))
                except (asyncio.QueueEmpty, janus.AsyncQueueShutDown):
                    break
        return items

    def send_arrived(self, item: Outgoing) -> None:
        """A send of the main thread's crossed: its feed watches its deadline (io_loop/sends.py)."""
        if 0 <= item.feed < len(self.clients) and not self.given_up[item.feed]:
            self.clients[item.feed].send_arrived(item)

    def discard_gathered(self) -> int:
        """At an aborted stop: messages gathered by the feeds' hand-overs, not yet on inbound."""
        return sum(client.handover.discard() for client in self.clients)

    def ended(self, index: int) -> str:
        """Why feed ``index`` takes no more frames: it gave up, or its source's ``run`` returned;
        "" while it takes them (callable from any thread: two reads, no copy)."""
        why = self.given_up[index]
        if why:
            return f"it gave up: {why}"
        return "its run returned" if self.clients[index].ended else ""

    def snapshots(self) -> list[FeedSnapshot]:
        """Each feed's figures, copied (callable from any thread)."""
        return [FeedSnapshot(spec.name, spec.required, why,
                             client.stats.snapshot(0, 0, client.held_frames()
                                                   + (self.outboxes[i].frames if self.outboxes else 0)),
                             ended=client.ended)
                for i, (spec, client, why) in enumerate(zip(self.specs, self.clients, self.given_up))]
