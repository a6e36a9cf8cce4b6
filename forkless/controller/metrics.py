"""Prometheus metrics drawn from snapshots: one collector, one registry per controller (or relay).

Rules:
- Nothing here counts anything. Each scrape takes one snapshot and turns it into metric families, so
  ``/metrics``, ``stats()`` and the status line never disagree. The relay's ``/metrics`` is the same collector
  with its own families.
- Every controller gets its own ``CollectorRegistry``; the global default registry is never touched.
- Histograms come from the snapshot's fixed buckets; seconds histograms expose every ``SECONDS_STEP``-th bound,
  and counts there are exact because the snapshot's buckets nest inside them.
- Label values stay bounded: at most ``MAX_REASONS`` reasons per counter (per sink for a sink's), the rarest
  beyond summed under ``reason="other"``; totals stay exact.
- Counters start at 0 in each process and only grow: a restored checkpoint's counts are gauges of their own
  (``forkless_restored_*``), never added to a counter (it would read as a reset).
- A labelled series exists from the start, at 0, for every label value known then (each feed, sink, declared
  counter and ``KNOWN_REASONS``): ``rate()`` over a series born at its first event misses that event.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import math
import platform
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from forkless import __version__
from forkless.controller.stats import PHASES, SourceFigures, StatsSnapshot
from forkless.io_loop.connectors.jetstream.figures import JETSTREAM_FAMILIES
from forkless.io_loop.counters import LAG_INTERVAL_S, SECONDS_BOUNDS, FeedSnapshot, HistogramSnapshot, IOSnapshot
from forkless.io_loop.crossing import HOPS, SAMPLE_EVERY

__all__ = ["KNOWN_REASONS", "MAX_REASONS", "SECONDS_STEP", "SnapshotCollector", "build_family", "build_info",
           "by_reason_family", "exposition", "gil_family", "histogram_family", "make_registry", "metric_families",
           "metrics_table_markdown", "render", "sink_families"]

log = logging.getLogger("forkless.metrics")

SECONDS_STEP = 5  # expose every 5th of the snapshot's ten-per-decade bounds
MAX_REASONS = 32

# The reasons forkless itself counts, by family (those of bad input are the input's own): exposed at 0 from the start.
# Written out here because they are counted in modules this pure one may not import;
# tests/controller/test_metrics_counters.py holds each to a reason counted in the code.
KNOWN_REASONS: dict[str, tuple[str, ...]] = {
    "forkless_dropped": ("not processed before the stop", "unsent at stop", "outbound full at stop", "IO side ended",
                         "inbound overflow (drop_oldest)", "feed given up", "lease lost"),
    "forkless_errors": ("not JSON", "too many streams", "non-finite result", "processing failed", "encode failed",
                        "frame too large"),
    "forkless_state_resets": ("stream reset: non-finite", "state lost with a failed step"),
    "forkless_sink_dropped": ("unwritten at the stop",),  # per sink
}


def metric_families(snap: StatsSnapshot) -> list[Metric]:
    """Every ``forkless_*`` metric family for one snapshot (pure; see the module rules)."""
    feeds = _feed_rows(snap)
    return [*_message_families(snap, feeds), *_book_families(snap), *_restored_families(snap),
            *_connection_families(snap, feeds), *_latency_families(snap, feeds), *_process_families(snap),
            *sink_families(snap.sinks),
            CounterMetricFamily("forkless_sink_results_unsent", "Results for the controller's sinks whose batch never "
                                "reached the IO thread (outbound still full at the stop's deadline).",
                                value=snap.sink_results_unsent)]


def _message_families(snap: StatsSnapshot, feeds: list[_FeedRow]) -> list[Metric]:
    """Messages, frames, events and sent frames per feed; what a source counted itself."""
    fams: list[Metric] = []
    messages = CounterMetricFamily("forkless_messages", "Messages received from the feed (in) and result "
                                   "frames sent back (out).", labels=["direction", "feed"])
    for f in feeds:
        messages.add_metric(["in", f.name], f.messages_in)
        messages.add_metric(["out", f.name], f.results_out)
    fams.append(messages)
    fams.append(_per_feed(CounterMetricFamily, "forkless_frames_received", "WebSocket frames received from the feed.",
                          feeds, "frames_in"))
    fams.append(_per_feed(CounterMetricFamily, "forkless_error_replies", "Error frames sent back to the feed.",
                          feeds, "errors_out"))
    fams.append(_per_feed(CounterMetricFamily, "forkless_events", "Objects a source of your own handed to the "
                          "main thread as they are (ctx.emit_event).", feeds, "events_in"))
    fams.append(_per_feed(CounterMetricFamily, "forkless_sent_frames", "Frames the main thread sent the feed on its "
                          "own (Controller.send), written.", feeds, "sent_out"))
    failed = CounterMetricFamily("forkless_sent_failed", "Frames the main thread sent the feed (Controller.send) that "
                                 "were given up, never written, by reason: deadline (max_age_s), disconnected "
                                 "(refused while not connected), hold_s, write failed, gave up, or a source's own.",
                                 labels=["feed", "reason"])
    for feed in snap.feeds:
        for reason, count in _bounded(feed.io.sent_failed).items():
            failed.add_metric([feed.name, reason], count)
    fams.append(failed)
    counted = CounterMetricFamily("forkless_source_counts", "What a source of your own counted itself (ctx.count: "
                                  "heartbeats answered, say), by what.", labels=["feed", "what"])
    for feed in snap.feeds:
        for what, count in sorted(feed.io.counts.items())[:MAX_REASONS]:
            counted.add_metric([feed.name, what], count)
    fams.append(counted)
    return fams


def _book_families(snap: StatsSnapshot) -> list[Metric]:
    """The books: processed, unanswered, streams, resets, declined, the declared counters, errors, drops."""
    fams: list[Metric] = []
    fams.append(CounterMetricFamily("forkless_processed", "Messages run through the step in this process "
                                    "(before it, as a restored checkpoint counted them: forkless_restored_processed).",
                                    value=snap.processed))
    fams.append(CounterMetricFamily("forkless_batches", "Batches run through the step in this process.",
                                    value=snap.batches))
    fams.append(CounterMetricFamily("forkless_answer_error_replies", "Error frames sent that answer a received "
                                    "message (part of forkless_error_replies).", value=snap.answer_errors_out))
    fams.append(GaugeMetricFamily("forkless_in_flight", "Received messages not yet answered, dropped or declined "
                                  "(the rest of the books).", value=snap.unanswered))
    fams.append(CounterMetricFamily("forkless_written_unconfirmed", "Reply frames written to connections that then "
                                    "ended abnormally: they may not have arrived.", value=snap.written_unconfirmed))
    fams.append(GaugeMetricFamily("forkless_streams_active", "Streams holding a state slot.",
                                  value=snap.streams_active))
    fams.append(CounterMetricFamily("forkless_streams_evicted", "Idle streams whose slot was given to a new stream "
                                    "(FORKLESS_STREAM_IDLE_S).", value=snap.streams_evicted))
    fams.append(by_reason_family("forkless_state_resets", "Streams (or the whole state) reset, by reason.",
                                 snap.resets, KNOWN_REASONS["forkless_state_resets"]))
    fams.append(CounterMetricFamily("forkless_no_reply", "Received messages answered with no frame: the codec "
                                    "returned None, or the reply was declined (forkless_replies_declined).",
                                    value=snap.no_reply))
    fams.append(by_reason_family("forkless_replies_declined", "Replies not sent, by reason (the error's, or "
                                 "\"result\"): the feed's reply policy (FORKLESS_REPLIES, a feed's \"replies\") or "
                                 "the codec's encode_error returning None declined them.", snap.replies_declined))
    # the processor's declared counters: the default detector's "anomalies" keeps a family of its own
    if "anomalies" in snap.counters:
        fams.append(CounterMetricFamily("forkless_anomalies", "Messages the default detector flagged as anomalies "
                                        "in this process (its declared counter \"anomalies\").", value=snap.anomalies))
    declared = CounterMetricFamily("forkless_processor_counts", "The processor's declared counters "
                                   "(Description(counters=...)) in this process: each a bool or int output summed over "
                                   "the messages answered with results, by counter name; the default detector's is "
                                   "forkless_anomalies.", labels=["name"])
    for name, value in snap.counters.items():
        if name != "anomalies":
            declared.add_metric([name], value)
    fams.append(declared)
    fams.append(by_reason_family("forkless_errors", "Messages or frames refused or failed, by reason.", snap.errors,
                                 KNOWN_REASONS["forkless_errors"]))
    fams.append(by_reason_family("forkless_dropped", "Messages or replies dropped, by reason.", snap.dropped,
                                 KNOWN_REASONS["forkless_dropped"]))
    return fams


def _restored_families(snap: StatsSnapshot) -> list[Metric]:
    """What the checkpoint this process restored had counted before it (module rules: gauges, not counters)."""
    fams: list[Metric] = [GaugeMetricFamily(
        "forkless_restored_processed", "Messages run through the step before this process, as the checkpoint it "
        "restored counted them (0: it started fresh); forkless_processed_total counts this process's, and the next "
        "checkpoint records the sum.", value=snap.restored_processed)]
    if "anomalies" in snap.counters:
        fams.append(GaugeMetricFamily("forkless_restored_anomalies", "The default detector's anomalies before this "
                                      "process, as the checkpoint it restored counted them (forkless_anomalies_total: "
                                      "this process's).", value=snap.restored_counters.get("anomalies", 0)))
    declared = GaugeMetricFamily("forkless_restored_processor_counts", "The processor's declared counters before this "
                                 "process, as the checkpoint it restored counted them, by counter name "
                                 "(forkless_processor_counts_total: this process's).", labels=["name"])
    for name in snap.counters:
        if name != "anomalies":
            declared.add_metric([name], snap.restored_counters.get(name, 0))
    fams.append(declared)
    return fams


def _connection_families(snap: StatsSnapshot, feeds: list[_FeedRow]) -> list[Metric]:
    """Each feed's connections, its unsent replies, and the queues' depths."""
    fams: list[Metric] = []
    fams.append(_per_feed(CounterMetricFamily, "forkless_connects", "Connections opened to the feed.",
                          feeds, "connects"))
    fams.append(_per_feed(CounterMetricFamily, "forkless_reconnects", "Connections lost and retried.",
                          feeds, "reconnects"))
    fams.append(_per_feed(CounterMetricFamily, "forkless_connect_failures", "Connection attempts that failed.",
                          feeds, "connect_failures"))
    fams.append(_per_feed(GaugeMetricFamily, "forkless_connected", "1 while connected to the feed, else 0.",
                          feeds, "connected"))
    fams.append(_per_feed(GaugeMetricFamily, "forkless_connection_state_since_timestamp_seconds",
                          "Unix time of the last connect or disconnect (0: never).", feeds, "state_since"))
    fams.append(_per_feed(GaugeMetricFamily, "forkless_unsent_replies", "Reply frames taken for the feed and not "
                          "yet written (held across a reconnect, or waiting while its connection is down).",
                          feeds, "unsent"))
    fams.append(_per_feed(GaugeMetricFamily, "forkless_feed_given_up", "1 once the feed has given up (a refused "
                          "handshake or FORKLESS_RECONNECT_TRIES used up), else 0.", feeds, "given_up"))
    depth = GaugeMetricFamily("forkless_queue_depth", "Items waiting: inbound chunks (IO to main), outbound "
                              "batches (main to IO), unsent reply frames held for the next connection.",
                              labels=["queue"])
    depth.add_metric(["inbound"], snap.inbound_depth)
    depth.add_metric(["outbound"], snap.outbound_depth)
    depth.add_metric(["unsent"], snap.unsent)
    fams.append(depth)
    return fams


def _latency_families(snap: StatsSnapshot, feeds: list[_FeedRow]) -> list[Metric]:
    """The latency histograms (end to end, written, hops), batch sizes, loop lag, steps, IO CPU."""
    fams: list[Metric] = []
    latency = HistogramMetricFamily("forkless_latency_seconds", "From a message's frame arriving to its results "
                                    "being handed over (OnResults sinks returned, reply frames made), for every result "
                                    "whatever is sent back.", labels=["feed"])
    for f in feeds:
        latency.add_metric([f.name], _buckets(f.latency, SECONDS_STEP), sum_value=f.latency.total)
    fams.append(latency)
    written = HistogramMetricFamily("forkless_write_latency_seconds", "From a message's frame arriving to its reply "
                                    "frame (result or error) being written to the socket.", labels=["feed"])
    for f in feeds:
        written.add_metric([f.name], _buckets(f.write_latency, SECONDS_STEP), sum_value=f.write_latency.total)
    fams.append(written)
    hops = HistogramMetricFamily("forkless_hop_seconds", f"The latency budget: time a sampled message (one in "
                                 f"{SAMPLE_EVERY}) spent in each hop from its frame being read to its reply "
                                 "being written, or to its results being handed over when no frame is sent "
                                 "(docs/performance.md); hop=\"total\" is the whole way.",
                                 labels=["hop"])
    for hop, hist in snap.hops.items():
        hops.add_metric([hop], _buckets(hist, SECONDS_STEP), sum_value=hist.total)
    fams.append(hops)
    fams.append(histogram_family("forkless_batch_size", "Messages per batch run through the step.",
                           snap.batch_size, 1))
    fams.append(histogram_family("forkless_io_loop_lag_seconds", "How late the IO loop runs what is due, sampled every "
                           f"{LAG_INTERVAL_S * 1000:g} ms: a ready callback's wait for its turn, or the sampling "
                           "timer's lateness, the longer (a block of the loop shows for as long as it lasted).",
                           snap.loop_lag, SECONDS_STEP))
    fams.append(histogram_family("forkless_step_seconds", "Wall time of one compiled step, device to host included.",
                           snap.step_seconds, SECONDS_STEP))
    if not math.isnan(snap.io_cpu_s):  # the IO thread's CPU clock is known (Linux and most Unixes)
        io_cpu = CounterMetricFamily("forkless_io_thread_cpu_seconds", "CPU time of the IO thread, split by whether "
                                     "the main thread was inside a step meanwhile (in_step: the IO side's work that "
                                     "overlapped the steps).", labels=["main_thread"])
        io_cpu.add_metric(["in_step"], snap.step_io_cpu_s)
        io_cpu.add_metric(["outside_step"], max(0.0, snap.io_cpu_s - snap.step_io_cpu_s))
        fams.append(io_cpu)
    return fams


def _process_families(snap: StatsSnapshot) -> list[Metric]:
    """The process: compilations, readiness, devices, checkpoints, the feeds' positions, partitions."""
    fams: list[Metric] = [build_family(), gil_family(snap.gil)]
    fams.append(CounterMetricFamily("forkless_compilations", "XLA compilations in this process (flat after ready).",
                                    value=snap.compilations))
    fams.append(GaugeMetricFamily("forkless_ready", "1 when connected and the step is compiled, else 0.",
                                  value=int(snap.ready)))
    fams.append(_phase_family(snap))
    devices = InfoMetricFamily("forkless_device", "The JAX devices in use.", labels=["device"])
    for device in snap.devices:
        devices.add_metric([device], {})
    fams.append(devices)
    fams.extend(_device_families(snap))
    fams.extend(_checkpoint_families(snap))
    fams.extend(_feed_figure_families(snap))
    fams.append(GaugeMetricFamily("forkless_partitions_unowned", "A partitioned instance: its stream's partitions "
                                  "with no live lease for longer than FORKLESS_LEASE_S (no instance owns them: their "
                                  "messages go unanswered).", value=snap.partitions_unowned))
    fams.append(CounterMetricFamily("forkless_lease_losses", "A partitioned instance: times it found the leases of "
                                    "its own partitions lost (0 from the start, then 1: it drops what it holds and "
                                    "exits 3, serving these books until a scrape reads them).",
                                    value=snap.lease_losses))
    return fams



