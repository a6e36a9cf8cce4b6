"""JetStreamFeed: one JetStream feed (an entry of ``FORKLESS_FEEDS`` with ``"nats"``), in the role a
``FeedClient`` has for a WebSocket feed: consume, decode, hand chunks over, publish the replies,
reconnect. Imported only when such a feed is configured (nats-py is an optional extra).

Rules:
- Runs on the IO loop only, beside the WebSocket feeds (io_loop/feeds.py), with the same inbound
  queue; its hand-over always blocks (``FORKLESS_OVERFLOW=drop_oldest`` does not apply: a dropped
  message would break the exactly-once state).
- Where it starts: the position the restored checkpoint recorded (``resume``, the last
  ``Origin`` the main thread had consumed, handed in by the controller at start), else the
  entry's ``start`` ("first": the stream's first message, "new": what arrives after the
  first connection; checkpoints that were all damaged hand ``PositionUnknown``: it starts
  at the stream's first message only if ``start`` is "first" and the stream holds every
  message from sequence 1, else ``PositionLost``). From then on it keeps its own position,
  ``(next stream sequence, good elements of it already handed over)``, and every connection
  makes a new consumer starting there: the server's consumer holds nothing we need.
- Consuming: an ephemeral pull consumer (deliver from a start sequence, ack policy "all",
  ``max_ack_pending`` bounded, memory storage, removed by the server after ``INACTIVE_S``
  unused). One pull request at a time for ``pull_batch`` messages, with idle heartbeats; the
  next is asked for only once the messages of the last are handed over, so a full inbound
  queue stops fetching, and the server never has more than ``pull_batch`` messages out to us.
  Deliveries come through a raw subscription (io_loop/nats_compat.py: nats-py's protocol parser
  hands us the bytes, no ``Msg`` per message), their numbers (times delivered, stream and consumer
  sequence, pending) read from the reply subject (``delivery_numbers``, both of JetStream's token
  layouts; a delivery without one drops the connection).
  A delivery below the position (a redelivery) is skipped; a first delivery whose consumer
  sequence is not the next one (a gap), or a redelivery of a message never consumed, drops the
  connection, and the next consumer starts at the position again.
- Acks: the last message of each pull, once every message of it is handed over. They are flow
  control only (``max_ack_pending``, no redelivery of what this process holds): a restart
  resumes from the checkpoint's position, a reconnect from this feed's own.
- Decoding: the codec's ``decode`` on each payload, exactly as for a WebSocket frame; a payload
  over ``max_msg_bytes`` is not decoded: one error reply ("message too large"), counted, and
  acknowledged with the others (the connection stays up: the stream would deliver it again). Good
  elements get ``Origin(seq, i, last)`` with i = 0, 1, … in order; the error replies to bad
  ones are indexed after the good ones (deterministic, so a replay makes the same ids).
- Replies: the outbox's items in order (the main thread's results and error replies, and this
  feed's error replies to bad input), each frame published to the ``results`` subject with the
  header ``Nats-Msg-Id: <stream>:<seq>:<index>`` and a reply subject of this feed's own,
  ``<inbox><n>`` (one raw subscription per connection, ``_Acks``); an item's frames are written
  as one buffer of HPUB commands (``reply_commands``, ``nats_compat.publish_commands``) and their
  acknowledgements awaited together before the next item, and what was not acknowledged (from
  the first frame not acknowledged on) is published again after a reconnect (the results
  stream's duplicate window drops a copy). ``SourceStats.confirmed`` is the origin of
  the last main-thread reply acknowledged: a checkpoint is committed only once every reply to
  the messages it covers is (controller/loop.py).
- A partitioned feed is fenced by its leases (``fence``, the store's ``holds``): before each
  item is published, a False ``fence`` (a lease lost, or run out unrenewed after a pause) drops
  the item instead, counted in ``dropped`` ("lease lost") and logged once: another instance may
  own the partitions now and answers those messages from its checkpoint.
- Reconnect on any loss (connection, server restart, heartbeats missing, a publish not
  acknowledged) with the same ``Backoff`` as the WebSocket feeds; tries used up, or the server
  refusing the credentials: ``FeedFatal`` (exit 3). At every connection the stream is checked
  against the position: if it no longer holds the messages the position needs (retention), or
  ends before it (a stream made again): ``PositionLost`` (exit 2). Retention is judged by the
  feed's own subjects: a pull that ends with nothing more to deliver (or a delivery with
  nothing pending) proves the stream held no further message of them up to the last sequence
  it had reached before the request (``SourceStats.covered``, recorded in checkpoints), so
  only a first sequence past that refuses. A stream whose created time differs from the one
  this run first connected to, or that ends before a sequence this run saw in it, was made
  again: ``PositionLost`` too, never resumed into.
- Secrets (the URL's user:password, ``token``, the creds file's content) are never logged.
- A partitioned feed (``partition_count``, issue 24) consumes its owned partitions' subjects
  with one consumer (``filter_subjects``). A restore hands it one position per partition
  (``resume`` by partition: each partition's checkpoint object has its own); it starts at the
  lowest and skips, per partition, the messages (and the good elements of a message) that the
  partition's position covers, until it is past all of them. A partition without a recorded
  position starts per ``start``. An element whose stream is not in the partition of the
  subject it came on (``partition_of(escape_stream(stream))``, the server's function: a
  publisher that did not escape the name, or another partition count) is an error reply,
  counted, never applied: its state would belong to another partition. At every connection
  the stream's subject transform is checked against ``partition_count`` and the subject, as
  ``--check`` does: a disagreement is ``FeedFatal`` (exit 3), naming both values.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors
import numpy as np
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from io_loop.backoff import Backoff
from io_loop.client import End, FeedControl, Outcome, pause_before_reconnect
from io_loop.counters import IOStats, SourceStats
from io_loop.crossing import Origin, Outgoing, PositionUnknown, Resume
from io_loop.decoding import FrameDecoder
from io_loop.errors import FeedFatal, PositionLost
from io_loop.handover import Handover
from io_loop.nats_compat import RawClient, publish_commands
from io_loop.natsconn import (
    NATS_ERRORS,
    close_quietly,
    connect_once,
    connect_options,
    duplicate_ack,
    unsubscribe_quietly,
)
from io_loop.natsconn import NatsConnectFailed as _Failed
from io_loop.natsconn import describe_error as _describe
from io_loop.partitions import escape_stream, format_partitions, partition_of, partition_transform, transform_problems
from io_loop.settings import FeedSpec, IOSettings, JetStreamSpec
from io_loop.writer import HeldReply

__all__ = ["JetStreamFeed", "delivery_numbers", "msg_id", "probe_jetstream", "reply_commands"]

log = logging.getLogger("forkless.jetstream")

PULL_BATCH_MIN = 64  # messages asked for in one pull request (at least; MAX_BATCH when larger)
PULL_EXPIRES_S = 5.0  # a pull request with nothing to deliver ends after this long (then a new one)
PULL_HEARTBEAT_S = 1.0  # the server's idle heartbeat on an open pull request
MISSED_HEARTBEATS = 3  # nothing at all for this many heartbeats: the connection is dropped
ACK_WAIT_S = 30.0
INACTIVE_S = 30.0  # an ephemeral consumer unused this long (its process killed) is removed by the server
STREAM_INFO_EVERY_S = 1.0  # the stream's last sequence (for the lag) is read this often
GIVE_UP_CLOSE_S = 0.25
FOREIGN_REASON = "stream not in this subject's partition"
TOO_LARGE_REASON = "message too large"  # a payload over FORKLESS_MAX_MSG_BYTES
PARTITION_CACHE = 1 << 20  # streams whose partition is remembered (the cache is emptied when full)


def msg_id(stream: str, origin: Origin) -> str:
    """The ``Nats-Msg-Id`` of a reply: ``<stream name>:<stream sequence of the input>:<index>``."""
    return f"{stream}:{origin.seq}:{origin.index}"


def reply_commands(subject: bytes, inbox: bytes, first: int, stream: str, frames: list[Any],
                   origins: list[Origin], max_payload: int) -> bytes:
    """The NATS protocol commands publishing ``frames`` (str or bytes) to ``subject``, frame k
    with the header ``Nats-Msg-Id: msg_id(stream, origins[k])`` and the reply subject
    ``<inbox><first + k>`` (where the results stream acknowledges it), as one buffer
    (nats_compat.publish_commands). A frame larger than the server's ``max_payload``:
    ``MaxPayloadError``, as nats-py's ``publish`` raises."""
    header = b"NATS/1.0\r\nNats-Msg-Id: " + stream.encode() + b":"
    parts: list[bytes] = []
    add = parts.append
    for k, frame in enumerate(frames):
        payload = frame if type(frame) is bytes else frame.encode()
        if len(payload) > max_payload:
            raise nats.errors.MaxPayloadError
        origin = origins[k]
        hdr = header + b"%d:%d\r\n\r\n" % (origin.seq, origin.index)
        add(b"HPUB %s %s%d %d %d\r\n" % (subject, inbox, first + k, len(hdr), len(hdr) + len(payload)))
        add(hdr)
        add(payload)
        add(b"\r\n")
    return b"".join(parts)


