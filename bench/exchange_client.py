"""The exchange user's program (issue 29): one worker and one main loop, shared by the baseline
designs, which differ only in how the two are handed their queues.

- ``DataClientWorker`` (the IO side, no JAX): logs in over HTTP (aiohttp), opens the WebSocket
  with the token, subscribes, answers every ping itself, forwards trades, books, fills and
  rejects to the main loop, each stamped ``time.monotonic_ns()`` on arrival, and sends the
  orders the main loop decides. On a 4003 close or a 401 it logs in again and reconnects. It
  waits for the main loop's ``GO`` before it logs in (so nothing piles up while JAX compiles),
  and stops at a ``None``.
- ``run_main`` (the main thread): a tick every ``TICK_S``; between ticks it waits on the
  inbound queue with a timeout up to the next tick (never a blind sleep), so a fill is seen
  when it arrives. It keeps the last ``WINDOW`` prices per symbol (floats for the model, the
  exact text for ``--prices``), runs one jitted z-score over the windows each tick, orders
  when ``|z| > Z_THRESHOLD`` (at most one a symbol every ``MODEL_ORDER_GAP_S``), and, with
  ``--force-order-every S``, a small order every S whatever the market does.

Measured: each order's round trip (decided in the main loop -> its fill seen there), split by
whether trades were flowing when it was decided (``quiet``: none seen for ``QUIET_GAP_S``); each
trade's arrival on the worker -> its pickup in the main loop (monotonic is system-wide on Linux,
so this holds across the spawn child too); CPU seconds of the process tree over the loop's run.

Both queues carry ``(kind, payload, arrival_ns)`` inbound and order dicts outbound; anything
with ``put`` and ``get(timeout=)`` fits (``queue.Queue``, ``multiprocessing`` queues). This
module's top level imports no JAX: the spawn child imports it.

Rules:
- The top level imports no JAX (the spawn child imports this module); ``run_main`` imports it.
- The worker and the main loop share only their two queues; every stamp is ``time.monotonic_ns()``.
- The main loop never sleeps blindly: it waits on the inbound queue up to the next tick.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import queue
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil

SYMBOLS = ("BTCUSDT", "ETHUSDT", "SOLUSDT", "XRPUSDT")
USER, PASSWORD = "alice", "s3cret"
WINDOW = 64
TICK_S = 0.1
Z_THRESHOLD = 2.5
MIN_PRICES = 16  # no model order on a window shorter than this
MODEL_ORDER_GAP_S = 1.0
QUIET_GAP_S = 0.3
ORDER_GET_S = 0.5  # how long the worker's order pump blocks on the queue before checking again
RECONNECT_S = 0.2
GO = "go"


# ---- the worker: the IO side ----------------------------------------------------------------


class DataClientWorker:
    """The user's async client. ``run()`` is the thread's or the child's target."""

    def __init__(self, url: str, to_main: Any, from_main: Any, symbols: tuple[str, ...] = SYMBOLS) -> None:
        self.url = url.rstrip("/")
        self.to_main, self.from_main, self.symbols = to_main, from_main, symbols
        self.token: str | None = None
        self.figures: dict[str, Any] = {"logins": 0, "connects": 0, "refused_401": 0, "closes": {},
                                        "pongs": 0, "orders_sent": 0, "errors": 0}

    def run(self) -> None:
        asyncio.run(self.main())

    async def main(self) -> None:
        import aiohttp  # here: the main loop's process need not load it when the worker runs elsewhere

        self._go, self._stop = asyncio.Event(), asyncio.Event()
        self._orders: deque[dict[str, Any]] = deque()
        self._have_orders = asyncio.Event()
        pump = asyncio.create_task(self._pump())
        try:
            await self._go.wait()
            async with aiohttp.ClientSession() as session:
                while not self._stop.is_set():
                    try:
                        await self._connection(session, aiohttp)
                    except (aiohttp.ClientError, OSError, ValueError, KeyError) as exc:
                        self.figures["errors"] += 1
                        self.to_main.put(("error", repr(exc), time.monotonic_ns()))
                        await self._wait_stop(RECONNECT_S)
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
            self.figures["jax_imported"] = "jax" in sys.modules
            self.figures["pid"] = os.getpid()
            self.to_main.put(("end", self.figures, time.monotonic_ns()))

    async def _wait_stop(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), seconds)
        except TimeoutError:
            pass

    async def _pump(self) -> None:
        # orders from the main loop: a blocking get in the default executor, as a user writes it
        loop = asyncio.get_running_loop()

        def get() -> Any:
            try:
                return self.from_main.get(timeout=ORDER_GET_S)
            except queue.Empty:
                return queue.Empty

        while True:
            item = await loop.run_in_executor(None, get)
            if item is None:
                self._stop.set()
                self._go.set()
                return
            if item == GO:
                self._go.set()
            elif item is not queue.Empty:
                self._orders.append(item)
                self._have_orders.set()

    async def _login(self, session: Any) -> str:
        async with session.post(f"{self.url}/login", json={"user": USER, "password": PASSWORD}) as resp:
            resp.raise_for_status()
            token = (await resp.json())["token"]
        self.figures["logins"] += 1
        self.to_main.put(("login", self.figures["logins"], time.monotonic_ns()))
        return token

    async def _connection(self, session: Any, aiohttp: Any) -> None:
        if self.token is None:
            self.token = await self._login(session)
        ws_url = self.url.replace("http", "ws", 1) + "/ws"
        try:
            ws = await session.ws_connect(ws_url, params={"token": self.token}, autoping=True, heartbeat=None)
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status != 401:
                raise
            self.figures["refused_401"] += 1
            self.token = None  # expired: log in again
            return
        self.figures["connects"] += 1
        text = aiohttp.WSMsgType.TEXT
        async with ws:
            await ws.send_str(json.dumps({"type": "subscribe", "symbols": list(self.symbols)}))
            helpers = [asyncio.create_task(self._send_orders(ws)), asyncio.create_task(self._close_on_stop(ws))]
            try:
                async for msg in ws:
                    if msg.type is text:
                        await self._frame(ws, msg.data)
            finally:
                for task in helpers:
                    task.cancel()
                await asyncio.gather(*helpers, return_exceptions=True)
        code = ws.close_code
        self.figures["closes"][str(code)] = self.figures["closes"].get(str(code), 0) + 1
        self.to_main.put(("closed", code, time.monotonic_ns()))
        if code == 4003:
            self.token = None
        elif not self._stop.is_set():
            await self._wait_stop(RECONNECT_S)

    async def _frame(self, ws: Any, data: str) -> None:
        arrived = time.monotonic_ns()
        obj = json.loads(data)  # prices are strings: their text survives as is
        kind = obj.get("type")
        if kind == "ping":
            await ws.send_str(json.dumps({"type": "pong", "id": obj["id"]}))
            self.figures["pongs"] += 1
        elif kind in ("trade", "book", "fill", "reject", "subscribed"):
            self.to_main.put((kind, obj, arrived))

    async def _send_orders(self, ws: Any) -> None:
        while True:
            await self._have_orders.wait()
            while self._orders:
                order = self._orders[0]  # left queued until sent: a lost connection resends it
                await ws.send_str(json.dumps(order))
                self._orders.popleft()
                self.figures["orders_sent"] += 1
            self._have_orders.clear()

    async def _close_on_stop(self, ws: Any) -> None:
        await self._stop.wait()
        await ws.close()


