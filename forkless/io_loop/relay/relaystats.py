"""The relay's figures (``forkless relay``): ``SeqGaps``, the gaps in the feeds' seqs, and
``RelayStats``, the publisher's counters (io_loop/connectors/jetstream/publisher.py), read through ``RelaySnapshot``.
Pure: no
threads, no clock, no nats-py.

Rules:
- ``SeqGaps`` follows each feed's ``seq`` (FORKLESS_RELAY_SEQ=feed: the feed numbers its messages
  one by one, as the demo feed does; ``stream``: each stream's own numbering; ``none``) and counts
  the messages whose seq jumps over missing ones, and the numbers jumped over, by reason: across a
  reconnect of the feed (the chunk's ``connection`` changed) or within one connection; a seq that
  goes back (a feed that restarted its numbering) is counted apart. The caller logs what it finds.
- ``RelayStats`` has one writer, the publisher on the IO thread; another thread reads it only
  through ``snapshot()`` (``copy_counts`` for the gap counters, io_loop/counters.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from forkless.io_loop.counters import copy_counts
from forkless.io_loop.relay.settings import SEQ_MODES

__all__ = ["ACROSS_RECONNECT", "GAP_REASONS", "WITHIN_CONNECTION", "Gap", "RelaySnapshot", "RelayStats", "SeqGaps"]

ACROSS_RECONNECT, WITHIN_CONNECTION = "across a reconnect", "within a connection"
GAP_REASONS = (ACROSS_RECONNECT, WITHIN_CONNECTION)


# ---- counting gaps (pure) -------------------------------------------------------------------------


@dataclass(frozen=True)
class Gap:
    """One message whose seq did not follow the previous one of its feed (or stream)."""

    feed: int
    stream: str
    before: int  # the previous seq
    seq: int
    reason: str  # one of GAP_REASONS

    @property
    def missing(self) -> int:
        """Numbers jumped over (0 when the seq went back or repeated)."""
        return max(0, self.seq - self.before - 1)


class SeqGaps:
    """Follows the seqs of each feed (``per="feed"``) or of each stream (``"stream"``); ``"none"``
    counts nothing. Pure: the caller passes each chunk's messages and logs what comes back."""

    def __init__(self, per: str) -> None:
        if per not in SEQ_MODES:
            raise ValueError(f"per must be one of {SEQ_MODES}")
        self.per = per
        self._last: dict[Any, tuple[int, int]] = {}  # key -> (seq, connection)
        self.gaps: Counter[str] = Counter()  # messages whose seq jumped, by reason
        self.missing: Counter[str] = Counter()  # numbers jumped over, by reason
        self.back: Counter[str] = Counter()  # messages whose seq went back or repeated, by reason

    def observe(self, feed: int, connection: int, seqs: list[Any], streams: list[str]) -> list[Gap]:
        """Follow one chunk's messages (in order); the gaps and goings-back found."""
        if self.per == "none":
            return []
        found: list[Gap] = []
        last = self._last
        by_stream = self.per == "stream"
        for seq, stream in zip(seqs, streams):
            key = (feed, stream) if by_stream else feed
            prev = last.get(key)
            last[key] = (seq, connection)
            if prev is None or seq == prev[0] + 1:
                continue
            reason = ACROSS_RECONNECT if connection != prev[1] else WITHIN_CONNECTION
            gap = Gap(feed, stream, prev[0], seq, reason)
            if seq > prev[0]:
                self.gaps[reason] += 1
                self.missing[reason] += gap.missing
            else:
                self.back[reason] += 1
            found.append(gap)
        return found


# ---- the counters ---------------------------------------------------------------------------------


@dataclass
class RelayStats:
    """Written by the IO thread only (the publisher); read elsewhere through ``snapshot()``."""

    taken: int = 0  # messages taken from inbound (each gets an id)
    published: int = 0  # first publications
    retried: int = 0  # publications again (after a failure)
    acked: int = 0  # messages the server acknowledged (stored, or a duplicate of one stored)
    duplicates: int = 0  # of those, acknowledged as duplicates (a retry of one already stored)
    held: int = 0  # taken and not yet acknowledged (waiting to be published, or published and unacknowledged)
    unpublished: int = 0  # held when the publisher was cancelled: never stored
    connects: int = 0
    reconnects: int = 0
    connect_failures: int = 0
    connected: bool = False
    state_since: float = 0.0  # wall-clock seconds of the last connect/disconnect
    last_error: str = ""
    gaps: SeqGaps = field(default_factory=lambda: SeqGaps("none"))

    def snapshot(self) -> RelaySnapshot:
        gaps = self.gaps
        return RelaySnapshot(
            taken=self.taken, published=self.published, retried=self.retried, acked=self.acked,
            duplicates=self.duplicates, held=self.held, unpublished=self.unpublished, connects=self.connects,
            reconnects=self.reconnects, connect_failures=self.connect_failures, connected=self.connected,
            state_since=self.state_since, last_error=self.last_error, gaps=copy_counts(gaps.gaps),
            missing=copy_counts(gaps.missing), back=copy_counts(gaps.back))


@dataclass(frozen=True)
class RelaySnapshot:
    """The publisher's figures at one moment (see ``RelayStats``)."""

    taken: int
    published: int
    retried: int
    acked: int
    duplicates: int
    held: int
    unpublished: int
    connects: int
    reconnects: int
    connect_failures: int
    connected: bool
    state_since: float
    last_error: str
    gaps: dict[str, int]
    missing: dict[str, int]
    back: dict[str, int]
