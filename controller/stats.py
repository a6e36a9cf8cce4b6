"""Counters, histograms and snapshots; the status line is drawn from a snapshot.

Rules:
- Pure: no threads, no clock (the caller passes times).
- Each counter object has one writer thread: ``IOStats`` is written only by the IO thread,
  ``MainStats`` only by the main thread. Readers on the other side only read (single int or
  list reads are atomic under the GIL), so no lock is needed and none is taken.
- The other side reads them only through a snapshot: ``IOStats.snapshot()`` (called by
  ``IOThread.snapshot()``) copies the IO side's counters; ``copy_counts`` holds the one retry
  needed to copy a counter dict another thread may be adding keys to.
- ``Controller.stats()`` combines both into a ``StatsSnapshot``; the status line and the
  Prometheus metrics are both made from snapshots, so the three never disagree.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from io_loop.crossing import HOPS

# latency-like values in seconds: 1 µs … 100 s, ten buckets per decade
SECONDS_BOUNDS: tuple[float, ...] = tuple(10 ** (e / 10) for e in range(-60, 21))
# how often the IO thread samples its loop's lag (one trip round the loop)
LAG_INTERVAL_S = 0.02
COPY_TRIES = 10


def copy_counts(counts: dict[str, int]) -> dict[str, int]:
    """Copy a counter dict that its writer thread may be adding keys to (never locked).

    ``dict(counts)`` raises RuntimeError ("changed size during iteration") if a key is added
    meanwhile; trying again is enough, because writers only ever add keys or increment.
    """
    for _ in range(COPY_TRIES - 1):
        try:
            return dict(counts)
        except RuntimeError:
            continue
    return dict(counts)


class Histogram:
    """Fixed buckets; ``counts[i]`` counts values <= ``bounds[i]`` and > ``bounds[i-1]``;
    the last count is the overflow bucket (> ``bounds[-1]``)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def observe_many(self, values: Iterable[float]) -> None:
        bounds = self.bounds
        counts = self.counts
        total = 0.0
        n = 0
        for v in values:
            counts[bisect.bisect_left(bounds, v)] += 1
            total += v
            n += 1
        self.total += total
        self.n += n

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.total, self.n)


@dataclass(frozen=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float
    n: int

    def __sub__(self, earlier: HistogramSnapshot) -> HistogramSnapshot:
        """What was observed between ``earlier`` and this snapshot."""
        return HistogramSnapshot(
            self.bounds,
            tuple(a - b for a, b in zip(self.counts, earlier.counts)),
            self.total - earlier.total,
            self.n - earlier.n,
        )

    def __add__(self, other: HistogramSnapshot) -> HistogramSnapshot:
        """Both histograms' observations together (same bounds)."""
        return HistogramSnapshot(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts)),
                                 self.total + other.total, self.n + other.n)

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else math.nan

    def quantile(self, q: float) -> float:
        """Estimate of the q-quantile: geometric interpolation inside the bucket (nan if empty)."""
        n = sum(self.counts)
        if n == 0:
            return math.nan
        rank = q * n
        seen = 0
        for i, c in enumerate(self.counts):
            if c and seen + c >= rank:
                if i == len(self.bounds):
                    return self.bounds[-1]
                hi = self.bounds[i]
                lo = self.bounds[i - 1] if i else hi / 10
                frac = min(1.0, max(0.0, (rank - seen) / c))
                if lo > 0:
                    return lo * (hi / lo) ** frac
                return lo + (hi - lo) * frac
            seen += c
        return self.bounds[-1]

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, count of values <= it) pairs, ending with (+inf, n)."""
        out = []
        acc = 0
        for bound, c in zip(self.bounds, self.counts):
            acc += c
            out.append((bound, acc))
        out.append((math.inf, acc + self.counts[-1]))
        return out


@dataclass
class IOStats:
    """Written by the IO thread only; read from elsewhere through ``snapshot()``."""

    frames_in: int = 0
    messages_in: int = 0
    results_out: int = 0  # result frames written to the socket
    errors_out: int = 0  # error frames written to the socket (answers and bad-input replies)
    answer_errors_out: int = 0  # of those, error frames that answer a received message
    errors: Counter = field(default_factory=Counter)  # bad input by reason
    dropped: Counter = field(default_factory=Counter)  # received messages never answered, by reason
    error_replies_unsent: int = 0  # bad-input error replies not written at the stop
    written_unconfirmed: int = 0  # frames written to connections that then ended without the closing handshake
    connects: int = 0
    reconnects: int = 0
    connect_failures: int = 0
    connected: bool = False
    state_since: float = 0.0  # wall-clock seconds of the last connect/disconnect
    latency: Histogram = field(default_factory=lambda: Histogram(SECONDS_BOUNDS))
    loop_lag: Histogram = field(default_factory=lambda: Histogram(SECONDS_BOUNDS))
    last_error: str = ""  # why the last connection attempt failed or the last connection ended
    # the latency budget: seconds per hop of the sampled messages (batching.HOPS, then "total")
    hops: dict[str, Histogram] = field(default_factory=lambda: {hop: Histogram(SECONDS_BOUNDS)
                                                                 for hop in (*HOPS, "total")})

    def observe_hops(self, seconds: list[float]) -> None:
        """One sampled message's ``Trace.hops_s()``."""
        for histogram, value in zip(self.hops.values(), seconds):
            histogram.observe(value)

    def snapshot(self, inbound_depth: int = 0, outbound_depth: int = 0, unsent: int = 0) -> IOSnapshot:
        """A copy safe to read from any thread (the queue depths and unsent count are the caller's)."""
        return IOSnapshot(
            frames_in=self.frames_in, messages_in=self.messages_in, results_out=self.results_out,
            errors_out=self.errors_out, answer_errors_out=self.answer_errors_out,
            error_replies_unsent=self.error_replies_unsent, written_unconfirmed=self.written_unconfirmed,
            errors=copy_counts(self.errors), dropped=copy_counts(self.dropped),
            connects=self.connects, reconnects=self.reconnects, connect_failures=self.connect_failures,
            connected=self.connected, state_since=self.state_since, last_error=self.last_error,
            latency=self.latency.snapshot(), loop_lag=self.loop_lag.snapshot(),
            inbound_depth=inbound_depth, outbound_depth=outbound_depth, unsent=unsent,
            hops={hop: histogram.snapshot() for hop, histogram in self.hops.items()},
        )