def run_worker(url: str, to_main: Any, from_main: Any) -> None:
    """The spawn child's target: the worker, Ctrl-C left to the parent (it stops the child)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    DataClientWorker(url, to_main, from_main).run()


# ---- the main loop: JAX in the main thread ------------------------------------------------------


def parse_args(prog: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description="The exchange user's program (bench/exchange_client.py).")
    p.add_argument("--url", required=True, help="http://HOST:PORT of bench.exchange")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of main loop, then stop")
    p.add_argument("--stats", required=True, help="write the figures here (JSON)")
    p.add_argument("--prices", help="write 'seq price' per trade here, in the order the main loop saw them")
    p.add_argument("--force-order-every", type=float, default=0.0, help="a small order every S seconds (0: none)")
    return p.parse_args(argv)


def z_scores(windows: Any, counts: Any) -> Any:
    """The model: the last price's z-score against each symbol's window (right-aligned, ``counts``
    valid prices each)."""
    import jax.numpy as jnp  # here, as in run_main: the spawn child imports this module and must not load JAX

    valid = jnp.arange(windows.shape[1])[None, :] >= (windows.shape[1] - counts)[:, None]
    n = jnp.maximum(counts, 1)[:, None]
    mean = jnp.sum(jnp.where(valid, windows, 0.0), axis=1, keepdims=True) / n
    var = jnp.sum(jnp.where(valid, (windows - mean) ** 2, 0.0), axis=1, keepdims=True) / n
    z = (windows[:, -1:] - mean) / jnp.sqrt(var + 1e-12)
    return jnp.where(counts >= MIN_PRICES, z[:, 0], 0.0)


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process, its live descendants and its reaped children."""
    me = psutil.Process()
    total = 0.0
    for proc in (me, *me.children(recursive=True)):
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
        if proc is me:
            total += t.children_user + t.children_system
    return total


