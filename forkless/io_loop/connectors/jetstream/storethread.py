"""StoreThread: the checkpoint store's own thread, asyncio loop and NATS connection (store.py composes it with the
leases and the objects).

Rules:
- One connection on a daemon thread of its own ("forkless-store", a ``LoopThread``), apart from the IO thread: a
  large checkpoint never delays the feeds, and a busy IO loop never delays a renewal. ``call`` runs a coroutine
  there and blocks, from any thread but the store's own (RuntimeError); the connection is touched on the loop only.
- ``start`` connects with ``Backoff`` per ``FORKLESS_RECONNECT_*`` (tries used up, or credentials refused:
  ``FeedFatal``), then opens the caller's buckets, their failure retried as a connection's. A connection lost
  later is made again on demand, one attempt by the operation that needs it (``StoreError`` if it fails).
- The connection is a ``Transport``: a failure the parts do not handle reaches ``call``'s caller as one
  ``StoreError`` naming it. No secret is logged (nats-py's logging error callback is replaced).
- A wait is never deaf to a stop: ``start`` looks at the caller's stop every ``STOP_POLL_S`` (``sleep_or_stop``):
  ``StopRequested``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from forkless.io_loop.backoff import Backoff
from forkless.io_loop.connectors.jetstream.transport import NatsConnectFailed as _Failed
from forkless.io_loop.connectors.jetstream.transport import NatsError, NatsUnavailable, Transport, connect_options
from forkless.io_loop.connectors.jetstream.transport import describe_error as _describe
from forkless.io_loop.errors import FeedFatal, StopRequested, StoreError
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.loopthread import LoopThread
from forkless.io_loop.settings import ReconnectSettings, Timeouts, TlsSettings

__all__ = ["StoreThread", "each", "sleep_or_stop"]

log = logging.getLogger("forkless.store")

T = TypeVar("T")

CONCURRENT_REQUESTS = 64  # requests (create, get, update, delete) under way at once, over many keys
CLOSE_S = 1.0
STOP_POLL_S = 0.05  # a wait (connection retries, a dead holder's lease) looks at the caller's stop this often
TAKE_ATTEMPTS = 5  # a lease key changing hands under a claimant, an object overwritten while read: StoreError
NAME_IN_USE = 10058  # JetStream's "stream name already in use with a different configuration"


async def sleep_or_stop(seconds: float, stop: threading.Event | None) -> None:
    """``asyncio.sleep(seconds)``, looking at ``stop`` every ``STOP_POLL_S``: ``StopRequested``
    once it is set (a ``threading.Event``: the caller's stop request, set by a signal handler)."""
    end = time.monotonic() + seconds
    while True:
        if stop is not None and stop.is_set():
            raise StopRequested("a stop was requested while the checkpoint store waited")
        left = end - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(left, STOP_POLL_S) if stop is not None else left)


async def each(fn: Callable[[str], Awaitable[T]], items: Iterable[str]) -> list[T]:
    """``fn`` on every item, at most ``CONCURRENT_REQUESTS`` at once; the first error cancels the rest and
    is raised as it is (not in an ExceptionGroup)."""
    gate = asyncio.Semaphore(CONCURRENT_REQUESTS)

    async def one(item: str) -> T:
        async with gate:
            return await fn(item)

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(item)) for item in items]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


