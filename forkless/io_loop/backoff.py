"""Reconnect policy: exponential backoff with jitter, reset only after a stable connection, and,
where asked, a cap that follows a young outage (a peer back soon is reconnected to soon).

Rules (pure: no clock, no sleeping; the caller passes ``now`` and sleeps the returned delay):
- After the k-th failure in a row the longest delay is ``cap = min(max_s, min_s * 2**(k-1))``;
  the delay is uniform in ``[max(min_s, cap * (1 - jitter)), cap]``: ``jitter=1`` is full jitter
  (the default, the built-in feeds'), ``jitter=0`` no jitter.
- ``follow_s`` (None: off) makes the delay follow the outage: while the outage (from the lost
  connection, or the first failed attempt) is ``age`` seconds old, ``cap`` is also at most
  ``max(follow_s, age * follow_ratio)``. A peer back within ``follow_s / follow_ratio`` seconds
  (5 s with 0.5 and 0.1) is reconnected to within ``follow_s`` of its return; after a longer
  outage within ``follow_ratio`` of the outage's length, and a peer that stays down is tried
  every ``max_s`` at most. Without ``now`` (``failed()``), the age is unknown and not used.
- A connection that stayed up at least ``reset_s`` resets k to 0 and ends the outage when it
  ends; one that drops sooner counts as a failure and the outage goes on, so a server that
  accepts then closes at once is not hammered (the opposite of resetting on every open).
- With ``tries > 0``, the ``tries``-th failure in a row gives up: ``failed`` returns None.
- A ``Backoff`` holds the count of one connection's failures: ``fresh()`` is the same policy
  with a count of its own, for a second user of one policy (``Relogin`` and ``IOPortal`` take a fresh one).
- ``DEFAULT_BACKOFF`` is the one policy of a client of your own that follows its peer: ``Relogin``'s
  reconnects (io_loop/relogin.py) and an ``IOPortal``'s restarts of its worker (io_loop/portal.py,
  ``RestartPolicy``) both use it unless given another (docs/embedding/reconnects.md).
"""

from __future__ import annotations

import numbers
import random
from typing import TYPE_CHECKING

from forkless.io_loop.seconds import seconds, whole

if TYPE_CHECKING:
    from forkless.io_loop.settings import ReconnectSettings

__all__ = ["DEFAULT_BACKOFF", "Backoff"]

MAX_EXPONENT = 64  # 2**64 times any sensible min_s is far past any max_s


def _seconds(name: str, value: object, *, zero: bool = False) -> float:
    return seconds(value, f"Backoff's {name}", zero=zero)  # any real number (io_loop/seconds.py)


class Backoff:
    """The delay before each reconnect attempt (see the module rules). ``Backoff(min_s, max_s,
    reset_s, tries)`` is the built-in feeds' (``FORKLESS_RECONNECT_*``); ``jitter`` is the random
    part of each delay (0 to 1); ``follow_s`` and ``follow_ratio`` the cap of a young outage."""

    def __init__(self, min_s: float = 0.05, max_s: float = 5.0, reset_s: float = 5.0, tries: int = 0,
                 rng: random.Random | None = None, *, jitter: float = 1.0, follow_s: float | None = None,
                 follow_ratio: float = 0.1) -> None:
        self.min_s = _seconds("min_s", min_s)
        self.max_s = _seconds("max_s", max_s)
        if self.max_s < self.min_s:
            raise ValueError(f"Backoff's max_s ({max_s!r}) is less than its min_s ({min_s!r}): the longest delay "
                             "cannot be shorter than the first")
        self.reset_s = _seconds("reset_s", reset_s, zero=True)
        tries = whole(tries, "Backoff's tries", means_zero="never give up")
        if isinstance(jitter, bool) or not isinstance(jitter, numbers.Real) or not 0 <= jitter <= 1:
            raise ValueError(f"Backoff's jitter is the random part of each delay, from 0 (none) to 1 (the whole "
                             f"delay), not {jitter!r}")
        self.follow_s: float | None = None if follow_s is None else _seconds("follow_s", follow_s)
        self.follow_ratio: float = _seconds("follow_ratio", follow_ratio, zero=True)
        self.tries: int = tries
        self.jitter: float = float(jitter)
        self.failures: int = 0
        self._rng: random.Random = rng or random.Random()
        self._up_since: float | None = None
        self._outage_since: float | None = None  # when the outage began (a connection lost, an attempt failed)

    @classmethod
    def of(cls, reconnect: ReconnectSettings) -> Backoff:
        """The policy of ``FORKLESS_RECONNECT_*`` (io_loop/settings.py's ``ReconnectSettings``)."""
        return cls(reconnect.min_s, reconnect.max_s, reconnect.reset_s, reconnect.tries)

    def fresh(self, *, tries: int | None = None) -> Backoff:
        """The same policy (``tries`` replaced, if given) with a failure count of its own."""
        return Backoff(self.min_s, self.max_s, self.reset_s, self.tries if tries is None else tries, rng=self._rng,
                       jitter=self.jitter, follow_s=self.follow_s, follow_ratio=self.follow_ratio)

    def __repr__(self) -> str:
        follow = "" if self.follow_s is None else f", follow_s={self.follow_s}, follow_ratio={self.follow_ratio}"
        return (f"Backoff(min_s={self.min_s}, max_s={self.max_s}, reset_s={self.reset_s}, tries={self.tries}, "
                f"jitter={self.jitter}{follow})")

    def connected(self, now: float) -> None:
        self._up_since = now

    def disconnected(self, now: float) -> None:
        """A connection ended; it only wipes the failure count (and ends the outage) if it lasted
        ``reset_s``; the outage it begins is dated ``now``."""
        if self._up_since is not None and now - self._up_since >= self.reset_s:
            self.failures = 0
            self._outage_since = None
        self._up_since = None
        if self._outage_since is None:
            self._outage_since = now

    def failed(self, now: float | None = None) -> float | None:
        """Record one failure (an attempt that failed or a connection that ended) at ``now``; the
        delay before the next attempt, or None when ``tries`` failures in a row have been used up."""
        self.failures += 1
        if self.tries and self.failures >= self.tries:
            return None
        # the exponent is bounded: 2.0 ** 1024 overflows a float, and after ~1000 failures in a
        # row (hours at the cap, with tries=0) that would kill the IO thread
        cap = min(self.max_s, self.min_s * 2.0 ** min(self.failures - 1, MAX_EXPONENT))
        if self.follow_s is not None and now is not None:
            if self._outage_since is None:
                self._outage_since = now
            cap = min(cap, max(self.follow_s, (now - self._outage_since) * self.follow_ratio))
        cap = max(self.min_s, cap)
        return self._rng.uniform(max(self.min_s, cap * (1.0 - self.jitter)), cap)


# the first retry at once (0.05 s), then doubling, but at most 0.5 s while the outage is younger than
# 5 s (follow_s / follow_ratio): a peer restarted within that is followed within 0.5 s; after, at most
# a tenth of the outage's age, up to 5 s; each delay is between half and all of its cap (jitter 0.5);
# a connection that held 5 s starts the count again
DEFAULT_BACKOFF = Backoff(min_s=0.05, max_s=5.0, reset_s=5.0, jitter=0.5, follow_s=0.5, follow_ratio=0.1)
