"""IOPortal: your own coroutine on forkless's dedicated IO thread, with two bounded queues to the main thread.

Its contract is docs/embedding/io-thread.md. The rules this module keeps:
- ``start()``, ``stop()``, ``poll()`` and the queues' sync ends (``MainQueue``) are the main thread's; the worker
  runs as one task on the portal's own ``LoopThread`` and touches only its ends (``WorkerQueue``). Nobody else holds
  both.
- The start handshake: ``start()`` returns once the queues exist and the worker has taken its first step; a worker
  that fails before its first ``await`` fails it (never restarted). A later failure comes from the next queue call,
  ``poll()`` or ``stop()``.
- Up and down: a run is *up* once the worker says so (``set_connected``) or, if it never says, at its first item;
  *down* when it says so or the run ends. With ``connection_events`` each change is a ``ConnectionEvent`` on
  ``to_main``, in order with the worker's items.
- Restarts (``RestartPolicy``) follow the peer as ``Relogin``'s reconnects do (io_loop/reconnect.py): same queue
  ends, a failure logged and never ending the portal until the ``tries``-th in a row.
- Answers (``send_answered=``): an item put with an ``id`` awaits the worker's answer; one taken by a run that ends
  first is reported (``SendFailed``, ``"connection lost"``) after the down event.
- The stop first delivers what is in flight, within its deadline less a reserve (``CANCEL_RESERVE_S`` at most),
  then sets ``stopping``: a worker that looked at it has until the reserve to return, one that never did is
  cancelled at once, and again every ``RECANCEL_S`` while it swallows the cancellation.
- A worker that raises is never swallowed: both queues are shut down, and every later call raises
  ``WorkerFailed`` from it. One that returns, and the stop, shut ``to_main`` down keeping what it holds: the main
  thread takes the rest, then ``PortalClosed``. What ``from_main`` still holds is logged and reported.
- The stop never outlasts its deadline: a worker still running then is reported and its daemon thread left behind.
- How the threads wait is the IO thread's (``WaitSettings``): the two queues are the bridge's, one wake-up a put.
- A library leaves its host alone: no process-wide setting changed (the loop is not made the thread's current
  loop), nothing forks or exits, logs go to ``forkless.portal``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, NoReturn

import janus

from forkless.io_loop.backoff import DEFAULT_BACKOFF, Backoff
from forkless.io_loop.bridge import Bridge, MainSide
from forkless.io_loop.crossing import ConnectionEvent
from forkless.io_loop.errors import FeedFatal, ForklessError
from forkless.io_loop.gil import log_gil
from forkless.io_loop.loopthread import LoopThread
from forkless.io_loop.portalqueue import MainQueue, PortalQueue, PortalSends, WorkerQueue
from forkless.io_loop.reconnect import drive
from forkless.io_loop.renamed import deprecated
from forkless.io_loop.seconds import seconds, whole
from forkless.io_loop.sends import LOST, STOP_DEADLINE
from forkless.io_loop.waiting import PARK, WaitSettings

__all__ = ["IOPortal", "PortalClosed", "RestartPolicy", "WorkerFailed"]

log = logging.getLogger("forkless.portal")

WORKER_RETURNED = (
    "the IO worker returned before the stop (its coroutine ended on its own: did its client's connection close, "
    "a session or a token expire?), and the main thread has taken everything it sent: nothing more will come. "
    "Catch PortalClosed in your loop, around its gets and its puts (portal.poll() is False once the worker has "
    "returned), and stop or start a new IOPortal; or give the portal restart=forkless.RestartPolicy() to call the "
    "worker again, or keep the client connected inside the worker (forkless.Relogin logs in again)")
RESTARTS_USED_UP = (
    "the IO worker returned before the stop and its restart policy's tries={tries} failures in a row are used "
    "up (runs that ended before they were up, or soon after: within its backoff's reset_s={reset_s}s), and the "
    "main thread has taken everything it sent: nothing more will come. Catch PortalClosed in your loop, around "
    "its gets and its puts")
STOPPED = "the portal has stopped"
CANCEL_RESERVE_S = 1.0  # at most this much of the stop's time is kept for cancelling the worker
RECANCEL_S = 0.02  # how often a worker that swallows the cancellation is cancelled again
AWAIT_POLL_S = 0.01  # how often the stop asks whether what is in flight has been delivered
MAX_LOGGED_FAILURES = 100  # distinct failures of a restarted worker logged with their traceback; then one line
OLD_KEYWORDS = ("min_s", "max_s", "reset_s")  # RestartPolicy's old keywords, now its backoff= (Relogin's)


class RestartPolicy:
    """How ``IOPortal(restart=...)`` calls a worker again that returned or raised before the stop:
    with ``backoff`` (a ``forkless.Backoff``; None: ``DEFAULT_BACKOFF``, ``Relogin``'s, which follows
    the peer: io_loop/backoff.py), as ``Relogin`` reconnects (see the module rules). ``tries``: the
    ``tries``-th failure in a row ends the portal as without a policy (0: never; the backoff's own
    ``tries`` too, the smaller one counting). ``failures``: a worker that raised is restarted too
    (False: it fails the portal, ``WorkerFailed``)."""

    __slots__ = ("backoff", "failures", "tries")

    def __init__(self, backoff: Backoff | None = None, *, tries: int = 0, failures: bool = True,
                 **old: Any) -> None:
        if old:
            named = ", ".join(f"{k}={v!r}" for k, v in old.items())
            if not set(old) <= set(OLD_KEYWORDS):
                raise TypeError(f"RestartPolicy takes backoff=, tries= and failures=, not {named}")
            if backoff is not None:
                raise TypeError(f"RestartPolicy({named}) and its backoff=: give the delays once, in the Backoff")
            deprecated("RestartPolicy(min_s=..., max_s=..., reset_s=...)", old=f"RestartPolicy({named})",
                       new=f"RestartPolicy(backoff=forkless.Backoff({named}))")
            # the old delays on the default's other parts (it follows the peer); a bad value is refused here
            d = DEFAULT_BACKOFF
            backoff = Backoff(old.get("min_s", d.min_s), old.get("max_s", d.max_s), old.get("reset_s", d.reset_s),
                              jitter=d.jitter, follow_s=d.follow_s, follow_ratio=d.follow_ratio)
        if backoff is not None and not isinstance(backoff, Backoff):
            raise TypeError(f"RestartPolicy's backoff is a forkless.Backoff (min_s, max_s, reset_s, jitter, follow_s, "
                            f"…), or None for DEFAULT_BACKOFF, not {backoff!r}")
        if not isinstance(failures, bool):
            raise TypeError(f"RestartPolicy's failures is True (a worker that raised is restarted) or False, not "
                            f"{failures!r}")
        policy = backoff or DEFAULT_BACKOFF
        tries = whole(tries, "RestartPolicy's tries", means_zero="never give up")
        both = [t for t in (tries, policy.tries) if t]
        self.backoff = policy.fresh(tries=min(both) if both else 0)  # each portal runs a fresh() copy of it
        self.tries, self.failures = self.backoff.tries, failures

    def __repr__(self) -> str:
        return f"RestartPolicy(backoff={self.backoff!r}, tries={self.tries}, failures={self.failures})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RestartPolicy) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))

    @property
    def reset_s(self) -> float:
        return self.backoff.reset_s


def _described(exc: BaseException) -> str:
    """``Type: text`` of an exception, never raising (a user's exception whose ``str()`` raises is still named)."""
    try:
        text = str(exc)
    except Exception:  # its __str__ failed: the type alone says what it was
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class WorkerFailed(ForklessError, RuntimeError):
    """The worker raised (its exception is the ``__cause__``), or did not start or end in time."""


class PortalClosed(ForklessError, janus.SyncQueueShutDown):
    """The queue has ended without a failure: the worker returned, or the portal stopped."""


class _Stopping(asyncio.Event):
    """``IOPortal.stopping``: an ``asyncio.Event`` that remembers whether the worker has looked at it
    (awaited it, or asked ``is_set()``): a worker that never did cannot return on its own at the stop."""

    watched = False

    async def wait(self) -> Literal[True]:
        self.watched = True
        return await super().wait()

    def is_set(self) -> bool:
        self.watched = True
        return super().is_set()


class _Over(Exception):
    """A run ended and the worker is not called again: ``failure``, what it raised (None: it returned, or the stop)."""

    def __init__(self, failure: BaseException | None) -> None:
        super().__init__()
        self.failure = failure


class _NotUp(Exception):
    """A run ended before it was up: a failed attempt, to be retried (``str``: why it ended)."""


class IOPortal:
    """Runs ``worker(to_main, from_main)`` on a dedicated thread and event loop (see the module rules).
    ``queue_size`` bounds each queue (0: no bound, as ``multiprocessing.Queue``); ``stop_timeout_s``
    bounds ``stop()``; ``start_timeout_s`` bounds ``start()``; ``restart``: a ``RestartPolicy`` for a
    worker that returns or raises before the stop (None: it ends the portal); ``connection_events``:
    a ``ConnectionEvent`` on ``to_main`` as the worker's connection comes up and goes down;
    ``send_answered``: ``send_answered(item)``, the id of the ``from_main`` item that an item the
    worker puts answers (None: it answers none); ``wait``: how the threads wait (``PARK``; a spinning one with
    ``expect``). Use it as a context manager, or call ``start()`` then ``stop()``."""

    def __init__(self, worker: Callable[[WorkerQueue, WorkerQueue], Awaitable[Any]], *, queue_size: int = 10_000,
                 stop_timeout_s: float = 2.0, start_timeout_s: float = 30.0, name: str = "forkless-io",
                 restart: RestartPolicy | None = None, connection_events: bool = False,
                 send_answered: Callable[[Any], Any] | None = None, wait: WaitSettings = PARK) -> None:
        queue_size = whole(queue_size, "IOPortal's queue_size", means_zero="no bound")
        stop_timeout_s = float(seconds(stop_timeout_s, "IOPortal's stop_timeout_s"))
        start_timeout_s = float(seconds(start_timeout_s, "IOPortal's start_timeout_s"))
        if restart is not None and not isinstance(restart, RestartPolicy):
            raise TypeError(f"IOPortal(restart=...) takes a forkless.RestartPolicy (or None: the worker's end ends "
                            f"the portal), not {restart!r}")
        if send_answered is not None and not callable(send_answered):
            raise TypeError(f"IOPortal(send_answered=...) takes a callable, send_answered(item) -> the id of the "
                            f"from_main item an item of the worker's answers, or None; not {send_answered!r}")
        if not isinstance(wait, WaitSettings):
            raise TypeError(f"IOPortal(wait=...) takes how the threads wait, a WaitSettings (io_loop/waiting.py's "
                            f"wait_settings('spin', platform), or PARK, the default), not {wait!r}")
        self._worker = worker
        self.restart, self.connection_events, self.send_answered = restart, connection_events, send_answered
        self.queue_size, self.stop_timeout_s, self.start_timeout_s = queue_size, stop_timeout_s, start_timeout_s
        self.stopping = _Stopping()  # set on the loop when the worker is to stop; the worker may await it
        # the thread and its loop (io_loop/loopthread.py): what the worker started and left running is
        # cancelled at the end, as asyncio.run does, within CANCEL_RESERVE_S; its executor is shut down
        # (under a spinning wait, on its SpinningSelector: io_loop/waiting.py)
        self._runner = LoopThread(name, cleanup_s=CANCEL_RESERVE_S, shutdown_executor=True, wait=wait)
        self._thread = self._runner.thread
        self._bridge: Bridge[Any, Any] | None = None  # the two queues (io_loop/bridge.py), made on the loop
        self._main_side: MainSide[Any, Any] | None = None
        self._ends: tuple[MainQueue, MainQueue] | None = None
        self._task: asyncio.Task[Any] | None = None
        self._stopper: asyncio.Task[None] | None = None
        self._stop_now: asyncio.Event | None = None  # set with stopping: ends a restart's delay (made on the loop)
        self._stop_set = False  # stopping is set (read without asking the event: that is the worker's look)
        self._failure: BaseException | None = None  # what the worker raised
        self._broken: str | None = None  # a deadline the worker broke (start or stop)
        self._delivered = False  # the failure has been raised in the main thread
        self._end = STOPPED  # what PortalClosed says once the queues have ended
        self._started = self._stopped = False
        self._worker_ends: tuple[WorkerQueue, ...] = ()
        self._sends: PortalSends | None = None  # from_main's deadlines and answers (io_loop/portalqueue.py)
        self._worker_done = False
        self._start_failed = False  # the worker failed before its first await: start() raises it
        self._logged_failures: set[str] = set()
        self._up_lock = threading.Lock()  # the up state below: the worker puts on the loop or in executor threads
        self._up = False  # this run's connection is up (under _up_lock)
        self._says = False  # the worker says when it is up (set_connected): its first item no longer does
        self._up_seen: asyncio.Future[None] | None = None  # this run's first "up", for the driver (on the loop)
        self.result: Any = None  # what the worker's coroutine returned, once it has (its last run's)
        self.runs = 0  # runs of the worker begun so far (1, 2, …)
        self.connections = 0  # connections up so far (1, 2, …: a ConnectionEvent's connection)
        self.restarts = 0  # runs begun again after one ended (RestartPolicy), written on the loop only
        self.restarting = False  # a run has ended and the next waits for its backoff

    # ---- main thread --------------------------------------------------------------------------

    @property
    def to_main(self) -> MainQueue:
        """What the worker sends: take it with ``get``/``get_nowait`` (once ``start()`` has returned)."""
        return self._main_end(0)

    @property
    def from_main(self) -> MainQueue:
        """What the main thread sends the worker: ``put``/``put_nowait``."""
        return self._main_end(1)

    @property
    def sent_failed(self) -> dict[str, int]:
        """Items put on ``from_main`` with ``max_age_s`` or an ``id`` that the worker did not take (in
        time: ``"deadline"``; before the portal ended: ``"not taken"``), by reason (a copy)."""
        return dict(self._sends.sent_failed) if self._sends is not None else {}

    @property
    def awaited_unanswered(self) -> dict[str, int]:
        """With ``send_answered``: items the worker took whose answer never came, by reason (``"connection
        lost"``, ``"stop deadline"``), each reported on ``to_main`` as ``SendFailed`` (a copy)."""
        return dict(self._sends.awaited_unanswered) if self._sends is not None else {}

    @property
    def awaiting(self) -> int:
        """With ``send_answered``: items put with an ``id`` whose answer has not come yet (taken or not)."""
        return self._sends.awaiting() if self._sends is not None else 0

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> IOPortal:
        """Start the thread; return once its loop runs, the queues exist and the worker has taken
        its first step. Raises ``WorkerFailed`` if it failed before its first ``await``, or the start
        took longer than ``start_timeout_s``; a later failure comes from the next queue call,
        ``poll()`` or ``stop()``. A second call does nothing."""
        if self._stopped:
            raise RuntimeError("this IOPortal has stopped; a portal runs once: make a new one")
        if self._started:
            return self
        self._started = True
        log_gil(log)  # whether the worker's thread and the main thread run at once (io_loop/gil.py)
        if not self._runner.start(self._run, self.start_timeout_s):
            self._stopped = True
            self._stop(0.0, because=f"did not start within start_timeout_s={self.start_timeout_s}")
            self._raise_end()
        if self._start_failed:
            self._stopped = True
            self._runner.join(self.stop_timeout_s)  # it is closing its queues and its loop
            self._raise_end()
        return self

    def expect(self, steps: int) -> None:
        """``steps`` steps of yours are in flight, whose items you will put on ``from_main``: under a spinning
        ``wait`` the portal's loop stays awake until the last has ended (and ``spin_s`` after), so that a put
        is taken without waking it (io_loop/waiting.py, as the controller tells the IO thread); under
        ``park``, the default, nothing. Main thread."""
        steps = whole(steps, "IOPortal.expect(steps)", means_zero="none in flight")
        if self._main_side is not None:
            self._main_side.expect(steps)

    def poll(self) -> bool:
        """True while the worker runs (or, with a restart policy, waits to run again), False once it
        has returned for good (what it sent may still be in ``to_main``: take it until
        ``PortalClosed``); raises ``WorkerFailed`` if it failed."""
        self.raise_if_failed()
        return self.alive and not self._worker_done

    def raise_if_failed(self) -> None:
        """Raise ``WorkerFailed`` (from the worker's exception) if the worker failed or broke a deadline."""
        if self._failure is not None or self._broken is not None:
            self._raise_end()

    def stop(self, timeout: float | None = None) -> None:
        """The orderly stop (see the module rules), within ``timeout`` seconds (``stop_timeout_s``
        by default): what is in flight is delivered first, then the worker is stopped; raises
        ``WorkerFailed`` if the worker did not end in time, or failed and no call has raised that
        yet. What the worker had put stays in ``to_main``. A second call does nothing."""
        if self._stopped:
            return
        timeout = self.stop_timeout_s if timeout is None else float(seconds(timeout, "IOPortal.stop(timeout=)"))
        self._stopped = True
        if self._started:
            self._stop(timeout, because=f"did not end within the stop's {timeout}s")
            if not self._delivered:
                self.raise_if_failed()

    def __enter__(self) -> IOPortal:
        return self.start()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            self.stop()
        except WorkerFailed:
            if exc is None:  # with an exception already on its way, the failure has been logged
                raise

    def _stop(self, timeout: float, *, because: str) -> None:
        deadline = time.monotonic() + timeout
        self._runner.call_soon(self._begin_stop, deadline)  # nothing once the loop has closed: the worker has ended
        if not self._runner.join(max(0.0, deadline - time.monotonic())):
            self._broken = f"the IO worker {because}; its thread {self._thread.name!r} is left running (a daemon)"
            log.error("%s", self._broken)
            if self._bridge is not None:  # thread-safe: nothing the main thread calls can block now
                self._bridge.end_outbound(immediate=True)
                self._bridge.stop_inbound()  # what the worker put stays for the main thread, then WorkerFailed

    def _raise_end(self) -> NoReturn:
        failure = self._failure
        if failure is not None:
            self._delivered = True
            raise WorkerFailed(f"the IO worker failed: {_described(failure)}") from failure
        if self._broken is not None:
            raise WorkerFailed(self._broken) from None
        raise PortalClosed(self._end) from None

    def _main_end(self, i: int) -> MainQueue:
        if self._ends is None:
            raise RuntimeError("the portal's queues exist once start() has returned")
        return self._ends[i]

    # ---- the IO thread ------------------------------------------------------------------------

    async def _run(self) -> None:
        """The thread's main coroutine (the loop is not the thread's current loop: nothing global changes)."""
        try:
            await self._main()
        except BaseException as exc:  # only the portal's own bookkeeping: the worker's are caught in _work
            self._fail(exc)

    async def _main(self) -> None:
        self._stop_now = asyncio.Event()
        # from_main's deadlines and answers; what is given up or lost goes to_main, never seen as the worker's
        self._sends = sends = PortalSends(self._put_own, answers=self.send_answered is not None)
        # to_main is the bridge's inbound, from_main its outbound; a deadline is watched from its put's wake-up
        bridge: Bridge[Any, Any] = Bridge(self.queue_size, self._runner.selector, sends.arm, sends.watched,
                                          queue=PortalQueue)
        self._bridge = bridge
        self._main_side = main = bridge.main_side()
        self._ends = (MainQueue(main.inbound, self._raise_end), MainQueue(main.outbound, self._raise_end, sends))
        self._worker_ends = ends = (
            WorkerQueue(bridge.inbound, main.inbound, self.stopping, "to_main", on_put=self._worker_put,
                        says=self._worker_says),
            WorkerQueue(bridge.outbound, main.outbound, self.stopping, "from_main", sends, says=self._worker_says))
        policy = self.restart
        try:
            await drive(_Runs(self), (policy.backoff if policy is not None else DEFAULT_BACKOFF).fresh())
        except _Over as over:
            if over.failure is not None:
                self._fail(over.failure)
        except FeedFatal:
            pass  # the policy's tries used up: _Runs.gave_up said so
        self._worker_done = True  # before the queues end: poll() is False by the time a get raises
        if self._failure is None:
            self._ends[0].leftover.extend(await ends[0].take_waiting())  # the main thread takes them after the rest
            if not self._stop_set:
                if self._end is STOPPED:  # not RESTARTS_USED_UP
                    self._end = WORKER_RETURNED
                log.warning("the IO worker returned before the stop (its coroutine ended on its own); the main "
                            "thread gets PortalClosed once it has taken the %d items it sent that are left",
                            self._ends[0].qsize())
        unread = bridge.outbound.take_all() + await ends[1].take_waiting()
        sends.report_untaken(unread)
        if unread and self._failure is None:
            log.warning("%d items the main thread put were not taken by the IO worker before it ended", len(unread))
        # from_main first (once to_main has ended, from_main has too); what the worker put stays for the main
        # thread (a failure dropped it already)
        await bridge.aclose()

    # ---- a run, as the reconnect driver sees it (_Runs) -----------------------------------------

    async def _begin_run(self) -> asyncio.Task[Any]:
        """A new run of the worker: its task, the first run's start handshake done."""
        self.runs += 1
        if self.runs > 1:
            self.restarts += 1
        self.restarting = False
        with self._up_lock:
            self._up = False
        self._up_seen = asyncio.get_running_loop().create_future()
        self._task = task = asyncio.create_task(self._work(*self._worker_ends), name=f"{self._thread.name}-worker")
        if self.runs == 1:
            await asyncio.sleep(0)  # the worker's first step runs first: a failure there fails start()
            if task.done() and (failure := task.result()) is not None:
                self._start_failed = True
                self._worker_done = True
                self._fail(failure)
            self._runner.ready()
            if self._start_failed:
                raise _Over(None)
        return task

    def _outcome(self, task: asyncio.Task[Any]) -> BaseException | None:
        """What the run raised (None: it returned, or the stop cancelled it)."""
        return None if task.cancelled() else task.result()

    def _restarted(self, failure: BaseException | None) -> bool:
        """Whether a run that ended with ``failure`` is called again (the policy, and not the stop)."""
        policy = self.restart
        return policy is not None and not self._stop_set and (failure is None or policy.failures)

    def _ended(self, task: asyncio.Task[Any]) -> tuple[BaseException | None, list[tuple[Any, Any]]]:
        """The run ended: its outcome, and what it took whose answer never came (reported by the caller, after
        the down event)."""
        for end in self._worker_ends:
            end.run_ended()  # an executor get this run left blocked gives back what it takes
        assert self._sends is not None
        return self._outcome(task), self._sends.lost(self.runs - 1)

    def _gone(self, reason: str, lost: list[tuple[Any, Any]], code: int | None = None) -> None:
        """The connection went down (if it was up): its event, then the report of what it took unanswered."""
        with self._up_lock:
            was_up, self._up = self._up, False
        if was_up:
            self._announce(ConnectionEvent(self._thread.name, False, reason, code, self.connections, time.time()))
        assert self._sends is not None
        self._sends.report(LOST, lost)

    def _ended_text(self, failure: BaseException | None) -> str:
        return "the worker returned" if failure is None else f"the worker failed: {_described(failure)}"

    # ---- up and down (the worker's puts: on the loop or in an executor thread) -------------------

    def _worker_put(self, item: Any) -> None:
        """The worker puts ``item`` on ``to_main``: its answer is noted; a run not up yet is up now,
        unless the worker says itself when it is (the up event goes first)."""
        if self.send_answered is not None:
            send_id = self.send_answered(item)  # raises into the worker's put: the item is not put
            if send_id is not None:
                assert self._sends is not None
                self._sends.answered(send_id)
        if not self._up and not self._says:
            self._came_up()

    def _worker_says(self, connected: bool, reason: str, code: int | None) -> None:
        self._says = True
        if connected:
            self._came_up()
            return
        if threading.get_ident() != self._loop_thread_id():
            self._runner.call_soon(self._worker_says, connected, reason, code)
            return
        assert self._sends is not None
        self._gone(reason or "the worker says it is not connected", self._sends.lost(self.runs - 1), code)

    def _came_up(self) -> None:
        with self._up_lock:
            if self._up:
                return
            self.connections += 1
            self._announce(ConnectionEvent(self._thread.name, True, "", None, self.connections, time.time()))
            self._up = True  # after the event is in: a put racing this one sees it up only then
        if threading.get_ident() == self._loop_thread_id():
            self._mark_up_seen()
        else:
            self._runner.call_soon(self._mark_up_seen)

    def _mark_up_seen(self) -> None:
        if self._up_seen is not None and not self._up_seen.done():
            self._up_seen.set_result(None)

    def _loop_thread_id(self) -> int | None:
        return self._thread.ident

    def _announce(self, event: ConnectionEvent) -> None:
        """With ``connection_events``: ``event`` on ``to_main``, after what the worker put."""
        if self.connection_events:
            self._put_own(event)

    def _put_own(self, item: Any) -> None:
        """The portal's own ``item`` on ``to_main`` (an event, a report), never seen as the worker's."""
        self._worker_ends[0].put_own(item)

    # ---- the worker ------------------------------------------------------------------------------

    async def _work(self, to_main: WorkerQueue, from_main: WorkerQueue) -> BaseException | None:
        """One run of the worker: None when it returned, else what it raised (the stop's cancellation is re-raised)."""
        try:
            self.result = await self._worker(to_main, from_main)
        except asyncio.CancelledError as exc:
            if self._stop_set:
                raise
            return exc
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: a library never exits its host
            return exc
        return None

    def _log_restart(self, failure: BaseException | None, delay: float) -> None:
        if failure is None:
            log.warning("the IO worker returned before the stop (run %d); restarting it in %.2fs (its restart "
                        "policy)", self.runs, delay)
            return
        key = _described(failure)
        first = key not in self._logged_failures and len(self._logged_failures) < MAX_LOGGED_FAILURES
        self._logged_failures.add(key)
        log.error("the IO worker failed (run %d); restarting it in %.2fs (its restart policy)%s", self.runs, delay,
                  "" if first else f": {key} (its traceback was logged before)", exc_info=failure if first else None)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is not None:
            return
        self._failure = exc
        bridge = self._bridge
        dropped = sum(bridge.depths() if bridge else ()) + sum(len(end._waiting) for end in self._worker_ends)
        log.error("the IO worker failed%s", f" ({dropped} queued items dropped)" if dropped else "", exc_info=exc)
        if bridge is not None:  # wakes a main thread blocked in get or put
            bridge.stop_inbound(immediate=True)
            bridge.end_outbound(immediate=True)

    # ---- the stop ----------------------------------------------------------------------------------

    def _begin_stop(self, deadline: float) -> None:
        # a worker already ended (a stop arriving as the loop closes, after _main) has nothing to
        # stop: a task made then would never run, its coroutine "never awaited"
        if self._worker_done or self._stopper is not None:
            self._set_stopping()
            return
        self._stopper = asyncio.ensure_future(self._stop_at(deadline))

    def _set_stopping(self) -> None:
        self._stop_set = True
        asyncio.Event.set(self.stopping)
        if self._stop_now is not None:
            self._stop_now.set()

    async def _stop_at(self, deadline: float) -> None:
        """The stop on the loop: what is in flight delivered, then the worker stopped (module rules)."""
        reserve = min(CANCEL_RESERVE_S, (deadline - time.monotonic()) / 4)
        until = deadline - reserve
        await self._deliver(until)
        self._set_stopping()
        task = self._task
        if task is None or task.done():
            return
        if self.stopping.watched:  # it can know of the stop: its time to return
            await asyncio.wait({task}, timeout=max(0.0, until - time.monotonic()))
        while not task.done() and time.monotonic() < deadline:
            task.cancel()
            await asyncio.wait({task}, timeout=min(RECANCEL_S, max(0.0, deadline - time.monotonic())))

    async def _deliver(self, until: float) -> None:
        """Until ``until``: every item put on ``from_main`` taken and, with ``send_answered``, every answer
        awaited come; what is still awaited then is counted and reported ("stop deadline")."""
        sends = self._sends
        assert sends is not None
        while not self._worker_done and not (sends.handed() and not sends.awaiting()):
            left = until - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(AWAIT_POLL_S, left))
        unanswered = sends.taken_unanswered()
        if unanswered:
            log.error("the stop's time for answers ran out with %d items the worker took still unanswered: each is "
                      "reported on to_main (SendFailed, %r), counted in awaited_unanswered", len(unanswered),
                      STOP_DEADLINE)
            sends.report(STOP_DEADLINE, unanswered)


