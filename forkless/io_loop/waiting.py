"""How each thread waits for the other: park (sleep until woken) or spin (stay awake) while work is imminent.

A hand-off between the threads costs what waking the other thread costs (DESIGN.md, "Fast hand-offs between the
threads"; FORKLESS_HANDOFF's figures: docs/performance.md). Aeron's idle strategies and the LMAX Disruptor's wait
strategies are the models: a receiver that expects work soon does not go to sleep; one that expects none parks.

Rules:
- ``HANDOFFS``: ``park`` sleeps until woken; ``spin`` keeps the IO loop awake while a step is in flight and
  ``linger_s`` after the last one ended. ``auto`` is resolved once, by the main thread (``resolve_handoff``):
  ``spin`` on an accelerator, ``park`` on the CPU.
- Under one GIL one thread spins at a time, the main thread meanwhile blocking on the running step (which releases
  the GIL): two spinning threads take the GIL from each other.
- Without a GIL both threads spin while work is imminent (``WaitSettings.both``), the main thread for ``spin_s``
  after its last work, then it blocks; the IO thread is kept off the main thread's core (``keep_apart``), as a
  thread that sleeps is woken on its waker's core.
- Nothing holds the GIL while it waits: between looks a spinning thread ``pause``s, yielding its core or napping,
  the GIL released; never a bare loop.
- ``Expecting`` is the one record the two threads share for this: ``steps`` and ``until`` written by the main thread
  only, ``spinning`` by the IO thread only; each read, never written, by the other.
- One place decides how a loop thread waits: ``LoopThread(wait=...)``, under the IO thread and the portal alike;
  the bridge attaches its ``SpinningSelector`` to *outbound*.
- ``SpinningSelector``: while work is imminent its ``select`` looks at the sockets and at *outbound* between pauses
  and returns as soon as either has something; then it looks at *outbound* once more (a put made while
  ``spinning`` did not wake the loop) and parks as the default selector does.
"""

from __future__ import annotations

import os
import selectors
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from forkless.io_loop.gil import gil_status

__all__ = ["HANDOFFS", "NAP_S", "PARK", "SPIN_S", "Expecting", "SpinningSelector", "WaitSettings", "cpu_of",
           "keep_apart", "pause", "processor_of", "resolve_handoff", "spin", "wait_settings"]

HANDOFFS = ("auto", "park", "spin")
# a spinning thread's pause between looks: 0 yields the core (``os.sched_yield``, the GIL released,
# no sleep); a nap (``time.sleep``) costs less CPU, but even a short one can wake as late as a park
# (bench/handoff_wait.py measures it)
NAP_S = 0.0
SPIN_S = 0.002  # the IO loop spins on this long after the last step in flight ended: the next message is likely near


def pause(nap_s: float) -> None:
    """A spinning thread's pause between looks, the GIL released: a nap of ``nap_s``, or with 0 the
    core yielded to whatever else is runnable (``os.sched_yield``)."""
    if nap_s:
        time.sleep(nap_s)
    else:
        os.sched_yield()


def spin(look: Callable[[], bool], until: float, nap_s: float = NAP_S) -> bool:
    """Look between pauses (``pause(nap_s)``, the core yielded) until ``look()`` says yes (True) or ``until``
    (``time.monotonic()`` seconds) has passed (False): the main thread's spin, without a GIL."""
    while not look():
        if time.monotonic() >= until:
            return False
        pause(nap_s)
    return True


@dataclass(frozen=True)
class WaitSettings:
    """How the threads wait for each other (FORKLESS_HANDOFF, resolved: never ``auto``). ``both``: the main
    thread spins too; ``apart``: the IO thread is kept off the main thread's core (both only without a GIL)."""

    handoff: str = "park"  # "park" or "spin"
    nap_s: float = NAP_S
    spin_s: float = SPIN_S
    both: bool = False
    apart: bool = False

    @property
    def spins(self) -> bool:
        return self.handoff == "spin"


PARK = WaitSettings()  # the default: each thread sleeps until woken


def resolve_handoff(setting: str, platform: str) -> str:
    """``FORKLESS_HANDOFF``'s strategy on ``platform`` (the first device's: "cpu", "tpu", "gpu" …):
    ``auto`` spins on an accelerator, where a wake-up costs a step's fraction, and parks on the CPU,
    where spinning threads take cores from XLA's own threads and the feed's (a free-threaded build's
    two spinners take two: docs/performance.md has the measurements)."""
    if setting not in HANDOFFS:
        raise ValueError(f"handoff: {setting!r} is not one of {', '.join(HANDOFFS)}")
    if setting == "auto":
        return "park" if platform == "cpu" else "spin"
    return setting


def wait_settings(setting: str, platform: str, gil: bool | None = None) -> WaitSettings:
    """The resolved ``WaitSettings`` of ``FORKLESS_HANDOFF`` on ``platform``; ``gil``: whether the GIL is
    on (None: this interpreter's, now). Without a GIL a spin is both threads', kept apart."""
    gil = gil_status().enabled if gil is None else gil
    if resolve_handoff(setting, platform) == "park":
        return PARK
    return WaitSettings("spin", both=not gil, apart=not gil)


