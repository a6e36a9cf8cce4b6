"""A JetStream feed's position in a checkpoint's header, written and read back (the connector's ``PositionCodec``):
what a checkpoint records per feed and a partitioned instance's objects per partition, in one place.

Rules:
- Pure: no threads, no clock, no nats-py. The entry is plain JSON by feed name, in the form every checkpoint
  written so far has: ``{"stream", "subject", "seq", "index", "last", "replied"}``, with ``covered`` (a restore
  resumes after it), ``created`` (the stream's created time: the feed refuses a stream made again), and for a
  partitioned feed ``partitions`` (partition -> [seq, index, last]) and ``covering`` ([handed, through]).
- Its ``identity`` is the stream and the subject filter: another is the caller's ``CheckpointMismatch``.
- A partition's object records the further of the feed's position and the partition's restored one, its own
  subject, and ``covered`` where its position is at or past ``handed`` (``partition_entry``); read back
  (``partition_position``), a ``covered`` past the position is where the partition resumes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from forkless.io_loop.connectors.connector import RestoredPosition
from forkless.io_loop.connectors.jetstream.partitions import partition_subjects
from forkless.io_loop.connectors.jetstream.settings import JetStreamSpec
from forkless.io_loop.counters import SourceStats
from forkless.io_loop.crossing import Origin, PositionUnknown, Resume

__all__ = ["JetStreamPositions"]


class JetStreamPositions:
    """The ``PositionCodec`` of the JetStream feed whose settings are ``spec`` (see the module rules)."""

    kind = "a JetStream feed"

    def __init__(self, spec: JetStreamSpec) -> None:
        self.spec = spec

    def written_by(self, entry: Mapping[str, Any]) -> bool:
        return "position" not in entry  # a user's source writes its own "position"

    def identity(self) -> dict[str, Any]:
        return {"stream": self.spec.stream, "subject": self.spec.subject}

    def record(self, consumed: Origin | None, replied: Origin | None, floors: Mapping[int, Origin] | None,
               io: SourceStats | None, created: str) -> dict[str, Any]:
        entry: dict[str, Any] = {
            **self.identity(),
            "seq": None if consumed is None else consumed.seq, "index": None if consumed is None else consumed.index,
            "last": None if consumed is None else consumed.last,
            "replied": [replied.seq, replied.index] if replied is not None else None}
        handed, through = io.covered if io is not None else (0, 0)
        if self.spec.partitioned:  # judged per partition, against each one's own position (partition_entry)
            if through > handed:
                entry["covering"] = [handed, through]
        elif consumed is not None and consumed.last and handed <= consumed.seq < through:
            entry["covered"] = through
        created = (io.stream_created if io is not None else "") or created
        if created:  # (a connection that found another created time stopped the run: PositionLost)
            entry["created"] = created
        if floors:
            entry["partitions"] = {str(p): list(o) for p, o in floors.items()}
        return entry

    def restore(self, entry: Mapping[str, Any]) -> RestoredPosition:
        created = str(entry.get("created") or "")
        if "partitions" in entry:
            floors = {int(p): Origin(int(o[0]), int(o[1]), bool(o[2])) for p, o in entry["partitions"].items()}
            return RestoredPosition(Resume(floors, created), None, floors, created)
        origin = Origin(int(entry["seq"]), int(entry["index"]), bool(entry["last"]))
        if origin.last and int(entry.get("covered") or 0) > origin.seq:
            # no message of the feed's subjects between them: the state holds all of them up to it
            origin = Origin(int(entry["covered"]), 0, True)
        return RestoredPosition(Resume(origin, created), origin, None, created)

    def when_unknown(self, why: str) -> PositionUnknown | None:
        # a partitioned feed's positions are its partitions' objects' (every one of a partition damaged: refused
        # there); any other decides at its first connection whether its stream still holds everything
        return None if self.spec.partitioned else PositionUnknown(why)

    # ---- a partitioned feed's objects, one per partition ----------------------------------------------

    def partition_entry(self, entry: Mapping[str, Any] | None, partition: int) -> dict[str, Any] | None:
        """What partition ``partition``'s object records of ``entry`` (``record``'s): None when nothing of the
        feed was consumed yet and no position was restored for the partition."""
        if entry is None:
            return None
        floor = (entry.get("partitions") or {}).get(str(partition))
        cur = None if entry.get("seq") is None else [entry["seq"], entry["index"], entry["last"]]
        if floor is not None and (cur is None or _after(floor, cur)):
            cur = floor
        if cur is None:
            return None
        seq, index, last = cur
        (subject,) = partition_subjects(self.spec.subject, [partition])
        out = {"stream": entry["stream"], "subject": subject, "partition": partition,
               "seq": seq, "index": index, "last": last, "replied": entry.get("replied")}
        handed, through = entry.get("covering") or (0, 0)
        if last and handed <= seq < through:
            # the partition's state holds its messages up to seq, so up to handed: and the stream held none of
            # the feed's subjects' between handed and through
            out["covered"] = through
        if entry.get("created"):  # the stream the position counts in (a floor's: checked at the connection)
            out["created"] = entry["created"]
        return out

    def partition_position(self, entry: Mapping[str, Any]) -> tuple[list[Any], str]:
        """A partition's object's entry read back: its position ([seq, index, last]; past a ``covered``) and the
        stream's created time it recorded ("": none). The caller checks ``entry["stream"]`` first."""
        position = [int(entry["seq"]), int(entry["index"]), bool(entry["last"])]
        if entry["last"] and int(entry.get("covered") or 0) > int(entry["seq"]):
            # none of the partition's messages between them: its state holds all of them up to it
            position = [int(entry["covered"]), 0, True]
        return position, str(entry.get("created") or "")

    def from_partitions(self, positions: Mapping[int, Sequence[Any]], created: str) -> dict[str, Any]:
        """The entry a restore takes from the owned partitions' objects (their positions, by partition)."""
        return {**self.identity(), "created": created, "partitions": {str(p): list(pos) for p, pos in
                                                                      positions.items()}}


def _after(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Position ``a`` lies after ``b`` (both [seq, index, last])."""
    return (int(a[0]), int(a[1])) > (int(b[0]), int(b[1]))
