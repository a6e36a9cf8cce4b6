"""What the composition root talks to for a configured feed (bytewax's connectors are the model): its ``Connector``, a
source factory, a position codec, a partition owner with its fence, and a probe (the source's own). The protocols
only (pure); io_loop/kinds.py's ``connector_for`` finds a feed's connector by its kind, and each room implements them.

Rules:
- The controller never asks which kind of feed it runs: it asks the feed's ``Connector``. A user's own source is
  handed in made and has none. Positions in a checkpoint are its ``PositionCodec``'s; partitions are owned through
  ``own_partitions`` (an ``OwnedPartitions``: leases, the objects' store, the ``layout``); ``source`` makes its
  ``Source``, fenced by the partitions it owns.
- The fence is a typed object (``Fence``), handed by the connector that owns the leases to the source it makes,
  never a key in a dictionary of arguments: ``holds()`` False, and nothing more is published for those partitions.
- What every room shares besides: the words an entry's fault is refused in (``entry_refusal``, ``COMMON_REFUSALS``)
  and the form of a room's metric families (``FigureFamily``).
- A connector is handed settings groups, never the whole ``IOSettings`` or configuration, and the embedder's connect
  hooks (ignored where connections take none). What a codec records in a checkpoint is plain JSON.
- Pure: nothing here opens a socket, starts a thread or imports nats-py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from forkless.io_loop.counters import SourceStats
from forkless.io_loop.crossing import Origin, PositionUnknown, Resume
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.settings import REPLY_POLICIES, Limits, ReconnectSettings, Timeouts, TlsSettings

__all__ = ["COMMON_REFUSALS", "Connector", "Fence", "FigureFamily", "OwnedPartitions", "PartitionLayout",
           "PositionCodec", "RestoredPosition", "entry_refusal"]

# what the fields every connector's entry has allow, as a fault of one is reported (after "feed i ('name'): ")
COMMON_REFUSALS: dict[str, str] = {
    "name": '"name" must be 1-64 letters, digits, "_", "." or "-"',
    "required": '"required" must be true or false',
    "replies": f'"replies" must be one of {", ".join(map(repr, REPLY_POLICIES))}',
}
# where msgspec's message says which field: "… - at `$.buffer`", "… - at `$.headers[...]`", or
# "Object missing required field `url`" (the entry itself)
_AT_FIELD = re.compile(r" - at `\$\.(\w+)")
_MISSING = re.compile(r"^Object missing required field `(\w+)`")
_UNKNOWN = "Object contains unknown field"


def entry_refusal(message: str, item: Mapping[str, Any], fields: Sequence[str], refusals: Mapping[str, str],
                  fields_are: str = "; the fields are") -> str:
    """What a connector's entry schema reports for msgspec's ``message`` about ``item`` (an entry of
    ``FORKLESS_FEEDS`` whose ``fields`` are these): the faulty field's text in ``refusals``, never msgspec's own
    message, which may quote a secret value; for unknown fields, all of them (sorted) with the fields there are."""
    if message.startswith(_UNKNOWN):
        unknown = ", ".join(map(repr, sorted(set(item) - set(fields))))
        return f"unknown field(s) {unknown}{fields_are} {', '.join(fields)}"
    found = _MISSING.match(message) or _AT_FIELD.search(message)
    name = found.group(1) if found else ""
    # a message of a form not foreseen names no value either: only the fields there are
    return refusals.get(name, f"not a feed entry: its fields are {', '.join(fields)}")


@dataclass(frozen=True)
class FigureFamily:
    """A metric family a connector room declares for its feeds' figures (its ``figures.py``): the family's name in
    ``/metrics`` (``forkless_…``, without ``_total``), its type (``counter`` or ``gauge``), its help, and the
    attribute of a feed's figures it reads (controller/stats.py's ``SourceFigures``); controller/metrics.py renders
    it, one sample per feed, labelled ``feed``."""

    name: str
    type: str
    help: str
    attribute: str


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

    @property
    def feed(self) -> FeedSpec: ...
    @property
    def positions(self) -> PositionCodec | None: ...
    @property
    def partitioned(self) -> bool: ...

    def refuses_sends(self) -> str:
        """Why ``Controller.send`` may not hand this feed frames ("": it may)."""
        ...

    def refuses_relay(self) -> str:
        """What this feed is that ``forkless relay`` may not read ("a JetStream feed …"; "": it may read it)."""
        ...

    def describe(self, partitioning: Any) -> list[str]:
        """What ``--check`` shows of its configuration beyond the variables (lines, no secret); ``partitioning``
        the partitioned feeds' settings (io_loop/connectors/jetstream/settings.py's ``PartitionSettings``)."""
        ...

    def own_partitions(self, partitioning: Any, *, timeouts: Timeouts, reconnect: ReconnectSettings,
                       tls: TlsSettings, stop: Any = None) -> OwnedPartitions:
        """Take the leases of its partitions (blocking), keep them renewed; its sources are fenced by them from
        now on. ``StopRequested`` once ``stop`` (a ``threading.Event``) is set while it waits, with nothing held."""
        ...

    def source(self, *, timeouts: Timeouts, reconnect: ReconnectSettings, tls: TlsSettings, limits: Limits,
               credentials: Any, partitioning: Any, demo: Any = None, features: int = 0, warmup: int = 0,
               on_connect: Callable[[str, int], Any] | None = None,
               before_connect: Callable[[str, int], Any] | None = None, feeds_from_list: bool = False) -> Any:
        """Its ``Source`` (io_loop/source.py), fenced by the partitions it owns. Each connector reads the groups it
        needs: ``credentials`` (a WebSocket handshake's), ``partitioning`` (a partitioned feed's buckets),
        ``demo`` (the demo feed's settings where it runs, None where it does not, with ``features``, the length of
        a message's x, and ``warmup``, the default detector's); ``on_connect``, ``before_connect``, the embedder's
        connect hooks; ``feeds_from_list``: the feeds came from ``FORKLESS_FEEDS`` (what ``--check`` says)."""
        ...
