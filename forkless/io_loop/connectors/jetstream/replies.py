"""A JetStream feed's replies published to its results subject: the writer of a ``JetStreamSource``, one per
connection, in the role a WebSocket client's writer has. Imported only when such a feed is configured.

Rules:
- The source's reply batches in order, taken through ``ctx.replies()`` (a batch kept across reconnects). Each frame
  is published with ``Nats-Msg-Id: <stream>:<seq>:<index>`` (``msg_id``) and a reply subject of this connection's
  own; a batch's frames go as one buffer of HPUB commands, their acks awaited together before the next batch.
- What was not acknowledged is published again after a reconnect; the results stream's duplicate window drops a
  copy (``SourceStats.duplicates``). ``SourceStats.confirmed`` is the last main-thread reply acknowledged: a
  checkpoint is committed only once every reply it covers is.
- No ack in ``connect_timeout_s``, an error ack, or no stream storing the subject: the connection is lost (``End``)
  and the feed reconnects. An ack not understood is an error ack, never counted stored, never raised out of the
  subscription's handler.
- Replies ``"none"``, or a batch with nothing to name it by: not published, counted in ``dropped``.
- A partitioned feed's leases fence it: with ``fence.holds()`` False a batch is dropped ("lease lost", logged once),
  as another instance may own the partitions and answers those messages from its checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from forkless.io_loop.connectors.connector import Fence
from forkless.io_loop.connectors.jetstream.settings import spec_of
from forkless.io_loop.connectors.jetstream.transport import (
    NatsError,
    NatsNoStreamResponse,
    Transport,
    describe_error,
    duplicate_ack,
    error_ack,
)
from forkless.io_loop.counters import SourceStats
from forkless.io_loop.crossing import Origin
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.reconnect import End, Outcome
from forkless.io_loop.settings import Timeouts
from forkless.io_loop.writer import ReplyBatch

__all__ = ["ReplyAcks", "ReplyPublisher", "msg_id", "reply_commands"]

log = logging.getLogger("forkless.jetstream")


def msg_id(stream: str, origin: Origin) -> str:
    """The ``Nats-Msg-Id`` of a reply: ``<stream name>:<stream sequence of the input>:<index>``."""
    return f"{stream}:{origin.seq}:{origin.index}"


def reply_commands(subject: bytes, inbox: bytes, first: int, stream: str, frames: list[Any],
                   origins: list[Origin], max_payload: int) -> bytes:
    """The NATS protocol commands publishing ``frames`` (str or bytes) to ``subject``, frame k
    with the header ``Nats-Msg-Id: msg_id(stream, origins[k])`` and the reply subject
    ``<inbox><first + k>`` (where the results stream acknowledges it), as one buffer
    (nats_compat.publish_commands). A frame larger than the server's ``max_payload``: ``NatsError``, as the
    transport's ``publish`` raises for nats-py's ``MaxPayloadError``."""
    header = b"NATS/1.0\r\nNats-Msg-Id: " + stream.encode() + b":"
    parts: list[bytes] = []
    add = parts.append
    for k, frame in enumerate(frames):
        payload = frame if isinstance(frame, bytes) else frame.encode()  # a send's frame subclasses them
        if len(payload) > max_payload:
            raise NatsError(f"MaxPayloadError: a reply of {len(payload)} bytes, over the server's max_payload "
                            f"({max_payload})")
        origin = origins[k]
        hdr = header + b"%d:%d\r\n\r\n" % (origin.seq, origin.index)
        add(b"HPUB %s %s%d %d %d\r\n" % (subject, inbox, first + k, len(hdr), len(hdr) + len(payload)))
        add(hdr)
        add(payload)
        add(b"\r\n")
    return b"".join(parts)


class ReplyAcks:
    """The results stream's acknowledgements of the item being published: frame k of it was
    published with the reply subject ``<inbox><base + k>``. ``wake`` is called once every frame
    is acknowledged, or at the first error (an error response, no stream storing the subject).
    No socket: ``on_ack`` is handed each acknowledgement as the protocol parser gives it."""

    def __init__(self, cut: int, wake: Callable[[], Any]) -> None:
        self.cut = cut  # the length of ``<inbox>``
        self.wake = wake
        self.base = 0
        self.done = bytearray()
        self.acked = 0
        self.duplicates = 0
        self.error: NatsError | None = None

    def begin(self, base: int, n: int) -> None:
        self.base, self.done, self.acked, self.error = base, bytearray(n), 0, None

    def complete(self) -> bool:
        return self.acked == len(self.done) or self.error is not None

    def prefix(self) -> int:
        """Frames acknowledged in order from the item's first."""
        first_missing = self.done.find(0)
        return len(self.done) if first_missing < 0 else first_missing

    def on_ack(self, subject: bytes, _reply: bytes, data: bytes, headers: dict[str, str] | None) -> None:
        """One acknowledgement, from nats_compat.RawClient (a raw subscription to ``<inbox>*``).
        Raises nothing: what it raised would go to the connection's ``error_cb``, and the item
        would wait for ``connect_timeout_s`` instead of ending with the error."""
        try:
            k = int(subject[self.cut:]) - self.base
        except ValueError:
            return
        if not 0 <= k < len(self.done) or self.done[k] or self.error is not None:
            return  # an earlier item's (acknowledged after a timeout), or a copy
        try:
            status = headers.get("Status") if headers else None
            if status and headers:
                self.error = (NatsNoStreamResponse("NoStreamResponseError: no stream stores the subject")
                              if status == "503" else
                              NatsError(f"the server answered {status} {headers.get('Description', '')}".strip()))
            elif b'"error"' in data and (error := error_ack(data)) is not None:  # a stored frame's: not parsed
                self.error = error
            else:
                self.done[k] = 1
                self.acked += 1
                if duplicate_ack(data):
                    self.duplicates += 1
        except Exception as exc:  # not foreseen: the item's error, not a wait in vain
            self.error = NatsError(f"an acknowledgement not understood ({describe_error(exc)}): {data[:200]!r}")
        if self.complete():
            self.wake()


