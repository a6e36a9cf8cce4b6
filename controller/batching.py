"""Micro-batching: chunks of decoded messages in, fixed-shape padded batches out.

Rules:
- Pure: no threads, no queues, no clock; the caller passes ``now`` (seconds, monotonic).
- ``Chunk`` (IO -> main) and ``Outgoing`` (main -> IO) are the only things that cross the
  bridge between the threads; they are defined where the threads meet (io_loop/crossing.py),
  with the ``Trace`` stamps and ``HOPS``, and imported from there.
- Order is kept: messages leave in the order their chunks were added, and a chunk larger
  than the room left is split, its tail going first into the next batch.
- Size and deadline: a batch holds at most ``max_batch`` messages. After its first message
  the caller may keep adding chunks that are *already waiting* while ``wants_more(now)`` is
  true, i.e. until the batch is full or ``max_wait_s`` has passed since it began collecting.
  The batcher never asks the caller to wait for an empty queue, so a lone message goes
  straight through.
- A batch begins collecting with its first message; what a ``take`` leaves (the rest of a
  chunk, or of chunks, a full batch had no room for) begins collecting again with the first
  chunk added after the take. The time between (the caller stepping the batch taken) is not
  collecting, so a leftover is topped up from what is already waiting before it is cut,
  however long the step was; with nothing waiting it goes out at once, as a lone message does.
- Padding: a batch of n messages is padded to the smallest bucket >= n (``Config.buckets``: powers
  of four up to ``max_batch``) so the jitted step only ever sees a few shapes, all compiled at start-up.
- Stream slots (name -> row of the state table) are controller/slots.py's business.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from forkless.io_loop.crossing import (
    Chunk,
    Trace,
)

__all__ = ["Batch", "MicroBatcher", "Taken", "bucket_for", "pad_batch"]

@dataclass
class Taken:
    """The messages of one micro-batch, in arrival order, before slotting and padding."""

    seq: list[Any]
    stream: list[str]
    x: np.ndarray  # [n, F] of the processor's input dtype (float32 by default)
    received_ns: list[int]
    feed: list[int]  # per message, the feed it came from
    feeds_mixed: bool = False  # True when ``feed`` holds more than one value
    traces: list[Trace] = field(default_factory=list)  # of the sampled messages in this batch
    origin: list[Any] | None = None  # per message its ``Origin`` (None for a WebSocket feed's), if any has one

    def __len__(self) -> int:
        return len(self.seq)


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

    def __init__(self, max_batch: int, max_wait_s: float) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
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
        xs: list[np.ndarray] = []
        received: list[int] = []
        feeds: list[int] = []
        first_feed = self._chunks[0].feed
        mixed = False
        traces: list[Trace] = []
        origins: list[Any] | None = None  # only when a chunk of a replayable source is taken
        while len(seqs) < want:
            chunk = self._chunks[0]
            mixed = mixed or chunk.feed != first_feed
            start = self._offset
            if chunk.trace is not None and start == 0:  # the trace is its first message's
                traces.append(chunk.trace)
            stop = min(len(chunk), start + want - len(seqs))
            if chunk.origin is not None or origins is not None:
                if origins is None:
                    origins = [None] * len(seqs)
                origins.extend(chunk.origin[start:stop] if chunk.origin is not None else [None] * (stop - start))
            seqs.extend(chunk.seq[start:stop])
            streams.extend(chunk.stream[start:stop])
            xs.append(chunk.x[start:stop])
            received.extend([chunk.received_ns] * (stop - start))
            feeds.extend([chunk.feed] * (stop - start))
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
        x = xs[0] if len(xs) == 1 else np.concatenate(xs, axis=0)
        return Taken(seqs, streams, x, received, feeds, mixed, traces, origins)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds n rows; ``buckets`` is sorted ascending."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} rows exceed the largest bucket {buckets[-1]}")
    return buckets[i]


def pad_batch(x: np.ndarray, key: np.ndarray, bucket: int, spare_slot: int, dtype: Any = np.float32) -> Batch:
    """Host arrays padded to ``bucket`` rows: padding has ``valid=False`` and the spare slot;
    ``x`` becomes ``dtype`` (the processor's input dtype) in the copy that pads it."""
    n, features = x.shape
    xp = np.zeros((bucket, features), dtype)
    xp[:n] = x
    kp = np.full(bucket, spare_slot, np.int32)
    kp[:n] = key
    valid = np.zeros(bucket, bool)
    valid[:n] = True
    return Batch(xp, kp, valid)
