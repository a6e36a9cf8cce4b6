"""Sends with a deadline: a frame the main thread sends (``Controller.send``) is written by its deadline or never, and
the main thread learns which (``SendFailed``).

Rules:
- A send carries its id, when it was sent and its deadline (``time.monotonic()``; None: none), on its ``Outgoing``
  and on each of its frames (``SentText``, ``SentBytes``), so whatever holds a frame knows its deadline.
- ``SendWatch`` is one source's, IO loop only. It learns of each send as it crosses (the bridge's wake-up: none of
  its own) and, until a writer has it in hand, gives it up at its deadline wherever it waits (``"deadline"``). A
  writer asks ``usable`` before handing an item out, so no frame is written after its deadline by the feed's writer,
  and each is reported at its own deadline, whatever is queued before it.
- A source with ``sends_while_disconnected = "refuse"`` has every send given up while it is not connected
  (``"disconnected"``).
- A frame in a source's own hands (``ctx.outgoing()``) keeps its deadline there (``Relogin`` does); the source
  reports what it gives up (``ctx.send_failed``).
- Every frame given up is counted once (``sent_failed`` by reason) and reported once, as a ``SendFailed`` to
  ``on_event`` in order with the source's events (after the stop shut inbound, counted only); each reason logged
  once per source.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import janus

from forkless.io_loop.capabilities import declarations
from forkless.io_loop.counters import IOStats
from forkless.io_loop.crossing import Events, Outgoing
from forkless.io_loop.errors import ForklessError
from forkless.io_loop.seconds import seconds_or_none

__all__ = [
    "DEADLINE",
    "DISCONNECTED",
    "GAVE_UP",
    "HOLD",
    "LOST",
    "NOT_TAKEN",
    "STOP_DEADLINE",
    "WRITE_FAILED",
    "WRITTEN_OUT",
    "SendFailed",
    "SendWatch",
    "SentBytes",
    "SentText",
    "Unanswered",
    "checked_max_age",
    "declared_send_policy",
    "sent_frames",
]

log = logging.getLogger("forkless.sends")

# why a send was given up (``SendFailed.reason``, the ``sent_failed`` counter's keys)
DEADLINE = "deadline"  # its deadline (max_age_s) passed before it was written
DISCONNECTED = "disconnected"  # refused while the source was not connected (sends_while_disconnected="refuse")
HOLD = "hold_s"  # Relogin held it hold_s without a connection
WRITE_FAILED = "write failed"  # Relogin's write raised and resend=False
GAVE_UP = "gave up"  # Relogin gave up connecting (FeedFatal)
NOT_TAKEN = "not taken"  # an IOPortal's from_main item its worker never took before the portal ended
# why a send that was written never got its answer (``SendFailed.reason``; counted in ``awaited_unanswered``)
LOST = "connection lost"  # written on a connection that ended before its answer came
STOP_DEADLINE = "stop deadline"  # still awaited when the stop's time for answers ran out



class SendFailed(ForklessError):
    """A send that was not written: ``frame`` (what was not written: the frame, or the frames of a
    send of several), ``id`` (the send's id: ``Controller.send``'s return value; None for a frame
    the main thread did not send), ``reason`` (``"deadline"``, ``"disconnected"``, ``"hold_s"``,
    ``"write failed"``, ``"gave up"``, ``"not taken"``, or a source's own) and ``source`` (its name,
    where known). Or one that was written and whose answer will never come: ``"connection lost"``
    (its connection ended first), ``"stop deadline"`` (the stop's time for answers ran out).
    Raised by ``Relogin.send``; handed to ``on_event`` for a send of the main thread's; put on an
    ``IOPortal``'s ``to_main``. ``__cause__``: what made it fail, where there is one (a write's error,
    the ``FeedFatal`` of a link that gave up)."""

    def __init__(self, message: str, frame: Any, *, id: Any = None, reason: str = "", source: str = "") -> None:
        super().__init__(message)
        self.frame, self.id, self.reason, self.source = frame, id, reason, source


WRITTEN_OUT = "written"  # a frame's ``outcome`` once counted written (``sent_out``)


class _Sent:
    """What a frame of a send carries beside its text (see the rules)."""

    send_id: Any
    deadline: float | None
    sent_at: float
    outcome: str  # "" until counted: WRITTEN_OUT, or the reason it was given up

    def settle(self, outcome: str) -> bool:
        """Record the frame's outcome once; True when this call recorded it."""
        if self.outcome:
            return False
        self.outcome = outcome
        return True


class SentText(_Sent, str):
    """A text frame the main thread sent: the ``str`` itself, and its send's ``send_id``,
    ``deadline`` (``time.monotonic()`` seconds, or None) and ``sent_at`` (``time.monotonic()``)."""


class SentBytes(_Sent, bytes):
    """``SentText`` for a frame of UTF-8 ``bytes``."""


