"""LoopThread: one thread running one new asyncio loop for one main coroutine — the one loop-in-a-thread primitive
under the IO thread, the IO portal, the checkpoint store's thread and ``--check``'s feed probe (``run_in_thread``).
anyio's ``BlockingPortal`` is the model: a start handshake, the exception delivered, cancellation at exit.

Rules:
- ``start(main, timeout)`` starts a daemon thread named ``name`` and runs ``main()`` on a new loop there as its main
  task. The loop is never made any thread's current loop: nothing process-wide changes.
- How the thread waits is decided here, from its ``WaitSettings`` (io_loop/waiting.py): the default loop under
  ``park``, a ``SpinningSelector`` under ``spin``, and, where the settings keep the threads apart, off the starting
  thread's core, its affinity given back before its last act.
- The start handshake: ``start`` returns True once ``main`` has called ``ready()`` or ended, False after ``timeout``.
- What ``main`` raised (its cancellation too) is kept in ``failure``, what it returned in ``result``; nothing is
  logged or swallowed here: its owner says what a failure means.
- At the exit what ``main`` left running is cancelled and awaited for at most ``cleanup_s``, as ``asyncio.run``
  does, then the loop is closed; the thread's last act sets ``ended``.
- ``run_all`` runs coroutines as tasks until all are done; the first failure cancels the rest and is raised as it
  is (not in an ``ExceptionGroup``: the callers raise a ``FeedFatal``).
- ``cancel_bounded`` awaits a user's coroutine as a task of its own, a cancellation waited for at most
  ``CANCEL_GRACE_S``; one that swallows it is given up (logged, never waited for again), so the thread still ends
  by its deadline.
- ``call_soon``, ``submit`` and ``cancel`` are for other threads; ``join(timeout)`` never waits past its deadline,
  and a ``KeyboardInterrupt`` in it leaves the thread joinable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from forkless.io_loop.waiting import PARK, SpinningSelector, WaitSettings, keep_apart

__all__ = ["CANCEL_GRACE_S", "LoopThread", "cancel_bounded", "run_all", "run_in_thread"]

log = logging.getLogger("forkless.io")

T = TypeVar("T")

CANCEL_S = 2.0  # run_in_thread: how long an interrupted caller waits for the cancelled coroutine to end
# cancel_bounded: how long a user's cancelled coroutine is waited for (an aborted stop leaves the IO thread
# about a quarter of a second: lifecycle.end_io), and the tasks given up after it, which no one waits for again
CANCEL_GRACE_S = 0.1
_given_up: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()


class LoopThread:
    """A thread, its loop and its main coroutine (see the module rules). Made once, started once."""

    def __init__(self, name: str, *, cleanup_s: float | None = None, shutdown_executor: bool = False,
                 wait: WaitSettings = PARK) -> None:
        self.thread = threading.Thread(target=self._body, name=name, daemon=True)
        self.wait = wait
        self.selector = SpinningSelector(wait.nap_s, wait.spin_s) if wait.spins else None  # None: it parks
        self._caller = 0  # the native id of the thread that called start (kept apart from, without a GIL)
        self.cleanup_s = cleanup_s
        self.shutdown_executor = shutdown_executor
        self.loop: asyncio.AbstractEventLoop | None = None  # set in the thread before main runs
        self.main_task: asyncio.Task[Any] | None = None
        self.failure: BaseException | None = None
        self.result: Any = None
        self._main: Callable[[], Awaitable[Any]] | None = None
        self._begun = False
        self._cancelled = False  # cancel() was called: main is cancelled, or never begins
        self._ready = threading.Event()
        # set by the thread as its last act: what join() waits for. Not Thread.join alone: a
        # KeyboardInterrupt inside it marks a live thread as ended (CPython 3.11, bpo-45274's fix)
        self._ended = threading.Event()
        self._cpu_clock: int | None = None  # this thread's CPU clock (``time.pthread_getcpuclockid``)
        self._cpu_at_end: float | None = None  # its CPU seconds when it ended

    @property
    def name(self) -> str:
        return self.thread.name

    @property
    def started(self) -> bool:
        return self.thread.ident is not None

    @property
    def ended(self) -> bool:
        """True once the thread's last act is done (the loop closed, ``failure`` and ``result`` final)."""
        return self._ended.is_set()

    @property
    def alive(self) -> bool:
        return self.started and not self._ended.is_set()

    def start(self, main: Callable[[], Awaitable[Any]], timeout: float | None = None) -> bool:
        """Start the thread running ``main()``; True once it has called ``ready()`` or ended, False if
        neither within ``timeout`` seconds (None: no bound)."""
        if self._begun:
            raise RuntimeError(f"LoopThread {self.name!r} was started already (a LoopThread runs once)")
        self._begun = True
        self._main = main
        self._caller = threading.get_native_id()
        self.thread.start()
        return self._ready.wait(timeout)

    def ready(self) -> None:
        """Called by the main coroutine (any thread may): the start handshake is complete."""
        self._ready.set()

    def call_soon(self, callback: Callable[..., Any], *args: Any) -> bool:
        """``callback(*args)`` on the loop, from any thread; False when the loop is not there (not
        started yet, or closed)."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed meanwhile
            return False
        return True

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop beside the main task; its future, for another thread to wait on.
        RuntimeError (``coro`` closed) when the loop is not running or this is its own thread."""
        loop = self.loop
        if loop is None or loop.is_closed() or self._ended.is_set():
            coro.close()
            raise RuntimeError(f"the loop of thread {self.name!r} is not running")
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError(f"a blocking call onto thread {self.name!r} was made on that thread: it would wait "
                               "for itself")
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def cancel(self) -> bool:
        """Cancel the main task, from any thread (asked before it began, it never begins); False
        once the thread has ended."""
        if self._ended.is_set():
            return False
        self._cancelled = True  # first, then the task: _guarded sets the task, then reads this
        task = self.main_task
        return task is None or self.call_soon(task.cancel)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread's last act, at most ``timeout`` seconds in all; True if it has ended
        (or never started). Safe to call again after a ``KeyboardInterrupt`` interrupted it."""
        if not self.started:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._ended.wait(timeout):
            return False
        # what is left of it after its last act: the thread's own exit
        self.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return True

    def cpu_seconds(self) -> float:
        """CPU seconds this thread has used (``time.thread_time`` as the thread itself would read it),
        callable from any thread; NaN before it started, or where the platform has no per-thread CPU
        clock. One ``clock_gettime`` a call."""
        if self._cpu_at_end is not None:
            return self._cpu_at_end
        clock = self._cpu_clock
        if clock is None:
            return math.nan
        try:
            return time.clock_gettime(clock)
        except OSError:  # the thread ended between the two reads above
            return self._cpu_at_end if self._cpu_at_end is not None else math.nan

    # ---- the thread ---------------------------------------------------------------------------

    def _body(self) -> None:
        """The thread's work: a new loop runs ``main()``, then the exit (see the module rules)."""
        had = keep_apart(self._caller) if self.wait.apart else None
        getclock = getattr(time, "pthread_getcpuclockid", None)  # Unix; not macOS
        if getclock is not None:
            try:
                self._cpu_clock = getclock(threading.get_ident())
            except OSError:
                pass
        # not set as the thread's current loop: nothing global changes
        loop = asyncio.new_event_loop() if self.selector is None else asyncio.SelectorEventLoop(self.selector)
        self.loop = loop
        try:
            try:
                self.result = loop.run_until_complete(self._guarded())
            except BaseException as exc:
                self.failure = exc
            self._clean_up(loop)
        finally:
            loop.close()
            if had is not None:
                try:
                    os.sched_setaffinity(0, had)
                except OSError:  # a CPU of ``had`` taken away meanwhile (a cpuset): the thread ends anyway
                    pass
            self._cpu_at_end = time.thread_time()
            self._ready.set()
            self._ended.set()

    async def _guarded(self) -> Any:
        assert self._main is not None
        self.main_task = asyncio.current_task()
        if self._cancelled:
            raise asyncio.CancelledError
        return await self._main()

    def _clean_up(self, loop: asyncio.AbstractEventLoop) -> None:
        """What ``main`` left running cancelled (within ``cleanup_s``), async generators closed, the
        default executor shut down if asked."""
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            left -= set(_given_up)  # a user's coroutine that swallowed its cancellation: waited for once already
            if left:
                loop.run_until_complete(asyncio.wait(left, timeout=self.cleanup_s))
            loop.run_until_complete(loop.shutdown_asyncgens())
            if self.shutdown_executor:
                loop.run_until_complete(loop.shutdown_default_executor())
        except BaseException as exc:
            log.error("closing the loop of thread %r failed", self.name, exc_info=exc)
            if self.failure is None:
                self.failure = exc


