"""An exchange session on forkless: the user's own async client on the IO thread, a JAX main loop.

The program people bring (their ``DataClientWorker``: log in over HTTP, open the WebSocket with the
token, subscribe, answer the exchange's JSON heartbeat, send orders when the main loop decides,
receive fills), written as a ``controller.Source``:

- the client is the user's, unchanged in spirit: it logs in again whenever the session ends (the
  token expired: close 4003, or HTTP 401 on the reconnect; the exchange restarted) with
  ``forkless.Relogin``, whose backoff follows the exchange (``RECONNECT``: back within about 0.5 s
  of its return while the outage is young), and answers ``{"type":"ping"}`` with
  ``{"type":"pong"}`` itself, on the IO thread, counted as what it is (``ctx.count``);
- every order has a deadline (``send_max_age_s``, ``--order-max-age``): one not written within
  it, the session being down, is never written (an order seconds old is worse than none) and the
  main loop hears of it (``SendFailed`` to ``on_event``, with the order's id), counted apart;
- it says which order a fill (or a reject) answers (``send_answered(event)``): the orderly stop stops the
  market data, hands every fill of the orders in flight to the main loop, and ends once none is
  awaited (or at its deadline, each one left reported): no drain of its own before ``stop()``
  (docs/embedding/stop.md); an order written on a session that ended before its fill came (the
  exchange answers on the order's own session) is reported too (``SendFailed``, "connection lost");
- trades, books and fills reach the main thread as they are (``ctx.emit_event`` → ``on_event``):
  the price keeps the exchange's exact text, no processor squeezes it into a row;
- the main loop hears when the session goes down and comes back (``OnEvent(on_event,
  connections=True)``: a ``forkless.ConnectionEvent`` with the close code, 4003 for an expired
  token, 1006 for an exchange that died) and stops quoting while it is down: no model order is
  decided on a market it cannot see;
- the main loop ticks every 100 ms, runs a jitted model over a window of the latest prices per
  symbol, and sends an order the moment it decides (``Controller.send``), whatever the market does.

Why a ``Source`` rather than the bare IO thread (``controller.IOPortal``): the controller's books,
metrics, status and orderly stop count this client as they count a built-in feed, and an order
sent is counted until it is written. Nothing is sent to the exchange but the subscribe, the pongs
and the orders.

    python examples/exchange_session.py --url http://127.0.0.1:8080 --duration 30 --stats stats.json

It prints ``main loop started`` on stderr once its loop runs; SIGTERM or Ctrl-C ends it with exit 0.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script from a clone: the repository's packages beside it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp

from forkless import Backoff, Relogin, SendFailed, SourceStopped

SYMBOLS = ("BTCUSDT", "ETHUSDT", "SOLUSDT", "XRPUSDT")
WINDOW = 64  # latest prices per symbol the model sees
TICK_S = 0.1
THRESHOLD = 2.5  # |z| of the last price against its window that makes the model order
ORDER_GAP_S = 1.0  # per symbol, at most one model order in this long
MIN_PRICES = 16  # no model order on a window shorter than this
QUIET_GAP_S = 0.3  # an order decided when no trade has come for this long counts as "quiet market"
ORDER_MAX_AGE_S = 0.5  # an order not written within this long of its decision is never written
# the first retry at once, then at most 0.5 s apart while the outage is under 5 s (an exchange restart
# is followed within about 0.5 s of its return), then a tenth of the outage's age, up to 5 s
RECONNECT = Backoff(min_s=0.05, max_s=5.0, jitter=0.5, follow_s=0.5, follow_ratio=0.1)

log = logging.getLogger("exchange_session")


class ExchangeSession:
    """The user's own client of the exchange, as a forkless ``Source`` (see the module docstring)."""

    name = "exchange"
    replies = "none"  # no processor answers anything: the exchange is sent only what this client sends
    starts_connected = False  # Relogin says when it is connected

    def __init__(self, url: str, user: str = "alice", password: str = "s3cret",
                 symbols: tuple[str, ...] = SYMBOLS, order_max_age_s: float = ORDER_MAX_AGE_S) -> None:
        self.send_max_age_s = order_max_age_s  # every order's deadline (the main loop sends without its own)
        self.url = url.rstrip("/")
        self.user, self.password, self.symbols = user, password, symbols
        self.logins = 0

    def send_answered(self, event: Any) -> Any:
        """The order a fill or a reject answers (its ``client_order_id``, the id it was sent with): the stop
        awaits the answers of the orders written (docs/embedding/stop.md), and one whose session ended first
        is reported to the main loop (SendFailed, "connection lost")."""
        return event.get("client_order_id") if event.get("type") in ("fill", "reject") else None

    async def run(self, ctx: Any) -> None:
        async with aiohttp.ClientSession() as http:
            async def connect(attempt: int) -> aiohttp.ClientWebSocketResponse:
                """A fresh login for every connection (a token expires: close 4003, or 401 here)."""
                login = {"user": self.user, "password": self.password}
                async with http.post(f"{self.url}/login", json=login) as resp:
                    resp.raise_for_status()
                    token = (await resp.json())["token"]
                self.logins += 1
                ctx.count("logins")
                ws = await http.ws_connect(self.url.replace("http", "ws", 1) + "/ws", params={"token": token})
                await ws.send_str(json.dumps({"type": "subscribe", "symbols": list(self.symbols)}))
                return ws

            async with Relogin(connect, lambda ws: self._serve(ws, ctx), ctx=ctx, name="exchange",
                               backoff=RECONNECT) as link:
                async for order in ctx.outgoing():  # ends once the main thread has sent its last order (the stop)
                    try:
                        await link.send(order)  # held while it logs in again, until the order's deadline
                    except SendFailed:  # given up: the main loop hears of it (on_event), counted in sent_failed
                        pass

    async def _serve(self, ws: aiohttp.ClientWebSocketResponse, ctx: Any) -> None:
        """One session, until the exchange ends it (the token expired) or the connection is lost."""
        async for msg in ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                continue
            received_ns = time.monotonic_ns()
            event = json.loads(msg.data)  # prices stay the exchange's text
            kind = event.get("type")
            if kind == "ping":  # the application heartbeat: answered here, at once
                await ws.send_str(json.dumps({"type": "pong", "id": event["id"]}))
                ctx.count("pongs")
            elif kind in ("fill", "reject"):  # replies: handed over through the stop too
                event["received_ns"] = received_ns
                try:
                    await ctx.emit_event(event)
                except SourceStopped:  # after the stop's deadline: not taken any more
                    ctx.count("replies after the stop")
            elif ctx.stopping.is_set():  # the stop began: no new market data is read in
                ctx.count("market data after the stop")
            elif kind in ("trade", "book"):
                event["received_ns"] = received_ns
                await ctx.emit_event(event)
            else:
                ctx.count(f"other frames ({kind})")


