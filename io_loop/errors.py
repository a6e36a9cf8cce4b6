"""The exceptions the IO side ends a run with; the composition layer catches them by these names.

Rules:
- Defined here, in the leaf, and re-exported by ``controller.errors`` (the same classes), so a
  caller of the controller never reaches into the IO side's modules to catch them.
- ``IOThread.raise_if_failed`` re-raises ``FeedFatal``, ``MetricsServerError`` and ``PositionLost`` as they are;
  anything else that killed the IO thread becomes ``IOThreadError`` with it as cause.
- ``LeaseHeld`` and ``LeaseLost`` come from the partition leases (``io_loop/natsstore.py``), raised
  to the thread that called the store, not through the IO thread.
- The exit status each maps to is stated in ``controller/errors.py``, with the others.
"""

from __future__ import annotations

__all__ = ["DeploymentMismatch", "FeedFatal", "IOThreadError", "LeaseHeld", "LeaseLost", "MetricsServerError",
           "PositionLost", "StopRequested"]


class FeedFatal(Exception):
    """The feed cannot be used (4xx handshake, tries used up): exit status 3."""


class PositionLost(Exception):
    """A JetStream stream no longer holds the messages the recorded position needs (retention
    removed them, or the stream was made again): the state cannot be continued exactly.
    Exit status 2; ``FORKLESS_CHECKPOINT_RESTORE=never`` accepts the loss."""


class LeaseHeld(Exception):
    """Another live instance holds partitions we claim: it renewed their leases while we waited
    (or took them first). ``keys``: the lease keys still held by others, sorted; ``holder``: who
    holds them (several holders joined by ", "). The message names both."""

    def __init__(self, keys: list[str], holder: str, message: str = "") -> None:
        super().__init__(message or f"the leases of {', '.join(keys)} are held by {holder!r}, which is alive")
        self.keys = list(keys)
        self.holder = holder

    def __reduce__(self) -> tuple:  # the default would call __init__ with the message only
        return type(self), (self.keys, self.holder, str(self))


class LeaseLost(Exception):
    """A partition lease of ours could not be renewed before it expired, or someone else took
    it: the partitions may have a new owner, so nothing more is written for them; the instance
    stops with exit status 3."""


class DeploymentMismatch(Exception):
    """Live instances sharing this partitioned stream were started with another partition count
    or number of instances (``FORKLESS_INSTANCES``), as the lease bucket's deployment record says:
    together the two layouts would leave partitions without an owner, or with two. ``recorded``
    and ``ours`` are the two layouts ({"partition_count": P, "instances": N}); the message names
    both. Exit status 2."""

    def __init__(self, recorded: dict, ours: dict, message: str = "") -> None:
        super().__init__(message or f"the live instances run with {recorded}, this one with {ours}")
        self.recorded = dict(recorded)
        self.ours = dict(ours)

    def __reduce__(self) -> tuple:
        return type(self), (self.recorded, self.ours, str(self))


class StopRequested(Exception):
    """The caller's stop was requested while the partition store waited for it (its connection
    retries, a dead holder's lease): what the call had taken is released. Not an error: the
    controller's start ends there, and the run stops cleanly (exit status 0)."""


class MetricsServerError(RuntimeError):
    """``FORKLESS_METRICS_ADDR`` cannot be served (bad address, port in use): exit status 2."""


class IOThreadError(RuntimeError):
    """The IO thread died of something unexpected; ``__cause__`` is what killed it: exit status 1."""
