"""The classic program, as it was written before forkless: a ``Controller`` main loop in the main
process and the user's ``DataClientWorker`` run by ``asyncio.run(dcw.run())`` in a child process,
the two joined by ``multiprocessing.Queue``s (a fork beside JAX, which forkless removes).

The worker logs in over HTTP, opens the exchange's WebSocket with the token, subscribes, answers
the exchange's JSON heartbeat itself, puts what comes on ``to_queue`` (``put``, on its loop) and
sends the orders it takes from ``from_queue`` (a blocking ``get(True, 0.5)`` in the loop's
executor). It ends when the exchange ends its session (the token expired: close 4003).

Kept here as written, for tests/io_loop/test_portal_session.py: examples/portal_session.py is this program
ported to ``IOPortal``, its ``DataClientWorker`` the same text, its ``Controller`` changed by two
``except PortalClosed`` clauses. The suite runs the port against tests/ws_exchange.py, and this
``DataClientWorker`` on a restarting portal; the ``multiprocessing`` program itself is not run.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import queue
import time

import aiohttp


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
            self.handle(event)

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


def run_worker(dcw):
    asyncio.run(dcw.run())


def main(url, seconds):
    to_queue, from_queue = multiprocessing.Queue(), multiprocessing.Queue()
    dcw = DataClientWorker(to_queue, from_queue, url)
    process = multiprocessing.Process(target=run_worker, args=(dcw,))
    process.start()
    controller = Controller(to_queue, from_queue, process.is_alive)
    controller.run(seconds)
    process.terminate()
    return controller
