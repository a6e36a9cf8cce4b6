"""IOPortal: your own coroutine on forkless's dedicated IO thread, with two bounded queues to the main thread.

Rules:
- ``start()``, ``stop()``, ``poll()`` and the queues' sync ends (``to_main``, ``from_main``:
  ``MainQueue``) belong to the main thread; the worker runs as one task on the portal's own loop
  in its own thread (a ``LoopThread``: io_loop/loopthread.py) and touches only its ends
  (``WorkerQueue``, io_loop/portalqueue.py: called as ``multiprocessing.Queue``'s, on the loop or
  from its executor threads, or awaited). Nobody else holds both.
- The start handshake: ``start()`` returns once the loop has made the janus queues and the
  worker has taken its first step; a worker that fails before its first ``await`` fails it (and
  is not restarted: a worker that cannot start is a mistake to fix). One that fails later, however
  soon, never fails ``start()``: its failure comes from the next queue call, ``poll()`` or ``stop()``
  (or, with a restart policy, it is restarted).
- A restart policy (``restart=RestartPolicy(...)``): a worker that returns, or raises
  (``failures``), before the stop is called again after the policy's backoff (io_loop/backoff.py),
  with the same queue ends (what they hold waits for the next run; an executor get the last run
  left blocked gives back what it takes: io_loop/portalqueue.py). The main loop is told:
  ``restarts`` counts them, ``restarting`` is True during the backoff, ``poll()`` stays True, and
  with ``connection_events`` each run's start and end is a ``ConnectionEvent`` on ``to_main``, in
  order with what the worker put. A failure is logged with its traceback (once per distinct error,
  then in one line) and never ends the portal; the ``tries``-th short run in a row does: as
  without a policy (a return, ``PortalClosed``; a failure, ``WorkerFailed``).
- The worker is ``worker(to_main, from_main)``, returning a coroutine. The stop begins by setting
  ``stopping`` (an ``asyncio.Event``, also each ``WorkerQueue``'s ``.stopping``); the worker has
  the stop's time less a reserve (a quarter of it, at most ``CANCEL_RESERVE_S``) to return, is
  then cancelled, again every ``RECANCEL_S`` while it swallows the cancellation, until the deadline.
- A worker that raises is never swallowed: its exception is logged, both queues are shut down at
  once (what they held is dropped, counted in the log), and every later queue call and ``poll()``
  raise ``WorkerFailed`` from it (its traceback is the ``__cause__``'s), as does ``stop()`` unless
  one of them has. A worker that returns, and the stop, shut ``to_main`` down keeping what it
  holds (and what its ``put`` still kept waiting): the main thread takes the rest, then gets
  ``PortalClosed`` (a janus ``SyncQueueShutDown``); a worker that returned before the stop is
  logged, ``poll()`` is False from then, and ``PortalClosed`` says what to do (``WORKER_RETURNED``).
- The stop never outlasts its deadline: a worker still running then (it ignores cancellation,
  or blocks the loop) is reported (logged, ``WorkerFailed`` from ``stop()``), its queues are shut
  down from the main thread, and its thread, a daemon, is left behind. A second ``stop()`` does nothing.
- A library leaves its host alone: no process-wide setting is changed (the loop is not made the
  thread's current loop), nothing forks or exits, logs go to ``forkless.portal``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import janus

from forkless.io_loop.backoff import Backoff
from forkless.io_loop.crossing import ConnectionEvent
from forkless.io_loop.errors import ForklessError
from forkless.io_loop.gil import log_gil
from forkless.io_loop.loopthread import LoopThread
from forkless.io_loop.portalqueue import MainQueue, PortalQueue, PortalSends, WorkerQueue

__all__ = ["IOPortal", "PortalClosed", "RestartPolicy", "WorkerFailed"]

log = logging.getLogger("forkless.portal")

WORKER_RETURNED = (
    "the IO worker returned before the stop (its coroutine ended on its own: did its client's connection close, "
    "a session or a token expire?), and the main thread has taken everything it sent: nothing more will come. "
    "Catch PortalClosed in your loop, around its gets and its puts (portal.poll() is False once the worker has "
    "returned), and stop or start a new IOPortal; or give the portal restart=forkless.RestartPolicy() to call the "
    "worker again, or keep the client connected inside the worker (forkless.Relogin logs in again)")
RESTARTS_USED_UP = (
    "the IO worker returned before the stop and its restart policy's tries={tries} short runs in a row are used "
    "up (it kept ending within reset_s={reset_s}s of its start), and the main thread has taken everything it sent: "
    "nothing more will come. Catch PortalClosed in your loop, around its gets and its puts")
STOPPED = "the portal has stopped"
CANCEL_RESERVE_S = 1.0  # at most this much of the stop's time is kept for cancelling the worker
RECANCEL_S = 0.02  # how often a worker that swallows the cancellation is cancelled again
MAX_LOGGED_FAILURES = 100  # distinct failures of a restarted worker logged with their traceback; then one line


@dataclass(frozen=True)
class RestartPolicy:
    """How ``IOPortal(restart=...)`` calls a worker again that returned or raised before the stop:
    after the k-th short run in a row, a delay uniform in [``min_s``, min(``max_s``, ``min_s``·2^(k-1))]
    (io_loop/backoff.py); a run that lasted ``reset_s`` or more starts the count again. ``tries``: the
    ``tries``-th short run in a row ends the portal as without a policy (0: never). ``failures``: a
    worker that raised is restarted too (False: it fails the portal, ``WorkerFailed``)."""

    min_s: float = 0.05
    max_s: float = 5.0
    reset_s: float = 2.0
    tries: int = 0
    failures: bool = True

    def __post_init__(self) -> None:
        if (not isinstance(self.tries, int) or self.tries < 0 or not 0 < self.min_s <= self.max_s
                or not self.reset_s >= 0):
            raise ValueError(f"RestartPolicy needs 0 < min_s <= max_s, reset_s >= 0 and tries >= 0 (an int; 0: no "
                             f"bound), not min_s={self.min_s!r}, max_s={self.max_s!r}, reset_s={self.reset_s!r}, "
                             f"tries={self.tries!r}")

    def backoff(self) -> Backoff:
        return Backoff(min_s=self.min_s, max_s=self.max_s, reset_s=self.reset_s, tries=self.tries)


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


class IOPortal:
    """Runs ``worker(to_main, from_main)`` on a dedicated thread and event loop (see the module rules).
    ``queue_size`` bounds each queue (0: no bound, as ``multiprocessing.Queue``); ``stop_timeout_s``
    bounds ``stop()``; ``start_timeout_s`` bounds ``start()``; ``restart``: a ``RestartPolicy`` for a
    worker that returns or raises before the stop (None: it ends the portal); ``connection_events``:
    a ``ConnectionEvent`` on ``to_main`` as each run of the worker starts and ends. Use it as a
    context manager, or call ``start()`` then ``stop()``."""

    def __init__(self, worker: Callable[[WorkerQueue, WorkerQueue], Awaitable[Any]], *, queue_size: int = 10_000,
                 stop_timeout_s: float = 2.0, start_timeout_s: float = 30.0, name: str = "forkless-io",
                 restart: RestartPolicy | None = None, connection_events: bool = False) -> None:
        if not isinstance(queue_size, int) or queue_size < 0 or not stop_timeout_s > 0 or not start_timeout_s > 0:
            raise ValueError(f"IOPortal needs queue_size >= 0 (an int; 0: no bound), stop_timeout_s > 0 and "
                             f"start_timeout_s > 0, not {queue_size!r}, {stop_timeout_s!r}, {start_timeout_s!r}")
        if restart is not None and not isinstance(restart, RestartPolicy):
            raise TypeError(f"IOPortal(restart=...) takes a forkless.RestartPolicy (or None: the worker's end ends "
                            f"the portal), not {restart!r}")
        self._worker = worker
        self.restart, self.connection_events = restart, connection_events
        self.queue_size, self.stop_timeout_s, self.start_timeout_s = queue_size, stop_timeout_s, start_timeout_s
        self.stopping = asyncio.Event()  # set on the loop when the stop begins; the worker may await it
        # the thread and its loop (io_loop/loopthread.py): what the worker started and left running is
        # cancelled at the end, as asyncio.run does, within CANCEL_RESERVE_S; its executor is shut down
        self._runner = LoopThread(name, cleanup_s=CANCEL_RESERVE_S, shutdown_executor=True)
        self._thread = self._runner.thread
        self._queues: tuple[janus.Queue[Any], janus.Queue[Any]] | None = None
        self._ends: tuple[MainQueue, MainQueue] | None = None
        self._task: asyncio.Task[Any] | None = None
        self._stopper: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None  # what the worker raised
        self._broken: str | None = None  # a deadline the worker broke (start or stop)
        self._delivered = False  # the failure has been raised in the main thread
        self._end = STOPPED  # what PortalClosed says once the queues have ended
        self._started = self._stopped = False
        self._worker_ends: tuple[WorkerQueue, ...] = ()
        self._sends: PortalSends | None = None  # from_main's deadlines (io_loop/portalqueue.py)
        self._worker_done = False
        self._start_failed = False  # the worker failed before its first await: start() raises it
        self._logged_failures: set[str] = set()
        self.result: Any = None  # what the worker's coroutine returned, once it has (its last run's)
        self.runs = 0  # runs of the worker begun so far (1, 2, …: a ConnectionEvent's connection)
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
        """Items put on ``from_main`` with ``max_age_s`` that the worker did not take in time, by reason (a copy)."""
        return dict(self._sends.sent_failed) if self._sends is not None else {}

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
        by default); raises ``WorkerFailed`` if the worker did not end in time, or failed and no
        call has raised that yet. What the worker had put stays in ``to_main``. A second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
        if self._started:
            timeout = self.stop_timeout_s if timeout is None else timeout
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
            for q in self._queues or ():
                q.shutdown(immediate=True)  # thread-safe: nothing the main thread calls can block now

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
        self._queues = to_main, from_main = PortalQueue(self.queue_size), PortalQueue(self.queue_size)
        to_worker = WorkerQueue(to_main, self.stopping, "to_main")
        self._sends = sends = PortalSends(to_worker.put)  # from_main's deadlines; what is given up goes to_main
        self._ends = (MainQueue(to_main.sync_q, self._raise_end),
                      MainQueue(from_main.sync_q, self._raise_end, sends))
        self._worker_ends = ends = (to_worker, WorkerQueue(from_main, self.stopping, "from_main", sends))
        backoff = self.restart.backoff() if self.restart is not None else None
        while True:
            self.runs += 1
            self._announce(True)
            if backoff is not None:
                backoff.connected(time.monotonic())
            self._task = task = asyncio.create_task(self._work(*ends), name=f"{self._thread.name}-worker")
            if self.runs == 1:
                await asyncio.sleep(0)  # the worker's first step runs first: a failure there fails start()
                if task.done() and task.result() is not None:
                    self._start_failed = True
                    self._worker_done = True
                    self._fail(task.result())
                self._runner.ready()
            await asyncio.wait({task})
            for end in ends:
                end.run_ended()  # an executor get this run left blocked gives back what it takes
            failure = None if task.cancelled() else task.result()
            if self._failure is not None or not await self._restarted(backoff, failure):
                break
        self._worker_done = True  # before the queues end: poll() is False by the time a get raises
        if self._failure is None:
            self._ends[0].leftover.extend(await ends[0].take_waiting())  # the main thread takes them after the rest
            if not self.stopping.is_set():
                if self._end is STOPPED:  # not RESTARTS_USED_UP
                    self._end = WORKER_RETURNED
                log.warning("the IO worker returned before the stop (its coroutine ended on its own); the main "
                            "thread gets PortalClosed once it has taken the %d items it sent that are left",
                            self._ends[0].qsize())
        unread = from_main.async_q.qsize() + len(await ends[1].take_waiting())
        if unread and self._failure is None:
            log.warning("%d items the main thread put were not taken by the IO worker before it ended", unread)
        from_main.shutdown(immediate=True)  # first: once to_main has ended, from_main has too
        to_main.shutdown(immediate=self._failure is not None)  # what the worker put stays for the main thread
        await from_main.wait_closed()
        await to_main.wait_closed()

    async def _restarted(self, backoff: Backoff | None, failure: BaseException | None) -> bool:
        """A run ended before the stop (``failure``: what it raised): wait for the restart policy's
        backoff, telling the main loop; False when the worker is not run again (no policy, the
        stop, a failure the policy does not restart, its tries used up)."""
        policy = self.restart
        if failure is not None and (self.stopping.is_set() or policy is None or not policy.failures):
            self._fail(failure)
            return False
        if self.stopping.is_set():
            return False
        ended = "the worker returned" if failure is None else f"the worker failed: {_described(failure)}"
        if policy is None or backoff is None:
            self._announce(False, ended)
            return False
        backoff.disconnected(time.monotonic())
        delay = backoff.failed()
        if delay is None:  # its tries are used up: it ends as without a policy
            self._end = RESTARTS_USED_UP.format(tries=policy.tries, reset_s=policy.reset_s)
            log.error("the IO worker's run %d ended (%s): tries=%d short runs in a row, not restarted",
                      self.runs, ended, policy.tries)
            if failure is not None:
                self._fail(failure)
            else:
                self._announce(False, ended)
            return False
        self._log_restart(failure, delay)
        self.restarting = True
        self._announce(False, f"{ended}; restarting in {delay:.2f}s")
        try:
            await asyncio.wait_for(self.stopping.wait(), delay)
            return False  # the stop came first
        except TimeoutError:
            self.restarts += 1
            return True
        finally:
            self.restarting = False

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

    def _announce(self, running: bool, reason: str = "") -> None:
        """With ``connection_events``: the run's start or end on ``to_main``, after what the worker put."""
        if self.connection_events:
            self._worker_ends[0].put(ConnectionEvent(self._thread.name, running, reason, None, self.runs, time.time()))

    async def _work(self, to_main: WorkerQueue, from_main: WorkerQueue) -> BaseException | None:
        """One run of the worker: None when it returned, else what it raised (the stop's cancellation is re-raised)."""
        try:
            self.result = await self._worker(to_main, from_main)
        except asyncio.CancelledError as exc:
            if self.stopping.is_set():
                raise
            return exc
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: a library never exits its host
            return exc
        return None

    def _fail(self, exc: BaseException) -> None:
        if self._failure is not None:
            return
        self._failure = exc
        queues = self._queues or ()
        dropped = sum(q.async_q.qsize() for q in queues) + sum(len(end._waiting) for end in self._worker_ends)
        log.error("the IO worker failed%s", f" ({dropped} queued items dropped)" if dropped else "", exc_info=exc)
        for q in queues:
            q.shutdown(immediate=True)  # wakes a main thread blocked in get or put

    def _begin_stop(self, deadline: float) -> None:
        self.stopping.set()
        # a worker already ended (a stop arriving as the loop closes, after _main) has nothing to
        # cancel: a task made then would never run, its coroutine "never awaited"
        if self._task is not None and not self._task.done() and self._stopper is None:
            self._stopper = asyncio.ensure_future(self._cancel_at(self._task, deadline))

    async def _cancel_at(self, task: asyncio.Task[Any], deadline: float) -> None:
        reserve = min(CANCEL_RESERVE_S, (deadline - time.monotonic()) / 4)
        await asyncio.wait({task}, timeout=max(0.0, deadline - reserve - time.monotonic()))
        while not task.done() and time.monotonic() < deadline:
            task.cancel()
            await asyncio.wait({task}, timeout=min(RECANCEL_S, max(0.0, deadline - time.monotonic())))