def run_in_thread(main: Callable[[], Awaitable[T]], *, name: str, cancel_s: float = CANCEL_S) -> T:
    """``asyncio.run(main())`` on a thread of its own: the caller's thread keeps its event loop (or
    its running one); ``main``'s exception is raised here. An interruption of the wait (Ctrl-C)
    cancels ``main``, waits up to ``cancel_s`` for it to end and is raised."""
    runner = LoopThread(name, shutdown_executor=True)
    try:
        runner.start(main)
        runner.join()
    except BaseException:
        runner.cancel()
        runner.join(cancel_s)
        raise
    if runner.failure is not None:
        raise runner.failure
    return runner.result


async def cancel_bounded(coro: Coroutine[Any, Any, T], *, name: str, what: str,
                         grace_s: float = CANCEL_GRACE_S) -> T:
    """``await coro`` (a user's code, named ``what`` in the log), run as a task named ``name``: what
    it returns or raises; a cancellation of the caller cancels it and waits for it at most
    ``grace_s``, then goes on whatever it did (module rules)."""
    task = asyncio.get_running_loop().create_task(_outcome(coro), name=name)
    try:
        return _unboxed(await asyncio.shield(task))
    except asyncio.CancelledError:
        if task.done():  # it was cancelled itself, or ended as the caller was: its own outcome
            return _unboxed(task.result())
        task.cancel()
        try:
            await asyncio.wait({task}, timeout=grace_s)
        finally:
            if not task.done():
                _given_up.add(task)
                log.error("%s did not end within %.1fs of its cancellation (it caught the CancelledError and went on, "
                          "or its clean-up is slow): given up, left running until its loop closes", what, grace_s)
        if task.done():  # it ended on the cancellation: what it did (a return after catching it too)
            return _unboxed(task.result())
        raise


async def _outcome(coro: Coroutine[Any, Any, T]) -> tuple[bool, Any]:
    """``(True, result)`` or ``(False, exception)``: a task hands a ``SystemExit`` or ``KeyboardInterrupt``
    to its loop, which it ends; boxed, it reaches the awaiting caller as any exception does."""
    try:
        return True, await coro
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except BaseException as exc:
        return False, exc


def _unboxed(outcome: tuple[bool, Any]) -> Any:
    ok, value = outcome
    if not ok:
        raise value
    return value


async def run_all(named: dict[str, Coroutine[Any, Any, Any]]) -> None:
    """Run each coroutine as a task named by its key until all are done; the first that fails
    cancels the others, which are awaited, and its exception is raised as it is (module rules)."""
    tasks = [asyncio.create_task(coro, name=name) for name, coro in named.items()]
    try:
        for done in asyncio.as_completed(tasks):
            await done
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