class StoreThread:
    """The store's thread, loop and connection to the server of the JetStream feed ``feed``
    (see the module rules). ``start`` first, ``close`` last."""

    def __init__(self, feed: FeedSpec, *, timeouts: Timeouts, reconnect: ReconnectSettings, tls: TlsSettings) -> None:
        self.timeouts = timeouts
        self.reconnect = reconnect
        self.tls = tls
        self.feed = feed
        self.shown = feed.shown_url
        self.api_s = timeouts.connect_timeout_s  # a JetStream API call's timeout
        self._guard = threading.Lock()  # start and close
        self._runner: LoopThread | None = None  # the thread and its loop (io_loop/loopthread.py)
        self.closed = False
        # ---- the store's loop only ----
        self._nc: Transport | None = None  # the connection (a new one with each connection)
        self._connecting: asyncio.Lock | None = None
        self.nats_error = ""  # what nats-py's error callback said last

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The store's loop once started."""
        return self._runner.loop if self._runner is not None else None

    @property
    def running(self) -> bool:
        return self.loop is not None and not self.closed

    # ---- the thread and the calls onto it --------------------------------------------------------------

    def start(self, stop: threading.Event | None, open_buckets: Callable[[Transport], Awaitable[str]]) -> None:
        """Start the thread, connect (retrying) and ``open_buckets(transport)`` (what it returns is
        logged). Raises ``FeedFatal`` when the server cannot be used, ``StopRequested`` once
        ``stop`` is set between two attempts; then the thread is ended."""
        with self._guard:
            if self._runner is not None or self.closed:
                raise RuntimeError("NatsStore.start: started already (a store is started once)")
            self._runner = runner = LoopThread("forkless-store")
            runner.start(self._serve)  # returns once the loop serves calls
        try:
            self.call(self._start(stop, open_buckets))
        except BaseException:
            self._end_thread()
            raise

    def close(self, last: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``last()`` on the loop, then close the connection and end the thread, within
        ``FORKLESS_SHUTDOWN_TIMEOUT_S``. Idempotent."""
        with self._guard:
            if self.closed:
                return
            if self._runner is None:
                self.closed = True
                return
        try:  # bounded: with the server gone, the release's one connection attempt must not hold a stop
            self.call(self._close(last), timeout=self.timeouts.shutdown_timeout_s)
        except Exception as exc:  # the connection is closed below in any case
            log.warning("closing the checkpoint store on %s: %s", self.shown, _describe(exc))
        finally:
            self._end_thread()

    async def _serve(self) -> None:
        """The thread's main coroutine: the loop serves ``call`` until ``_end_thread`` cancels it;
        a call still running then is cancelled and awaited (LoopThread's exit)."""
        assert self._runner is not None
        self._runner.ready()
        await asyncio.Event().wait()

    def _end_thread(self) -> None:
        with self._guard:
            self.closed = True
            runner = self._runner
        if runner is not None:
            runner.cancel()  # nothing once the loop has closed
            if runner.thread is not threading.current_thread():
                runner.join(CLOSE_S * 5)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the store's loop and wait for it; what NATS raises becomes ``StoreError``."""
        runner = self._runner
        if runner is None or self.closed or not runner.alive:
            coro.close()
            raise RuntimeError("the checkpoint store is not started (call start()) or is closed")
        if threading.current_thread() is runner.thread:
            coro.close()
            raise RuntimeError("a NatsStore method was called on the store's own thread: it would wait for itself")
        future = runner.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.CancelledError:
            raise StoreError(f"the checkpoint store on {self.shown} was closed during the call") from None
        except (NatsError, TimeoutError) as exc:  # TimeoutError: the wait above (the work's own is a NatsError)
            if not future.done():
                future.cancel()
                raise StoreError(f"the checkpoint store on {self.shown} did not finish within {timeout:g} s") from None
            raise StoreError(f"the checkpoint store on {self.shown}: {_describe(exc)}") from None

    # ---- connecting (the store's loop) ---------------------------------------------------------------

    async def _start(self, stop: threading.Event | None, open_buckets: Callable[[Transport], Awaitable[str]]) -> None:
        self._connecting = asyncio.Lock()
        backoff = Backoff.of(self.reconnect)
        while True:
            try:
                await self._connect()
                opened = await self._open(open_buckets)
                log.info("checkpoint store on %s: %s", self.shown, opened)
                return
            except _Failed as exc:
                await self._drop_connection()
                if exc.fatal:
                    raise FeedFatal(f"checkpoint store on {self.shown}: {exc}") from None
                delay = backoff.failed()
                if delay is None:
                    raise FeedFatal(f"giving up on the checkpoint store on {self.shown} after {backoff.failures} "
                                    f"failed attempts in a row: {exc}") from None
                log.warning("checkpoint store on %s: %s; retrying in %.2fs", self.shown, exc, delay)
                await sleep_or_stop(delay, stop)

    async def _open(self, open_buckets: Callable[[Transport], Awaitable[str]]) -> str:
        """``open_buckets(transport)``, its errors raised as ``_Failed``."""
        try:
            return await open_buckets(self.transport)
        except NatsUnavailable:
            raise _Failed("JetStream does not answer (not enabled: nats-server -js; or starting)") from None
        except NatsError as exc:
            if exc.api:  # the server answered an error
                raise _Failed(f"making the buckets failed: {_describe(exc)}", fatal=exc.code in (400, 403)) from None
            raise _Failed(f"reading the buckets failed: {self.nats_error or _describe(exc)}") from None

    async def _connect(self) -> None:
        """One attempt; raises ``_Failed``."""
        async def on_error(exc: Exception) -> None:  # nats-py's default logs the exception
            self.nats_error = _describe(exc)

        async def on_event() -> None:
            pass

        options = connect_options(self.feed, self.timeouts, self.tls, error_cb=on_error, disconnected_cb=on_event,
                                  closed_cb=on_event)
        options["name"] = f"forkless-store-{self.feed.name}"
        self.nats_error = ""
        try:
            nc = await Transport.connect(self.timeouts, options, api_s=self.api_s)
        except _Failed as exc:
            if exc.fatal:
                raise _Failed(f"the server refused the credentials (check the user:password in \"nats\", \"token\" "
                              f"or \"creds\" of {self.feed.label})", fatal=True) from None
            raise _Failed(f"cannot connect: {self.nats_error or exc}") from None
        self._nc = nc

    async def _drop_connection(self) -> None:
        nc, self._nc = self._nc, None
        if nc is not None:
            await nc.close(CLOSE_S)

    @property
    def transport(self) -> Transport:
        """The connection of the moment (the store's loop only; after ``connection()``)."""
        if self._nc is None:
            raise StoreError(f"the checkpoint store on {self.shown} is not connected")
        return self._nc

    async def connection(self) -> None:
        """Connected, or one attempt to connect again; ``StoreError`` if it fails."""
        if self._nc is not None and self._nc.is_connected:
            return
        assert self._connecting is not None
        async with self._connecting:
            if self._nc is not None and self._nc.is_connected:
                return
            await self._drop_connection()
            try:
                await self._connect()
            except _Failed as exc:
                raise StoreError(f"the checkpoint store on {self.shown}: {exc}") from None
            log.info("checkpoint store: connected again to %s", self.shown)

    async def _close(self, last: Callable[[], Coroutine[Any, Any, None]]) -> None:
        try:
            await last()
        finally:
            await self._drop_connection()