def _phase_family(snap: StatsSnapshot) -> Metric:
    """The run's phase, one series per phase (0 but the one it is in), served from the first second."""
    phase = GaugeMetricFamily("forkless_phase", "The run's phase: 1 for the one it is in, 0 for the others "
                              "(starting, restoring and compiling before the first connection; waiting_for_leases "
                              "a partitioned instance; running; stopping).", labels=["phase"])
    for name in PHASES:
        phase.add_metric([name], int(name == snap.phase))
    return phase


def _feed_figure_families(snap: StatsSnapshot) -> list[Metric]:
    """Each replayable feed's position figures, in the families its connector room declares (a JetStream feed's:
    io_loop/connectors/jetstream/figures.py); no samples without one."""
    fams: list[Metric] = []
    for declared in JETSTREAM_FAMILIES:
        fam = (CounterMetricFamily if declared.type == "counter" else GaugeMetricFamily)(declared.name, declared.help,
                                                                                          labels=["feed"])
        for src in snap.sources:
            fam.add_metric([src.name], getattr(src, declared.attribute))
        fams.append(fam)
    return fams


def _device_families(snap: StatsSnapshot) -> list[Metric]:
    """How the work spreads over the devices (FORKLESS_DEVICES)."""
    count = GaugeMetricFamily("forkless_devices", "JAX devices the stream table is sharded over.",
                              value=len(snap.devices))
    messages = CounterMetricFamily("forkless_device_messages", "Messages run on each device (the device owning "
                                   "their stream).", labels=["device"])
    for device, ran in zip(snap.devices, snap.device_messages):
        messages.add_metric([device], ran)
    rows = CounterMetricFamily("forkless_device_batch_rows", "Rows of the per-device batches run, padding included "
                               "(devices x the bucket of the busiest device, per step); the batch fill is the sum of "
                               "forkless_device_messages_total over this.", value=snap.device_rows)
    return [count, messages, rows]


