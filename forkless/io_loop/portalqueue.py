"""The queue ends of an ``IOPortal``: the worker's, which behave as ``multiprocessing.Queue``'s when called that way,
and the main thread's, ``queue.Queue``'s. They are the portal's semantics over the bridge's two queues
(io_loop/bridge.py): ``to_main`` is its *inbound*, ``from_main`` its *outbound*, one wake-up per put.

Rules:
- Each end holds both sides of its queue: the loop's (janus's async side; ``OutboundReceiver``) and the other
  threads' (janus's sync side; ``OutboundSender``, whose puts wake the loop's reader).
- ``WorkerQueue`` is made on the portal's loop. On the loop it never blocks: ``put`` enqueues or, full, keeps the
  item waiting in order (never lost) and returns an awaitable; ``get`` returns an awaitable. From another thread
  (``run_in_executor``) both block as ``multiprocessing.Queue``'s do.
- Only the loop touches what is waiting; the portal takes it at the end (``take_waiting``).
- ``MainQueue`` has ``queue.Queue``'s calls; once the queue has ended they raise what the portal says, after the
  leftover.
- A restarted worker keeps its ends. An executor ``get`` a run left behind that takes an item after the run ended
  gives it back at the front for the next run and raises ``Empty``; a get on the loop from a task the worker left
  running is the worker's: it cancels what it started before it returns.
- Deadlines (``from_main`` only, ``PortalSends``): ``get`` never hands out an item past its deadline; one not taken
  by then is given up (``SendFailed``, ``"deadline"``). Taking, giving up and counting the puts' ids are settled
  under one lock (a ``get`` may run in an executor thread); the report is made on the loop only.
- Answers: a put with an ``id`` awaits the worker's answering item (``on_put``); ``untaken`` counts what the worker
  has neither taken nor seen given up, and the stop waits for it to be 0.
- The portal's own items (``ConnectionEvent``s, ``SendFailed`` reports) go in with ``put_own``, unseen as "up".
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

from forkless.io_loop.bridge import OutboundReceiver, OutboundSender
from forkless.io_loop.errors import ForklessError
from forkless.io_loop.sends import DEADLINE, LOST, NOT_TAKEN, STOP_DEADLINE, SendFailed, Unanswered, checked_max_age

__all__ = ["Empty", "First", "Full", "MainQueue", "PortalQueue", "PortalSends", "WorkerQueue"]

log = logging.getLogger("forkless.portal")

LoopSide = janus.AsyncQueue[Any] | OutboundReceiver[Any]  # a queue's side on the loop
SyncSide = janus.SyncQueue[Any] | OutboundSender[Any]  # ... in other threads


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


class _Enqueued:
    """What ``WorkerQueue.put`` returns when the item is already in the queue: awaiting it does
    nothing, and not awaiting it loses nothing (it is not a coroutine: no "never awaited")."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        return iter(())  # type: ignore[return-value]  # await takes any iterator; typeshed asks a Generator


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
    """An item put with a deadline or an id (``PortalSends``); ``outcome`` is settled once, under the lock."""

    __slots__ = ("deadline", "id", "item", "outcome")

    def __init__(self, item: Any, deadline: float | None, id: Any) -> None:
        self.item, self.deadline, self.id, self.outcome = item, deadline, id, ""


