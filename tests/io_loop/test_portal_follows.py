"""A portal's worker as safe as a Source (issue 65): its restarts follow the exchange as ``Relogin``'s
reconnects do, its connection events mean the connection, its stop delivers the answers in flight,
and an order its session took to the grave is reported, never lost silently.

Real parts: tests/ws_exchange.py on loopback, killed and restarted as a process would be, and the
classic worker written for ``multiprocessing.Queue`` (tests/classic_program.py), unchanged. Nothing is
timed but the restart policy's own delays, which are the policy's, not the machine's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import re
import threading
import time
from typing import Any

import aiohttp
import pytest

import forkless
from forkless import Backoff, ConnectionEvent, IOPortal, RestartPolicy, SendFailed, WorkerFailed
from tests.classic_program import DataClientWorker
from tests.harness import UNIT_S, wait_until
from tests.ws_exchange import USER, WsExchange, order

WAIT_S = 30 * UNIT_S
OUTAGE_S = 2.0  # the exchange dead this long: its young outage is followed (DEFAULT_BACKOFF: within 0.5 s)


def _classic(url: str) -> Any:
    return lambda to_main, from_main: DataClientWorker(to_main, from_main, url).run()


def _fill_of(item: Any) -> Any:
    """The portal's ``send_answered``: a fill answers the order of its client_order_id."""
    return item.get("client_order_id") if isinstance(item, dict) and item.get("type") == "fill" else None


def _take(portal: IOPortal, until: Any, what: str) -> list[Any]:
    """What ``to_main`` brings until ``until(seen)`` holds."""
    seen: list[Any] = []
    deadline = time.monotonic() + WAIT_S
    while not until(seen):
        assert time.monotonic() < deadline, f"not within {WAIT_S:.0f}s: {what}; the last: {seen[-5:]}"
        try:
            seen.append(portal.to_main.get(timeout=0.1))
        except queue.Empty:
            continue
    return seen


def _rest(portal: IOPortal) -> list[Any]:
    """What ``to_main`` still holds after the stop, until ``PortalClosed``."""
    left = []
    while True:
        try:
            left.append(portal.to_main.get_nowait())
        except forkless.PortalClosed:
            return left


def _changes(seen: list[Any]) -> list[ConnectionEvent]:
    return [e for e in seen if isinstance(e, ConnectionEvent)]


# ---- its connection events mean the connection ------------------------------------------------------


def test_a_run_that_fails_at_login_says_nothing_up_and_never_connected_is_never_up():
    """The login refused (403: the worker's raise_for_status): each run fails before its first item."""
    with WsExchange() as exchange:
        class WrongPassword(DataClientWorker):
            async def run(self):
                async with aiohttp.ClientSession() as http:
                    async with http.post(f"{self.url}/login", json={"user": USER, "password": "wrong"}) as resp:
                        resp.raise_for_status()

        with IOPortal(lambda a, b: WrongPassword(a, b, exchange.url).run(), connection_events=True,
                      restart=RestartPolicy(backoff=Backoff(min_s=0.01, max_s=0.02))) as portal:
            wait_until(lambda: portal.runs >= 4, timeout_s=WAIT_S, what="four runs refused at login")
            assert portal.poll() and portal.connections == 0
            assert portal.to_main.empty(), "a run that failed at login put an up (or a down) event"


