"""The main thread's counters, the whole-process snapshot, and the lines drawn from it.

Rules:
- Pure: no threads, no clock (the caller passes times).
- Each counter object has one writer thread: ``MainStats`` the main thread, ``IOStats`` (io_loop/counters.py) the
  IO thread; the other side only reads, through a snapshot, so no lock is taken. A figure both threads count is
  two counters, added when read (Java's ``LongAdder``). A counter dict another thread may add keys to is copied
  only by ``copy_counts``.
- ``whole_snapshot`` (``Controller.stats()``, any thread) reads the books in their order: the main thread's
  counters first, then the IO side's, each feed's messages received last. A message is counted received before
  anything of its answer, so a snapshot never shows more answered than received (``unanswered`` >= 0); it may
  show one received and not yet answered.
- The status line and the Prometheus metrics are both made from snapshots, so the three never disagree.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from forkless.io_loop.counters import (
    SECONDS_BOUNDS,
    FeedSnapshot,
    Histogram,
    HistogramSnapshot,
    IOSnapshot,
    add_hops,
    copy_counts,
    new_hops,
)
from forkless.io_loop.renamed import removed

__all__ = ["PHASES", "MainStats", "SourceFigures", "StatsSnapshot", "books_line", "checkpoint_part", "losses",
           "status_line",
           "whole_snapshot"]

# a run's phases, in order (``MainStats.phase``; /readyz, forkless_phase, docs/metrics.md): "starting" until
# start() has done its work, "restoring" while a checkpoint is read and put on the device, "compiling",
# "waiting_for_leases" (a partitioned instance), "running" once the IO side runs, "stopping", "stopped"
PHASES = ("starting", "restoring", "compiling", "waiting_for_leases", "running", "stopping", "stopped")


@dataclass
class MainStats:
    """Written by the main thread only."""

    phase: str = PHASES[0]  # where the run is (``PHASES``)

    batches: int = 0
    processed: int = 0  # in this process: a counter starts at 0 in each process and only grows
    # the processor's declared counters (controller/declared.py), by name, in declaration order; this process's too
    counters: dict[str, int] = field(default_factory=dict)
    # what the checkpoint this run continued from had counted before (Recovery.restore), kept apart from the
    # counters above: a checkpoint records the sum of both, so its counts go on across restarts
    restored_processed: int = 0
    restored_counters: dict[str, int] = field(default_factory=dict)
    errors: Counter = field(default_factory=Counter)  # by reason (too many streams, processing failed)
    dropped: Counter = field(default_factory=Counter)  # received messages never answered, by reason
    no_reply: int = 0  # received messages answered with no frame (the codec's None, a declined reply)
    replies_declined: Counter = field(default_factory=Counter)  # by reason ("result" for results)
    resets: Counter = field(default_factory=Counter)  # state reset, by reason (see the README)
    batch_size: Histogram = field(default_factory=lambda: Histogram(()))  # for_run gives it the buckets
    step_seconds: Histogram = field(default_factory=lambda: Histogram(SECONDS_BOUNDS))
    # the IO thread's CPU seconds that fell while this thread was inside a step (its CPU clock
    # read before and after each step): the IO side's work that overlapped the steps
    step_io_cpu_s: float = 0.0
    compilations_at_ready: int | None = None
    # receipt -> results handed over (after the OnResults sinks, before the put on outbound), one per feed
    latency: list[Histogram] = field(default_factory=lambda: [Histogram(SECONDS_BOUNDS)])
    # the latency budget of the sampled messages whose batch sent their feed no frame (ends at "assemble")
    hops: dict[str, Histogram] = field(default_factory=new_hops)
    events: int = 0  # a user source's objects handed to on_event (io_loop/source.py)
    events_unhandled: int = 0  # ... that found no on_event (counted, logged once), or came after the stop
    sink_results_unsent: int = 0  # results for the controller's sinks whose batch never reached the IO side (the stop)

    @classmethod
    def for_run(cls, buckets: Sequence[int], feeds: int) -> MainStats:
        """The counters of a run with these bucket sizes and ``feeds`` feeds (a latency histogram each)."""
        return cls(batch_size=Histogram(buckets), latency=[Histogram(SECONDS_BOUNDS) for _ in range(feeds)])

    def snapshot(self) -> MainStats:
        """The counters as they are now, for another thread (``whole_snapshot`` takes it before the IO side's: the
        module rules): every number and by-reason count copied; the histograms are the same objects, each copied
        by its own ``snapshot()`` when read."""
        return dataclasses.replace(
            self, errors=Counter(copy_counts(self.errors)), dropped=Counter(copy_counts(self.dropped)),
            replies_declined=Counter(copy_counts(self.replies_declined)), resets=Counter(copy_counts(self.resets)),
            counters=copy_counts(self.counters), restored_counters=dict(self.restored_counters))


@dataclass(frozen=True)
class SourceFigures:
    """One replayable feed's position figures: what its IO side fetched and had acknowledged, and what the main
    thread applied; its connector room declares their metric families (a JetStream feed's: docs/jetstream.md,
    "Figures")."""

    name: str
    fetched: int  # stream messages fetched (a replay's included)
    applied: int  # messages run through the step in this process
    applied_seq: int  # the last stream sequence whose every element the state holds (0: none)
    confirmed_seq: int  # the stream sequence of the last reply the results stream acknowledged
    stream_last_seq: int  # the stream's last sequence, as last seen
    skipped: int = 0  # deliveries at or below the position, not applied again
    duplicates: int = 0  # replies the results stream dropped as already stored (after a replay)

    @property
    def lag(self) -> int:
        """Stream messages not yet applied: the stream's last sequence minus the last applied."""
        return max(0, self.stream_last_seq - self.applied_seq)


