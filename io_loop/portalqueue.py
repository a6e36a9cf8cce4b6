"""The queue ends of an ``IOPortal`` (io_loop/portal.py): the worker's, which behave as
``multiprocessing.Queue``'s when called that way, and the main thread's, ``queue.Queue``'s.

Rules:
- ``WorkerQueue`` is made on the portal's loop. Called on the loop it never blocks: ``put``
  enqueues at once or, the queue full, keeps the item waiting in order (moved in as the main thread
  takes; never lost, awaited or not) and returns an awaitable that waits for it to be in;
  ``get`` returns an awaitable (a blocking get would stop the loop). Called from another thread
  (``loop.run_in_executor``) ``put`` and ``get`` block as ``multiprocessing.Queue``'s do.
- Only the loop touches what is waiting; the portal takes it at the end (``take_waiting``): for the
  main thread after the rest (``MainQueue.leftover``) when the worker returned, counted in the
  log as dropped when it failed.
- ``MainQueue`` is the main thread's: ``queue.Queue``'s calls; once the queue has ended they
  raise what the portal says (``WorkerFailed`` or ``PortalClosed``), after the leftover.
- A worker restarted (``IOPortal(restart=...)``) keeps its ends: what is waiting or queued waits for
  the next run. A blocking ``get`` from another thread that its run left behind (an executor get
  whose awaiting task the worker cancelled as it returned) may take an item after that run ended
  (``run_ended``): the item is given back at the front of the queue (``PortalQueue``'s ``First``)
  for the next run, and that get raises ``Empty``. A get on the loop from a task the worker left
  running is the worker's: it must cancel what it started before it returns.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Generator
from typing import Any, NoReturn

import janus
from forkless.io_loop.errors import ForklessError

__all__ = ["Empty", "First", "Full", "MainQueue", "PortalQueue", "WorkerQueue"]

log = logging.getLogger("forkless.portal")


class Empty(ForklessError, queue.Empty, asyncio.QueueEmpty):
    """``WorkerQueue.get_nowait`` found nothing: both ``queue.Empty`` and ``asyncio.QueueEmpty``."""


class Full(ForklessError, queue.Full, asyncio.QueueFull):
    """``WorkerQueue.put_nowait`` found it full: both ``queue.Full`` and ``asyncio.QueueFull``."""


class First:
    """An item put back at the front of a ``PortalQueue``: a finished run's get took it (module rules)."""

    __slots__ = ("item",)

    def __init__(self, item: Any) -> None:
        self.item = item


class PortalQueue(janus.Queue[Any]):
    """A janus queue whose ``put`` of a ``First`` puts its item at the front (janus's extension
    point, as its ``PriorityQueue``: ``_init``, ``_qsize``, ``_put``, ``_get``, called under its lock)."""

    def _init(self, maxsize: int) -> None:
        self._items: deque[Any] = deque()

    def _qsize(self) -> int:
        return len(self._items)

    def _put(self, item: Any) -> None:
        if type(item) is First:
            self._items.appendleft(item.item)
        else:
            self._items.append(item)

    def _get(self) -> Any:
        return self._items.popleft()


class _Sized:
    """``qsize``, ``empty`` and ``full``, as ``queue.Queue``'s, of the janus end ``_q``."""

    _q: Any

    def qsize(self) -> int:
        return self._q.qsize()

    def empty(self) -> bool:
        return self.qsize() == 0

    def full(self) -> bool:
        return self._q.full()


