"""The one loop-in-a-thread primitive (io_loop/loopthread.py) under the IO thread, the portal, the
store's thread and --check's probe: the start handshake, the exception delivered, cancellation at
the exit, the join's deadline, the host's event loop left alone. Waits are bounded by
``timeout_unit``; nothing asserts how long something took."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from forkless.io_loop.loopthread import LoopThread, run_in_thread
from forkless.io_loop.waiting import WaitSettings

# the loop's thread, its handshake, exceptions and stop: run on free-threaded CPython too (.ci/run)
pytestmark = pytest.mark.threads


def test_start_returns_once_main_has_said_ready_and_the_thread_is_named_and_a_daemon(timeout_unit):
    made = []
    release = threading.Event()

    async def main():
        made.append(asyncio.get_running_loop())
        runner.ready()
        while not release.is_set():
            await asyncio.sleep(0.01)
        return "done"

    runner = LoopThread("test-loop")
    assert runner.start(main, 10 * timeout_unit)
    assert made == [runner.loop]  # what main made before ready() is there when start returns
    assert runner.thread.name == "test-loop" and runner.thread.daemon and runner.alive
    release.set()
    assert runner.join(10 * timeout_unit)
    assert runner.result == "done" and runner.failure is None and not runner.alive
    assert runner.loop.is_closed()


def test_start_says_false_when_main_neither_says_ready_nor_ends_within_the_timeout(timeout_unit):
    async def main():
        await asyncio.Event().wait()

    runner = LoopThread("test-loop")
    assert not runner.start(main, 0.01)
    assert runner.cancel()
    assert runner.join(10 * timeout_unit)
    assert isinstance(runner.failure, asyncio.CancelledError)


def test_what_main_raises_before_ready_ends_the_handshake_and_is_delivered_as_it_is(timeout_unit):
    boom = ValueError("the worker's own error")

    async def main():
        raise boom

    runner = LoopThread("test-loop")
    assert runner.start(main, 10 * timeout_unit)  # returns at once: main has ended
    assert runner.join(10 * timeout_unit)
    assert runner.failure is boom


def test_run_in_thread_raises_the_coroutine_s_exception_in_the_caller_with_its_traceback():
    async def fails():
        raise KeyError("from the loop")

    with pytest.raises(KeyError, match="from the loop") as caught:
        run_in_thread(fails, name="test-run")
    assert any(entry.name == "fails" for entry in caught.traceback)


def test_what_main_left_running_is_cancelled_at_the_exit_and_its_clean_up_runs(timeout_unit):
    cleaned = threading.Event()

    async def forever():
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()

    async def main():
        asyncio.get_running_loop().create_task(forever())
        await asyncio.sleep(0)  # it has started
        return 1

    runner = LoopThread("test-loop")
    runner.start(main, 10 * timeout_unit)
    assert runner.join(10 * timeout_unit)
    assert cleaned.is_set() and runner.failure is None and runner.result == 1


def test_the_exit_waits_at_most_cleanup_s_for_a_task_that_swallows_its_cancellation(timeout_unit):
    stubborn_ran = threading.Event()

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                stubborn_ran.set()  # swallowed: cancelled, it goes on

    async def main():
        asyncio.get_running_loop().create_task(stubborn())
        await asyncio.sleep(0)

    runner = LoopThread("test-loop", cleanup_s=0.01)
    runner.start(main, 10 * timeout_unit)
    assert runner.join(10 * timeout_unit)  # without the bound the thread would never end
    assert stubborn_ran.is_set()


def test_join_returns_false_at_its_deadline_while_the_loop_is_held_then_true_once_it_ends(timeout_unit):
    held, release = threading.Event(), threading.Event()

    async def main():
        held.set()
        release.wait()  # blocks the loop itself: nothing on it can end it

    runner = LoopThread("test-loop")
    assert not runner.start(main, 0)  # main never says ready: no handshake to wait for here
    assert held.wait(10 * timeout_unit)
    assert not runner.join(0.01)
    assert runner.alive
    release.set()
    assert runner.join(10 * timeout_unit) and not runner.alive


def test_cancel_cancels_main_and_the_cancellation_is_the_failure(timeout_unit):
    async def main():
        runner.ready()
        await asyncio.Event().wait()

    runner = LoopThread("test-loop")
    assert runner.start(main, 10 * timeout_unit)
    assert runner.cancel()
    assert runner.join(10 * timeout_unit)
    assert isinstance(runner.failure, asyncio.CancelledError)
    assert not runner.cancel() and not runner.call_soon(print)  # the loop has closed: nothing to do


def test_a_cancel_asked_before_main_began_means_it_never_begins(timeout_unit):
    began = []

    async def main():
        began.append(True)

    runner = LoopThread("test-loop")
    assert runner.cancel()
    runner.start(main, 10 * timeout_unit)
    assert runner.join(10 * timeout_unit)
    assert began == [] and isinstance(runner.failure, asyncio.CancelledError)


def test_submit_runs_a_coroutine_beside_main_and_refuses_one_from_the_loop_s_own_thread(timeout_unit):
    refused = []

    async def main():
        runner.ready()
        coro = asyncio.sleep(0)
        try:
            runner.submit(coro)
        except RuntimeError as exc:
            refused.append(str(exc))
        await asyncio.Event().wait()

    async def add(a, b):
        return a + b

    runner = LoopThread("test-loop")
    assert runner.start(main, 10 * timeout_unit)
    assert runner.submit(add(2, 3)).result(10 * timeout_unit) == 5
    assert refused and "would wait for itself" in refused[0]
    runner.cancel()
    assert runner.join(10 * timeout_unit)
    with pytest.raises(RuntimeError, match="not running"):
        runner.submit(add(1, 1))


def test_a_loop_thread_runs_once():
    async def main():
        return None

    runner = LoopThread("test-loop")
    runner.start(main)
    runner.join()
    with pytest.raises(RuntimeError, match="runs once"):
        runner.start(main)


def test_run_in_thread_leaves_the_caller_s_event_loop_as_it_was():
    """asyncio.run would set the caller's current loop to None when done (a host's loop lost) and
    refuse to run inside a running loop; --check's probe runs through run_in_thread."""
    mine = asyncio.new_event_loop()
    asyncio.set_event_loop(mine)
    try:
        async def where():
            return threading.current_thread().name

        assert run_in_thread(where, name="test-run") == "test-run"
        assert asyncio.get_event_loop_policy().get_event_loop() is mine

        async def inside_a_running_loop():
            return run_in_thread(where, name="test-run-inner")

        assert mine.run_until_complete(inside_a_running_loop()) == "test-run-inner"
    finally:
        asyncio.set_event_loop(None)
        mine.close()