class PortalSends:
    """What the main thread puts on ``from_main``, followed (see the module rules): each item until
    the worker takes it (``untaken``), its deadline, and, with ``answers``, the answer of each put
    with an ``id``. Made on the portal's loop; ``report`` puts on ``to_main`` there."""

    def __init__(self, report: Callable[[Any], Any], *, answers: bool = False) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._report = report
        self.answers = answers  # IOPortal(send_answered=...): a put with an id awaits its answer
        self._lock = threading.Lock()  # an item's outcome, the count of puts, what is untaken and awaited below
        self._sends = 0  # puts with a deadline so far: their id unless the caller gives one
        self.untaken = 0  # items put and neither taken by the worker nor given up (under the lock)
        self._queued: dict[Any, _Timed] = {}  # items put with an id that await an answer, not taken yet
        self._unanswered = Unanswered()  # ... taken by a run (its number), their answer not come yet
        self.sent_failed: Counter[str] = Counter()  # items never taken, by reason (written on the loop only)
        self.awaited_unanswered: Counter[str] = Counter()  # items taken whose answer never came, by reason
        self._logged: set[str] = set()

    def awaiting(self) -> int:
        """Answers still awaited: items put with an id, taken or not, not answered nor given up."""
        with self._lock:
            return len(self._queued) + len(self._unanswered)

    def handed(self) -> bool:
        """True when every item the main thread put was taken by the worker (or given up)."""
        return self.untaken <= 0

    def timed(self, item: Any, max_age_s: Any, id: Any) -> _Timed:
        """The main thread's put: ``item`` with its deadline (``max_age_s`` from now) and id; with
        ``answers``, an item with an id awaits its answer from now (``ValueError`` for an id awaited already)."""
        max_age_s = checked_max_age(max_age_s, "put(max_age_s=)")
        if max_age_s is None and not self.answers:
            raise ValueError("put(id=) names an item put with a deadline: give max_age_s too (or give the portal "
                             "send_answered=, to follow the answer of each item put with an id)")
        awaits = self.answers and id is not None
        with self._lock:  # one id each, whichever threads put at once (the module rules)
            if awaits and (id in self._queued or id in self._unanswered):
                raise ValueError(f"put(id={id!r}): an item put with that id awaits its answer already; an id names "
                                 f"one item")
            self._sends += 1
            record = _Timed(item, None if max_age_s is None else time.monotonic() + max_age_s,
                            self._sends if id is None else id)
            if awaits:
                self._queued[record.id] = record
        return record

    def putting(self) -> None:
        """The main thread is about to put an item (``put_failed`` if the put raises)."""
        with self._lock:
            self.untaken += 1

    def put_failed(self, record: _Timed | None) -> None:
        """The put raised (full, or the portal ended): the item is not there."""
        with self._lock:
            self.untaken -= 1
            if record is not None:
                record.outcome = "not put"
                self._queued.pop(record.id, None)

    def take(self, item: Any, run: int) -> tuple[bool, Any]:
        """What the worker's ``get`` took in its ``run``: (True, the item to hand out), or (False,
        None) for one given up (now, its deadline passed, or before): skip it."""
        if type(item) is not _Timed:
            with self._lock:
                self.untaken -= 1
            return True, item
        outcome = DEADLINE if item.deadline is not None and time.monotonic() >= item.deadline else "taken"
        with self._lock:
            if item.outcome:
                return False, None
            item.outcome = outcome
            self.untaken -= 1
            if self._queued.pop(item.id, None) is not None and outcome != DEADLINE:
                self._unanswered.left(item.id, run, item.item)
        if outcome == DEADLINE:
            self._given_up(item.id, item.item, DEADLINE)
            return False, None
        return True, item.item

    def answered(self, send_id: Any) -> None:
        """An item the worker put answers ``send_id`` (``IOPortal(send_answered=...)``): no longer awaited."""
        with self._lock:
            if not self._unanswered.answered(send_id):
                self._queued.pop(send_id, None)

    def lost(self, run: int) -> list[tuple[Any, Any]]:
        """``run`` ended (or its worker said it is not connected): what it took unanswered, forgotten."""
        with self._lock:
            return self._unanswered.lost(run)

    def taken_unanswered(self) -> list[tuple[Any, Any]]:
        """Every item taken whose answer has not come, forgotten (the stop's time for answers is over)."""
        with self._lock:
            return self._unanswered.left_over()

    def untaken_records(self, records: list[Any]) -> list[_Timed]:
        """Of ``records`` (what ``from_main`` still held at the end), those put with a deadline or an
        id that were never settled: settled "not taken" now."""
        left = []
        with self._lock:
            for record in records:
                if type(record) is _Timed and not record.outcome:
                    record.outcome = NOT_TAKEN
                    self._queued.pop(record.id, None)
                    left.append(record)
        return left

    def report_untaken(self, records: list[Any]) -> None:
        """At the end: each of ``records`` put with a deadline or an id and never settled is reported, "not taken"."""
        self.report(NOT_TAKEN, [(record.id, record.item) for record in self.untaken_records(records)])

    @staticmethod
    def watched(item: Any) -> bool:
        """Whether the bridge hands ``item``, as it crosses, to ``arm``: a record with a deadline."""
        return type(item) is _Timed and item.deadline is not None

    def arm(self, record: _Timed) -> None:
        """On the loop, as ``record`` crosses (the bridge's ``on_sent``): its deadline is watched from now."""
        if not record.outcome and record.deadline is not None:
            self._loop.call_at(record.deadline, self._due, record)  # loop.time() is time.monotonic()

    def _due(self, record: _Timed) -> None:
        with self._lock:
            if record.outcome:
                return
            record.outcome = DEADLINE
            self.untaken -= 1
            self._queued.pop(record.id, None)
        self._given_up(record.id, record.item, DEADLINE)

    def _given_up(self, send_id: Any, item: Any, reason: str) -> None:
        """Report an item given up (never taken: ``sent_failed``) or whose answer will not come
        (``awaited_unanswered``): counted and put on ``to_main`` as ``SendFailed``, on the loop."""
        if threading.get_ident() != self._loop_thread:  # a get in an executor thread: counted on the loop
            try:
                self._loop.call_soon_threadsafe(self._given_up, send_id, item, reason)
            except RuntimeError:
                pass
            return
        answered = reason in (LOST, STOP_DEADLINE)
        (self.awaited_unanswered if answered else self.sent_failed)[reason] += 1
        what = {DEADLINE: "was not taken by the worker within its max_age_s",
                NOT_TAKEN: "was not taken by the worker before the portal ended",
                LOST: "was taken by a run of the worker that ended (or said it was not connected) before its "
                      "answer came",
                STOP_DEADLINE: "was taken by the worker, and its answer had not come when the stop's time for "
                               "answers ran out"}[reason]
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("from_main: an item %s: to_main gets SendFailed (reason %r) for each, counted in IOPortal.%s "
                        "(logged once)", what, reason, "awaited_unanswered" if answered else "sent_failed")
        failed = SendFailed(f"from_main: item {send_id!r} {what}", item, id=send_id, reason=reason, source="from_main")
        try:
            self._report(failed)
        except (janus.AsyncQueueShutDown, janus.SyncQueueShutDown):  # to_main has ended: counted only
            pass

    def report(self, reason: str, items: list[tuple[Any, Any]]) -> None:
        """Report each of ``items`` (id, item) for ``reason`` (on the loop)."""
        for send_id, item in items:
            self._given_up(send_id, item, reason)


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout >= 0:  # as queue.Queue's
        raise ValueError(f"timeout must be a non-negative number of seconds or None, not {timeout!r}")


