"""The reconnect driver: connect, serve, back off, again: the one loop under the WebSocket feed, the JetStream feed,
the relay's publisher and ``Relogin``.

Rules:
- ``await drive(link, backoff)`` owns the loop and the ``Backoff``: its ``connected``/``disconnected`` stamps, and
  ``failed(now)`` after each failed attempt or lost connection (``now`` dates the outage). Everything else is the
  ``Link``'s: when to stop, what an attempt and a connection are, what is counted and logged, the pause.
- An attempt: ``link.connect()``; only an exception of ``link.failures`` fails it (anything else ends the drive),
  then ``link.attempt_failed`` (which may raise ``FeedFatal`` when retrying cannot help), the delay, ``retrying``,
  ``pause``.
- A connection: ``link.serve(conn)`` returns why it was lost, or ``DONE`` (the work is over: the drive returns);
  ``link.more()`` is asked after each connection and before each attempt. A lost one: the delay, ``reconnecting``,
  ``pause``.
- Tries used up: ``raise link.gave_up(reason, failures, lost)``; the link builds the ``FeedFatal``.
- ``drive`` reads no clock but the one passed and sleeps only through ``pause``. Beside it, what the feeds' links
  share: ``End`` and ``Outcome``, ``pause_before_reconnect``, and ``closed_how``, the words for a WebSocket's end by
  its close code (1006 is a connection lost without a close frame, never "closed by" anyone).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from forkless.io_loop.backoff import Backoff
from forkless.io_loop.errors import FeedFatal

__all__ = ["DONE", "LOST_WITHOUT_CLOSE", "End", "Link", "Outcome", "closed_how", "drive", "pause_before_reconnect"]

DONE = None  # what ``Link.serve`` returns when the work is over: no reconnect
LOST_WITHOUT_CLOSE = 1006  # RFC 6455: the close code of a connection that ended without a close frame


def closed_how(code: int | None, by: str = "the peer") -> str:
    """Why a WebSocket connection ended, by its close code (None: none known): ``closed by the peer
    (code 4003)``, or ``lost without a close frame (1006)``."""
    if code == LOST_WITHOUT_CLOSE:
        return f"lost without a close frame ({LOST_WITHOUT_CLOSE}: the peer died, or the network)"
    return f"closed by {by}" if code is None else f"closed by {by} (code {code})"


class Outcome(enum.Enum):
    """How a reader, a writer or a whole connection ended."""

    DRAINED = "outbound shut down and every item sent"  # writer
    STOPPED = "stopped reading on request"  # reader
    CLOSED = "closed with 1000 after sending every result"  # connection
    LOST = "connection lost"  # any of them; ``End.reason`` says why


@dataclass(frozen=True)
class End:
    outcome: Outcome
    reason: str = ""
    code: int | None = None  # the close code the connection ended with, where one is known (its ConnectionEvent's)


async def pause_before_reconnect(delay: float, ended: Callable[[], bool]) -> None:
    """Sleep ``delay`` seconds before a feed's next attempt, or less once ``ended()`` says the
    stop has come and nothing is left to send (a feed that is down need not connect again)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + delay
    while True:
        left = end - loop.time()
        if left <= 0 or ended():
            return
        await asyncio.sleep(min(left, 0.05))


class Link(Protocol):
    """What a connect-serve-backoff loop supplies to ``drive`` (see the module rules)."""

    @property
    def failures(self) -> tuple[type[BaseException], ...]: ...  # what a failed attempt raises (retried)

    def more(self) -> bool: ...

    async def connect(self) -> Any: ...

    def attempt_failed(self, exc: BaseException) -> str: ...

    def retrying(self, reason: str, delay: float) -> None: ...

    async def serve(self, conn: Any) -> str | None: ...

    def reconnecting(self, reason: str, delay: float) -> None: ...

    def gave_up(self, reason: str, failures: int, lost: bool) -> FeedFatal: ...

    async def pause(self, delay: float) -> None: ...


async def drive(link: Link, backoff: Backoff, clock: Callable[[], float] = time.monotonic) -> None:
    """Connect, serve, reconnect with ``backoff`` until ``link`` says stop (see the module rules)."""
    while link.more():
        try:
            conn = await link.connect()
        except link.failures as exc:
            reason = link.attempt_failed(exc)
            delay = backoff.failed(clock())
            if delay is None:
                raise link.gave_up(reason, backoff.failures, False) from None
            link.retrying(reason, delay)
            await link.pause(delay)
            continue
        backoff.connected(clock())
        lost = await link.serve(conn)
        backoff.disconnected(clock())
        if lost is DONE or not link.more():
            return
        delay = backoff.failed(clock())
        if delay is None:
            raise link.gave_up(lost, backoff.failures, True)
        link.reconnecting(lost, delay)
        await link.pause(delay)