def test_up_comes_with_the_first_item_of_a_session_and_down_with_its_end_once_per_session(caplog):
    """Against the exchange killed and back: one up and one down per session that was up, none for the
    runs that failed to log in while it was dead (the contract in connection-events.md)."""
    with WsExchange(trade_every_s=0.02) as exchange:
        with IOPortal(_classic(exchange.url), connection_events=True, restart=RestartPolicy()) as portal:
            seen = _take(portal, lambda s: any(isinstance(e, dict) and e["type"] == "trade" for e in s), "a trade")
            assert isinstance(seen[0], ConnectionEvent) and seen[0].connected  # before the first item
            assert seen[1]["type"] == "subscribed"
            exchange.kill()
            seen += _take(portal, lambda s: any(not e.connected for e in _changes(s)), "the session lost")
            runs = portal.runs
            wait_until(lambda: portal.runs >= runs + 2, timeout_s=WAIT_S, what="two runs failing to log in")
            exchange.restart()
            seen += _take(portal, lambda s: len(_changes(s)) == 1, "the next session up")
            ups = portal.connections
    changes = _changes(seen)
    assert [(e.connected, e.connection) for e in changes] == [(True, 1), (False, 1), (True, 2)]
    assert ups == 2 and re.fullmatch(r"the worker returned; restarting in 0\.\d\ds", changes[1].reason)
    down_at = seen.index(changes[1])
    assert seen[down_at - 1] == {"type": "closed", "code": 1006}  # after what its run put last


def test_a_worker_that_says_when_it_is_connected_is_taken_at_its_word_with_its_reason_and_close_code():
    async def worker(to_main, from_main):
        to_main.set_connected(False, "not yet")  # down while not up: nothing, and from now it says when it is up
        to_main.put("logging in")  # its first item: no "up"
        to_main.put("still logging in")
        to_main.set_connected(True)
        to_main.put("trade")
        from_main.set_connected(False, "closed by the exchange (code 4003)", code=4003)  # either end says it
        await to_main.stopping.wait()

    with IOPortal(worker, connection_events=True, name="ex") as portal:
        seen = _take(portal, lambda s: len(s) == 5, "five items")
    assert seen[:3] == ["logging in", "still logging in", ConnectionEvent("ex", True, "", None, 1, seen[2].at_s)]
    assert seen[3] == "trade"
    assert seen[4] == ConnectionEvent("ex", False, "closed by the exchange (code 4003)", 4003, 1, seen[4].at_s)


def test_set_connected_checks_what_it_is_given():
    async def worker(to_main, from_main):
        with pytest.raises(TypeError, match=r"set_connected\(connected, reason='', code=None\) takes a bool"):
            to_main.set_connected("yes")
        with pytest.raises(TypeError, match="an int close code"):
            to_main.set_connected(False, "lost", code="1006")
        to_main.put("checked")

    with IOPortal(worker) as portal:
        assert portal.to_main.get(timeout=WAIT_S) == "checked"


# ---- its restarts follow the peer -----------------------------------------------------------------------


def test_restarts_through_an_outage_are_never_more_than_half_a_second_apart_and_follow_the_return(caplog):
    """DEFAULT_BACKOFF, Relogin's: while the outage is young every delay is at most follow_s (0.5 s), so the
    exchange back is followed within that; a portal's delays doubled through the outage before (to 5 s)."""
    with WsExchange(trade_every_s=0.02) as exchange:
        with caplog.at_level(logging.WARNING, logger="forkless.portal"):
            with IOPortal(_classic(exchange.url), connection_events=True, restart=RestartPolicy()) as portal:
                _take(portal, lambda s: len(_changes(s)) == 1, "the first session")
                exchange.kill()
                _take(portal, lambda s: len(_changes(s)) == 1, "the session lost")
                time.sleep(OUTAGE_S)  # the outage: the portal tries again and again
                exchange.restart()
                _take(portal, lambda s: len(_changes(s)) == 1, "the next session up")
    delays = [float(d) for d in re.findall(r"restarting it in (\d+\.\d+)s", caplog.text)]
    assert len(delays) >= 3, caplog.text  # the session's end, then logins refused while it was dead
    assert max(delays) <= 0.5, delays


