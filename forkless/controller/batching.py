"""Micro-batching: chunks of decoded messages in, fixed-shape padded batches out.

Rules:
- Pure: no threads, no queues, no clock; the caller passes ``now`` (seconds, monotonic).
- ``Chunk`` (IO -> main) and ``Outgoing`` (main -> IO), the only things that cross between the threads, are
  defined where the threads meet (io_loop/crossing.py) and imported from there.
- Order is kept: messages leave in the order their chunks were added; a chunk larger than the room left is split,
  its tail going first into the next batch.
- Size and deadline: a batch holds at most ``max_batch`` messages. After its first message the caller adds only
  chunks *already waiting*, while ``wants_more(now)``: until full or ``max_wait_s`` since it began collecting. The
  batcher never asks the caller to wait on an empty queue, so a lone message goes straight through.
- What a ``take`` leaves begins collecting with the next chunk added: the step between is not collecting time,
  so a leftover is topped up from what waits before it is cut, and with nothing waiting goes out at once.
- Padding: n messages are padded to the smallest bucket >= n (``Config.buckets``: powers of four up to
  ``max_batch``), so the jitted step sees a few shapes, all compiled at start-up.
- One copy of ``x`` on the host: the chunks' rows are copied once, into the batch's zeroed bucket-sized array
  (``PaddedRows``), which ``pad_batch`` takes as it is. Per-chunk values stay per chunk (``Taken.runs``).
- Stream slots are controller/slots.py's business.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Any, NamedTuple

import numpy as np

from forkless.io_loop.crossing import (
    Chunk,
    Trace,
)

__all__ = ["Batch", "MicroBatcher", "PaddedRows", "Taken", "bucket_for", "pad_batch"]

class Taken:
    """The messages of one micro-batch, in arrival order, before slotting.

    ``x`` is [n, F] of the processor's input dtype (float32 by default); made by a batcher with
    ``buckets``, it is the leading rows of a zeroed bucket-sized array that ``pad_batch`` uses as
    the padded batch: the chunks' rows are copied once, from their frames to the batch.
    Per-chunk values stay per chunk: ``runs`` holds one ``(end, feed, received_ns)`` per piece
    of a chunk in the batch (``end``: the index after its last message); ``feed`` and
    ``received_ns`` (one per message) are made from them on first use, for the rare paths."""

    __slots__ = ("_feed", "_received", "feeds_mixed", "origin", "runs", "seq", "stream", "traces", "x")

    def __init__(self, seq: list[Any], stream: list[str], x: np.ndarray, runs: list[tuple[int, int, int]],
                 feeds_mixed: bool = False, traces: list[Trace] | None = None, origin: list[Any] | None = None
                 ) -> None:
        self.seq = seq
        self.stream = stream
        self.x = x
        self.runs = runs
        self.feeds_mixed = feeds_mixed  # True when the runs hold more than one feed
        self.traces: list[Trace] = traces if traces is not None else []  # of the sampled messages in this batch
        self.origin = origin  # per message its ``Origin`` (None for a WebSocket feed's), if any has one
        self._feed: list[int] | None = None
        self._received: list[int] | None = None

    def __len__(self) -> int:
        return len(self.seq)

    @property
    def first_feed(self) -> int:
        """The feed of the first message (of every message unless ``feeds_mixed``)."""
        return self.runs[0][1]

    @property
    def feed(self) -> list[int]:
        """Per message, the feed it came from (made from ``runs`` on first use)."""
        if self._feed is None:
            self._feed = self._expand(1)
        return self._feed

    @property
    def received_ns(self) -> list[int]:
        """Per message, when its chunk's first frame was read (made from ``runs`` on first use)."""
        if self._received is None:
            self._received = self._expand(2)
        return self._received

    def _expand(self, column: int) -> list[int]:
        out: list[int] = []
        start = 0
        for run in self.runs:
            out += [run[column]] * (run[0] - start)
            start = run[0]
        return out


class Batch(NamedTuple):
    """What a processor's ``step`` receives; every leaf has the bucket size B as leading axis.

    ``x``: float32 [B, F] (float64 for a processor that declares ``input_dtype=float64``);
    ``key``: int32 [B] state slot of the message's stream;
    ``valid``: bool [B], False for padding rows (whose ``key`` is the spare slot ``max_streams``).
    """

    x: Any
    key: Any
    valid: Any