def _checkpoint_families(snap: StatsSnapshot) -> list[Metric]:
    """The checkpoint writer's figures (all 0 while ``FORKLESS_CHECKPOINT_DIR`` is unset)."""
    return [
        GaugeMetricFamily("forkless_checkpoint_last_success_timestamp_seconds",
                          "Unix time the state in the newest written checkpoint was taken (0: none yet).",
                          value=snap.checkpoint_last_at),
        GaugeMetricFamily("forkless_checkpoint_duration_seconds",
                          "How long writing the newest checkpoint took, off the main thread.",
                          value=snap.checkpoint_duration_s),
        GaugeMetricFamily("forkless_checkpoint_bytes", "Size of the newest written checkpoint.",
                          value=snap.checkpoint_bytes),
        CounterMetricFamily("forkless_checkpoint_failures", "Checkpoints that could not be written.",
                            value=snap.checkpoint_failures),
        CounterMetricFamily("forkless_checkpoint_skipped",
                            "Checkpoints not taken because the previous one was still being written.",
                            value=snap.checkpoint_skipped),
    ]


def sink_families(sinks: Iterable[tuple[str, Any]]) -> list[Metric]:
    """Each sink's books (io_loop/sinks/sink.py ``SinkStats``: taken, written, dropped, held, unwritten,
    batches), labelled by its name: a controller's sinks of results
    (``StatsSnapshot.sinks``) or a ``SinkRun``'s one (controller/lifetime/sinkrun.py); no samples without."""
    sinks = list(sinks)
    rows = [
        (CounterMetricFamily, "forkless_sink_taken", "Items a sink took (results, messages or events): written + "
         "dropped + held.", "taken"),
        (CounterMetricFamily, "forkless_sink_written", "Items a sink said it wrote (batch.wrote).", "written"),
        (GaugeMetricFamily, "forkless_sink_held", "Items a sink took and has neither written nor dropped yet.",
         "held"),
        (CounterMetricFamily, "forkless_sink_unwritten", "Items a sink still held when it returned or was "
         "cancelled at the stop (also in forkless_sink_dropped, reason \"unwritten at the stop\").", "unwritten"),
        (CounterMetricFamily, "forkless_sink_batches", "Batches a sink took.", "batches"),
    ]
    fams: list[Metric] = []
    for kind, name, doc, attr in rows:
        fam = kind(name, doc, labels=["sink"])
        for sink, books in sinks:
            fam.add_metric([sink], getattr(books, attr))
        fams.append(fam)
    dropped = CounterMetricFamily("forkless_sink_dropped", "Items a sink gave up (batch.drop), by reason.",
                                  labels=["sink", "reason"])
    for sink, books in sinks:
        for reason, count in _bounded(books.dropped, KNOWN_REASONS["forkless_sink_dropped"]).items():
            dropped.add_metric([sink, reason], count)
    fams.append(dropped)
    return fams