def sent_frames(frames: list[str | bytes], send_id: Any, deadline: float | None, sent_at: float) -> list[Any]:
    """The frames of one send, each carrying the send's id, deadline and time (see the rules)."""
    out: list[Any] = []
    for frame in frames:
        sent = SentBytes(frame) if isinstance(frame, bytes) else SentText(frame)
        sent.send_id, sent.deadline, sent.sent_at, sent.outcome = send_id, deadline, sent_at, ""
        out.append(sent)
    return out


class Unanswered:
    """Sends that left (written, or taken by a portal's worker) on a connection and await their
    answer, by id: the book of a source that declares ``answers`` (io_loop/source.py) and of an
    ``IOPortal(answers=...)`` (io_loop/portalqueue.py). Pure: the caller holds whatever lock its
    threads need, and reports what ``lost`` and ``left_over`` return."""

    __slots__ = ("_on",)

    def __init__(self) -> None:
        self._on: dict[Any, tuple[int, Any]] = {}  # send id -> (its connection, what left)

    def __len__(self) -> int:
        return len(self._on)

    def __contains__(self, send_id: Any) -> bool:
        return send_id in self._on

    def left(self, send_id: Any, connection: int, what: Any) -> None:
        """``what`` (send ``send_id``) left on ``connection``: its answer is awaited from now."""
        self._on[send_id] = (connection, what)

    def answered(self, send_id: Any) -> bool:
        """The answer of ``send_id`` came: no longer awaited (False: it was not awaited)."""
        return self._on.pop(send_id, None) is not None

    def lost(self, connection: int) -> list[tuple[Any, Any]]:
        """``connection`` ended: the sends that left on it (or before it) unanswered, as (id, what), forgotten."""
        gone = [(send_id, what) for send_id, (on, what) in self._on.items() if on <= connection]
        for send_id, _ in gone:
            del self._on[send_id]
        return gone

    def left_over(self) -> list[tuple[Any, Any]]:
        """Every send still awaited, as (id, what), forgotten (the stop's end)."""
        gone = [(send_id, what) for send_id, (_, what) in self._on.items()]
        self._on.clear()
        return gone


def checked_max_age(value: Any, what: str) -> float | None:
    """A maximum age in seconds (``max_age_s``, a source's ``send_max_age_s``): None, or a finite
    number > 0 (any real number: io_loop/seconds.py); ``TypeError``/``ValueError`` naming ``what`` otherwise."""
    return seconds_or_none(value, what, "no deadline")


def declared_send_policy(source: Any, name: str) -> tuple[float | None, str]:
    """A source's ``send_max_age_s`` and ``sends_while_disconnected``, checked: ``TypeError`` or
    ``ValueError`` naming the source."""
    declared = declarations(source, name)  # checked there (io_loop/capabilities.py)
    max_age = declared.send_max_age_s
    return (None if max_age is None else float(max_age)), declared.sends_while_disconnected