class WorkerQueue:
    """The worker's end of a queue: ``multiprocessing.Queue``'s calls on the loop or from another thread
    (``loop.run_in_executor``), awaitable on the loop (docs/embedding/io-thread.md, "The worker").

    On the loop ``put`` never blocks (the queue full, the item waits in order, counted in ``qsize``, ``full()``
    True) and ``get`` returns an awaitable; from another thread both block. ``Empty`` and ``Full`` are both the
    ``queue`` and the ``asyncio`` ones. ``stopping`` is set when the portal's stop begins. After the end, calls
    raise janus's ``AsyncQueueShutDown`` on the loop, ``SyncQueueShutDown`` in another thread."""

    def __init__(self, q: LoopSide, sync: SyncSide, stopping: asyncio.Event, name: str,
                 sends: PortalSends | None = None, *, on_put: Callable[[Any], None] | None = None,
                 says: Callable[[bool, str, int | None], None] | None = None) -> None:
        self._q, self._sync = q, sync
        self.stopping, self.name = stopping, name
        self._sends = sends  # from_main's: items put with a deadline (PortalSends)
        self._on_put = on_put  # to_main's: the portal sees each item the worker puts (its first: "up"; answers)
        self._says = says  # set_connected: the portal's
        self._loop_thread = threading.get_ident()  # made on the loop
        self._waiting: deque[_WaitingPut] = deque()  # items put while full, in order (loop only)
        self._mover: asyncio.Task[None] | None = None
        self._full_logged = False
        self._run = 0  # the worker's runs ended so far (run_ended): a get of an ended run gives back what it took

    def qsize(self) -> int:
        return self._q.qsize() + len(self._waiting)

    def empty(self) -> bool:
        return self.qsize() == 0

    def full(self) -> bool:
        return bool(self._waiting) or self._sync.full()

    def _full(self) -> Full:
        return Full(f"the queue holds queue_size={self._sync.maxsize} items: the main thread takes them too "
                    "slowly (a larger queue_size, or 0 for no bound)")

    def set_connected(self, connected: bool = True, reason: str = "", *, code: int | None = None) -> None:
        """Say whether the worker's connection is up (``reason``, ``code``: why not, the close code
        received, if any): the portal's ``ConnectionEvent`` and its restart's backoff follow what the
        worker says from its first call on, no longer its first item (io_loop/portal.py). Anywhere."""
        if not isinstance(connected, bool) or not isinstance(reason, str) or (
                code is not None and (isinstance(code, bool) or not isinstance(code, int))):
            raise TypeError(f"set_connected(connected, reason='', code=None) takes a bool, a str and an int close code "
                            f"(or None), not {connected!r}, {reason!r}, {code!r}")
        if self._says is not None:
            self._says(connected, reason, code)

    def put_nowait(self, item: Any) -> None:
        if self._on_put is not None:
            self._on_put(item)
        self._put_nowait(item)

    def _put_nowait(self, item: Any) -> None:
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
        if self._on_put is not None:
            self._on_put(item)
        return self._put(item, block, timeout)

    def put_own(self, item: Any) -> None:
        """The portal's own item (a ``ConnectionEvent``, a ``SendFailed``), put as the worker's ``put``
        puts, never seen as the worker's (no "up", no answer)."""
        self._put(item, True, None)

    def _put(self, item: Any, block: bool, timeout: float | None) -> _Enqueued | _WaitingPut:
        if not block:
            self._put_nowait(item)
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
                        "takes some (await put() to wait for room instead; logged once)", self.name, self._sync.maxsize)
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
            usable, item = self._taken(item, self._run)
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
            usable, item = self._taken(item, run)
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

    def _taken(self, item: Any, run: int) -> tuple[bool, Any]:
        """An item taken from the queue by the worker's ``run`` (0, 1, …: runs ended before it): (True,
        what to hand out), or (False, None) for one past its deadline."""
        return (True, item) if self._sends is None else self._sends.take(item, run)

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
                    usable, item = self._taken(await self._q.get(), self._run)
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


