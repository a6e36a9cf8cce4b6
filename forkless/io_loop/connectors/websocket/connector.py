"""WebSocketConnector: one WebSocket feed (``FORKLESS_WS_URL``, an entry of ``FORKLESS_FEEDS`` with ``"url"``) or the
embedded demo feed (the feed with no url while no feed is configured), as the composition root sees it
(io_loop/connectors/connector.py's ``Connector``): its source, made with the settings groups it reads and the
embedder's connect hooks; it keeps no position, owns no partitions and has no sink.

Rules:
- Made for every configured feed that is not a JetStream one by controller/ioside.py's ``connector_for`` (the one
  place a feed's kind is decided), at the composition root (``feed_plan``, ``feed_sources``, ``--check``); nothing
  outside this room imports its client, its connecting, its probe or the demo feed (tests/docs/test_architecture.py).
- ``source``: a ``WebSocketSource`` (client.py) with the timeouts, reconnect policy, TLS, credentials,
  ``max_msg_bytes`` and the hooks (``on_connect``, ``before_connect``); for the feed with no url while the demo feed
  runs (``demo`` given), a ``DemoSource`` (demo_source.py) whose client is that same ``WebSocketSource``, pointed
  at the demo's server. ``--check`` tries either through its source's ``probe`` (probe.py). A feed with no url
  where the demo feed does not run has nowhere to connect: ``ValueError``.
- What only a JetStream feed does is refused naming the feed (``ValueError``): owning partitions, a relay's sink.
- ``describe`` says nothing beyond the variables: the probe says what a WebSocket feed's connection carries
  (headers by name, TLS, the subscribe message).
"""

from __future__ import annotations

from typing import Any

from forkless.io_loop.connectors.connector import OwnedPartitions
from forkless.io_loop.connectors.websocket.before_connect import BeforeConnect
from forkless.io_loop.connectors.websocket.client import WebSocketSource
from forkless.io_loop.connectors.websocket.on_connect import OnConnect
from forkless.io_loop.settings import (
    Credentials,
    DemoSettings,
    FeedSpec,
    Limits,
    PartitionSettings,
    ReconnectSettings,
    Timeouts,
    TlsSettings,
)
from forkless.io_loop.source import Source

__all__ = ["WebSocketConnector"]


class WebSocketConnector:
    """One WebSocket feed's connector (see the module rules)."""

    positions = None  # a WebSocket feed cannot be replayed: no position in a checkpoint
    partitioned = False

    def __init__(self, feed: FeedSpec) -> None:
        if feed.jetstream is not None:
            raise ValueError(f"{feed.label} is a JetStream feed (its entry has \"nats\"): its connector is "
                             "JetStreamConnector")
        self.feed = feed

    def refuses_sends(self) -> str:
        return ""  # Controller.send's frames are written to its connection

    def describe(self, partitioning: PartitionSettings, instance: int | None, instances: int | None) -> list[str]:
        return []

    def own_partitions(self, partitioning: PartitionSettings, *, timeouts: Timeouts, reconnect: ReconnectSettings,
                       tls: TlsSettings, instances: int | None, instance: int | None = None,
                       stop: Any = None) -> OwnedPartitions:
        raise ValueError(f"{self.feed.label} is a WebSocket feed: it owns no partitions (only a JetStream feed with "
                         "\"partition_count\" has them)")

    def source(self, *, timeouts: Timeouts, reconnect: ReconnectSettings, tls: TlsSettings, credentials: Credentials,
               limits: Limits, partitioning: PartitionSettings, demo: DemoSettings | None = None,
               on_connect: OnConnect | None = None, before_connect: BeforeConnect | None = None,
               feeds_from_list: bool = False) -> Source:
        """The feed's ``WebSocketSource``, or the demo feed's ``DemoSource`` (see the module rules);
        ``feeds_from_list`` only says, in ``--check``'s report, where the subscribe message came from."""

        def client(feed: FeedSpec, url: str | None = None) -> WebSocketSource:
            return WebSocketSource(feed, timeouts=timeouts, reconnect=reconnect, tls=tls, credentials=credentials,
                                   max_msg_bytes=limits.max_msg_bytes, url=url, on_connect=on_connect,
                                   before_connect=before_connect, feeds_from_list=feeds_from_list)

        if self.feed.url:
            return client(self.feed)
        if demo is None:
            raise ValueError(f"{self.feed.label} has no url and the demo feed does not run: a WebSocket feed needs a "
                             "ws:// or wss:// url (the demo feed runs only while no feed is configured)")
        # only when it runs: the demo feed's server (demo_source.py has the reason)
        from forkless.io_loop.connectors.websocket.demo_source import DemoSource

        return DemoSource(self.feed, demo, timeouts=timeouts, client=client)

    def sink(self, relay: Any, stats: Any, feed_names: list[str]) -> Any:
        raise ValueError(f"{self.feed.label} is a WebSocket feed: the relay publishes to JetStream "
                         "(FORKLESS_RELAY_NATS), and a WebSocket feed is one of the relay's sources, not its sink")
