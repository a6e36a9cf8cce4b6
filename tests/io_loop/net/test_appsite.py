"""io_loop/net/appsite.py: an aiohttp application served on TCP or a unix-domain socket and closed,
the metrics server's and the demo feed's one way, against real sockets on this host."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import tempfile

import aiohttp
import pytest
from aiohttp import web

from forkless.io_loop.net.appsite import serve_app
from tests.harness import UNIT_S

LIMIT_S = 10.0 * UNIT_S  # bounds each test if something hangs; nothing waits this long when it works


def _app() -> web.Application:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/hello", hello)
    return app


def test_a_tcp_site_answers_on_the_port_it_reports_and_refuses_once_closed() -> None:
    async def main() -> None:
        async with asyncio.timeout(LIMIT_S):
            served = await serve_app(_app(), host="127.0.0.1", port=0, shutdown_timeout_s=0.5)
            assert served.port > 0
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{served.port}/hello") as response:
                    assert await response.text() == "hello"
                await served.close()
                await served.close()  # idempotent
                with pytest.raises(aiohttp.ClientConnectorError):
                    await session.get(f"http://127.0.0.1:{served.port}/hello")

    asyncio.run(main())


def test_a_unix_site_answers_through_its_socket_and_its_file_is_gone_once_closed() -> None:
    async def main(path: str) -> None:
        async with asyncio.timeout(LIMIT_S):
            served = await serve_app(_app(), unix_socket=path, shutdown_timeout_s=0.5)
            assert served.port == 0 and os.path.exists(path)
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as session:
                async with session.get("http://localhost/hello") as response:
                    assert await response.text() == "hello"
            await served.close()
            assert not os.path.exists(path)

    with tempfile.TemporaryDirectory() as folder:
        asyncio.run(main(os.path.join(folder, "site.sock")))


def test_a_unix_site_never_takes_a_live_server_s_socket_and_leaves_it_alone() -> None:
    async def main(path: str) -> None:
        async with asyncio.timeout(LIMIT_S):
            with pytest.raises(OSError) as failed:
                await serve_app(_app(), unix_socket=path, shutdown_timeout_s=0.5)
            assert failed.value.errno == errno.EADDRINUSE

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "taken.sock")
        live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            live.bind(path)
            live.listen(1)
            asyncio.run(main(path))
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.connect(path)  # still the live server's
            probe.close()
        finally:
            live.close()
