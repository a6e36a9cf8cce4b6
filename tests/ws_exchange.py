"""A loopback exchange for tests: the protocol of bench/exchange.py (examples/exchange_session.py's
and the documents' one exchange), with a test's controls: tokens that expire, fills held, the
exchange killed and restarted.

- ``POST /login`` with ``{"user": "alice", "password": "s3cret"}`` -> 200, ``{"token": ...}`` (wrong:
  403). A token lives ``token_ttl_s`` (or until ``expire_all()``); at its end every session opened
  with it is closed with 4003 ("token expired") and ``GET /ws?token=`` with it is refused with 401.
- ``GET /ws?token=...``: the client's first frame must be ``{"type":"subscribe","symbols":[...]}``
  -> ``{"type":"subscribed"}``. Then a trade every ``trade_every_s`` (``seq`` global) and a
  ``{"type":"ping","id":n}`` every ``ping_every_s``, to be answered ``{"type":"pong","id":n}``
  before the next ping or the session is closed with 4001.
- ``{"type":"order","client_order_id":...}`` -> ``{"type":"fill","client_order_id":...,"session":k}``;
  with ``expire_after_orders=n`` every token expires right after the n-th order's fill; with
  ``hold_fills=True`` the fills wait until ``release_fills()`` (never, if it is not called).

- ``kill()``: the exchange dies as a killed process does: every session's TCP connection is
  aborted (no close frame: its client sees 1006) and the port stops listening (it refuses
  connections), tokens and all forgotten; ``restart()`` serves again on the same port
  (``restarted_at``: its ``time.monotonic()``), as the same exchange started again would.

Records, written on the server's loop under ``_lock`` and copied by ``figures()``: ``logins``,
``refused`` (401s), ``sessions`` (close code of each, None while open), ``orders`` (every
client_order_id received, in order, repeats kept), ``pongs``, ``violations``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import WSMsgType, web

from tests.servers import LoopThread

USER, PASSWORD = "alice", "s3cret"


def order(i: int) -> dict[str, Any]:
    """Order ``o{i}`` of the exchange's protocol (filled at once, on the session it came on)."""
    return {"type": "order", "symbol": "BTCUSDT", "side": "buy", "qty": "0.01", "client_order_id": f"o{i}"}


