"""The stop that delivers what is in flight (issue 44, item 3; docs/embedding/stop.md): a source
that declares ``awaiting()`` keeps handing its replies (fills) to ``on_event`` through the
orderly stop, until it awaits nothing or the stop's deadline; what it still awaited then is
counted (``awaited_unanswered``) and logged once.

The user's program here is a source of its own against a real ``websockets`` exchange on
loopback (tests/ws_exchange.py) whose fills are held until the stop has begun: every fill comes
after ``ctx.stopping`` is set, so none reaches the main loop unless the stop takes it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

import aiohttp
import pytest

from forkless import EVENTS_ONLY, Config, Controller, FeedFatal, SendFailed, SourceStopped
from tests.harness import UNIT_S, assert_books_balance, drive
from tests.ws_exchange import PASSWORD, USER, WsExchange

pytestmark = pytest.mark.timeout(90 * UNIT_S)

ORDERS = 10


def _config(**changes: Any) -> Config:
    base: dict[str, Any] = dict(features=4, max_batch=4, max_streams=16, max_wait_ms=1.0, heartbeat_s=0.0,
                                shutdown_timeout_s=30 * UNIT_S, status_s=0.0)
    base.update(changes)
    return Config(**base)


class Trader:
    """The user's client: logs in, subscribes, answers pings, writes the orders the main loop
    sends and hands trades and fills over. ``awaiting()``: orders written whose fill has not come."""

    name = "exchange"
    replies = "none"

    def __init__(self, url: str, stop_began: threading.Event, *, declares: bool = True) -> None:
        self.url = url
        self.stop_began = stop_began
        self.open: set[str] = set()
        self.refused_after_stop = 0  # emits the stop refused (SourceStopped)
        if declares:
            self.awaiting = lambda: len(self.open)

    async def before_stop(self, ctx: Any) -> None:
        self.stop_began.set()  # the exchange sends its fills from now on

    async def run(self, ctx: Any) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{self.url}/login", json={"user": USER, "password": PASSWORD}) as resp:
                token = (await resp.json())["token"]
            async with http.ws_connect(self.url.replace("http", "ws", 1) + "/ws", params={"token": token}) as ws:
                await ws.send_str(json.dumps({"type": "subscribe", "symbols": ["BTCUSDT"]}))
                reader = asyncio.create_task(self._read(ws, ctx))
                try:
                    async for frame in ctx.outgoing():  # ends once the main thread has sent its last frame
                        self.open.add(json.loads(frame)["client_order_id"])
                        await ws.send_str(frame.decode() if isinstance(frame, bytes) else frame)
                finally:
                    reader.cancel()
                    await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, ws: Any, ctx: Any) -> None:
        async for msg in ws:
            event = json.loads(msg.data)
            kind = event["type"]
            if kind == "ping":
                await ws.send_str(json.dumps({"type": "pong", "id": event["id"]}))
            elif kind == "fill" or (kind == "trade" and not ctx.stopping.is_set()):  # no new market data
                self.open.discard(event["client_order_id"]) if kind == "fill" else None
                try:
                    await ctx.emit_event(event)
                except SourceStopped:
                    self.refused_after_stop += 1


class Idle:
    """A second source that hands nothing over: with two, replies are routed through per-feed outboxes."""

    name = "idle"
    replies = "none"

    async def run(self, ctx: Any) -> None:
        async for _ in ctx.outgoing():
            pass


def _order(i: int) -> dict[str, Any]:
    return {"type": "order", "symbol": "BTCUSDT", "side": "buy", "qty": "0.01", "client_order_id": f"o{i}"}


def _trade_then_stop(exchange: WsExchange, trader: Trader, cfg: Config, **controller: Any) -> tuple[Controller, list]:
    """Connect, send ORDERS orders, stop at once; the events on_event got, in order."""
    events: list[dict[str, Any]] = []
    ctl = Controller(cfg, processor=EVENTS_ONLY, on_event=lambda source, event: events.append(event), **controller)
    with ctl:
        drive(ctl, lambda: any(e["type"] == "trade" for e in events), timeout_s=30 * UNIT_S, what="a first trade")
        for i in range(ORDERS):
            ctl.send("exchange", _order(i))
    return ctl, events


@pytest.mark.parametrize("sources", ["one source", "beside another source"])
def test_every_fill_of_orders_sent_just_before_the_stop_reaches_on_event_with_no_drain(sources: str) -> None:
    stop_began = threading.Event()
    exchange = WsExchange(hold_fills=True)
    url = exchange.start()
    trader = Trader(url, stop_began)
    releaser = threading.Thread(target=lambda: stop_began.wait(60 * UNIT_S) and exchange.release_fills())
    releaser.start()
    try:
        extra = [Idle()] if sources != "one source" else []
        ctl, events = _trade_then_stop(exchange, trader, _config(), sources=[trader, *extra])
    finally:
        stop_began.set()
        releaser.join()
        exchange.stop()
    fills = [e["client_order_id"] for e in events if e["type"] == "fill"]
    # each, once; in the order the exchange wrote them (its held fills are sent by a task each: any order)
    assert sorted(fills, key=lambda oid: int(oid[1:])) == [f"o{i}" for i in range(ORDERS)], \
        f"fills that reached on_event: {fills}"
    assert trader.refused_after_stop == 0 and trader.open == set()
    snap = ctl.stats()
    assert snap.awaited_unanswered == {}
    assert snap.events_in == snap.events == len(events) and snap.events_unhandled == 0
    assert snap.sent_out == ORDERS and snap.sent_unsent == 0
    assert_books_balance(ctl)


def test_a_stop_whose_fills_never_come_ends_at_its_deadline_with_what_was_awaited_counted_and_logged(caplog):
    exchange = WsExchange(hold_fills=True)  # never released
    url = exchange.start()
    trader = Trader(url, threading.Event())
    try:
        with caplog.at_level(logging.WARNING, logger="forkless"):
            ctl, events = _trade_then_stop(exchange, trader, _config(shutdown_timeout_s=2 * UNIT_S),
                                           sources=[trader])
        orders = exchange.figures()["orders"]
    finally:
        exchange.stop()
    assert orders == [f"o{i}" for i in range(ORDERS)], "every order was written"
    assert not any(e["type"] == "fill" for e in events)
    snap = ctl.stats()
    assert snap.awaited_unanswered == {"stop deadline": ORDERS}
    assert snap.feeds[0].io.awaited_unanswered == {"stop deadline": ORDERS}
    logged = [r.getMessage() for r in caplog.records if "awaited_unanswered" in r.getMessage()]
    assert len(logged) == 1 and f"{ORDERS} replies" in logged[0] and "'exchange'" in logged[0], logged
    assert not ctl.abandoned_io
    assert_books_balance(ctl)


def test_fills_that_came_but_were_not_delivered_before_the_main_loop_s_deadline_are_counted_and_logged(caplog):
    import time

    stop_began = threading.Event()
    exchange = WsExchange(hold_fills=True)
    url = exchange.start()
    trader = Trader(url, stop_began)
    releaser = threading.Thread(target=lambda: stop_began.wait(60 * UNIT_S) and exchange.release_fills())
    releaser.start()
    fills: list[str] = []

    def on_event(source: str, event: dict[str, Any]) -> None:
        if event["type"] == "fill":
            fills.append(event["client_order_id"])
            time.sleep(0.5)  # a slow handler: 10 fills outlast the stop's 1.5 s of work

    cfg = _config(shutdown_timeout_s=2.0)
    try:
        with caplog.at_level(logging.WARNING, logger="forkless"):
            with Controller(cfg, processor=EVENTS_ONLY, sources=[trader], on_event=on_event) as ctl:
                drive(ctl, lambda: exchange.figures()["sessions"] != [], timeout_s=30 * UNIT_S, what="a session")
                for i in range(ORDERS):
                    ctl.send("exchange", _order(i))
                exchange.wait_for(lambda f: len(f["orders"]) == ORDERS, 30 * UNIT_S, "every order")
    finally:
        stop_began.set()
        releaser.join()
        exchange.stop()
    snap = ctl.stats()
    assert snap.awaited_unanswered == {}, "every fill came: the source awaited none at the end"
    assert 0 < len(fills) < ORDERS
    assert snap.events_unhandled == ORDERS - len(fills) and snap.events_in == snap.events + snap.events_unhandled
    logged = [r.getMessage() for r in caplog.records if "not delivered to on_event" in r.getMessage()]
    assert logged == [f"{ORDERS - len(fills)} events were not delivered to on_event before the stop deadline: "
                      "counted in events_unhandled"]
    assert_books_balance(ctl)


class EndsWithItsSession(Trader):
    """Its ``run`` returns once the exchange ends its session; ``before_stop`` expires every token
    (the exchange closes the session with 4003), so it ends while it still awaits its fills."""

    def __init__(self, url: str, exchange: WsExchange) -> None:
        super().__init__(url, threading.Event())
        self.exchange = exchange

    async def before_stop(self, ctx: Any) -> None:
        self.exchange.expire_all()

    async def run(self, ctx: Any) -> None:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{self.url}/login", json={"user": USER, "password": PASSWORD}) as resp:
                token = (await resp.json())["token"]
            async with http.ws_connect(self.url.replace("http", "ws", 1) + "/ws", params={"token": token}) as ws:
                await ws.send_str(json.dumps({"type": "subscribe", "symbols": ["BTCUSDT"]}))

                async def write() -> None:
                    async for frame in ctx.outgoing():
                        self.open.add(json.loads(frame)["client_order_id"])
                        await ws.send_str(frame)

                writer = asyncio.create_task(write())
                await self._read(ws, ctx)  # until the exchange closes the session
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)


def test_a_source_whose_run_ends_while_it_awaits_replies_ends_the_wait_with_them_counted(caplog):
    exchange = WsExchange(hold_fills=True)  # never released
    url = exchange.start()
    source = EndsWithItsSession(url, exchange)
    events: list[dict[str, Any]] = []
    cfg = _config()
    try:
        with caplog.at_level(logging.WARNING, logger="forkless"):
            ctl = Controller(cfg, processor=EVENTS_ONLY, sources=[source], on_event=lambda s, e: events.append(e))
            with ctl:
                drive(ctl, lambda: bool(events), timeout_s=30 * UNIT_S, what="a first trade")
                for i in range(ORDERS):
                    ctl.send("exchange", _order(i))
                exchange.wait_for(lambda f: len(f["orders"]) == ORDERS, 30 * UNIT_S, "every order")
        sessions = exchange.figures()["sessions"]
    finally:
        exchange.stop()
    assert sessions == [4003]
    snap = ctl.stats()
    assert snap.awaited_unanswered == {"source ended": ORDERS}
    logged = [r.getMessage() for r in caplog.records if "awaited_unanswered" in r.getMessage()]
    assert len(logged) == 1 and "before its run ended" in logged[0], logged
    assert_books_balance(ctl)


class AwaitingFails(Trader):
    def __init__(self, url: str, result: Any) -> None:
        super().__init__(url, threading.Event(), declares=False)  # its own awaiting() below
        self.result = result

    def awaiting(self) -> Any:
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.mark.parametrize("result, says", [
    (KeyError("o3"), "KeyError: 'o3'"),
    (-1, "ValueError: awaiting\\(\\) returned -1: it says how many replies the source still awaits, an int >= 0"),
    ("2", "ValueError: awaiting\\(\\) returned '2': it says how many replies the source still awaits"),
    (True, "ValueError: awaiting\\(\\) returned True: "),
])
def test_an_awaiting_that_raises_or_says_no_count_fails_the_source_and_the_stop_does_not_wait_it_out(result, says):
    import time

    exchange = WsExchange(hold_fills=True)
    url = exchange.start()
    source = AwaitingFails(url, result)
    cfg = _config()
    try:
        began = [0.0]
        with pytest.raises(FeedFatal, match=f"source 'exchange' failed in awaiting\\(\\): {says}") as info:
            ctl = Controller(cfg, processor=EVENTS_ONLY, sources=[source], on_event=lambda s, e: None)
            with ctl:
                drive(ctl, lambda: exchange.figures()["sessions"] != [], timeout_s=30 * UNIT_S, what="a session")
                ctl.send("exchange", _order(0))
                began[0] = time.monotonic()
        stopped_s = time.monotonic() - began[0]
    finally:
        exchange.stop()
    if isinstance(result, Exception):
        assert info.value.__cause__ is result
    assert stopped_s < cfg.shutdown_timeout_s / 2, f"the stop took {stopped_s:.1f}s: it waited for its deadline"
    assert_books_balance(ctl)


def test_an_awaiting_that_is_not_callable_is_refused_when_the_controller_is_built() -> None:
    class Declares:
        name = "exchange"
        awaiting = 3

        async def run(self, ctx: Any) -> None: ...

    with pytest.raises(TypeError, match="source 'exchange' declares awaiting = 3: a method, awaiting\\(\\)"):
        Controller(_config(), processor=EVENTS_ONLY, sources=[Declares()])


def test_a_source_that_declares_nothing_has_its_emits_refused_from_the_stop_on_as_before() -> None:
    stop_began = threading.Event()
    exchange = WsExchange(hold_fills=True)
    url = exchange.start()
    trader = Trader(url, stop_began, declares=False)
    releaser = threading.Thread(target=lambda: stop_began.wait(60 * UNIT_S) and exchange.release_fills())
    releaser.start()
    try:
        ctl, events = _trade_then_stop(exchange, trader, _config(), sources=[trader])
    finally:
        stop_began.set()
        releaser.join()
        exchange.stop()
    assert not any(e["type"] == "fill" for e in events)
    assert ctl.stats().awaited_unanswered == {}
    assert_books_balance(ctl)


class AnsweredTrader(Trader):
    """The trader without ``awaiting()``, saying instead which order a fill answers: the stop awaits the fills
    of the orders it wrote all the same (the source's books count them: io_loop/source.py)."""

    def __init__(self, url: str, stop_began: threading.Event) -> None:
        super().__init__(url, stop_began, declares=False)

    def send_answered(self, event: Any) -> Any:
        return event.get("client_order_id") if event.get("type") == "fill" else None


@pytest.mark.parametrize("released", [True, False], ids=["fills come", "fills never come"])
def test_a_source_that_says_what_a_fill_answers_gets_every_fill_through_the_stop_or_each_one_reported(released):
    stop_began = threading.Event()
    exchange = WsExchange(hold_fills=True)
    url = exchange.start()
    trader = AnsweredTrader(url, stop_began)
    releaser = threading.Thread(target=lambda: stop_began.wait(60 * UNIT_S) and released and exchange.release_fills())
    releaser.start()
    events: list[Any] = []
    cfg = _config(shutdown_timeout_s=(30 if released else 2) * UNIT_S)
    try:
        with Controller(cfg, processor=EVENTS_ONLY, sources=[trader], on_event=lambda s, e: events.append(e)) as ctl:
            drive(ctl, lambda: any(isinstance(e, dict) and e["type"] == "trade" for e in events), timeout_s=30 * UNIT_S,
                  what="a first trade")
            for i in range(ORDERS):
                ctl.send("exchange", _order(i), id=f"o{i}")
    finally:
        stop_began.set()
        releaser.join()
        exchange.stop()
    fills = sorted(int(e["client_order_id"][1:]) for e in events if isinstance(e, dict) and e["type"] == "fill")
    failed = sorted(int(e.id[1:]) for e in events if isinstance(e, SendFailed))
    snap = ctl.stats()
    if released:
        assert fills == list(range(ORDERS)) and failed == [] and snap.awaited_unanswered == {}
    else:  # counted by the stop's reason, and each one reported: handed to on_event, or, the main loop's deadline
        # come (the phase ran to it), counted as not delivered
        assert fills == [] and snap.awaited_unanswered == {"stop deadline": ORDERS}
        assert {e.reason for e in events if isinstance(e, SendFailed)} <= {"stop deadline"}
        assert len(failed) + snap.events_unhandled == ORDERS, (failed, snap.events_unhandled)
    assert_books_balance(ctl)