def by_reason_family(name: str, doc: str, counts: Mapping[str, int], known: Iterable[str] = ()) -> CounterMetricFamily:
    """A counter labelled by ``reason``: at most ``MAX_REASONS`` of them, the rarest beyond summed as "other";
    each ``known`` reason there from the start, at 0 (while fewer than ``MAX_REASONS`` reasons were counted)."""
    fam = CounterMetricFamily(name, doc, labels=["reason"])
    for reason, count in _bounded(counts, known).items():
        fam.add_metric([reason], count)
    return fam


def _bounded(counts: Mapping[str, int], known: Iterable[str] = ()) -> dict[str, int]:
    """``counts`` (with each ``known`` reason at 0 where not counted) with at most ``MAX_REASONS`` reasons, the
    rarest beyond summed as "other"; sorted by reason."""
    counts = {**dict.fromkeys(known, 0), **counts}
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    kept = dict(ranked[:MAX_REASONS])
    other = sum(count for _, count in ranked[MAX_REASONS:])
    if other:
        kept["other"] = kept.get("other", 0) + other
    return {reason: kept[reason] for reason in sorted(kept)}


@dataclass(frozen=True)
class _FeedRow:
    """One feed's per-connection figures, as the labelled families need them."""

    name: str
    frames_in: int
    messages_in: int
    results_out: int
    errors_out: int
    connects: int
    reconnects: int
    connect_failures: int
    connected: int
    state_since: float
    unsent: int
    given_up: int
    latency: HistogramSnapshot  # to the results handed over (the main thread's, per feed)
    write_latency: HistogramSnapshot  # to the reply frame written (the feed's own)
    events_in: int = 0  # a user source's events handed over
    sent_out: int = 0  # Controller.send frames written


