"""WebSocketConnector: one WebSocket feed (``FORKLESS_WS_URL``, a ``FORKLESS_FEEDS`` entry with ``"url"``) or the
embedded demo feed, as the composition root sees it (``Connector``): its source, made with the settings groups it
reads and the embedder's connect hooks. It keeps no position, owns no partitions, and has no sink: its source writes its
replies on the connection the messages came in on.

Rules:
- Made by io_loop/kinds.py's ``connector_for``; nothing outside this room imports its client, connecting, probe or
  demo feed (tests/docs/test_architecture.py).
- ``source``: a ``WebSocketSource``; for the feed with no url while the demo feed runs, a ``DemoSource`` whose
  client is that same ``WebSocketSource`` pointed at the demo's server. A feed with no url and no demo feed:
  ``ValueError``.
- Owning partitions is refused naming the feed (``ValueError``): only a JetStream feed has them.
"""

from __future__ import annotations

from typing import Any

from forkless.io_loop.connectors.connector import OwnedPartitions
from forkless.io_loop.connectors.websocket.before_connect import BeforeConnect
from forkless.io_loop.connectors.websocket.client import WebSocketSource
from forkless.io_loop.connectors.websocket.on_connect import OnConnect
from forkless.io_loop.connectors.websocket.settings import Credentials, DemoSettings
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.settings import Limits, ReconnectSettings, Timeouts, TlsSettings
from forkless.io_loop.source import Source

__all__ = ["WebSocketConnector"]


class WebSocketConnector:
    """One WebSocket feed's connector (see the module rules)."""

    positions = None  # a WebSocket feed cannot be replayed: no position in a checkpoint
    partitioned = False

    def __init__(self, feed: FeedSpec) -> None:
        self.feed = feed

    def refuses_sends(self) -> str:
        return ""  # Controller.send's frames are written to its connection

    def refuses_relay(self) -> str:
        return ""  # the relay reads WebSocket feeds

    def describe(self, partitioning: Any) -> list[str]:
        return []

    def own_partitions(self, partitioning: Any, *, timeouts: Timeouts, reconnect: ReconnectSettings,
                       tls: TlsSettings, stop: Any = None) -> OwnedPartitions:
        raise ValueError(f"{self.feed.label} is a WebSocket feed: it owns no partitions (only a JetStream feed with "
                         "\"partition_count\" has them)")

    def source(self, *, timeouts: Timeouts, reconnect: ReconnectSettings, tls: TlsSettings, limits: Limits,
               credentials: Credentials, partitioning: Any, demo: DemoSettings | None = None, features: int = 0,
               warmup: int = 0, on_connect: OnConnect | None = None, before_connect: BeforeConnect | None = None,
               feeds_from_list: bool = False) -> Source:
        """The feed's ``WebSocketSource``, or the demo feed's ``DemoSource`` (see the module rules): the demo feed's
        messages carry ``features`` values each, and it plants anomalies once a stream has sent ``warmup``;
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

        return DemoSource(self.feed, demo, timeouts=timeouts, client=client, features=features, warmup=warmup)
