"""Relogin: one connection of your own client kept up with fresh credentials, for a ``Source.run`` (or an
``IOPortal`` worker): sends held while it reconnects, each until its own deadline, then written or failed
explicitly. Its contract: docs/embedding/subscriptions.md, "Re-login in your own client".

Rules:
- ``async with Relogin(connect, serve, ...) as link`` on the loop: a task keeps one connection up. ``connect(attempt)``
  logs in and opens it (``attempt > 1``: the last failed, log in again rather than reuse a token); ``serve(conn)``
  reads until it ends. Then it connects again with its ``Backoff`` (the reconnect driver, io_loop/reconnect.py);
  ``tries`` failures in a row: ``FeedFatal``.
- Whatever ``connect`` raises fails that attempt, counted and retried (a ``CancelledError`` that is not the link's
  own too); what ``serve`` raises ends that connection alike. Anything else ending the task ends the link with
  ``FeedFatal`` (logged, raised at the ``async with``'s end, every send failing): it never dies silently.
- ``await link.send(frame)`` writes frames in the order sent. While no connection is up a send is held until the
  earlier of ``hold_s`` after it was sent and its own deadline, then ``SendFailed``; with ``hold_s=0`` or a source
  that refuses sends while disconnected it is refused at once. A write that raised is written again on the next
  connection (``resend=True``) or raises ``SendFailed``. A frame is written or its ``send`` raises, both counted.
- A frame the main thread sent that is given up is reported to it through the ``ctx`` (``ctx.send_failed``).
- A resend covers only writes that raised: a frame written to a connection that then ended may be lost (an
  exchange's ``client_order_id`` makes a resend safe).
- With a ``ctx`` the source's books count it as the built-in feeds are counted; give the source
  ``starts_connected = False``. Failures are logged once per distinct reason, URLs without query or credentials;
  ``connect`` is bounded by ``connect_timeout_s``.
- Leaving the ``async with`` cancels the connection task and closes the connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from forkless.io_loop.backoff import DEFAULT_BACKOFF, Backoff
from forkless.io_loop.errors import FeedFatal
from forkless.io_loop.hooks import HookFailed, guarded_call, own_cancellation, reason_of
from forkless.io_loop.reconnect import closed_how, drive
from forkless.io_loop.seconds import seconds, seconds_or_none, whole
from forkless.io_loop.sends import DEADLINE, DISCONNECTED, GAVE_UP, HOLD, WRITE_FAILED, SendFailed, SentBytes, SentText

__all__ = ["Relogin"]

log = logging.getLogger("forkless.relogin")

MAX_LOGGED_REASONS = 100  # distinct failure reasons logged at warning; the rest at debug



def _reason(exc: BaseException) -> str:
    return reason_of(exc)


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
        hold_s = seconds_or_none(hold_s, "Relogin's hold_s (0: refuse sends while not connected)", "no bound",
                                 zero=True)
        connect_timeout_s = seconds(connect_timeout_s, "Relogin's connect_timeout_s")
        tries = whole(tries, "Relogin's tries", means_zero="no bound")
        if backoff is not None and not isinstance(backoff, Backoff):
            raise TypeError(f"Relogin's backoff is a forkless.Backoff (min_s, max_s, jitter, …), not {backoff!r}")
        self._connect, self._serve, self._write, self._ctx = connect, serve, send, ctx
        self.hold_s, self.resend, self.connect_timeout_s, self.name = hold_s, resend, connect_timeout_s, name
        policy = backoff or DEFAULT_BACKOFF
        self._backoff = policy.fresh(tries=min(t for t in (tries, policy.tries) if t) if tries or policy.tries else 0)
        # refused at once while not connected: hold_s=0, or the source's own declaration
        self._refuse = hold_s == 0 or (ctx is not None and ctx.sends_while_disconnected == "refuse")
        self._conn: Any = None
        self.connections = 0  # connections opened so far (the current one's number)
        self.attempts_failed = 0  # attempts to connect that failed (connect raised, or timed out)
        self.figures = {"sends held while not connected": 0, "sends resent": 0, "sends failed": 0}
        self._fatal: FeedFatal | None = None
        self._changed = asyncio.Event()
        self._lock = asyncio.Lock()  # one send at a time: frames go out in the order send was called
        self._sending = 0  # sends in progress (the one holding the lock and those waiting for it)
        self._task: asyncio.Task[None] | None = None
        self._logged: set[str] = set()

    @property
    def connected(self) -> bool:
        return self._conn is not None

    @property
    def backoff(self) -> Backoff:
        """The reconnect policy in use (its own copy of the one given, or of ``DEFAULT_BACKOFF``)."""
        return self._backoff

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

    async def send(self, frame: Any, *, deadline: float | None = None, id: Any = None) -> None:
        """Write ``frame`` on the connection, holding it while there is none until its deadline:
        the earlier of ``hold_s`` after it was sent and ``deadline`` (``time.monotonic()`` seconds),
        or the deadline a frame the main thread sent carries (see the module rules). ``id`` names
        it in ``SendFailed`` (a frame the main thread sent carries its send's)."""
        mains = isinstance(frame, (SentText, SentBytes))  # sent by the main thread: its time, deadline and id
        sent_at = frame.sent_at if mains else time.monotonic()
        if mains:
            id = frame.send_id if id is None else id
            if frame.deadline is not None:
                deadline = frame.deadline if deadline is None else min(deadline, frame.deadline)
        until, why = deadline, DEADLINE
        if self.hold_s is not None and (until is None or sent_at + self.hold_s < until):
            until, why = sent_at + self.hold_s, HOLD
        if self._conn is None:
            if self._refuse:
                self._fail(frame, id, DISCONNECTED, "no connection, and sends are refused while not connected")
            self._count("sends held while not connected")
        self._sending += 1
        try:
            if self._sending == 1 or until is None:  # alone, the lock is free: no timer, which costs a send dearly
                await self._lock.acquire()
            else:  # behind other sends: its turn is awaited no longer than its own deadline
                try:
                    async with asyncio.timeout(max(0.0, until - time.monotonic())):
                        await self._lock.acquire()
                except TimeoutError:
                    self._fail_late(frame, id, why)
            try:
                await self._write_held(frame, id, until, why)
            finally:
                self._lock.release()
        finally:
            self._sending -= 1

    async def _write_held(self, frame: Any, id: Any, until: float | None, why: str) -> None:
        """The write, its turn come: on the connection up, waiting for one until ``until``."""
        after = 0  # any connection will do; after a failed write, only a newer one
        while True:
            conn, number = await self._wait_up(after, until, why, frame, id)
            try:
                await self._write(conn, frame)
                return
            except Exception as exc:  # the connection broke under the write
                if not self.resend:
                    self._fail(frame, id, WRITE_FAILED, f"the write failed on connection {number}: "
                               f"{_reason(exc)}; not written again (resend=False)", cause=exc)
                self._count("sends resent")
                after = number

    async def _wait_up(self, after: int, until: float | None, why: str, frame: Any, id: Any) -> tuple[Any, int]:
        """The connection to write on (one newer than ``after``), waiting for it until ``until``."""
        while True:
            if self._fatal is not None:
                self._fail(frame, id, GAVE_UP, f"no connection: {self._fatal}", cause=self._fatal)
            if self._conn is not None and self.connections > after:
                return self._conn, self.connections
            if self._refuse:
                self._fail(frame, id, DISCONNECTED, "the connection ended, and sends are refused while not "
                           "connected")
            remaining = None if until is None else until - time.monotonic()
            if remaining is not None and remaining <= 0:
                self._fail_late(frame, id, why)
            changed = self._changed
            try:
                async with asyncio.timeout(remaining):
                    await changed.wait()
            except TimeoutError:
                pass

    def _fail_late(self, frame: Any, id: Any, why: str) -> NoReturn:
        if why == HOLD:
            self._fail(frame, id, HOLD, f"no connection within hold_s={self.hold_s}s; the frame was not written")
        self._fail(frame, id, DEADLINE, "its deadline passed before a connection could take it; the frame was "
                   "not written")

    def _fail(self, frame: Any, id: Any, reason: str, text: str, cause: BaseException | None = None) -> NoReturn:
        """Give the send up: counted, logged once per reason, reported to the main thread when it sent it."""
        self._count("sends failed")
        self._log("a send was not written", text if reason in (HOLD, DISCONNECTED) else reason)
        if self._ctx is not None and isinstance(frame, (SentText, SentBytes)):
            self._ctx.send_failed(frame, reason, cause=cause)
        raise SendFailed(f"{self.name}: {text}", frame, id=id, reason=reason, source=self.name) from cause

    # ---- the connection ---------------------------------------------------------------------------

    def _state_changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _keep_up(self) -> None:
        try:
            await drive(_Link(self), self._backoff)
        except asyncio.CancelledError as exc:
            if own_cancellation():  # aclose: the end of the async with
                raise
            self._give_up(f"{self.name}: the connection task ended: CancelledError (not the link's own "
                          "cancellation)", cause=exc)
        except FeedFatal:
            raise  # tries used up: _give_up said so
        except BaseException as exc:  # never silent: the link ends, every send fails, the async with raises
            log.error("%s: the connection task failed", self.name, exc_info=exc)
            self._give_up(f"{self.name}: the connection task failed: {_reason(exc)}", cause=exc)
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
        reason = ""  # serve returned: the close code says how it ended
        try:
            await self._serve(conn)
        except asyncio.CancelledError as exc:
            if own_cancellation():
                raise
            reason = f"{_reason(exc)} (raised by serve, not a cancellation of the link)"
        except Exception as exc:
            reason = _reason(exc)
        finally:
            self._conn = None
            self._state_changed()
            await self._close(conn)  # also when cancelled (the end of the async with)
        code = getattr(conn, "close_code", None)  # aiohttp's and websockets' connections have one
        code = code if isinstance(code, int) and not isinstance(code, bool) else None
        reason = reason or closed_how(code)  # 1006: lost without a close frame, never "closed by the peer"
        self._lost(f"the connection ended: {reason}", opened=True, code=code)
        return reason

    def _lost(self, reason: str, *, opened: bool, code: int | None = None) -> None:
        if self._ctx is not None:
            if opened:
                self._ctx.connection_closed(reason, code=code)
                self._ctx.reconnecting()
            else:
                self._ctx.connect_failed(reason)
        if not opened:
            self.attempts_failed += 1
        self._log("connecting again", reason)

    def _give_up(self, giving_up: str, cause: BaseException | None = None) -> FeedFatal:
        """The link gives up: its ``FeedFatal`` (``cause``, what ended the connection task, its
        ``__cause__``), raised at the ``async with``'s end and the cause of every send it fails."""
        self._fatal = FeedFatal(f"giving up: {giving_up}")
        self._fatal.__cause__ = cause
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
    or the last connection served, plus one (the before-connect hook's rule). Whatever ``connect``
    raises (``guarded_call``: an exception, a timeout, a ``CancelledError`` not the link's own) is a
    ``HookFailed``: a failed attempt."""

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
