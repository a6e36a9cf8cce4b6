"""Reconnect policy: exponential backoff with full jitter, reset only after a stable connection.

Rules (pure: no clock, no sleeping; the caller passes ``now`` and sleeps the returned delay):
- After the k-th failure in a row the delay is uniform in [min_s, min(max_s, min_s * 2**(k-1))].
- A connection that stayed up at least ``reset_s`` resets k to 0 when it ends; one that
  drops sooner counts as a failure, so a server that accepts then closes at once is not
  hammered (the opposite of resetting on every open).
- With ``tries > 0``, the ``tries``-th failure in a row gives up: ``failed`` returns None.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forkless.io_loop.settings import ReconnectSettings

__all__ = ["Backoff"]

MAX_EXPONENT = 64  # 2**64 times any sensible min_s is far past any max_s


class Backoff:
    def __init__(self, min_s: float, max_s: float, reset_s: float, tries: int = 0,
                 rng: random.Random | None = None) -> None:
        self.min_s = min_s
        self.max_s = max_s
        self.reset_s = reset_s
        self.tries = tries
        self.failures = 0
        self._rng = rng or random.Random()
        self._up_since: float | None = None

    @classmethod
    def of(cls, reconnect: ReconnectSettings) -> Backoff:
        """The policy of ``FORKLESS_RECONNECT_*`` (io_loop/settings.py's ``ReconnectSettings``)."""
        return cls(reconnect.min_s, reconnect.max_s, reconnect.reset_s, reconnect.tries)

    def connected(self, now: float) -> None:
        self._up_since = now

    def disconnected(self, now: float) -> None:
        """A connection ended; it only wipes the failure count if it lasted ``reset_s``."""
        if self._up_since is not None and now - self._up_since >= self.reset_s:
            self.failures = 0
        self._up_since = None

    def failed(self) -> float | None:
        """Record one failure (an attempt that failed or a connection that ended); the delay
        before the next attempt, or None when ``tries`` failures in a row have been used up."""
        self.failures += 1
        if self.tries and self.failures >= self.tries:
            return None
        # the exponent is bounded: 2.0 ** 1024 overflows a float, and after ~1000 failures in a
        # row (hours at the cap, with tries=0) that would kill the IO thread
        cap = min(self.max_s, self.min_s * 2.0 ** min(self.failures - 1, MAX_EXPONENT))
        return self._rng.uniform(self.min_s, max(self.min_s, cap))