def delivery_numbers(reply: bytes) -> tuple[int, int, int, int] | None:
    """A JetStream delivery's ``(times delivered, stream sequence, consumer sequence, pending)``
    from its reply subject, ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer
    seq>.<timestamp>.<pending>``, or with a domain and an account hash after ``$JS.ACK`` (11 or
    more tokens, the newer servers'); None for anything else."""
    tokens = reply.split(b".")
    n = len(tokens)
    if n == 9:
        at = 4
    elif n >= 11:
        at = 6
    else:
        return None
    if tokens[0] != b"$JS" or tokens[1] != b"ACK":
        return None
    try:
        return int(tokens[at]), int(tokens[at + 1]), int(tokens[at + 2]), int(tokens[at + 4])
    except ValueError:
        return None


@dataclass
class _Part:
    """The good elements of a payload not yet handed over (after a partly consumed message)."""

    seq: list[Any]
    stream: list[str]
    x: Any

    def __len__(self) -> int:
        return len(self.seq)


@dataclass
class _NotDecoded:
    """A payload refused before the codec saw it (over ``max_msg_bytes``): no element, one error."""

    errors: list[tuple[str, Any]]

    def __len__(self) -> int:
        return 0

    def error_counts(self) -> list[tuple[str, int]]:
        return [(reason, 1) for reason, _ in self.errors]


class _Acks:
    """The results stream's acknowledgements of the item being published: frame k of it was
    published with the reply subject ``<inbox><base + k>``. ``wake`` is set once every frame is
    acknowledged, or at the first error (an error response, no stream storing the subject)."""

    def __init__(self, cut: int) -> None:
        self.cut = cut  # the length of ``<inbox>``
        self.base = 0
        self.done = bytearray()
        self.acked = 0
        self.duplicates = 0
        self.error: Exception | None = None
        self.wake = asyncio.Event()

    def begin(self, base: int, n: int) -> None:
        self.base, self.done, self.acked, self.error = base, bytearray(n), 0, None

    def complete(self) -> bool:
        return self.acked == len(self.done) or self.error is not None

    def prefix(self) -> int:
        """Frames acknowledged in order from the item's first."""
        first_missing = self.done.find(0)
        return len(self.done) if first_missing < 0 else first_missing

    def on_ack(self, subject: bytes, _reply: bytes, data: bytes, headers: dict[str, str] | None) -> None:
        """One acknowledgement, from nats_compat.RawClient (a raw subscription to ``<inbox>*``)."""
        try:
            k = int(subject[self.cut:]) - self.base
        except ValueError:
            return
        if not 0 <= k < len(self.done) or self.done[k] or self.error is not None:
            return  # an earlier item's (acknowledged after a timeout), or a copy
        status = headers.get("Status") if headers else None
        if status:
            self.error = (nats.js.errors.NoStreamResponseError() if status == "503" else
                          nats.errors.Error(f"the server answered {status} {headers.get('Description', '')}"))
        elif b'"error":' in data and "error" in (resp := json.loads(data)):
            self.error = nats.js.errors.APIError.from_error(resp["error"])
        else:
            self.done[k] = 1
            self.acked += 1
            if duplicate_ack(data):
                self.duplicates += 1
        if self.complete():
            self.wake.set()


