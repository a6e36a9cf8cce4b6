"""Micro-batching: chunks of decoded messages in, fixed-shape padded batches out.

Rules:
- Pure: no threads, no queues, no clock; the caller passes ``now`` (seconds, monotonic).
- ``Chunk`` (IO -> main) and ``Outgoing`` (main -> IO) are the only things that cross the
  bridge between the threads.
- Order is kept: messages leave in the order their chunks were added, and a chunk larger
  than the room left is split, its tail going first into the next batch.
- Size and deadline: a batch holds at most ``max_batch`` messages. After its first message
  the caller may keep adding chunks that are *already waiting* while ``wants_more(now)`` is
  true, i.e. until the batch is full or ``max_wait_s`` has passed since the first message.
  The batcher never asks the caller to wait for an empty queue, so a lone message goes
  straight through.
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

# ---- the latency budget: hop times of a sample of messages ---------------------------------

SAMPLE_EVERY = 64  # one message in this many carries a Trace (cheap enough to leave on)
# the stamps of a Trace, in the order a message passes them (time.monotonic_ns, every thread)
READ, DECODED, INBOUND, TAKEN, STEP, FETCHED, ENCODED, OUTBOUND, PICKED, WRITTEN = range(10)
HOPS = ("decode", "gather", "inbound", "batch", "step", "encode", "assemble", "outbound", "write")
"""The hops between consecutive stamps: ``decode`` frame read -> decoded; ``gather`` -> put on
the inbound queue (frames of one loop turn gathered into a chunk); ``inbound`` -> taken by the
main thread (queue wait and wake-up); ``batch`` -> the step starts (micro-batching, earlier
batches); ``step`` -> outputs on the host (pad, run, device-to-host); ``encode`` -> reply
frames made; ``assemble`` -> put on the outbound queue (error frames, results callback);
``outbound`` -> taken by the IO thread's writer (queue wait and wake-up); ``write`` -> its
batch of frames written to the socket. A stamp is taken just before a put, so time a put
waits for room counts in the next hop."""


class Trace:
    """The stamps of one sampled message (``READ`` … ``WRITTEN``), each written once, by the
    thread at that hop; the IO thread reads them all after ``WRITTEN`` (see ``HOPS``)."""

    __slots__ = ("feed", "ns")

    def __init__(self, feed: int, read_ns: int, decoded_ns: int) -> None:
        self.feed = feed
        self.ns = [read_ns, decoded_ns, 0, 0, 0, 0, 0, 0, 0, 0]

    def hops_s(self) -> list[float]:
        """Seconds spent in each of ``HOPS``, then the whole way (read to written)."""
        ns = self.ns
        return [(ns[i + 1] - ns[i]) * 1e-9 for i in range(len(HOPS))] + [(ns[WRITTEN] - ns[READ]) * 1e-9]


@dataclass
class Chunk:
    """Messages from one inbound frame, column-wise, with the time the frame arrived."""

    seq: list[Any]
    stream: list[str]
    x: np.ndarray  # float32 [n, F]
    received_ns: int
    feed: int = 0  # index of the feed (``Config.feed_specs``) whose connection it came from
    trace: Trace | None = None  # one in SAMPLE_EVERY messages: its first message's hop times

    def __len__(self) -> int:
        return len(self.seq)


@dataclass
class Outgoing:
    """Frames for the IO thread to send, in order.

    ``answers``: True when every frame answers one received message (results, and error
    replies such as "too many streams"), False for the error replies to bad input the
    reader makes itself (not messages: outside the message books). ``error_at`` holds the
    positions of the error frames among the answers (sorted), so a writer that is stopped
    part-way through an item still counts exactly how many results it wrote.
    ``received_ns`` holds, for each frame that answers a message, when its frame arrived
    (monotonic ns), for the received-to-sent latency. ``feed`` is the index of the feed whose
    connection the frames go back on (their messages came from it).

    A batch that mixed several feeds crosses as one bundle (one queue hand-over, one wake-up
    of the IO thread): ``parts`` holds one ``Outgoing`` per feed and ``frames`` is empty; the
    IO side's router hands each part to its feed (``unbundled``).
    """

    frames: list[str | bytes]
    received_ns: list[int] = field(default_factory=list)
    error_at: tuple[int, ...] = ()
    answers: bool = True
    feed: int = 0
    parts: tuple[Outgoing, ...] = ()
    traces: list[Trace] = field(default_factory=list)  # sampled messages among those answered here

    def unbundled(self) -> tuple[Outgoing, ...]:
        """The items to send: the parts of a bundle, else this item itself."""
        return self.parts or (self,)

    @property
    def frame_count(self) -> int:
        """Frames to send, a bundle's parts included."""
        return sum(len(part.frames) for part in self.parts) if self.parts else len(self.frames)

    @property
    def results(self) -> int:
        """How many of the frames are results."""
        return len(self.frames) - len(self.error_at) if self.answers else 0

    def errors_between(self, start: int, stop: int) -> int:
        """How many of ``frames[start:stop]`` are error frames."""
        if not self.answers:
            return stop - start
        return bisect.bisect_left(self.error_at, stop) - bisect.bisect_left(self.error_at, start)