def make_model() -> Any:
    """The user's JAX model: per symbol, the z-score of the last price against its window."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def model(window: jax.Array, filled: jax.Array) -> jax.Array:
        weight = (jnp.arange(WINDOW)[None, :] >= WINDOW - filled[:, None]).astype(window.dtype)
        n = jnp.maximum(weight.sum(axis=1), 1.0)
        mean = (window * weight).sum(axis=1) / n
        var = (((window - mean[:, None]) ** 2) * weight).sum(axis=1) / n
        return (window[:, -1] - mean) / jnp.sqrt(var + 1e-12)

    return model


def quantile_ms(values: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.quantile(values, q)) if values else None


class MainLoop:
    """The trader's main loop, whatever carries its orders and events (the ``Controller`` here, an
    ``IOPortal`` in examples/portal_exchange.py): the latest prices per symbol as trades come, the jitted
    model over them at each tick, an order the moment it decides (none while the session is down), and
    what is counted and timed. ``send(order, client_order_id)`` hands an order to the exchange."""

    def __init__(self, send: Any, force_order_every_s: float = 0.0) -> None:
        import numpy as np

        self._np, self.send, self.force_every_s = np, send, force_order_every_s
        self.model = make_model()
        self.window = np.zeros((len(SYMBOLS), WINDOW), np.float32)  # the model's input, made at each tick
        self.filled = np.zeros(len(SYMBOLS), np.int32)
        self.latest = {symbol: collections.deque(maxlen=WINDOW) for symbol in SYMBOLS}  # kept as trades come
        self.row = {symbol: i for i, symbol in enumerate(SYMBOLS)}
        self.pending: dict[str, tuple[int, bool]] = {}  # client_order_id -> (monotonic ns decided, quiet market)
        self.closing: set[str] = set()  # the orders placed right before the stop
        self.rtt_ms: dict[bool, list[float]] = {False: [], True: []}
        self.last_trade = -math.inf
        self.trade_ms: list[float] = []
        self.counts: collections.Counter[str] = collections.Counter()
        self.prices: list[str] = []  # "seq price" lines for --prices, written at the end
        self.connected = False  # the session, as the connection events tell it: no model order while it is down
        self.connections: list[list[Any]] = []  # [up, reason, close code] of each connection event, in order
        self.ups_at_s: list[float] = []  # when each connection came up (Unix seconds)
        self.last_model_order = dict.fromkeys(SYMBOLS, 0.0)
        self.next_tick = self.next_force = math.inf

    def compile(self) -> None:
        """Compile the model before the session opens: no trade waits for XLA."""
        self.model(self.window, self.filled).block_until_ready()

    def begin(self, now: float) -> None:
        self.next_tick = now + TICK_S
        self.next_force = now + self.force_every_s if self.force_every_s > 0 else math.inf

    def take(self, event: Any) -> None:
        """One event from the exchange's side: a connection's change, an order given up or lost, a trade, a fill."""
        from forkless import ConnectionEvent

        if isinstance(event, ConnectionEvent):  # the session came up, or went down (its close code)
            self.connected = event.connected
            self.connections.append([event.connected, event.reason, event.code])
            if event.connected:
                self.ups_at_s.append(event.at_s)
            return
        if isinstance(event, SendFailed):  # an order not written by its deadline, or whose session died with it
            self.counts["orders_lost_with_session" if event.reason == "connection lost" else "orders_given_up"] += 1
            self.pending.pop(event.id, None)
            return
        now = time.monotonic_ns()
        kind = event["type"]
        self.counts[kind] += 1
        if kind == "trade":  # as little as it takes: this runs for every trade, the model at each tick
            self.trade_ms.append((now - event["received_ns"]) / 1e6)
            self.last_trade = time.monotonic()
            latest = self.latest.get(event["symbol"])
            if latest is not None:
                latest.append(float(event["price"]))
            self.prices.append(f"{event['seq']} {event['price']}\n")
        elif kind in ("fill", "reject"):
            oid = event.get("client_order_id", "")
            decided = self.pending.pop(oid, None)
            if decided is not None:
                self.rtt_ms[decided[1]].append((now - decided[0]) / 1e6)
            if kind == "fill" and oid in self.closing:
                self.counts["closing_fills"] += 1

    def place(self, symbol: str, side: str, qty: str) -> str:
        self.counts["orders"] += 1
        oid = f"o{self.counts['orders']}"
        self.pending[oid] = (time.monotonic_ns(), time.monotonic() - self.last_trade > QUIET_GAP_S)
        self.send({"type": "order", "symbol": symbol, "side": side, "qty": qty, "client_order_id": oid}, oid)
        return oid

    def due(self, now: float) -> float:
        """Seconds to the next tick (<= 0: it is due)."""
        return self.next_tick - now

    def tick(self, now: float) -> None:
        """The model over the latest prices; an order where it decides; the timer's order."""
        np = self._np
        self.next_tick = max(self.next_tick + TICK_S, now)
        for symbol, i in self.row.items():
            latest = self.latest[symbol]
            if latest:  # relative to the last price: float32 keeps the digits that matter
                self.window[i, WINDOW - len(latest):] = np.asarray(latest) / latest[-1] - 1.0
                self.filled[i] = len(latest)
        z = np.asarray(self.model(self.window, self.filled))
        for symbol, i in self.row.items():
            decides = self.filled[i] >= MIN_PRICES and abs(z[i]) > THRESHOLD
            if decides and not self.connected:  # no quoting on a market it cannot see
                self.counts["orders_not_quoted_while_down"] += 1
            elif decides and now - self.last_model_order[symbol] > ORDER_GAP_S:
                self.last_model_order[symbol] = now
                self.place(symbol, "sell" if z[i] > 0 else "buy", "0.01")
        if now >= self.next_force:
            self.next_force = max(self.next_force + self.force_every_s, now)
            self.counts["orders_forced"] += 1
            self.place(SYMBOLS[self.counts["orders"] % len(SYMBOLS)], "buy", "0.001")

    def run(self, wait: Any, stop: threading.Event, duration_s: float) -> tuple[float, float]:
        """The loop: events as they come (``wait(timeout)`` hands them to ``take``) until each tick, until
        ``stop`` or ``duration_s`` (0: no bound); the wall and CPU seconds it ran."""
        print("main loop started", file=sys.stderr, flush=True)
        started = time.monotonic()  # --duration counts the main loop's time, not the compile's
        cpu_at_start = cpu_seconds()
        self.begin(started)
        while not stop.is_set():
            now = time.monotonic()
            if duration_s and now - started >= duration_s:
                break
            if self.due(now) > 0:
                wait(self.due(now))  # events as they come, until the tick
                continue
            self.tick(now)
        return time.monotonic() - started, cpu_seconds() - cpu_at_start

    def close_out(self, orders: int) -> None:
        """``orders`` small orders right before the stop: their fills too reach the main loop, through the stop."""
        for k in range(orders):
            self.counts["orders_at_stop"] += 1
            self.closing.add(self.place(SYMBOLS[k % len(SYMBOLS)], "sell", "0.001"))

    def figures(self) -> dict[str, Any]:
        """What the run counted and timed (--stats), for the carrier's figures to join."""
        counts, rtt_ms, trade_ms = self.counts, self.rtt_ms, self.trade_ms
        every = rtt_ms[False] + rtt_ms[True]
        return {
            "orders": counts["orders"], "orders_forced": counts["orders_forced"], "fills": counts["fill"],
            "orders_at_stop": counts["orders_at_stop"], "closing_fills": counts["closing_fills"],
            "orders_given_up": counts["orders_given_up"], "rejects": counts["reject"], "trades": counts["trade"],
            "books": counts["book"], "unfilled": len(self.pending),
            "orders_lost_with_session": counts["orders_lost_with_session"],
            "order_rtt_ms_p50": quantile_ms(every, 0.5), "order_rtt_ms_p99": quantile_ms(every, 0.99),
            "order_rtt_ms_max": max(every, default=None),
            "order_rtt_quiet_ms_p50": quantile_ms(rtt_ms[True], 0.5),
            "order_rtt_quiet_ms_p99": quantile_ms(rtt_ms[True], 0.99), "order_rtt_quiet_n": len(rtt_ms[True]),
            "trade_ms_p50": quantile_ms(trade_ms, 0.5), "trade_ms_p99": quantile_ms(trade_ms, 0.99),
            "trade_ms_max": max(trade_ms, default=None),
            "orders_not_quoted_while_down": counts["orders_not_quoted_while_down"], "connections": self.connections,
            "ups_at_s": self.ups_at_s,
        }


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """The command line both carriers take (this program's and examples/portal_exchange.py's)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", required=True, help="the exchange, http://HOST:PORT")
    parser.add_argument("--duration", type=float, default=0.0, help="seconds to run (0: until SIGTERM/Ctrl-C)")
    parser.add_argument("--stats", help="write the session's figures here (JSON)")
    parser.add_argument("--prices", help="write 'seq price' per trade here, the price as the exchange sent it")
    parser.add_argument("--force-order-every", type=float, default=0.0,
                        help="also place a small order from the main loop's timer every S seconds")
    parser.add_argument("--order-max-age", type=float, default=ORDER_MAX_AGE_S,
                        help="seconds an order may wait to be written (the session down) before it is given up")
    parser.add_argument("--orders-at-stop", type=int, default=0,
                        help="place N small orders right before the stop (closing out): their fills too reach the "
                             "main loop, through the stop")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("FORKLESS_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args


def stop_on_signals() -> tuple[threading.Event, list[str]]:
    """SIGTERM and Ctrl-C (SIGINT) ask for the orderly stop: the loop ends, closes out, stops; what asked."""
    stop = threading.Event()
    stopped_by = ["duration"]

    def on_signal(signum: int, _frame: Any) -> None:
        stopped_by[0] = signal.Signals(signum).name
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop, stopped_by


def write_figures(args: argparse.Namespace, loop: MainLoop, figures: dict[str, Any]) -> None:
    if args.prices:
        Path(args.prices).write_text("".join(loop.prices), encoding="utf-8")
    if args.stats:
        Path(args.stats).write_text(json.dumps(loop.figures() | figures, indent=1))


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__.splitlines()[0])

    from forkless import EVENTS_ONLY, Config, Controller, OnEvent

    stop, stopped_by = stop_on_signals()
    session = ExchangeSession(args.url, order_max_age_s=args.order_max_age)
    carrier: list[Any] = []  # the controller, once made: orders go through it
    loop = MainLoop(lambda order, oid: carrier[0].send("exchange", order, id=oid),  # its deadline: send_max_age_s
                    args.force_order_every)
    loop.compile()
    # events only: trades and fills reach on_event, the model is this loop's own: nothing compiled at start
    # connections=True: on_event also hears each ConnectionEvent of the session, in order with its events
    ctl = Controller(Config.from_env(), processor=EVENTS_ONLY, sources=[session],
                     on_event=OnEvent(lambda source, event: loop.take(event), connections=True))
    carrier.append(ctl)
    with ctl:  # its stop hands over the fills of the orders in flight (ExchangeSession.send_answered)
        wall, cpu_s = loop.run(lambda timeout: ctl.process_pending(timeout=timeout), stop, args.duration)
        loop.close_out(args.orders_at_stop)  # sent just before the stop: filled while it stops
    snapshot = ctl.stats()  # after the stop: its books whole
    write_figures(args, loop, {
        "stopped_by": stopped_by[0], "logins": session.logins, "awaited_unanswered": snapshot.awaited_unanswered,
        "cpu_s": cpu_s, "wall_s": wall, "pongs": snapshot.counts.get("pongs", 0),
        "events_unhandled": snapshot.events_unhandled, "orders_unsent": snapshot.sent_unsent})
    return 0


if __name__ == "__main__":
    sys.exit(main())
