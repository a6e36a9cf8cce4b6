"""A host program that runs two embedded controllers with overlapping lives, as a program with
two sessions (two exchanges, say) would, and reports what it finds of its own process-wide
settings before and after (tests/controller/lifetime/test_host.py).

    python -m tests.overlap_program

It sets a switch interval and a SIGTERM handler of its own, then runs, in turn: A start, B
start, A stop, B stop; A start, B start, B stop, A stop; and A's ``run()`` with B's ``run()``
inside A's ``on_results`` (each handles the signals while it runs). Both controllers freeze the
collector's objects (``freeze_gc=True``). Its last line of stdout is JSON: the settings before,
after each sequence, and during the first (while both ran).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from forkless import Config, Controller, OnResults, Runtime
from forkless.controller.processor import ewma_processor

PROCESSOR = ewma_processor()


class Ticks:
    """A source of its own: a message every few milliseconds until the stop."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def run(self, ctx: Any) -> None:
        seq = 0
        while not ctx.stopping.is_set():
            await ctx.emit(json.dumps({"seq": seq, "stream": "s", "x": [1.0] * ctx.features}))
            seq += 1
            await asyncio.sleep(0.005)
        async for _ in ctx.outgoing():
            pass


def controller(name: str, sinks: Sequence[OnResults] = (), **changes: Any) -> Controller:
    config = Config(features=4, max_batch=4, max_streams=8, status_s=0.0, **changes)
    return Controller(config, processor=PROCESSOR, sources=[Ticks(name)], sinks=sinks, runtime=Runtime(freeze_gc=True))


def host_handler(signum: int, frame: object) -> None:
    print(f"host handler: {signum}", flush=True)


def settings() -> dict[str, Any]:
    return {"switch_interval": sys.getswitchinterval(), "frozen": gc.get_freeze_count() > 0,
            "sigint": repr(signal.getsignal(signal.SIGINT)), "sigterm": repr(signal.getsignal(signal.SIGTERM))}


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    signal.signal(signal.SIGTERM, host_handler)
    sys.setswitchinterval(0.0123)
    found: dict[str, Any] = {"before": settings()}
    a, b = controller("a"), controller("b")
    a.start()
    b.start()
    found["during"] = settings()
    a.stop()
    b.stop()
    found["after A B A B"] = settings()
    a, b = controller("a"), controller("b")
    a.start()
    b.start()
    b.stop()
    a.stop()
    found["after A B B A"] = settings()
    b = controller("b", duration_s=0.2)
    ran: list[str] = []

    def run_b(seq: list, stream: list, outputs: dict) -> None:
        if not ran:
            ran.append("b")
            found["inside B"] = settings()
            b.run()
            found["B inside A ended"] = settings()

    a = controller("a", sinks=[OnResults(run_b)], duration_s=1.0)
    a.run()
    found["after nested runs"] = settings()
    print(json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
