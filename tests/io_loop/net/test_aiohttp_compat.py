"""io_loop/net/aiohttp_compat.py against a real aiohttp WebSocket server on 127.0.0.1.

These are the tests that fail when an aiohttp upgrade moves the private attributes the corked
write needs. The socket stays real; only a spy is put around the transport to count ``write``
calls (it passes every call through).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from forkless.io_loop.net import aiohttp_compat

LIMIT_S = 10.0  # bounds each test if something hangs; nothing waits this long when it works


class WriteSpy:
    """Passes everything through to the real transport, recording the data of each ``write``."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class Server:
    """A loopback WebSocket server that records the text of every frame it receives."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self._wanted = 0
        self._enough = asyncio.Event()

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            if msg.type is aiohttp.WSMsgType.TEXT:
                self.received.append(msg.data)
                if len(self.received) >= self._wanted:
                    self._enough.set()
        return ws

    async def wait_for(self, n: int) -> list[str]:
        self._wanted = n
        if len(self.received) < n:
            self._enough.clear()
            await self._enough.wait()
        return self.received


@asynccontextmanager
async def connected() -> AsyncIterator[tuple[Server, aiohttp.ClientWebSocketResponse]]:
    server = Server()
    app = web.Application()
    app.router.add_get("/feed", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as session, session.ws_connect(f"ws://127.0.0.1:{port}/feed") as ws:
            yield server, ws
    finally:
        await runner.cleanup()


def run(test: Callable[[Server, aiohttp.ClientWebSocketResponse], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        async with asyncio.timeout(LIMIT_S), connected() as (server, ws):
            return await test(server, ws)

    return asyncio.run(main())


def spy_on_transport(ws: aiohttp.ClientWebSocketResponse) -> WriteSpy:
    """Put a spy around the connection's real transport inside aiohttp's frame writer."""
    spy = WriteSpy(ws._writer.transport)
    ws._writer.transport = spy
    return spy


def test_nothing_the_patches_need_is_missing_from_the_installed_aiohttp():
    async def test(server: Server, ws: aiohttp.ClientWebSocketResponse) -> list[str]:
        return aiohttp_compat.aiohttp_missing(ws)

    assert run(test) == []


def test_frames_sent_while_corked_leave_in_one_write_and_arrive_in_order():
    async def test(server: Server, ws: aiohttp.ClientWebSocketResponse) -> tuple[Any, list[bytes], list[str]]:
        spy = spy_on_transport(ws)
        corked = aiohttp_compat.cork(ws)
        assert corked is not None
        corked.corked = True
        for text in ("one", "two", "three"):
            await ws.send_str(text)
        held_back = list(spy.writes)
        corked.uncork()
        received = await server.wait_for(3)
        return held_back, list(spy.writes), received  # a copy: closing the connection writes a close frame

    held_back, writes, received = run(test)
    assert held_back == []
    assert len(writes) == 1
    # three masked client frames of 3, 3 and 5 bytes: 2 header bytes and a 4-byte mask each
    assert len(writes[0]) == 3 * (2 + 4) + len("one") + len("two") + len("three")
    assert received == ["one", "two", "three"]


def test_uncorked_frames_are_written_one_by_one():
    # the baseline the cork improves on; if aiohttp ever gathered writes itself, this says so
    async def test(server: Server, ws: aiohttp.ClientWebSocketResponse) -> tuple[int, list[str]]:
        spy = spy_on_transport(ws)
        assert aiohttp_compat.cork(ws) is not None  # installed, but not corked: writes pass through
        for text in ("one", "two", "three"):
            await ws.send_str(text)
        received = await server.wait_for(3)
        return len(spy.writes), received

    writes, received = run(test)
    assert writes == 3
    assert received == ["one", "two", "three"]


def test_nothing_tls_over_a_unix_socket_needs_is_missing_from_the_installed_aiohttp():
    async def gaps() -> list[str]:
        connector = aiohttp_compat.UnixConnector(path="/nonexistent.sock")  # nothing connects until a request
        try:
            return aiohttp_compat.unix_tls_missing(connector)
        finally:
            await connector.close()

    assert asyncio.run(gaps()) == []


def test_aiohttp_s_failure_on_an_open_websocket_becomes_connection_lost_with_its_text():
    from forkless.io_loop.connectors.websocket.connect import ConnectionLost, mapped_aiohttp_errors

    async def test(server: Server, ws: aiohttp.ClientWebSocketResponse) -> BaseException:
        ws._writer.transport.close()  # the socket is gone under the open WebSocket
        try:
            with mapped_aiohttp_errors():
                await ws.send_str("after the close")
        except Exception as exc:
            return exc
        raise AssertionError("nothing was raised")

    exc = run(test)
    assert type(exc) is ConnectionLost and isinstance(exc.__cause__, aiohttp.ClientError)
    assert str(exc) == f"{type(exc.__cause__).__name__}: {exc.__cause__}"


def test_other_exceptions_pass_the_aiohttp_mapping_unmapped():
    import pytest

    from forkless.io_loop.connectors.websocket.connect import mapped_aiohttp_errors

    with pytest.raises(KeyError), mapped_aiohttp_errors():
        raise KeyError("a bug")
