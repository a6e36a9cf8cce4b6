"""SinkRun: a source → sink run: the feeds (or a program's own sources) into one ``RecordSink``, on one IO thread,
with no processor and no JAX: the relay (controller/commands/relaycmd.py) and a user's own.

Rules:
- The controller's runtime and pieces: one ``IOThread`` runs the sources and the sink (``SinkRunner``) on its loop;
  this main thread waits for the stop with the controller's ``StopSignals``, ``serve``, ``StopDeadline`` and
  ``end_io``.
- Nothing here imports JAX, the processors, the engine or the loop (the relay's test checks ``sys.modules``).
- Orderly stop (``request_stop``, a signal with ``signals=True``, ``duration_s``): the sources stop reading, the sink
  deals with everything read, the thread ends; bounded by ``shutdown_timeout_s``, then the IO thread is aborted and
  what the sink held or never took is counted (a sink that swallows the cancellation is given up after a grace:
  ``cancel_bounded``). A second SIGINT aborts at once; SIGUSR1 logs a status line.
- ``/metrics`` serves the sink's books by its name (``sink_families``) or ``render_metrics``' families (the relay's).
- ``run()`` returns the final ``view()`` once the thread has ended, or raises what ended it; after a ``FeedFatal``
  the thread is ended the stop's way first.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from forkless.controller.codec import JsonCodec
from forkless.controller.config import Config
from forkless.controller.ioside import feed_plan, feed_sources
from forkless.controller.lifetime.host import StopSignals
from forkless.controller.lifetime.lifecycle import ABORT_JOIN_S, end_io
from forkless.controller.lifetime.serving import serve
from forkless.controller.queues import POLL_S, StopDeadline
from forkless.io_loop.counters import IOSnapshot, IOStats
from forkless.io_loop.errors import FeedFatal, ForklessError
from forkless.io_loop.gil import log_gil
from forkless.io_loop.sinks.sink import RecordSink, SinkRunner, SinkStats
from forkless.io_loop.thread import IOThread

__all__ = ["SinkRun", "SinkView", "sink_status_line"]

log = logging.getLogger("forkless.sink")


@dataclass(frozen=True)
class SinkView:
    """A source → sink run at one moment: the IO side's figures and the sink's books, with the
    names the health endpoints read (io_loop/net/http.py: ready while the required feeds are connected)."""

    io: IOSnapshot
    sink: SinkStats
    at: float = 0.0  # time.monotonic() when taken

    compiled = True  # nothing to compile: ready means connected

    connected = property(lambda self: self.io.connected)
    feeds = property(lambda self: self.io.feeds)
    connects = property(lambda self: self.io.connects)
    connect_failures = property(lambda self: self.io.connect_failures)
    connection_since = property(lambda self: self.io.state_since)
    last_error = property(lambda self: self.io.last_error)
    loop_lag = property(lambda self: self.io.loop_lag)


def sink_status_line(now: Any, before: Any, *, final: bool = False) -> str:
    """One line: messages read, items written by the sink (a second), held, dropped."""
    s, p = now.sink, before.sink
    rate = (s.written - p.written) / max(1e-9, now.at - before.at)
    head = "sink final:" if final else "sink:"
    return (f"{head} read {now.io.messages_in} written {s.written} ({rate:.0f}/s) held {s.held} "
            f"dropped {sum(s.dropped.values())}")


def _sink_exposition(view: Callable[[], Any], name: str) -> Any:
    """``/metrics`` of a run of a program's own sink: its books (controller/metrics.py ``sink_families``)."""
    from forkless.controller.metrics import exposition, sink_families  # only when served: prometheus_client is 10 MiB

    return exposition(view, families=lambda now: sink_families(((name, now.sink),)))