@dataclass(frozen=True)
class IOSnapshot:
    """Everything the main thread learns about the IO side, at one moment."""

    frames_in: int
    messages_in: int
    results_out: int
    errors_out: int
    answer_errors_out: int
    error_replies_unsent: int
    written_unconfirmed: int
    errors: dict[str, int]
    dropped: dict[str, int]
    connects: int
    reconnects: int
    connect_failures: int
    connected: bool
    state_since: float
    last_error: str
    latency: HistogramSnapshot
    loop_lag: HistogramSnapshot
    inbound_depth: int  # chunks waiting for the main thread
    outbound_depth: int  # batches of replies waiting for the IO thread
    unsent: int  # reply frames taken from outbound, not yet written (held across a reconnect)
    feeds: tuple[FeedSnapshot, ...] = ()  # each feed's own figures (``combine_io`` made the totals above)
    hops: dict[str, HistogramSnapshot] = field(default_factory=dict)  # the latency budget (IOStats.hops)


@dataclass(frozen=True)
class FeedSnapshot:
    """One feed's figures: its own ``IOStats`` snapshot (connection, frames, messages, replies,
    latency, unsent), its name, whether readiness waits for it, and why it was given up ("" while used)."""

    name: str
    required: bool
    given_up: str
    io: IOSnapshot

    @property
    def up(self) -> bool:
        return self.io.connected and not self.given_up


_SUMMED = ("frames_in", "messages_in", "results_out", "errors_out", "answer_errors_out", "error_replies_unsent",
           "written_unconfirmed", "connects", "reconnects", "connect_failures", "unsent")


def combine_io(thread: IOSnapshot, feeds: Sequence[FeedSnapshot]) -> IOSnapshot:
    """The IO side's totals: the thread's own figures (loop lag, queue depths, what the stop could
    not send) plus every feed's. ``connected`` is True when every required feed is connected
    (any feed, if none is required); ``last_error`` is the most recent feed's, named when there
    are several."""
    totals: dict[str, Any] = {name: getattr(thread, name) + sum(getattr(f.io, name) for f in feeds)
                              for name in _SUMMED}
    errors, dropped = Counter(thread.errors), Counter(thread.dropped)
    latency = thread.latency
    hops = dict(thread.hops)
    for f in feeds:
        errors.update(f.io.errors)
        dropped.update(f.io.dropped)
        latency = latency + f.io.latency
        hops = {hop: hops[hop] + value if hop in hops else value for hop, value in f.io.hops.items()}
    required = [f for f in feeds if f.required] or list(feeds)
    latest = max(feeds, key=lambda f: f.io.state_since, default=None)
    last_error = thread.last_error
    if latest is not None and latest.io.last_error:
        last_error = latest.io.last_error if len(feeds) == 1 else f"feed {latest.name!r}: {latest.io.last_error}"
    return dataclasses.replace(
        thread, **totals, errors=dict(errors), dropped=dict(dropped), latency=latency, hops=hops,
        connected=bool(required) and all(f.up for f in required),
        state_since=latest.io.state_since if latest is not None else thread.state_since,
        last_error=last_error, feeds=tuple(feeds))