def _ms(values: list[float], q: float) -> float | None:
    return float(np.quantile(values, q)) if values else None


def run_main(args: argparse.Namespace, design: str, to_worker: Any, from_worker: Any,
             worker_alive: Callable[[], bool], worker_join: Callable[[float], None]) -> int:
    """The main loop, for a worker already started on ``to_worker``/``from_worker``; writes the
    figures and returns the exit status (0, also after SIGTERM or Ctrl-C)."""
    import jax  # here, not at the top: the spawn child imports this module and must not load JAX

    stopping: list[str] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))
    model = jax.jit(z_scores)
    model(np.zeros((len(SYMBOLS), WINDOW), np.float32), np.zeros(len(SYMBOLS), np.int32)).block_until_ready()
    main = MainLoop(design, to_worker, model)
    to_worker.put(GO)
    print("main loop started", file=sys.stderr, flush=True)
    cpu0, t0 = tree_cpu_s(), time.monotonic()
    try:
        main.run(t0 + args.duration, args.force_order_every, from_worker, worker_alive, stopping)
    except KeyboardInterrupt:
        stopping.append("SIGINT")
    wall_s, cpu_s = time.monotonic() - t0, tree_cpu_s() - cpu0
    main.stop_worker(from_worker, worker_alive)
    worker_join(5.0)
    stats = {**main.stats(), "cpu_s": cpu_s, "wall_s": wall_s, "stopped_by": stopping[0] if stopping else "duration",
             "compilations": model._cache_size() if hasattr(model, "_cache_size") else None,
             "jax_platform": jax.devices()[0].platform, "worker": main.worker_figures}
    Path(args.stats).write_text(json.dumps(stats, indent=1) + "\n", encoding="utf-8")
    if args.prices:
        Path(args.prices).write_text("".join(main.prices), encoding="utf-8")
    return 0