def count_unsent(items: list[tuple[Outgoing | None, int]]) -> tuple[int, int]:
    """For ``(item, frames already written)`` pairs that will never be sent further: how many
    unsent frames answer received messages, and how many are error replies to bad input."""
    answers = errors = 0
    for item, written in items:
        for part in item.unbundled() if item is not None else ():
            if part.answers:
                answers += len(part.frames) - written
            else:
                errors += len(part.frames) - written
    return answers, errors


@dataclass
class Taken:
    """The messages of one micro-batch, in arrival order, before slotting and padding."""

    seq: list[Any]
    stream: list[str]
    x: np.ndarray  # float32 [n, F]
    received_ns: list[int]
    feed: list[int]  # per message, the feed it came from
    feeds_mixed: bool = False  # True when ``feed`` holds more than one value
    traces: list[Trace] = field(default_factory=list)  # of the sampled messages in this batch

    def __len__(self) -> int:
        return len(self.seq)


class Batch(NamedTuple):
    """What a processor's ``step`` receives; every leaf has the bucket size B as leading axis.

    ``x``: float32 [B, F]; ``key``: int32 [B] state slot of the message's stream;
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
        """Queue a chunk; ``now`` starts the deadline if the batcher was empty."""
        if len(chunk) == 0:
            return
        if self._size == 0:
            self._first_at = now
        self._chunks.append(chunk)
        self._size += len(chunk)

    def wants_more(self, now: float) -> bool:
        """True while the next batch has room and its first message is younger than max_wait."""
        if self._size == 0:
            return True
        if self._size >= self.max_batch:
            return False
        return self._first_at is not None and now - self._first_at < self.max_wait_s

    def take(self, now: float) -> Taken | None:
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
        while len(seqs) < want:
            chunk = self._chunks[0]
            mixed = mixed or chunk.feed != first_feed
            start = self._offset
            if chunk.trace is not None and start == 0:  # the trace is its first message's
                traces.append(chunk.trace)
            stop = min(len(chunk), start + want - len(seqs))
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
        # what is left was already waiting, so its deadline starts now
        self._first_at = now if self._size else None
        x = xs[0] if len(xs) == 1 else np.concatenate(xs, axis=0)
        return Taken(seqs, streams, x, received, feeds, mixed, traces)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds n rows; ``buckets`` is sorted ascending."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} rows exceed the largest bucket {buckets[-1]}")
    return buckets[i]


def pad_batch(x: np.ndarray, key: np.ndarray, bucket: int, spare_slot: int) -> Batch:
    """Host arrays padded to ``bucket`` rows: padding has ``valid=False`` and the spare slot."""
    n, features = x.shape
    xp = np.zeros((bucket, features), np.float32)
    xp[:n] = x
    kp = np.full(bucket, spare_slot, np.int32)
    kp[:n] = key
    valid = np.zeros(bucket, bool)
    valid[:n] = True
    return Batch(xp, kp, valid)
