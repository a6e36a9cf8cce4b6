"""``FeedSpec``: one feed as forkless runs it, whatever its kind: its name, where it connects, what it is sent back,
its overflow, the connector room it belongs to (``kind``) and what only its connector reads (``options``). Pure.

Rules:
- Made by a connector room (its ``FORKLESS_FEEDS`` entry's schema, or the one-feed shorthand's settings), or by the
  composition root for a program's own source (``kind`` "": it has no connector).
- ``kind`` is read by io_loop/kinds.py and io_loop/feedlist.py alone (the two places a kind is told apart); what
  else forkless asks of a feed's connector options goes through ``FeedOptions`` (partitions, how its URL is shown),
  never by their type.
- A URL's credentials and a feed's ``subscribe`` and ``headers`` stay out of ``repr`` and messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from forkless.io_loop.net.netaddr import redact_url, unix_label
from forkless.io_loop.settings import ReplyPolicy

__all__ = ["FEED_NAME", "FeedOptions", "FeedSpec"]

FEED_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a feed's name (a FORKLESS_FEEDS entry's "name")


class FeedOptions(Protocol):
    """What a feed's connector adds to its ``FeedSpec`` (a JetStream feed's ``JetStreamSpec``), as the rest of
    forkless asks it: whether it consumes some partitions of its stream, which, and how its URL may be shown."""

    @property
    def partitioned(self) -> bool: ...
    @property
    def partition_count(self) -> int: ...
    @property
    def partitions(self) -> tuple[int, ...]: ...

    def with_partitions(self, partitions: tuple[int, ...]) -> Any: ...

    def shown_url(self, url: str) -> str: ...


@dataclass(frozen=True)
class FeedSpec:
    """One feed: a ``FORKLESS_FEEDS`` entry, the one ``FORKLESS_WS_URL`` names, or a program's own source. ``name``
    labels its metrics, logs and (with several feeds, unless ``FORKLESS_SHARED_STREAMS=1``) its streams'
    identities; ``url`` is where it connects; ``replies`` says what it is sent back; ``overflow`` and ``buffer``
    its own overflow (io_loop/spill.py: "" and None take FORKLESS_OVERFLOW and FORKLESS_SOURCE_BUFFER). What a
    WebSocket feed sends first and carries: ``subscribe``, ``headers``, ``unix_socket`` (reached through that
    unix-domain socket, ``url`` then giving only the handshake's path and Host). ``kind``: the connector room
    it belongs to ("" a program's own source); ``options``: what only its connector reads (``FeedOptions``)."""

    name: str
    url: str
    subscribe: str = field(default="", repr=False)  # sent as is on every new connection
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    required: bool = True  # /readyz waits for it
    replies: ReplyPolicy = "all"
    overflow: str = ""
    buffer: int | None = None
    unix_socket: str = ""  # a WebSocket feed's unix-domain socket ("": TCP to the URL's host and port)
    kind: str = ""
    options: FeedOptions | None = None

    def __repr__(self) -> str:  # the URL without credentials (user:password@ in a URL is a secret)
        via = f", unix_socket={self.unix_socket!r}" if self.unix_socket else ""
        return (f"FeedSpec(name={self.name!r}, url={self.shown_url!r}{via}, required={self.required!r}, "
                f"replies={self.replies!r}, kind={self.kind!r}, options={self.options!r})")

    @property
    def partitioned(self) -> bool:
        """It consumes some of its stream's partitions (a JetStream entry with ``"partition_count"``)."""
        return self.options is not None and self.options.partitioned

    @property
    def partition_count(self) -> int:
        """Its stream's partitions (0: not partitioned)."""
        return self.options.partition_count if self.options is not None else 0

    @property
    def partitions(self) -> tuple[int, ...]:
        """The partitions this instance owns, as resolved (``with_partitions``) or given in its entry."""
        return self.options.partitions if self.options is not None else ()

    def with_partitions(self, partitions: tuple[int, ...]) -> FeedSpec:
        """This partitioned feed owning ``partitions`` (resolved from FORKLESS_INSTANCE)."""
        if self.options is None or not self.options.partitioned:
            raise ValueError(f"{self.label} is not partitioned")
        return replace(self, options=self.options.with_partitions(tuple(partitions)))

    @property
    def shown_url(self) -> str:
        """The URL(s) as logs may show them: no credentials, no query."""
        return self.options.shown_url(self.url) if self.options is not None else redact_url(self.url)

    @property
    def label(self) -> str:
        """How messages name it: ``feed 'name' (ws://host/path)``, never with credentials or query;
        ``feed 'name' (ws://host/path via unix:/path)`` through a unix-domain socket."""
        if not self.url:  # a user's own source (or the demo feed, before its address is known)
            return f"feed {self.name!r}"
        via = f" via {unix_label(self.unix_socket)}" if self.unix_socket else ""
        return f"feed {self.name!r} ({self.shown_url}{via})"