def test_a_connection_that_held_reset_s_starts_the_count_again_and_one_that_did_not_does_not(caplog):
    held = {"s": 0.0}

    async def worker(to_main, from_main):
        to_main.put("up")
        await asyncio.sleep(held["s"])

    policy = RestartPolicy(backoff=Backoff(min_s=0.01, max_s=5.0, reset_s=0.3, jitter=0.0))
    with caplog.at_level(logging.WARNING, logger="forkless.portal"):
        with IOPortal(worker, restart=policy) as portal:  # each run up, then at once gone: 0.01, 0.02, 0.04
            wait_until(lambda: portal.runs >= 4, timeout_s=WAIT_S, what="four short runs")
            held["s"] = 0.35  # from now each run holds reset_s: each delay the first one again
            runs = portal.runs
            wait_until(lambda: portal.runs >= runs + 3, timeout_s=WAIT_S, what="three runs that held")
    delays = [float(d) for d in re.findall(r"restarting it in (\d+\.\d+)s", caplog.text)]
    assert delays[:3] == [0.01, 0.02, 0.04], delays
    assert delays[-2:] == [0.01, 0.01], delays


# ---- the stop delivers what is in flight; what its session took to the grave is reported -------------------


class WatchingWorker(DataClientWorker):
    """The classic worker, plus a look at the portal's stop: it returns at once when told to stop."""

    async def run(self):
        session = asyncio.ensure_future(super().run())
        stop = asyncio.ensure_future(self.to_queue.stopping.wait())
        await asyncio.wait({session, stop}, return_when=asyncio.FIRST_COMPLETED)
        for task in (session, stop):
            task.cancel()
        await asyncio.gather(session, stop, return_exceptions=True)


def _closing_orders(portal: IOPortal, exchange: WsExchange, n: int) -> None:
    _take(portal, lambda s: any(isinstance(e, dict) and e["type"] == "trade" for e in s), "a trade")
    for i in range(n):
        portal.from_main.put(order(i), id=f"o{i}")


def test_the_stop_delivers_every_fill_of_the_orders_in_flight_before_it_stops_the_worker():
    stop_began = threading.Event()
    with WsExchange(hold_fills=True) as exchange:
        releaser = threading.Thread(target=lambda: stop_began.wait(WAIT_S) and exchange.release_fills())
        releaser.start()
        try:
            portal = IOPortal(lambda a, b: WatchingWorker(a, b, exchange.url).run(), send_answered=_fill_of,
                              stop_timeout_s=10 * UNIT_S)
            with portal:
                _closing_orders(portal, exchange, 8)
                assert portal.awaiting == 8
                stop_began.set()  # the fills come once the stop has begun
        finally:
            stop_began.set()
            releaser.join()
        left = _rest(portal)
    fills = sorted(e["client_order_id"] for e in left if isinstance(e, dict) and e["type"] == "fill")
    assert fills == sorted(f"o{i}" for i in range(8))
    assert portal.awaiting == 0 and portal.awaited_unanswered == {} and portal.sent_failed == {}
    assert not any(isinstance(e, SendFailed) for e in left)


def test_fills_that_never_come_are_counted_and_reported_at_the_stop_s_deadline(caplog):
    with WsExchange(hold_fills=True) as exchange:  # never released
        with caplog.at_level(logging.WARNING, logger="forkless.portal"):
            portal = IOPortal(_classic(exchange.url), send_answered=_fill_of, stop_timeout_s=2 * UNIT_S)
            with portal:
                _closing_orders(portal, exchange, 8)
                exchange.wait_for(lambda f: len(f["orders"]) == 8, WAIT_S, "every order")
        left = _rest(portal)
    failed = [e for e in left if isinstance(e, SendFailed)]
    assert sorted(e.id for e in failed) == sorted(f"o{i}" for i in range(8))
    assert {e.reason for e in failed} == {"stop deadline"} and failed[0].frame["type"] == "order"
    assert portal.awaited_unanswered == {"stop deadline": 8} and portal.awaiting == 0
    assert "the stop's time for answers ran out with 8 items" in caplog.text


