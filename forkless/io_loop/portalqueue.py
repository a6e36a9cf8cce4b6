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
- Deadlines (``from_main`` only): ``put(item, max_age_s=)`` queues the item with its deadline
  (``PortalSends``). The worker's ``get`` never hands out an item past it: one not taken by then is
  given up at its deadline (a timer on the loop, whatever is queued before it), ``to_main`` gets a
  ``SendFailed`` (its id, the item, reason ``"deadline"``) and ``sent_failed`` counts it. Taking and
  giving up are settled under one lock (a ``get`` may run in an executor thread); the count and the
  report are made on the loop only. The ids of such puts are counted under the same lock: ``from_main``
  is a ``queue.Queue`` to whoever puts on it, and two threads' puts once took one id.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Generator
from typing import Any, NoReturn

import janus

from forkless.io_loop.errors import ForklessError
from forkless.io_loop.sends import DEADLINE, SendFailed, checked_max_age

__all__ = ["Empty", "First", "Full", "MainQueue", "PortalQueue", "PortalSends", "WorkerQueue"]

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


class _Timed:
    """An item put with a deadline (``PortalSends``); ``outcome`` is settled once, under the lock."""

    __slots__ = ("deadline", "id", "item", "outcome")

    def __init__(self, item: Any, deadline: float, id: Any) -> None:
        self.item, self.deadline, self.id, self.outcome = item, deadline, id, ""


class PortalSends:
    """The deadlines of what the main thread puts on ``from_main`` (see the module rules). Made on
    the portal's loop; ``report`` puts on ``to_main`` there."""

    def __init__(self, report: Callable[[Any], Any]) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._report = report
        self._lock = threading.Lock()  # an item's outcome, and the count of puts below
        self._sends = 0  # puts with a deadline so far: their id unless the caller gives one
        self.sent_failed: Counter[str] = Counter()  # items given up by reason (written on the loop only)
        self._logged = False

    def timed(self, item: Any, max_age_s: Any, id: Any) -> _Timed:
        """The main thread's put: ``item`` with its deadline (``max_age_s`` from now)."""
        max_age_s = checked_max_age(max_age_s, "put(max_age_s=)")
        if max_age_s is None:
            raise ValueError("put(id=) names an item put with a deadline: give max_age_s too")
        with self._lock:  # one id each, whichever threads put at once (the module rules)
            self._sends += 1
            sends = self._sends
        return _Timed(item, time.monotonic() + max_age_s, sends if id is None else id)

    def watch(self, record: _Timed) -> None:
        """After the put: its deadline is watched on the loop from now."""
        try:
            self._loop.call_soon_threadsafe(self._arm, record)
        except RuntimeError:  # the loop has closed: the portal has ended, nothing is taken any more
            pass

    def take(self, item: Any) -> tuple[bool, Any]:
        """What the worker's ``get`` took: (True, the item to hand out), or (False, None) for one
        given up (now, its deadline passed, or before): skip it."""
        if type(item) is not _Timed:
            return True, item
        outcome = DEADLINE if time.monotonic() >= item.deadline else "taken"
        if not self._settle(item, outcome):
            return False, None
        if outcome == DEADLINE:
            self._given_up(item)
            return False, None
        return True, item.item

    def _arm(self, record: _Timed) -> None:
        if not record.outcome:
            self._loop.call_at(record.deadline, self._due, record)  # loop.time() is time.monotonic()

    def _due(self, record: _Timed) -> None:
        if self._settle(record, DEADLINE):
            self._given_up(record)

    def _settle(self, record: _Timed, outcome: str) -> bool:
        with self._lock:
            if record.outcome:
                return False
            record.outcome = outcome
            return True

    def _given_up(self, record: _Timed) -> None:
        if threading.get_ident() != self._loop_thread:  # a get in an executor thread: counted on the loop
            try:
                self._loop.call_soon_threadsafe(self._given_up, record)
            except RuntimeError:
                pass
            return
        self.sent_failed[DEADLINE] += 1
        if not self._logged:
            self._logged = True
            log.warning("from_main: an item put with max_age_s was not taken by the worker in time: given up, "
                        "to_main gets SendFailed for each (counted in IOPortal.sent_failed; logged once)")
        failed = SendFailed(f"from_main: item {record.id!r} was not taken by the worker within its max_age_s",
                            record.item, id=record.id, reason=DEADLINE, source="from_main")
        try:
            self._report(failed)
        except (janus.AsyncQueueShutDown, janus.SyncQueueShutDown):  # to_main has ended: counted only
            pass


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

    def __init__(self, q: janus.Queue[Any], stopping: asyncio.Event, name: str,
                 sends: PortalSends | None = None) -> None:
        self._q, self._sync = q.async_q, q.sync_q
        self.stopping, self.name = stopping, name
        self._sends = sends  # from_main's: items put with a deadline (PortalSends)
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
        while True:
            try:
                if threading.get_ident() != self._loop_thread:
                    item = self._sync.get_nowait()
                else:
                    item = self._q.get_nowait()
            except (queue.Empty, asyncio.QueueEmpty):
                raise Empty from None
            usable, item = self._taken(item)
            if usable:
                return item

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        _check_timeout(timeout)
        if not block:
            return self.get_nowait()
        if threading.get_ident() == self._loop_thread:
            return _Get(self, timeout)
        run = self._run
        until = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                item = self._sync.get(True, None if until is None else max(0.0, until - time.monotonic()))
            except queue.Empty:
                raise Empty from None
            if run != self._run:  # the run that asked has ended (a restart): the item is the next run's, first
                self._give_back(item)
                raise Empty
            usable, item = self._taken(item)
            if usable:
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

    def _taken(self, item: Any) -> tuple[bool, Any]:
        """An item taken from the queue: (True, what to hand out), or (False, None) for one past its deadline."""
        return (True, item) if self._sends is None else self._sends.take(item)

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
                while True:
                    usable, item = self._taken(await self._q.get())
                    if usable:
                        return item
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

    def __init__(self, q: janus.SyncQueue[Any], raise_end: Callable[[], NoReturn],
                 sends: PortalSends | None = None) -> None:
        self._q = q
        self._raise_end = raise_end
        self._sends = sends  # from_main's: items put with a deadline
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

    def put(self, item: Any, block: bool = True, timeout: float | None = None, *, max_age_s: float | None = None,
            id: Any = None) -> Any:
        """``queue.Queue.put``; ``from_main`` also takes ``max_age_s``: the worker gets the item within
        that many seconds or never (``to_main`` gets ``SendFailed`` with ``id``: the given one, or the
        count of such puts, which ``put`` returns; None without a deadline)."""
        record = None
        if max_age_s is not None or id is not None:
            if self._sends is None:
                raise TypeError("put(max_age_s=, id=) is from_main's: the main thread's items for the worker "
                                "carry a deadline, to_main's do not")
            record = self._sends.timed(item, max_age_s, id)
        try:
            self._q.put(item if record is None else record, block, timeout)
        except janus.SyncQueueShutDown:
            self._raise_end()
        if record is None:
            return None
        self._sends.watch(record)
        return record.id

    def put_nowait(self, item: Any, *, max_age_s: float | None = None, id: Any = None) -> Any:
        return self.put(item, False, max_age_s=max_age_s, id=id)
