"""The exceptions the IO side ends a run with; the composition layer catches them by these names.

Rules:
- Defined here, in the leaf, and re-exported by ``controller.errors`` (the same classes), so a
  caller of the controller never reaches into the IO side's modules to catch them.
- ``IOThread.raise_if_failed`` re-raises ``FeedFatal``, ``MetricsServerError`` and ``PositionLost`` as they are;
  anything else that killed the IO thread becomes ``IOThreadError`` with it as cause.
- The exit status each maps to is stated in ``controller/errors.py``, with the others.
"""

from __future__ import annotations

__all__ = ["FeedFatal", "IOThreadError", "LeaseHeld", "LeaseLost", "MetricsServerError", "PositionLost"]


class FeedFatal(Exception):
    """The feed cannot be used (4xx handshake, tries used up): exit status 3."""


class PositionLost(Exception):
    """A JetStream stream no longer holds the messages the recorded position needs (retention
    removed them, or the stream was made again): the state cannot be continued exactly.
    Exit status 2; ``FORKLESS_CHECKPOINT_RESTORE=never`` accepts the loss."""


class LeaseHeld(Exception):
    """Another live instance holds the lease of partitions this one claims (issue 24): exit
    status 2. ``keys``: the leases' keys; ``holder``: who holds them."""

    def __init__(self, message: str, keys: list[str] | None = None, holder: str = "") -> None:
        super().__init__(message)
        self.keys = list(keys or [])
        self.holder = holder


class LeaseLost(Exception):
    """A partition's lease could not be renewed before it expired (another instance may own the
    partition now): this instance stops writing checkpoints and stops; exit status 3."""


class MetricsServerError(RuntimeError):
    """``FORKLESS_METRICS_ADDR`` cannot be served (bad address, port in use): exit status 2."""


class IOThreadError(RuntimeError):
    """The IO thread died of something unexpected; ``__cause__`` is what killed it: exit status 1."""