class MicroBatcher:
    """Collects chunks and hands out batches of at most ``max_batch`` messages."""

    def __init__(self, max_batch: int, max_wait_s: float, buckets: tuple[int, ...] | None = None) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        # with buckets, a batch's x is made in the leading rows of its padded array (``Taken``)
        self.buckets = tuple(buckets) if buckets else None
        self._chunks: deque[Chunk] = deque()
        self._offset = 0  # messages of _chunks[0] already taken
        self._size = 0
        self._first_at: float | None = None

    def __len__(self) -> int:
        return self._size

    def add(self, chunk: Chunk, now: float) -> None:
        """Queue a chunk; ``now`` starts the deadline if the batcher was empty or holds only
        what the last ``take`` left."""
        if len(chunk) == 0:
            return
        if self._first_at is None:
            self._first_at = now
        self._chunks.append(chunk)
        self._size += len(chunk)

    @property
    def leftover(self) -> bool:
        """It holds only what the last ``take`` left, which has not begun collecting again."""
        return self._size > 0 and self._first_at is None

    def wants_more(self, now: float) -> bool:
        """True while the next batch has room and has been collecting for less than max_wait
        (a leftover has not begun collecting until a chunk is added to it)."""
        if self._size == 0:
            return True
        if self._size >= self.max_batch:
            return False
        return self._first_at is None or now - self._first_at < self.max_wait_s

    def take(self) -> Taken | None:
        """Remove and return up to ``max_batch`` messages in arrival order (None if empty)."""
        if self._size == 0:
            return None
        want = min(self.max_batch, self._size)
        seqs: list[Any] = []
        streams: list[str] = []
        xs: list[np.ndarray] = []  # the chunks' own rows: copied once, into the batch's x
        runs: list[tuple[int, int, int]] = []
        first_feed = self._chunks[0].feed
        mixed = False
        traces: list[Trace] = []
        origins: list[Any] | None = None  # only when a chunk of a replayable source is taken
        taken = 0
        while taken < want:
            chunk = self._chunks[0]
            mixed = mixed or chunk.feed != first_feed
            start = self._offset
            if chunk.trace is not None and start == 0:  # the trace is its first message's
                traces.append(chunk.trace)
            stop = min(len(chunk), start + want - taken)
            if chunk.origin is not None or origins is not None:
                if origins is None:
                    origins = [None] * taken
                origins.extend(chunk.origin[start:stop] if chunk.origin is not None else [None] * (stop - start))
            if start == 0 and stop == len(chunk):  # the whole chunk: no slices
                seqs += chunk.seq
                streams += chunk.stream
                if isinstance(chunk.x, list):
                    xs += chunk.x
                else:
                    xs.append(chunk.x)
            else:
                seqs += chunk.seq[start:stop]
                streams += chunk.stream[start:stop]
                _rows(chunk.x, start, stop, xs)
            taken += stop - start
            runs.append((taken, chunk.feed, chunk.received_ns))
            if stop == len(chunk):
                self._chunks.popleft()
                self._offset = 0
            else:
                self._offset = stop
        self._size -= want
        # what is left begins collecting with the next chunk added: the caller steps this
        # batch first, and a deadline started now would have passed by then, sending the
        # leftover out alone however much is waiting behind it
        self._first_at = None
        return Taken(seqs, streams, self._batch_x(xs, want), runs, mixed, traces, origins)

    def _batch_x(self, xs: list[np.ndarray], n: int) -> np.ndarray:
        """The rows of ``xs`` as one [n, F] array: with buckets, the leading rows of a zeroed
        bucket-sized array (``pad_batch`` pads in place), copied there in one call."""
        if self.buckets is None:
            return xs[0] if len(xs) == 1 else np.concatenate(xs, axis=0)
        first = xs[0]
        padded = np.zeros((bucket_for(n, self.buckets), first.shape[1]), first.dtype)
        np.concatenate(xs, axis=0, out=padded[:n])
        return PaddedRows.of(padded, n)


class PaddedRows(np.ndarray):
    """The leading ``n`` rows of a zeroed bucket-sized array (``padded``): ``pad_batch`` takes that
    array as the padded batch instead of copying. Any array derived from one (a slice, an index,
    arithmetic) is not: its ``padded`` is None, and it is padded by a copy as any array is."""

    padded: np.ndarray | None = None

    @classmethod
    def of(cls, padded: np.ndarray, n: int) -> PaddedRows:
        rows = padded[:n].view(cls)
        rows.padded = padded
        return rows

    def __array_finalize__(self, obj: Any) -> None:
        self.padded = None


def _rows(x: Any, start: int, stop: int, out: list[np.ndarray]) -> None:
    """Append to ``out`` the arrays holding rows ``start:stop`` of a chunk's ``x`` (one array, or
    its frames' arrays in order: ``Chunk``), as views."""
    if not isinstance(x, list):
        out.append(x[start:stop])
        return
    at = 0  # the chunk's row where ``part`` begins
    for part in x:
        end = at + len(part)
        if end > start:
            if at >= stop:
                break
            out.append(part[max(start - at, 0):min(stop, end) - at])
        at = end


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds n rows; ``buckets`` is sorted ascending."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} rows exceed the largest bucket {buckets[-1]}")
    return buckets[i]


def pad_batch(x: np.ndarray, key: np.ndarray, bucket: int, spare_slot: int, dtype: Any = np.float32) -> Batch:
    """Host arrays padded to ``bucket`` rows: padding has ``valid=False`` and the spare slot;
    ``x`` becomes ``dtype`` (the processor's input dtype) in the copy that pads it. An ``x`` that
    is ``PaddedRows`` of a bucket-sized array of ``dtype`` (``MicroBatcher.take``'s, with
    buckets) is padded already: that array is the batch's, not copied."""
    n, features = x.shape
    padded = getattr(x, "padded", None)  # PaddedRows
    if padded is not None and padded.shape == (bucket, features) and padded.dtype == dtype:
        xp = padded  # the batcher made x in it: the rows beyond n are zeros
    else:
        xp = np.zeros((bucket, features), dtype)
        xp[:n] = x
    kp = np.full(bucket, spare_slot, np.int32)
    kp[:n] = key
    valid = np.zeros(bucket, bool)
    valid[:n] = True
    return Batch(xp, kp, valid)