def _when(created: Any) -> str:
    """A stream's created time (nats-py's datetime) as the server's UTC text."""
    return created.isoformat() if hasattr(created, "isoformat") else str(created)


def _same_time(created: Any, recorded: str) -> bool:
    """A stream's created time is the one recorded (as ``_when`` wrote it), to the millisecond
    (what another nats-py version might round differently; two streams are never made that close)."""
    try:
        return abs((created - datetime.datetime.fromisoformat(recorded)).total_seconds()) < 1e-3
    except (TypeError, ValueError):
        return _when(created) == recorded


class JetStreamFeed(FeedControl):
    """One JetStream feed (see the module rules). ``inbound``: the bridge's inbound queue;
    ``outbox``: where its replies come from and its error replies to bad input go; ``stats``:
    its own counters (``stats.source`` is its position); ``resume``: the last ``Origin`` the
    restored checkpoint recorded for it (None: start per ``start``)."""

    def __init__(self, settings: IOSettings, codec: FrameDecoder, stats: IOStats, feed: FeedSpec, *, inbound: Any,
                 outbox: Any, index: int = 0, resume: Origin | None = None,
                 fence: Callable[[], bool] | None = None) -> None:
        assert feed.jetstream is not None
        self.fence = fence  # a partitioned instance's leases: False once it may no longer publish
        self.settings = settings
        self.codec = codec
        self.feed = feed
        self.spec = feed.jetstream
        self.outbox = outbox
        self.stats = stats
        self.source = stats.source = SourceStats()
        self.shown_url = feed.shown_url
        self.replies = getattr(feed, "replies", "all")  # the feed's reply policy: all, results or none
        self.pull_batch = max(PULL_BATCH_MIN, settings.max_batch)
        self.handover = Handover(inbound, settings.max_batch, drop_oldest=False, on_dropped=lambda _: None,
                                 feed=index)
        self._unknown = ""  # why the checkpoints' position is unknown (all damaged: PositionUnknown)
        if isinstance(resume, PositionUnknown):
            self._unknown, resume = resume.why, None
        self._recorded_created = ""  # the stream's created time the restored checkpoint recorded
        if isinstance(resume, Resume):
            self._recorded_created, resume = resume.stream_created, resume.origin
        self.resume = resume
        # a partitioned feed's restored positions: partition -> (next sequence, elements to skip)
        self._floors: dict[int, tuple[int, int]] | None = None
        if isinstance(resume, dict):
            self._floors = {p: origin.resume() for p, origin in resume.items()}
            resume = None
        self._floors_end = 0  # at and after this sequence no floor can apply
        self._partition_cache: dict[str, int] = {}
        self._next: tuple[int, int] | None = resume.resume() if resume is not None else None
        self._from_checkpoint = resume is not None or bool(self._floors)  # until the first message is handed over
        if self._next is not None:
            self.source.next_seq = self._next[0]
        self._stopping = False
        self.held = HeldReply(outbox, stats)  # the reply item being published; survives reconnects
        self._reader_task: asyncio.Task | None = None
        self._reader_in_handover = False
        self._ack_sub: Any = None  # the writer's subscription to the acknowledgements
        self._fenced = False  # the fence refused a publication (logged once)
        self._connection_id = 0
        self._live = 0  # the connection being served (0: none); its loops end when it changes
        self._nats_error = ""
        self._stream_created: Any = None  # the stream's created time at this run's first connection
        self.stop_deadline: float | None = None  # monotonic; the stop's, given to stop_reading

    # ---- the connection loop ------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, serve, reconnect, until stopped and every reply is published (or FeedFatal,
        PositionLost)."""
        cfg = self.settings
        backoff = Backoff.from_settings(cfg)
        while not self.held.drained:
            try:
                nc, closed = await self._connect()
            except _Failed as exc:
                if exc.fatal:
                    raise FeedFatal(f"{self.feed.label}: {exc}") from None
                self.stats.connect_failures += 1
                self.stats.last_error = str(exc)
                delay = backoff.failed()
                if delay is None:
                    raise FeedFatal(f"giving up on {self.feed.label} after {backoff.failures} failed attempts "
                                    f"in a row: {exc}") from None
                log.warning("%s: %s; retrying in %.2fs", self.feed.label, exc, delay)
                await pause_before_reconnect(self, delay)
                continue
            backoff.connected(time.monotonic())
            end = await self._serve(nc, closed)
            backoff.disconnected(time.monotonic())
            if end.outcome is not Outcome.CLOSED:
                self.stats.last_error = end.reason
            if self.held.drained:
                break
            delay = backoff.failed()
            if delay is None:
                raise FeedFatal(f"giving up on {self.feed.label} after {backoff.failures} lost connections "
                                f"in a row: {end.reason}")
            log.warning("%s: connection %d lost: %s; reconnecting in %.2fs", self.feed.label,
                        self._connection_id, end.reason, delay)
            self.stats.reconnects += 1
            await pause_before_reconnect(self, delay)


    async def _connect(self) -> tuple[Any, asyncio.Event]:
        """One attempt: connect to a server of the list, read the stream's state, check the
        position against it. Raises ``_Failed`` (retried), ``PositionLost``."""
        cfg = self.settings
        closed = asyncio.Event()

        async def on_closed() -> None:
            closed.set()

        async def on_error(exc: Exception) -> None:  # nats-py's default logs a traceback per error
            self._nats_error = _describe(exc)

        options = connect_options(cfg, self.feed, error_cb=on_error, disconnected_cb=on_closed, closed_cb=on_closed)
        try:
            nc = await connect_once(cfg, options, RawClient())
        except _Failed as exc:
            if exc.fatal:
                raise _Failed(f"the server refused the credentials (check the user:password in \"nats\", "
                              f"\"token\" or \"creds\" of {self.feed.label})", fatal=True) from None
            raise _Failed(f"cannot connect to {self.shown_url}: {self._nats_error or exc}") from None
        try:
            try:
                info = await nc.jsm(timeout=cfg.connect_timeout_s).stream_info(self.spec.stream)
            except nats.js.errors.NotFoundError:
                raise _Failed(f"stream {self.spec.stream!r} not found on {self.shown_url}") from None
            except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError):
                raise _Failed(f"JetStream is not enabled on {self.shown_url} (nats-server -js)") from None
            except NATS_ERRORS as exc:
                raise _Failed(f"reading stream {self.spec.stream!r} failed: {_describe(exc)}") from None
            if self.spec.partitioned:  # the stream must partition as the feed expects (as --check says)
                problems = _check_partitions(self.spec, info.config, lambda line: None)
                if problems:
                    raise FeedFatal(f"{self.feed.label}: " + "; ".join(problems))
            self._check_identity(info.state.last_seq, info.created)
            self._check_position(info.state.first_seq, info.state.last_seq, info.state.num_deleted or 0)
        except BaseException:
            await close_quietly(nc, GIVE_UP_CLOSE_S)
            raise
        return nc, closed

    def _start_without_position(self, first: int, last: int, deleted: int) -> None:
        """Every checkpoint was damaged: the position they recorded is unknown. Consuming the
        stream from its first message rebuilds the same state only if the feed's ``start`` is
        "first" and the stream still holds every message it ever stored (first sequence 1,
        none deleted); anything else may lose messages the state held: ``PositionLost``."""
        why, self._unknown = self._unknown, ""
        if (self.spec.start == "first" or last == 0) and first <= 1 and not deleted:  # (or it never held any)
            log.warning("%s: %s, but stream %r holds every message from sequence 1 (to %d): consuming all of it "
                        "again rebuilds the state (replies older than the results stream's duplicate window are "
                        "stored again)", self.feed.label, why, self.spec.stream, last)
            return
        holds = (f"its first sequence is {first}" if first > 1 else f"{deleted} of its messages were deleted"
                 if deleted else "it holds every message")
        unsafe = (f"messages the lost state held may be gone from stream {self.spec.stream!r} ({holds})"
                  if self.spec.start == "first" and (first > 1 or deleted) else
                  f"the feed's \"start\" is \"new\", which would skip what arrived since (stream "
                  f"{self.spec.stream!r}: {holds})")
        raise PositionLost(
            f"{self.feed.label}: {why}, so the position they recorded is unknown, and {unsafe}: refusing to start "
            f"fresh. To start fresh anyway, accepting the loss, start with FORKLESS_CHECKPOINT_RESTORE=never (the "
            f"state starts empty and the feed at its \"start\")")

    def _check_identity(self, last: int, created: Any) -> None:
        """``PositionLost`` when the stream is not the one this run consumed: its created time
        differs from the first connection's, or it ends before a sequence this run saw in it
        (a stream deleted and made again numbers its messages from 1 again: resuming at this
        run's position in it would skip the new stream's first messages)."""
        source = self.source
        fix = ("start with FORKLESS_CHECKPOINT_RESTORE=never to accept the loss (the state starts empty and "
               "the feed at its \"start\")")
        if created is not None:
            if self._stream_created is None:
                if self._recorded_created and not _same_time(created, self._recorded_created):
                    raise PositionLost(
                        f"{self.feed.label}: stream {self.spec.stream!r} was deleted and made again since the "
                        f"checkpoint was written: created {_when(created)}, but the checkpoint recorded its "
                        f"position in a stream created {self._recorded_created}; its sequences are not the ones "
                        f"the checkpoint's position counts. To continue anyway, {fix}")
                self._stream_created = created
                source.stream_created = _when(created)
            elif created != self._stream_created:
                raise PositionLost(
                    f"{self.feed.label}: stream {self.spec.stream!r} was deleted and made again: created "
                    f"{_when(created)}, but at this run's first connection it had been created "
                    f"{_when(self._stream_created)}; "
                    f"its sequences are not the ones this run's position counts. To continue anyway, {fix}")
        if last < source.stream_last_seq:
            raise PositionLost(
                f"{self.feed.label}: stream {self.spec.stream!r} ends at sequence {last}, but this run saw it reach "
                f"{source.stream_last_seq}: was the stream deleted and made again? To continue anyway, {fix}")

    def _check_position(self, first: int, last: int, deleted: int = 0) -> None:
        """Where consuming starts; ``PositionLost`` when the stream cannot give what it needs
        (``deleted``: the stream's count of messages removed from its middle)."""
        source = self.source
        if self._unknown and self._next is None:
            self._start_without_position(first, last, deleted)
        source.stream_last_seq = max(source.stream_last_seq, last)
        if self._next is None and self._floors:  # a partitioned feed's restored positions: start at the lowest
            fresh = (max(first, 1), 0) if self.spec.start == "first" else (last + 1, 0)
            for p in self.spec.partitions:
                self._floors.setdefault(p, fresh)
            self._next = min(self._floors.values())
            self._floors_end = max(seq for seq, _ in self._floors.values()) + 1
            source.next_seq = self._next[0]
        if self._next is None:
            self._next = (max(first, 1), 0) if self.spec.start == "first" else (last + 1, 0)
            source.next_seq = self._next[0]
            log.info("%s: no recorded position; starting at stream sequence %d (\"start\": %r)",
                     self.feed.label, self._next[0], self.spec.start)
            return
        need, skip = self._next
        applied = need if skip else need - 1
        whose = "the checkpoint" if self._from_checkpoint else "this run"
        fix = ("start with FORKLESS_CHECKPOINT_RESTORE=never to accept the loss (the state starts empty and "
               "the feed at its \"start\")")
        if need > last + 1:
            raise PositionLost(
                f"{self.feed.label}: stream {self.spec.stream!r} ends at sequence {last}, but {whose} recorded "
                f"{applied} as the last applied: was the stream deleted and made again? To continue anyway, {fix}")
        # no message of the feed's own subjects is missing below the first one that the consumer, at
        # the position, found nothing more after (other subjects' messages there are not ours)
        covered = source.covered[1] if source.covered[0] == need - 1 and not skip else 0
        if first > max(need, covered + 1) and need <= last:
            beyond = f", and none of its subjects' up to {covered}" if covered >= need else ""
            raise PositionLost(
                f"{self.feed.label}: stream {self.spec.stream!r} no longer holds messages {whose} needs: its first "
                f"sequence is {first}, {whose} recorded {applied} as the last applied (the next needed is "
                f"{need}{beyond}); retention removed them. Keep messages longer in the stream (max_age, max_msgs, "
                f"max_bytes), or {fix}")
        log.info("%s: resuming at stream sequence %d%s (%s's position)", self.feed.label, need,
                 f", after its first {skip} elements" if skip else "", whose)

    async def _serve(self, nc: Any, closed: asyncio.Event) -> End:
        """Run one connection until it is lost or everything is published."""
        self._connection_id += 1
        conn = self._live = self._connection_id
        stats = self.stats
        stats.connects += 1
        stats.connected = True
        stats.state_since = time.time()
        log.info("%s: connection %d open (stream %r, subject %r, replies to %r)", self.feed.label, conn,
                 self.spec.stream, self.spec.subject or ">", self.spec.results or "(none)")
        tasks: set[asyncio.Task] = set()
        try:
            writer = asyncio.create_task(self._write(nc), name="forkless-js-writer")
            lost = asyncio.create_task(closed.wait(), name="forkless-js-closed")
            watch = asyncio.create_task(self._watch_stream(nc), name="forkless-js-stream")
            tasks |= {writer, lost, watch}
            reader = None
            if not self._stopping:
                reader = self._reader_task = asyncio.create_task(self._read(nc), name="forkless-js-reader")
                tasks.add(reader)
            while True:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                if writer in done:
                    end = writer.result()
                    if end.outcome is not Outcome.DRAINED:
                        return end
                    if self._fenced:
                        log.info("%s: connection %d closed; the replies left were dropped (the leases are lost)",
                                 self.feed.label, conn)
                    else:
                        log.info("%s: connection %d closed after publishing every reply", self.feed.label, conn)
                    return End(Outcome.CLOSED)
                if reader is not None and reader in done:
                    tasks.discard(reader)
                    if reader.cancelled() or reader.result().outcome is Outcome.STOPPED:
                        reader = None
                        continue  # stopping: keep publishing until outbound is drained
                    return reader.result()
                if lost in done:
                    return End(Outcome.LOST, f"connection lost{': ' + self._nats_error if self._nats_error else ''}")
                return watch.result()
        except NATS_ERRORS as exc:
            return End(Outcome.LOST, _describe(exc))
        finally:
            self._live = 0
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)
            await close_quietly(nc, GIVE_UP_CLOSE_S)
            stats.connected = False
            stats.state_since = time.time()

    # ---- consuming ------------------------------------------------------------------------------------

    async def _read(self, nc: Any) -> End:
        spec, conn = self.spec, self._live
        start, _ = self._next
        name = f"forkless-{self.feed.name}-{secrets.token_hex(6)}"
        subjects = spec.subjects()
        try:
            await nc.jsm(timeout=self.settings.connect_timeout_s).add_consumer(spec.stream, ConsumerConfig(
                name=name, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start,
                ack_policy=AckPolicy.ALL, ack_wait=ACK_WAIT_S, max_ack_pending=2 * self.pull_batch,
                filter_subject=subjects[0] if len(subjects) == 1 else None,
                filter_subjects=list(subjects) if len(subjects) > 1 else None,
                inactive_threshold=INACTIVE_S, mem_storage=True))
        except NATS_ERRORS as exc:
            return End(Outcome.LOST, f"creating the consumer failed: {_describe(exc)}")
        inbox = nc.new_inbox()
        # deliveries go to a queue of ours, awaited directly (nats-py's next_msg waits in a task of its
        # own with asyncio.wait_for, which on Python 3.11 can swallow a cancellation: the stop's, the end
        # of a connection, when a message arrives at the same moment, and the reader then runs on), as
        # (the message's subject, reply subject, payload, headers) straight from the protocol parser
        # (nats_compat.RawClient)
        deliveries: asyncio.Queue = asyncio.Queue()
        sub = await nc.raw_subscribe(inbox, lambda subject, reply, data, headers: deliveries.put_nowait(
            (subject, reply, data, headers)))
        request = json.dumps({"batch": self.pull_batch, "expires": int(PULL_EXPIRES_S * 1e9),
                              "idle_heartbeat": int(PULL_HEARTBEAT_S * 1e9)}).encode()
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{spec.stream}.{name}"
        expected = 1  # the consumer sequence of the next first delivery
        try:
            while self._live == conn:
                # the stream reached this before the request: a pull that ends with nothing more for us
                # says no message of the feed's subjects up to it is left (_covered)
                known_last = self.source.stream_last_seq
                await nc.publish(subject, request, reply=inbox)
                got, last = 0, b""
                while got < self.pull_batch:
                    try:  # a delivery already queued is taken without a timer (most of them, at full speed)
                        where, reply, data, headers = deliveries.get_nowait()
                    except asyncio.QueueEmpty:
                        try:
                            async with asyncio.timeout(PULL_HEARTBEAT_S * MISSED_HEARTBEATS):
                                where, reply, data, headers = await deliveries.get()
                        except TimeoutError:
                            return End(Outcome.LOST, f"nothing from the consumer for "
                                                     f"{PULL_HEARTBEAT_S * MISSED_HEARTBEATS:g}s (no heartbeat)")
                    status = headers.get("Status") if headers else None
                    if status:
                        if status == "100":  # idle heartbeat
                            continue
                        if status in ("404", "408"):  # no messages / the request expired: ask again
                            self._covered(known_last)
                            break
                        return End(Outcome.LOST, f"the consumer answered {status} "
                                                 f"{headers.get('Description', '')}".strip())
                    numbers = delivery_numbers(reply)
                    if numbers is None:
                        return End(Outcome.LOST, f"a delivery without JetStream's reply subject: {reply[:200]!r}")
                    got += 1
                    last = reply
                    delivered, seq, consumer_seq, pending = numbers
                    if delivered == 1:
                        if consumer_seq != expected:
                            return End(Outcome.LOST, f"delivery gap at stream sequence {seq} (consumer sequence "
                                                     f"{consumer_seq}, expected {expected})")
                        expected += 1
                    if seq < self._next[0]:  # consumed already (a redelivery)
                        self.source.skipped += 1
                        continue
                    if delivered > 1:
                        return End(Outcome.LOST, f"stream sequence {seq} redelivered before it was consumed")
                    await self._consume(data, seq, pending, where)
                    if pending == 0:  # nothing of the feed's subjects after it, as far as the stream had reached
                        self._covered(max(seq, known_last))
                    if self._stopping:
                        break
                if last:
                    await nc.publish(last.decode())  # the ack; ack policy "all": everything up to it
                if self._stopping:
                    return End(Outcome.STOPPED)
            return End(Outcome.LOST, "connection over")
        finally:
            await unsubscribe_quietly(sub)

    def _covered(self, seq: int) -> None:
        """Every message of the feed's subjects up to ``seq`` is handed over: the consumer, made at
        the position, had nothing more to deliver when the stream had reached ``seq``. Retention
        of other subjects' messages up to it loses nothing of ours (``_check_position``). Not
        while a message is partly handed over (a restored position inside a payload)."""
        if self._next is not None and self._next[1] == 0 and seq > self.source.covered[1]:
            self.source.covered = (self._next[0] - 1, seq)

    async def _consume(self, data: bytes, seq: int, pending: int, subject: bytes | str = b"") -> None:
        """Decode one stream message and hand its good elements over (those not handed over before)."""
        stats, source, codec = self.stats, self.source, self.codec
        received = time.monotonic_ns()
        source.fetched += 1
        source.stream_last_seq = max(source.stream_last_seq, seq + pending)
        stats.frames_in += 1
        need, skip = self._next
        if seq != need:
            skip = 0
        partition = -1
        if self.spec.partitioned:
            partition = self.spec.partition_of_subject(subject.decode() if type(subject) is bytes else subject)
            if self._floors:
                floor = self._floors.get(partition)
                if floor is not None and seq < floor[0]:  # the partition's restored state holds it already
                    source.skipped += 1
                    self._next = (seq + 1, 0)
                    source.next_seq = seq + 1
                    return
                if floor is not None and seq == floor[0]:
                    skip = max(skip, floor[1])
                if seq >= self._floors_end:
                    self._floors = None  # past every partition's position: no more checks
        if len(data) > self.settings.max_msg_bytes:  # not decoded: one error for it, acknowledged like any poison
            log.warning("%s: stream %r sequence %d: a payload of %d bytes, over FORKLESS_MAX_MSG_BYTES (%d)",
                        self.feed.label, self.spec.stream, seq, len(data), self.settings.max_msg_bytes)
            decoded = _NotDecoded([(TOO_LARGE_REASON, None)])
        else:
            decoded = codec.decode(data)
        if partition >= 0 and len(decoded):
            decoded = self._own_partition(decoded, partition)
        decoded_ns = time.monotonic_ns()
        n = len(decoded)
        self._reader_in_handover = True
        try:
            if decoded.errors:
                for reason, count in decoded.error_counts():
                    stats.errors[reason] += count
                    log.warning("bad input in stream %r at sequence %d: %s", self.spec.stream, seq, reason)
                if self.replies == "all" and self.spec.results:
                    frames = [codec.encode_error(reason, s) for reason, s in decoded.errors]
                    await self.outbox.put(Outgoing(frames, answers=False,
                                                   origin=[Origin(seq, n + k, True) for k in range(len(frames))]))
            if n > skip:
                part = decoded if not skip else _Part(decoded.seq[skip:], decoded.stream[skip:], decoded.x[skip:])
                stats.messages_in += n - skip
                self.handover.add(part, received, decoded_ns, [Origin(seq, i, i == n - 1) for i in range(skip, n)])
                self._from_checkpoint = False
                if self.handover.should_flush():
                    await self.handover.flush()
        finally:
            self._reader_in_handover = False
        self._next = (seq + 1, 0)
        source.next_seq = seq + 1

    def _own_partition(self, decoded: Any, partition: int) -> Any:
        """``decoded`` without the elements whose stream is not in ``partition`` (each an error reply)."""
        cache, count = self._partition_cache, self.spec.partition_count
        foreign = []
        for i, stream in enumerate(decoded.stream):
            p = cache.get(stream)
            if p is None:
                if len(cache) >= PARTITION_CACHE:
                    cache.clear()
                try:
                    p = cache[stream] = partition_of(escape_stream(stream), count)
                except ValueError:
                    p = -1
            if p != partition:
                foreign.append(i)
        if not foreign:
            return decoded
        keep = np.ones(len(decoded), bool)
        keep[foreign] = False
        out = copy.copy(decoded)
        out.seq = [s for s, k in zip(decoded.seq, keep) if k]
        out.stream = [s for s, k in zip(decoded.stream, keep) if k]
        out.x = decoded.x[keep]
        out.errors = [(FOREIGN_REASON, decoded.seq[i]) for i in foreign] + list(decoded.errors)
        return out

    async def _watch_stream(self, nc: Any) -> End:
        """The stream's last sequence, for the lag (``SourceStats.stream_last_seq``)."""
        jsm = nc.jsm(timeout=self.settings.connect_timeout_s)
        conn = self._live
        while self._live == conn:  # also ends it should nats-py swallow its cancellation (see _read)
            await asyncio.sleep(STREAM_INFO_EVERY_S)
            try:
                info = await jsm.stream_info(self.spec.stream)
            except nats.js.errors.NotFoundError:
                return End(Outcome.LOST, f"stream {self.spec.stream!r} was deleted")
            except NATS_ERRORS:
                continue  # the heartbeats and publications decide whether the connection is lost
            if info.created is not None and self._stream_created is not None and info.created != self._stream_created:
                return End(Outcome.LOST, f"stream {self.spec.stream!r} was made again")  # refused at the reconnect
            self.source.stream_last_seq = max(self.source.stream_last_seq, info.state.last_seq)
        return End(Outcome.LOST, "connection over")

    # ---- publishing the replies -----------------------------------------------------------------------

    async def _write(self, nc: Any) -> End:
        try:
            return await self._publish_replies(nc)
        finally:
            sub = self._ack_sub
            self._ack_sub = None
            if sub is not None:
                await unsubscribe_quietly(sub)

    async def _publish_replies(self, nc: Any) -> End:
        stats, stream, results = self.stats, self.spec.stream, self.spec.results
        # the results stream's acknowledgements come to an inbox of ours, ``<inbox>.<n>`` with n counting
        # this connection's publications (nats-py's publish_async costs a future, a semaphore and a
        # JSON parse per reply), straight from the parser to _Acks.on_ack (a raw subscription); the
        # writer wakes once per item, when all of its frames are acknowledged
        inbox = nc.new_inbox() + "."
        acks = _Acks(len(inbox))
        self._ack_sub = await nc.raw_subscribe(inbox + "*", acks.on_ack)
        subject, inbox_bytes = results.encode(), inbox.encode()
        sent = 0
        held = self.held
        while True:
            item = await held.next()
            if item is None:
                return End(Outcome.DRAINED)
            frames, origin = item.frames, item.origin
            start = held.offset
            if not results or origin is None:  # replies "none", or nothing to name them by: not published
                stats.dropped["reply not published (no results subject)"] += item.results
                held.take_held()
                continue
            if self.fence is not None and not self.fence():
                # the partitions' leases are lost or ran out unrenewed (a pause past the lease):
                # their new owner answers these from its checkpoint, so they are never published here
                dropped = len(frames) - start
                stats.dropped["lease lost"] += dropped
                if not self._fenced:
                    self._fenced = True
                    log.error("%s: the partitions' leases are lost or ran out unrenewed: no reply is published "
                              "from now on (their new owner answers them; counted in dropped, \"lease lost\")",
                              self.feed.label)
                held.take_held()
                continue
            acks.begin(sent, len(frames) - start)
            try:
                await publish_commands(nc, reply_commands(subject, inbox_bytes, sent, stream, frames[start:],
                                                          origin[start:], nc.max_payload))
                sent += len(frames) - start
                while not acks.complete():  # all of the item's acknowledgements awaited together
                    before = acks.acked
                    acks.wake.clear()
                    try:
                        async with asyncio.timeout(self.settings.connect_timeout_s):
                            await acks.wake.wait()
                    except TimeoutError:
                        if acks.acked == before:
                            raise nats.errors.TimeoutError from None
                if acks.error is not None:
                    raise acks.error
            except nats.js.errors.NoStreamResponseError:
                return End(Outcome.LOST, f"no stream stores the results subject {results!r}: create one "
                                         "(with a duplicate window, docs/jetstream.md)")
            except NATS_ERRORS as exc:
                return End(Outcome.LOST, f"publishing to {results!r} failed: {_describe(exc)}")
            finally:
                # acknowledged in order from the start: not published again
                held.wrote(start + acks.prefix())
                self.source.duplicates += acks.duplicates
                acks.duplicates = 0
            if item.answers and origin:
                self.source.confirmed = (origin[-1].seq, origin[-1].index)
            held.finish()


