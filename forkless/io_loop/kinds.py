"""The feed kinds forkless knows, as the composition root reaches them: a configured feed's connector, found by its
spec's ``kind`` (``connector_for``), and the relay's sink (``relay_sink``). With io_loop/feedlist.py (which room's
schema reads an entry of ``FORKLESS_FEEDS``), the one place a feed's kind is decided: the controller asks the
connector this hands it, never the kind.

Rules:
- A WebSocket feed's connector (the one-feed shorthand, a ``FORKLESS_FEEDS`` entry without ``"nats"``, the demo
  feed's place) is imported with this module; a JetStream feed's only when there is one (the connector imports no
  nats-py until it makes a source), and the relay's publisher only for the relay (it imports nats-py).
- A spec of a kind no room has is a ``ValueError`` naming the feed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from forkless.io_loop.connectors.connector import Connector
from forkless.io_loop.connectors.jetstream import settings as jetstream
from forkless.io_loop.connectors.websocket import settings as websocket
from forkless.io_loop.connectors.websocket.connector import WebSocketConnector
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.relay.settings import RelaySettings
from forkless.io_loop.settings import ReconnectSettings, Timeouts, TlsSettings

__all__ = ["connector_for", "relay_sink"]


def _jetstream(spec: FeedSpec) -> Connector:
    # only with a JetStream feed: its room (the connector itself imports no nats-py until it makes a source)
    from forkless.io_loop.connectors.jetstream.connector import JetStreamConnector

    return JetStreamConnector(spec)


# each kind's connector, by the kind its room's specs carry (io_loop/feedspec.py's ``FeedSpec.kind``)
CONNECTORS: dict[str, Callable[[FeedSpec], Connector]] = {websocket.WEBSOCKET: WebSocketConnector,
                                                          jetstream.JETSTREAM: _jetstream}


def connector_for(spec: FeedSpec) -> Connector:
    """The connector of one configured feed (io_loop/connectors/connector.py), by its kind: the composition root
    makes each once (controller/ioside.py's ``feed_plan``) and hands it to ``feed_sources``."""
    make = CONNECTORS.get(spec.kind)
    if make is None:
        raise ValueError(f"{spec.label} has no connector: its kind {spec.kind!r} is none of "
                         f"{', '.join(map(repr, CONNECTORS))} (a program's own source is handed in made)")
    return make(spec)


def relay_sink(relay: RelaySettings, stats: Any, feed_names: list[str], *, timeouts: Timeouts,
               reconnect: ReconnectSettings, tls: TlsSettings) -> Any:
    """The relay's ``RecordSink`` (io_loop/sinks/sink.py): the JetStream room's publisher to ``relay``'s servers.
    ``ImportError`` without nats-py (an optional extra: pip install ".[nats]")."""
    # only the relay publishes: it imports nats-py, an optional extra
    from forkless.io_loop.connectors.jetstream.publisher import Publisher

    return Publisher(relay, stats, feed_names, timeouts=timeouts, reconnect=reconnect, tls=tls)
