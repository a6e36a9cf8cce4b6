"""What a running controller changes in its host process, and gives back exactly.

Rules:
- A library leaves its host alone: every process-wide setting the controller changes while it runs (the switch
  interval, the collector's frozen objects when asked, the handlers of ``HANDLED_SIGNALS``) is taken here and put
  back at the stop as the host had it. Thread CPU affinities change only while compiling (``unsplit_cpu_ops``);
  the collector's enablement is never touched.
- ``gc.freeze()`` and ``gc.unfreeze()`` act on the whole process: the controller freezes only when asked
  (``Runtime(freeze_gc=True)``) and nothing is frozen yet, and unfreezes only if nothing was frozen since.
- Several controllers may run with overlapping lives: each change has one process-wide owner (``_Owner``) counting
  its holders; the first takes the host's setting, the last restores it. A controller stopped while a later one's
  signal handlers are in place hands its place in the chain on (``_RETIRED``).
- SIGINT, SIGTERM and SIGHUP ask for the orderly stop, SIGUSR1 for a report (docs/running.md, "Signals"); a SIGHUP
  the host ignores (``nohup``) stays ignored; every other signal keeps the host's handling.
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

__all__ = ["HANDLED_SIGNALS", "ProcessSettings", "StopSignals"]

log = logging.getLogger("forkless.controller")


class _Owner:
    """The process-wide side of ``ProcessSettings``: one owner of each change, however many
    controllers run (see the module rules). Guarded by ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.interval_holders = 0
        self.interval: float | None = None  # the host's, while ours is set
        self.freeze_holders = 0
        self.frozen: int | None = None  # gc.get_freeze_count() right after our freeze


_OWNER = _Owner()

# what ``StopSignals`` takes while it is installed, where the platform has it (Windows has no SIGHUP, SIGUSR1)
HANDLED_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1") if hasattr(signal, name))


class ProcessSettings:
    """The switch interval and (optionally) the collector's frozen generation, changed by
    ``apply()`` and given back by ``restore()`` (idempotent: a second call does nothing). Each
    controller holds the changes through the process-wide owner: the first to apply makes them,
    the last to restore gives them back."""

    def __init__(self, *, switch_interval_s: float | None, freeze_gc: bool) -> None:
        self.switch_interval_s = switch_interval_s
        self.freeze_gc = freeze_gc
        self._holds_interval = False
        self._holds_freeze = False

    def apply(self) -> None:
        owner = _OWNER
        with owner.lock:
            if self.switch_interval_s and not self._holds_interval:
                if not owner.interval_holders:
                    owner.interval = sys.getswitchinterval()
                sys.setswitchinterval(min(sys.getswitchinterval(), self.switch_interval_s))
                owner.interval_holders += 1
                self._holds_interval = True
            if self.freeze_gc and not self._holds_freeze:
                self._hold_freeze(owner)

    def _hold_freeze(self, owner: _Owner) -> None:
        if owner.freeze_holders:  # another controller froze: this one holds that freeze too
            owner.freeze_holders += 1
            self._holds_freeze = True
        elif gc.get_freeze_count():
            log.info("the host has frozen %d objects (gc.freeze): the controller freezes none of its own",
                     gc.get_freeze_count())
        else:
            gc.collect()  # what startup left as garbage is freed, not kept
            gc.freeze()
            owner.frozen = gc.get_freeze_count()
            owner.freeze_holders = 1
            self._holds_freeze = True

    def restore(self) -> None:
        owner = _OWNER
        with owner.lock:
            if self._holds_interval:
                self._holds_interval = False
                owner.interval_holders -= 1
                if not owner.interval_holders and owner.interval is not None:
                    sys.setswitchinterval(owner.interval)
                    owner.interval = None
            if self._holds_freeze:
                self._holds_freeze = False
                owner.freeze_holders -= 1
                if not owner.freeze_holders and owner.frozen is not None:
                    if gc.get_freeze_count() <= owner.frozen:  # fewer: frozen objects that died meanwhile
                        gc.unfreeze()
                    else:  # someone froze more meanwhile: thawing would thaw theirs too
                        log.warning("objects were frozen (gc.freeze) by someone else while the controller ran: "
                                    "the controller leaves every frozen object frozen")
                    owner.frozen = None


# a stopped controller's handler, still in place under a later one's: its id -> (it, the handler it
# replaced); by id, as a host's handler need not be hashable (main thread only, as signal.signal)
_RETIRED: dict[int, tuple[Any, Any]] = {}


class StopSignals:
    """``HANDLED_SIGNALS`` handled by ``on_signal(signum)`` while installed (main thread only), but
    a SIGHUP the host ignores; ``restore()`` puts back exactly the handlers the host had (see the
    module rules)."""

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self._on_signal = on_signal
        self._previous: dict[int, Any] = {}
        self._ours: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in HANDLED_SIGNALS:
            if sig == getattr(signal, "SIGHUP", None) and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # nohup: the operator asked the process to outlive its terminal
            self._ours[sig] = ours = lambda signum, frame: self._on_signal(signum)
            self._previous[sig] = signal.signal(sig, ours)

    def restore(self) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            ours = self._ours.pop(sig)
            while id(handler) in _RETIRED:  # it replaced a controller's that stopped since: what that one replaced
                handler = _RETIRED.pop(id(handler))[1]
            if signal.getsignal(sig) is ours:  # None: a handler not set from Python, left as the default
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            else:  # a later controller's is in place: when it gives ours back, it gives back ours' predecessor
                _RETIRED[id(ours)] = (ours, handler)
