"""The IO thread as a public primitive (io_loop/portal.py): your own coroutine on forkless's IO
thread and loop, two bounded queues to the main thread, the stop and error guarantees.

The classic worker below is written for ``multiprocessing.Queue`` as people write it, and runs
unchanged; the servers are real, on loopback (tests/servers.py). Waits are bounded by
``timeout_unit``; nothing asserts how long something took.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import multiprocessing
import queue
import re
import signal
import sys
import threading
import time
import traceback

import aiohttp
import pytest

import forkless
import forkless.io_loop.portal
from forkless.io_loop.portal import IOPortal, PortalClosed, RestartPolicy, WorkerFailed
from tests.harness import wait_until
from tests.servers import send_frames


class DataClientWorker:
    """Reads a WebSocket feed into ``to_queue`` and sends the orders it finds in ``from_queue``:
    written for ``multiprocessing.Queue`` (``asyncio.run(dcw.run())`` in a child process)."""

    def __init__(self, to_queue, from_queue, url):
        self.to_queue = to_queue
        self.from_queue = from_queue
        self.url = url

    async def run(self):
        async with aiohttp.ClientSession() as session, session.ws_connect(self.url) as ws:
            sender = asyncio.create_task(self.send_orders(ws))
            try:
                async for msg in ws:
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        self.to_queue.put_nowait(json.loads(msg.data))
            finally:
                sender.cancel()

    async def send_orders(self, ws):
        while True:
            try:
                order = self.from_queue.get_nowait()
            except queue.Empty:
                await asyncio.sleep(0.001)
                continue
            await ws.send_str(json.dumps(order))


def test_the_classic_multiprocessing_worker_runs_unchanged_on_the_portal(feed_server, timeout_unit):
    frames = [{"seq": i, "price": 100.0 + i} for i in range(20)]
    server = feed_server(send_frames(frames))
    with IOPortal(lambda to_main, from_main: DataClientWorker(to_main, from_main, server.url).run(),
                  stop_timeout_s=2 * timeout_unit) as portal:
        got = [portal.to_main.get(timeout=10 * timeout_unit) for _ in frames]
        for msg in got:
            portal.from_main.put({"order": msg["seq"], "at": msg["price"]})
        server.wait_for(lambda: server.received_count == len(frames), 10 * timeout_unit, "every order sent")
    assert got == frames
    assert server.replies() == [{"order": i, "at": 100.0 + i} for i in range(20)]
    assert not portal.alive


def test_a_worker_s_exception_wakes_a_blocked_get_with_the_worker_s_traceback(timeout_unit):
    async def failing_worker(to_main, from_main):
        await from_main.get()
        await asyncio.sleep(0.05)  # the main thread is most likely blocked in get by now (the test holds either way)
        raise ValueError("the feed sent nonsense")

    with IOPortal(failing_worker) as portal:
        portal.from_main.put("go")
        with pytest.raises(WorkerFailed) as caught:
            portal.to_main.get(timeout=10 * timeout_unit)
        assert isinstance(caught.value.__cause__, ValueError)
        assert "in failing_worker" in "".join(traceback.format_exception(caught.value))
        with pytest.raises(WorkerFailed):  # every later call too, and poll
            portal.from_main.put_nowait("more")
        with pytest.raises(WorkerFailed):
            portal.poll()


def test_a_worker_s_exception_is_raised_by_stop(timeout_unit):
    async def failing_worker(to_main, from_main):
        await from_main.get()
        raise KeyError("gone")

    portal = IOPortal(failing_worker, stop_timeout_s=5 * timeout_unit).start()
    portal.from_main.put("go")
    with pytest.raises(WorkerFailed) as caught:
        portal.stop()
    assert isinstance(caught.value.__cause__, KeyError)
    assert "in failing_worker" in "".join(traceback.format_exception(caught.value))
    portal.stop()  # a second stop does nothing: it does not raise again


def test_a_stop_arriving_as_the_loop_closes_makes_no_task(monkeypatch, timeout_unit):
    """A stop that reaches the loop after the worker ended (while the loop shuts its async
    generators down, as ``stop()``'s ``call_soon_threadsafe`` can) makes no cancelling task: one
    made then would never run, its coroutine "never awaited" (a RuntimeWarning seen in the suite at
    test_a_worker_s_exception_is_raised_by_stop, 2026-12-04)."""
    portals: list[IOPortal] = []
    closing = asyncio.BaseEventLoop.shutdown_asyncgens

    async def stop_as_it_closes(loop: asyncio.AbstractEventLoop) -> None:
        for p in portals:
            if p._loop is loop:
                p._begin_stop(time.monotonic() + 5 * timeout_unit)  # what stop() asks the loop to run
        await closing(loop)

    monkeypatch.setattr(asyncio.BaseEventLoop, "shutdown_asyncgens", stop_as_it_closes)

    async def failing_worker(to_main, from_main):
        await from_main.get()
        raise KeyError("gone")

    portal = IOPortal(failing_worker, stop_timeout_s=5 * timeout_unit)
    portals.append(portal)
    portal.start()
    portal.from_main.put("go")
    portal._thread.join(10 * timeout_unit)
    assert not portal._thread.is_alive()
    assert portal._stopper is None
    with pytest.raises(WorkerFailed):
        portal.stop()


def test_a_worker_that_fails_at_once_fails_start():
    def not_a_worker(to_main):  # called with two queues: TypeError before any await
        raise AssertionError("never called with one argument")

    portal = IOPortal(not_a_worker)
    with pytest.raises(WorkerFailed) as caught:
        portal.start()
    assert isinstance(caught.value.__cause__, TypeError)
    assert not portal.alive


def test_the_stop_keeps_its_deadline_with_a_worker_that_ignores_it_and_swallows_one_cancellation(timeout_unit):
    cancellations = []

    async def stubborn_worker(to_main, from_main):
        while True:
            try:
                await asyncio.sleep(3600)  # never looks at the stopping event
            except asyncio.CancelledError:
                cancellations.append(to_main.stopping.is_set())
                if len(cancellations) > 1:
                    raise

    portal = IOPortal(stubborn_worker, stop_timeout_s=2 * timeout_unit).start()
    portal.stop()  # raises WorkerFailed if the thread had not ended by the deadline
    assert cancellations == [True, True]
    assert not portal.alive


def test_a_worker_that_never_ends_is_reported_by_stop_and_left_behind(timeout_unit):
    release = threading.Event()

    async def deaf_worker(to_main, from_main):
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                pass

    portal = IOPortal(deaf_worker, stop_timeout_s=0.5 * timeout_unit, name="forkless-io-deaf").start()
    try:
        with pytest.raises(WorkerFailed, match=r"did not end within the stop's .*left running"):
            portal.stop()
        assert portal.alive
        with pytest.raises(WorkerFailed):  # the queues are shut down: nothing blocks on them
            portal.to_main.get(timeout=10 * timeout_unit)
        portal.stop()  # the second stop does nothing
    finally:
        release.set()
        portal._thread.join(10 * timeout_unit)


def test_a_second_stop_does_nothing(timeout_unit):
    async def polite_worker(to_main, from_main):
        await to_main.stopping.wait()

    portal = IOPortal(polite_worker).start()
    portal.stop()
    assert not portal.alive
    portal.stop()
    with pytest.raises(RuntimeError, match="runs once"):  # nor does it start again
        portal.start()


def test_the_worker_learns_the_stop_began_and_what_it_sent_last_stays_for_the_main_thread(timeout_unit):
    async def polite_worker(to_main, from_main):
        await from_main.stopping.wait()
        to_main.put_nowait("bye")

    with IOPortal(polite_worker, stop_timeout_s=10 * timeout_unit) as portal:
        assert portal.poll() and not portal.stopping.is_set()
    assert portal.stopping.is_set() and not portal.poll()
    assert portal.to_main.get_nowait() == "bye"
    with pytest.raises(PortalClosed):
        portal.to_main.get_nowait()


def test_a_worker_that_returns_ends_to_main_after_what_it_sent(timeout_unit):
    async def short_worker(to_main, from_main):
        for i in range(3):
            await to_main.put(i)

    with IOPortal(short_worker) as portal:
        assert [portal.to_main.get(timeout=10 * timeout_unit) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(PortalClosed, match="returned before the stop") as caught:
            portal.to_main.get(timeout=10 * timeout_unit)
        assert isinstance(caught.value, forkless.io_loop.portal.janus.SyncQueueShutDown)
        with pytest.raises(PortalClosed):
            portal.from_main.put_nowait("too late")


def test_the_worker_side_queue_exceptions_are_both_the_queue_and_the_asyncio_ones(timeout_unit):
    async def probing_worker(to_main, from_main):
        try:
            from_main.get_nowait()
        except Exception as exc:
            empty = (isinstance(exc, queue.Empty), isinstance(exc, asyncio.QueueEmpty))
        to_main.put_nowait("fills the queue")
        try:
            to_main.put_nowait("one too many")
        except Exception as exc:
            full = (isinstance(exc, queue.Full), isinstance(exc, asyncio.QueueFull), "queue_size=1" in str(exc))
        await from_main.get()  # the main thread has taken the first item
        to_main.put_nowait((empty, full, to_main.qsize(), from_main.empty()))
        await to_main.stopping.wait()  # returning would end to_main

    with IOPortal(probing_worker, queue_size=1) as portal:
        assert portal.to_main.get(timeout=10 * timeout_unit) == "fills the queue"
        portal.from_main.put("next")
        assert portal.to_main.get(timeout=10 * timeout_unit) == ((True, True), (True, True, True), 0, True)
        with pytest.raises(queue.Empty):  # the main side's are queue.Queue's
            portal.to_main.get_nowait()


def test_queue_size_0_bounds_nothing_as_a_multiprocessing_queue(timeout_unit):
    async def flooding_worker(to_main, from_main):
        for i in range(25_000):  # more than the default bound of 10 000
            to_main.put_nowait(i)
        to_main.put_nowait(to_main.full())
        await to_main.stopping.wait()

    with IOPortal(flooding_worker, queue_size=0) as portal:
        got = [portal.to_main.get(timeout=10 * timeout_unit) for _ in range(25_001)]
    assert got == [*range(25_000), False]


def test_the_portal_leaves_its_host_process_as_it_found_it(timeout_unit):
    def host():
        return (sys.getswitchinterval(), gc.isenabled(), gc.get_freeze_count(), signal.getsignal(signal.SIGINT),
                signal.getsignal(signal.SIGTERM), threading.enumerate(), multiprocessing.active_children())

    async def worker(to_main, from_main):
        to_main.put_nowait((threading.current_thread().name, threading.current_thread().daemon))
        await to_main.stopping.wait()

    before = host()
    with IOPortal(worker, name="forkless-io-host") as portal:
        assert portal.to_main.get(timeout=10 * timeout_unit) == ("forkless-io-host", True)
        assert multiprocessing.active_children() == []  # no process started, nothing forked
    assert host() == before


def test_the_portal_is_exported_by_forkless_and_checks_its_arguments():
    assert forkless.IOPortal is IOPortal
    assert forkless.WorkerFailed is WorkerFailed
    with pytest.raises(ValueError, match="queue_size"):
        IOPortal(lambda a, b: None, queue_size=-1)
    with pytest.raises(RuntimeError, match="start"):
        IOPortal(lambda a, b: None).to_main  # noqa: B018


# ---- the worker's queue ends called as multiprocessing.Queue's (issue 43, item 7) --------------


def test_a_put_not_awaited_on_the_loop_delivers_every_item_in_order_even_past_queue_size(timeout_unit, recwarn):
    async def sync_style_worker(to_main, from_main):
        for i in range(10):  # multiprocessing.Queue style: never awaited, the queue holds 2
            to_main.put(i)
        seen = (to_main.full(), to_main.qsize())
        try:
            to_main.put_nowait("may not pass the held items")
        except queue.Full:
            seen += ("Full",)
        to_main.put(seen, True, 0.5)  # put(item, block, timeout): held too, never lost
        await to_main.stopping.wait()

    with IOPortal(sync_style_worker, queue_size=2, stop_timeout_s=10 * timeout_unit) as portal:
        got = [portal.to_main.get(timeout=10 * timeout_unit) for _ in range(11)]
    assert got == [*range(10), (True, 10, "Full")]
    gc.collect()
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


def test_an_awaited_put_waits_for_room_and_with_a_timeout_raises_full_and_withdraws_the_item(timeout_unit):
    timed_out = threading.Event()

    async def async_style_worker(to_main, from_main):
        await to_main.put("first")  # room: in at once
        try:
            await to_main.put("withdrawn", timeout=0.01)  # the main thread takes nothing until timed_out
        except queue.Full as exc:
            outcome = type(exc).__name__
        timed_out.set()
        await to_main.put(outcome)  # full: waits until the main thread takes "first"
        await to_main.put("waited for room")
        await to_main.stopping.wait()

    with IOPortal(async_style_worker, queue_size=1, stop_timeout_s=10 * timeout_unit) as portal:
        assert timed_out.wait(10 * timeout_unit)
        got = [portal.to_main.get(timeout=10 * timeout_unit) for _ in range(3)]
    assert got == ["first", "Full", "waited for room"]


def test_the_blocking_calls_block_as_multiprocessing_s_from_an_executor_thread(timeout_unit):
    async def executor_worker(to_main, from_main):
        loop = asyncio.get_running_loop()
        try:  # get(True, 0.05) in an executor: Empty after the timeout, as multiprocessing's
            await loop.run_in_executor(None, from_main.get, True, 0.05)
        except queue.Empty:
            timed_out = True
        await loop.run_in_executor(None, to_main.put, ("ready", timed_out), True, 10.0)
        order = await loop.run_in_executor(None, from_main.get)  # blocks until the main thread puts
        while from_main.empty():  # the main thread puts "last" just after the order (seen later under load)
            await asyncio.sleep(0.001)
        sizes = await loop.run_in_executor(None, lambda: (from_main.qsize(), from_main.empty(), to_main.full()))
        await loop.run_in_executor(None, to_main.put_nowait, (order, sizes))
        taken = await loop.run_in_executor(None, from_main.get_nowait)
        to_main.put(taken)
        await to_main.stopping.wait()

    with IOPortal(executor_worker, stop_timeout_s=10 * timeout_unit) as portal:
        assert portal.to_main.get(timeout=10 * timeout_unit) == ("ready", True)
        portal.from_main.put({"order": 1})
        portal.from_main.put("last")
        assert portal.to_main.get(timeout=10 * timeout_unit) == ({"order": 1}, (1, False, False))
        assert portal.to_main.get(timeout=10 * timeout_unit) == "last"


def test_get_on_the_loop_is_awaitable_or_non_blocking_and_one_not_awaited_takes_nothing_and_says_so(
        timeout_unit, caplog):
    async def getting_worker(to_main, from_main):
        first = await from_main.get()  # async style still works
        while from_main.empty():  # the main thread puts "two" just after "one"
            await asyncio.sleep(0.001)
        second = from_main.get(block=False)  # multiprocessing style on the loop: the item, at once
        try:
            await from_main.get(timeout=0.01)
        except queue.Empty:
            empty = "Empty"
        from_main.get()  # a blocking get on the loop, not awaited: takes nothing, and says so
        gc.collect()
        to_main.put((first, second, empty))
        to_main.put(await from_main.get())  # "three" was not taken by the get not awaited
        await to_main.stopping.wait()

    with IOPortal(getting_worker, stop_timeout_s=10 * timeout_unit) as portal:
        portal.from_main.put("one")
        portal.from_main.put("two")
        assert portal.to_main.get(timeout=10 * timeout_unit) == ("one", "two", "Empty")
        portal.from_main.put("three")
        assert portal.to_main.get(timeout=10 * timeout_unit) == "three"
    assert "from_main.get() was called on the IO loop and not awaited: nothing was taken" in caplog.text
    assert "run_in_executor" in caplog.text


def test_a_worker_that_returns_hands_over_what_its_put_still_held_then_portal_closed_says_why(timeout_unit):
    async def short_worker(to_main, from_main):
        for i in range(5):
            to_main.put(i)  # queue_size 2: three are held when it returns

    with IOPortal(short_worker, queue_size=2) as portal:
        portal._thread.join(10 * timeout_unit)  # the worker has returned and the loop has closed
        assert not portal.poll()
        assert [portal.to_main.get(timeout=10 * timeout_unit) for _ in range(5)] == [0, 1, 2, 3, 4]
        with pytest.raises(PortalClosed, match=r"returned before the stop .* Catch PortalClosed"):
            portal.to_main.get(timeout=10 * timeout_unit)


# ---- start(), and a restart policy (issue 54 item 12; issue 55 item 4) -------------------------


def test_a_worker_that_fails_after_its_first_await_never_fails_start_its_failure_comes_from_the_next_call(
        timeout_unit):
    async def unreachable_exchange(to_main, from_main):
        await asyncio.sleep(0)  # its first step is done: start() has returned, or is returning
        raise ConnectionRefusedError("the exchange is down")

    for _ in range(10):  # the failure races start()'s return: it must lose every time
        portal = IOPortal(unreachable_exchange, stop_timeout_s=5 * timeout_unit)
        assert portal.start() is portal
        with pytest.raises(WorkerFailed) as caught:
            portal.to_main.get(timeout=10 * timeout_unit)
        assert isinstance(caught.value.__cause__, ConnectionRefusedError)
        portal.stop()  # the failure was raised once: the stop does not raise it again


def test_a_failed_worker_is_restarted_with_its_queue_ends_and_the_main_loop_is_told(timeout_unit, caplog):
    async def worker(to_main, from_main):
        order = await from_main.get()
        to_main.put(("taken", order))
        if order == "fail":
            raise RuntimeError("the session broke")
        # returns: a restart too

    policy = forkless.RestartPolicy(backoff=forkless.Backoff(min_s=0.01, max_s=0.02))
    with IOPortal(worker, restart=policy, connection_events=True, name="orders") as portal:
        for order in ("fail", "return", "fail"):
            portal.from_main.put(order)  # taken by whichever run is up: the ends are the same
        seen = [portal.to_main.get(timeout=10 * timeout_unit) for _ in range(3 * 3)]
        wait_until(lambda: portal.restarts == 3, timeout_s=10 * timeout_unit, what="the fourth run")
        assert portal.poll() and portal.to_main.empty()  # the fourth run has put nothing: it is not up
    connection_events = [e for e in seen if isinstance(e, forkless.ConnectionEvent)]
    assert [(e.source, e.connected, e.connection) for e in connection_events] == [
        ("orders", True, 1), ("orders", False, 1), ("orders", True, 2), ("orders", False, 2), ("orders", True, 3),
        ("orders", False, 3)]
    assert [e for e in seen if not isinstance(e, forkless.ConnectionEvent)] == [
        ("taken", "fail"), ("taken", "return"), ("taken", "fail")]
    assert seen.index(("taken", "return")) == 4  # in order: each run's items between its start and its end
    assert re.fullmatch(r"the worker failed: RuntimeError: the session broke; restarting in 0\.0\ds",
                        connection_events[1].reason)
    assert re.fullmatch(r"the worker returned; restarting in 0\.0\ds", connection_events[3].reason)
    assert caplog.text.count("Traceback") == 1  # the same failure's traceback is logged once, then one line


def test_an_executor_get_a_finished_run_left_blocked_gives_what_it_takes_to_the_next_run(timeout_unit):
    async def classic(to_main, from_main):  # as the classic worker's sender: cancelled while its get blocks
        loop = asyncio.get_running_loop()
        getter = asyncio.ensure_future(loop.run_in_executor(None, from_main.get, True, 30 * timeout_unit))
        if to_main.qsize():  # the first run: it returns at once, its executor get still blocked
            getter.cancel()
            return
        to_main.put(("second run took", await getter))

    async def worker(to_main, from_main):
        if not getattr(worker, "ran", False):
            worker.ran = True
            to_main.put("first run")
        await classic(to_main, from_main)

    with IOPortal(worker, restart=forkless.RestartPolicy(backoff=forkless.Backoff(min_s=0.01, max_s=0.02))) as portal:
        assert portal.to_main.get(timeout=10 * timeout_unit) == "first run"
        wait_until(lambda: portal.restarts == 1, timeout_s=10 * timeout_unit, what="the restart")
        portal.from_main.put("order 1")  # the first run's orphaned get takes it, and gives it back
        assert portal.to_main.get(timeout=10 * timeout_unit) == ("second run took", "order 1")


def test_a_worker_whose_tries_are_used_up_ends_the_portal_as_without_a_policy(timeout_unit):
    async def short_worker(to_main, from_main):
        to_main.put("ran")

    policy = forkless.RestartPolicy(backoff=forkless.Backoff(min_s=0.01, max_s=0.02), tries=3)
    with IOPortal(short_worker, restart=policy) as portal:
        assert [portal.to_main.get(timeout=10 * timeout_unit) for _ in range(3)] == ["ran"] * 3
        with pytest.raises(PortalClosed, match=r"tries=3 failures in a row are used up"):
            portal.to_main.get(timeout=10 * timeout_unit)
        assert not portal.poll() and portal.restarts == 2
        with pytest.raises(PortalClosed):  # the order put after the end raises too: catch it around puts
            portal.from_main.put("order")


def test_a_worker_that_fails_before_its_first_await_fails_start_even_with_a_restart_policy():
    def not_a_worker(to_main):
        raise AssertionError("never called with one argument")

    with pytest.raises(WorkerFailed) as caught:
        IOPortal(not_a_worker, restart=forkless.RestartPolicy()).start()
    assert isinstance(caught.value.__cause__, TypeError)


def test_a_restart_policy_and_its_misuse_are_checked_naming_what_is_allowed():
    assert forkless.RestartPolicy is RestartPolicy
    assert repr(RestartPolicy().backoff) == repr(forkless.DEFAULT_BACKOFF)  # Relogin's: it follows the peer
    with pytest.raises(TypeError, match=r"RestartPolicy takes backoff=, tries= and failures=, not min_delay=1"):
        RestartPolicy(min_delay=1)
    with pytest.raises(ValueError, match=r"max_s \(0.5\) is less than its min_s \(1.0\)"):
        RestartPolicy(backoff=forkless.Backoff(min_s=1.0, max_s=0.5))
    with pytest.raises(ValueError, match=r"RestartPolicy's tries is an int >= 0 .*not -1"):
        RestartPolicy(tries=-1)
    with pytest.raises(TypeError, match=r"RestartPolicy's backoff is a forkless.Backoff .* not 0.5"):
        RestartPolicy(0.5)
    with pytest.raises(TypeError, match=r"takes a forkless.RestartPolicy .* not True"):
        IOPortal(lambda a, b: None, restart=True)
    assert RestartPolicy(backoff=forkless.Backoff(tries=5), tries=3).tries == 3  # the smaller one counts


def test_a_failure_whose_text_itself_raises_is_still_named_restarted_and_raised(timeout_unit):
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no text")

    async def worker(to_main, from_main):
        to_main.put(await from_main.get())  # its first item: it is up
        raise Unprintable

    policy = RestartPolicy(backoff=forkless.Backoff(min_s=0.01, max_s=0.02), tries=2)
    with IOPortal(worker, restart=policy, connection_events=True) as portal:
        portal.from_main.put("go")
        assert portal.to_main.get(timeout=10 * timeout_unit).connected
        assert portal.to_main.get(timeout=10 * timeout_unit) == "go"
        ended = portal.to_main.get(timeout=10 * timeout_unit)
        assert re.fullmatch(r"the worker failed: Unprintable; restarting in 0\.0\ds", ended.reason)
        portal.from_main.put("go")  # the second short run in a row: tries=2 used up, it fails the portal
        with pytest.raises(WorkerFailed, match=r"^the IO worker failed: Unprintable$"):
            while True:
                portal.to_main.get(timeout=10 * timeout_unit)


def test_a_restart_policy_s_old_delays_warn_naming_the_backoff_and_still_work_their_values_checked_where_given():
    # the one deprecation policy (docs/embedding/versions.md): warned in 0.3.0, removed in 0.4.0
    with pytest.warns(DeprecationWarning, match=r"RestartPolicy\(min_s=0.2, max_s=3.0\) is deprecated since "
                                                r"forkless 0.3.0 and is removed in 0.4.0: write RestartPolicy\("
                                                r"backoff=forkless.Backoff\(min_s=0.2, max_s=3.0\)\)"):
        policy = RestartPolicy(min_s=0.2, max_s=3.0)
    assert (policy.backoff.min_s, policy.backoff.max_s) == (0.2, 3.0)
    assert policy.backoff.follow_s == forkless.DEFAULT_BACKOFF.follow_s  # the rest is the default's: it follows
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"Backoff's max_s is a finite number"):
        RestartPolicy(max_s=math.inf)  # refused where it is given, never at the first restart
    with pytest.raises(TypeError, match=r"give the delays once"):
        RestartPolicy(forkless.Backoff(), min_s=0.2)