class SinkRun:
    """A source → sink run (see the module rules). ``sink``: a ``forkless.RecordSink``; ``config``: the
    feeds, the stop's timeout, the duration and status interval (default ``Config.from_env()``'s
    feeds are not read: ``Config()``); ``sources``: a program's own sources by feed name (as
    ``Controller(sources=)`` takes them: beside the configured feeds, or instead of the demo feed);
    ``signals``: SIGINT/SIGTERM/SIGHUP stop it while ``run()`` runs, SIGUSR1 logs its status; ``out``: where
    the status lines go."""

    def __init__(self, sink: RecordSink, *, config: Config | None = None, sources: Sequence[Any] = (),
                 codec: Any = None, signals: bool = False, out: Callable[[str], None] | None = None,
                 view: Callable[[SinkRun], Any] | None = None,
                 status_line: Callable[..., str] = sink_status_line,
                 render_metrics: Callable[[Callable[[], Any]], Any] | None = None,
                 io_settings: Any = None) -> None:
        self.config = config = config if config is not None else Config()
        settings = io_settings if io_settings is not None else config.io_settings()
        if sources:  # beside the configured feeds, or instead of the demo feed: the controller's one plan
            plan = feed_plan(config, sources)
            settings = dataclasses.replace(settings, feed_specs=plan.specs, uses_demo_feed=plan.uses_demo_feed)
            built = feed_sources(settings, sources=plan.sources)
        else:
            built = feed_sources(settings)
        self.io_stats = IOStats()
        self.sink_stats = SinkStats()
        self.runner = SinkRunner(sink, [spec.name for spec in settings.feed_specs], self.sink_stats)
        self.uses_demo_feed = settings.uses_demo_feed
        if codec is None:  # x as the feed wrote it: decoded in float64
            codec = JsonCodec(config.step.features, max_frame_items=config.limits.max_frame_items, dtype=np.float64)
        self._view = view
        self.status_line = status_line
        render = None
        if config.run.metrics_addr:  # the relay's families, else the sink's books (prometheus_client only when served)
            render = render_metrics(self.view) if render_metrics is not None else _sink_exposition(self.view, sink.name)
        self.io = IOThread(settings, codec, self.io_stats, stats_snapshot=self.view, render_metrics=render,
                           sources=built, sink=self.runner)
        self.signals = signals
        self.aborted = False  # a second SIGINT aborted the run
        self._print = out if out is not None else (lambda line: print(line, flush=True))
        self._stop = threading.Event()
        self.deadline = StopDeadline(config.timeouts.shutdown_timeout_s)
        self._reported: Any = None  # the view at the run's start or the last SIGUSR1

    def view(self) -> Any:
        """The run's figures now (any thread): a ``SinkView``, or the relay's own view of them."""
        if self._view is not None:
            return self._view(self)
        sink = self.sink_stats.snapshot()  # first: what the sink took was read before (controller/stats.py's books)
        return SinkView(self.io.snapshot(), sink, time.monotonic())

    def request_stop(self) -> None:
        """Begin the orderly stop (any thread); ``run()`` then ends the thread."""
        self.deadline.fix()
        self._stop.set()

    def _on_signal(self, signum: int) -> None:
        if signum == getattr(signal, "SIGUSR1", None):  # the main thread only waits here: the line is made at once
            now = self.view()
            log.info("SIGUSR1: %s", self.status_line(now, self._reported or now))
            self._reported = now
            return
        if signum == signal.SIGINT and self._stop.is_set():
            log.warning("second interrupt: aborting (what the sink held is counted as unwritten)")
            self.aborted = True
            self.io.abort()
            return
        self.request_stop()
        log.info("%s received: stopping (reading stopped, the sink deals with what was read)",
                 signal.Signals(signum).name)

    def run(self) -> Any:
        """Start, serve until the stop (``request_stop``, a signal, ``duration_s``, the thread's end),
        end the thread; the final view (see the module rules)."""
        handlers = StopSignals(self._on_signal) if self.signals else None
        if handlers is not None:
            handlers.install()
        try:
            return self._run()
        finally:
            if handlers is not None:
                handlers.restore()

    def _run(self) -> Any:
        cfg, io = self.config, self.io
        try:
            log_gil(log)  # with every extension the run needs loaded: any that turned the GIL on is named
            io.start()
            self._reported = self.view()
            if self.uses_demo_feed:
                log.info("the embedded demo feed runs (FORKLESS_WS_URL and FORKLESS_FEEDS are unset)")
            first = serve(self._wait, self.view, self._print, self._stop, duration_s=cfg.run.duration_s,
                          status_s=cfg.run.status_s, poll_s=POLL_S, line=self.status_line)
            io.raise_if_failed()
            self.request_stop()
            self.end_thread()
            io.raise_if_failed()
        except ForklessError as exc:
            if isinstance(exc, FeedFatal):  # the feeds gave up while the thread runs: the sink deals with what was read
                self.end_thread()
            raise
        final = self.view()
        if cfg.run.status_s > 0:
            self._print(self.status_line(final, first, final=True))
        return final

    def _wait(self, timeout: float) -> int:
        """``serve``'s wait between its checks: a stop requested, or the thread ended (its failure)."""
        if not self.io.alive:
            self._stop.set()
        else:
            self._stop.wait(timeout)
        return 0

    def end_thread(self) -> None:
        """Stop the IO thread in order; abort it if it has not ended by the stop's deadline."""
        io = self.io
        if not io.alive:
            io.join(ABORT_JOIN_S)
            return
        self.deadline.fix()
        io.request_stop(self.deadline.work)
        end_io(io, self.deadline, self.config.timeouts.shutdown_timeout_s)
