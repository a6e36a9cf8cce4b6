"""A real aiohttp WebSocket feed on 127.0.0.1 (free port), in its own thread and loop.

The server sends a scripted list of frames to each connection (optionally in steps) and
records every reply, decoded. Used by the pipeline tests; bounded in time by the callers.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

from aiohttp import WSMsgType, web


class FeedServer:
    def __init__(self, frames: list[str | bytes] | None = None, *, gap_s: float = 0.0) -> None:
        self.frames = list(frames or [])
        self.gap_s = gap_s
        self.replies: list[dict[str, Any]] = []
        self.raw_replies: list[str] = []
        self.close_codes: list[int | None] = []
        self.connections = 0
        self._open: set[web.WebSocketResponse] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._run, name="test-feed", daemon=True)
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self.url = ""

    def __enter__(self) -> FeedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> str:
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("test feed did not start")
        return self.url

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def drop_clients(self) -> None:
        """Close every open connection from the server side (code 1012, service restart)."""
        assert self._loop is not None
        fut = asyncio.run_coroutine_threadsafe(self._drop(), self._loop)
        fut.result(10)

    async def _drop(self) -> None:
        for ws in list(self._open):
            await ws.close(code=1012, message=b"restart")

    def wait_replies(self, n: int, timeout: float = 20.0, raw: bool = False) -> list[Any]:
        got = self.raw_replies if raw else self.replies
        end = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < end:
            time.sleep(0.01)
        return list(got)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_get("/", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"ws://127.0.0.1:{port}/"
        self._started.set()
        await self._stop.wait()
        await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.connections += 1
        self._open.add(ws)
        sender = asyncio.create_task(self._send(ws))
        async for msg in ws:
            if msg.type is WSMsgType.TEXT:
                self.raw_replies.append(msg.data)
                try:
                    self.replies.append(json.loads(msg.data))
                except ValueError:  # a test speaking another protocol reads raw_replies
                    pass
        self._open.discard(ws)
        self.close_codes.append(ws.close_code)
        sender.cancel()
        return ws

    async def _send(self, ws: web.WebSocketResponse) -> None:
        for frame in self.frames:
            if isinstance(frame, bytes):
                await ws.send_bytes(frame)
            else:
                await ws.send_str(frame)
            if self.gap_s:
                await asyncio.sleep(self.gap_s)