def _feed_rows(snap: StatsSnapshot) -> list[_FeedRow]:
    """Per feed (``snap.feeds``); a snapshot without them (a fake IO side) is one feed named ``0``."""
    if not snap.feeds:
        return [_FeedRow("0", snap.frames_in, snap.messages_in, snap.messages_out, snap.errors_out, snap.connects,
                         snap.reconnects, snap.connect_failures, int(snap.connected), snap.connection_since,
                         snap.unsent, 0, snap.latency, snap.write_latency)]
    latency = snap.feed_latency
    if len(latency) != len(snap.feeds):  # a snapshot made without it: the total on the first feed, sums kept
        empty = snap.latency - snap.latency
        latency = (snap.latency, *(empty,) * (len(snap.feeds) - 1))
    return [_FeedRow(f.name, f.io.frames_in, f.io.messages_in, f.io.results_out, f.io.errors_out, f.io.connects,
                     f.io.reconnects, f.io.connect_failures, int(f.io.connected), f.io.state_since, f.io.unsent,
                     int(bool(f.given_up)), lat, f.io.write_latency, f.io.events_in, f.io.sent_out)
            for f, lat in zip(snap.feeds, latency)]


@functools.cache
def build_info() -> dict[str, str]:
    """What this process runs: forkless's version, Python's, and the installed JAX's and jaxlib's (read from
    their package metadata, so nothing imports JAX; "" where not installed: the relay needs none)."""
    def installed(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return ""

    return {"version": __version__, "python": platform.python_version(), "jax": installed("jax"),
            "jaxlib": installed("jaxlib")}


def build_family() -> Metric:
    """``forkless_build_info``: always 1, its labels saying what runs (``build_info``); the program's and the
    relay's alike."""
    info = build_info()
    family = InfoMetricFamily("forkless_build", "What this process runs: forkless's version, Python's, JAX's and "
                              "jaxlib's (value 1).", labels=list(info))
    family.add_metric(list(info.values()), {})
    return family


def gil_family(status: str) -> Metric:
    """``forkless_gil_enabled``: 1 while this interpreter runs with the GIL, its ``status`` label saying why
    (io_loop/gil.py: ``off``, ``on: the build has a GIL``, ``on: enabled by module 'x'``, …); the program's and
    the relay's alike. No sample when the status is not known."""
    family = GaugeMetricFamily("forkless_gil_enabled", "1 while the interpreter runs with the GIL (a free-threaded "
                               "build runs without it until an extension module that needs it is loaded, or "
                               "PYTHON_GIL=1); status says why: off, on: the build has a GIL, on: enabled by module "
                               "'x', on: PYTHON_GIL=1.", labels=["status"])
    if status:
        family.add_metric([status], int(status.startswith("on")))
    return family


def _per_feed(kind: type, name: str, doc: str, feeds: list[_FeedRow], attr: str) -> Metric:
    fam = kind(name, doc, labels=["feed"])
    for f in feeds:
        fam.add_metric([f.name], getattr(f, attr))
    return fam


def histogram_family(name: str, doc: str, hist: HistogramSnapshot, step: int) -> HistogramMetricFamily:
    """Cumulative buckets at every ``step``-th bound of the snapshot, then ``+Inf``."""
    return HistogramMetricFamily(name, doc, buckets=_buckets(hist, step), sum_value=hist.total)


def _buckets(hist: HistogramSnapshot, step: int) -> list[tuple[str, float]]:
    """Cumulative buckets at every ``step``-th bound of the snapshot, then ``+Inf``."""
    cumulative = hist.cumulative()  # ends with (inf, total count)
    finite = cumulative[:-1]
    # bounds 0, step, 2*step, …: for seconds that is decades and half-decades
    picked = finite[::step]
    if finite and picked[-1] != finite[-1]:
        picked.append(finite[-1])  # always expose the last finite bound
    buckets: list[tuple[str, float]] = [(floatToGoString(bound), count) for bound, count in picked]
    buckets.append(("+Inf", cumulative[-1][1]))
    return buckets


Families = Callable[[Any], Iterable[Metric]]  # a snapshot's metric families: metric_families, the relay's


class SnapshotCollector(Collector):
    """Calls ``snapshot()`` once per scrape and yields ``families`` of the result (``metric_families``
    by default; the relay's ``relay_metric_families`` of its view).

    ``snapshot`` may return None (nothing to report yet); then no ``forkless_*`` family is
    yielded. It is called from the scraping thread (the IO thread for ``MetricsServer``).
    """

    def __init__(self, snapshot: Callable[[], Any], families: Families = metric_families) -> None:
        self.snapshot = snapshot
        self.families = families

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()  # copying counters another thread writes: see io_loop/counters.py copy_counts
        if snap is not None:
            yield from self.families(snap)


def make_registry(snapshot: Callable[[], Any], *, families: Families = metric_families,
                  process: bool = True) -> CollectorRegistry:
    """A fresh registry with the snapshot collector (and the standard ``process_*`` metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot, families))
    if process:
        ProcessCollector(registry=registry)
    return registry


def render(registry: Any) -> bytes:
    """The Prometheus text exposition of ``registry`` (``prometheus_client.generate_latest``)."""
    return generate_latest(registry)


def exposition(snapshot: Callable[[], Any], *, families: Families = metric_families,
               process: bool = True) -> Callable[[], tuple[bytes, str]]:
    """What the IO side's metrics server (io_loop/net/http.py) is handed to answer ``/metrics``:
    a callable returning the text exposition of a fresh registry (``make_registry``), drawn
    from one ``snapshot()`` per call (``families`` of it), and its content type."""
    registry = make_registry(snapshot, families=families, process=process)
    return lambda: (render(registry), CONTENT_TYPE_LATEST)


# ---- the documentation's table of metrics -----------------------------------------------------

_VARIES = "\x00varies"  # a label value that comes from the run (a reason, a device), not the code


def _every_field_populated() -> StatsSnapshot:
    """A snapshot with every field set, so that every family and label shows up."""
    seconds = HistogramSnapshot(SECONDS_BOUNDS, (1,) * (len(SECONDS_BOUNDS) + 1), 1.0, len(SECONDS_BOUNDS) + 1)
    sizes = HistogramSnapshot((1.0, 4.0), (1, 1, 1), 9.0, 3)
    return StatsSnapshot(
        at=1.0, messages_in=1, frames_in=1, messages_out=1, errors_out=1, processed=1, batches=1,
        errors={_VARIES: 1}, dropped={_VARIES: 1}, connects=1, reconnects=1, connect_failures=1, connected=True,
        connection_since=1.0, inbound_depth=1, outbound_depth=1, unsent=1, batch_size=sizes, latency=seconds,
        write_latency=seconds, feed_latency=(seconds,), replies_declined={_VARIES: 1},
        loop_lag=seconds, step_seconds=seconds, compilations=1, compilations_after_warmup=0, devices=(_VARIES,),
        ready=True, compiled=True, last_error="x", device_messages=(1,), device_rows=1, io_cpu_s=2.0, step_io_cpu_s=1.0,
        hops=dict.fromkeys((*HOPS, "total"), seconds), sources=(SourceFigures(_VARIES, 1, 1, 1, 1, 2, 1, 1),),
        feeds=(FeedSnapshot(_VARIES, True, "x", IOSnapshot(
            frames_in=1, messages_in=1, results_out=1, errors_out=1, answer_errors_out=1, error_replies_unsent=1,
            written_unconfirmed=1, errors={}, dropped={}, connects=1, reconnects=1, connect_failures=1,
            connected=True, state_since=1.0, last_error="x", write_latency=seconds, loop_lag=seconds, inbound_depth=0,
            outbound_depth=0, unsent=1, events_in=1, sent_out=1, counts={_VARIES: 1}, sent_failed={_VARIES: 1})),),
        counters={"anomalies": 1, _VARIES: 1}, restored_processed=1, restored_counters={"anomalies": 1, _VARIES: 1},
        sinks=((_VARIES, SimpleNamespace(taken=2, written=1, dropped={_VARIES: 1}, held=0, unwritten=1, batches=1)),),
        gil=_VARIES,
    )


def _exposed_name(fam: Metric) -> str:
    """The name a family has in ``/metrics`` (counters end in ``_total``, info in ``_info``)."""
    return fam.name + {"counter": "_total", "info": "_info"}.get(fam.type, "")


def _labels_cell(fam: Metric) -> str:
    values: dict[str, list[str]] = {}
    for sample in fam.samples:
        for label, value in sample.labels.items():
            seen = values.setdefault(label, [])
            if value not in seen:
                seen.append(value)
    cells = []
    for label, seen in values.items():
        if label == "le" or _VARIES in seen or fam.name == "forkless_build":  # build labels: the process's
            cells.append(label)
        else:
            cells.append(f"{label}=" + "\\|".join(f"`{v}`" for v in seen))
    return ", ".join(cells) or "—"


def metrics_table_markdown() -> str:
    """The Markdown table of every ``forkless_*`` metric: name, type, labels, help.

    Drawn from ``metric_families`` itself (docs/metrics.md holds it between
    ``<!-- metrics:start/end -->``; ``gendocs.py`` writes it, ``tests/docs/test_docs.py`` checks it).
    """
    lines = ["| metric | type | labels | help |", "|---|---|---|---|"]
    for fam in metric_families(_every_field_populated()):
        kind = "gauge (info, value 1)" if fam.type == "info" else fam.type  # info is exposed as a gauge
        doc = fam.documentation.replace("|", "\\|")
        lines.append(f"| `{_exposed_name(fam)}` | {kind} | {_labels_cell(fam)} | {doc} |")
    return "\n".join(lines) + "\n"
