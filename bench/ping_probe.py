"""A side probe: how long a WebSocket ping waits for its pong from a design's event loop.

    python -m bench.ping_probe --duration 4 --warmup-s 1 [--interval-ms 5]

A WebSocket server in its own process (like ``bench.loadgen``: it never shares a GIL with the
design under test). It prints ``LISTENING ws://HOST:PORT/`` (``--unix-socket PATH``: served on
that unix socket, ``LISTENING ws+unix://...``, ``bench.unix``), serves ONE connection, and
from the moment it is opened sends a ping every ``--interval-ms`` (jittered uniformly
between half and one and a half times it, so the pings do not lock onto the load's period)
for ``--duration`` seconds; each ping carries its number, and its round trip is the time
from sending it to reading its pong, both on this process's clock. Pings sent in the first
``--warmup-s`` seconds are not counted. It then waits until every ping has its pong (at most
``--drain-s`` seconds: a bound for a client that stopped answering, not a measurement window;
``bench.run`` passes a generous one), closes the connection, stops listening, prints
``RESULT <json>`` (``rtt_ms`` p50/p99/max, ``pings``, ``pongs``, ``lost``: pings not answered
by the end) and exits.

The design connects to it as a second connection on the loop that answers its feed (the
forkless design: a second feed in ``FORKLESS_FEEDS``, on the IO thread's loop; spawn: a
second connection in the child; inline: a second connection on its one loop). A client
built on aiohttp answers a ping inside ``receive()``, so a pong waits for whatever holds that
loop: in the inline design, the step. The load generator (``bench/loadgen.py``) sends no
pings, so this is where the wait is measured, the same way for every design.

It always stops by itself: no connection within ``--connect-timeout`` seconds, or a run
capped at ``duration + 30`` seconds of pinging plus the drain (and a SIGALRM backstop).

Rules:
- Its own process; a round trip is from sending a ping to reading its pong, on its own clock.
- It always stops by itself (the connect timeout, the cap, the SIGALRM backstop).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
from aiohttp import WSMsgType, web

from bench.loadgen import REPO_ROOT, LoadgenProcess, _next_line, _pump
from bench.unix import start_site
from forkless.io_loop.jsontext import dumps

DRAIN_S = 1.0  # after the last ping, wait at most this long (the default of --drain-s) for the last pongs


async def serve(duration: float, warmup_s: float, interval_s: float, connect_timeout: float,
                host: str = "127.0.0.1", drain_s: float = DRAIN_S, unix_socket: str = "") -> dict[str, Any]:
    connected = asyncio.Event()
    result: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    taken = False

    async def handle(request: web.Request) -> web.StreamResponse:
        nonlocal taken
        if taken:
            return web.Response(status=409, text="the probe serves one connection\n")
        taken = True
        # autoping off: the pongs are read here (a client's own pings are answered by hand)
        ws = web.WebSocketResponse(autoping=False, heartbeat=None, timeout=2.0)
        await ws.prepare(request)
        connected.set()
        sent: dict[int, int] = {}
        rtts: list[tuple[int, float]] = []  # (ping number, round trip in ns)
        counted_from = time.perf_counter_ns() + int(warmup_s * 1e9)
        stop_at = time.perf_counter_ns() + int(duration * 1e9)
        rng = random.Random(0)

        async def pinger() -> None:
            n = 0
            while time.perf_counter_ns() < stop_at and not ws.closed:
                sent[n] = time.perf_counter_ns()
                await ws.ping(n.to_bytes(8, "big"))
                n += 1
                await asyncio.sleep(interval_s * rng.uniform(0.5, 1.5))

        async def reader() -> None:
            async for msg in ws:
                if msg.type is WSMsgType.PONG:
                    t = time.perf_counter_ns()
                    n = int.from_bytes(msg.data, "big") if len(msg.data) == 8 else -1
                    if n in sent:
                        rtts.append((n, t - sent[n]))
                elif msg.type is WSMsgType.PING:
                    await ws.pong(msg.data)

        read = asyncio.create_task(reader())
        try:
            await asyncio.wait_for(pinger(), duration + 30.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(_all_answered(sent, rtts, read)), drain_s)
        finally:
            counted = {n for n, t in sent.items() if t >= counted_from}
            ms = np.asarray([rtt / 1e6 for n, rtt in rtts if n in counted])
            answered = {n for n, _ in rtts}
            report = {"pings": len(counted), "pongs": len(ms), "lost": len(counted - answered),
                      "interval_ms": interval_s * 1000, "warmup_s": warmup_s, "duration_s": duration,
                      "rtt_ms": ({q: round(float(np.quantile(ms, v)), 4) for q, v in
                                  (("p50", 0.5), ("p99", 0.99), ("max", 1.0))} if len(ms) else
                                 {"p50": None, "p99": None, "max": None})}
            with contextlib.suppress(Exception):
                await ws.close()
            read.cancel()
            await asyncio.gather(read, return_exceptions=True)
            if not result.done():
                result.set_result(report)
        return ws

    app = web.Application()
    app.router.add_get("/", handle)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    address = await start_site(runner, host, unix_socket or None)
    _alarm(connect_timeout + duration + drain_s + 40.0)
    print(f"LISTENING {address}", flush=True)
    try:
        await asyncio.wait_for(connected.wait(), connect_timeout)
    except TimeoutError:
        report = {"error": f"no client connected within {connect_timeout:g} s"}
    else:
        report = await result
    for site in list(runner.sites):  # no second connection: a reconnecting client is refused at the socket
        await site.stop()
    await runner.cleanup()
    return report


async def _all_answered(sent: dict[int, int], rtts: list[tuple[int, float]], reader: asyncio.Task[None]) -> None:
    """Until every ping sent has its pong, or the connection is closed (its reader ended)."""
    while len(rtts) < len(sent) and not reader.done():
        await asyncio.sleep(0.01)


def _alarm(seconds: float) -> None:
    if hasattr(signal, "alarm"):
        signal.alarm(max(1, int(seconds)))


def start_probe(args: list[str], timeout: float = 30.0) -> tuple[subprocess.Popen, str]:  # type: ignore[type-arg]
    """Start ``python -m bench.ping_probe ARGS``; ``(proc, url)`` once it listens. Its RESULT
    is read with ``bench.loadgen.wait_result``."""
    proc = LoadgenProcess([sys.executable, "-m", "bench.ping_probe", *args], cwd=REPO_ROOT,
                          stdout=subprocess.PIPE, text=True)
    proc.lines = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=_pump, args=(proc.stdout, proc.lines), daemon=True).start()
    try:
        url = _next_line(proc, "LISTENING ", time.monotonic() + timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ping_probe", description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, required=True, help="seconds of pinging after the connect")
    p.add_argument("--warmup-s", type=float, default=0.0, help="pings sent before this are not counted")
    p.add_argument("--interval-ms", type=float, default=5.0)
    p.add_argument("--connect-timeout", type=float, default=60.0)
    p.add_argument("--drain-s", type=float, default=DRAIN_S,
                   help="after the last ping, wait until every pong is in, at most this long")
    p.add_argument("--unix-socket", default="", help="serve on this unix socket instead of TCP (bench.unix)")
    a = p.parse_args(argv)
    report = asyncio.run(serve(a.duration, a.warmup_s, a.interval_ms / 1000, a.connect_timeout,
                               drain_s=a.drain_s, unix_socket=a.unix_socket))
    print("RESULT " + dumps(report).decode(), flush=True)
    return 0 if "error" not in report else 2


if __name__ == "__main__":
    sys.exit(main())
