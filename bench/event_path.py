"""An event's way to the main thread, in CPU per event: forkless events-only against a plain thread.

    python -m bench.event_path [--events 2000] [--gap-ms 2] [--rounds 5]

The exchange session's hand-over without its sockets (bench/docs/exchange-session-cost.md): an
asyncio coroutine on another thread hands the main thread ``--events`` trade dicts, one every
``--gap-ms`` (one event a wake-up, as trades come in a session), and the main thread hands each
to the same ``on_event``. ``thread``: the coroutine runs in a plain ``threading.Thread`` with
``asyncio.run`` and puts ``(kind, event, ns)`` on a ``queue.Queue``; the main thread waits on
``get(timeout=0.1)``. ``forkless``: the coroutine is a user source of an events-only controller
(``ctx.emit_event``); the main thread calls ``process_pending(timeout=0.1)``. Each run's figures
are the CPU seconds (``time.thread_time``) each thread used over the events, per event, in
microseconds; the designs alternate within each round and the medians over the rounds are printed.
To compare two commits, run it in a checkout of each (``git worktree add``), alternately.

Rules:
- The two designs share the events, the gap and the ``on_event``; only the hand-over differs.
- Each thread's CPU is measured by the thread itself, over the events only (no start or stop).
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

WAIT_S = 0.1  # the main thread's wait for the next event (the session's main loop waits up to its tick)
SETTLE_S = 0.3  # before the first event: the controller's start is over


def trade(i: int) -> dict[str, Any]:
    return {"type": "trade", "symbol": "BTCUSDT", "price": f"37000.{i:04d}", "seq": i, "received_ns": 0}


def run_thread(events: int, gap_s: float) -> dict[str, float]:
    """The plain thread's hand-over: CPU seconds of the main thread and of the worker."""
    to_main: queue.Queue[Any] = queue.Queue()
    got: list[int] = []
    cpu: dict[str, float] = {}

    def on_event(source: str, event: dict[str, Any]) -> None:
        got.append(event["seq"])

    async def produce() -> None:
        await asyncio.sleep(SETTLE_S)
        t0 = time.thread_time()
        for i in range(events):
            to_main.put(("trade", trade(i), 0))
            await asyncio.sleep(gap_s)
        cpu["io"] = time.thread_time() - t0

    worker = threading.Thread(target=asyncio.run, args=(produce(),), name="worker")
    worker.start()
    t0 = time.thread_time()
    while len(got) < events:
        try:
            _kind, event, _ = to_main.get(timeout=WAIT_S)
        except queue.Empty:
            continue
        on_event("x", event)
    cpu["main"] = time.thread_time() - t0
    worker.join()
    return cpu


def run_forkless(events: int, gap_s: float) -> dict[str, float]:
    """Forkless's hand-over: CPU seconds of the main thread and of the IO thread."""
    from forkless import EVENTS_ONLY, Config, Controller

    got: list[int] = []
    cpu: dict[str, float] = {}

    def on_event(source: str, event: dict[str, Any]) -> None:
        got.append(event["seq"])

    class Producer:
        name = "x"
        replies = "none"

        async def run(self, ctx: Any) -> None:
            await asyncio.sleep(SETTLE_S)
            t0 = time.thread_time()
            for i in range(events):
                await ctx.emit_event(trade(i))
                await asyncio.sleep(gap_s)
            cpu["io"] = time.thread_time() - t0
            async for _ in ctx.outgoing():  # until the stop
                pass

    config = Config.from_env({"FORKLESS_STATUS_S": "0"})
    with Controller(config, processor=EVENTS_ONLY, sources=[Producer()], on_event=on_event) as ctl:
        while not got:  # the first event: the start is over on both threads
            ctl.process_pending(timeout=WAIT_S)
        t0, first = time.thread_time(), len(got)
        while len(got) < events:
            ctl.process_pending(timeout=WAIT_S)
        cpu["main"] = (time.thread_time() - t0) * events / (events - first)
    return cpu


DESIGNS: dict[str, Callable[[int, float], dict[str, float]]] = {"thread": run_thread, "forkless": run_forkless}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.event_path", description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=2000)
    p.add_argument("--gap-ms", type=float, default=2.0, help="between two events (one event a wake-up)")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    import jax  # noqa: F401  both programs of the session import it: its threads and memory are there in both

    names = list(DESIGNS)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(a.rounds):
        for name in names[r % 2:] + names[:r % 2]:  # alternating, the order turned each round
            runs[name].append(DESIGNS[name](a.events, a.gap_ms / 1e3))
    print("| design | main thread µs/event | IO thread µs/event | main, each round |\n|---|---|---|---|")
    for name, each in runs.items():
        main_us = [r["main"] / a.events * 1e6 for r in each]
        io_us = [r["io"] / a.events * 1e6 for r in each]
        print(f"| {name} | {statistics.median(main_us):.1f} | {statistics.median(io_us):.1f} | "
              f"{', '.join(f'{v:.1f}' for v in main_us)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