class _Enqueued:
    """What ``WorkerQueue.put`` returns when the item is already in the queue: awaiting it does
    nothing, and not awaiting it loses nothing (it is not a coroutine: no "never awaited")."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return iter(())


ENQUEUED = _Enqueued()


class _WaitingPut:
    """An item ``put`` on the loop while the queue was full: waiting, in order, until the main thread
    makes room, then moved in. Awaiting it waits for that (with the put's ``timeout``: ``Full``,
    the item withdrawn); not awaiting it still delivers it."""

    __slots__ = ("_end", "_timeout", "item", "moved")

    def __init__(self, item: Any, end: WorkerQueue, timeout: float | None) -> None:
        self.item, self._end, self._timeout = item, end, timeout
        self.moved = asyncio.get_running_loop().create_future()  # set once the item is in the queue

    def __await__(self) -> Generator[Any, None, None]:
        return self._end._wait_moved(self, self._timeout).__await__()


class _Get:
    """What ``WorkerQueue.get`` returns on the loop: await it for the item. One never awaited took
    nothing; it says so in the log when it is dropped (a blocking get cannot run on the loop)."""

    __slots__ = ("_awaited", "_end", "_timeout")

    def __init__(self, end: WorkerQueue, timeout: float | None) -> None:
        self._end, self._timeout, self._awaited = end, timeout, False

    def __await__(self) -> Generator[Any, None, Any]:
        self._awaited = True
        return self._end._get_within(self._timeout).__await__()

    def __repr__(self) -> str:
        return "<WorkerQueue.get() not awaited: nothing was taken; see WorkerQueue>"

    def __del__(self) -> None:
        if not self._awaited:
            log.error("%s.get() was called on the IO loop and not awaited: nothing was taken. On the loop, "
                      "await it, or call get_nowait() or get(block=False); a blocking get(timeout=...) runs "
                      "in loop.run_in_executor", self._end.name)


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout >= 0:  # as queue.Queue's
        raise ValueError(f"timeout must be a non-negative number of seconds or None, not {timeout!r}")


class WorkerQueue(_Sized):
    """The worker's end of a queue, behaving as ``multiprocessing.Queue``'s when called that way,
    on the loop or from another thread (``loop.run_in_executor``), and awaitable on the loop:

    - ``put(item, block=True, timeout=None)``: on the loop it never blocks: the item is in the
      queue before it returns, or, the queue full, kept waiting in order and moved in as the main thread
      takes (never lost, awaited or not); awaiting what it returns waits for the item to be in
      (``timeout``: ``Full`` after it, the item withdrawn). From another thread it blocks as
      ``multiprocessing.Queue.put`` does. ``block=False`` is ``put_nowait``.
    - ``get(block=True, timeout=None)``: from another thread it blocks as
      ``multiprocessing.Queue.get`` does (``Empty`` after ``timeout``); on the loop it returns an
      awaitable (``await get()``; ``timeout``: ``Empty`` after it): a blocking call would stop the
      loop. ``get(False)`` is ``get_nowait``, anywhere.
    - ``put_nowait``, ``get_nowait``, ``qsize``, ``empty``, ``full`` anywhere; ``Empty`` and
      ``Full`` are both the ``queue`` and the ``asyncio`` ones. Waiting items count in ``qsize``;
      ``full()`` is True while any waits.

    ``stopping`` is set when the portal's stop begins. After the end, calls raise janus's
    ``AsyncQueueShutDown`` on the loop, ``SyncQueueShutDown`` in another thread."""

    def __init__(self, q: janus.Queue[Any], stopping: asyncio.Event, name: str) -> None:
        self._q, self._sync = q.async_q, q.sync_q
        self.stopping, self.name = stopping, name
        self._loop_thread = threading.get_ident()  # made on the loop
        self._waiting: deque[_WaitingPut] = deque()  # items put while full, in order (loop only)
        self._mover: asyncio.Task[None] | None = None
        self._full_logged = False
        self._run = 0  # the worker's runs ended so far (run_ended): a get of an ended run gives back what it took

    def qsize(self) -> int:
        return self._q.qsize() + len(self._waiting)

    def full(self) -> bool:
        return bool(self._waiting) or self._q.full()

    def _full(self) -> Full:
        return Full(f"the queue holds queue_size={self._q.maxsize} items: the main thread takes them too "
                    "slowly (a larger queue_size, or 0 for no bound)")

    def put_nowait(self, item: Any) -> None:
        if threading.get_ident() != self._loop_thread:
            try:
                self._sync.put_nowait(item)
            except queue.Full:
                raise self._full() from None
            return
        if self._waiting:  # waiting items go first: this one may not pass them
            raise self._full()
        try:
            self._q.put_nowait(item)
        except asyncio.QueueFull:
            raise self._full() from None

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> _Enqueued | _WaitingPut:
        _check_timeout(timeout)
        if not block:
            self.put_nowait(item)
            return ENQUEUED
        if threading.get_ident() != self._loop_thread:
            try:
                self._sync.put(item, True, timeout)
            except queue.Full:
                raise self._full() from None
            return ENQUEUED
        if not self._waiting:
            try:
                self._q.put_nowait(item)
                return ENQUEUED
            except asyncio.QueueFull:
                pass
        waiting = _WaitingPut(item, self, timeout)
        self._waiting.append(waiting)
        if self._mover is None:
            self._mover = asyncio.get_running_loop().create_task(self._move(), name=f"forkless-portal-{self.name}")
        if not self._full_logged:
            self._full_logged = True
            log.warning("%s is full (queue_size=%d): put() holds what comes, in order, until the main thread "
                        "takes some (await put() to wait for room instead; logged once)", self.name, self._q.maxsize)
        return waiting

    def get_nowait(self) -> Any:
        try:
            if threading.get_ident() != self._loop_thread:
                return self._sync.get_nowait()
            return self._q.get_nowait()
        except (queue.Empty, asyncio.QueueEmpty):
            raise Empty from None

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        _check_timeout(timeout)
        if not block:
            return self.get_nowait()
        if threading.get_ident() == self._loop_thread:
            return _Get(self, timeout)
        run = self._run
        try:
            item = self._sync.get(True, timeout)
        except queue.Empty:
            raise Empty from None
        if run != self._run:  # the run that asked has ended (a restart): the item is the next run's, first
            self._give_back(item)
            raise Empty
        return item

    def run_ended(self) -> None:
        """The worker's run has ended (on the loop): a blocking get it left behind gives back what it takes."""
        self._run += 1

    def _give_back(self, item: Any) -> None:
        """Put ``item`` back at the front (another thread: this may wait for room, as a put does)."""
        try:
            self._sync.put(First(item))
        except janus.SyncQueueShutDown:
            log.error("%s: an item a finished run of the IO worker took was not given back: the portal has "
                      "ended (dropped)", self.name)

    # ---- the loop's side of put and get ---------------------------------------------------------

    async def _move(self) -> None:
        """Move the waiting items into the queue as room comes, in order (one task while any waits)."""
        try:
            while self._waiting:
                waiting = self._waiting[0]
                await self._q.put(waiting.item)  # a cancelled janus put has not put its item
                self._waiting.popleft()
                waiting.moved.set_result(None)
        except janus.AsyncQueueShutDown:
            pass  # the end: what is still waiting is the portal's to hand over or count (IOPortal._main)
        finally:
            if self._mover is asyncio.current_task():
                self._mover = None

    async def _wait_moved(self, waiting: _WaitingPut, timeout: float | None) -> None:
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(waiting.moved)  # cancelling the waiter leaves the item waiting, to be delivered
        except TimeoutError:
            if waiting.moved.done() or not self._withdraw(waiting):
                return
            raise self._full() from None

    def _withdraw(self, waiting: _WaitingPut) -> bool:
        """Take a waiting item back (its put timed out); False if it no longer waits."""
        if waiting not in self._waiting:
            return False
        if self._waiting[0] is waiting and self._mover is not None:
            self._mover.cancel()  # its put of this item has not happened: a cancelled put never does
            self._mover = None
        self._waiting.remove(waiting)
        if self._waiting and self._mover is None:
            self._mover = asyncio.get_running_loop().create_task(self._move(), name=f"forkless-portal-{self.name}")
        return True

    async def _get_within(self, timeout: float | None) -> Any:
        try:
            async with asyncio.timeout(timeout):
                return await self._q.get()
        except TimeoutError:
            raise Empty from None

    async def take_waiting(self) -> list[Any]:
        """The items still waiting, taken (the mover stopped): at the end, for the main thread or the count."""
        mover, self._mover = self._mover, None
        if mover is not None:
            mover.cancel()
            await asyncio.gather(mover, return_exceptions=True)
        items = [waiting.item for waiting in self._waiting]
        self._waiting.clear()
        return items


class MainQueue(_Sized):
    """The main thread's end of a queue: ``queue.Queue``'s calls (``queue.Empty``, ``queue.Full``);
    once the queue has ended they raise ``WorkerFailed`` (the worker failed) or ``PortalClosed``,
    after handing out what the worker's ``put`` still kept waiting when it returned."""

    def __init__(self, q: janus.SyncQueue[Any], raise_end: Callable[[], NoReturn]) -> None:
        self._q = q
        self._raise_end = raise_end
        self.leftover: deque[Any] = deque()  # filled on the loop before the queue ends; read after

    def qsize(self) -> int:
        return self._q.qsize() + len(self.leftover)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        try:
            return self._q.get(block, timeout)
        except janus.SyncQueueShutDown:
            if self.leftover:
                return self.leftover.popleft()
            self._raise_end()

    def get_nowait(self) -> Any:
        return self.get(False)

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        try:
            self._q.put(item, block, timeout)
        except janus.SyncQueueShutDown:
            self._raise_end()

    def put_nowait(self, item: Any) -> None:
        self.put(item, False)
