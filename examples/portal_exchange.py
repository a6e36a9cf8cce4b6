"""The exchange session on forkless's IO thread the other way: the trader's own ``DataClientWorker``,
written for ``multiprocessing.Queue`` and unchanged, on an ``IOPortal``; the same JAX main loop as
examples/exchange_session.py (its ``MainLoop``: the model, the orders, what is counted).

The worker logs in (``POST /login``), opens the WebSocket with the token, subscribes, answers the
exchange's heartbeat, puts what comes on ``to_queue`` and writes the orders it takes from
``from_queue`` (a blocking ``get`` in its loop's executor); it returns when the exchange ends its
session (the token expired, 4003; the exchange died, 1006), and fails when it cannot log in. The
portal keeps it going as a ``Source`` with ``Relogin`` would be kept:

- ``restart=RestartPolicy()``: called again with ``DEFAULT_BACKOFF``, ``Relogin``'s, which follows the
  exchange (back within about 0.5 s of its return while the outage is young);
- ``connection_events=True``: a ``ConnectionEvent`` when a session is up (its first item crossed) and
  when it ends, never for a login that fails: the main loop quotes only while it is up;
- every order put with its deadline (``from_main.put(order, max_age_s=, id=)``): one the worker has not
  taken in time is never written (``SendFailed`` on ``to_main``);
- ``send_answered``: a fill answers its order, so an order a session took to the grave is reported
  (``SendFailed``, "connection lost") and the stop delivers the fills in flight before it stops the
  worker (the closing orders' fills stay in ``to_main``, taken after it).

    python examples/portal_exchange.py --url http://127.0.0.1:8080 --duration 30 --stats stats.json

It prints ``main loop started`` on stderr once its loop runs; SIGTERM or Ctrl-C ends it with exit 0.
"""

from __future__ import annotations

import asyncio
import json
import queue
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script from a clone: the repository's packages beside it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp

from examples.exchange_session import (
    SYMBOLS,
    MainLoop,
    parse_args,
    stop_on_signals,
    write_figures,
)
from forkless import IOPortal, PortalClosed, RestartPolicy


class DataClientWorker:
    """The trader's client of the exchange, written for ``multiprocessing.Queue``: one session a run."""

    def __init__(self, to_queue, from_queue, url, symbols=SYMBOLS):
        self.to_queue = to_queue
        self.from_queue = from_queue
        self.url = url
        self.symbols = symbols

    async def run(self):
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{self.url}/login", json={"user": "alice", "password": "s3cret"}) as resp:
                resp.raise_for_status()
                token = (await resp.json())["token"]
            ws_url = self.url.replace("http", "ws", 1) + "/ws"
            async with http.ws_connect(ws_url, params={"token": token}) as ws:
                await ws.send_str(json.dumps({"type": "subscribe", "symbols": list(self.symbols)}))
                sender = asyncio.create_task(self.send_orders(ws))
                try:
                    async for msg in ws:
                        if msg.type is not aiohttp.WSMsgType.TEXT:
                            continue
                        event = json.loads(msg.data)
                        if event["type"] == "ping":  # the exchange's heartbeat, answered here
                            await ws.send_str(json.dumps({"type": "pong", "id": event["id"]}))
                        else:
                            event["received_ns"] = time.monotonic_ns()
                            self.to_queue.put(event)
                finally:
                    sender.cancel()

    async def send_orders(self, ws):
        loop = asyncio.get_running_loop()
        while True:
            try:
                order = await loop.run_in_executor(None, self.from_queue.get, True, 0.5)
            except queue.Empty:
                continue
            await ws.send_str(json.dumps(order))


def fill_of(item: Any) -> Any:
    """What the portal asks of each item the worker puts: the order a fill or a reject answers."""
    return item.get("client_order_id") if isinstance(item, dict) and item.get("type") in ("fill", "reject") else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__.splitlines()[0])
    stop, stopped_by = stop_on_signals()
    portal = IOPortal(lambda to_main, from_main: DataClientWorker(to_main, from_main, args.url).run(),
                      restart=RestartPolicy(), connection_events=True, send_answered=fill_of, name="exchange")
    loop = MainLoop(lambda order, oid: portal.from_main.put(order, max_age_s=args.order_max_age, id=oid),
                    args.force_order_every)
    loop.compile()
    def take(timeout: float) -> None:  # what the worker put, as it comes, until the tick
        try:
            loop.take(portal.to_main.get(timeout=timeout))
        except queue.Empty:
            pass

    with portal:  # its stop delivers the fills of the orders in flight, then stops the worker
        wall, cpu_s = loop.run(take, stop, args.duration)
        loop.close_out(args.orders_at_stop)  # put just before the stop: filled while it stops
    while True:  # what the worker put before the stop ended it: the closing orders' fills among it
        try:
            loop.take(portal.to_main.get_nowait())
        except PortalClosed:
            break
    write_figures(args, loop, {
        "stopped_by": stopped_by[0], "logins": portal.connections, "awaited_unanswered": portal.awaited_unanswered,
        "cpu_s": cpu_s, "wall_s": wall, "restarts": portal.restarts, "sent_failed": portal.sent_failed,
        "events_unhandled": 0, "orders_unsent": portal.sent_failed.get("not taken", 0)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
