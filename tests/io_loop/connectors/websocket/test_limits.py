"""Limits at the edges of the protocol, against real loopback servers: redirects are not
followed to where the credentials would leak, the largest frame is what the README says,
one frame's error replies are bounded, and a peer that never answers pings is dropped
within the documented bound."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest
from aiohttp import web
from websockets.asyncio.server import serve

from forkless import Config, Controller, Runtime
from forkless.controller.codec import FOLDED_REASON, MAX_ERROR_REPLIES, JsonCodec
from forkless.io_loop.crossing import Chunk
from forkless.io_loop.errors import FeedFatal
from tests.fake_io import FakeIO, drain
from tests.harness import UNIT_S, drive
from tests.reference import EWMAReference

WAIT_S = 30.0


class Loop:
    """A background event loop for the test's servers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> Loop:
        self.thread.start()
        return self

    def run(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


async def _ws_serve(handler, **kwargs):
    """A ``websockets`` server on 127.0.0.1 (made inside the running loop, as it must be)."""
    return await serve(handler, "127.0.0.1", 0, **kwargs)


async def _aiohttp_feed(handler) -> tuple[web.AppRunner, str]:
    """An aiohttp server on 127.0.0.1 answering /feed with ``handler``; (runner, ws URL)."""
    app = web.Application()
    app.router.add_get("/feed", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"ws://127.0.0.1:{runner.addresses[0][1]}/feed"


async def _redirector(target: str) -> tuple[web.AppRunner, str]:
    async def handle(request: web.Request) -> web.Response:
        raise web.HTTPFound(target)

    return await _aiohttp_feed(handle)


def test_a_redirect_to_another_origin_is_refused_and_no_header_reaches_it():
    seen_headers: list[dict] = []

    async def record(connection, request):
        seen_headers.append(dict(request.headers))

    async def echo(ws):
        async for _ in ws:
            pass

    with Loop() as bg:
        target_server = bg.run(_ws_serve(echo, process_request=record))
        port = target_server.sockets[0].getsockname()[1]
        runner, url = bg.run(_redirector(f"ws://127.0.0.1:{port}/elsewhere?sig=abc"))
        try:
            cfg = Config(ws_url=url, features=2, headers=(("X-Api-Key", "k3y"),), status_s=0, reconnect_min_s=0.1)
            ctl = Controller(cfg)
            with pytest.raises(FeedFatal) as err:
                with ctl:
                    end = time.monotonic() + WAIT_S
                    while time.monotonic() < end:
                        ctl.process_pending(timeout=0.05)
        finally:
            bg.run(runner.cleanup())
            target_server.close()
            bg.run(target_server.wait_closed())
    assert seen_headers == []
    text = str(err.value)
    assert f"refused the WebSocket handshake with HTTP 302 (a redirect to ws://127.0.0.1:{port}/elsewhere, " in text
    assert "not followed" in text and "sig=abc" not in text and "k3y" not in text


def test_a_redirect_to_a_malformed_url_is_refused_naming_it_not_a_crash():
    from forkless.io_loop.connectors.websocket.connect import HandshakeRefused, new_session, open_feed

    async def handle(request: web.Request) -> web.Response:  # web.HTTPFound would refuse the Location itself
        return web.Response(status=302, headers={"Location": "ws://[::1/elsewhere?sig=abc"})

    async def main() -> str:
        runner, url = await _aiohttp_feed(handle)
        try:
            async with new_session() as session:
                with pytest.raises(HandshakeRefused) as err:
                    io = Config(ws_url=url).io_settings()
                    await open_feed(session, url, None, headers={}, timeouts=io.timeouts,
                                    max_msg_bytes=io.limits.max_msg_bytes)
        finally:
            await runner.cleanup()
        assert err.value.fatal
        return str(err.value)

    text = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert "HTTP 302 (a redirect to ws://[::1/elsewhere, not followed" in text and "sig=abc" not in text


@pytest.mark.parametrize(("extra", "accepted"), [(0, True), (1, False)])
def test_a_frame_of_exactly_max_msg_bytes_is_accepted_and_one_more_byte_is_not(extra, accepted):
    limit = 512
    body = json.dumps({"seq": 1, "stream": "s", "x": [1.0, 2.0]})
    frame = body[:-1] + " " * (limit - len(body) + extra) + "}"
    assert len(frame.encode()) == limit + extra
    replies: list[str] = []
    closes: list[int] = []

    async def handler(ws):
        await ws.send(frame)
        try:
            async for reply in ws:
                replies.append(reply)
        finally:
            closes.append(ws.close_code)

    with Loop() as bg:
        server = bg.run(_ws_serve(handler))
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/feed"
        cfg = Config(ws_url=url, features=2, max_msg_bytes=limit, status_s=0, reconnect_min_s=5)
        with Controller(cfg) as ctl:
            end = time.monotonic() + WAIT_S
            while not (replies or closes) and time.monotonic() < end:
                ctl.process_pending(timeout=0.05)
            stats = ctl.stats()
        server.close()
        bg.run(server.wait_closed())
    if accepted:
        assert [json.loads(r)["seq"] for r in replies] == [1] and stats.errors == {}
    else:
        assert replies == [] and closes[0] == 1009 and stats.errors == {"frame too large": 1}


def test_error_replies_for_one_frame_are_bounded_and_every_bad_element_is_counted():
    decoded = JsonCodec(2).decode(json.dumps([1] * 9_999 + [{"seq": 1, "stream": "s", "x": [0, 0]}]))
    assert len(decoded) == 1 and len(decoded.errors) == MAX_ERROR_REPLIES
    assert decoded.errors[-1] == (f"{9_999 - MAX_ERROR_REPLIES + 1} more bad elements in this frame "
                                  "(the first: not an object)", None)
    assert dict(decoded.error_counts()) == {"not an object": 1, FOLDED_REASON: 9_999 - MAX_ERROR_REPLIES + 1}
    assert sum(n for _, n in decoded.error_counts()) == 9_999


def test_a_20_kb_frame_of_bad_elements_gets_a_bounded_reply_over_a_real_connection():
    frame = json.dumps([0] * 10_000)
    replies: list[str] = []

    async def handler(ws):
        await ws.send(frame)
        async for reply in ws:
            replies.append(reply)

    with Loop() as bg:
        server = bg.run(_ws_serve(handler))
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/feed"
        with Controller(Config(ws_url=url, features=2, status_s=0)) as ctl:
            end = time.monotonic() + WAIT_S
            while len(replies) < MAX_ERROR_REPLIES and time.monotonic() < end:
                ctl.process_pending(timeout=0.05)
            ctl.process_pending(timeout=0.2)
            stats = ctl.stats()
        server.close()
        bg.run(server.wait_closed())
    assert len(replies) == MAX_ERROR_REPLIES
    assert sum(len(r) for r in replies) < len(frame)  # output O(input), no amplification
    assert stats.errors_total == 10_000 and stats.errors_out == MAX_ERROR_REPLIES


def test_a_peer_that_never_answers_pings_is_dropped_within_one_and_a_half_heartbeats():
    heartbeat = 0.6
    opened: list[float] = []
    closed: list[float] = []

    async def silent(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(autoping=False)  # reads pings, never answers them
        await ws.prepare(request)
        opened.append(time.monotonic())
        async for _ in ws:
            pass
        closed.append(time.monotonic())
        return ws

    with Loop() as bg:
        runner, url = bg.run(_aiohttp_feed(silent))
        cfg = Config(ws_url=url, features=2, heartbeat_s=heartbeat, status_s=0, reconnect_min_s=5)
        with Controller(cfg) as ctl:
            end = time.monotonic() + WAIT_S
            while not ctl.stats().reconnects and time.monotonic() < end:
                ctl.process_pending(timeout=0.02)
            dropped_at = time.monotonic()
            assert ctl.stats().reconnects == 1, ctl.stats()
        bg.run(runner.cleanup())
    # the bound the README states: a ping after HEARTBEAT_S of silence, the pong awaited half
    # as long (timers of 5 s or more are rounded up to whole seconds by aiohttp)
    assert dropped_at - opened[0] >= heartbeat * 1.5
    assert dropped_at - opened[0] < heartbeat * 1.5 + 1.0


def test_numbers_that_would_poison_a_stream_are_refused_and_the_stream_stays_alive():
    rng = np.random.default_rng(5)
    normal = lambda: rng.normal(size=8).round(4).tolist()
    xs = [normal() for _ in range(25)] + [[3e38] * 8, [-3e38] * 8, [1e20] * 8, [-1e20] * 8]
    xs += [normal() for _ in range(30)] + [[40.0] * 8] + [normal() for _ in range(5)]
    frames = [json.dumps({"seq": i, "stream": "s", "x": x}) for i, x in enumerate(xs)]
    replies: list[str] = []

    async def handler(ws):
        for frame in frames:
            await ws.send(frame)
        async for reply in ws:
            replies.append(reply)

    with Loop() as bg:
        server = bg.run(_ws_serve(handler))
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/feed"
        with Controller(Config(ws_url=url, features=8, status_s=0)) as ctl:
            end = time.monotonic() + WAIT_S
            while len(replies) < len(frames) and time.monotonic() < end:
                ctl.process_pending(timeout=0.05)
            stats = ctl.stats()
        server.close()
        bg.run(server.wait_closed())
    by_seq = {json.loads(r)["seq"]: json.loads(r) for r in replies}
    assert [by_seq[i]["error"] for i in range(25, 29)] == ["x must be finite and within ±1e18"] * 4
    ref = EWMAReference()
    for i, x in enumerate(xs):
        if 25 <= i < 29:
            continue
        _z, score, anomaly = ref("s", x)
        assert np.isfinite(by_seq[i]["score"]), i
        np.testing.assert_allclose(by_seq[i]["score"], score, rtol=1e-4, atol=1e-4, err_msg=str(i))
        assert by_seq[i]["anomaly"] == anomaly
    assert by_seq[59]["anomaly"] is True  # the stream can still flag an anomaly
    assert stats.errors == {"x must be finite and within ±1e18": 4} and stats.resets == {}


def test_the_largest_accepted_values_keep_the_default_detector_finite():
    xs = [[1e18] * 8, [-1e18] * 8, [1e18] * 8] + [[float(i % 3)] * 8 for i in range(20)]
    fake = FakeIO()
    cfg = Config(features=8, max_batch=4, max_streams=4, max_wait_ms=0.0, status_s=0.0)
    with Controller(cfg, runtime=Runtime(io_factory=fake)) as ctl:
        for i, x in enumerate(xs):
            fake.inbound.put_nowait(Chunk([i], ["s"], np.array([x], np.float32), 0))
        while ctl.process_pending():
            pass
        replies = [json.loads(f) for item in drain(fake.outbound) for f in item.frames]
        stats = ctl.stats()
    ref = EWMAReference()
    for x, reply in zip(xs, replies):
        _z, score, _ = ref("s", x)
        assert "error" not in reply and np.isfinite(reply["z"]).all()
        np.testing.assert_allclose(reply["score"], score, rtol=1e-4)
    assert stats.resets == {} and stats.errors == {}


def test_a_feed_that_dies_mid_stream_loses_nothing_from_the_books_and_hides_no_loss():
    """The feed's TCP connection is reset (as when its process is killed -9) while replies are
    flowing; after the reconnect the books balance, and every reply the server never read is
    among those counted as ``written_unconfirmed`` (written to a connection that ended without
    the closing handshake): no loss is hidden, none is claimed."""
    received: list[int] = []
    first = [json.dumps({"seq": i, "stream": f"s{i % 7}", "x": [float(i % 5), 1.0]}) for i in range(3000)]
    second = [json.dumps({"seq": 10_000 + i, "stream": "s0", "x": [1.0, 2.0]}) for i in range(20)]
    connections: list[int] = []

    async def handle(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        connections.append(len(connections))
        if len(connections) == 1:
            for frame in first:
                await ws.send_str(frame)
            got = 0
            async for msg in ws:
                received.append(json.loads(msg.data)["seq"])
                got += 1
                if got == 500:  # replies still flowing: the peer dies without a close frame
                    request.transport.abort()
                    break
            return ws
        for frame in second:
            await ws.send_str(frame)
        async for msg in ws:
            received.append(json.loads(msg.data)["seq"])
        return ws

    with Loop() as bg:
        runner, url = bg.run(_aiohttp_feed(handle))
        cfg = Config(ws_url=url, features=2, status_s=0, reconnect_min_s=0.1, heartbeat_s=0)
        with Controller(cfg) as ctl:
            end = time.monotonic() + WAIT_S
            while sum(s >= 10_000 for s in received) < len(second) and time.monotonic() < end:
                ctl.process_pending(timeout=0.05)
        stats = ctl.stats()
        bg.run(runner.cleanup())
    assert len(connections) == 2 and sum(s >= 10_000 for s in received) == len(second)
    assert stats.unanswered == 0
    assert stats.messages_in == stats.messages_out + stats.answer_errors_out + stats.no_reply + stats.dropped_total
    never_arrived = stats.messages_out - len(received)
    assert never_arrived >= 0
    assert stats.written_unconfirmed >= never_arrived, (stats.written_unconfirmed, never_arrived)


@pytest.mark.parametrize("answers_pings", [True, False], ids=["server answers pings", "server never answers"])
def test_written_unconfirmed_counts_only_the_replies_written_after_the_servers_last_pong(feed_server, answers_pings):
    """The client pings while replies are unconfirmed, and the server's pong confirms every reply written
    before the ping: a connection that then dies without a closing handshake counts only the replies after
    it as ``written_unconfirmed``, not the connection's whole lifetime. Deterministic: after the pong the server
    sends one more message, so its reply (read after the pong) is the one reply unconfirmed."""
    burst = 40

    async def script(conn) -> None:
        if conn.index:
            await conn.read_until_closed(timeout=60 * UNIT_S)
            return
        conn.answer_pings = answers_pings
        for seq in range(burst):
            await conn.send({"seq": seq, "stream": f"s{seq % 3}", "x": [1.0, 2.0]})
        for _ in range(burst):
            assert await conn.recv(timeout=30 * UNIT_S) is not None
        pinged, deadline = conn.pings, time.monotonic() + 30 * UNIT_S
        while conn.pings == pinged:  # every reply read: the client's next ping confirms them all
            assert time.monotonic() < deadline, "no ping from the client"
            assert await conn.recv(timeout=0.05) is None, "no frame expected"  # reads (and answers) pings
        await conn.send({"seq": burst, "stream": "s0", "x": [1.0, 2.0]})
        assert await conn.recv(timeout=30 * UNIT_S) is not None
        conn.request.transport.abort()  # the server dies: no closing handshake

    server = feed_server(script, autoping=False)
    cfg = Config(ws_url=server.url, features=2, status_s=0, heartbeat_s=0, reconnect_min_s=5)
    with Controller(cfg) as ctl:
        drive(ctl, lambda: ctl.stats().reconnects >= 1, timeout_s=60 * UNIT_S, what="the connection lost")
        stats = ctl.stats()
    assert stats.messages_out == burst + 1
    assert stats.written_unconfirmed == (1 if answers_pings else burst + 1)
