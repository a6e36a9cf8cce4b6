"""What a running controller changes in its host process, and gives back exactly.

Rules:
- A library leaves its host alone: every process-wide setting the controller changes while it
  runs is taken here, remembered, and put back as it was at the stop — including what the
  host had set before: the switch interval, the collector's frozen objects (only when asked
  for), the SIGINT/SIGTERM handlers. Thread CPU affinities are changed only while compiling
  and given back there (controller/compiled.py ``unsplit_cpu_ops``); the collector's
  enablement is never touched.
- ``gc.freeze()`` acts on every object of the process and ``gc.unfreeze()`` thaws every frozen
  object, the host's too. So the controller freezes only when asked (``freeze_gc=True``: the
  ``forkless`` program asks, an embedder may), only when nothing is frozen yet, and unfreezes
  at the stop only if nothing was frozen since (the frozen count has not grown).
- Nothing here exits the process.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["ProcessSettings", "StopSignals"]

log = logging.getLogger("forkless.controller")


class ProcessSettings:
    """The switch interval and (optionally) the collector's frozen generation, changed by
    ``apply()`` and given back by ``restore()`` (idempotent: a second call does nothing)."""

    def __init__(self, *, switch_interval_s: float | None, freeze_gc: bool) -> None:
        self.switch_interval_s = switch_interval_s
        self.freeze_gc = freeze_gc
        self._interval: float | None = None  # the host's, while ours is set
        self._frozen: int | None = None  # gc.get_freeze_count() right after our freeze

    def apply(self) -> None:
        if self.switch_interval_s:
            self._interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._interval, self.switch_interval_s))
        if self.freeze_gc:
            if gc.get_freeze_count():
                log.info("the host has frozen %d objects (gc.freeze): the controller freezes none of its own",
                         gc.get_freeze_count())
            else:
                gc.collect()  # what startup left as garbage is freed, not kept
                gc.freeze()
                self._frozen = gc.get_freeze_count()

    def restore(self) -> None:
        if self._interval is not None:
            sys.setswitchinterval(self._interval)
            self._interval = None
        if self._frozen is not None:
            if gc.get_freeze_count() <= self._frozen:  # fewer: frozen objects that died meanwhile
                gc.unfreeze()
            else:  # someone froze more meanwhile: thawing would thaw theirs too
                log.warning("objects were frozen (gc.freeze) by someone else while the controller ran: the "
                            "controller leaves every frozen object frozen")
            self._frozen = None


class StopSignals:
    """SIGINT and SIGTERM handled by ``on_signal(signum)`` while installed (main thread only);
    ``restore()`` puts back exactly the handlers the host had."""

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self._on_signal = on_signal
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, lambda signum, frame: self._on_signal(signum))

    def restore(self) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():  # None: a handler not set from Python, left as the default
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