def cpu_of(native_id: int) -> int | None:
    """The CPU the thread ``native_id`` (``threading.get_native_id()``) of this process last ran on (Linux's
    /proc), None where that cannot be read."""
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as f:
            return processor_of(f.read())
    except OSError:
        return None


def processor_of(stat: bytes) -> int | None:
    """The "processor" field (39) of a /proc/…/stat line; None where it has none."""
    fields = stat[stat.rfind(b")") + 2:].split()  # after the name, which may hold spaces and ')': field 3 on
    try:
        return int(fields[36])
    except (IndexError, ValueError):
        return None


def keep_apart(main_native_id: int) -> set[int] | None:
    """On the calling thread (forkless's IO thread): keep it off the core the thread ``main_native_id`` (the
    controller's) runs on now, within the CPUs the host allows it (the host's affinity wins: it is only
    narrowed); the CPUs it had, for ``os.sched_setaffinity(0, ...)`` to give back, or None when nothing was
    changed (one CPU allowed, no affinity on this platform, the main thread's core unknown)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    main_cpu = cpu_of(main_native_id)
    if len(allowed) < 2 or main_cpu not in allowed:
        return None
    try:
        os.sched_setaffinity(0, allowed - {main_cpu})
    except OSError:  # a sandbox that refuses it: the threads wait as they would without
        return None
    return allowed


class Expecting:
    """What each thread expects of the other (see the module rules): one writer per field. ``spinning``
    is written and read under ``lock``: the IO thread clears it and then looks at *outbound* once more,
    the main thread puts and then reads it; the lock orders the two on any memory model (without it,
    only a GIL, or x86's, would), so a put is either seen by that last look or wakes the loop."""

    def __init__(self, linger_s: float = 0.0) -> None:
        self.steps = 0  # main thread: steps in flight, whose results will be put on outbound
        self.until = 0.0  # main thread: when the last step ended, plus linger_s (time.monotonic())
        self.spinning = False  # IO thread: its selector looks at outbound by itself (under ``lock``)
        self.linger_s = linger_s
        self.lock = threading.Lock()

    def expect(self, steps: int) -> int:
        """The main thread: ``steps`` steps are in flight now; how many were before. When the
        last one ends, the IO loop goes on spinning for ``linger_s``: the next message is likely near
        (``until`` is written before ``steps``, so the loop never sees no step and the old ``until``)."""
        before = self.steps
        if before and not steps:
            self.until = time.monotonic() + self.linger_s
        self.steps = steps
        return before

    def spinning_now(self) -> bool:
        """The main thread, after a put: whether the IO loop's selector will see it without a wake-up."""
        with self.lock:
            return self.spinning

    def spin(self, on: bool) -> None:
        """The IO thread: its selector starts (True) or stops (False) looking at *outbound* by itself."""
        with self.lock:
            self.spinning = on

    @property
    def imminent(self) -> bool:
        """The IO loop: work is expected (a step in flight, or one ended within ``linger_s``)."""
        return bool(self.steps) or time.monotonic() < self.until


class SpinningSelector(selectors.DefaultSelector):
    """A spinning loop's selector (see the module rules): ``LoopThread(wait=...)`` makes it under ``spin``, with
    the ``Expecting`` its main thread writes; the bridge ``attach``es what it looks at, on the loop's own thread."""

    def __init__(self, nap_s: float = NAP_S, linger_s: float = 0.0) -> None:
        super().__init__()
        self._nap_s = nap_s
        self.expecting = Expecting(linger_s)
        self._poll: Callable[[], bool] | None = None
        self.naps = 0  # how many naps it took (tests: a spin that naps, never a bare loop)

    def attach(self, poll: Callable[[], bool]) -> None:
        """While work is imminent, look at ``poll()`` too (True: it found an item on outbound and woke its reader)."""
        self._poll = poll

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        expecting, poll = self.expecting, self._poll
        if poll is None or timeout == 0 or not expecting.imminent:
            return super().select(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        ready: list[tuple[selectors.SelectorKey, int]] | None = None
        expecting.spin(True)
        try:
            ready = self._spin(expecting, poll, deadline)
        finally:
            expecting.spin(False)
        if poll():  # put while ``spinning`` was set: the main thread did not wake the loop
            return ready or []
        if ready is not None:
            return ready
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        return super().select(remaining)

    def _spin(self, expecting: Expecting, poll: Callable[[], bool],
              deadline: float | None) -> list[tuple[selectors.SelectorKey, int]] | None:
        """Look at the sockets and at outbound between pauses while work is imminent; what is ready
        (None: none is any more)."""
        nap, look = self._nap_s, super().select
        while expecting.imminent:
            ready = look(0)
            if ready or poll():
                return ready
            if deadline is not None and time.monotonic() >= deadline:
                return []
            self.naps += 1
            pause(nap)
        return None
