"""The relay's publishing side (``forkless relay``): every message the WebSocket feeds hand over is published to a
JetStream stream, one JSON object per NATS message, and held until the server has stored it. Imported only by the
relay (nats-py is an optional extra). What it guarantees: docs/relay.md.

Rules:
- A public ``RecordSink`` run on the IO loop by the ``SinkRunner``: it takes the feeds' batches on the same loop,
  no second loop, no hop between threads. Backpressure is one rule: a batch is taken only while fewer than
  ``max_held`` messages are held (unpublished or unacknowledged); inbound is bounded and the relay's hand-over
  blocks, so a slow server stops the feeds' readers and TCP pushes back.
- Ids: a message gets ``Nats-Msg-Id: <run id>:<n>`` when taken and keeps it for every retry, so the stream's
  duplicate window drops a retry it had stored, and two real messages never share one.
- What waits goes out as one buffer of HPUB commands (``publish_commands``: one write).
- A message is held until its ack says stored (or duplicate); then its batch is told (``wrote(1)``). Events are not
  relayed: dropped, counted. Any failure drops the connection; after the ``Backoff`` delay every held message is
  published again, in order, with its id: nothing is skipped. ``FORKLESS_RECONNECT_TRIES`` failures in a row:
  ``FeedFatal`` (exit 3).
- Payload ``{"seq", "stream", "x"}``, ``x`` written with the shortest text that reads back to the same double, on
  ``<subject>.<escape_stream(stream)>``.
- Gaps in each feed's ``seq`` are counted by reason (``SeqGaps``) and logged at most once per feed per
  ``GAP_LOG_S``; with one feed and ``RELAY_SEQ=feed`` the first seq is logged against the stream's last message.
- Orderly stop: the sink returns once inbound is done and every held message acknowledged; what is held when it
  is cancelled is counted in ``unpublished`` and logged.
- Secrets (a URL's user:password, the token, the creds file) are never logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import Any

from forkless.io_loop.backoff import Backoff
from forkless.io_loop.connectors.jetstream.partitions import escape_stream
from forkless.io_loop.connectors.jetstream.settings import JETSTREAM, JetStreamSpec
from forkless.io_loop.connectors.jetstream.transport import (
    NatsConnectFailed,
    NatsError,
    NatsNotFound,
    Transport,
    connect_options,
    describe_error,
    duplicate_ack,
)
from forkless.io_loop.errors import FeedFatal
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.jsontext import dumps
from forkless.io_loop.reconnect import DONE, drive
from forkless.io_loop.relay.relaystats import GAP_REASONS, Gap, RelayStats, SeqGaps
from forkless.io_loop.relay.settings import RelaySettings
from forkless.io_loop.settings import ReconnectSettings, Timeouts, TlsSettings
from forkless.io_loop.sinks.sink import EventBatch, MessageBatch, RecordContext

__all__ = ["Publisher"]

log = logging.getLogger("forkless.relay")

GAP_LOG_S = 5.0  # a feed's gaps are logged at most once per this long (the next line counts the rest)
GIVE_UP_CLOSE_S = 0.25
SUBJECT_CACHE = 100_000  # stream names whose subject is kept (then the cache starts again)


# ---- the publisher --------------------------------------------------------------------------------


class _Publication:
    """One message taken, to be published until acknowledged: its id ``n``, subject and payload, whether it was
    published yet (``sent``), and ``batch``, the sink batch it came in."""

    __slots__ = ("batch", "n", "payload", "sent", "subject")

    def __init__(self, batch: MessageBatch, n: int, subject: str, payload: bytes) -> None:
        self.batch = batch
        self.n = n
        self.subject = subject
        self.payload = payload
        self.sent = False  # published at least once


class _Connection:
    """One connection's fate: the first failure seen on it (its callbacks write here, so a late
    callback of an old connection cannot touch the next one)."""

    __slots__ = ("failure", "wake")

    def __init__(self, wake: asyncio.Event) -> None:
        self.failure = ""
        self.wake = wake

    def fail(self, reason: str) -> None:
        if not self.failure:
            self.failure = reason
        self.wake.set()


class Publisher:
    """The relay's sink (see the module rules): ``await run(ctx)`` until the batches end and
    everything taken is stored; raises ``FeedFatal`` when the server cannot be used.
    ``feed_names``: the feeds' names by index, for the logs. ``relay``: the relay's settings (io_loop/relay/
    settings.py); its connection's ``timeouts``, ``reconnect`` policy and ``tls`` are the IO side's groups."""

    name = "relay"

    def __init__(self, relay: RelaySettings, stats: RelayStats, feed_names: list[str], *, timeouts: Timeouts,
                 reconnect: ReconnectSettings, tls: TlsSettings) -> None:
        self.relay = relay
        self.timeouts, self.reconnect, self.tls = timeouts, reconnect, tls
        # its servers, described as a JetStream feed's are (the URLs comma-separated, the token and creds in its
        # options, the stream unused)
        self.target = FeedSpec("relay", relay.nats, kind=JETSTREAM, options=JetStreamSpec("", token=relay.token,
                                                                                   creds=relay.creds))
        self.stats = stats
        stats.gaps = self.gaps = SeqGaps(relay.seq)
        self.feed_names = feed_names
        self.run_id = secrets.token_hex(8)
        self.shown_url = self.target.shown_url
        self._n = 0  # ids given so far
        self._waiting: deque[_Publication] = deque()  # taken, not published on the current connection
        self._unacknowledged: dict[int, _Publication] = {}  # published on the current connection, not acknowledged yet
        self._inbound_done = False
        self._wake = asyncio.Event()  # something changed: an ack, a new message, a failure
        self._room = asyncio.Event()  # fewer than max_held held
        self._subjects: dict[str, str] = {}
        self._gap_logged_at: dict[int, float] = {}
        self._gaps_not_logged: Counter[int] = Counter()
        # the start against the stream (FORKLESS_RELAY_SEQ=feed, one feed): the feed's first seq this
        # run, and the seq of the last message the stream held when the first connection was made
        self._start_check = relay.seq == "feed" and len(feed_names) == 1
        self._first_seq: Any = None
        self._last_stored: Any = None
        self._looked_up = False
        self._stream_name = ""

    # ---- the sink -------------------------------------------------------------------------------

    async def run(self, ctx: RecordContext) -> None:
        taker = asyncio.create_task(self._take(ctx), name="forkless-relay-take")
        log.info("relaying to %s.<stream> on %s (run id %s, at most %d messages held)", self.relay.subject,
                 self.shown_url, self.run_id, self.relay.max_held)
        try:
            await drive(_Link(self, taker), Backoff.of(self.reconnect))
        finally:
            taker.cancel()
            await asyncio.gather(taker, return_exceptions=True)
            held = len(self._waiting) + len(self._unacknowledged)
            if held:
                self.stats.unpublished += held
                log.error("relay: %d messages taken from the feeds were never stored by %s (ids %s:%d and after)",
                          held, self.shown_url, self.run_id, min(m.n for m in (*self._waiting,
                                                                             *self._unacknowledged.values())))
            self._log_gap_totals()

    async def _pause(self, delay: float, taker: asyncio.Task) -> None:
        """The backoff's delay (the taker goes on filling up to the bound meanwhile)."""
        if taker.done() and not self._inbound_done:
            taker.result()  # what killed it (a bug): raised, not waited on forever
        await asyncio.sleep(delay)

    # ---- taking chunks ------------------------------------------------------------------------------

    async def _take(self, ctx: RecordContext) -> None:
        bound = self.relay.max_held
        while True:
            while self.stats.held >= bound:
                self._room.clear()
                await self._room.wait()
            try:
                batch = await ctx.next_batch()
                while batch is not None:
                    self._add(batch)
                    if self.stats.held >= bound:
                        break
                    batch = ctx.next_ready()  # what else is queued, without a turn of the loop each
                if ctx.ended:
                    self._inbound_done = True
                    return
            finally:
                self._wake.set()

    def _add(self, chunk: MessageBatch | EventBatch) -> None:
        """Give each message of ``chunk`` its id, subject and payload; follow its seqs."""
        if isinstance(chunk, EventBatch):
            chunk.drop("events are not relayed")
            return
        for gap in self.gaps.observe(chunk.index, chunk.connection, chunk.seq, chunk.stream):
            self._log_gap(gap)
        if self._first_seq is None and self._start_check and len(chunk):
            self._first_seq = chunk.seq[0]
            self._compare_start()
        rows: list[list[float]] = []
        for part in chunk.x_parts():
            rows += part.tolist()  # float64: Python floats, written back exactly
        subjects, waiting = self._subjects, self._waiting
        for seq, stream, x in zip(chunk.seq, chunk.stream, rows):
            subject = subjects.get(stream)
            if subject is None:
                if len(subjects) >= SUBJECT_CACHE:
                    subjects.clear()
                subject = subjects[stream] = f"{self.relay.subject}.{escape_stream(stream)}"
            self._n += 1
            waiting.append(_Publication(chunk, self._n, subject, dumps({"seq": seq, "stream": stream, "x": x})))
        self.stats.taken += len(chunk)
        self.stats.held += len(chunk)

    # ---- the connection -----------------------------------------------------------------------------

    async def _connect(self) -> tuple[Transport, _Connection]:
        conn = _Connection(self._wake)
        errors: list[str] = []

        async def on_closed() -> None:
            conn.fail("the connection to the NATS server was lost")

        async def on_error(exc: Exception) -> None:  # nats-py's default logs a traceback per error
            errors.append(describe_error(exc))

        options = connect_options(self.target, self.timeouts, self.tls, error_cb=on_error, disconnected_cb=on_closed,
                                  closed_cb=on_closed)
        try:
            nc = await Transport.connect(self.timeouts, options)
        except NatsConnectFailed as exc:
            if exc.fatal:
                raise NatsConnectFailed("the server refused the credentials (check the user:password in "
                                        "FORKLESS_RELAY_NATS, FORKLESS_RELAY_TOKEN or FORKLESS_RELAY_CREDS)",
                                        fatal=True) from None
            raise NatsConnectFailed(f"cannot connect: {errors[-1] if errors else exc}") from None
        return nc, conn

    async def _serve(self, nc: Transport, conn: _Connection, taker: asyncio.Task) -> str:
        """Publish until everything taken is stored and inbound is done (returns ""), or until the
        connection fails (returns why; the unacknowledged messages wait to be published again)."""
        await self._connected(nc)
        prefix = nc.new_inbox() + "."
        try:
            sub = await nc.subscribe_messages(prefix + "*", self._on_ack(conn, len(prefix)))
        except NatsError as exc:
            await self._end(nc, conn)
            return f"subscribing to the acknowledgements failed: {exc}"
        try:
            return await self._publish(nc, conn, prefix, taker)
        except NatsError as exc:
            return f"publishing failed: {exc}"
        finally:
            self._requeue_unacknowledged()
            await sub.unsubscribe()
            await self._end(nc, conn)

    async def _connected(self, nc: Transport) -> None:
        """A new connection counted and logged; before this run's first publication, the last
        message the stream holds looked up (the start against the stream)."""
        stats = self.stats
        stats.connects += 1
        stats.connected = True
        stats.state_since = time.time()
        log.info("relay: connected to %s", self.shown_url)
        if self._start_check and not self._looked_up:
            await self._look_up_last_stored(nc)

    def _on_ack(self, conn: _Connection, cut: int) -> Callable[[Any], Awaitable[None]]:
        """The callback of ``conn``'s acknowledgements (subjects ``<inbox>.<n>``, ``cut`` the length of
        ``<inbox>.``): a message stored (or a duplicate) is no longer held; an error ack fails ``conn``."""
        stats, bound = self.stats, self.relay.max_held
        unacknowledged, wake = self._unacknowledged, self._wake

        async def on_ack(msg: Any) -> None:
            try:
                n = int(msg.subject[cut:])
            except ValueError:
                return
            held = unacknowledged.get(n)
            if held is None:  # an ack of an earlier connection's publication, or a copy
                return
            problem = _ack_problem(msg)
            if problem:
                conn.fail(problem.replace("{subject}", repr(held.subject)))
                return
            del unacknowledged[n]
            held.batch.wrote(1)
            stats.acked += 1
            stats.held -= 1
            if duplicate_ack(msg.data):
                stats.duplicates += 1
            if stats.held < bound:
                self._room.set()
            wake.set()

        return on_ack

    async def _publish(self, nc: Transport, conn: _Connection, prefix: str, taker: asyncio.Task) -> str:
        """Publish what waits and wait for the acks, until everything taken is stored and inbound is
        done (returns "") or ``conn`` fails: its callbacks say why, or no ack came for
        FORKLESS_CONNECT_TIMEOUT_S while some were awaited."""
        stats, unacknowledged, waiting, wake = self.stats, self._unacknowledged, self._waiting, self._wake
        timeout = self.timeouts.connect_timeout_s
        loop = asyncio.get_running_loop()
        acked, waiting_since = stats.acked, loop.time()  # the last ack seen, and since when we wait for one
        while True:
            if not unacknowledged:  # nothing awaited: the wait for an ack starts with the next publication
                acked, waiting_since = stats.acked, loop.time()
            await self._publish_waiting(nc, conn, prefix)
            if conn.failure:
                return conn.failure
            if taker.done() and not self._inbound_done:
                taker.result()  # what killed it (a bug): raised, not waited on forever
            if not unacknowledged and not waiting and self._inbound_done:
                return ""
            now = loop.time()
            if stats.acked != acked:  # progress: the wait for an ack starts again
                acked, waiting_since = stats.acked, now
            elif now - waiting_since >= timeout:  # new messages arriving do not extend it
                return (f"no acknowledgement from {self.shown_url} within {timeout:g}s "
                        "(FORKLESS_CONNECT_TIMEOUT_S)")
            wake.clear()
            try:
                async with asyncio.timeout(waiting_since + timeout - now if unacknowledged else None):
                    await wake.wait()
            except TimeoutError:
                pass

    async def _publish_waiting(self, nc: Transport, conn: _Connection, prefix: str) -> None:
        """Publish the waiting messages in order while fewer than ``max_held`` are unacknowledged and
        ``conn`` has not failed, each with its id and its ack's subject ``<prefix><n>``: as one buffer
        of HPUB commands, the client protocol's own (``Transport.publish_commands``: one write),
        not one ``publish`` a message. A payload larger than the server's ``max_payload`` is published
        alone, once those before it are sent, and raises as ``publish`` does."""
        stats, bound = self.stats, self.relay.max_held
        unacknowledged, waiting = self._unacknowledged, self._waiting
        if conn.failure:
            return
        header = f"NATS/1.0\r\nNats-Msg-Id: {self.run_id}:".encode()
        reply, max_payload = prefix.encode(), nc.max_payload
        parts: list[bytes] = []
        add = parts.append
        while waiting and len(unacknowledged) < bound:
            held = waiting.popleft()
            unacknowledged[held.n] = held
            if held.sent:
                stats.retried += 1
            else:
                held.sent = True
                stats.published += 1
            payload = held.payload
            if len(payload) > max_payload:
                if parts:
                    await nc.publish_commands(b"".join(parts))
                # alone, as before: the transport raises its error for a payload the server refuses
                await nc.publish(held.subject, payload, reply=f"{prefix}{held.n}",
                                 headers={"Nats-Msg-Id": f"{self.run_id}:{held.n}"})
                parts.clear()
                continue
            hdr = header + b"%d\r\n\r\n" % held.n
            add(b"HPUB %s %s%d %d %d\r\n" % (held.subject.encode(), reply, held.n, len(hdr), len(hdr) + len(payload)))
            add(hdr)
            add(payload)
            add(b"\r\n")
        if parts:
            await nc.publish_commands(b"".join(parts))

    def _requeue_unacknowledged(self) -> None:
        """After a connection: what was unacknowledged waits to be published again, in order, before what waited."""
        unacknowledged = self._unacknowledged
        if unacknowledged:
            self._waiting.extendleft(sorted(unacknowledged.values(), key=lambda m: m.n, reverse=True))
            unacknowledged.clear()

    async def _end(self, nc: Transport, conn: _Connection) -> None:
        conn.failure = conn.failure or "closed"  # its callbacks (the close's own) change nothing now
        await nc.close(GIVE_UP_CLOSE_S)
        self.stats.connected = False
        self.stats.state_since = time.time()

    # ---- gaps ------------------------------------------------------------------------------------------

    async def _look_up_last_stored(self, nc: Transport) -> None:
        """Before this run's first publication: the seq in the last message the stream holds
        under ``<subject>.>`` (what an earlier relay stored last). Looked up once; a failure is
        logged, not retried (it is a report, not a condition of the run)."""
        subject = f"{self.relay.subject}.>"
        try:
            async with asyncio.timeout(self.timeouts.connect_timeout_s):
                self._stream_name = await nc.find_stream_name_by_subject(subject)
                try:
                    msg = await nc.get_last_msg(self._stream_name, subject)
                except NatsNotFound:
                    self._last_stored = "none"
                else:
                    seq = json.loads(msg.data or b"{}").get("seq")
                    self._last_stored = seq if isinstance(seq, int) and not isinstance(seq, bool) else "unknown"
        except (TimeoutError, NatsError, ValueError, AttributeError) as exc:
            log.info("relay: the last message stored under %s could not be read (%s): the start is not compared "
                     "with it", subject, describe_error(exc))
            self._last_stored = "unknown"
        self._looked_up = True
        self._compare_start()

    def _compare_start(self) -> None:
        """Once both are known: the feed's first seq of this run against the last one stored,
        logged once (a gap with its size: what an earlier relay read and never stored, a kill -9's
        loss, or what the feed sent while no relay ran)."""
        first, last = self._first_seq, self._last_stored
        if first is None or last is None or last == "unknown":
            return
        self._start_check = False  # logged once
        feed, stream = self._feed_name(0), self._stream_name
        if not isinstance(first, int) or isinstance(first, bool):
            return
        if last == "none":
            log.info("relay: feed %r starts at seq %d; stream %r holds nothing under %s.> yet", feed, first, stream,
                     self.relay.subject)
        elif first == last + 1:
            log.info("relay: feed %r starts at seq %d, right after the last one stored in stream %r (seq %d): "
                     "nothing missing between the runs", feed, first, stream, last)
        elif first > last + 1:
            log.warning("relay: feed %r starts at seq %d, the last one stored in stream %r is seq %d: a gap of %d "
                        "messages between the runs (read and never stored by the relay before, as after a kill -9, "
                        "or sent while no relay ran)", feed, first, stream, last, first - last - 1)
        else:
            log.info("relay: feed %r starts at seq %d, at or before the last one stored in stream %r (seq %d): the "
                     "feed sends again from an earlier point or numbers anew (not a gap; copies are stored again)",
                     feed, first, stream, last)

    def _feed_name(self, index: int) -> str:
        return self.feed_names[index] if 0 <= index < len(self.feed_names) else str(index)

    def _log_gap(self, gap: Gap) -> None:
        now = time.monotonic()
        last = self._gap_logged_at.get(gap.feed)
        if last is not None and now - last < GAP_LOG_S:
            self._gaps_not_logged[gap.feed] += 1
            return
        self._gap_logged_at[gap.feed] = now
        more = self._gaps_not_logged.pop(gap.feed, 0)
        where = f"stream {gap.stream!r} of feed {self._feed_name(gap.feed)!r}" if self.gaps.per == "stream" \
            else f"feed {self._feed_name(gap.feed)!r}"
        what = (f"{gap.missing} messages missing" if gap.seq > gap.before
                else "the seq went back (the feed restarted its numbering?)")
        log.warning("relay: %s: seq %d followed %d %s: %s%s", where, gap.seq, gap.before, gap.reason, what,
                    f" ({more} more gaps since the last such line)" if more else "")

    def _log_gap_totals(self) -> None:
        gaps = self.gaps
        if gaps.gaps or gaps.back:
            parts = [f"{gaps.gaps[r]} gaps {r} ({gaps.missing[r]} messages missing)" for r in GAP_REASONS
                     if gaps.gaps[r]]
            parts += [f"{gaps.back[r]} times the seq went back {r}" for r in GAP_REASONS if gaps.back[r]]
            log.warning("relay: seq gaps in this run: %s", "; ".join(parts))


