"""JetStreamConnector: one JetStream feed (a ``FORKLESS_FEEDS`` entry with ``"nats"``) as the composition root sees it
(``Connector``): its source, its positions' codec, its partitions owned with their fence, ``--check``'s lines.

Rules:
- Made by io_loop/kinds.py's ``connector_for``, the one place a feed's kind is decided; nats-py is imported only when
  a source, a sink or the partitions' store is made, so a configuration is read and checked without it.
- ``own_partitions`` starts the store, takes every owned partition's lease (``lease_key``; another live holder:
  ``LeaseHeld``, exit 2; a dead one's waited out unless the stop is set: ``StopRequested``) and checks the
  deployment record (``deployment_key``; another layout alive: ``DeploymentMismatch``, exit 2). The leases are the
  ``Fence`` of the source made after it, handed inside this room, through no other hand.
- A source made before the partitions are owned (``--check``'s probe, which publishes nothing) has no fence.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from typing import Any

from forkless.io_loop.connectors.connector import Fence, OwnedPartitions
from forkless.io_loop.connectors.jetstream.partitions import Layout, format_partitions
from forkless.io_loop.connectors.jetstream.positions import JetStreamPositions
from forkless.io_loop.connectors.jetstream.settings import PartitionSettings, spec_of
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.settings import Limits, ReconnectSettings, Timeouts, TlsSettings

__all__ = ["JetStreamConnector", "deployment_key", "lease_key"]

log = logging.getLogger("forkless.checkpoint")


def lease_key(stream: str, partition: int) -> str:
    """The KV key of a partition's lease: the stream name (characters a KV key cannot hold
    written as ``=XX``), a dot, the partition."""
    return f"{_key_safe(stream)}.{partition}"


def deployment_key(stream: str) -> str:
    """The KV key of the stream's deployment record (the partition count and instances its live
    instances run with), beside its partitions' leases."""
    return f"{_key_safe(stream)}.deployment"


def _key_safe(stream: str) -> str:
    return "".join(c if c.isascii() and (c.isalnum() or c in "-_") else "".join(f"={b:02X}" for b in c.encode())
                   for c in stream)


class _Owned:
    """The partitions a ``JetStreamConnector`` owns (io_loop/connectors/connector.py's ``OwnedPartitions``): the
    store's leases (its ``Fence``) and objects, and the layout."""

    def __init__(self, store: Any, layout: Layout, objects: bool) -> None:
        self._store = store  # a NatsStore (io_loop/connectors/jetstream/store.py)
        self.layout = layout
        self.objects = objects
        self.fence: Fence = store  # its holds(): every lease still held by time (any thread, no I/O)

    @property
    def unowned(self) -> tuple[int, ...]:
        return self._store.unowned

    def put(self, name: str, data: bytes) -> None:
        self._store.put(name, data)

    def get(self, name: str) -> bytes | None:
        return self._store.get(name)

    def names(self, prefix: str = "") -> list[str]:
        return self._store.names(prefix)

    def delete(self, name: str) -> None:
        self._store.delete(name)

    def close(self) -> None:
        self._store.close()


class JetStreamConnector:
    """One JetStream feed's connector (see the module rules)."""

    def __init__(self, feed: FeedSpec) -> None:
        self.feed = feed
        self.spec = spec = spec_of(feed)
        self.positions = JetStreamPositions(spec)
        self.partitioned = spec.partitioned
        self._owned: _Owned | None = None  # its partitions, once owned

    def refuses_sends(self) -> str:
        return (f"{self.feed.label} is a JetStream feed: it publishes replies to its results subject and is sent no "
                "frames")

    def refuses_relay(self) -> str:
        return ('a JetStream feed ("nats"): the relay publishes to FORKLESS_RELAY_NATS, it does not read a '
                "stream")

    def describe(self, partitioning: PartitionSettings) -> list[str]:
        spec = self.spec
        if not spec.partitioned:
            return []
        given = (f"FORKLESS_INSTANCE {partitioning.instance} of FORKLESS_INSTANCES {partitioning.instances}"
                 if partitioning.instance is not None else 'its "partitions"')
        kept = f"in bucket {partitioning.checkpoint_bucket!r}" if partitioning.checkpoint_bucket else "off"
        return [f"{self.feed.label}: partitioned, partition_count {spec.partition_count}; this instance owns "
                f"{format_partitions(spec.partitions)} ({len(spec.partitions)} of {spec.partition_count}, from "
                f"{given}); checkpoints {kept}, leases in {partitioning.lease_bucket!r} for "
                f"{partitioning.lease_s:g} s"]

    def own_partitions(self, partitioning: PartitionSettings, *, timeouts: Timeouts, reconnect: ReconnectSettings,
                       tls: TlsSettings, stop: Any = None) -> OwnedPartitions:
        """Connect, take the leases (blocking: a dead holder's are waited out), check the deployment record; the
        sources made from now on are fenced by the leases (see the module rules). ``stop`` (a ``threading.Event``)
        set meanwhile: ``StopRequested``, with nothing held."""
        # nats-py is an optional extra, loaded only by a process with a partitioned JetStream feed
        from forkless.io_loop.connectors.jetstream.store import NatsStore

        spec = self.spec
        if not spec.partitioned:
            raise ValueError(f"{self.feed.label} is not partitioned (no \"partition_count\"): it owns no partitions")
        holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        store = NatsStore(self.feed, timeouts=timeouts, reconnect=reconnect, tls=tls,
                          bucket=partitioning.checkpoint_bucket or None, lease_bucket=partitioning.lease_bucket,
                          lease_s=partitioning.lease_s, holder=holder)
        store.start(stop)
        try:
            store.acquire([lease_key(spec.stream, p) for p in spec.partitions], stop)
            # after the leases (a dead deployment's record expires with them): another layout alive is refused
            store.claim_deployment(deployment_key(spec.stream),
                                   {"partition_count": spec.partition_count, "instances": partitioning.instances},
                                   {lease_key(spec.stream, p): p for p in range(spec.partition_count)}, stop)
        except BaseException:
            store.close()
            raise
        which = "" if partitioning.instance is None else \
            f"instance {partitioning.instance} of {partitioning.instances}, "
        log.info("%s: holding the leases of partitions %s of %d (%sas %s)", self.feed.label,
                 format_partitions(spec.partitions), spec.partition_count, which, holder)
        self._owned = owned = _Owned(store, Layout(spec.stream, spec.partition_count, spec.partitions),
                                     objects=bool(partitioning.checkpoint_bucket))
        return owned

    def source(self, *, timeouts: Timeouts, reconnect: ReconnectSettings, tls: TlsSettings, limits: Limits,
               credentials: Any, partitioning: PartitionSettings, demo: Any = None, features: int = 0,
               warmup: int = 0, on_connect: Any = None, before_connect: Any = None,
               feeds_from_list: bool = False) -> Any:
        """The feed's ``JetStreamSource``, fenced by the partitions this connector owns (none: no fence).
        ``credentials``, ``demo``, ``features``, ``warmup``, the hooks and ``feeds_from_list`` are a WebSocket
        feed's: a JetStream feed's credentials are its entry's (``JetStreamSpec``), and its connections take no
        hooks."""
        # only with a JetStream feed: it imports nats-py, an optional extra (pip install ".[nats]")
        from forkless.io_loop.connectors.jetstream.source import JetStreamSource

        fence = self._owned.fence if self._owned is not None else None
        return JetStreamSource(self.feed, timeouts=timeouts, reconnect=reconnect, tls=tls,
                               max_msg_bytes=limits.max_msg_bytes, partitioning=partitioning, fence=fence)
