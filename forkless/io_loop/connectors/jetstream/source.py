"""JetStreamSource: one JetStream feed (a ``FORKLESS_FEEDS`` entry with ``"nats"``) as a ``Source``, run by a
``SourceRunner`` exactly as a user's source is: consume, decode, hand over, publish the replies, reconnect. The
I/O pump around consumer.py's pure bookkeeping; its replies are published by replies.py. Imported only when such
a feed is configured (nats-py is an optional extra). What it guarantees: docs/jetstream-exactly-once.md.

Rules:
- IO loop only, through its ``SourceContext`` alone. It is ``replayable``, so its hand-over always blocks: a
  dropped message would break the exactly-once state.
- Where it starts and what each delivery means is ``Consumer``'s, made at ``run`` from ``ctx.resume_from``;
  every connection makes a new ephemeral pull consumer starting at the position.
- One pull request at a time for ``PULL_BATCH`` messages; the next only once the last's messages are handed over,
  so a full inbound stops fetching. Deliveries come raw (nats_compat.py: no ``Msg`` per message). A ``Drop`` (a
  gap, a redelivery of a message never consumed) drops the connection.
- Acks (the last of each pull, once all of it is handed over) are flow control only: a restart resumes from the
  checkpoint's position, a reconnect from the feed's own.
- Each payload is ``ctx.decode``d and ``ctx.emit``ted at its stream sequence from the first element the state
  does not hold; one over ``max_msg_bytes`` is one error reply, acknowledged with the others. Error replies are
  indexed after the good elements, so a replay makes the same ids; another partition's elements are errors.
- Replies go out through ``ReplyPublisher`` (``ctx.replies()``), fenced by a partitioned instance's leases.
- Reconnect on any loss with the shared ``Backoff`` and driver (io_loop/reconnect.py); tries used up or
  credentials refused: ``FeedFatal`` (exit 3). At every connection the stream is checked against the position
  (``PositionLost``, exit 2), a filtered feed behind the first sequence again with ``Retention``; a stream made
  again since (another created time, or ending before a sequence seen) is never resumed into.
- Every ``STREAM_INFO_EVERY_S``, and once at the stop (bounded by ``STOP_SURVEY_S``), a survey learns what the
  feed covered (``Consumer.surveyed``), so an idle feed keeps up with retention of other subjects' messages.
- A partitioned feed consumes its owned partitions' subjects with one consumer; the stream's subject transform is
  checked against ``partition_count`` at every connection (``check_partitions``: ``FeedFatal`` naming both).
- Secrets (the URL's user:password, ``token``, the creds file) are never logged.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from forkless.io_loop.backoff import Backoff
from forkless.io_loop.capabilities import SourceCapabilities
from forkless.io_loop.connectors.connector import Fence
from forkless.io_loop.connectors.jetstream.consumer import Consumer, Drop, Retention, Take
from forkless.io_loop.connectors.jetstream.probe import check_partitions, probe_jetstream
from forkless.io_loop.connectors.jetstream.replies import ReplyPublisher
from forkless.io_loop.connectors.jetstream.settings import PartitionSettings, spec_of
from forkless.io_loop.connectors.jetstream.transport import (
    NatsConnectFailed,
    NatsError,
    NatsNotFound,
    NatsUnavailable,
    Transport,
    connect_options,
    describe_error,
)
from forkless.io_loop.counters import SourceStats
from forkless.io_loop.errors import ACCEPT_LOSS, FeedFatal, PositionLost
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.reconnect import End, Outcome, drive, pause_before_reconnect
from forkless.io_loop.settings import ReconnectSettings, Timeouts, TlsSettings
from forkless.io_loop.source import SourceContext

__all__ = ["JetStreamSource"]

log = logging.getLogger("forkless.jetstream")

# messages asked for in one pull request: at most this many are out to us (max_ack_pending is twice it), whatever
# the micro-batch's size. Not a setting: larger pulls gained nothing (bench/docs/jetstream.md)
PULL_BATCH = 256
PULL_EXPIRES_S = 5.0  # a pull request with nothing to deliver ends after this long (then a new one)
PULL_HEARTBEAT_S = 1.0  # the server's idle heartbeat on an open pull request
MISSED_HEARTBEATS = 3  # nothing at all for this many heartbeats: the connection is dropped
ACK_WAIT_S = 30.0
INACTIVE_S = 30.0  # an ephemeral consumer unused this long (its process killed) is removed by the server
STREAM_INFO_EVERY_S = 0.5  # the stream's state (the lag, what the feed covered) is read this often
STOP_SURVEY_S = 1.0  # the stop's last survey of what the feed covered waits this long at most
GIVE_UP_CLOSE_S = 0.25
TOO_LARGE_REASON = "message too large"  # a payload over FORKLESS_MAX_MSG_BYTES


@dataclass
class _NotDecoded:
    """A payload refused before the codec saw it (over ``max_msg_bytes``): no element, one error (a
    ``DecodedFrame`` that ``ctx.emit`` hands over as it hands over what ``ctx.decode`` read)."""

    errors: list[tuple[str, Any]]
    seq: list[Any] = field(default_factory=list)
    stream: list[str] = field(default_factory=list)
    x: Any = None

    def __len__(self) -> int:
        return 0

    def error_counts(self) -> list[tuple[str, int]]:
        return [(reason, 1) for reason, _ in self.errors]


_NOTHING = _NotDecoded([])  # a delivery the state holds: counted as a frame in, nothing handed over


def _removes_by_subject_only(config: Any) -> tuple[bool, int]:
    """Whether nothing but a per-subject limit removes the stream's messages (nats-py's ``StreamConfig``: limits
    retention, no max_age, no per-message TTL, max_msgs and max_bytes unlimited or discarding new messages), and that
    limit (0: none removes a message, as with ``discard_new_per_subject``)."""
    def value(field: Any) -> Any:
        return getattr(field, "value", field)

    stream_wide = (config.max_msgs or 0) > 0 or (config.max_bytes or 0) > 0
    discard_new = value(config.discard) == "new"
    only = (value(config.retention) in (None, "limits") and not (config.max_age or 0)
            and not getattr(config, "allow_msg_ttl", False) and (not stream_wide or discard_new))
    per_subject = config.max_msgs_per_subject or 0
    if per_subject < 0 or (discard_new and getattr(config, "discard_new_per_subject", False)):
        per_subject = 0
    return only, per_subject


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


class JetStreamSource(SourceCapabilities):
    """One JetStream feed as a ``Source`` (io_loop/source.py; see the module rules), run by a
    ``SourceRunner`` exactly as a user's source is. ``fence``: a partitioned instance's leases (its connector's).
    Its position figures are ``figures`` (the runner's ``stats.source``); it resumes from
    ``ctx.resume_from``, the restored checkpoint's record (a ``Resume``, a ``PositionUnknown``,
    or None), itself (``Consumer``), never dropped from (``replayable``); reads only the settings it is handed."""

    replayable = True  # FORKLESS_OVERFLOW=drop_oldest does not apply: a dropped message would break exactly-once
    buffer = 0  # no buffer of its own (io_loop/spill.py): the stream holds what waits, the reader waits for room
    starts_connected = False  # connected once a connection is up (ctx.connection_opened)

    def __init__(self, feed: FeedSpec, *, timeouts: Timeouts, reconnect: ReconnectSettings, tls: TlsSettings,
                 max_msg_bytes: int, partitioning: PartitionSettings | None = None,
                 fence: Fence | None = None) -> None:
        self.name, self.replies, self.required = feed.name, feed.replies, feed.required
        self.timeouts, self.reconnect, self.tls, self.max_msg_bytes = timeouts, reconnect, tls, max_msg_bytes
        self.partitioning = partitioning or PartitionSettings()  # the buckets: only --check reads them
        self.feed = feed
        self.spec = spec_of(feed)
        self.figures: SourceStats = SourceStats()
        self.consumer = Consumer(self.spec, feed.label, self.figures)  # made again at run, from ctx.resume_from
        self.shown_url = feed.shown_url
        self.pull_batch = PULL_BATCH
        self._stopping = False
        # a partitioned instance's leases (fence.holds() False once it may no longer publish)
        self.publisher = ReplyPublisher(timeouts, feed, self.figures, fence)
        self._reader_task: asyncio.Task | None = None
        self._reader_in_handover = False
        self._live = 0  # the connection being served (0: none); its loops end when it changes
        self._nats_error = ""
        self._stream_created: Any = None  # the stream's created time at this run's first connection
        self._nc: Transport | None = None  # the live connection (None: none)
        self._consumer_name = ""  # the live connection's consumer ("": not made yet)

    # ---- the connection loop ------------------------------------------------------------------------

    async def run(self, ctx: SourceContext) -> None:
        """Connect, serve, reconnect (io_loop/reconnect.py), until stopped and every reply is
        published (or FeedFatal, PositionLost)."""
        self.consumer = Consumer(self.spec, self.feed.label, self.figures, ctx.resume_from)
        await drive(_Link(self, ctx), Backoff.of(self.reconnect))

    async def probe(self, codec: Any, say: Callable[[str], None], *, dedupe_window_s: float = 180.0) -> None:
        """``--check``'s try of the feed: its server, stream and results stream
        (io_loop/connectors/jetstream/probe.py)."""
        from forkless.io_loop.probe import ProbeFailed  # only --check probes: a run never loads the probe

        problems = await probe_jetstream(self.feed, say, dedupe_window_s, self.timeouts, self.tls, self.partitioning)
        if problems:
            raise ProbeFailed("; ".join(problems))

    async def before_stop(self, ctx: SourceContext) -> None:
        """The stop begins: the reader stops taking messages, none lost half handed over (a reader
        handing one over finishes it, one waiting for deliveries is cancelled)."""
        self._stopping = True
        if self._nc is not None and self._consumer_name:  # what the feed covered, for the stop's checkpoint
            try:
                async with asyncio.timeout(STOP_SURVEY_S):
                    await self._survey(self._nc)
            except (TimeoutError, NatsError):
                pass  # the checkpoint records what earlier surveys found
        task = self._reader_task
        if task is not None and not task.done():
            if not self._reader_in_handover:
                task.cancel()
            await asyncio.wait([task])

    async def _connect(self) -> tuple[Transport, asyncio.Event]:
        """One attempt: connect to a server of the list, read the stream's state, check the
        position against it. Raises ``NatsConnectFailed`` (retried), ``PositionLost``."""
        closed = asyncio.Event()

        async def on_closed() -> None:
            closed.set()

        async def on_error(exc: Exception) -> None:  # nats-py's default logs a traceback per error
            self._nats_error = describe_error(exc)

        options = connect_options(self.feed, self.timeouts, self.tls, error_cb=on_error, disconnected_cb=on_closed,
                                  closed_cb=on_closed)
        try:
            nc = await Transport.connect(self.timeouts, options, raw=True)
        except NatsConnectFailed as exc:
            if exc.fatal:
                raise NatsConnectFailed(f"the server refused the credentials (check the user:password in \"nats\", "
                                        f"\"token\" or \"creds\" of {self.feed.label})", fatal=True) from None
            raise NatsConnectFailed(f"cannot connect to {self.shown_url}: {self._nats_error or exc}") from None
        try:
            await self._check_stream(nc)
        except BaseException:
            await nc.close(GIVE_UP_CLOSE_S)
            raise
        return nc, closed

    async def _check_stream(self, nc: Transport) -> None:
        """Read the stream's state and check it: its partitioning, its identity, the position."""
        try:
            info = await nc.stream_info(self.spec.stream)
        except NatsNotFound:
            raise NatsConnectFailed(f"stream {self.spec.stream!r} not found on {self.shown_url}") from None
        except NatsUnavailable:
            raise NatsConnectFailed(f"JetStream is not enabled on {self.shown_url} (nats-server -js)") from None
        except NatsError as exc:
            raise NatsConnectFailed(f"reading stream {self.spec.stream!r} failed: {exc}") from None
        if self.spec.partitioned:  # the stream must partition as the feed expects (as --check says)
            problems = check_partitions(self.spec, info.config, lambda line: None)
            if problems:
                raise FeedFatal(f"{self.feed.label}: " + "; ".join(problems))
        self._check_identity(info.state.last_seq, info.created)
        first, last, deleted = info.state.first_seq, info.state.last_seq, info.state.num_deleted or 0
        try:
            notes = self.consumer.check_stream(first, last, deleted)
        except PositionLost:
            if not self.consumer.filtered_behind(first, last):
                raise
            # a filtered feed behind the stream's first sequence: what can the stream tell of its retention?
            notes = self.consumer.check_stream(first, last, deleted, await self._retention(nc, info.config))
        for level, line in notes:
            log.log(level, "%s", line)

    async def _retention(self, nc: Transport, config: Any) -> Retention:
        """What the stream's configuration says its retention may remove, and, where it removes by subject only,
        how many messages each of the feed's subjects holds (and where the first few at their limit start)."""
        stream, subjects = self.spec.stream, tuple(config.subjects or ())
        by_subject_only, per_subject = _removes_by_subject_only(config)
        if not by_subject_only:
            return Retention(subjects)
        counts: dict[str, int] | None
        counts = {}  # (declared apart: mypy narrows an assignment, not a declaration's value)
        first_of: dict[str, int] = {}
        try:
            for subject in self.spec.subjects():
                got = await nc.subject_counts(stream, subject)
                if got is None:  # more subjects than it reads: not known
                    counts = None
                    break
                counts.update(got)
            for subject in sorted(s for s, held in (counts or {}).items() if per_subject and held >= per_subject)[:3]:
                first_of[subject] = (await nc.get_msg(stream, seq=1, subject=subject, next=True)).seq
        except NatsError as exc:  # the attempt fails and is tried again (a refusal must not hang on a lost answer)
            raise NatsConnectFailed(f"reading stream {stream!r}'s subjects failed: {exc}") from None
        return Retention(subjects, True, per_subject, counts, first_of)

    def _check_identity(self, last: int, created: Any) -> None:
        """``PositionLost`` when the stream is not the one this run consumed: its created time
        differs from the first connection's (or the restored checkpoint's), or it ends before a
        sequence this run saw in it (a stream deleted and made again numbers its messages from 1
        again: resuming at this run's position in it would skip the new stream's first messages)."""
        source, label, stream = self.figures, self.feed.label, self.spec.stream
        recorded = self.consumer.recorded_created
        if created is not None:
            if self._stream_created is None:
                if recorded and not _same_time(created, recorded):
                    raise PositionLost(
                        f"{label}: stream {stream!r} was deleted and made again since the checkpoint was written: "
                        f"created {_when(created)}, but the checkpoint recorded its position in a stream created "
                        f"{recorded}; its sequences are not the ones the checkpoint's position counts. To continue "
                        f"anyway, {ACCEPT_LOSS}")
                self._stream_created = created
                source.stream_created = _when(created)
            elif created != self._stream_created:
                raise PositionLost(
                    f"{label}: stream {stream!r} was deleted and made again: created {_when(created)}, but at this "
                    f"run's first connection it had been created {_when(self._stream_created)}; its sequences are "
                    f"not the ones this run's position counts. To continue anyway, {ACCEPT_LOSS}")
        if last < source.stream_last_seq:
            raise PositionLost(
                f"{label}: stream {stream!r} ends at sequence {last}, but this run saw it reach "
                f"{source.stream_last_seq}: was the stream deleted and made again? To continue anyway, {ACCEPT_LOSS}")

    async def _serve(self, ctx: SourceContext, nc: Transport, closed: asyncio.Event) -> tuple[int, End]:
        """Run one connection until it is lost or everything is published: its id and how it ended."""
        conn = self._live = ctx.connection_opened()
        self._nc = nc
        log.info("%s: connection %d open (stream %r, subject %r, replies to %r)", self.feed.label, conn,
                 self.spec.stream, self.spec.subject or ">", self.spec.results or "(none)",
                 extra={"feed": self.name, "connection": conn})
        tasks: set[asyncio.Task] = set()
        end = End(Outcome.LOST, "connection over")
        try:  # a publication, a pull, an ack that failed: a NatsError from the task's result
            writer = asyncio.create_task(self.publisher.run(nc, ctx.replies()), name="forkless-js-writer")
            lost = asyncio.create_task(closed.wait(), name="forkless-js-closed")
            watch = asyncio.create_task(self._watch_stream(nc), name="forkless-js-stream")
            tasks |= {writer, lost, watch}
            reader = None
            if not self._stopping:
                reader = self._reader_task = asyncio.create_task(self._read(ctx, nc), name="forkless-js-reader")
                tasks.add(reader)
            while True:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                if writer in done:
                    end = self._written(writer.result(), conn)
                    break
                if reader is not None and reader in done:
                    tasks.discard(reader)
                    if reader.cancelled() or reader.result().outcome is Outcome.STOPPED:
                        reader = None
                        continue  # stopping: keep publishing until outbound is drained
                    end = reader.result()
                    break
                if lost in done:
                    end = End(Outcome.LOST, f"connection lost{': ' + self._nats_error if self._nats_error else ''}")
                    break
                end = watch.result()
                break
        except NatsError as exc:
            end = End(Outcome.LOST, str(exc))
        finally:
            self._live = 0
            self._nc, self._consumer_name = None, ""
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)
            await nc.close(GIVE_UP_CLOSE_S)
            ctx.connection_closed("" if end.outcome is Outcome.CLOSED else end.reason)
        return conn, end

    def _written(self, end: End, conn: int) -> End:
        """How a connection ends when its writer did: lost, or closed once every reply is published."""
        if end.outcome is not Outcome.DRAINED:
            return end
        if self.publisher.fenced:
            log.info("%s: connection %d closed; the replies left were dropped (the leases are lost)",
                     self.feed.label, conn, extra={"feed": self.name, "connection": conn})
        else:
            log.info("%s: connection %d closed after publishing every reply", self.feed.label, conn,
                     extra={"feed": self.name, "connection": conn})
        return End(Outcome.CLOSED)

    # ---- consuming ------------------------------------------------------------------------------------

    async def _read(self, ctx: SourceContext, nc: Transport) -> End:
        spec, conn = self.spec, self._live
        name = f"forkless-{self.feed.name}-{secrets.token_hex(6)}"
        try:
            await nc.add_pull_consumer(spec.stream, name=name, start_seq=self.consumer.new_consumer(),
                                       subjects=spec.subjects(), ack_wait_s=ACK_WAIT_S,
                                       max_ack_pending=2 * self.pull_batch, inactive_s=INACTIVE_S)
        except NatsError as exc:
            return End(Outcome.LOST, f"creating the consumer failed: {exc}")
        self._consumer_name = name
        inbox = nc.new_inbox()
        # deliveries go to a queue of ours, awaited directly (nats-py's next_msg waits in a task of its
        # own with asyncio.wait_for, which on Python 3.11 can swallow a cancellation: the stop's, the end
        # of a connection, when a message arrives at the same moment, and the reader then runs on), as
        # (the message's subject, reply subject, payload, headers) straight from the protocol parser
        # (nats_compat.RawClient, a raw transport's subscribe)
        deliveries: asyncio.Queue = asyncio.Queue()
        sub = await nc.subscribe(inbox, lambda subject, reply, data, headers: deliveries.put_nowait(
            (subject, reply, data, headers)))
        request = json.dumps({"batch": self.pull_batch, "expires": int(PULL_EXPIRES_S * 1e9),
                              "idle_heartbeat": int(PULL_HEARTBEAT_S * 1e9)}).encode()
        pull = f"$JS.API.CONSUMER.MSG.NEXT.{spec.stream}.{name}"
        try:
            while self._live == conn:
                end = await self._pull(ctx, nc, pull, request, inbox, deliveries)
                if end is not None:
                    return end
            return End(Outcome.LOST, "connection over")
        finally:
            await sub.unsubscribe()

    async def _pull(self, ctx: SourceContext, nc: Transport, pull: str, request: bytes, inbox: str,
                    deliveries: asyncio.Queue) -> End | None:
        """One pull request: its deliveries handed over (as ``Consumer`` decides), then the ack of
        the last; an ``End`` when the connection must end (or the reader stop), else None."""
        consumer = self.consumer
        await nc.publish(pull, request, reply=inbox)
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
                    break
                return End(Outcome.LOST, f"the consumer answered {status} {headers.get('Description', '')}".strip())
            take = consumer.deliver(reply, where)
            if type(take) is Drop:
                return End(Outcome.LOST, take.reason)
            got += 1
            last = reply
            if type(take) is not Take:  # SKIP: a redelivery of what was consumed
                continue
            if take.in_state:  # a partition's restored position is past it: read, nothing of it handed over
                await ctx.emit(_NOTHING, take.seq)
            else:
                await self._consume(ctx, data, take)
            consumer.consumed(take)
            if self._stopping:
                break
        if last:
            await nc.publish(last.decode())  # the ack; ack policy "all": everything up to it
        return End(Outcome.STOPPED) if self._stopping else None

    async def _consume(self, ctx: SourceContext, data: bytes, take: Take) -> None:
        """Decode one stream message and hand its good elements over (those not handed over before)."""
        received = time.monotonic_ns()
        if len(data) > self.max_msg_bytes:  # not decoded: one error for it, acknowledged like any poison
            log.warning("%s: stream %r sequence %d: a payload of %d bytes, over FORKLESS_MAX_MSG_BYTES (%d)",
                        self.feed.label, self.spec.stream, take.seq, len(data), self.max_msg_bytes)
            decoded = _NotDecoded([(TOO_LARGE_REASON, None)])
        else:
            decoded = ctx.decode(data)
        if take.partition >= 0 and len(decoded):
            decoded = self.consumer.own_partition(decoded, take.partition)
        if len(decoded) > take.skip:
            self.consumer.handing_over()
        self._reader_in_handover = True
        try:
            await ctx.emit(decoded, take.seq, first=take.skip, received_ns=received)
        finally:
            self._reader_in_handover = False

    async def _watch_stream(self, nc: Transport) -> End:
        """The stream's state, every ``STREAM_INFO_EVERY_S``: its last sequence for the lag
        (``SourceStats.stream_last_seq``), and what the feed covered (``_survey``)."""
        conn = self._live
        while self._live == conn:  # also ends it should nats-py swallow its cancellation (see _read)
            await asyncio.sleep(STREAM_INFO_EVERY_S)
            try:
                info = await self._survey(nc)
            except NatsNotFound:
                return End(Outcome.LOST, f"stream {self.spec.stream!r} was deleted")
            except NatsError:
                continue  # the heartbeats and publications decide whether the connection is lost
            if info.created is not None and self._stream_created is not None and info.created != self._stream_created:
                return End(Outcome.LOST, f"stream {self.spec.stream!r} was made again")  # refused at the reconnect
        return End(Outcome.LOST, "connection over")

    async def _survey(self, nc: Transport) -> Any:
        """The stream's state (returned); where the feed may have covered more, then its
        consumer's state and the stream's first sequence, for ``Consumer.surveyed``."""
        consumer, stream = self.consumer, self.spec.stream
        mark = consumer.activity  # a delivery read from here on voids the survey
        info = await nc.stream_info(stream)
        last = info.state.last_seq
        self.figures.stream_last_seq = max(self.figures.stream_last_seq, last)
        name = self._consumer_name
        if not name or not consumer.may_cover(last):
            return info
        try:
            state = await nc.consumer_info(stream, name)
        except NatsNotFound:
            return info  # the consumer is gone (a server restart): the connection is about to end
        after = await nc.stream_info(stream)
        if name == self._consumer_name and (after.created is None or after.created == info.created):
            delivered = state.delivered.consumer_seq if state.delivered is not None else 0
            consumer.surveyed(mark, last, state.num_pending or 0, delivered or 0, bool(state.num_waiting),
                            after.state.first_seq)
        return info