@dataclass
class MainStats:
    """Written by the main thread only."""

    batches: int = 0
    processed: int = 0
    anomalies: int = 0
    errors: Counter = field(default_factory=Counter)  # by reason (too many streams, processing failed)
    dropped: Counter = field(default_factory=Counter)  # received messages never answered, by reason
    no_reply: int = 0  # processed messages the codec chose not to answer
    resets: Counter = field(default_factory=Counter)  # state reset, by reason (see the README)
    batch_size: Histogram | None = None
    step_seconds: Histogram = field(default_factory=lambda: Histogram(SECONDS_BOUNDS))
    compilations_at_ready: int | None = None
    # per device (in the order of ``devices``): messages run there; set up by the controller's
    # compile (an int array, added to in place)
    device_messages: Any = field(default_factory=list)
    device_rows: int = 0  # rows of the per-device batches run, padding included (N x Bd a step)


@dataclass(frozen=True)
class StatsSnapshot:
    """Everything ``Controller.stats()`` reports, at one moment."""

    at: float  # monotonic seconds
    messages_in: int
    frames_in: int
    messages_out: int  # result frames sent
    errors_out: int  # error frames sent
    processed: int
    anomalies: int
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
    latency: HistogramSnapshot
    loop_lag: HistogramSnapshot
    step_seconds: HistogramSnapshot
    compilations: int
    compilations_after_warmup: int | None
    devices: tuple[str, ...]
    ready: bool  # compiled and connected
    compiled: bool = False
    no_reply: int = 0  # processed, and the codec chose to send no reply
    answer_errors_out: int = 0  # error frames sent that answer a received message (in errors_out)
    resets: dict[str, int] = field(default_factory=dict)  # streams (or the whole state) reset, by reason
    streams_active: int = 0  # streams holding a state slot
    streams_evicted: int = 0  # idle streams whose slot went to a new stream (FORKLESS_STREAM_IDLE_S)
    written_unconfirmed: int = 0  # frames written to connections that ended without the closing handshake
    last_error: str = ""  # why the last connection attempt failed or the last connection ended
    feeds: tuple[FeedSnapshot, ...] = ()  # per feed (FORKLESS_FEEDS); the fields above are totals
    hops: dict[str, HistogramSnapshot] = field(default_factory=dict)  # latency budget, per hop (batching.HOPS)
    extra: dict[str, Any] = field(default_factory=dict)
    # checkpoints (controller/checkpointer.py; all 0 while FORKLESS_CHECKPOINT_DIR is unset)
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
    def in_flight(self) -> int:
        """Received messages not yet answered, dropped or declined: the rest of the books,
        ``messages_in = messages_out + answer_errors_out + no_reply + dropped + in_flight``
        (0 after an orderly stop; what it holds then was lost with the process)."""
        return self.messages_in - self.messages_out - self.answer_errors_out - self.no_reply - self.dropped_total


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
        bsz = now.batch_size
        lag = now.loop_lag
    else:
        span = now.at - before.at
        lat = now.latency - before.latency
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
        if now.in_flight:
            conn = f"unanswered {now.in_flight} | {conn}"
    elif len(now.feeds) > 1:
        conn = f"feeds {sum(f.up for f in now.feeds)}/{len(now.feeds)} connected"
    else:
        conn = "connected" if now.connected else "DISCONNECTED"
    parts = [
        f"in {now.messages_in} msg ({in_rate})",
        f"out {now.messages_out} msg ({out_rate})",
        f"batch {mean_batch} msg",
        f"latency p50 {_ms(lat.quantile(0.5))} p99 {_ms(lat.quantile(0.99))}",
        f"anomalies {now.anomalies}",
        f"errors {now.errors_total}",
        f"dropped {now.dropped_total}",
        f"io-lag p99 {_ms(lag.quantile(0.99))}",
        f"reconnects {now.reconnects}",
        *([checkpoint_part(now)] if now.checkpoints_on else []),
        conn,
    ]
    if len(now.devices) > 1:  # how full the per-device sub-batches ran, in this window
        rows = now.device_rows - (before.device_rows if before else 0)
        ran = sum(now.device_messages) - (sum(before.device_messages) if before else 0)
        parts.insert(3, f"{len(now.devices)} devices fill {'-' if not rows else f'{100 * ran / rows:.0f}%'}")
    return ("final (whole run): " if final else "") + " | ".join(parts)


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
    """
    dropped = ", ".join(f"{reason} {n}" for reason, n in sorted(snap.dropped.items()))
    return (f"books: in {snap.messages_in} = results {snap.messages_out} + error replies {snap.answer_errors_out}"
            f" + no reply {snap.no_reply} + dropped {snap.dropped_total}{f' ({dropped})' if dropped else ''}"
            f" + unanswered {snap.in_flight}; also {snap.errors_out - snap.answer_errors_out} replies to bad input"
            f", {snap.written_unconfirmed} replies written to connections that then failed")