def test_an_order_taken_by_a_session_that_died_before_its_fill_is_reported_after_its_down_event():
    with WsExchange(hold_fills=True) as exchange:  # the fill never comes: the exchange dies first
        with IOPortal(_classic(exchange.url), send_answered=_fill_of, connection_events=True,
                      restart=RestartPolicy()) as portal:
            _closing_orders(portal, exchange, 1)
            exchange.wait_for(lambda f: f["orders"] == ["o0"], WAIT_S, "the order written")
            exchange.kill()
            seen = _take(portal, lambda s: any(isinstance(e, SendFailed) for e in s), "the order reported")
            exchange.restart()
    failed = [e for e in seen if isinstance(e, SendFailed)]
    assert [(e.id, e.reason, e.source) for e in failed] == [("o0", "connection lost", "from_main")]
    down = next(e for e in _changes(seen) if not e.connected)
    assert seen.index(down) < seen.index(failed[0])  # after the down event
    assert portal.awaited_unanswered == {"connection lost": 1}


def test_an_answer_callable_and_an_id_awaited_twice_are_checked():
    with pytest.raises(TypeError, match=r"IOPortal\(send_answered=...\) takes a callable"):
        IOPortal(lambda a, b: None, send_answered="client_order_id")

    async def worker(to_main, from_main):
        await to_main.stopping.wait()

    with IOPortal(worker, send_answered=_fill_of) as portal:
        portal.from_main.put(order(0), id="o0")
        with pytest.raises(ValueError, match=r"put\(id='o0'\): an item put with that id awaits its answer already"):
            portal.from_main.put(order(0), id="o0")
        assert portal.awaiting == 1
    with IOPortal(worker) as portal:  # without send_answered an id names a deadline's item
        with pytest.raises(ValueError, match=r"give max_age_s too \(or give the portal send_answered="):
            portal.from_main.put("x", id="a")


# ---- a worker that cannot know of the stop, and one that hangs ------------------------------------------


def test_a_worker_that_never_looks_at_stopping_is_cancelled_at_once_not_after_its_share_of_the_stop():
    cancelled: list[float] = []

    async def classic(to_main, from_main):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(time.monotonic())
            raise

    portal = IOPortal(classic, stop_timeout_s=40 * UNIT_S).start()
    began = time.monotonic()
    portal.stop()
    assert cancelled and cancelled[0] - began < 30 * UNIT_S  # its share: 39 s of the 40 (the reserve: 1 s)


def test_a_hung_worker_s_items_stay_for_the_main_thread_after_the_stop_reports_it():
    async def hung(to_main, from_main):
        for i in range(3):
            to_main.put(i)
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # swallowed, every time

    portal = IOPortal(hung, stop_timeout_s=0.5).start()
    wait_until(lambda: portal.to_main.qsize() == 3, timeout_s=WAIT_S, what="three items")
    with pytest.raises(WorkerFailed, match=r"did not end within the stop's 0\.5s"):
        portal.stop()
    assert [portal.to_main.get_nowait() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(WorkerFailed, match=r"did not end within the stop's 0\.5s"):
        portal.to_main.get_nowait()


def test_a_worker_that_said_what_it_took_was_answered_is_not_reported():
    async def worker(to_main, from_main):
        while True:
            item = await from_main.get()
            to_main.put({"type": "fill", "client_order_id": item["client_order_id"]})

    with IOPortal(worker, send_answered=_fill_of) as portal:
        for i in range(3):
            portal.from_main.put(order(i), id=f"o{i}")
        got = [portal.to_main.get(timeout=WAIT_S) for _ in range(3)]
        wait_until(lambda: portal.awaiting == 0, timeout_s=WAIT_S, what="every answer noted")
    assert [json.dumps(g) for g in got] == [json.dumps({"type": "fill", "client_order_id": f"o{i}"})
                                            for i in range(3)]
    assert portal.awaited_unanswered == {} and portal.sent_failed == {}
