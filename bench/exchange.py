"""A toy crypto exchange for the exchange-session benchmark (issue 29): HTTP login, a WebSocket
of trades, books and pings, and orders that fill at once.

    python -m bench.exchange --port 0 [--print-port] [--rate 500] [--token-ttl S]
        [--quiet-every S --quiet-for S] [--summary PATH] [--record PATH]

Prints ``listening on http://127.0.0.1:PORT`` once it listens; SIGTERM or Ctrl-C stops it and
writes the counters as JSON to ``--summary`` (and ``seq price`` per trade sent to ``--record``).
In-process (tests): ``Exchange(...).start()`` returns the URL and serves on a thread of its own;
``counters()``, ``wait_for(predicate)``, ``sent_prices()``, ``stop()``; ``kill()`` is the exchange
dying (every connection dropped without a close frame: a client sees 1006; the port stops
listening; its tokens forgotten) and ``restart()`` serves again on the same port.

The protocol, exactly (anything else a client sends is a violation, counted by kind and logged):
- ``POST /login`` ``{"user": "alice", "password": "s3cret"}`` -> ``{"token": ...}``; wrong -> 403.
  A token lives ``token_ttl_s``; at its end the session is closed with 4003 and
  ``GET /ws?token=`` with it gets 401.
- ``GET /ws?token=...``: the client's first frame must be ``{"type":"subscribe","symbols":[...]}``
  -> ``{"type":"subscribed","symbols":[...]}``. Then, for the subscribed symbols: trades at about
  ``rate``/s in all (``seq`` global, +1 a trade; prices are decimal strings of 1 to 10 decimals,
  trailing zeros kept), a 5-level book per symbol each second; always a ``{"type":"ping","id":n}``
  every ``ping_every_s``, to be answered ``{"type":"pong","id":n}`` within ``pong_within_s`` or the
  connection is closed with 4001.
- ``{"type":"order","symbol","side":"buy"|"sell","qty","client_order_id"}`` -> a ``fill`` at the
  symbol's last trade price at once, or a ``reject`` with a ``reason``.
- Quiet market: no trades for ``quiet_for_s`` at the end of every ``quiet_every_s`` (from start);
  books and pings go on.

All counters are written on the exchange's loop, under ``_cond``; readers copy under it.

Rules:
- One exchange a process (or a thread, in tests); its counters are written on its loop only, under
  ``_cond``, and readers copy them under it.
- What a client may send is exactly the protocol above: anything else is a violation, counted by kind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import random
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web

log = logging.getLogger("bench.exchange")

USER, PASSWORD = "alice", "s3cret"
SYMBOLS = ("BTCUSDT", "ETHUSDT", "SOLUSDT", "XRPUSDT")
START_PRICES = {"BTCUSDT": 37000, "ETHUSDT": 2000, "SOLUSDT": 60, "XRPUSDT": 0.6}
UNIT = 10**10  # prices are kept as integers of 1e-10
TRADE_TICK_S = 0.01
BOOK_EVERY_S = 1.0
CLOSE_WAIT_S = 2.0


def decimal_text(units: int, decimals: int) -> str:
    """``units`` (of 1e-10) rounded down to ``decimals`` (1..10) places, trailing zeros kept."""
    step = 10 ** (10 - decimals)
    units -= units % step
    return f"{units // UNIT}.{(units % UNIT) // step:0{decimals}d}"


def order_problem(obj: dict[str, Any]) -> str | None:
    """Why an order frame is rejected; None for a good one."""
    if obj.get("symbol") not in SYMBOLS:
        return f"symbol must be one of {', '.join(SYMBOLS)}"
    if obj.get("side") not in ("buy", "sell"):
        return "side must be buy or sell"
    if not isinstance(obj.get("client_order_id"), str) or not obj["client_order_id"]:
        return "client_order_id must be a non-empty string"
    try:
        qty = Decimal(obj["qty"]) if isinstance(obj.get("qty"), str) else None
    except InvalidOperation:
        qty = None
    if qty is None or not qty.is_finite() or qty <= 0:
        return "qty must be a positive decimal string"
    return None


class Exchange:
    """The exchange's state and counters; ``start()`` serves it on its own thread and loop,
    ``serve()`` on the caller's loop (the CLI)."""

    def __init__(self, *, rate: float = 500.0, token_ttl_s: float = 1e9, quiet_every_s: float = 0.0,
                 quiet_for_s: float = 0.0, ping_every_s: float = 2.0, pong_within_s: float = 1.0,
                 record: bool = False, seed: int = 0) -> None:
        self.rate, self.token_ttl_s = rate, token_ttl_s
        self.quiet_every_s, self.quiet_for_s = quiet_every_s, quiet_for_s
        self.ping_every_s, self.pong_within_s = ping_every_s, pong_within_s
        self.record = record
        self.url = ""
        self._rng = random.Random(seed)
        self._price = {s: int(START_PRICES[s] * UNIT) for s in SYMBOLS}
        self._last_text = {s: decimal_text(self._price[s], 2) for s in SYMBOLS}
        self._seq = 0
        self._tokens: dict[str, float] = {}  # token -> when it expires (loop time)
        self._sent: dict[int, str] = {}  # seq -> price text, if record
        self._sessions: set[_Session] = set()
        self._cond = threading.Condition()
        self._counters: dict[str, Any] = {
            "logins": 0, "logins_refused": 0, "ws_refused_401": 0, "connections": 0,
            "closes": {"4001": 0, "4003": 0}, "pongs_on_time": 0, "pongs_late": 0, "pings_missed": 0,
            "orders": 0, "fills": 0, "rejects": 0, "violations": {}, "trades_sent": 0, "books_sent": 0}
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    # ---- counters (written on the loop; read from anywhere) ------------------------------------

    def count(self, key: str, sub: str | None = None, n: int = 1) -> None:
        with self._cond:
            if sub is None:
                self._counters[key] += n
            else:
                self._counters[key][sub] = self._counters[key].get(sub, 0) + n
            self._cond.notify_all()

    def counters(self) -> dict[str, Any]:
        """A copy of every counter."""
        with self._cond:
            return copy.deepcopy(self._counters)

    def sent_prices(self) -> dict[int, str]:
        """``seq -> price text`` of every trade sent (``record=True`` only)."""
        with self._cond:
            return dict(self._sent)

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, what: str) -> dict[str, Any]:
        """Wait until ``predicate(counters)`` holds (checked at every change); the counters then."""
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self._counters), timeout_s):
                raise AssertionError(f"not within {timeout_s:.1f}s: {what} (counters {self._counters})")
            return copy.deepcopy(self._counters)

    def violation(self, kind: str, frame: Any) -> None:
        log.warning("violation %s: %.200r", kind, frame)
        self.count("violations", kind)

    # ---- the market -------------------------------------------------------------------------------

    def quiet(self, now: float) -> bool:
        every = self.quiet_every_s
        return every > 0 and (now - self._t0) % every >= every - self.quiet_for_s

    def trade(self, symbol: str) -> dict[str, Any]:
        rng = self._rng
        units = self._price[symbol]
        units = max(UNIT // 10**6, units + int(rng.gauss(0.0, units * 2e-4)))
        self._price[symbol] = units
        text = decimal_text(units, rng.randint(1, 10))
        self._last_text[symbol] = text
        self._seq += 1
        if self.record:
            with self._cond:
                self._sent[self._seq] = text
        qty = decimal_text(rng.randrange(UNIT // 1000, 5 * UNIT), rng.randint(1, 8))
        return {"type": "trade", "symbol": symbol, "price": text, "qty": qty, "ts": int(time.time() * 1000),
                "seq": self._seq}

    def book(self, symbol: str) -> dict[str, Any]:
        rng, mid = self._rng, self._price[symbol]
        spread = max(1, mid // 10**4)
        levels = [(mid - k * spread, mid + k * spread) for k in range(1, 6)]

        def qty() -> str:
            return decimal_text(rng.randrange(UNIT // 100, 20 * UNIT), rng.randint(1, 6))

        return {"type": "book", "symbol": symbol,
                "bids": [[decimal_text(b, rng.randint(2, 8)), qty()] for b, _ in levels],
                "asks": [[decimal_text(a, rng.randint(2, 8)), qty()] for _, a in levels]}

    def order(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.count("orders")
        reason = order_problem(obj)
        if reason is not None:
            self.count("rejects")
            return {"type": "reject", "client_order_id": obj.get("client_order_id"), "reason": reason}
        self.count("fills")
        return {"type": "fill", "client_order_id": obj["client_order_id"], "symbol": obj["symbol"],
                "side": obj["side"], "qty": obj["qty"], "price": self._last_text[obj["symbol"]]}

    # ---- HTTP -------------------------------------------------------------------------------------

    async def _login(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "body must be JSON"}, status=400)
        if not isinstance(body, dict) or body.get("user") != USER or body.get("password") != PASSWORD:
            self.count("logins_refused")
            return web.json_response({"error": "wrong user or password"}, status=403)
        token = secrets.token_hex(16)
        self._tokens[token] = asyncio.get_running_loop().time() + self.token_ttl_s
        self.count("logins")
        return web.json_response({"token": token})

    async def _ws(self, request: web.Request) -> web.StreamResponse:
        expires_at = self._tokens.get(request.query.get("token", ""))
        if expires_at is None or expires_at <= asyncio.get_running_loop().time():
            self.count("ws_refused_401")
            return web.json_response({"error": "token unknown or expired"}, status=401)
        ws = web.WebSocketResponse(autoping=True, compress=False, timeout=CLOSE_WAIT_S)
        await ws.prepare(request)
        self.count("connections")
        session = _Session(self, ws, expires_at)
        session.transport = request.transport  # kill() drops it as a dying process would: no close frame
        self._sessions.add(session)
        try:
            await session.run()
        finally:
            self._sessions.discard(session)
        return ws

    # ---- serving ----------------------------------------------------------------------------------

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on the running loop; returns ``http://host:port``. ``aclose()`` to stop."""
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        app = web.Application()
        app.router.add_post("/login", self._login)
        app.router.add_get("/ws", self._ws)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{host}:{port}"
        return self.url

    async def aclose(self) -> None:
        for session in list(self._sessions):
            session.close(1001, "exchange stopping")
        if self._runner is not None:
            await self._runner.cleanup()

    async def _kill(self) -> None:
        for session in list(self._sessions):
            if session.transport is not None:
                session.transport.abort()
        self._tokens.clear()
        if self._runner is not None:
            await self._runner.cleanup()

    def kill(self) -> None:
        """The exchange dies (see the module docstring); ``restart()`` serves again on the same port."""
        assert self._loop is not None, "kill() an exchange started with start()"
        asyncio.run_coroutine_threadsafe(self._kill(), self._loop).result(10.0)

    def restart(self) -> None:
        """Serve again, on the same port, after ``kill()``."""
        assert self._loop is not None, "restart() an exchange started with start()"
        port = int(self.url.rsplit(":", 1)[1])
        asyncio.run_coroutine_threadsafe(self.serve(port=port), self._loop).result(10.0)

    def start(self) -> str:
        """Serve on a thread and loop of its own; returns the URL. ``stop()`` after."""
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="exchange", daemon=True)
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self.serve(), loop).result(10.0)

    def stop(self) -> None:
        """Close every session and stop serving; callable more than once."""
        loop, self._loop = self._loop, None
        if loop is None or self._thread is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.aclose(), loop).result(10.0)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            loop.close()


class _Session:
    """One WebSocket: its reader, and the tasks that feed it; ``close(code)`` ends it once."""

    def __init__(self, ex: Exchange, ws: web.WebSocketResponse, expires_at: float) -> None:
        self.ex, self.ws, self.expires_at = ex, ws, expires_at
        self.symbols: list[str] | None = None
        self.pings: dict[int, float] = {}  # outstanding ping id -> when sent
        self.missed: set[int] = set()
        self.code: int | None = None
        self.closing: asyncio.Future[Any] | None = None
        self.tasks: list[asyncio.Task[Any]] = []
        self.transport: asyncio.BaseTransport | None = None  # set by the exchange: kill() aborts it

    async def send(self, obj: dict[str, Any]) -> None:
        if self.code is None and not self.ws.closed:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.ws.send_str(json.dumps(obj))

    def close(self, code: int, why: str) -> None:
        if self.code is None:
            self.code = code
            self.closing = asyncio.ensure_future(self.ws.close(code=code, message=why.encode()))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.tasks = [asyncio.create_task(self._pinger()),
                      asyncio.create_task(self._expire(self.expires_at - loop.time()))]
        try:
            async for msg in self.ws:
                if msg.type is WSMsgType.TEXT:
                    await self._frame(msg.data)
                else:
                    self.ex.violation("binary", msg.data)
        finally:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            if self.closing is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.closing, CLOSE_WAIT_S)
            self.ex.count("closes", str(self.code if self.code is not None else self.ws.close_code or 1006))

    async def _frame(self, data: str) -> None:
        ex = self.ex
        try:
            obj = json.loads(data)
        except ValueError:
            obj = None
        kind = obj.get("type") if isinstance(obj, dict) else None
        if not isinstance(kind, str):
            return ex.violation("not_json_object", data)
        ping_id = obj.get("id") if isinstance(obj.get("id"), int) else None
        if kind == "pong" and ping_id in self.pings:
            late = asyncio.get_running_loop().time() - self.pings.pop(ping_id) > ex.pong_within_s
            ex.count("pongs_late" if late else "pongs_on_time")
        elif kind == "pong" and ping_id in self.missed:
            ex.count("pongs_late")
        elif self.symbols is None:
            symbols = obj.get("symbols")
            if kind != "subscribe":
                return ex.violation("before_subscribe", data)
            if not isinstance(symbols, list) or not symbols or not all(s in SYMBOLS for s in symbols):
                return ex.violation("bad_subscribe", data)
            self.symbols = list(dict.fromkeys(symbols))
            await self.send({"type": "subscribed", "symbols": self.symbols})
            self.tasks += [asyncio.create_task(self._trades()), asyncio.create_task(self._books())]
        elif kind == "order":
            await self.send(ex.order(obj))
        elif kind == "subscribe":
            ex.violation("subscribe_again", data)
        else:
            ex.violation("pong_unexpected" if kind == "pong" else f"type:{kind[:32]}", data)

    async def _pinger(self) -> None:
        loop, n = asyncio.get_running_loop(), 0
        while True:
            await asyncio.sleep(self.ex.ping_every_s)
            n += 1
            self.pings[n] = loop.time()
            await self.send({"type": "ping", "id": n})
            loop.call_later(self.ex.pong_within_s, self._pong_due, n)

    def _pong_due(self, n: int) -> None:
        if self.pings.pop(n, None) is not None and self.code is None:
            self.missed.add(n)
            self.ex.count("pings_missed")
            self.close(4001, f"no pong for ping {n}")

    async def _expire(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self.close(4003, "token expired")

    async def _trades(self) -> None:
        ex, loop = self.ex, asyncio.get_running_loop()
        assert self.symbols is not None
        due, owed = loop.time(), 0.0
        while True:
            due += TRADE_TICK_S
            now = loop.time()
            if due < now - 1.0:  # far behind (a loaded machine): do not burst to catch up
                due = now
            await asyncio.sleep(max(0.0, due - now))
            if ex.quiet(loop.time()):
                owed = 0.0
                continue
            owed += ex.rate * TRADE_TICK_S
            n, owed = int(owed), owed - int(owed)
            for _ in range(n):
                await self.send(ex.trade(ex._rng.choice(self.symbols)))
            ex.count("trades_sent", n=n)

    async def _books(self) -> None:
        assert self.symbols is not None
        while True:
            await asyncio.sleep(BOOK_EVERY_S)
            for symbol in self.symbols:
                await self.send(self.ex.book(symbol))
            self.ex.count("books_sent", n=len(self.symbols))


async def _main(a: argparse.Namespace) -> None:
    ex = Exchange(rate=a.rate, token_ttl_s=a.token_ttl, quiet_every_s=a.quiet_every, quiet_for_s=a.quiet_for,
                  ping_every_s=a.ping_every, pong_within_s=a.pong_within, record=bool(a.record), seed=a.seed)
    url = await ex.serve(a.host, a.port)
    if a.print_port:
        print(url.rsplit(":", 1)[1], flush=True)
    print(f"listening on {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await ex.aclose()
    if a.summary:
        Path(a.summary).write_text(json.dumps(ex.counters(), indent=1) + "\n", encoding="utf-8")
    if a.record:
        Path(a.record).write_text("".join(f"{s} {p}\n" for s, p in ex.sent_prices().items()), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.exchange", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--print-port", action="store_true", help="first print the bare port on a line of its own")
    p.add_argument("--rate", type=float, default=500.0, help="trades per second, all symbols together")
    p.add_argument("--token-ttl", type=float, default=1e9, help="seconds a login token lives")
    p.add_argument("--quiet-every", type=float, default=0.0, help="a quiet market every S seconds (0: never)")
    p.add_argument("--quiet-for", type=float, default=0.0, help="... lasting S seconds")
    p.add_argument("--ping-every", type=float, default=2.0)
    p.add_argument("--pong-within", type=float, default=1.0)
    p.add_argument("--summary", help="write the counters as JSON here when stopped")
    p.add_argument("--record", help="write 'seq price' per trade sent here when stopped")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="exchange: %(message)s")
    asyncio.run(_main(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