class ReplyPublisher:
    """The replies of one JetStream feed published on one connection at a time (see the module
    rules): ``await run(nc, batch)`` until the replies end (``Outcome.DRAINED``) or the
    connection is lost. ``batch``: the source's ``ctx.replies()``; ``source``: its figures
    (``confirmed``, ``duplicates``); ``fence``: a partitioned instance's leases."""

    def __init__(self, timeouts: Timeouts, feed: FeedSpec, source: SourceStats, fence: Fence | None = None) -> None:
        self.timeouts = timeouts
        self.feed = feed
        self.spec = spec_of(feed)
        self.source = source
        self.fence = fence
        self.fenced = False  # the fence refused a publication (logged once)
        self._ack_sub: Any = None  # this connection's subscription to the acknowledgements

    async def run(self, nc: Transport, batch: ReplyBatch) -> End:
        try:
            return await self._publish(nc, batch)
        finally:
            sub = self._ack_sub
            self._ack_sub = None
            if sub is not None:
                await sub.unsubscribe()

    async def _publish(self, nc: Transport, batch: ReplyBatch) -> End:
        stream, results = self.spec.stream, self.spec.results
        # the results stream's acknowledgements come to an inbox of ours, ``<inbox>.<n>`` with n counting
        # this connection's publications (nats-py's publish_async costs a future, a semaphore and a
        # JSON parse per reply), straight from the parser to ReplyAcks.on_ack (a raw subscription); the
        # writer wakes once per batch, when all of its frames are acknowledged
        inbox = nc.new_inbox() + "."
        wake = asyncio.Event()
        acks = ReplyAcks(len(inbox), wake.set)
        self._ack_sub = await nc.subscribe(inbox + "*", acks.on_ack)
        subject, inbox_bytes = results.encode(), inbox.encode()
        sent = 0
        async for _ in batch:  # a batch not wholly published comes again, from its first frame not acknowledged
            frames, origins = batch.frames, batch.positions
            if not self._may_publish(batch, origins):
                continue
            assert origins is not None  # (_may_publish drops a batch without)
            n, answers = len(frames), batch.answers
            acks.begin(sent, n)
            try:
                await nc.publish_commands(reply_commands(subject, inbox_bytes, sent, stream, frames, origins,
                                                         nc.max_payload))
                sent += n
                await self._acknowledged(acks, wake)
            except NatsNoStreamResponse:
                return End(Outcome.LOST, f"no stream stores the results subject {results!r}: create one "
                                         "(with a duplicate window, docs/jetstream.md)")
            except NatsError as exc:
                if exc.api:  # an error acknowledgement: the stream's limits, say
                    return End(Outcome.LOST, f"the results stream refused a reply published to {results!r}: "
                                             f"{exc.description or describe_error(exc)} (code {exc.code}, "
                                             f"err_code {exc.err_code})")
                return End(Outcome.LOST, f"publishing to {results!r} failed: {describe_error(exc)}")
            finally:
                # acknowledged in order from the start: not published again
                acked = acks.prefix()
                if acked == n and answers:
                    self.source.confirmed = (origins[-1].seq, origins[-1].index)
                batch.wrote(acked)
                self.source.duplicates += acks.duplicates
                acks.duplicates = 0
        return End(Outcome.DRAINED)

    def _may_publish(self, batch: ReplyBatch, origins: list[Origin] | None) -> bool:
        """Whether the batch is published; what is not is dropped, counted."""
        if not self.spec.results or origins is None:
            # replies "none", or nothing to name them by: not published
            batch.drop("reply not published (no results subject)")
            return False
        if self.fence is not None and not self.fence.holds():
            # the partitions' leases are lost or ran out unrenewed (a pause past the lease):
            # their new owner answers these from its checkpoint, so they are never published here
            batch.drop("lease lost")
            if not self.fenced:
                self.fenced = True
                log.error("%s: the partitions' leases are lost or ran out unrenewed: no reply is published "
                          "from now on (their new owner answers them; counted in dropped, \"lease lost\")",
                          self.feed.label)
            return False
        return True

    async def _acknowledged(self, acks: ReplyAcks, wake: asyncio.Event) -> None:
        """Every frame of the item acknowledged; raises the error acknowledgement, or a timeout
        when none came for ``connect_timeout_s``."""
        while not acks.complete():  # all of the item's acknowledgements awaited together
            before = acks.acked
            wake.clear()
            try:
                async with asyncio.timeout(self.timeouts.connect_timeout_s):
                    await wake.wait()
            except TimeoutError:
                if acks.acked == before:
                    raise NatsError(f"TimeoutError: no acknowledgement within {self.timeouts.connect_timeout_s:g}s "
                                    "(FORKLESS_CONNECT_TIMEOUT_S)") from None
        if acks.error is not None:
            raise acks.error