class _Link:
    """A ``JetStreamSource`` run's side of the reconnect driver (io_loop/reconnect.py)."""

    failures = (NatsConnectFailed,)

    def __init__(self, source: JetStreamSource, ctx: SourceContext) -> None:
        self.source, self.ctx, self.label, self.conn = source, ctx, source.feed.label, 0

    def more(self) -> bool:
        return not self.ctx.replies_ended()

    async def connect(self) -> tuple[Any, asyncio.Event]:
        return await self.source._connect()

    def attempt_failed(self, exc: BaseException) -> str:
        if getattr(exc, "fatal", False):
            raise FeedFatal(f"{self.label}: {exc}") from None
        self.ctx.connect_failed(str(exc))
        return str(exc)

    def retrying(self, reason: str, delay: float) -> None:
        log.warning("%s: %s; retrying in %.2fs", self.label, reason, delay, extra={"feed": self.source.name})

    async def serve(self, conn: tuple[Any, asyncio.Event]) -> str:
        self.conn, end = await self.source._serve(self.ctx, *conn)
        return end.reason

    def reconnecting(self, reason: str, delay: float) -> None:
        log.warning("%s: connection %d lost: %s; reconnecting in %.2fs", self.label, self.conn, reason, delay,
                    extra={"feed": self.source.name, "connection": self.conn})
        self.ctx.reconnecting()

    def gave_up(self, reason: str, failures: int, lost: bool) -> FeedFatal:
        return FeedFatal(f"giving up on {self.label} after {failures} "
                         f"{'lost connections' if lost else 'failed attempts'} in a row: {reason}")

    async def pause(self, delay: float) -> None:  # down at the stop: no new connection
        await pause_before_reconnect(delay, lambda: self.source._stopping and self.ctx.replies_ended())