class SendWatch:
    """One source's sends until a writer has them in hand (see the module rules). IO loop only.
    ``held`` is the source's ``HeldReply`` (io_loop/writer.py): the item a lost connection left
    half written waits there; ``events`` hands the reports over (the source's hand-over)."""

    def __init__(self, stats: IOStats, *, name: str, feed: int, held: Any, events: Any, refuse: bool = False) -> None:
        self.stats, self.name, self.feed = stats, name, feed
        self.held = held
        self.events = events  # Handover.hand_event: in order with the source's other events
        self.refuse = refuse  # sends_while_disconnected == "refuse"
        self._waiting: dict[int, Outgoing] = {}  # sends not yet in a writer's hands (by id()), to refuse or expire
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._logged: set[str] = set()

    def arrived(self, item: Outgoing) -> None:
        """A send crossed the bridge (the IO loop's wake-up for it)."""
        if item.taken or item.failed:  # the writer side took it before this wake-up ran (and asked usable)
            return
        if self.refuse and not self.stats.connected:
            self.fail(item, DISCONNECTED)
            return
        if item.deadline is not None or self.refuse:
            # a turn later: a writer waiting for it (the common case) takes it first, and no timer is made
            # (a timer made and cancelled would cost every send on an order's way)
            asyncio.get_running_loop().call_soon(self._watch, item)

    def _watch(self, item: Outgoing) -> None:
        if self._waits(item):  # still queued, or taken but held (a feed that is down took it to look)
            self._waiting[id(item)] = item
            self._arm(item)

    def usable(self, item: Outgoing) -> bool:
        """Before a writer takes or hands ``item`` out: False for a send given up (now, or before: skip it)."""
        if not item.sent:
            return True
        if item.failed:
            return False
        if item.deadline is not None and time.monotonic() >= item.deadline:
            self.fail(item, DEADLINE)
            return False
        if self.refuse and not self.stats.connected:
            self.fail(item, DISCONNECTED)
            return False
        return True

    def handed(self, item: Outgoing) -> None:
        """A writer has ``item`` in hand (``Outgoing.handed``): no longer watched."""
        self._forget(item)

    def put_back(self, item: Outgoing) -> None:
        """A writer gave ``item`` back half written (its connection was lost): watched again."""
        if item.sent and not item.failed and (item.deadline is not None or self.refuse):
            self._waiting[id(item)] = item
            self._arm(item)

    def disconnected(self) -> None:
        """The source is not connected any more: with ``refuse``, every waiting send is given up."""
        if self.refuse:
            for item in list(self._waiting.values()):
                if self._waits(item):
                    self.fail(item, DISCONNECTED)

    def fail(self, item: Outgoing, reason: str) -> None:
        """Give ``item`` up (the frames not yet written): counted, reported, never written."""
        self._forget(item)
        written = 0
        if self.held.item is item:  # half written before a lost connection: the writer holds it no more
            written = self.held.offset
            self.held.take_held()
        item.give_up(reason)
        left = item.frames[written:]
        for frame in left:
            if isinstance(frame, _Sent):
                frame.settle(reason)
        self.count(reason, len(left), item.send_id, left[0] if len(item.frames) == 1 and left else left)

    def report(self, frame: Any, reason: str, cause: BaseException | None = None) -> None:
        """A frame the source had in hand (``ctx.outgoing()``) that it will not write (``ctx.send_failed``;
        ``cause``: the ``SendFailed``'s ``__cause__``)."""
        if not isinstance(frame, _Sent):
            raise TypeError(f"send_failed(frame) takes a frame ctx.outgoing() handed out that the main thread sent "
                            f"(Controller.send); {type(frame).__name__} {frame!r:.60} is not one")
        if not isinstance(reason, str) or not reason:
            raise TypeError(f"send_failed(frame, reason): reason is a non-empty str (why it was not written), not "
                            f"{reason!r}")
        if frame.outcome == WRITTEN_OUT:  # counted written when the next frame was asked for: it was not
            self.stats.sent_out -= 1
            frame.outcome = reason
        elif not frame.settle(reason):
            return  # given up before: counted and reported once
        self.count(reason, 1, frame.send_id, frame, cause)

    def unanswered(self, reason: str, send_id: Any, what: Any, *, counted: bool = False) -> None:
        """A send written whose answer will not come (``LOST``: its connection ended first; the stop's
        reasons, io_loop/finishing.py): counted in ``awaited_unanswered`` (unless ``counted`` already),
        logged once per reason, reported (``SendFailed``)."""
        if not counted:
            self.stats.awaited_unanswered[reason] += 1
        self._report(reason, send_id, what, None, f"send {send_id!r} was written and its answer will not come",
                     f"a send was written and its answer will not come ({reason}); the main thread gets SendFailed "
                     f"for each, counted in awaited_unanswered")

    def count(self, reason: str, frames: int, send_id: Any, what: Any, cause: BaseException | None = None) -> None:
        """``frames`` frames of send ``send_id`` given up for ``reason``: counted, logged once, reported."""
        self.stats.sent_failed[reason] += frames
        self._report(reason, send_id, what, cause, f"send {send_id!r} was not written",
                     f"a send was not written ({reason}); the main thread gets SendFailed for each, counted in "
                     f"sent_failed")

    def _report(self, reason: str, send_id: Any, what: Any, cause: BaseException | None, text: str,
                logged: str) -> None:
        """``SendFailed`` to the main thread, in order with the source's events; each reason logged once."""
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("source %r: %s (logged once per reason)", self.name, logged)
        failed = SendFailed(f"source {self.name!r}: {text}: {reason}", what, id=send_id, reason=reason,
                            source=self.name)
        failed.__cause__ = cause
        try:
            self.events(Events(self.feed, [failed], time.monotonic_ns()))
        except (janus.AsyncQueueShutDown, RuntimeError):  # the stop shut inbound: counted, not reported
            return
        self.stats.events_in += 1

    def _arm(self, item: Outgoing) -> None:
        if item.deadline is None:
            return
        loop = asyncio.get_running_loop()
        # loop.time() is time.monotonic() for asyncio's loops: the deadline is on the loop's clock
        self._timers[id(item)] = loop.call_at(item.deadline, self._due, item)

    def _due(self, item: Outgoing) -> None:
        self._timers.pop(id(item), None)
        if self._waits(item):
            self.fail(item, DEADLINE)

    def _waits(self, item: Outgoing) -> bool:
        """``item`` waits for a writer: in a queue, or held half written; not in a writer's hands,
        not given up, not written or counted by the stop."""
        if item.failed or item.handed:
            return False
        return not item.taken or self.held.item is item

    def _forget(self, item: Outgoing) -> None:
        self._waiting.pop(id(item), None)
        timer = self._timers.pop(id(item), None)
        if timer is not None:
            timer.cancel()
