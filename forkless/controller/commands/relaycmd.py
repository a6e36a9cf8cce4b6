"""``forkless relay`` (and ``python app.py relay``): the WebSocket feeds into a JetStream stream.

    forkless relay           read FORKLESS_FEEDS / FORKLESS_WS_URL, publish every message to
                             <FORKLESS_RELAY_SUBJECT>.<escaped stream> on FORKLESS_RELAY_NATS
    forkless relay --help    the variables it reads

Rules:
- No JAX in this process: nothing it imports imports JAX, the processors, the engine or the loop (a test checks
  ``sys.modules``). The codec is ``JsonCodec`` in float64: the payload carries the numbers as the feed wrote them.
- A source → sink run (``SinkRun``): the IO thread runs the feeds and the publisher (``relay_sink``), which takes
  the chunks in place of the main thread; this thread waits with the controller's own pieces (signals, serving
  loop, stop deadline). The relay's own: its view (``RelayView``), status and books lines, metrics, exit status.
- Orderly stop (SIGINT/SIGTERM, FORKLESS_DURATION): everything read is published and acknowledged, then exit 0;
  bounded by FORKLESS_SHUTDOWN_TIMEOUT_S, what is not stored by then is counted, logged, and the exit is 3. A
  second SIGINT aborts at once (130).
- Exit statuses as the program's: 2 a configuration the relay cannot use (naming the variable or feed; a feed
  it cannot read is its connector's to say, ``Connector.refuses_relay``), 3 a feed or NATS server unusable or
  messages not stored by the deadline, 1 a crash.
- ``/metrics`` serves ``relay_metric_families`` of one ``RelayView`` per scrape through the controller's collector;
  ``/healthz`` and ``/readyz`` read the same view (ready while every required feed and NATS are connected).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from forkless.controller.commands.edge import early_log_format, load_config, report
from forkless.controller.commands.vardocs import help_text
from forkless.controller.config import Config
from forkless.controller.ioside import feed_plan
from forkless.controller.lifetime.sinkrun import SinkRun
from forkless.controller.logs import flush_log_repeats, program_line, setup_logging
from forkless.controller.metrics import (
    SECONDS_STEP,
    build_family,
    by_reason_family,
    exposition,
    gil_family,
    histogram_family,
)
from forkless.io_loop.counters import FeedSnapshot, HistogramSnapshot, IOSnapshot, IOStats
from forkless.io_loop.errors import EXIT_CONFIG, EXIT_FEED, EXIT_INTERRUPTED, EXIT_OK, ConfigError, ForklessError
from forkless.io_loop.gil import gil_status
from forkless.io_loop.iosettings import IOSettings
from forkless.io_loop.kinds import relay_sink
from forkless.io_loop.relay.relaystats import RelayStats

__all__ = ["RelayView", "relay_main", "relay_metric_families", "relay_metrics_table_markdown", "relay_settings",
           "relay_status_line"]

log = logging.getLogger("forkless.relay")


@dataclass(frozen=True)
class RelayView:
    """The relay at one moment: the IO side's figures and the publisher's (its connector's sink),
    with the names the health endpoints read (io_loop/net/http.py)."""

    io: IOSnapshot
    relay: Any  # io_loop.relay.relaystats.RelaySnapshot
    at: float = 0.0  # time.monotonic() when taken
    gil: str = ""  # whether the interpreter runs with the GIL, and why (io_loop/gil.py; "": not known)

    compiled = True  # nothing to compile: ready means connected

    @property
    def connected(self) -> bool:
        return self.io.connected and self.relay.connected

    @property
    def feeds(self) -> tuple[FeedSnapshot, ...]:
        return self.io.feeds

    @property
    def connects(self) -> int:
        return self.io.connects

    @property
    def connect_failures(self) -> int:
        return self.io.connect_failures

    @property
    def connection_since(self) -> float:
        return self.io.state_since

    @property
    def last_error(self) -> str:
        if not self.relay.connected and self.relay.last_error:
            return f"the NATS server: {self.relay.last_error}"
        return self.io.last_error

    @property
    def loop_lag(self) -> HistogramSnapshot:
        return self.io.loop_lag


# ---- the program ----------------------------------------------------------------------------------


def _parser(prog: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog=f"{prog} relay", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Read the WebSocket feeds (FORKLESS_FEEDS or FORKLESS_WS_URL; the embedded demo feed when "
                    "neither is set) and publish every message to <FORKLESS_RELAY_SUBJECT>.<escaped stream> on "
                    "FORKLESS_RELAY_NATS, each acknowledged by JetStream (docs/relay.md). No JAX.",
        epilog="Environment variables:\n" + help_text())


def relay_main(argv: list[str] | None = None, *, prog: str = "python app.py") -> int:
    """The relay program; returns its exit status."""
    _parser(prog).parse_args(argv)
    try:
        config = load_config()
        io_settings = relay_settings(config)
    except ForklessError as exc:  # a ConfigError
        return report(exc, early_log_format())
    setup_logging(config.run.log_level, config.run.log_format)
    try:
        relay = Relay(config, io_settings, relay_sink, RelayStats())
    except ImportError as exc:  # the sink imports nats-py, an optional extra (pip install ".[nats]")
        program_line(f"the relay needs nats-py: pip install \"forkless[nats]\" ({exc})", fmt=config.run.log_format,
                     exit_status=EXIT_CONFIG)
        return EXIT_CONFIG
    try:
        return relay.run()
    finally:
        flush_log_repeats()


def relay_settings(config: Config) -> IOSettings:
    """What ``forkless relay`` runs with: the IO side's settings, its feeds never sent a reply; ``ConfigError`` naming
    the variable (or the feed) the relay cannot use: FORKLESS_RELAY_NATS or FORKLESS_RELAY_SUBJECT unset, a feed whose
    connector refuses the relay (``refuses_relay``: a JetStream feed), FORKLESS_OVERFLOW=drop_oldest or a feed's own
    (the relay never drops a message)."""
    config.relay.required()
    for index, connector in enumerate(feed_plan(config, check_demo=False).connectors):
        refused = connector.refuses_relay()
        if refused:
            raise ConfigError("FORKLESS_FEEDS", "<hidden>", f"feeds the relay can read: feed {index} "
                              f"({connector.feed.name!r}) is {refused}")
    if config.limits.overflow != "block":
        raise ConfigError("FORKLESS_OVERFLOW", config.limits.overflow, "block for the relay: it never drops a message "
                          "(a full inbound queue stops reading the socket)")
    for index, spec in enumerate(config.feed_specs):
        if spec.overflow not in ("", "block"):
            raise ConfigError("FORKLESS_FEEDS", "<hidden>", f'"overflow" block for the relay: feed {index} '
                              f"({spec.name!r}) has {spec.overflow!r}; the relay never drops a message")
    io = config.io_settings()
    return dataclasses.replace(io, feed_specs=tuple(dataclasses.replace(spec, replies="none")
                                                    for spec in io.feed_specs))


class Relay:
    """The relay program: a source → sink run (controller/lifetime/sinkrun.py ``SinkRun``: the
    controller's signal handling, serving loop and ending of the IO thread) of the feeds into the
    publisher, and the relay's own view, lines, books and exit status (see the module rules)."""

    def __init__(self, config: Config, io_settings: IOSettings, publisher: Callable[..., Any], stats: Any,
                 out: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.relay_stats = stats
        names = [spec.name for spec in io_settings.feed_specs]
        self.publisher = publisher(config.relay, stats, names, timeouts=io_settings.timeouts,
                                   reconnect=io_settings.reconnect, tls=io_settings.tls)
        render = (lambda view: exposition(view, families=relay_metric_families)) if config.run.metrics_addr else None
        self.runtime = SinkRun(self.publisher, config=config, io_settings=io_settings, signals=True, out=out,
                               view=self._view, status_line=relay_status_line, render_metrics=render)

    @property
    def io(self) -> Any:
        return self.runtime.io

    def _view(self, run: SinkRun) -> RelayView:
        relay = self.relay_stats.snapshot()  # first: what the publisher took was read before (controller/stats.py)
        return RelayView(run.io.snapshot(), relay, time.monotonic(), str(gil_status()))

    def view(self) -> RelayView:
        """The relay's figures now (any thread)."""
        return self.runtime.view()

    def request_stop(self) -> None:
        self.runtime.request_stop()

    def run(self) -> int:
        cfg = self.config
        try:
            final = self.runtime.run()
        except ForklessError as exc:  # FeedFatal, MetricsServerError, IOThreadError
            return report(exc, cfg.run.log_format)
        books = relay_books_line(final)
        unstored = final.relay.unpublished
        log.log(logging.ERROR if unstored else logging.INFO, "%s", books)
        if self.runtime.aborted:
            return EXIT_INTERRUPTED
        if unstored:
            program_line(f"{unstored} messages read from the feeds were not stored by FORKLESS_RELAY_NATS before "
                         f"the stop's deadline (FORKLESS_SHUTDOWN_TIMEOUT_S={cfg.timeouts.shutdown_timeout_s:g})",
                         fmt=cfg.run.log_format, label="relay", exit_status=EXIT_FEED)
            return EXIT_FEED
        return EXIT_OK


# ---- the status line and the books ------------------------------------------------------------------


def relay_status_line(now: RelayView, before: RelayView, *, final: bool = False) -> str:
    """One line: messages read, stored, held, retried, gaps; the feeds' and the server's state."""
    r, p, io = now.relay, before.relay, now.io
    seconds = max(1e-9, now.at - before.at)
    rate = (r.acked - p.acked) / seconds
    feeds = io.feeds or ()
    up = sum(f.up for f in feeds)
    gaps = sum(r.gaps.values())
    head = "relay final:" if final else "relay:"
    return (f"{head} read {io.messages_in} stored {r.acked} ({rate:.0f}/s) held {r.held} "
            f"retried {r.retried} duplicates {r.duplicates} gaps {gaps} ({sum(r.missing.values())} missing) "
            f"| feeds up {up}/{len(feeds)} reconnects {io.reconnects} | nats "
            f"{'up' if r.connected else 'down'} reconnects {r.reconnects}")


def relay_books_line(view: RelayView) -> str:
    """Every message read accounted for: stored, held, unpublished, or refused by the codec."""
    r, io = view.relay, view.io
    refused = sum(io.errors.values())
    return (f"relay books: {io.messages_in} messages read = {r.acked} stored + {r.held - r.unpublished} held + "
            f"{r.unpublished} never stored + {io.messages_in - r.taken} not taken from the feeds' hand-over; "
            f"{refused} bad inputs refused; {r.retried} publications retried, {r.duplicates} duplicates dropped by "
            f"the stream; seq gaps {dict(r.gaps) or 0}, missing {dict(r.missing) or 0}, went back "
            f"{dict(r.back) or 0}")


# ---- metrics ---------------------------------------------------------------------------------------


def relay_metric_families(view: RelayView) -> list[Metric]:
    """Every metric family of the relay's ``/metrics`` for one view (pure)."""
    r, io = view.relay, view.io
    fams: list[Metric] = [build_family(), gil_family(view.gil)]
    rows = [
        (CounterMetricFamily, "forkless_relay_taken", "Messages the publisher took from the feeds (each given "
         "its Nats-Msg-Id).", r.taken),
        (CounterMetricFamily, "forkless_relay_published", "Messages published for the first time.", r.published),
        (CounterMetricFamily, "forkless_relay_acked", "Messages JetStream acknowledged (stored, or a duplicate of "
         "one stored).", r.acked),
        (CounterMetricFamily, "forkless_relay_retried", "Publications again after a failure (same id).", r.retried),
        (CounterMetricFamily, "forkless_relay_duplicates", "Acknowledgements saying duplicate: a retried message "
         "the stream had already stored.", r.duplicates),
        (GaugeMetricFamily, "forkless_relay_in_flight", "Messages taken and not yet acknowledged: held "
         "(at most FORKLESS_RELAY_MAX_HELD, plus the last chunk taken).", r.held),
        (CounterMetricFamily, "forkless_relay_unpublished", "Messages taken and never stored (held when the stop's "
         "deadline passed or the relay gave up).", r.unpublished),
        (CounterMetricFamily, "forkless_relay_nats_connects", "Connections opened to the NATS server.", r.connects),
        (CounterMetricFamily, "forkless_relay_nats_reconnects", "Connections to the NATS server lost or dropped "
         "after a failed publication, and retried.", r.reconnects),
        (CounterMetricFamily, "forkless_relay_nats_connect_failures", "Connection attempts to the NATS server that "
         "failed.", r.connect_failures),
        (GaugeMetricFamily, "forkless_relay_nats_connected", "1 while connected to the NATS server, else 0.",
         int(r.connected)),
    ]
    for kind, name, doc, value in rows:
        fams.append(kind(name, doc, value=value))
    for name, doc, counts in (
            ("forkless_relay_seq_gaps", "Messages whose seq jumped over missing numbers (FORKLESS_RELAY_SEQ), by "
             "reason.", r.gaps),
            ("forkless_relay_seq_missing", "Seq numbers jumped over, by reason.", r.missing),
            ("forkless_relay_seq_back", "Messages whose seq went back or repeated (a feed that restarted its "
             "numbering), by reason.", r.back)):
        fam = CounterMetricFamily(name, doc, labels=["reason"])
        for reason in ("across a reconnect", "within a connection"):
            fam.add_metric([reason], counts.get(reason, 0))
        fams.append(fam)
    return fams + _relay_feed_families(io)


def _relay_feed_families(io: IOSnapshot) -> list[Metric]:
    """The relay's feeds (read, connections), their bad input and drops, and its IO loop's lag."""
    fams: list[Metric] = []
    feeds = io.feeds
    for kind, name, doc, attr in (
            (CounterMetricFamily, "forkless_messages_read", "Messages read from each feed (decoded well).",
             "messages_in"),
            (CounterMetricFamily, "forkless_frames_received", "WebSocket frames received from the feed.",
             "frames_in"),
            (CounterMetricFamily, "forkless_connects", "Connections opened to the feed.", "connects"),
            (CounterMetricFamily, "forkless_reconnects", "Connections lost and retried.", "reconnects"),
            (CounterMetricFamily, "forkless_connect_failures", "Connection attempts that failed.",
             "connect_failures"),
            (GaugeMetricFamily, "forkless_connected", "1 while connected to the feed, else 0.", "connected")):
        fam = kind(name, doc, labels=["feed"])
        for f in feeds:
            fam.add_metric([f.name], int(getattr(f.io, attr)))
        fams.append(fam)
    fams.append(by_reason_family("forkless_errors", "Bad input refused (not published), by reason.", io.errors))
    fams.append(by_reason_family("forkless_dropped", "Messages dropped, by reason.", io.dropped))
    fams.append(histogram_family("forkless_io_loop_lag_seconds", "How late the IO loop runs what is due (a block of "
                                 "the loop shows for as long as it lasted).", io.loop_lag, SECONDS_STEP))
    return fams


def relay_metrics_table_markdown() -> str:
    """The Markdown table of the relay's metrics (docs/relay.md ``relay-metrics``, by gendocs.py)."""
    io = IOStats().snapshot()
    relay = _EmptyRelay()
    lines = ["| metric | type | labels | help |", "|---|---|---|---|"]
    for fam in relay_metric_families(RelayView(io, relay)):
        labels = {"forkless_relay_seq_gaps", "forkless_relay_seq_missing", "forkless_relay_seq_back",
                  "forkless_errors", "forkless_dropped"}
        label = "reason" if fam.name in labels else "feed" if fam.name in _FEED_FAMILIES else \
            "status" if fam.name == "forkless_gil_enabled" else "—"
        if fam.type == "info":  # forkless_build_info: its labels are the process's
            label = ", ".join(fam.samples[0].labels)
        suffix = {"counter": "_total", "info": "_info"}.get(fam.type, "")
        kind = "gauge (info, value 1)" if fam.type == "info" else fam.type
        lines.append(f"| `{fam.name}{suffix}` | {kind} | {label} | {fam.documentation} |")
    return "\n".join(lines) + "\n"


_FEED_FAMILIES = {"forkless_messages_read", "forkless_frames_received", "forkless_connects", "forkless_reconnects",
                  "forkless_connect_failures", "forkless_connected"}


class _EmptyRelay:
    """A publisher's snapshot with nothing counted (for the documentation's table)."""

    taken = published = retried = acked = duplicates = held = unpublished = 0
    connects = reconnects = connect_failures = 0
    connected = False
    state_since = 0.0
    last_error = ""
    gaps: dict[str, int] = {}
    missing: dict[str, int] = {}
    back: dict[str, int] = {}
