"""Sends with a deadline (io_loop/sends.py; issue 55 "What to build" 1, issue 54 items 5 and 6), through the
public API: a ``Controller`` main loop sending orders to a user's source that keeps its exchange session
up with ``Relogin``, against the loopback exchange on ``websockets`` (tests/ws_exchange.py) whose session
is ended under it. What is asserted is what reached the exchange (never a frame after its deadline),
what reached ``on_event`` (a ``SendFailed`` per send given up, with its id) and the books.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from forkless import EVENTS_ONLY, Config, Controller, Relogin, SendFailed
from forkless.controller.metrics import exposition
from tests.docs.test_readme import example
from tests.harness import UNIT_S, AppProcess, drive
from tests.ws_exchange import PASSWORD, USER, WsExchange, order

pytestmark = pytest.mark.timeout(90 * UNIT_S)

WAIT_S = 10 * UNIT_S


@pytest.fixture
def exchange() -> Iterator[WsExchange]:
    """The exchange of the tests here: trades every 50 ms, a ping every 0.2 s, tokens that live an hour."""
    with WsExchange(trade_every_s=0.05, ping_every_s=0.2) as ex:
        yield ex


class ExchangeSource:
    """A trader's client as a source: ``Relogin`` keeps the session up (fresh login each time), the
    main thread's orders go through ``link.send``; fills reach ``on_event``. ``gate`` cleared (from the
    test thread) holds every connection attempt: the exchange stays unreachable for the client."""

    name = "exchange"
    replies = "none"
    starts_connected = False

    def __init__(self, url: str, *, hold_s: float | None = 30.0, **declared: Any) -> None:
        self.url, self.hold_s = url, hold_s
        for key, value in declared.items():  # send_max_age_s, sends_while_disconnected
            setattr(self, key, value)
        self.gate = threading.Event()
        self.gate.set()
        self.not_written: list[SendFailed] = []  # what link.send raised (also reported to on_event)

    async def run(self, ctx: Any) -> None:
        async with aiohttp.ClientSession() as http:
            async def connect(attempt: int) -> aiohttp.ClientWebSocketResponse:
                while not self.gate.is_set():
                    await asyncio.sleep(0.01)
                async with http.post(f"{self.url}/login", json={"user": USER, "password": PASSWORD}) as resp:
                    resp.raise_for_status()
                    token = (await resp.json())["token"]
                ws = await http.ws_connect(self.url.replace("http", "ws", 1) + "/ws", params={"token": token})
                await ws.send_str(json.dumps({"type": "subscribe", "symbols": ["BTCUSDT"]}))
                return ws

            async def serve(ws: aiohttp.ClientWebSocketResponse) -> None:
                async for msg in ws:
                    event = json.loads(msg.data)
                    if event["type"] == "ping":
                        await ws.send_str(json.dumps({"type": "pong", "id": event["id"]}))
                    elif event["type"] == "fill" and not ctx.stopping.is_set():
                        await ctx.emit_event(event)

            async with Relogin(connect, serve, ctx=ctx, hold_s=self.hold_s) as link:
                async for frame in ctx.outgoing():
                    try:
                        await link.send(frame)
                    except SendFailed as exc:
                        self.not_written.append(exc)


class Events:
    def __init__(self) -> None:
        self.failed: list[tuple[float, SendFailed]] = []
        self.fills: list[str] = []

    def __call__(self, source: str, event: Any) -> None:
        if isinstance(event, SendFailed):
            self.failed.append((time.monotonic(), event))
        elif event["type"] == "fill":
            self.fills.append(event["client_order_id"])


def _config() -> Config:
    return Config(status_s=0.0, shutdown_timeout_s=5.0, connect_timeout_s=5.0)


def _connected(ctl: Controller) -> bool:
    return ctl.stats().feeds[0].io.connected


def _session_ended(ctl: Controller, source: ExchangeSource, exchange: WsExchange) -> None:
    """The exchange ends the session (its token expires) and the client cannot connect again."""
    source.gate.clear()
    exchange.expire_all()
    drive(ctl, lambda: not _connected(ctl), timeout_s=WAIT_S, what="the session's end")


def test_no_frame_is_written_after_its_deadline_and_each_expired_one_is_reported(exchange):
    source, events = ExchangeSource(exchange.url), Events()
    with Controller(_config(), sources=[source], on_event=events, processor=EVENTS_ONLY) as ctl:
        drive(ctl, lambda: _connected(ctl), timeout_s=WAIT_S, what="the first session")
        assert ctl.send("exchange", order(0), max_age_s=30.0) == 1  # the controller's count names a send
        drive(ctl, lambda: events.fills == ["o0"], timeout_s=WAIT_S, what="the first fill")
        _session_ended(ctl, source, exchange)
        # o1 is held by Relogin, o2 (no deadline) waits for the next session behind it, o3..o5 wait behind o2
        ids = [ctl.send("exchange", order(1), max_age_s=0.2, id="o1"), ctl.send("exchange", order(2), id="o2")]
        ids += [ctl.send("exchange", order(i), max_age_s=0.2, id=f"o{i}") for i in (3, 4, 5)]
        assert ids == ["o1", "o2", "o3", "o4", "o5"]
        drive(ctl, lambda: len(events.failed) == 4, timeout_s=WAIT_S, what="four sends given up")
        assert not _connected(ctl)  # each was given up while o2 still waited: none waited for what was before it
        source.gate.set()
        drive(ctl, lambda: events.fills == ["o0", "o2"], timeout_s=WAIT_S, what="o2 written on the new session")
        metrics = exposition(ctl.stats)()[0].decode()
    failed = [event for _, event in events.failed]
    assert sorted(event.id for event in failed) == ["o1", "o3", "o4", "o5"]
    assert {event.reason for event in failed} == {"deadline"} and {event.source for event in failed} == {"exchange"}
    assert {json.loads(event.frame)["client_order_id"] for event in failed} == {"o1", "o3", "o4", "o5"}
    assert exchange.figures()["orders"] == ["o0", "o2"]  # never written after their deadline, the others once
    assert [exc.id for exc in source.not_written] == ["o1"]  # the one Relogin held raised there too
    snap = ctl.stats()
    assert snap.sent_failed == {"deadline": 4} and snap.sent_out == 2 and snap.sent_unsent == 0
    assert 'forkless_sent_failed_total{feed="exchange",reason="deadline"} 4.0' in metrics


def test_eight_sends_held_together_each_fail_at_their_own_hold_s(exchange):
    hold_s = 1.0
    source, events = ExchangeSource(exchange.url, hold_s=hold_s), Events()
    with Controller(_config(), sources=[source], on_event=events, processor=EVENTS_ONLY) as ctl:
        drive(ctl, lambda: _connected(ctl), timeout_s=WAIT_S, what="the first session")
        _session_ended(ctl, source, exchange)
        sent_at = time.monotonic()
        for i in range(8):
            ctl.send("exchange", order(i))
        drive(ctl, lambda: len(events.failed) == 8, timeout_s=WAIT_S, what="eight sends given up")
        source.gate.set()
    times = [at for at, _ in events.failed]
    assert {event.reason for _, event in events.failed} == {"hold_s"}
    assert [event.id for _, event in events.failed] == list(range(1, 9))  # in the order they were sent
    assert min(times) - sent_at >= hold_s  # held the whole hold_s ...
    # ... and each at most its own: one after the other they would have taken 8 x hold_s
    assert max(times) - min(times) < hold_s, [round(t - sent_at, 3) for t in times]
    assert exchange.figures()["orders"] == [] and ctl.stats().sent_failed == {"hold_s": 8}


def test_sends_are_refused_at_once_while_disconnected_when_the_source_asks(exchange):
    source, events = ExchangeSource(exchange.url, sends_while_disconnected="refuse"), Events()
    with Controller(_config(), sources=[source], on_event=events, processor=EVENTS_ONLY) as ctl:
        drive(ctl, lambda: _connected(ctl), timeout_s=WAIT_S, what="the first session")
        _session_ended(ctl, source, exchange)
        for i in (1, 2, 3):  # hold_s is 30 s and no deadline: only the refusal ends them while the gate is shut
            ctl.send("exchange", order(i), id=f"o{i}")
        drive(ctl, lambda: len(events.failed) == 3, timeout_s=WAIT_S, what="three sends refused")
        assert not _connected(ctl)
        source.gate.set()
        drive(ctl, lambda: _connected(ctl), timeout_s=WAIT_S, what="the next session")
        ctl.send("exchange", order(4), id="o4")
        drive(ctl, lambda: events.fills == ["o4"], timeout_s=WAIT_S, what="o4 written once connected")
    assert [event.id for _, event in events.failed] == ["o1", "o2", "o3"]
    assert {event.reason for _, event in events.failed} == {"disconnected"}
    assert exchange.figures()["orders"] == ["o4"]
    assert ctl.stats().sent_failed == {"disconnected": 3} and ctl.stats().sent_out == 1


def test_a_source_s_send_max_age_s_is_the_deadline_of_a_send_without_one(exchange):
    source, events = ExchangeSource(exchange.url, send_max_age_s=0.2), Events()
    with Controller(_config(), sources=[source], on_event=events, processor=EVENTS_ONLY) as ctl:
        drive(ctl, lambda: _connected(ctl), timeout_s=WAIT_S, what="the first session")
        _session_ended(ctl, source, exchange)
        ctl.send("exchange", order(1), id="o1")  # the source's 0.2 s
        ctl.send("exchange", order(2), id="o2", max_age_s=60.0)  # its own, longer
        drive(ctl, lambda: len(events.failed) == 1, timeout_s=WAIT_S, what="o1 given up")
        source.gate.set()
        drive(ctl, lambda: events.fills == ["o2"], timeout_s=WAIT_S, what="o2 written")
    assert [event.id for _, event in events.failed] == ["o1"]
    assert exchange.figures()["orders"] == ["o2"]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"max_age_s": 0}, ValueError, r"send\(max_age_s=\) is a finite number of seconds > 0"),
    ({"max_age_s": -1.0}, ValueError, r"send\(max_age_s=\) is a finite number of seconds > 0"),
    ({"max_age_s": float("nan")}, ValueError, r"send\(max_age_s=\) is a finite number of seconds > 0"),
    ({"max_age_s": "0.5"}, TypeError, r"send\(max_age_s=\) is a number of seconds .* not a str"),
    ({"max_age_s": True}, TypeError, r"send\(max_age_s=\) is a number of seconds .* not a bool"),
])
def test_a_wrong_max_age_is_refused_naming_what_is_right(exchange, kwargs, error, match):
    with Controller(_config(), sources=[ExchangeSource(exchange.url)], processor=EVENTS_ONLY) as ctl:
        with pytest.raises(error, match=match):
            ctl.send("exchange", order(0), **kwargs)
        assert ctl.stats().sent_failed == {} and ctl.stats().sent_out == 0


@pytest.mark.parametrize(("declared", "error", "match"), [
    ({"send_max_age_s": -2}, ValueError, r"source 'exchange' has send_max_age_s=-2; expected a finite number of "
                                           r"seconds > 0"),
    ({"send_max_age_s": "1"}, TypeError, r"source 'exchange' has send_max_age_s='1'; expected a number of seconds"),
    ({"sends_while_disconnected": "drop"}, ValueError,
     r"source 'exchange' has sends_while_disconnected='drop'; expected 'hold' .* or 'refuse'"),
])
def test_a_source_s_wrong_send_policy_is_refused_when_the_controller_is_built(declared, error, match):
    with pytest.raises(error, match=match):
        Controller(_config(), sources=[ExchangeSource("http://127.0.0.1:9", **declared)], processor=EVENTS_ONLY)


def test_send_failed_takes_only_a_frame_the_main_thread_sent():
    seen: list[BaseException] = []

    class Misuses:
        name = "misuses"
        replies = "none"

        async def run(self, ctx: Any) -> None:
            for frame, reason in (("text of its own", "deadline"), (b"bytes", "x")):
                try:
                    ctx.send_failed(frame, reason)
                except TypeError as exc:
                    seen.append(exc)
            async for frame in ctx.outgoing():
                try:
                    ctx.send_failed(frame, "")
                except TypeError as exc:
                    seen.append(exc)
                ctx.send_failed(frame, "not wanted")
                ctx.send_failed(frame, "not wanted")  # once per frame: counted once

    events = Events()
    with Controller(_config(), sources=[Misuses()], on_event=events, processor=EVENTS_ONLY) as ctl:
        ctl.send("misuses", "an order", id="x1")
        drive(ctl, lambda: len(events.failed) == 1, timeout_s=WAIT_S, what="the report")
    assert [str(exc).split(";")[0] for exc in seen[:2]] == [
        "send_failed(frame) takes a frame ctx.outgoing() handed out that the main thread sent (Controller.send)"] * 2
    assert "reason is a non-empty str" in str(seen[2])
    assert events.failed[0][1].id == "x1" and events.failed[0][1].reason == "not wanted"
    snap = ctl.stats()
    assert snap.sent_failed == {"not wanted": 1} and snap.sent_out == 0 and snap.sent_unsent == 0


def test_the_deadlines_example_never_writes_an_order_late_and_reports_every_one_given_up(exchange):
    """The documents' example as a process, the exchange killed for 1.5 s and restarted mid-session: an
    order is filled, or given up at its deadline (never written), or written as the session died (no
    fill will come); never two of these."""
    app = AppProcess(env={"EXCHANGE_URL": exchange.url, "SESSION_S": "5"}, program=("-c", example("deadlines")))
    with app:
        exchange.wait_for(lambda seen: len(seen["orders"]) >= 5, 60 * UNIT_S, "orders before the kill")
        exchange.kill()
        time.sleep(1.5)  # the outage: orders sent now are held at most their 0.5 s, then given up
        exchange.restart()
        proc = app.finish(90 * UNIT_S)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    written = set(exchange.figures()["orders"])
    filled, given_up, sent = set(out["filled"]), set(out["given_up"]), out["sent"]
    assert given_up and filled and not given_up & written and filled <= written
    # each order written or reported, but for those the client wrote as the session died, which the killed
    # exchange never read: the tail of the first session's stream (every order before them read), sent
    # right before the first order given up in the outage
    lost = sorted(int(oid[1:]) for oid in set(sent) - written - given_up)
    if lost:
        assert lost == list(range(lost[0], lost[-1] + 1)), lost
        assert {f"o{i}" for i in range(lost[0])} <= written, lost
        assert lost[-1] + 1 == min(int(oid[1:]) for oid in given_up), (lost, sorted(given_up))
    assert out["sent_failed"] == {"deadline": len(given_up)}


def test_a_built_in_feed_never_writes_a_send_after_its_deadline(feed_server):
    """The same rule for the built-in WebSocket feed (its writer takes ``ctx.replies()`` batches): a send
    made while the feed cannot connect is given up at its deadline and never written on the next connection."""
    server, events = feed_server(), Events()
    config = Config(ws_url=server.url, status_s=0.0, shutdown_timeout_s=5.0, reconnect_min_s=0.05,
                    reconnect_max_s=0.2, heartbeat_s=0.0, features=4, max_batch=4, max_streams=64)  # a small compile
    with Controller(config, on_event=events) as ctl:
        drive(ctl, lambda: _connected(ctl), timeout_s=WAIT_S, what="the first connection")
        server.handshake_status = lambda attempt: 503  # every attempt refused (retried) until let in again
        server.drop()
        drive(ctl, lambda: not _connected(ctl), timeout_s=WAIT_S, what="the connection lost")
        assert ctl.send("0", "a late order", max_age_s=0.2, id="late") == "late"
        drive(ctl, lambda: len(events.failed) == 1, timeout_s=WAIT_S, what="the late order given up")
        assert not _connected(ctl)  # given up while the feed was down, at its own deadline
        server.handshake_status = None
        drive(ctl, lambda: _connected(ctl), timeout_s=WAIT_S, what="the connection after the refusals")
        ctl.send("0", "an order in time")
        server.wait_for(lambda: "an order in time" in server.received, WAIT_S, "the order in time")
    assert events.failed[0][1].id == "late" and events.failed[0][1].source == "0"
    assert "a late order" not in server.received
    assert ctl.stats().sent_failed == {"deadline": 1} and ctl.stats().sent_out == 1


def test_a_send_given_up_with_a_cause_reaches_on_event_with_it_as_its_cause():
    """``Relogin`` hands the ``FeedFatal`` of a link that gave up as the cause of each send it fails
    (``ctx.send_failed(frame, reason, cause=)``): the ``SendFailed`` on_event gets carries it."""
    from forkless.io_loop.counters import IOStats
    from forkless.io_loop.errors import FeedFatal
    from forkless.io_loop.sends import SendWatch, sent_frames

    handed: list[Any] = []
    watch = SendWatch(IOStats(), name="exchange", feed=0, held=None, events=handed.append)
    frame = sent_frames(["order"], "o1", None, 0.0)[0]
    fatal = FeedFatal("giving up: exchange: 3 failed attempts in a row")
    watch.report(frame, "gave up", fatal)
    [failed] = handed[0].items
    assert (failed.id, failed.reason, failed.frame) == ("o1", "gave up", "order") and failed.__cause__ is fatal
