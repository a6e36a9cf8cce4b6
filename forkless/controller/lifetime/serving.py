"""serve: ``Controller.run()``'s loop between its start and its stop.

Rules:
- Main thread only; it calls what it is given (``process_pending``, ``stats``, ``out``) and
  owns nothing, so it runs and is tested without a controller; a source → sink run
  (controller/lifetime/sinkrun.py: the relay) serves with it too.
- It ends when ``stop_requested`` is set or ``duration_s`` is over (0: no end), checking at
  least every ``poll_s``; it prints a status line every ``status_s`` (0: none), each over the
  interval since the last, and catches up without a burst when a batch held it past one.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

from forkless.controller.stats import StatsSnapshot, status_line

__all__ = ["serve"]


def serve(process_pending: Callable[[float], int], stats: Callable[[], StatsSnapshot],
          out: Callable[[str], None], stop_requested: threading.Event, *, duration_s: float | None, status_s: float,
          poll_s: float, clock: Callable[[], float] = time.monotonic,
          line: Callable[[Any, Any], str] = status_line) -> StatsSnapshot:
    """Process until a stop is requested or ``duration_s`` is over; the snapshot it began with.
    ``clock``: the monotonic clock it reads (a test's own); ``line``: the status line of two
    snapshots (a source → sink run's own, controller/lifetime/sinkrun.py)."""
    started = clock()
    end = started + duration_s if duration_s else math.inf
    next_status = started + status_s if status_s > 0 else math.inf
    first = last = stats()
    while not stop_requested.is_set():
        now = clock()
        if now >= end:
            break
        if now >= next_status:
            snap = stats()
            out(line(snap, last))
            last = snap
            next_status += status_s
            if next_status < now:
                next_status = now + status_s
        process_pending(poll_s)
    return first