def test_cpu_seconds_is_nan_before_the_start_and_final_after_the_end(timeout_unit):
    async def main():
        return None

    runner = LoopThread("test-loop")
    assert runner.cpu_seconds() != runner.cpu_seconds()  # NaN
    runner.start(main)
    assert runner.join(10 * timeout_unit)
    assert runner.cpu_seconds() >= 0.0 and runner.cpu_seconds() == runner.cpu_seconds()


def test_a_loop_thread_parks_by_default_and_under_a_spinning_wait_its_loop_runs_on_its_spinning_selector(
        timeout_unit):
    assert LoopThread("test-park").selector is None
    runner = LoopThread("test-spin", wait=WaitSettings("spin"))
    selector = runner.selector
    assert selector is not None
    release = threading.Event()

    async def main():
        selector.attach(lambda: False)  # nothing to look at but the sockets: what a bridge attaches
        runner.ready()
        while not release.is_set():
            await asyncio.sleep(0.01)

    assert runner.start(main, 10 * timeout_unit)
    selector.expecting.expect(1)  # work imminent: the loop's next select spins, napping between looks
    deadline = time.monotonic() + 10 * timeout_unit
    while not selector.naps:
        assert time.monotonic() < deadline, "the loop never spun: it does not run on the thread's selector"
        time.sleep(0.001)
    selector.expecting.expect(0)
    release.set()
    assert runner.join(10 * timeout_unit) and runner.failure is None