@dataclass(frozen=True)
class StatsSnapshot:
    """Everything ``Controller.stats()`` reports, at one moment."""

    at: float  # monotonic seconds
    messages_in: int
    frames_in: int
    messages_out: int  # result frames sent
    errors_out: int  # error frames sent
    processed: int
    batches: int
    errors: dict[str, int]  # by reason: bad input, too many streams, processing failed
    dropped: dict[str, int]
    connects: int
    reconnects: int
    connect_failures: int
    connected: bool
    connection_since: float
    inbound_depth: int
    outbound_depth: int
    unsent: int
    batch_size: HistogramSnapshot
    latency: HistogramSnapshot  # receipt -> results handed over (OnResults returned), every result
    loop_lag: HistogramSnapshot
    step_seconds: HistogramSnapshot
    compilations: int
    compilations_after_warmup: int | None
    devices: tuple[str, ...]
    ready: bool  # compiled and connected
    compiled: bool = False
    phase: str = "running"  # the run's phase (``PHASES``)
    no_reply: int = 0  # received, answered with no frame: the codec's None, or a declined reply
    replies_declined: dict[str, int] = field(default_factory=dict)  # replies not sent, by reason
    answer_errors_out: int = 0  # error frames sent that answer a received message (in errors_out)
    resets: dict[str, int] = field(default_factory=dict)  # streams (or the whole state) reset, by reason
    streams_active: int = 0  # streams holding a state slot
    streams_evicted: int = 0  # idle streams whose slot went to a new stream (FORKLESS_STREAM_IDLE_S)
    written_unconfirmed: int = 0  # frames written to connections that ended without the closing handshake
    last_error: str = ""  # why the last connection attempt failed or the last connection ended
    feeds: tuple[FeedSnapshot, ...] = ()  # per feed (FORKLESS_FEEDS); the fields above are totals
    hops: dict[str, HistogramSnapshot] = field(default_factory=dict)  # latency budget, per hop (crossing.HOPS)
    extra: dict[str, Any] = field(default_factory=dict)
    # checkpoints (controller/checkpoints/checkpointer.py; all 0 while FORKLESS_CHECKPOINT_DIR is unset)
    checkpoint_last_at: float = 0.0  # Unix time the newest written checkpoint's state was taken (0: none)
    checkpoint_duration_s: float = 0.0  # how long writing it took
    checkpoint_bytes: int = 0  # its size
    checkpoint_failures: int = 0  # checkpoints that could not be written
    checkpoint_skipped: int = 0  # checkpoints not taken: the previous one was still being copied or written
    checkpoints_on: bool = False  # FORKLESS_CHECKPOINT_DIR is set
    checkpoint_age_s: float = math.nan  # seconds since the newest written checkpoint's state was taken (nan: none)
    checkpoint_copy_s: float = 0.0  # the newest copied checkpoint: its start to its hand-over to the writer
    # devices: messages run on each device (the order of ``devices``), and the rows of the
    # per-device batches run (N devices x the bucket Bd per step, padding included)
    device_messages: tuple[int, ...] = ()
    device_rows: int = 0
    # receipt -> reply frame written (results and error frames answering a message), where frames are written
    write_latency: HistogramSnapshot = field(default_factory=lambda: Histogram(SECONDS_BOUNDS).snapshot())
    feed_latency: tuple[HistogramSnapshot, ...] = ()  # ``latency`` per feed (the order of ``feeds``)
    sources: tuple[SourceFigures, ...] = ()  # the JetStream feeds' positions (empty without one)
    # pipelining: the IO thread's CPU seconds so far (NaN: not known on this platform, or no IO
    # thread), and those of them that fell while the main thread was inside a step
    io_cpu_s: float = math.nan
    step_io_cpu_s: float = 0.0
    # the user's own sources (io_loop/source.py): objects handed over as they are, those that reached
    # on_event and those that did not, frames the main thread sent (Controller.send) written and not
    # written, and what the sources counted themselves (ctx.count)
    events_in: int = 0
    events: int = 0
    events_unhandled: int = 0
    sent_out: int = 0
    sent_unsent: int = 0
    sent_failed: dict[str, int] = field(default_factory=dict)  # sends given up, never written, by reason
    counts: dict[str, int] = field(default_factory=dict)
    # the controller's sinks of results (Controller(sinks=...)): each one's name and books (SinkStats)
    sinks: tuple[tuple[str, Any], ...] = ()
    sink_results_unsent: int = 0  # results for the sinks never handed to the IO side (outbound full at the stop)
    # the sources' own buffers (io_loop/spill.py): events given up by reason (an overflow
    # drop_oldest, an aborted stop), and the messages and events waiting in them now
    events_dropped: dict[str, int] = field(default_factory=dict)
    buffered: int = 0
    # replies a source still awaited (its awaiting()) when the stop ended its wait, by why (io_loop/finishing.py)
    awaited_unanswered: dict[str, int] = field(default_factory=dict)
    # a partitioned instance: the stream's partitions with no live lease for longer than a lease
    partitions_unowned: int = 0
    # ... and the times this process found its own partitions' leases lost (0, then 1: it stops, exit 3)
    lease_losses: int = 0
    # the processor's declared counters (Processor.counters; the default detector's "anomalies"), in this process
    counters: dict[str, int] = field(default_factory=dict)
    # what the checkpoint this run continued from had counted before this process (0, {}: started fresh)
    restored_processed: int = 0
    restored_counters: dict[str, int] = field(default_factory=dict)
    # the weights in force (controller/device/weights.py ``Weights``: version, digest, since which step); None: no
    # params
    weights: Any = None
    # whether this interpreter runs with the GIL, and why (io_loop/gil.py): "off", "on: the build has a GIL",
    # "on: PYTHON_GIL=1", "on: enabled by module 'x'" …; "" where not known (a snapshot made by hand)
    gil: str = ""

    @property
    def anomalies(self) -> int:
        """The default detector's counter (``counters["anomalies"]``; 0 for a processor without it)."""
        return self.counters.get("anomalies", 0)

    @property
    def device_fill(self) -> float:
        """Messages per row of the per-device batches run (1.0: every device's sub-batch full,
        no padding; skew and bucket padding lower it); NaN before the first batch."""
        return sum(self.device_messages) / self.device_rows if self.device_rows else math.nan

    @property
    def errors_total(self) -> int:
        return sum(self.errors.values())

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    @property
    def replies_declined_total(self) -> int:
        return sum(self.replies_declined.values())

    @property
    def unanswered(self) -> int:
        """Received messages not yet answered, dropped or declined: the rest of the books,
        ``messages_in = messages_out + answer_errors_out + no_reply + dropped + unanswered``
        (0 after an orderly stop; what it holds then was lost with the process)."""
        return self.messages_in - self.messages_out - self.answer_errors_out - self.no_reply - self.dropped_total

    @property
    def in_flight(self) -> int:
        """The old name of ``unanswered`` ("in flight" is said of steps dispatched and not finished):
        ``AttributeError`` naming it."""
        raise removed("StatsSnapshot.in_flight", error=AttributeError)


