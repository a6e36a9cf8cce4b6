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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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

    import numpy as np

    from forkless import EVENTS_ONLY, Config, ConnectionEvent, Controller, OnEvent

    stop = threading.Event()
    stopped_by = ["duration"]

    def on_sigterm(*_: Any) -> None:
        stopped_by[0] = "SIGTERM"
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    session = ExchangeSession(args.url, order_max_age_s=args.order_max_age)
    model = make_model()
    window = np.zeros((len(SYMBOLS), WINDOW), np.float32)  # the model's input, made at each tick
    filled = np.zeros(len(SYMBOLS), np.int32)
    latest_prices = {symbol: collections.deque(maxlen=WINDOW) for symbol in SYMBOLS}  # kept as trades come
    row = {symbol: i for i, symbol in enumerate(SYMBOLS)}
    pending: dict[str, tuple[int, bool]] = {}  # client_order_id -> (monotonic ns it was decided, quiet market)
    rtt_ms: dict[bool, list[float]] = {False: [], True: []}
    last_trade = [-math.inf]
    trade_ms: list[float] = []
    counts = collections.Counter()
    prices: list[str] = []  # "seq price" lines for --prices, written at the end
    connected = [False]  # the session, as the connection events tell it: no model order while it is down
    connections: list[list[Any]] = []  # [up, reason, close code] of each connection event, in order

    def on_event(source: str, event: Any) -> None:
        if isinstance(event, ConnectionEvent):  # the session came up, or went down (its close code)
            connected[0] = event.connected
            connections.append([event.connected, event.reason, event.code])
            return
        if isinstance(event, SendFailed):  # an order not written by its deadline, or whose session died with it
            counts["orders_lost_with_session" if event.reason == "connection lost" else "orders_given_up"] += 1
            pending.pop(event.id, None)
            return
        now = time.monotonic_ns()
        kind = event["type"]
        counts[kind] += 1
        if kind == "trade":  # as little as it takes: this runs for every trade, the model at each tick
            trade_ms.append((now - event["received_ns"]) / 1e6)
            last_trade[0] = time.monotonic()
            latest = latest_prices.get(event["symbol"])
            if latest is not None:
                latest.append(float(event["price"]))
            prices.append(f"{event['seq']} {event['price']}\n")
        elif kind in ("fill", "reject"):
            decided = pending.pop(event.get("client_order_id", ""), None)
            if decided is not None:
                rtt_ms[decided[1]].append((now - decided[0]) / 1e6)

    def order(ctl: Any, symbol: str, side: str, qty: str) -> None:
        counts["orders"] += 1
        oid = f"o{counts['orders']}"
        pending[oid] = (time.monotonic_ns(), time.monotonic() - last_trade[0] > QUIET_GAP_S)
        ctl.send("exchange", {"type": "order", "symbol": symbol, "side": side, "qty": qty, "client_order_id": oid},
                 id=oid)  # its deadline: the source's send_max_age_s

    model(window, filled).block_until_ready()  # compiled before the session opens: no trade waits for XLA
    config = Config.from_env()
    started = time.monotonic()
    last_model_order = dict.fromkeys(SYMBOLS, 0.0)
    try:
        # events only: trades and fills reach on_event, the model is this loop's own: nothing compiled at start
        # connections=True: on_event also hears each ConnectionEvent of the session, in order with its events
        ctl = Controller(config, processor=EVENTS_ONLY, sources=[session], on_event=OnEvent(on_event, connections=True))
        with ctl:  # its stop hands over the fills of the orders in flight (ExchangeSession.awaiting)
            print("main loop started", file=sys.stderr, flush=True)
            started = time.monotonic()  # --duration counts the main loop's time, not the compile's
            cpu_at_start = os.times()
            next_tick = started + TICK_S
            next_force = started + args.force_order_every if args.force_order_every > 0 else math.inf
            while not stop.is_set():
                now = time.monotonic()
                if args.duration and now - started >= args.duration:
                    break
                if now < next_tick:
                    ctl.process_pending(timeout=next_tick - now)  # events as they come, until the tick
                    continue
                next_tick = max(next_tick + TICK_S, now)
                for symbol, i in row.items():
                    latest = latest_prices[symbol]
                    if latest:  # relative to the last price: float32 keeps the digits that matter
                        window[i, WINDOW - len(latest):] = np.asarray(latest) / latest[-1] - 1.0
                        filled[i] = len(latest)
                z = np.asarray(model(window, filled))
                for symbol, i in row.items():
                    decides = filled[i] >= MIN_PRICES and abs(z[i]) > THRESHOLD
                    if decides and not connected[0]:  # no quoting on a market it cannot see
                        counts["orders_not_quoted_while_down"] += 1
                    elif decides and now - last_model_order[symbol] > ORDER_GAP_S:
                        last_model_order[symbol] = now
                        order(ctl, symbol, "sell" if z[i] > 0 else "buy", "0.01")
                if now >= next_force:
                    next_force = max(next_force + args.force_order_every, now)
                    counts["orders_forced"] += 1
                    order(ctl, SYMBOLS[counts["orders"] % len(SYMBOLS)], "buy", "0.001")
            for k in range(args.orders_at_stop):  # sent just before the stop: filled while it stops
                counts["orders_at_stop"] += 1
                order(ctl, SYMBOLS[k % len(SYMBOLS)], "sell", "0.001")
            wall = time.monotonic() - started
            cpu_end = os.times()
            cpu_s = cpu_end.user + cpu_end.system - cpu_at_start.user - cpu_at_start.system
        snapshot = ctl.stats()  # after the stop: its books whole
    except KeyboardInterrupt:
        snapshot, wall, cpu_s = None, time.monotonic() - started, math.nan
        stopped_by[0] = "SIGINT"
    finally:
        if args.prices:
            Path(args.prices).write_text("".join(prices), encoding="utf-8")
    if args.stats:
        every = rtt_ms[False] + rtt_ms[True]
        figures = {
            "orders": counts["orders"], "orders_forced": counts["orders_forced"], "fills": counts["fill"],
            "orders_at_stop": counts["orders_at_stop"], "orders_given_up": counts["orders_given_up"],
            "rejects": counts["reject"], "stopped_by": stopped_by[0],
            "trades": counts["trade"], "books": counts["book"], "logins": session.logins,
            "unfilled": len(pending), "orders_lost_with_session": counts["orders_lost_with_session"],
            "awaited_unanswered": snapshot.awaited_unanswered if snapshot is not None else None,
            "order_rtt_ms_p50": quantile_ms(every, 0.5), "order_rtt_ms_p99": quantile_ms(every, 0.99),
            "order_rtt_ms_max": max(every, default=None),
            "order_rtt_quiet_ms_p50": quantile_ms(rtt_ms[True], 0.5),
            "order_rtt_quiet_ms_p99": quantile_ms(rtt_ms[True], 0.99), "order_rtt_quiet_n": len(rtt_ms[True]),
            "trade_ms_p50": quantile_ms(trade_ms, 0.5), "trade_ms_p99": quantile_ms(trade_ms, 0.99),
            "trade_ms_max": max(trade_ms, default=None), "cpu_s": cpu_s, "wall_s": wall,
            "pongs": snapshot.counts.get("pongs", 0) if snapshot is not None else None,
            "events_unhandled": snapshot.events_unhandled if snapshot is not None else None,
            "orders_unsent": snapshot.sent_unsent if snapshot is not None else None,
            "orders_not_quoted_while_down": counts["orders_not_quoted_while_down"], "connections": connections,
        }
        Path(args.stats).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
