"""Lifetime: what a started controller holds, each resource put on one exit stack as it is taken, and given back
once, in reverse, by one ``end(how)``.

Rules:
- ``Controller.start()`` takes, in order: the host's process settings (given back last), a partitioned instance's
  leases, the checkpoint writer, the IO side. ``end`` gives each back exactly once, in reverse, whatever ended the
  run; a second ``end`` does nothing; one raising does not keep the others (``contextlib.ExitStack``).
- How the run ended decides the waits: ``ORDERLY`` and ``LEASE_LOST`` give the IO side until the stop's deadline
  (``end_io``), and ``ORDERLY`` alone waits for the stop's checkpoint; ``ABORTED`` gives the IO side
  ``ABORT_JOIN_S`` (so the books are whole when the interrupt is raised); ``FAILED`` aborts it, not waited for, so a
  crashed IO thread never delays the exit.
- Nothing here exits the process; an IO thread that does not end is left behind (a daemon), ``abandoned_io`` says so.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from forkless.controller.ioside import IOSide
from forkless.controller.queues import StopDeadline

__all__ = ["ABORTED", "ABORT_JOIN_S", "FAILED", "LEASE_LOST", "ORDERLY", "Lifetime", "end_io"]

log = logging.getLogger("forkless.controller")

# After a second SIGINT (or a failure): how long the ending waits for the aborted IO thread
ABORT_JOIN_S = 0.5

ORDERLY = "orderly"  # stop(): everything processed and sent, the stop's checkpoint written
LEASE_LOST = "lease lost"  # stop() of a partitioned instance whose lease is lost: no checkpoint
ABORTED = "aborted"  # a second SIGINT: the IO side was aborted, nothing more is written
FAILED = "failed"  # the start failed or was stopped, or the IO side failed with no stop


def end_io(io: IOSide, deadline: StopDeadline, timeout_s: float) -> bool:
    """Join the IO side after an orderly stop so that the process can exit by ``deadline.at``
    whatever the socket does: it has until halfway between the work deadline and that to
    finish, is then aborted, and one that still runs at the deadline is left behind (a daemon:
    it cannot hold the exit). False: left behind (``timeout_s``: FORKLESS_SHUTDOWN_TIMEOUT_S)."""
    work, at = deadline.work, deadline.at
    assert work is not None and at is not None  # the stop fixed them
    if io.join(max(0.0, (work + at) / 2 - time.monotonic())):
        return True
    log.error("the IO thread did not finish within FORKLESS_SHUTDOWN_TIMEOUT_S=%s; aborting", timeout_s)
    io.abort()
    if io.join(max(0.0, at - time.monotonic())):
        return True
    log.error("the IO thread did not end after the abort; leaving it behind (it is a daemon)")
    return False


class Lifetime:
    """The resources of one run (see the module rules); ``deadline``: the stop's."""

    def __init__(self, deadline: StopDeadline) -> None:
        self.deadline = deadline
        self.abandoned_io = False  # True if the IO thread still ran when the ending gave up on it
        self._how = FAILED
        self._stack = contextlib.ExitStack()
        # a second SIGINT may be raised only where it cannot cut a give-back in half: before ``end``,
        # or while ``end`` waits for the IO side (see ``interruptible``)
        self._ending = False
        self._joining = False

    @property
    def interruptible(self) -> bool:
        """False while ``end`` gives back something other than the IO side (the host's settings, the
        leases): a ``KeyboardInterrupt`` raised there would leave it half given back."""
        return not self._ending or self._joining

    def hold(self, give_back: Callable[[], None]) -> None:
        """A resource taken; ``give_back()`` is called once by ``end``."""
        self._stack.callback(give_back)

    def hold_checkpoints(self, checkpoints: Any) -> None:
        """The checkpoint writer started (``Checkpointer``, or ``NoCheckpoints``)."""
        self._stack.callback(self._end_checkpoints, checkpoints)

    def hold_io(self, io: IOSide) -> None:
        """The IO side started."""
        self._stack.callback(self._end_io, io)

    def end(self, how: str) -> None:
        """Give back everything held, in reverse, ended ``how`` (``ORDERLY``, ``LEASE_LOST``,
        ``ABORTED``, ``FAILED``); once: a later call does nothing."""
        self._how = how
        self._ending = True
        self._stack.close()

    def _end_checkpoints(self, checkpoints: Any) -> None:
        orderly = self._how == ORDERLY
        if not checkpoints.end(self.deadline.at if orderly else None):
            log.error("the checkpoint of the stop was not written within FORKLESS_SHUTDOWN_TIMEOUT_S=%s",
                      self.deadline.timeout_s)

    def _end_io(self, io: IOSide) -> None:
        how = self._how
        if how == FAILED:  # an IO side that failed ends by itself (a daemon): not waited for
            io.abort()
            return
        self._joining = True
        try:
            ended = end_io(io, self.deadline, self.deadline.timeout_s) if how != ABORTED else io.join(ABORT_JOIN_S)
        except KeyboardInterrupt:  # a second SIGINT during the join: the IO side was aborted (Controller._on_signal);
            # its books are final once it has counted what it held: waited for as an aborted stop is, then raised
            self._joining = False
            if not io.join(ABORT_JOIN_S):
                self.abandoned_io = True
            raise
        finally:
            self._joining = False
        if not ended:
            self.abandoned_io = True