class MainQueue:
    """The main thread's end of a queue: ``queue.Queue``'s calls (``queue.Empty``, ``queue.Full``);
    once the queue has ended they raise ``WorkerFailed`` (the worker failed) or ``PortalClosed``,
    after handing out what the worker's ``put`` still kept waiting when it returned."""

    def __init__(self, q: SyncSide, raise_end: Callable[[], NoReturn], sends: PortalSends | None = None) -> None:
        self._q = q
        self._raise_end = raise_end
        self._sends = sends  # from_main's: items put with a deadline
        self.leftover: deque[Any] = deque()  # filled on the loop before the queue ends; read after

    def qsize(self) -> int:
        return self._q.qsize() + len(self.leftover)

    def empty(self) -> bool:
        return self.qsize() == 0

    def full(self) -> bool:
        return self._q.full()

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
        count of such puts, which ``put`` returns; None without a deadline), and ``id``: with the
        portal's ``send_answered``, the item awaits the answer of that id (module rules)."""
        record = None
        sends = self._sends
        if max_age_s is not None or id is not None:
            if sends is None:
                raise TypeError("put(max_age_s=, id=) is from_main's: the main thread's items for the worker "
                                "carry a deadline, to_main's do not")
            record = sends.timed(item, max_age_s, id)
        if sends is not None:
            sends.putting()
        try:
            self._q.put(item if record is None else record, block, timeout)
        except BaseException as exc:
            if sends is not None:
                sends.put_failed(record)
            if isinstance(exc, janus.SyncQueueShutDown):
                self._raise_end()
            raise
        return None if record is None else record.id

    def put_nowait(self, item: Any, *, max_age_s: float | None = None, id: Any = None) -> Any:
        return self.put(item, False, max_age_s=max_age_s, id=id)
