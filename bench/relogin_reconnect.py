"""How soon ``Relogin`` reconnects after its exchange comes back (issue 55 "What to build" 3).

    python -m bench.relogin_reconnect [--outages 1,4,10] [--rounds 3] [--up-s 6]
        [--out bench/out/relogin_reconnect.json]

The toy exchange (``bench/exchange.py``) runs as a process of its own on a fixed port. Two
``forkless.Relogin`` clients in this process keep a session with it (a fresh login each time,
the pings answered): one with the old fixed policy (``Backoff(0.05, 5.0, 5.0)``: full jitter,
doubling to 5 s) and one with ``Relogin``'s default (``DEFAULT_BACKOFF``: doubling, but at most
0.5 s while the outage is younger than 5 s, then a tenth of its age up to 5 s, jitter 0.5).
For each outage length, each round: the sessions stay up ``--up-s`` (longer than the backoff's
``reset_s``, 5 s: a session that ends sooner continues the outage before it, by design), then the
exchange is killed (SIGKILL), stays down that long,
and is started again on the same port; once it prints ``listening on`` (its return) the time
until each client's next connection is its reconnect delay. Also counted: the attempts each
made while the exchange was down (what a peer that stays down sees). Prints a Markdown table
(per policy and outage: the delay's median and max over the rounds, attempts a round) and
writes every round's figures as JSON.

Rules:
- The exchange is a process of its own, killed and restarted on the same port; the clients are
  forkless's public API only (``from forkless import Backoff, Relogin``).
- A delay is from the restarted exchange's ``listening on`` line (read by this process) to the
  client's connection; both on this process's monotonic clock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from forkless import Backoff, Relogin

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "bench" / "out" / "relogin_reconnect.json"
POLICIES = {"old: 0.05 s doubling to 5 s": Backoff(0.05, 5.0, 5.0), "default (DEFAULT_BACKOFF)": None}
READY_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Exchange:
    """``python -m bench.exchange`` on ``port``: started, killed (SIGKILL) and started again."""

    def __init__(self, port: int) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[str] | None = None

    async def start(self) -> float:
        """Start it; the monotonic time it printed ``listening on``."""
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.exchange", "--port", str(self.port),
                                      "--ping-every", "2"], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), READY_TIMEOUT_S)
        at = time.monotonic()
        if "listening on" not in line:
            raise RuntimeError(f"the exchange did not start: {line!r}")
        return at

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc.stdout.close()
            self.proc = None


class Client:
    """A trader's session: log in, open the WebSocket, subscribe, answer the pings."""

    def __init__(self, url: str, http: aiohttp.ClientSession) -> None:
        self.url, self.http = url, http

    async def connect(self, attempt: int) -> aiohttp.ClientWebSocketResponse:
        async with self.http.post(f"{self.url}/login", json={"user": "alice", "password": "s3cret"}) as resp:
            resp.raise_for_status()
            token = (await resp.json())["token"]
        ws = await self.http.ws_connect(self.url.replace("http", "ws", 1) + "/ws", params={"token": token})
        await ws.send_str(json.dumps({"type": "subscribe", "symbols": ["BTCUSDT"]}))
        return ws

    async def serve(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        async for msg in ws:
            if msg.type is aiohttp.WSMsgType.TEXT and '"ping"' in msg.data:
                event = json.loads(msg.data)
                if event.get("type") == "ping":
                    await ws.send_str(json.dumps({"type": "pong", "id": event["id"]}))


async def until(predicate: Any, timeout_s: float, what: str) -> float:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.002)
    return time.monotonic()


async def reconnected(links: dict[str, Relogin], before: dict[str, tuple[int, int]], back_at: float,
                      timeout_s: float) -> dict[str, float]:
    """Each link's delay from ``back_at`` to its next connection, all watched at once (every 2 ms)."""
    delays: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(delays) < len(links):
        now = time.monotonic()
        for name, link in links.items():
            if name not in delays and link.connections > before[name][0] and link.connected:
                delays[name] = now - back_at
        if now > deadline:
            raise TimeoutError(f"not reconnected within {timeout_s}s: {sorted(set(links) - set(delays))}")
        await asyncio.sleep(0.002)
    return delays


async def measure(outages: list[float], rounds: int, up_s: float) -> list[dict[str, Any]]:
    exchange = Exchange(free_port())
    await exchange.start()
    runs: list[dict[str, Any]] = []
    try:
        async with aiohttp.ClientSession() as http:
            links = {name: Relogin(Client(exchange.url, http).connect, Client(exchange.url, http).serve,
                                   backoff=backoff, name=name)
                     for name, backoff in POLICIES.items()}
            for link in links.values():
                await link.__aenter__()
            try:
                await until(lambda: all(link.connected for link in links.values()), 30.0, "the first sessions")
                for k in range(rounds):
                    for outage_s in outages:
                        await asyncio.sleep(up_s)
                        before = {name: (link.connections, link.attempts_failed) for name, link in links.items()}
                        exchange.kill()
                        await asyncio.sleep(outage_s)
                        back_at = await exchange.start()
                        delays = await reconnected(links, before, back_at, outage_s + 30.0)
                        runs.append({"round": k, "outage_s": outage_s, "reconnect_s": delays,
                                     "attempts": {name: link.attempts_failed - before[name][1]
                                                  for name, link in links.items()}})
                        print(f"round {k} outage {outage_s:g} s: " + ", ".join(
                            f"{name} {delay:.3f} s after its return" for name, delay in delays.items()), flush=True)
            finally:
                for link in links.values():
                    await link.aclose()
    finally:
        exchange.kill()
    return runs


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| policy | outage s | reconnect after the return: median s | max s | attempts while down (median) |",
             "|---|---|---|---|---|"]
    for name in POLICIES:
        for outage_s in sorted({run["outage_s"] for run in runs}):
            mine = [run for run in runs if run["outage_s"] == outage_s]
            delays = [run["reconnect_s"][name] for run in mine]
            attempts = [run["attempts"][name] for run in mine]
            lines.append(f"| {name} | {outage_s:g} | {statistics.median(delays):.3f} | {max(delays):.3f} | "
                         f"{statistics.median(attempts):g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--outages", default="1,4,10", help="comma-separated outage lengths, seconds")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--up-s", type=float, default=6.0, help="seconds the sessions stay up before each kill")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    outages = [float(x) for x in args.outages.split(",")]
    runs = asyncio.run(measure(outages, args.rounds, args.up_s))
    text = table(runs)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": runs, "table": text, "cpus": os.cpu_count()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
