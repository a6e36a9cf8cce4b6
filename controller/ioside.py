"""The IO side as the controller sees it: the interface it drives, and the real one's factory.

Rules:
- The controller starts, stops and observes the IO side only through ``IOSide``; the real one
  is ``io_loop.thread.IOThread``, and tests use a fake built on plain queues (tests/fake_io.py)
  with the same interface (the main thread's loop tested without sockets, as httpx's
  ``MockTransport`` tests a client).
- The IO thread gets what it needs as constructor arguments (settings, codec, counters to
  write, the whole-process snapshot, the metrics renderer, the embedder's connect hook, the
  restored JetStream positions), never attributes set on it from outside.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from controller.codec import Codec
from controller.config import Config
from controller.stats import IOSnapshot, IOStats, StatsSnapshot
from io_loop.on_connect import OnConnect
from io_loop.thread import IOThread

__all__ = ["IOFactory", "IOSide", "OnResults", "io_thread"]


class IOSide(Protocol):
    """What the controller needs from the IO side; ``io_loop.thread.IOThread`` is the real one,
    and tests use a fake built on plain queues (tests/fake_io.py) with the same interface."""

    failure: BaseException | None
    metrics_url: str | None
    demo: Any

    def start(self) -> Any: ...  # -> an object with ``inbound`` and ``outbound`` sync queues

    def request_stop(self, deadline: float | None = None) -> None: ...

    def join(self, timeout: float | None = None) -> bool: ...

    def abort(self) -> None: ...

    def raise_if_failed(self) -> None: ...

    def snapshot(self) -> IOSnapshot: ...

    def cpu_seconds(self) -> float: ...  # the IO thread's CPU seconds so far, from any thread (NaN: unknown)


OnResults = Callable[[list[Any], list[str], dict[str, np.ndarray]], None]
"""``on_results(seq, stream, outputs)``: called in the main thread after each step, before the
replies are handed to the IO thread; ``outputs`` maps each output name to a numpy array whose
leading axis is the batch's messages (padding already cut off), in arrival order."""

IOFactory = Callable[[Config, Codec, IOStats, Callable[[], StatsSnapshot]], IOSide]
"""Builds the IO side; ``Controller(on_connect=...)`` is bound into the default one (the real
IO thread), and a custom factory (the tests' fake IO side) makes no connections to call it on."""


def io_thread(config: Config, codec: Codec, stats: IOStats, snapshot: Callable[[], StatsSnapshot], *,
               on_connect: OnConnect | None = None, positions: dict[str, Any] | None = None,
               fence: Callable[[], bool] | None = None) -> IOSide:
    """The real IO side; ``positions``: the JetStream feeds' positions a restored checkpoint
    recorded (passed only when there are some); ``fence``: a partitioned instance's lease check,
    asked before each publication of replies (passed only by a partitioned instance)."""
    render = None
    if config.metrics_addr:
        from controller.metrics import exposition  # only when served: prometheus_client is about 10 MiB of RSS

        render = exposition(snapshot)
    return IOThread(config.io_settings(), codec, stats, stats_snapshot=snapshot, render_metrics=render,
                    on_connect=on_connect, positions=positions, fence=fence)
