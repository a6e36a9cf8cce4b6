"""The reconnect driver: connect, serve, back off, again: the one loop under the WebSocket feed
(io_loop/connectors/websocket/client.py), the JetStream feed (io_loop/connectors/jetstream/source.py), the relay's
publisher (io_loop/connectors/jetstream/publisher.py) and ``Relogin`` (io_loop/relogin.py).

Rules:
- ``await drive(link, backoff)`` owns the loop and the ``Backoff`` (io_loop/backoff.py): its
  ``connected``/``disconnected`` stamps around each served connection, and ``failed(now)`` after
  each failed attempt and each lost connection (``now`` dates the outage: a ``Backoff`` with
  ``follow_s`` caps its delay by the outage's age). Everything else is the ``Link``'s: when to stop,
  what an attempt and a connection are, what is counted and logged, the give-up text, the pause.
- An attempt: ``await link.connect()``; an exception of ``link.failures`` (only those: anything
  else ends the drive) fails it: ``link.attempt_failed(exc)`` counts it and says why (or raises
  ``FeedFatal`` itself when retrying cannot help), then the backoff's delay,
  ``link.retrying(reason, delay)`` (the warning) and ``await link.pause(delay)``.
- A connection: ``await link.serve(conn)`` returns why it was lost, or ``DONE`` (None) when the
  work is over (everything sent): the drive returns. It also returns when ``link.more()`` is
  false after a connection ended; it is asked before each attempt too.
- A lost connection: the backoff's delay, ``link.reconnecting(reason, delay)`` (the warning,
  the counters), ``await link.pause(delay)``.
- Tries used up (``failed()`` is None): ``raise link.gave_up(reason, failures, lost)``, where
  ``lost`` says whether the last failure was a lost connection (else a failed attempt) and
  ``failures`` is the backoff's count in a row; the link builds the ``FeedFatal``.
- Pure of clocks but the one passed (``clock``, ``time.monotonic``): no sleeping of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from forkless.io_loop.backoff import Backoff
from forkless.io_loop.errors import FeedFatal

__all__ = ["DONE", "Link", "drive"]

DONE = None  # what ``Link.serve`` returns when the work is over: no reconnect


class Link(Protocol):
    """What a connect-serve-backoff loop supplies to ``drive`` (see the module rules)."""

    failures: tuple[type[BaseException], ...]  # what a failed attempt raises (retried)

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
