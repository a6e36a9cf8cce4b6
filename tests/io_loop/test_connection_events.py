"""Connection state as events (issue 55, item 2): with ``Controller(on_event=OnEvent(fn, connections=True))`` every
feed hands ``on_event`` a ``forkless.ConnectionEvent`` when its connection comes up or goes down, in
order with the source's other events, with the reason, the close code and the time; ``stats()`` and
/metrics show each feed's state and since when. Against real servers: the websockets exchange
(tests/ws_exchange.py: tokens that expire with 4003, killed and revived) for a user's ``Relogin``
source, the ``websockets`` feed server for the built-in WebSocket feed, nats-server for JetStream.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from forkless import EVENTS_ONLY, Config, ConnectionEvent, Controller, OnEvent, Relogin, SendFailed
from tests.harness import UNIT_S, drive
from tests.servers import FeedConn
from tests.ws_exchange import PASSWORD, USER, WsExchange, order

WAIT_S = 20 * UNIT_S


@pytest.fixture
def exchange() -> Iterator[WsExchange]:
    with WsExchange(trade_every_s=0.02, ping_every_s=0.2) as ex:
        yield ex


class ExchangeClient:
    """A trader's client of the exchange as a ``Source``: ``Relogin`` logs in for every connection, the
    heartbeat is answered here, each trade handed over as an event tagged with its connection."""

    name = "exchange"
    replies = "none"
    starts_connected = False  # Relogin says when it is connected

    def __init__(self, url: str) -> None:
        self.url = url

    async def run(self, ctx: Any) -> None:
        async with aiohttp.ClientSession() as http:
            async def connect(attempt: int) -> aiohttp.ClientWebSocketResponse:
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
                    elif event["type"] in ("trade", "fill"):
                        await ctx.emit_event({**event, "connection": link.connections})

            async with Relogin(connect, serve, ctx=ctx, name="exchange") as link:
                async for order in ctx.outgoing():  # the orders the main loop sends, until the stop
                    await link.send(order)


class AnsweredClient(ExchangeClient):
    """The same client, saying which order a fill answers: an order its session took to the grave is reported."""

    def send_answered(self, event: Any) -> Any:
        return event.get("client_order_id") if event.get("type") == "fill" else None


def _connection_events(events: list[Any]) -> list[ConnectionEvent]:
    return [e for e in events if isinstance(e, ConnectionEvent)]


def _metric(url: str, name: str, feed: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5 * UNIT_S) as answer:
        text = answer.read().decode()
    found = re.search(rf'^{name}{{feed="{feed}"}} (\S+)$', text, re.MULTILINE)
    assert found, f"{name} of feed {feed!r} is not in /metrics"
    return float(found.group(1))


def test_a_relogin_source_s_events_come_in_order_with_its_own_and_each_loss_names_its_close_code(exchange):
    events: list[Any] = []
    cfg = Config(metrics_addr="127.0.0.1:0", status_s=0.0, heartbeat_s=0.0, shutdown_timeout_s=5.0)
    with Controller(cfg, processor=EVENTS_ONLY, sources=[ExchangeClient(exchange.url)],
                    on_event=OnEvent(lambda source, event: events.append((source, event)), connections=True)) as ctl:
        got = [event for _, event in events]

        def trades_of(connection: int) -> int:
            return sum(1 for e in got if isinstance(e, dict) and e["connection"] == connection)

        def downs() -> list[ConnectionEvent]:
            return [e for e in _connection_events(got) if not e.connected]

        drive(ctl, lambda: (got.extend(e for _, e in events[len(got):]) or trades_of(1) >= 3), timeout_s=WAIT_S,
              what="trades on the first connection")
        exchange.expire_all()  # the exchange closes the session: 4003
        drive(ctl, lambda: (got.extend(e for _, e in events[len(got):]) or trades_of(2) >= 3), timeout_s=WAIT_S,
              what="trades on the second connection, after a fresh login")
        exchange.kill()  # no close frame: the connection is just gone
        drive(ctl, lambda: (got.extend(e for _, e in events[len(got):]) or len(downs()) == 2), timeout_s=WAIT_S,
              what="the loss of the second connection")
        lost = downs()[-1]
        feed = ctl.stats().feeds[0]  # down until the exchange is back: the books and /metrics say since when
        assert (feed.name, feed.io.connected, feed.io.state_since) == ("exchange", False, lost.at_s)
        assert _metric(ctl.metrics_url, "forkless_connected", "exchange") == 0
        assert _metric(ctl.metrics_url, "forkless_connection_state_since_timestamp_seconds", "exchange") == lost.at_s
        exchange.restart()
        drive(ctl, lambda: (got.extend(e for _, e in events[len(got):]) or trades_of(3) >= 1), timeout_s=WAIT_S,
              what="trades on the third connection, once the exchange is back")
        assert _metric(ctl.metrics_url, "forkless_connected", "exchange") == 1
        stats = ctl.stats()
    assert {source for source, _ in events} == {"exchange"}
    changes = _connection_events(got)
    assert [(e.connected, e.connection, e.code) for e in changes] == [
        (True, 1, None), (False, 1, 4003), (True, 2, None), (False, 2, 1006), (True, 3, None)]
    assert all(e.source == "exchange" for e in changes)
    assert all(e.reason == "" for e in changes if e.connected)
    assert all(e.reason.startswith("the connection ended") for e in changes if not e.connected)
    assert changes[1].reason == "the connection ended: closed by the peer (code 4003)"
    assert changes[3].reason.startswith("the connection ended: lost without a close frame (1006")  # killed: no frame
    assert [e.at_s for e in changes] == sorted(e.at_s for e in changes)
    # in order with the source's own events: each trade between its connection's up and down
    current = 0
    for event in got:
        if isinstance(event, ConnectionEvent):
            current = event.connection if event.connected else 0
        else:
            assert event["connection"] == current, f"trade of connection {event['connection']} seen at {current}"
    assert stats.events == len(got) and stats.events_unhandled == 0
    assert exchange.figures()["sessions"][:2] == [4003, 1006]


async def _three_lives(conn: FeedConn) -> None:
    """The feed server's script: the first connection closed with 4003, the second dropped without a
    close frame (the server killed), the third served until the client leaves."""
    if conn.index == 0:
        await conn.close(4003)
    elif conn.index == 1:
        conn.ws.transport.abort()
    else:
        await conn.read_until_closed(timeout=60 * UNIT_S)


def _feed_config(url: str) -> Config:
    return Config(ws_url=url, features=2, max_batch=4, warmup=0, status_s=0.0, heartbeat_s=0.0,
                  reconnect_min_s=0.05, reconnect_max_s=0.2, reconnect_reset_s=0.1, shutdown_timeout_s=5.0)


def test_the_websocket_feed_hands_connected_disconnected_with_the_close_code_then_connected_again(feed_server):
    server = feed_server(_three_lives, impl="websockets")
    events: list[tuple[str, Any]] = []
    with Controller(_feed_config(server.url),
                    on_event=OnEvent(lambda source, event: events.append((source, event)), connections=True)) as ctl:
        drive(ctl, lambda: len(events) == 5, timeout_s=WAIT_S, what="three connections and two losses")
        feed = ctl.stats().feeds[0].io
        assert feed.connected and feed.connects == 3 and feed.state_since == events[-1][1].at_s
    assert {source for source, _ in events} == {"0"}  # the one-feed shorthand's name
    changes = [event for _, event in events]
    assert [(e.connected, e.connection, e.code) for e in changes] == [
        (True, 1, None), (False, 1, 4003), (True, 2, None), (False, 2, 1006), (True, 3, None)]
    assert changes[1].reason == "closed by the server (code 4003)"
    assert ctl.stats().events == 5 and ctl.stats().events_unhandled == 0


def test_without_connection_events_nothing_is_handed_over_and_no_event_goes_unhandled(feed_server):
    server = feed_server(_three_lives, impl="websockets")
    with Controller(_feed_config(server.url)) as ctl:  # no on_event, and none asked for
        drive(ctl, lambda: ctl.stats().feeds[0].io.connects == 3, timeout_s=WAIT_S, what="three connections")
        stats = ctl.stats()
    assert stats.events_in == 0 and stats.events == 0 and stats.events_unhandled == 0


def test_connection_events_without_a_callable_to_hand_them_to_are_refused_naming_it():
    # connections=True is an option of the callback it hands them to: there is no asking for them without one
    with pytest.raises(TypeError, match=r"OnEvent\(fn\) takes a callable, fn\(source, event\); got None"):
        OnEvent(None, connections=True)
    with pytest.raises(TypeError, match=r"OnEvent\(connections=\.\.\.\) takes True or False, not 'yes'"):
        OnEvent(print, connections="yes")


def test_the_jetstream_feed_hands_its_connection_s_events_through_a_server_restart(nats_server):
    from tests.io_loop.connectors.jetstream.test_jetstream import _config, _js_feed
    from tests.natsserver import create_streams

    create_streams(nats_server.url)
    events: list[Any] = []
    with Controller(_config([_js_feed(nats_server.url)]),
                    on_event=OnEvent(lambda source, event: events.append((source, event)), connections=True)) as ctl:
        drive(ctl, lambda: len(events) == 1, timeout_s=WAIT_S, what="the first connection")
        nats_server.restart()
        drive(ctl, lambda: len(events) == 3, timeout_s=WAIT_S, what="the loss and the next connection")
    assert [(source, e.connected, e.connection) for source, e in events] == [
        ("ticks", True, 1), ("ticks", False, 1), ("ticks", True, 2)]
    assert events[1][1].reason and events[1][1].code is None  # NATS has no close code


def test_the_documents_example_stops_quoting_while_its_feed_is_down(feed_server):
    from tests.docs.test_readme import run_example

    async def script(conn: FeedConn) -> None:
        if conn.index == 0:
            await conn.close(4003)
        else:
            await conn.read_until_closed(timeout=60 * UNIT_S)

    server = feed_server(script, impl="websockets")
    proc = run_example("connection_events", server.url)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^up, down \(4003\), up \| quoting True, connected True since \d+ s, 2 connections$",
                     proc.stdout, re.MULTILINE), proc.stdout


def test_a_source_counted_connected_while_it_runs_says_so_at_its_start_and_end():
    class Once:
        name = "once"

        async def run(self, ctx: Any) -> None:
            await ctx.emit_event("hello")

    events: list[Any] = []
    with Controller(Config(status_s=0.0), processor=EVENTS_ONLY, sources=[Once()],
                    on_event=OnEvent(lambda source, event: events.append(event), connections=True)) as ctl:
        drive(ctl, lambda: len(events) == 3, timeout_s=WAIT_S, what="its start, its event and its end")
    assert [e if isinstance(e, str) else (e.connected, e.reason) for e in events] == [
        (True, ""), "hello", (False, "the source's run returned")]


def test_a_connection_killed_while_the_feed_writes_is_down_with_1006_as_one_killed_while_it_reads(feed_server):
    """The peer reads nothing (its TCP buffers fill, the feed's writer waits), then dies (no close
    frame): the writer finds it first, and its down event has the close code 1006 all the same."""
    kill = threading.Event()

    async def script(conn: FeedConn) -> None:
        if conn.index == 0:
            conn.stop_reading()
            while not kill.is_set():
                await asyncio.sleep(0.01)
            conn.request.transport.abort()  # killed with -9: no close frame
        else:
            await conn.read_until_closed(timeout=60 * UNIT_S)

    server = feed_server(script, compress=False)
    events: list[Any] = []
    sends = 4000  # 16 MB: more than the loopback's socket buffers hold
    config = _feed_config(server.url).replace(queue_size=2 * sends)  # every send queued at once
    with Controller(config, on_event=OnEvent(lambda s, e: events.append(e), connections=True)) as ctl:
        drive(ctl, lambda: len(events) == 1, timeout_s=WAIT_S, what="the first connection")
        for _ in range(sends):
            ctl.send("0", "x" * 4096)

        def stalled() -> bool:  # the feed's writer waits for the peer to read: nothing more is written
            now = ctl.stats().feeds[0].io.sent_out
            time.sleep(0.2)
            return ctl.stats().feeds[0].io.sent_out == now < sends
        drive(ctl, stalled, timeout_s=WAIT_S, what="the writes backed up")
        kill.set()
        drive(ctl, lambda: len(events) >= 2, timeout_s=WAIT_S, what="the connection lost")
    down = events[1]
    assert not down.connected and down.code == 1006, down
    assert "1006" in down.reason and "closed by the peer" not in down.reason and "by the server" not in down.reason


def test_orders_written_on_a_session_that_dies_before_their_fills_are_reported_after_its_down_event():
    """A source that declares ``send_answered``: each order written on the connection the exchange took to the
    grave (killed: its fills never come) reaches on_event as SendFailed, "connection lost", after the loss."""
    events: list[Any] = []
    cfg = Config(status_s=0.0, heartbeat_s=0.0, shutdown_timeout_s=5.0)
    with WsExchange(hold_fills=True) as exchange:  # never released: the fills die with the exchange
        with Controller(cfg, processor=EVENTS_ONLY, sources=[AnsweredClient(exchange.url)],
                        on_event=OnEvent(lambda source, event: events.append(event), connections=True)) as ctl:
            drive(ctl, lambda: _connection_events(events) != [], timeout_s=WAIT_S, what="the session up")
            for i in range(3):
                ctl.send("exchange", order(i), id=f"o{i}")
            exchange.wait_for(lambda f: len(f["orders"]) == 3, WAIT_S, "the three orders written")
            drive(ctl, lambda: ctl.stats().sent_out == 3, timeout_s=WAIT_S, what="the orders counted written")
            exchange.kill()
            drive(ctl, lambda: sum(isinstance(e, SendFailed) for e in events) == 3, timeout_s=WAIT_S,
                  what="the three orders reported")
            snap = ctl.stats()
            exchange.restart()
    failed = [e for e in events if isinstance(e, SendFailed)]
    assert [(e.id, e.reason, e.source) for e in failed] == [(f"o{i}", "connection lost", "exchange") for i in range(3)]
    down = next(e for e in _connection_events(events) if not e.connected)
    assert events.index(down) < events.index(failed[0]) and down.code == 1006
    assert snap.awaited_unanswered == {"connection lost": 3} and snap.sent_failed == {}
    assert json.loads(failed[0].frame)["client_order_id"] == "o0"  # the frame that was written
