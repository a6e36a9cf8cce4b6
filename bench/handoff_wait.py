"""How long a hand-off between two threads takes, by how the receiver waits (issue 53):

    python -m bench.handoff_wait [--rate 1000] [--seconds 2] [--out FILE]

Rules: two threads of one process, no sockets and no device. A sender hands a ``time.monotonic_ns``
stamp to a receiver ``--rate`` times a second; the receiver waits by one strategy at a time and
records how long each stamp took to reach it (the hand-off). Beside it, the sender's own "device
wait" (a GIL-free ``time.sleep(0.001)``, as a thread blocked on XLA) is timed from its due time to
the sender holding the GIL again: what a spinning receiver costs the other thread (CPython's GIL
goes to a waiter only when it wins the race, or after the switch interval). Strategies: ``park``
(``queue.Queue.get``: a condition), ``nap-N`` (``get_nowait``, then ``time.sleep(N µs)``), ``yield``
(``time.sleep(0)``), ``sched-yield`` (``os.sched_yield``). The switch interval is forkless's 1 ms,
given back at the end. Prints one JSON object: each strategy's hand-off and sender-wake p50/p99 µs,
and the receiver's CPU seconds a second.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

STRATEGIES = ("park", "nap-20", "nap-5", "yield", "sched-yield")


def _waiter(strategy: str) -> Callable[[queue.Queue], int]:
    """The receiver's wait for one stamp, by ``strategy``."""
    if strategy == "park":
        return lambda q: q.get()
    if strategy.startswith("nap-"):
        nap = int(strategy.removeprefix("nap-")) * 1e-6

        def napping(q: queue.Queue) -> int:
            while True:
                try:
                    return q.get_nowait()
                except queue.Empty:
                    time.sleep(nap)
        return napping
    pause = (lambda: time.sleep(0)) if strategy == "yield" else os.sched_yield

    def spinning(q: queue.Queue) -> int:
        while True:
            try:
                return q.get_nowait()
            except queue.Empty:
                pause()
    return spinning


def run(strategy: str, rate: float, seconds: float) -> dict[str, float]:
    """One strategy: the hand-offs' and the sender's wake-ups' quantiles (µs), the receiver's CPU."""
    handoffs: list[int] = []
    wakes: list[int] = []
    q: queue.Queue = queue.Queue()
    stop = object()
    wait = _waiter(strategy)
    cpu: list[float] = []

    def receive() -> None:
        t0 = time.thread_time()
        while True:
            stamp = wait(q)
            if stamp is stop:
                break
            handoffs.append(time.monotonic_ns() - stamp)
        cpu.append(time.thread_time() - t0)

    receiver = threading.Thread(target=receive, name="receiver")
    receiver.start()
    period = 1.0 / rate
    due = time.monotonic()
    end = due + seconds
    while due < end:
        time.sleep(0.001)  # the "device wait": the GIL released, then wanted back
        woke = time.monotonic()
        wakes.append(int((woke - (due + 0.001)) * 1e9))
        q.put(time.monotonic_ns())
        due += period
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    q.put(stop)
    receiver.join()
    h, w = np.array(handoffs[10:]) / 1e3, np.array(wakes[10:]) / 1e3
    return {"handoff_p50_us": float(np.percentile(h, 50)), "handoff_p99_us": float(np.percentile(h, 99)),
            "sender_wake_p50_us": float(np.percentile(w, 50)), "sender_wake_p99_us": float(np.percentile(w, 99)),
            "receiver_cpu_s_per_s": cpu[0] / seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.handoff_wait", description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=500.0, help="hand-offs a second (each after a 1 ms device wait)")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    try:
        results = {s: run(s, a.rate, a.seconds) for s in a.strategies.split(",")}
    finally:
        sys.setswitchinterval(interval)
    text = json.dumps(results, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