def _ms(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    ms = seconds * 1000
    return f"{ms:.2f}ms" if ms < 10 else f"{ms:.0f}ms"


def status_line(now: StatsSnapshot, before: StatsSnapshot | None, *, final: bool = False) -> str:
    """One human line: totals and per-second rates since ``before``, window latencies.

    ``final``: the line printed after an orderly stop, prefixed ``final (whole run)``; pass
    the snapshot taken at the start as ``before``, so it covers the run, and a connection
    closed by the stop reads ``stopped`` rather than ``DISCONNECTED``."""
    if before is None:
        span = 0.0
        lat = now.latency
        written = now.write_latency
        bsz = now.batch_size
        lag = now.loop_lag
    else:
        span = now.at - before.at
        lat = now.latency - before.latency
        written = now.write_latency - before.write_latency
        bsz = now.batch_size - before.batch_size
        lag = now.loop_lag - before.loop_lag

    def rate(a: int, b: int) -> str:
        return f"{(a - b) / span:.0f}/s" if span > 0 else "-/s"

    in_rate = rate(now.messages_in, before.messages_in if before else 0)
    out_rate = rate(now.messages_out, before.messages_out if before else 0)
    mean_batch = "-" if math.isnan(bsz.mean) else f"{bsz.mean:.1f}"
    if final:  # how the stop left the connection, and what it could not account for
        open_now = any(f.io.connected for f in now.feeds) if now.feeds else now.connected
        conn = "connection still open at the stop deadline" if open_now else "stopped"
        if now.unanswered:
            conn = f"unanswered {now.unanswered} | {conn}"
    elif len(now.feeds) > 1:
        conn = f"feeds {sum(f.up for f in now.feeds)}/{len(now.feeds)} connected"
    else:
        conn = "connected" if now.connected else "DISCONNECTED"
    parts = [
        f"in {now.messages_in} msg ({in_rate})",
        f"out {now.messages_out} msg ({out_rate})",
        f"batch {mean_batch} msg",
        f"latency p50 {_ms(lat.quantile(0.5))} p99 {_ms(lat.quantile(0.99))}",
        f"write-latency p99 {_ms(written.quantile(0.99))}",
        *(f"{name} {n}" for name, n in now.counters.items()),  # the processor's declared counters
        f"errors {now.errors_total}",
        f"dropped {now.dropped_total}",
        f"io-lag p99 {_ms(lag.quantile(0.99))}",
        f"reconnects {now.reconnects}",
        *([checkpoint_part(now)] if now.checkpoints_on else []),
        *(_sink_part(name, books) for name, books in now.sinks),  # the controller's sinks of results
        *(f"{src.name} seq {src.applied_seq} lag {src.lag}" for src in now.sources),
        conn,
    ]
    if len(now.devices) > 1:  # how full the per-device sub-batches ran, in this window
        rows = now.device_rows - (before.device_rows if before else 0)
        ran = sum(now.device_messages) - (sum(before.device_messages) if before else 0)
        parts.insert(3, f"{len(now.devices)} devices fill {'-' if not rows else f'{100 * ran / rows:.0f}%'}")
    return ("final (whole run): " if final else "") + " | ".join(parts)


def _sink_part(name: str, books: Any) -> str:
    """The status line's part for one of the controller's sinks: ``sink results written 120 held 0``
    (``dropped n`` added only when there are any)."""
    dropped = sum(books.dropped.values())
    return f"sink {name} written {books.written} held {books.held}" + (f" dropped {dropped}" if dropped else "")


def checkpoint_part(snap: StatsSnapshot) -> str:
    """The status line's checkpoint part: ``ckpt 12s ago 0.4s`` (age of the newest written
    checkpoint, how long writing it took), ``ckpt none yet``; failures and skips only when
    there are any."""
    if math.isnan(snap.checkpoint_age_s):
        text = "ckpt none yet"
    else:
        text = f"ckpt {max(0.0, snap.checkpoint_age_s):.0f}s ago {snap.checkpoint_duration_s:.1f}s"
    if snap.checkpoint_failures:
        text += f" FAILED {snap.checkpoint_failures}"
    if snap.checkpoint_skipped:
        text += f" skipped {snap.checkpoint_skipped}"
    return text


def books_line(snap: StatsSnapshot) -> str:
    """The message books in one line (logged at the end of ``run()``)::

        books: in N = results R + error replies A + no reply Q + dropped D (reason n, …) + unanswered U
        (…; sink 'name': taken T = written W + dropped D (reason n, …) + held H: each of the controller's sinks)
        (…; before this process (its checkpoint): processed P, anomalies A: after a restore)

    Every figure but the last part is this process's own.
    """
    dropped = ", ".join(f"{reason} {n}" for reason, n in sorted(snap.dropped.items()))
    return (f"books: in {snap.messages_in} = results {snap.messages_out} + error replies {snap.answer_errors_out}"
            f" + no reply {snap.no_reply} + dropped {snap.dropped_total}{f' ({dropped})' if dropped else ''}"
            f" + unanswered {snap.unanswered}; also {snap.errors_out - snap.answer_errors_out} replies to bad input"
            f", {snap.replies_declined_total} replies declined"
            f", {snap.written_unconfirmed} replies written to connections that then failed"
            + "".join(f"; sink {name!r}: taken {books.taken} = written {books.written} + dropped "
                      f"{sum(books.dropped.values())}{_reasons(books.dropped)} + held {books.held}"
                      for name, books in snap.sinks)
            + (f"; {snap.sink_results_unsent} results never handed to the sinks" if snap.sink_results_unsent else "")
            + _restored_part(snap))


def _restored_part(snap: StatsSnapshot) -> str:
    """The books line's tail after a restore: what the checkpoint had counted before this process (the books
    above are this process's alone)."""
    if not snap.restored_processed and not any(snap.restored_counters.values()):
        return ""
    counted = "".join(f", {name} {n}" for name, n in snap.restored_counters.items())
    return f"; before this process (its checkpoint): processed {snap.restored_processed}{counted}"


def losses(snap: StatsSnapshot) -> dict[str, int]:
    """What a run lost, by kind, the kinds with none left out (empty: nothing lost; the program's exit status
    after an orderly stop, controller/commands/cli.py): messages and replies dropped, messages still unanswered,
    results the controller's sinks gave up or never got, events a source's buffer gave up."""
    found = {
        "dropped": snap.dropped_total,
        "unanswered": snap.unanswered,
        "dropped by sinks": sum(sum(books.dropped.values()) for _, books in snap.sinks),
        "results never handed to the sinks": snap.sink_results_unsent,
        "events dropped": sum(snap.events_dropped.values()),
    }
    return {kind: n for kind, n in found.items() if n > 0}


def _reasons(dropped: dict[str, int]) -> str:
    return f" ({', '.join(f'{reason} {n}' for reason, n in sorted(dropped.items()))})" if dropped else ""


def whole_snapshot(main: MainStats, io_snapshot: Callable[[], IOSnapshot], *, at: float, compilations: int,
                   devices: tuple[tuple[str, ...], tuple[int, ...], int] | None, streams: tuple[int, int],
                   checkpoints: dict[str, Any],
                   sources: Callable[[IOSnapshot], tuple[SourceFigures, ...]] = lambda io: (),
                   io_cpu_s: float = math.nan, partitions_unowned: int = 0, lease_losses: int = 0,
                   weights: Any = None, gil: str = "") -> StatsSnapshot:
    """``Controller.stats()``, from any thread: the main thread's counters (``main``, copied first) and then
    the IO side's snapshot (``io_snapshot()``), in the books' order (the module rules), as one
    ``StatsSnapshot``. ``devices``: the engine's ``(devices, messages per device, rows stepped)``, None
    before the compile; ``streams``: ``(active, evicted)``; ``checkpoints``: the checkpointer's fields;
    ``sources``: the JetStream feeds' figures drawn from the IO side's snapshot; ``io_cpu_s``: the IO
    thread's CPU seconds (``IOSide.cpu_seconds``); ``partitions_unowned``: a partitioned instance's count of
    its stream's partitions that no instance owns; ``lease_losses``: the times it found its own leases
    lost; ``weights``: the engine's weights in force (controller/device/weights.py); ``gil``: the GIL's
    status (io_loop/gil.py)."""
    main = main.snapshot()  # before the IO side's: what the main thread counted of a message, before its receipt
    io = io_snapshot()
    at_ready = main.compilations_at_ready
    feed_latency = [histogram.snapshot() for histogram in main.latency]
    latency = feed_latency[0]
    for more in feed_latency[1:]:
        latency = latency + more
    compiled = devices is not None
    names, per_device, rows = devices if devices is not None else ((), (), 0)
    return StatsSnapshot(
        at=at,
        messages_in=io.messages_in,
        frames_in=io.frames_in,
        messages_out=io.results_out,
        errors_out=io.errors_out,
        processed=main.processed,
        batches=main.batches,
        errors=_merged(io.errors, copy_counts(main.errors)),
        dropped=_merged(io.dropped, copy_counts(main.dropped)),
        connects=io.connects, reconnects=io.reconnects, connect_failures=io.connect_failures,
        connected=io.connected, connection_since=io.state_since,
        inbound_depth=io.inbound_depth, outbound_depth=io.outbound_depth, unsent=io.unsent,
        batch_size=main.batch_size.snapshot(),
        latency=latency,
        write_latency=io.write_latency,
        feed_latency=tuple(feed_latency),
        replies_declined=_merged(io.replies_declined, copy_counts(main.replies_declined)),
        loop_lag=io.loop_lag,
        step_seconds=main.step_seconds.snapshot(),
        compilations=compilations,
        compilations_after_warmup=None if at_ready is None else compilations - at_ready,
        devices=names, device_messages=per_device, device_rows=rows,
        ready=compiled and io.connected, compiled=compiled, phase=main.phase,
        no_reply=main.no_reply,
        resets=copy_counts(main.resets),
        streams_active=streams[0], streams_evicted=streams[1],
        **checkpoints,
        answer_errors_out=io.answer_errors_out,
        written_unconfirmed=io.written_unconfirmed,
        last_error=io.last_error,
        feeds=io.feeds,
        hops=add_hops(io.hops, {hop: histogram.snapshot() for hop, histogram in main.hops.items()}),
        sources=sources(io),
        io_cpu_s=io_cpu_s,
        step_io_cpu_s=main.step_io_cpu_s,
        events_in=io.events_in, events=main.events, events_unhandled=main.events_unhandled,
        sent_out=io.sent_out, sent_unsent=io.sent_unsent, sent_failed=io.sent_failed, counts=io.counts, sinks=io.sinks,
        sink_results_unsent=main.sink_results_unsent,
        events_dropped=io.events_dropped, buffered=io.buffered, awaited_unanswered=io.awaited_unanswered,
        partitions_unowned=partitions_unowned, lease_losses=lease_losses,
        counters=copy_counts(main.counters),
        restored_processed=main.restored_processed, restored_counters=dict(main.restored_counters),
        weights=weights,
        gil=gil,
    )


def _merged(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    out = dict(a)
    for reason, count in b.items():
        out[reason] = out.get(reason, 0) + count
    return out
