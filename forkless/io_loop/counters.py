"""The IO side's counters and histograms, and the one way another thread reads them: a snapshot.

Rules:
- Pure: no threads, no clock (the caller passes times).
- Each counter object has one writer thread: an ``IOStats`` is written only by the IO thread (one per feed, plus
  the thread's own), so its ``x += 1`` is never raced. Readers only read, and a single read of an attribute, list
  item or dict item is atomic with or without the GIL, so no lock is taken.
- The other side reads them only through a snapshot (``IOStats.snapshot()``), copied one figure after another while
  the writer goes on: each figure is one its writer wrote, a counter never goes back, and each book's outflow is
  read before its inflow, so a copy never shows more answered than received. A histogram's buckets, total and count
  may differ by what was observed while it was copied (its quantiles use the buckets alone).
- ``copy_counts`` is the one place that copies a counter dict while its writer may add keys (iterating one raises
  then, on the free-threaded build as soon as two threads run); every reader of another thread's ``Counter`` uses it.
- The whole-process snapshot is the controller's; the IO side is handed a callable returning it.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from forkless.io_loop.crossing import HOPS

__all__ = ["LAG_INTERVAL_S", "SECONDS_BOUNDS", "FeedSnapshot", "Histogram", "HistogramSnapshot", "IOSnapshot",
           "IOStats", "SourceStats", "add_hops", "combine_io", "copy_counts", "new_hops", "observe_hops"]

# latency-like values in seconds: 1 µs … 100 s, ten buckets per decade
SECONDS_BOUNDS: tuple[float, ...] = tuple(10 ** (e / 10) for e in range(-60, 21))
# how often the IO thread samples its loop's lag (io_loop/thread.py ``LagSampler``): each sample wakes an
# idle loop, which costs CPU (bench/docs/exchange-session-cost.md)
LAG_INTERVAL_S = 0.1
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

    def observe_each(self, value: float, n: int) -> None:
        """``n`` observations of the same ``value`` (messages that arrived in one chunk)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.total += value * n
        self.n += n

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
class SourceStats:
    """A replayable source's position on the IO side (a JetStream feed, io_loop/connectors/jetstream/source.py);
    written by its feed only, copied whole (``dataclasses.replace``) into its snapshot."""

    fetched: int = 0  # source messages taken from the stream (replayed ones included)
    skipped: int = 0  # deliveries at or below the position already consumed: not handed over again
    next_seq: int = 0  # the stream sequence consumed next (0: not known yet)
    stream_last_seq: int = 0  # the stream's last sequence, as last seen (stream info, deliveries)
    # (sequence, index) of the last reply whose publication the results stream acknowledged;
    # replies are published in order, so every reply before it is stored too
    confirmed: tuple[int, int] = (0, -1)
    duplicates: int = 0  # replies the results stream dropped as duplicates (published again after a replay)
    # (handed, through): with the messages up to stream sequence ``handed`` handed over, the stream held
    # no further message of the feed's subjects up to ``through`` (what the feed covered: a survey of its
    # consumer's and the stream's state proved it, io_loop/connectors/jetstream/consumer.py ``Consumer.surveyed``)
    covered: tuple[int, int] = (0, 0)
    stream_created: str = ""  # the stream's created time (ISO 8601) at the first connection ("": not yet)


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
    # error replies to bad input not sent (the feed's reply policy, or encode_error returned None), by reason
    replies_declined: Counter = field(default_factory=Counter)
    error_replies_unsent: int = 0  # bad-input error replies not written at the stop
    written_unconfirmed: int = 0  # frames written to connections that then ended without the closing handshake
    connects: int = 0
    reconnects: int = 0
    connect_failures: int = 0
    connected: bool = False
    state_since: float = 0.0  # wall-clock seconds of the last connect/disconnect
    # a frame's arrival -> its reply frame written (results and error frames answering a message)
    write_latency: Histogram = field(default_factory=lambda: Histogram(SECONDS_BOUNDS))
    loop_lag: Histogram = field(default_factory=lambda: Histogram(SECONDS_BOUNDS))
    last_error: str = ""  # why the last connection attempt failed or the last connection ended
    # the latency budget: seconds per hop of the sampled messages (crossing.HOPS, then "total")
    hops: dict[str, Histogram] = field(default_factory=lambda: new_hops())
    source: SourceStats | None = None  # a JetStream feed's position (None for a WebSocket feed)
    events_in: int = 0  # objects a user source handed over as they are (``SourceContext.emit_event``)
    sent_out: int = 0  # frames the main thread sent on its own (``Controller.send``), written
    sent_unsent: int = 0  # of those, frames never written (the stop, a feed given up, a source ended)
    sent_failed: Counter = field(default_factory=Counter)  # of those, frames given up (io_loop/sends.py), by reason
    counts: Counter = field(default_factory=Counter)  # what a user source counted itself (``ctx.count``)
    events_dropped: Counter = field(default_factory=Counter)  # events given up (its overflow, the stop), by reason
    buffered: int = 0  # messages and events waiting in the source's own buffer (io_loop/spill.py)
    buffered_peak: int = 0  # the most that ever waited there (at most its bound plus one item)
    # replies a source still awaited (its awaiting()) when the stop's wait for them ended, by why (io_loop/finishing.py)
    awaited_unanswered: Counter = field(default_factory=Counter)

    def observe_hops(self, seconds: list[float]) -> None:
        """One sampled message's ``Trace.hops_s()``."""
        observe_hops(self.hops, seconds)

    def snapshot(self, inbound_depth: int = 0, outbound_depth: int = 0, unsent: int = 0) -> IOSnapshot:
        """A copy safe to read from any thread (the queue depths and unsent count are the caller's), read in
        the books' order (the module rules): what is received (frames, messages, events) last."""
        return IOSnapshot(
            results_out=self.results_out,
            errors_out=self.errors_out, answer_errors_out=self.answer_errors_out,
            error_replies_unsent=self.error_replies_unsent, written_unconfirmed=self.written_unconfirmed,
            errors=copy_counts(self.errors), dropped=copy_counts(self.dropped),
            replies_declined=copy_counts(self.replies_declined),
            connects=self.connects, reconnects=self.reconnects, connect_failures=self.connect_failures,
            connected=self.connected, state_since=self.state_since, last_error=self.last_error,
            write_latency=self.write_latency.snapshot(), loop_lag=self.loop_lag.snapshot(),
            inbound_depth=inbound_depth, outbound_depth=outbound_depth, unsent=unsent,
            hops={hop: histogram.snapshot() for hop, histogram in self.hops.items()},
            source=None if self.source is None else dataclasses.replace(self.source),
            sent_out=self.sent_out, sent_unsent=self.sent_unsent,
            sent_failed=copy_counts(self.sent_failed),
            counts=copy_counts(self.counts), events_dropped=copy_counts(self.events_dropped),
            buffered=self.buffered, buffered_peak=self.buffered_peak,
            awaited_unanswered=copy_counts(self.awaited_unanswered),
            # last: a message (an event) is counted received before anything of its answer is
            frames_in=self.frames_in, messages_in=self.messages_in, events_in=self.events_in,
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
    write_latency: HistogramSnapshot  # a frame's arrival -> its reply frame written
    loop_lag: HistogramSnapshot
    inbound_depth: int  # chunks waiting for the main thread
    outbound_depth: int  # batches of replies waiting for the IO thread
    unsent: int  # reply frames taken from outbound, not yet written (held across a reconnect)
    feeds: tuple[FeedSnapshot, ...] = ()  # each feed's own figures (``combine_io`` made the totals above)
    hops: dict[str, HistogramSnapshot] = field(default_factory=dict)  # the latency budget (IOStats.hops)
    replies_declined: dict[str, int] = field(default_factory=dict)  # IOStats.replies_declined
    source: SourceStats | None = None  # a JetStream feed's position, copied (a feed's own snapshot only)
    events_in: int = 0  # IOStats.events_in
    sent_out: int = 0  # IOStats.sent_out
    sent_unsent: int = 0  # IOStats.sent_unsent
    sent_failed: dict[str, int] = field(default_factory=dict)  # IOStats.sent_failed
    counts: dict[str, int] = field(default_factory=dict)  # IOStats.counts (a user source's own)
    sinks: tuple[tuple[str, Any], ...] = ()  # a controller's sinks: (name, SinkStats) each (io_loop/sinks/results.py)
    events_dropped: dict[str, int] = field(default_factory=dict)  # IOStats.events_dropped
    buffered: int = 0  # IOStats.buffered (summed over the feeds)
    buffered_peak: int = 0  # IOStats.buffered_peak (a feed's own; the largest feed's in the totals)
    awaited_unanswered: dict[str, int] = field(default_factory=dict)  # IOStats.awaited_unanswered


@dataclass(frozen=True)
class FeedSnapshot:
    """One feed's figures: its own ``IOStats`` snapshot (connection, frames, messages, replies,
    write latency, unsent), its name, whether readiness waits for it, why it was given up ("" while used),
    and whether its source has ended (its ``run`` returned)."""

    name: str
    required: bool
    given_up: str
    io: IOSnapshot
    ended: bool = False  # a source's run has returned (or raised): nothing more is written for it

    @property
    def up(self) -> bool:
        return self.io.connected and not self.given_up


def new_hops() -> dict[str, Histogram]:
    """The latency budget's histograms: one per hop (``HOPS``), then ``"total"``."""
    return {hop: Histogram(SECONDS_BOUNDS) for hop in (*HOPS, "total")}


def observe_hops(hops: dict[str, Histogram], seconds: list[float]) -> None:
    """One sampled message's ``Trace.hops_s(end)`` into ``hops`` (``new_hops``): the hops it
    passed, in order (all of them when its reply was written; up to ``assemble`` when it got no
    frame), and its last value, the whole way, into ``"total"``."""
    *each, total = seconds
    for histogram, value in zip(hops.values(), each):
        histogram.observe(value)
    hops["total"].observe(total)


def add_hops(a: dict[str, HistogramSnapshot], b: dict[str, HistogramSnapshot]) -> dict[str, HistogramSnapshot]:
    """Both latency budgets' observations together, hop by hop (either may be empty)."""
    return {**a, **{hop: a[hop] + value if hop in a else value for hop, value in b.items()}}


_SUMMED = ("frames_in", "messages_in", "results_out", "errors_out", "answer_errors_out", "error_replies_unsent",
           "written_unconfirmed", "connects", "reconnects", "connect_failures", "unsent", "events_in", "sent_out",
           "sent_unsent", "buffered")


def combine_io(thread: IOSnapshot, feeds: Sequence[FeedSnapshot]) -> IOSnapshot:
    """The IO side's totals: the thread's own figures (loop lag, queue depths, what the stop could
    not send) plus every feed's. ``connected`` is True when every required feed is connected
    (any feed, if none is required); ``last_error`` is the most recent feed's, named when there
    are several."""
    totals: dict[str, Any] = {name: getattr(thread, name) + sum(getattr(f.io, name) for f in feeds)
                              for name in _SUMMED}
    errors, dropped, declined = Counter(thread.errors), Counter(thread.dropped), Counter(thread.replies_declined)
    counts, events_dropped = Counter(thread.counts), Counter(thread.events_dropped)
    sent_failed = Counter(thread.sent_failed)
    awaited = Counter(thread.awaited_unanswered)
    latency = thread.write_latency
    hops = dict(thread.hops)
    for f in feeds:
        errors.update(f.io.errors)
        dropped.update(f.io.dropped)
        declined.update(f.io.replies_declined)
        counts.update(f.io.counts)
        events_dropped.update(f.io.events_dropped)
        sent_failed.update(f.io.sent_failed)
        awaited.update(f.io.awaited_unanswered)
        latency = latency + f.io.write_latency
        hops = add_hops(hops, f.io.hops)
    required = [f for f in feeds if f.required] or list(feeds)
    latest = max(feeds, key=lambda f: f.io.state_since, default=None)
    last_error = thread.last_error
    if latest is not None and latest.io.last_error:
        last_error = latest.io.last_error if len(feeds) == 1 else f"feed {latest.name!r}: {latest.io.last_error}"
    return dataclasses.replace(
        thread, **totals, errors=dict(errors), dropped=dict(dropped), write_latency=latency, hops=hops,
        replies_declined=dict(declined), counts=dict(counts), events_dropped=dict(events_dropped),
        sent_failed=dict(sent_failed),
        awaited_unanswered=dict(awaited),
        buffered_peak=max([thread.buffered_peak, *(f.io.buffered_peak for f in feeds)]),
        connected=bool(required) and all(f.up for f in required),
        state_since=latest.io.state_since if latest is not None else thread.state_since,
        last_error=last_error, feeds=tuple(feeds))