def _ack_problem(msg: Any) -> str:
    """Why a JetStream ack says the message was not stored ("" when it was); ``{subject}`` stands
    for the message's subject."""
    status = msg.headers.get("Status") if msg.headers else None
    if status == "503":
        return ("no stream stores the subject {subject}: create one with the subjects '<FORKLESS_RELAY_SUBJECT>.>' "
                "and a duplicate window (docs/relay.md, \"The stream\")")
    if status:
        return f"the server answered {status} {msg.headers.get('Description', '')}".strip()
    data = msg.data
    if b'"error"' in data:
        try:
            body = json.loads(data)
        except ValueError:
            return "the server's acknowledgement is not JSON"
        if not isinstance(body, dict):
            return f"the server's acknowledgement is not a JSON object: {data[:200]!r}"
        if "error" not in body:  # '"error"' was a value (a stream named so): stored
            return ""
        error = body["error"]
        why = error.get("description", error) if isinstance(error, dict) else error
        return f"the server did not store a message to {{subject}}: {why}"
    return ""


class _Link:
    """The publisher's side of the reconnect driver (io_loop/reconnect.py)."""

    failures = (NatsConnectFailed,)

    def __init__(self, publisher: Publisher, taker: asyncio.Task) -> None:
        self.publisher, self.taker, self.stats, self.url = publisher, taker, publisher.stats, publisher.shown_url

    def more(self) -> bool:  # until every message taken is stored (serve says DONE)
        return True

    async def connect(self) -> tuple[Any, _Connection]:
        return await self.publisher._connect()

    def attempt_failed(self, exc: BaseException) -> str:
        reason = str(exc)
        self.stats.connect_failures += 1
        self.stats.last_error = reason
        if getattr(exc, "fatal", False):
            raise FeedFatal(f"relay: giving up on {self.url}: {reason}") from None
        return reason

    def retrying(self, reason: str, delay: float) -> None:
        log.warning("relay: connecting to %s failed: %s; retrying in %.2fs", self.url, reason, delay)

    async def serve(self, conn: tuple[Any, _Connection]) -> str | None:
        reason = await self.publisher._serve(*conn, self.taker)
        if not reason:
            log.info("relay: every message taken is stored (%d); connection to %s closed", self.stats.acked, self.url)
            return DONE
        self.stats.last_error = reason
        return reason

    def reconnecting(self, reason: str, delay: float) -> None:
        log.warning("relay: %s; %d messages held, published again after a new connection in %.2fs", reason,
                    self.stats.held, delay)
        self.stats.reconnects += 1

    def gave_up(self, reason: str, failures: int, lost: bool) -> FeedFatal:
        if lost:
            return FeedFatal(f"relay: giving up on {self.url} after {failures} failures in a row, {self.stats.held} "
                             f"messages not stored: {reason}")
        return FeedFatal(f"relay: giving up on {self.url} after {failures} failed attempts in a row: {reason}")

    async def pause(self, delay: float) -> None:
        await self.publisher._pause(delay, self.taker)