class _Runs:
    """The portal's side of the reconnect driver (io_loop/reconnect.py): an attempt is a run of the
    worker until it is up; a connection, the rest of that run. A run not called again ends the
    drive (``_Over``); the policy's tries used up end it too (``gave_up``)."""

    failures = (_NotUp,)

    def __init__(self, portal: IOPortal) -> None:
        self.portal = portal
        self.failure: BaseException | None = None  # the last run's (for a give-up after a failure)
        self.lost: list[tuple[Any, Any]] = []  # what the last run took unanswered, reported after its down event

    def more(self) -> bool:
        return not self.portal._stop_set

    async def connect(self) -> asyncio.Task[Any]:
        p = self.portal
        task = await p._begin_run()
        assert p._up_seen is not None
        await asyncio.wait({task, p._up_seen}, return_when=asyncio.FIRST_COMPLETED)
        if p._up_seen.done() and not task.done():
            return task
        if p._up:  # up, and ended within the same turn: a connection all the same
            return task
        failure, lost = p._ended(task)
        self.failure = failure
        p._gone("", lost)  # not up: no event, but what it took is reported
        if not p._restarted(failure):
            raise _Over(failure)
        raise _NotUp(p._ended_text(failure))

    def attempt_failed(self, exc: BaseException) -> str:
        return str(exc)

    def retrying(self, reason: str, delay: float) -> None:
        p = self.portal
        p._log_restart(self.failure, delay)
        p.restarting = True

    async def serve(self, task: asyncio.Task[Any]) -> str:
        p = self.portal
        await asyncio.wait({task})
        failure, self.lost = p._ended(task)
        self.failure = failure
        reason = p._ended_text(failure)
        if not p._restarted(failure):
            p._gone(reason, self.lost)
            raise _Over(failure)
        return reason

    def reconnecting(self, reason: str, delay: float) -> None:
        p = self.portal
        p._gone(f"{reason}; restarting in {delay:.2f}s", self.lost)
        p._log_restart(self.failure, delay)
        p.restarting = True

    def gave_up(self, reason: str, failures: int, lost: bool) -> FeedFatal:
        p = self.portal
        policy = p.restart
        assert policy is not None
        p._end = RESTARTS_USED_UP.format(tries=policy.tries, reset_s=policy.reset_s)
        log.error("the IO worker's run %d ended (%s): tries=%d failures in a row, not restarted", p.runs, reason,
                  policy.tries)
        if lost:
            p._gone(reason, self.lost)
        if self.failure is not None:
            p._fail(self.failure)
        return FeedFatal(p._end)

    async def pause(self, delay: float) -> None:
        stop_now = self.portal._stop_now
        assert stop_now is not None
        try:
            await asyncio.wait_for(stop_now.wait(), delay)
        except TimeoutError:
            pass
        finally:
            self.portal.restarting = False
