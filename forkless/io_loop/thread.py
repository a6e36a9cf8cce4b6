"""IOThread: the one dedicated thread that owns the asyncio loop and every feed's socket (the checkpoint store keeps
its own thread and NATS connection).

Rules:
- ``start()``, ``request_stop()``, ``join()`` and ``abort()`` are the main thread's; everything else runs in the
  thread ("forkless-io") on its own loop, a ``LoopThread``.
- The bridge (both janus queues) is created inside the running loop; ``start()`` returns its sync sides.
- Anything that ends the loop with an exception is kept in ``failure``; the main thread calls
  ``raise_if_failed()`` at least every ``POLL_S`` (controller/queues.py), so it is never swallowed.
- The seam: the thread is given what it needs as constructor arguments (its ``IOSettings``, the codec's decoding
  half, its ``IOStats``, every feed's source ready made by the composition root, the restored positions, the
  snapshot and metrics callables, a metrics server already bound); with the feed set it is the IO side's
  composition root. The main thread learns about this side only through ``snapshot()``, ``cpu_seconds()`` and the
  bridge's queues.
- No process is started and nothing forks: the demo feed and the metrics server are tasks on this loop.
- A ``sink`` (a ``RecordSink``: the relay's publisher, or a user's own) takes the main thread's place as
  ``inbound``'s reader, on this loop; no replies come, so once it returns ``outbound`` is ended here. If the feeds
  fail first, the sink gets until ``shutdown_timeout_s`` to deal with what was read, then their error is raised.
- ``result_sinks`` (a controller's ``ResultSink``s) are handed each batch's results on this loop (io_loop/sinks/
  results.py); one that fails ends the loop (``FeedFatal``), and the feeds' end waits for theirs.
- ``acknowledged``, when given, is signalled each time a feed's batch of answers is written whole, so a checkpoint
  waiting on its replies wakes without a poll.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from forkless.io_loop.bridge import Bridge, MainSide
from forkless.io_loop.capabilities import SupportsSummary
from forkless.io_loop.counters import LAG_INTERVAL_S, IOSnapshot, IOStats, combine_io
from forkless.io_loop.crossing import Chunk, Origin, Outgoing, count_unsent
from forkless.io_loop.decoding import FrameDecoder
from forkless.io_loop.errors import FeedFatal, IOThreadError, MetricsServerError, PositionLost
from forkless.io_loop.feeds import FeedSet
from forkless.io_loop.iosettings import IOSettings
from forkless.io_loop.loopthread import LoopThread, run_all
from forkless.io_loop.sinks.results import ResultSinks
from forkless.io_loop.sinks.sink import Acknowledged, RecordSink, ResultSink, SinkRunner
from forkless.io_loop.source import Source
from forkless.io_loop.waiting import PARK, WaitSettings

if TYPE_CHECKING:  # imported where served only: aiohttp.web, 1.7 MiB resident
    from forkless.io_loop.net.http import MetricsServer

__all__ = ["IOThread"]

log = logging.getLogger("forkless.io")

ABORT_CLEANUP_S = 0.2
# epoll waits in whole milliseconds (selectors rounds a timeout up): an idle loop's timer fires up to this late
TIMER_ROUNDING_S = 0.001
MAX_MISSED_SAMPLES = 600  # a block of the loop stands for at most this many samples it delayed (a minute)


class IOThread:
    def __init__(self, settings: IOSettings, codec: FrameDecoder, stats: IOStats, *,
                 stats_snapshot: Callable[[], Any] = lambda: None,
                 render_metrics: Callable[[], tuple[bytes, str]] | None = None,
                 sources: Sequence[Source], positions: Mapping[str, Origin] | None = None,
                 sink: RecordSink | SinkRunner | None = None, acknowledged: Acknowledged | None = None,
                 result_sinks: Sequence[ResultSink] = (), connection_events: bool = False,
                 metrics: MetricsServer | None = None, name: str = "forkless-io", wait: WaitSettings = PARK) -> None:
        if len(sources) != len(settings.feed_specs):
            raise ValueError(f"IOThread needs one source per feed: {len(settings.feed_specs)} feeds, "
                             f"{len(sources)} sources (controller/ioside.py's feed_sources makes them)")
        self.settings = settings
        names = [spec.name for spec in settings.feed_specs]
        self.sink = sink if sink is None or isinstance(sink, SinkRunner) else SinkRunner(sink, names)
        # a controller's sinks of results (their queues hold as many batches as outbound does)
        self.results = ResultSinks(result_sinks, names, settings.limits.queue_size) if result_sinks else None
        self.acknowledged = acknowledged
        self.connection_events = connection_events  # each feed hands its ConnectionEvents over (io_loop/source.py)
        self._sources = list(sources)  # every feed's source, ready made (controller/ioside.py's feed_sources)
        self.positions = dict(positions or {})  # JetStream feeds' restored positions, by feed name
        self.codec = codec
        self.stats = stats
        self.failure: BaseException | None = None
        self.metrics_url: str | None = None
        self._stats_snapshot = stats_snapshot
        self._render_metrics = render_metrics
        self._metrics = metrics  # a metrics server bound by the controller (served here; released here at the end)
        self._feeds: FeedSet | None = None
        # the thread and its loop (io_loop/loopthread.py, which waits as ``wait`` says); what _main leaves
        # running is cancelled at its end, briefly: _main has ended every task it made
        self._runner = LoopThread(name, cleanup_s=ABORT_CLEANUP_S, wait=wait)
        self._bridge: Bridge[Chunk, Outgoing] | None = None
        self._main_side: MainSide[Chunk, Outgoing] | None = None
        self._aborted = False
        self._stopping: list[asyncio.Task] = []  # the stop's tasks, made on the loop by request_stop
        self._stop_closed = False  # True once _main has taken the stop's tasks to finish: none is made after

    # ---- main-thread API --------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> MainSide[Chunk, Outgoing]:
        """Start the thread; return the queues' sync sides once the loop has made them. Under a hand-off that
        keeps the threads apart (io_loop/waiting.py), the thread keeps off the core of the one calling this."""
        if not self._runner.start(self._outcome, timeout):
            raise IOThreadError(f"the IO thread did not start within {timeout}s")
        self.raise_if_failed()
        assert self._main_side is not None
        return self._main_side

    def request_stop(self, deadline: float | None = None) -> None:
        """Begin the orderly stop (stop reading; the rest follows the bridge's rules).
        ``deadline`` (``time.monotonic()`` seconds) bounds the waits of the closing handshake."""
        self._runner.call_soon(self._begin_stop, deadline)  # nothing once the loop has closed

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread; True if it has ended (its last act done: every count final). Safe
        to call again after a ``KeyboardInterrupt`` interrupted it (a second SIGINT)."""
        return self._runner.join(timeout)

    def abort(self) -> None:
        """Cancel the loop's main task (what was not sent is counted as dropped); the clean-up
        after it is bounded by ``ABORT_CLEANUP_S``, so the thread ends soon after."""
        self._aborted = True
        self._runner.cancel()

    def summaries(self) -> list[str]:
        """The ``summary()`` line of each source that declares one (the demo feed's tally), in the
        sources' order. Any thread; final once the thread has ended."""
        return [source.summary() for source in self._sources if isinstance(source, SupportsSummary)]

    @property
    def alive(self) -> bool:
        return self._runner.alive

    def raise_if_failed(self) -> None:
        """Re-raise what ended the thread: ``FeedFatal`` and ``MetricsServerError`` as they are,
        anything else as ``IOThreadError`` from it."""
        failure = self.failure
        if failure is not None:
            if isinstance(failure, (FeedFatal, MetricsServerError, PositionLost, IOThreadError)):
                raise failure
            raise IOThreadError(f"the IO thread died: {failure!r}") from failure

    def cpu_seconds(self) -> float:
        """CPU seconds this thread has used (``time.thread_time`` as the thread itself would read
        it), callable from any thread; NaN before it started, or where the platform has no
        per-thread CPU clock. One ``clock_gettime`` a call."""
        return self._runner.cpu_seconds()

    def snapshot(self) -> IOSnapshot:
        """Everything the IO side counts, copied: totals, and each feed's own; callable from any thread."""
        bridge, feeds = self._bridge, self._feeds
        inbound, outbound = bridge.depths() if bridge is not None else (0, 0)
        io = combine_io(self.stats.snapshot(inbound, outbound, 0), feeds.snapshots() if feeds is not None else [])
        return io if self.results is None else dataclasses.replace(io, sinks=self.results.snapshots())

    def feed_ended(self, index: int) -> str:
        """Why feed ``index`` takes no more frames ("" while it does): callable from any thread.
        ``Controller.send`` asks before every send: two reads of values the IO thread writes
        (each one reference read: atomic with or without the GIL), not a whole snapshot
        (bench/docs/exchange-session-cost.md)."""
        feeds = self._feeds
        return feeds.ended(index) if feeds is not None else ""

    # ---- the thread -------------------------------------------------------------------------

    @property
    def _loop(self) -> asyncio.AbstractEventLoop | None:
        return self._runner.loop

    async def _outcome(self) -> None:
        """The thread's main coroutine: ``_main``, what ends it kept in ``failure`` (see the rules)."""
        try:
            await self._main()
        except asyncio.CancelledError:
            escaped = self._runner.failure  # what left the loop from a task of its own, which then cancelled this
            if escaped is not None and not isinstance(escaped, asyncio.CancelledError):
                self.failure = IOThreadError(f"the IO loop was ended by {escaped!r}, raised in a task on it (a "
                                             "source's, a sink's or a hook's own task): the IO side stopped")
                self.failure.__cause__ = escaped
            elif not self._aborted:
                self.failure = IOThreadError("the IO loop was cancelled")
        except BaseException as exc:
            self.failure = exc
            if not isinstance(exc, (FeedFatal, MetricsServerError, PositionLost)):  # those get one clear line
                log.error("the IO thread died", exc_info=exc)

    async def _main(self) -> None:
        cfg = self.settings
        bridge: Bridge[Chunk, Outgoing] = Bridge(cfg.limits.queue_size, self._runner.selector,
                                                 on_sent=self._send_arrived, sent=attrgetter("sent"))
        self._bridge = bridge
        background: list[asyncio.Task] = []
        metrics = self._metrics  # released at the end however it ends, served or not
        try:
            self._feeds = FeedSet(cfg, self.codec, bridge, self._sources, positions=self.positions,
                                  acknowledged=self.acknowledged, results=self.results,
                                  connection_events=self.connection_events)
            if len(self._feeds.specs) > 1:
                log.info("%d feeds: %s", len(self._feeds.specs), ", ".join(s.label for s in self._feeds.specs))
            if metrics is not None:  # bound and served already while the controller started: now here
                self.metrics_url = await metrics.start(alive=self._runner.thread.is_alive)
            elif cfg.metrics_addr:
                from forkless.io_loop.net.http import MetricsServer  # only when served: aiohttp.web, 1.7 MiB resident

                metrics = MetricsServer(cfg.metrics_addr, snapshot=self._stats_snapshot,
                                        alive=self._runner.thread.is_alive, render=self._render_metrics)
                self.metrics_url = await metrics.start()
            background.append(asyncio.create_task(self._watch_lag(), name="forkless-lag"))
            self._main_side = bridge.main_side()
            self._runner.ready()
            if self.results is not None:
                await self._run_with_results(self.results, self._feeds)
            elif self.sink is None:
                await self._feeds.run()
            else:
                await self._run_with_sink(self.sink, self._feeds, bridge)
        finally:
            # a stop asked from here on (while the loop closes) has nothing left to stop: it makes no
            # task, which no one would run or await (a coroutine "never awaited")
            self._stop_closed = True
            for task in (*background, *self._stopping):
                task.cancel()
            await asyncio.gather(*background, *self._stopping, return_exceptions=True)
            # outbound shut before what it holds is counted: a put the main thread makes from here on
            # is refused (and counted there), never taken after the count and lost with the queue
            bridge.end_outbound()
            self._count_unsent()
            try:
                # after an abort the stop deadline has (nearly) passed: clean up briefly or not at all
                async with asyncio.timeout(ABORT_CLEANUP_S if self._aborted else None):
                    if metrics is not None:
                        await metrics.stop()
            except TimeoutError:
                log.warning("clean-up after the abort cut short after %.1fs", ABORT_CLEANUP_S)
            await bridge.aclose()

    def _send_arrived(self, item: Outgoing) -> None:
        """A send of the main thread's crossed (the bridge's wake-up, on the loop): its feed watches it."""
        if self._feeds is not None:
            self._feeds.send_arrived(item)

    async def _run_with_sink(self, sink: SinkRunner, feeds: FeedSet, bridge: Bridge[Chunk, Outgoing]) -> None:
        """The feeds and the sink together, until both are done (see the module rules)."""
        feeding = asyncio.create_task(feeds.run(), name="forkless-feeds")
        sinking = asyncio.create_task(sink.run(bridge.inbound), name="forkless-sink")
        try:
            done, _ = await asyncio.wait({feeding, sinking}, return_when=asyncio.FIRST_COMPLETED)
            if sinking in done:
                sinking.result()  # the sink's failure (FeedFatal) ends the loop at once
                bridge.end_outbound()  # no replies will come: the feeds' writers end, the connections close
                await feeding
                return
            # the feeds run until outbound ends, so they ended by failing: the sink deals with
            # what was read (bounded by the stop's timeout), then their error is raised
            bridge.stop_inbound()
            try:
                async with asyncio.timeout(self.settings.timeouts.shutdown_timeout_s):
                    await asyncio.shield(sinking)
            except TimeoutError:
                log.error("the feeds failed and what they had read was not dealt with within "
                          "FORKLESS_SHUTDOWN_TIMEOUT_S=%s", self.settings.timeouts.shutdown_timeout_s)
            feeding.result()
        finally:
            for task in (feeding, sinking):
                task.cancel()
            await asyncio.gather(feeding, sinking, return_exceptions=True)

    async def _run_with_results(self, results: ResultSinks, feeds: FeedSet) -> None:
        """The feeds and the controller's sinks together, until both are done; the first failure
        (a feed's, a sink's ``FeedFatal``) ends both and is raised (see the module rules)."""
        await run_all({"forkless-feeds": feeds.run(), "forkless-sinks": results.run()})

    def _begin_stop(self, deadline: float | None) -> None:
        """On the loop: start the stop as a task the loop keeps (``_main`` finishes it), so it is
        never collected unstarted when the loop ends first; nothing once ``_main`` has ended."""
        if self._stop_closed:
            return
        self._stopping.append(asyncio.get_running_loop().create_task(self._stop_reading(deadline),
                                                                     name="forkless-stop"))

    async def _stop_reading(self, deadline: float | None) -> None:
        if self.sink is not None:
            self.sink.begin_stop()
        if self.results is not None:
            self.results.begin_stop()
        if self._feeds is not None:
            await self._feeds.stop_reading(deadline)
        elif self._bridge is not None:
            self._bridge.stop_inbound()

    async def _watch_lag(self) -> None:
        """The IO-loop lag the status line and metrics report, sampled every ``LAG_INTERVAL_S``
        (``LagSampler``) until cancelled."""
        sampler = LagSampler(asyncio.get_running_loop(), self.stats.loop_lag)
        try:
            await sampler.run()
        finally:
            sampler.stop()

    def _count_unsent(self) -> None:
        """Whatever replies could not be sent are counted and logged, never silently lost:
        answers to messages as dropped messages, bad-input error replies on their own."""
        feeds = self._feeds
        unsent = [held for i in range(len(feeds.clients)) for held in feeds.unsent_items(i)] if feeds else []
        left_on_outbound = self._bridge.outbound.take_all() if self._bridge is not None else []
        unsent += [(item, 0) for item in left_on_outbound]
        if self.results is not None:  # their results never reached the sinks: counted in each one's books
            self.results.count_unsent(left_on_outbound)
        answers, errors, sent = count_unsent(unsent)
        # messages received but never handed to the main thread, or handed over after it
        # stopped taking them (an aborted stop): counted as not processed
        left = feeds.discard_gathered() if feeds is not None else 0
        inbound = self._bridge.inbound if self._bridge is not None else None
        while inbound is not None:
            try:
                left += len(inbound.get_nowait())
            except Exception:
                break
        if left:
            self.stats.dropped["not processed before the stop"] += left
            log.error("%d received messages were not handed to the main thread before the stop", left)
        if answers:
            self.stats.dropped["unsent at stop"] += answers
            log.error("%d replies to received messages could not be sent before the stop", answers)
        if errors:
            self.stats.error_replies_unsent += errors
            log.error("%d error replies to bad input could not be sent before the stop", errors)
        if sent:
            self.stats.sent_unsent += sent
            log.error("%d frames the main thread sent could not be written before the stop", sent)


class LagSampler:
    """The IO-loop lag, sampled every ``LAG_INTERVAL_S``: the longer of how long a callback that
    is ready now waits for its turn (one trip round the loop) and how late the sampling timer
    fired, less epoll's rounding (``TIMER_ROUNDING_S``: an idle loop's figure is the trip's).
    The timer's lateness covers whatever held the loop while it waited (a source's blocking call
    of 2 s is a sample of about 2 s), the trip whatever held it between the two callbacks; a
    block longer than the interval, in either, also stands for the samples it delayed, each as
    late as it was then (HdrHistogram's expected-interval correction), so the quantiles weigh a
    block by how long it lasted. Two plain callbacks a sample (a timer, then one trip round the
    loop): no future and no task step on an idle IO thread (bench/docs/exchange-session-cost.md)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, lag: Any) -> None:
        self.loop = loop
        self.lag = lag
        self._handle: asyncio.Handle | None = None
        self._due = self._start = self._late = 0.0

    async def run(self) -> None:
        """Sample until cancelled."""
        self._schedule()
        await self.loop.create_future()  # never done: the callbacks do the work

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self) -> None:
        self._due = due = self.loop.time() + LAG_INTERVAL_S
        self._handle = self.loop.call_at(due, self._fired)

    def _fired(self) -> None:
        self._start = start = self.loop.time()
        self._late = start - self._due - TIMER_ROUNDING_S
        self._handle = self.loop.call_soon(self._trip)

    def _trip(self) -> None:
        lag = self.lag
        late = max(self.loop.time() - self._start, self._late)  # a block shows in one or the other
        lag.observe(late)
        if late > LAG_INTERVAL_S:
            missed = min(int(late / LAG_INTERVAL_S), MAX_MISSED_SAMPLES)
            lag.observe_many(late - k * LAG_INTERVAL_S for k in range(1, missed + 1))
        self._schedule()