class MainLoop:
    """The main loop's state (see the module docstring): the windows of prices, the orders in flight,
    and what is counted and timed."""

    def __init__(self, design: str, to_worker: Any, model: Callable[[Any, Any], Any]) -> None:
        self.design, self.to_worker, self.model = design, to_worker, model
        self.windows = {s: deque(maxlen=WINDOW) for s in SYMBOLS}
        self.index = {s: i for i, s in enumerate(SYMBOLS)}
        self.prices: list[str] = []
        self.trade_ms: list[float] = []
        self.decided: dict[str, tuple[int, bool]] = {}  # client_order_id -> (decided ns, quiet market)
        self.rtt_ms: dict[bool, list[float]] = {False: [], True: []}
        self.n = {"orders": 0, "orders_forced": 0, "orders_model": 0, "fills": 0, "rejects": 0, "trades": 0,
                  "books": 0, "logins": 0, "ticks": 0, "errors": 0}
        self.closes: dict[str, int] = {}
        self.worker_figures: dict[str, Any] = {}
        self.last_model_order = dict.fromkeys(SYMBOLS, -math.inf)
        self.last_trade = -math.inf

    def run(self, end: float, force: float, from_worker: Any, worker_alive: Callable[[], bool],
            stopping: list[str]) -> None:
        """Until ``end`` (monotonic) or a stop: a tick every ``TICK_S``, waiting on the inbound queue between
        ticks; a forced order every ``force`` seconds (0: none)."""
        t0 = time.monotonic()
        next_tick = t0 + TICK_S
        next_force = t0 + force if force > 0 else math.inf
        n = self.n
        while not stopping and (now := time.monotonic()) < end:
            if now < next_tick:
                try:
                    self.take(from_worker.get(timeout=min(next_tick, end) - now))
                except queue.Empty:
                    if not worker_alive():
                        print(f"{self.design}: the worker has gone", file=sys.stderr, flush=True)
                        break
                continue
            next_tick = max(next_tick + TICK_S, now)
            self.tick(now)
            if now >= next_force:
                next_force = max(next_force + force, now)
                n["orders_forced"] += 1
                self.place(SYMBOLS[n["orders_forced"] % len(SYMBOLS)], ("buy", "sell")[n["orders_forced"] % 2],
                           "0.001", now)

    def place(self, symbol: str, side: str, qty: str, now: float) -> None:
        self.n["orders"] += 1
        coid = f"{self.design}-{os.getpid()}-{self.n['orders']}"
        self.decided[coid] = (time.monotonic_ns(), now - self.last_trade > QUIET_GAP_S)
        self.to_worker.put({"type": "order", "symbol": symbol, "side": side, "qty": qty, "client_order_id": coid})

    def take(self, item: tuple[str, Any, int]) -> None:
        kind, obj, arrived = item
        picked = time.monotonic_ns()
        n = self.n
        if kind == "trade":
            self.trade_ms.append((picked - arrived) / 1e6)
            self.windows[obj["symbol"]].append(float(obj["price"]))
            self.prices.append(f"{obj['seq']} {obj['price']}\n")
            n["trades"] += 1
            self.last_trade = time.monotonic()
        elif kind == "fill":
            sent = self.decided.pop(obj["client_order_id"], None)
            if sent is not None:
                self.rtt_ms[sent[1]].append((picked - sent[0]) / 1e6)
            n["fills"] += 1
        elif kind == "reject":
            n["rejects"] += 1
        elif kind == "book":
            n["books"] += 1
        elif kind == "login":
            n["logins"] = obj
        elif kind == "closed":
            self.closes[str(obj)] = self.closes.get(str(obj), 0) + 1
        elif kind == "error":
            n["errors"] += 1
            print(f"{self.design} worker: {obj}", file=sys.stderr, flush=True)
        elif kind == "end":
            self.worker_figures.update(obj)

    def tick(self, now: float) -> None:
        self.n["ticks"] += 1
        arr = np.zeros((len(SYMBOLS), WINDOW), np.float64)
        counts = np.zeros(len(SYMBOLS), np.int32)
        for s, d in self.windows.items():
            if d:  # relative to the last price: float32 keeps the digits that matter
                arr[self.index[s], WINDOW - len(d):] = np.asarray(d) / d[-1] - 1.0
                counts[self.index[s]] = len(d)
        z = np.asarray(self.model(arr.astype(np.float32), counts))
        for s, i in self.index.items():
            if abs(z[i]) > Z_THRESHOLD and now - self.last_model_order[s] >= MODEL_ORDER_GAP_S:
                self.last_model_order[s] = now
                self.n["orders_model"] += 1
                self.place(s, "sell" if z[i] > 0 else "buy", "0.01", now)

    def stop_worker(self, from_worker: Any, worker_alive: Callable[[], bool]) -> None:
        """Tell the worker to stop and take its last figures (at most 5 s)."""
        self.to_worker.put(None)
        deadline = time.monotonic() + 5.0
        while not self.worker_figures and time.monotonic() < deadline:
            try:
                kind, obj, _ = from_worker.get(timeout=0.1)
            except queue.Empty:
                if not worker_alive():
                    break
                continue
            if kind in ("end", "login", "closed"):  # orders and trades after the stop are not counted
                self.take((kind, obj, 0))

    def stats(self) -> dict[str, Any]:
        """The counts and the quantiles of what was timed."""
        rtt_ms, trade_ms = self.rtt_ms, self.trade_ms
        rtt_all = rtt_ms[False] + rtt_ms[True]
        return {
            "design": self.design, **self.n, "unfilled": len(self.decided), "closes": self.closes,
            "order_rtt_ms_p50": _ms(rtt_all, 0.5), "order_rtt_ms_p99": _ms(rtt_all, 0.99),
            "order_rtt_ms_max": max(rtt_all, default=None),
            "order_rtt_quiet_ms_p50": _ms(rtt_ms[True], 0.5), "order_rtt_quiet_ms_p99": _ms(rtt_ms[True], 0.99),
            "order_rtt_quiet_n": len(rtt_ms[True]),
            "order_rtt_busy_ms_p50": _ms(rtt_ms[False], 0.5), "order_rtt_busy_ms_p99": _ms(rtt_ms[False], 0.99),
            "order_rtt_busy_n": len(rtt_ms[False]),
            "trade_ms_p50": _ms(trade_ms, 0.5), "trade_ms_p99": _ms(trade_ms, 0.99),
            "trade_ms_max": max(trade_ms, default=None),
        }