# ---- --check ------------------------------------------------------------------------------------------


async def probe_jetstream(settings: IOSettings, feed: FeedSpec, say: Any, dedupe_window_s: float) -> list[str]:
    """The network half of ``--check`` for a JetStream feed: connect as the feed would, read the
    stream, find the stream that stores the results subject and its duplicate window (a warning
    when shorter than ``dedupe_window_s``). A partitioned feed: the stream's subject transform
    must make its partition_count's partitions where its subject has ``{partition}``
    (``_check_partitions``), and the checkpoint and lease buckets are looked for. Prints through
    ``say``; returns the problems (empty: the feed can be used)."""
    spec = feed.jetstream
    loop = asyncio.get_running_loop()
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(_describe(exc))

    t0 = loop.time()
    try:
        nc = await connect_once(settings, connect_options(settings, feed, error_cb=on_error))
    except _Failed as exc:
        if exc.fatal:
            return [f"{feed.shown_url} refused the credentials (the user:password in \"nats\", \"token\" or "
                    "\"creds\")"]
        return [f"cannot connect to {feed.shown_url}: {errors[-1] if errors else exc}"]
    problems: list[str] = []
    try:
        say(f"  connected to {feed.shown_url} in {(loop.time() - t0) * 1000:.1f} ms "
            f"(nats-server {nc.connected_server_version})")
        jsm = nc.jsm(timeout=settings.connect_timeout_s)
        try:
            info = await jsm.stream_info(spec.stream)
            state = info.state
            consuming = "by partition (below)" if spec.partitioned else repr(spec.subject or "all of it")
            say(f"  stream {spec.stream!r}: {state.messages} messages, sequences {state.first_seq}-{state.last_seq}, "
                f"subjects {', '.join(info.config.subjects or [])}; consuming {consuming} "
                f"from {'its first message' if spec.start == 'first' else 'new messages'} unless a checkpoint "
                "recorded a position")
            if spec.partitioned:
                problems.extend(_check_partitions(spec, info.config, say))
        except nats.js.errors.NotFoundError:
            problems.append(f"stream {spec.stream!r} not found on {feed.shown_url}")
        except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError):
            problems.append(f"JetStream is not enabled on {feed.shown_url} (nats-server -js)")
            return problems
        if spec.results:
            try:
                name = await jsm.find_stream_name_by_subject(spec.results)
                window = (await jsm.stream_info(name)).config.duplicate_window or 0.0
                say(f"  results subject {spec.results!r}: stored by stream {name!r}, duplicate window {window:g} s")
                if window < dedupe_window_s:
                    say(f"  WARNING: the duplicate window of {name!r} ({window:g} s) is shorter than 2 x "
                        f"FORKLESS_CHECKPOINT_S + 60 s = {dedupe_window_s:g} s: after a restart, a result published "
                        "again may be stored twice")
            except nats.js.errors.NotFoundError:
                problems.append(f"no stream stores the results subject {spec.results!r}")
        else:
            say("  no results subject (\"replies\": \"none\")")
        if spec.partitioned:
            await _look_for_buckets(settings, jsm, say)
    except NATS_ERRORS as exc:
        problems.append(f"asking {feed.shown_url} failed: {_describe(exc)}")
    finally:
        await close_quietly(nc, 1.0)
    return problems