class WsExchange:
    def __init__(self, *, token_ttl_s: float = 3600.0, trade_every_s: float = 0.02, ping_every_s: float = 0.2,
                 expire_after_orders: int = 0, hold_fills: bool = False) -> None:
        self.token_ttl_s, self.trade_every_s, self.ping_every_s = token_ttl_s, trade_every_s, ping_every_s
        self.expire_after_orders = expire_after_orders  # > 0: every token expires once this many orders are filled
        self._released = asyncio.Event()  # hold_fills: set by release_fills() (on the server's loop)
        if not hold_fills:
            self._released.set()
        self._fills: set[asyncio.Task] = set()  # fills waiting for the release
        self._thread = LoopThread("ws-exchange")
        self._lock = threading.Lock()
        self._live: dict[str, float] = {}  # token -> when it expires (monotonic)
        self._tokens = itertools.count(1)
        self._seq = itertools.count(1)
        self._figures: dict[str, Any] = {"logins": 0, "refused": 0, "sessions": [], "orders": [], "pongs": 0,
                                         "violations": []}
        self.url = ""
        self._port = 0
        self._sessions: dict[web.WebSocketResponse, Any] = {}  # open sessions and their transports (kill())
        self._runner: web.AppRunner
        self.restarted_at = 0.0  # time.monotonic() of the last restart()

    def start(self) -> str:
        """Serve on a free port of 127.0.0.1; the base URL, ``http://127.0.0.1:PORT``."""
        self._thread.start()
        self._port = port = self._thread.call(self._serve(), 10.0)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def kill(self) -> None:
        """Die as a killed process: sessions aborted without a close frame, the port refusing connections."""
        self._thread.call(self._kill(), 10.0)

    def restart(self) -> None:
        """Serve again on the same port (after ``kill()``), with no token of before; ``restarted_at`` is now."""
        self._thread.call(self._serve(self._port), 10.0)
        self.restarted_at = time.monotonic()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._thread.call(self._close(), 10.0)
        self._thread.stop()

    def __enter__(self) -> WsExchange:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def expire_all(self) -> None:
        """Every token issued so far expires now: their sessions close with 4003, their handshakes get 401."""
        self._thread.call_soon(self._live.clear)

    def release_fills(self) -> None:
        """``hold_fills``: every fill held so far is sent now, and later ones at once."""
        self._thread.call_soon(self._released.set)

    def figures(self) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(self._figures)

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not predicate(figures := self.figures()):
            if time.monotonic() > deadline:
                raise AssertionError(f"the exchange did not see {what} within {timeout_s:.0f}s: {figures}")
            time.sleep(0.01)
        return figures

    # ---- the server's loop ------------------------------------------------------------------------

    async def _serve(self, port: int = 0) -> int:
        app = web.Application()
        app.router.add_post("/login", self._login)
        app.router.add_get("/ws", self._ws)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, reuse_address=True)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _kill(self) -> None:
        for transport in list(self._sessions.values()):
            if transport is not None:
                transport.abort()  # no close frame, as a killed process's sockets
        self._live.clear()
        await self._runner.cleanup()  # the port stops listening: connections are refused

    async def _close(self) -> None:
        for ws in list(self._sessions):
            await ws.close(code=1001, message=b"exchange stopping")
        await self._runner.cleanup()
        for task in list(self._fills):  # fills still held (never released): not left pending on a closed loop
            task.cancel()
        await asyncio.gather(*self._fills, return_exceptions=True)

    def _note(self, key: str, value: Any = 1) -> None:
        with self._lock:
            if isinstance(self._figures[key], list):
                self._figures[key].append(value)
            else:
                self._figures[key] += value

    async def _login(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "body must be JSON"}, status=400)
        if not isinstance(body, dict) or (body.get("user"), body.get("password")) != (USER, PASSWORD):
            return web.json_response({"error": "wrong user or password"}, status=403)
        token = f"t{next(self._tokens)}"
        self._live[token] = time.monotonic() + self.token_ttl_s
        self._note("logins")
        return web.json_response({"token": token})

    async def _ws(self, request: web.Request) -> web.StreamResponse:
        token = request.query.get("token", "")
        if self._live.get(token, 0.0) <= time.monotonic():
            self._note("refused")
            return web.json_response({"error": "token expired or unknown"}, status=401)
        ws = web.WebSocketResponse(autoping=True, compress=False, timeout=1.0)
        await ws.prepare(request)
        with self._lock:
            number = len(self._figures["sessions"])
            self._figures["sessions"].append(None)
        code = None
        self._sessions[ws] = request.transport  # kill() aborts it
        try:
            first = await ws.receive()
            frame = json.loads(first.data) if first.type is WSMsgType.TEXT else None
            if not isinstance(frame, dict) or frame.get("type") != "subscribe":
                if first.type is WSMsgType.TEXT:
                    self._note("violations", f"first frame {frame!r}")
                    code = 4000
            else:
                await ws.send_str(json.dumps({"type": "subscribed", "symbols": frame.get("symbols")}))
                code = await self._serve_session(ws, token, number)
            if code is not None and not ws.closed:
                await ws.close(code=code, message=b"see the code")
        except (ConnectionError, RuntimeError):  # the client went away mid-send
            pass
        finally:
            self._sessions.pop(ws, None)
            with self._lock:
                self._figures["sessions"][number] = code if code is not None else ws.close_code or 1006
        return ws

    async def _serve_session(self, ws: web.WebSocketResponse, token: str, number: int) -> int | None:
        """Trades, pings and fills until the token expires (4003), a ping goes unanswered (4001), or the
        client closes (None)."""
        answered = asyncio.Event()
        answered.set()
        reader = asyncio.create_task(self._read(ws, number, answered))
        try:
            next_ping = time.monotonic() + self.ping_every_s
            pings = itertools.count(1)
            while not reader.done():
                now = time.monotonic()
                if now >= self._live.get(token, 0.0):
                    self._live.pop(token, None)
                    return 4003
                if now >= next_ping:
                    if not answered.is_set():
                        return 4001
                    answered.clear()
                    next_ping = now + self.ping_every_s
                    await ws.send_str(json.dumps({"type": "ping", "id": next(pings)}))
                await ws.send_str(json.dumps({"type": "trade", "symbol": "BTCUSDT", "price": "37000.10",
                                              "seq": next(self._seq)}))
                await asyncio.wait([reader], timeout=self.trade_every_s)
            return reader.result()
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, ws: web.WebSocketResponse, number: int, answered: asyncio.Event) -> int | None:
        """The client's frames, until it closes (None) or an order expires the tokens (4003)."""
        async for msg in ws:
            if msg.type is not WSMsgType.TEXT:
                continue
            frame = json.loads(msg.data)
            if frame.get("type") == "pong":
                self._note("pongs")
                answered.set()
            elif frame.get("type") == "order":
                self._note("orders", frame.get("client_order_id"))
                fill = json.dumps({"type": "fill", "client_order_id": frame.get("client_order_id"), "session": number})
                if self._released.is_set():
                    await ws.send_str(fill)
                else:  # held: sent once released, while this session goes on reading
                    task = asyncio.create_task(self._fill_when_released(ws, fill))
                    self._fills.add(task)
                    task.add_done_callback(self._fills.discard)
                if len(self._figures["orders"]) == self.expire_after_orders:
                    self._live.clear()
                    return 4003  # the session closes now
            else:
                self._note("violations", frame)
        return None

    async def _fill_when_released(self, ws: web.WebSocketResponse, fill: str) -> None:
        await self._released.wait()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.send_str(fill)
