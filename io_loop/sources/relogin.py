"""Relogin: one connection of your own client kept up with fresh credentials, for a ``Source.run``
(or an ``IOPortal`` worker): sends held while it reconnects, resent or failed explicitly.

Rules:
- ``Relogin(connect, serve, ...)`` is used on the loop as ``async with ... as link``: a task keeps
  one connection up. ``await connect(attempt)`` logs in (fresh credentials) and opens it;
  ``attempt`` is 1 after the start or after a connection that was served, one more for each
  failed attempt since (the before-connect hook's rule, io_loop/sources/before_connect.py: ``attempt > 1``
  says the last failed, so log in again rather than reuse a token). ``await serve(conn)`` reads
  until the connection ends (returns, or raises). Then the link connects again with ``Backoff``
  (io_loop/backoff.py; the loop is the reconnect driver's, io_loop/reconnect.py); with ``tries``
  failures in a row it gives up: ``FeedFatal``.
- ``await link.send(frame)`` writes one frame, in the order sends were called. While no
  connection is up it is held (at most ``hold_s``; then ``SendFailed``). A write that raises
  (the connection broke under it) is written again on the next connection (``resend=True``), or
  raises ``SendFailed`` from the write's error (``resend=False``). Nothing is dropped silently:
  a frame is written, or its ``send`` raises, and both are counted.
- A frame written to a connection that then ended may not have been read by the peer: a resend
  covers only writes that raised (an exchange's ``client_order_id`` makes a resend safe).
- With a ``ctx`` (a ``SourceContext``) the source's books count it as the built-in feeds are
  counted (``connection_opened``/``closed``, with the connection's ``close_code`` where it has one:
  its ``ConnectionEvent``'s, io_loop/source.py; ``connect_failed``, ``reconnecting``, and ``counts``:
  "sends held while not connected", "sends resent", "sends failed"); give the source
  ``starts_connected = False``. Failures are logged (``forkless.relogin``) once per distinct
  reason, URLs without query or credentials (tokens live there); calls of ``connect`` are bounded
  by ``connect_timeout_s`` (the hook machinery of io_loop/sources/on_connect.py).
- Leaving the ``async with`` cancels the connection task and closes the connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from forkless.io_loop.backoff import Backoff
from forkless.io_loop.errors import FeedFatal, ForklessError
from forkless.io_loop.net.netaddr import redact_url
from forkless.io_loop.reconnect import drive
from forkless.io_loop.sources.on_connect import URL_IN_TEXT, HookFailed, guarded_call

__all__ = ["Relogin", "SendFailed"]

log = logging.getLogger("forkless.relogin")

MAX_LOGGED_REASONS = 100  # distinct failure reasons logged at warning; the rest at debug


class SendFailed(ForklessError):
    """``Relogin.send`` could not write the frame (``frame``): no connection within ``hold_s``,
    or its write raised and ``resend`` is off (the write's error is the ``__cause__``)."""

    def __init__(self, message: str, frame: Any) -> None:
        super().__init__(message)
        self.frame = frame


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = URL_IN_TEXT.sub(lambda url: redact_url(url.group()), lines[0] if lines else "")[:200]
    return f"{type(exc).__name__}{': ' + text if text else ''}"


async def write_frame(conn: Any, frame: Any) -> None:
    """The default write: ``send_str`` (aiohttp) or ``send`` (websockets) of the frame's text
    (``bytes`` decoded as UTF-8, any other non-``str`` as compact JSON)."""
    if isinstance(frame, bytes):
        frame = frame.decode()
    elif not isinstance(frame, str):
        frame = json.dumps(frame, separators=(",", ":"))
    send = getattr(conn, "send_str", None) or conn.send
    await send(frame)


class Relogin:
    """One connection of your own client, kept up with fresh credentials (see the module rules)."""

    def __init__(self, connect: Callable[[int], Awaitable[Any]], serve: Callable[[Any], Awaitable[Any]], *,
                 ctx: Any = None, send: Callable[[Any, Any], Awaitable[Any]] = write_frame,
                 hold_s: float | None = 30.0, resend: bool = True, tries: int = 0, connect_timeout_s: float = 10.0,
                 backoff: Backoff | None = None, name: str = "relogin") -> None:
        if not callable(connect) or not callable(serve) or not callable(send):
            raise TypeError("Relogin needs callables: connect(attempt) -> connection, serve(connection), and "
                            "send(connection, frame) if given")
        if (hold_s is not None and not hold_s > 0) or not connect_timeout_s > 0 or tries < 0:
            raise ValueError(f"Relogin needs hold_s > 0 (or None: no bound), connect_timeout_s > 0 and tries >= 0 "
                             f"(0: no bound), not {hold_s!r}, {connect_timeout_s!r}, {tries!r}")
        self._connect, self._serve, self._write, self._ctx = connect, serve, send, ctx
        self.hold_s, self.resend, self.connect_timeout_s, self.name = hold_s, resend, connect_timeout_s, name
        self._backoff = backoff or Backoff(0.05, 5.0, 5.0, tries)
        self._conn: Any = None
        self.connections = 0  # connections opened so far (the current one's number)
        self.figures = {"sends held while not connected": 0, "sends resent": 0, "sends failed": 0}
        self._fatal: FeedFatal | None = None
        self._changed = asyncio.Event()
        self._lock = asyncio.Lock()  # one send at a time: frames go out in the order send was called
        self._task: asyncio.Task[None] | None = None
        self._logged: set[str] = set()

    @property
    def connected(self) -> bool:
        return self._conn is not None

    async def __aenter__(self) -> Relogin:
        self._task = asyncio.create_task(self._keep_up(), name=f"forkless-{self.name}")
        return self

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        await self.aclose()
        if self._fatal is not None and exc is None:
            raise self._fatal  # it gave up: the source fails with it (FeedFatal)

    async def aclose(self) -> None:
        """Stop connecting and close the connection (what ``async with`` does at its end)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # ---- sending ----------------------------------------------------------------------------------

    async def send(self, frame: Any) -> None:
        """Write ``frame`` on the connection, holding it while there is none (see the module rules)."""
        if self._conn is None:
            self._count("sends held while not connected")
        async with self._lock:
            deadline = None if self.hold_s is None else time.monotonic() + self.hold_s
            after = 0  # any connection will do; after a failed write, only a newer one
            while True:
                conn, number = await self._wait_up(after, deadline, frame)
                try:
                    await self._write(conn, frame)
                    return
                except Exception as exc:  # the connection broke under the write
                    if not self.resend:
                        self._count("sends failed")
                        self._log(f"a send failed on connection {number} (resend=False)", _reason(exc))
                        raise SendFailed(f"{self.name}: the write failed on connection {number}: {_reason(exc)}; "
                                         "not written again (resend=False)", frame) from exc
                    self._count("sends resent")
                    after = number
                    if self.hold_s is not None:
                        deadline = time.monotonic() + self.hold_s

    async def _wait_up(self, after: int, deadline: float | None, frame: Any) -> tuple[Any, int]:
        """The connection to write on (one newer than ``after``), waiting for it until ``deadline``."""
        while True:
            if self._fatal is not None:
                self._count("sends failed")
                raise SendFailed(f"{self.name}: no connection: {self._fatal}", frame) from self._fatal
            if self._conn is not None and self.connections > after:
                return self._conn, self.connections
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                self._count("sends failed")
                self._log("a send was not written", f"no connection within hold_s={self.hold_s}")
                raise SendFailed(f"{self.name}: no connection within hold_s={self.hold_s}s; the frame was not "
                                 "written", frame)
            changed = self._changed
            try:
                async with asyncio.timeout(remaining):
                    await changed.wait()
            except TimeoutError:
                pass

    # ---- the connection ---------------------------------------------------------------------------

    def _state_changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _keep_up(self) -> None:
        try:
            await drive(_Link(self), self._backoff)
        finally:
            conn, self._conn = self._conn, None
            self._state_changed()
            if conn is not None:
                await self._close(conn)

    async def _served(self, conn: Any) -> str:
        """One connection: up, served until it ends, closed; why it ended."""
        self._conn = conn
        self.connections += 1
        if self._ctx is not None:
            self._ctx.connection_opened()
        self._state_changed()
        reason = "closed by the peer"
        try:
            await self._serve(conn)
        except Exception as exc:
            reason = _reason(exc)
        finally:
            self._conn = None
            self._state_changed()
            await self._close(conn)  # also when cancelled (the end of the async with)
        self._lost(f"the connection ended: {reason}", opened=True, code=getattr(conn, "close_code", None))
        return reason

    def _lost(self, reason: str, *, opened: bool, code: int | None = None) -> None:
        if self._ctx is not None:
            if opened:  # the close code where the connection has one (aiohttp's and websockets' have)
                self._ctx.connection_closed(reason, code=code if isinstance(code, int) else None)
                self._ctx.reconnecting()
            else:
                self._ctx.connect_failed(reason)
        self._log("connecting again", reason)

    def _give_up(self, giving_up: str) -> FeedFatal:
        self._fatal = FeedFatal(f"giving up: {giving_up}")
        log.error("%s", self._fatal)
        self._state_changed()
        return self._fatal

    async def _close(self, conn: Any) -> None:
        close = getattr(conn, "close", None)
        if close is not None:
            try:
                await close()
            except Exception as exc:  # closing a broken connection: nothing more to learn from it
                log.debug("%s: closing a connection failed: %s", self.name, _reason(exc))

    def _count(self, what: str) -> None:
        self.figures[what] += 1
        if self._ctx is not None:
            self._ctx.count(what)

    def _log(self, what: str, reason: str) -> None:
        key = f"{what}: {reason}"
        first = key not in self._logged and len(self._logged) < MAX_LOGGED_REASONS
        self._logged.add(key)
        log.log(logging.WARNING if first else logging.DEBUG, "%s: %s: %s%s", self.name, what, reason,
                "" if not first else " (logged once per reason)")


class _Link:
    """A ``Relogin``'s side of the reconnect driver (io_loop/reconnect.py): it connects again until
    it gives up or the ``async with`` ends; ``attempt`` counts the failed attempts since the start
    or the last connection served, plus one (the before-connect hook's rule)."""

    failures = (HookFailed,)

    def __init__(self, relogin: Relogin) -> None:
        self.relogin, self.attempt = relogin, 0

    def more(self) -> bool:
        return True

    async def connect(self) -> Any:
        self.attempt += 1
        relogin = self.relogin
        return await guarded_call("connect", lambda _name, n: relogin._connect(n), relogin.name, self.attempt,
                                  relogin.connect_timeout_s, lambda c: c)

    def attempt_failed(self, exc: BaseException) -> str:
        self.relogin._lost(str(exc), opened=False)
        return str(exc)

    def retrying(self, reason: str, delay: float) -> None:
        pass  # logged by _lost, once per reason

    async def serve(self, conn: Any) -> str:
        self.attempt = 0
        return await self.relogin._served(conn)

    def reconnecting(self, reason: str, delay: float) -> None:
        pass  # counted and logged by _served

    def gave_up(self, reason: str, failures: int, lost: bool) -> FeedFatal:
        name = self.relogin.name
        return self.relogin._give_up(f"{name}: {failures} lost connections in a row" if lost
                                     else f"{name}: {self.attempt} failed attempts in a row: {reason}")

    async def pause(self, delay: float) -> None:
        await asyncio.sleep(delay)
