"""What the composition root talks to for a feed that is a connector (bytewax's connectors are the model): a source
factory, a position codec, a partition owner with its fence, a probe (the source's own), and a sink. The protocols
only (pure); controller/ioside.py's ``connector_for`` chooses a feed's connector, and each connector's room
implements them (io_loop/connectors/jetstream/connector.py, io_loop/connectors/websocket/connector.py).

Rules:
- The controller never asks which kind of feed it runs: it asks the feed's ``Connector``. Every configured feed has
  one (a WebSocket feed's and the demo feed's, io_loop/connectors/websocket/; a JetStream feed's,
  io_loop/connectors/jetstream/); a user's own source is handed in made and has none. Its positions in a
  checkpoint are its ``PositionCodec``'s (``Connector.positions``); its partitions (a partitioned feed) are owned
  through ``Connector.own_partitions``, which returns an ``OwnedPartitions``: the leases, the checkpoint objects'
  store and the partitions' ``layout``; ``Connector.source`` makes its ``Source`` (io_loop/source.py), fenced by
  the partitions the connector owns; ``Connector.sink`` makes its ``RecordSink`` (io_loop/sinks/sink.py) for a relay.
- The fence is a typed object (``Fence``), handed by the connector that owns the leases to the source it makes,
  never a key in a dictionary of arguments: ``holds()`` is False once a lease is lost or ran out unrenewed, and
  then nothing more is published for those partitions.
- A connector's settings come as io_loop/settings.py's groups, never the whole ``IOSettings`` nor the
  configuration: ``Connector.source`` is handed every group a connector's source may read (each reads its own) and
  the embedder's connect hooks (a connector whose connections take none ignores them). What a codec records in a
  checkpoint's header is plain JSON (dicts, lists, numbers, strings).
- Pure: nothing here opens a socket, starts a thread or imports nats-py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from forkless.io_loop.counters import SourceStats
from forkless.io_loop.crossing import Origin, PositionUnknown, Resume
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

__all__ = ["Connector", "Fence", "OwnedPartitions", "PartitionLayout", "PositionCodec", "RestoredPosition"]


class Fence(Protocol):
    """Whether the partitions a connector owns may still be answered from here (any thread, no I/O)."""

    def holds(self) -> bool: ...


@dataclass(frozen=True)
class RestoredPosition:
    """A position read back from a checkpoint (``PositionCodec.restore``): ``resume``, what the feed's source is
    handed (``ctx.resume_from``); ``consumed``, the main thread's position until the next message (None: only
    per-partition ones, ``floors``); ``created``, the stream's identity the checkpoint recorded ("": none)."""

    resume: Origin | Resume
    consumed: Origin | None = None
    floors: Mapping[int, Origin] | None = None
    created: str = ""


class PositionCodec(Protocol):
    """How one replayable feed's position is written in a checkpoint's header and read back (see the module rules).
    ``kind`` names the feed's kind in a mismatch ("a JetStream feed")."""

    kind: str

    def written_by(self, entry: Mapping[str, Any]) -> bool:
        """``entry`` (a checkpoint's record for a feed of this name) was written by a codec of this kind."""
        ...

    def identity(self) -> dict[str, Any]:
        """What an entry must have recorded to be restored here (each key's value; another: ``CheckpointMismatch``)."""
        ...

    def record(self, consumed: Origin | None, replied: Origin | None, floors: Mapping[int, Origin] | None,
               io: SourceStats | None, created: str) -> dict[str, Any]:
        """The entry for a checkpoint: the last consumed origin, the last reply's, restored per-partition positions,
        the IO side's figures for the feed, the stream's identity restored before the IO side knew it."""
        ...

    def restore(self, entry: Mapping[str, Any]) -> RestoredPosition:
        """``entry`` read back (its identity already checked)."""
        ...

    def when_unknown(self, why: str) -> PositionUnknown | None:
        """What the source is handed when every checkpoint was damaged (``why``): a ``PositionUnknown`` (it decides at
        its first connection), or None when its position lies elsewhere (a partitioned feed's, per partition);
        ``PositionLost`` when the source cannot tell whether it still holds everything."""
        ...


