"""The classic program ported to forkless's IO thread: your ``DataClientWorker``, written for
``multiprocessing.Queue`` and run by ``asyncio.run(dcw.run())`` in a child process, runs
unchanged on ``IOPortal``; the ``Controller`` main loop keeps the main thread (and JAX).

What changed from the ``multiprocessing`` program (tests/classic_program.py, the same worker):
``main`` starts an ``IOPortal`` instead of a process (the worker is ``DataClientWorker(...).run()``,
the queues are the portal's), ``process.is_alive`` became ``portal.poll``, and the main loop
catches ``PortalClosed`` where it takes an event and where it puts an order: the portal has ended
and everything the worker sent has been taken. The worker returns when the exchange closes its
session (the token expired: 4003); ``restart=RestartPolicy()`` calls it again (after a short
backoff), so it logs in again and the session goes on through every expiry, the queues the same.

    python examples/portal_session.py --url http://127.0.0.1:8080 --seconds 30

It prints one JSON line: orders sent, fills, trades, how the last session ended, the restarts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a clone: the repository's packages beside it
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp

from forkless import IOPortal, PortalClosed, RestartPolicy


class DataClientWorker:
    """The user's client of the exchange, written for ``multiprocessing.Queue``."""

    def __init__(self, to_queue, from_queue, url):
        self.to_queue = to_queue
        self.from_queue = from_queue
        self.url = url

    async def run(self):
        async with aiohttp.ClientSession() as http:
            login = {"user": "alice", "password": "s3cret"}
            async with http.post(f"{self.url}/login", json=login) as resp:
                resp.raise_for_status()
                token = (await resp.json())["token"]
            ws_url = self.url.replace("http", "ws", 1) + "/ws"
            async with http.ws_connect(ws_url, params={"token": token}) as ws:
                await ws.send_str(json.dumps({"type": "subscribe", "symbols": ["BTCUSDT"]}))
                sender = asyncio.create_task(self.send_orders(ws))
                try:
                    async for msg in ws:
                        event = json.loads(msg.data)
                        if event["type"] == "ping":  # the exchange's heartbeat, answered here
                            await ws.send_str(json.dumps({"type": "pong", "id": event["id"]}))
                        else:
                            self.to_queue.put(event)
                finally:
                    sender.cancel()
            self.to_queue.put({"type": "closed", "code": ws.close_code})

    async def send_orders(self, ws):
        loop = asyncio.get_running_loop()
        while True:
            try:
                order = await loop.run_in_executor(None, self.from_queue.get, True, 0.5)
            except queue.Empty:
                continue
            await ws.send_str(json.dumps(order))


class Controller:
    """The user's main loop (JAX would run here): an order on each of the first ``orders``
    trades, fills counted, until ``seconds`` pass or the worker ends."""

    def __init__(self, to_queue, from_queue, worker_alive, orders=5):
        self.to_queue = to_queue
        self.from_queue = from_queue
        self.worker_alive = worker_alive
        self.orders = orders
        self.sent, self.fills, self.trades, self.closed = [], [], 0, None

    def run(self, seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                event = self.to_queue.get(timeout=0.1)
            except queue.Empty:
                if not self.worker_alive():
                    break
                continue
            except PortalClosed:  # the worker ended on its own, and everything it sent is taken
                break
            try:
                self.handle(event)
            except PortalClosed:  # an order's put raises it too, once the portal has ended
                break

    def handle(self, event):
        if event["type"] == "trade":
            self.trades += 1
            if len(self.sent) < self.orders:
                order_id = f"o{len(self.sent)}"
                self.sent.append(order_id)
                self.from_queue.put({"type": "order", "symbol": event["symbol"], "side": "buy",
                                     "qty": "0.01", "client_order_id": order_id})
        elif event["type"] == "fill":
            self.fills.append(event["client_order_id"])
        elif event["type"] == "closed":
            self.closed = event["code"]


def main(url, seconds):
    """The main loop beside the worker, which the portal calls again each time it returns."""
    # the portal calls worker(to_main, from_main): to_main is what the worker puts (its to_queue),
    # from_main what it takes (its from_queue)
    with IOPortal(lambda to_main, from_main: DataClientWorker(to_main, from_main, url).run(),
                  restart=RestartPolicy()) as portal:
        controller = Controller(portal.to_main, portal.from_main, portal.poll)
        controller.run(seconds)
    return controller, portal.restarts


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the exchange, http://HOST:PORT")
    parser.add_argument("--seconds", type=float, default=30.0, help="at most this long")
    args = parser.parse_args()
    done, restarts = main(args.url, args.seconds)
    print(json.dumps({"orders": done.sent, "fills": done.fills, "trades": done.trades, "closed": done.closed,
                      "restarts": restarts}))