def _check_partitions(spec: JetStreamSpec, config: Any, say: Any) -> list[str]:
    """A partitioned feed against its stream's configuration (nats-py's ``StreamConfig``): the
    subject transforms of the stream and of its sources and mirror that write a partition must
    agree with the feed's partition_count and subject; at least one must. Prints what it finds
    and this instance's partitions; returns the problems."""
    transforms = []  # (where, src, dest)
    if config.subject_transform is not None:
        transforms.append(("the stream's", config.subject_transform))
    for source in [*(config.sources or []), *([config.mirror] if config.mirror is not None else [])]:
        for transform in source.subject_transforms or []:
            transforms.append((f"source {source.name!r}'s", transform))
    found = [(where, t) for where, raw in transforms
             if (t := partition_transform(raw.src or ">", raw.dest or "")) is not None]
    count = spec.partition_count
    if not found:
        have = "; ".join(f"{where} {raw.src!r} -> {raw.dest!r}" for where, raw in transforms) or "none"
        return [f"stream {spec.stream!r} has no subject transform writing a partition (its subject transforms: "
                f"{have}), but the feed's \"partition_count\" is {count}: give the stream one such as "
                f"'ticks.*' -> 'ticks.{{{{partition({count},1)}}}}.{{{{wildcard(1)}}}}' (docs/partitions.md)"]
    problems = []
    for where, transform in found:
        wrong = transform_problems(spec.subject, count, transform)
        problems.extend(f"stream {spec.stream!r}: {problem}" for problem in wrong)
        if not wrong:
            say(f"  partitioned by {where} subject transform {transform}: {count} partitions, as the feed's "
                f"\"partition_count\"; its subject {spec.subject!r} takes the partition where the transform "
                "writes it")
    subjects = spec.subjects()
    shown = ", ".join(subjects[:4]) + (f", … ({len(subjects)} subjects)" if len(subjects) > 4 else "")
    say(f"  this instance's partitions: {format_partitions(spec.partitions)} ({len(spec.partitions)} of {count}); "
        f"consuming {shown}")
    return problems


async def _look_for_buckets(settings: IOSettings, jsm: Any, say: Any) -> None:
    """Say whether a partitioned feed's checkpoint bucket (``FORKLESS_CHECKPOINT_BUCKET``, a JetStream
    object store) and lease bucket (``FORKLESS_LEASE_BUCKET``, a KV bucket) exist; one that does
    not is made at the first start, so it is no problem."""
    buckets = [("lease bucket", settings.lease_bucket, "KV", "KV_")]
    if settings.checkpoint_bucket:
        buckets.insert(0, ("checkpoint bucket", settings.checkpoint_bucket, "object store", "OBJ_"))
    else:
        say('  no FORKLESS_CHECKPOINT_BUCKET: no checkpoints; every start consumes its partitions from "start"')
    for what, name, kind, prefix in buckets:
        try:
            state = (await jsm.stream_info(prefix + name)).state
        except nats.js.errors.NotFoundError:
            say(f"  {what} {name!r} ({kind}): does not exist yet; the first instance to start creates it")
            continue
        say(f"  {what} {name!r} ({kind}, stream {prefix + name}): exists, {state.messages} messages, "
            f"{state.bytes} bytes")