class PartitionLayout(Protocol):
    """A partitioned feed's partitions: ``stream`` (named in the checkpoint objects), ``count`` of them, the
    ``partitions`` this instance owns."""

    @property
    def stream(self) -> str: ...
    @property
    def count(self) -> int: ...
    @property
    def partitions(self) -> tuple[int, ...]: ...

    def partition_of_names(self, names: Sequence[str]) -> Any:
        """Each stream name's partition (a numpy integer array), as the server computes it."""
        ...

    def shown(self, partitions: Sequence[int]) -> str:
        """``partitions`` as a short text ("0-5,9")."""
        ...


class OwnedPartitions(Protocol):
    """A partitioned instance's partitions, owned: its leases (renewed on a thread of their own), the checkpoint
    objects' store (``put``/``get``/``names``/``delete``: puts and deletes refused with ``LeaseLost`` once a lease
    is lost; ``get`` raising ``ObjectDamaged`` for an object that does not read back), the ``layout``, and the
    ``fence`` the connector's source asks before it publishes."""

    @property
    def layout(self) -> PartitionLayout: ...
    fence: Fence
    objects: bool  # a checkpoint bucket is configured: put/get/names/delete may be called

    @property
    def unowned(self) -> tuple[int, ...]: ...

    def put(self, name: str, data: bytes) -> None: ...
    def get(self, name: str) -> bytes | None: ...
    def names(self, prefix: str = "") -> list[str]: ...
    def delete(self, name: str) -> None: ...
    def close(self) -> None: ...


class Connector(Protocol):
    """One configured feed's connector (see the module rules): ``feed`` its spec; ``positions`` its codec (None: it
    keeps no position); ``partitioned``: it consumes some partitions of its stream, owned by one instance each."""

    feed: FeedSpec
    partitioned: bool

    @property
    def positions(self) -> PositionCodec | None: ...

    def refuses_sends(self) -> str:
        """Why ``Controller.send`` may not hand this feed frames ("": it may)."""
        ...

    def describe(self, partitioning: PartitionSettings, instance: int | None, instances: int | None) -> list[str]:
        """What ``--check`` shows of its configuration beyond the variables (lines, no secret)."""
        ...

    def own_partitions(self, partitioning: PartitionSettings, *, timeouts: Timeouts, reconnect: ReconnectSettings,
                       tls: TlsSettings, instances: int | None, instance: int | None = None,
                       stop: Any = None) -> OwnedPartitions:
        """Take the leases of its partitions (blocking), keep them renewed; its sources are fenced by them from
        now on. ``StopRequested`` once ``stop`` (a ``threading.Event``) is set while it waits, with nothing held."""
        ...

    def source(self, *, timeouts: Timeouts, reconnect: ReconnectSettings, tls: TlsSettings, credentials: Credentials,
               limits: Limits, partitioning: PartitionSettings, demo: DemoSettings | None = None,
               on_connect: Callable[[str, int], Any] | None = None,
               before_connect: Callable[[str, int], Any] | None = None, feeds_from_list: bool = False) -> Any:
        """Its ``Source`` (io_loop/source.py), fenced by the partitions it owns: ``demo``, the demo feed's settings
        where it runs (None: it does not); ``on_connect``, ``before_connect``, the embedder's connect hooks;
        ``feeds_from_list``: the feeds came from ``FORKLESS_FEEDS`` (what ``--check`` says)."""
        ...

    def sink(self, relay: Any, stats: Any, feed_names: list[str]) -> Any:
        """Its ``RecordSink`` for ``forkless relay`` (io_loop/sinks/sink.py): ``relay`` its ``RelaySettings``."""
        ...
