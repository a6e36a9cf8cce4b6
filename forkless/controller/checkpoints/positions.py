"""Where each replayable feed's messages have reached in the main thread: the positions a checkpoint records beside
the state, and the replies it must wait for.

Rules:
- Pure: no threads, no clock; written by the main thread only (``after_batch``), read by it (``record`` at a
  checkpoint's T0) and by the stats snapshot.
- A feed's position is the ``Origin`` of the last of its messages a batch consumed, whatever became of it: the
  state as of the same batch boundary holds exactly the effect of the messages up to it.
- A checkpoint recording a position may be committed only once the feed confirmed every reply up to it
  (``unconfirmed``): after a kill -9 the messages at or below it are not replayed, so their replies must be stored.
- A feed's entry in a checkpoint is its ``PositionCodec``'s (io_loop/connectors/connector.py); nothing here knows
  a kind of feed. A restore checks the entry's kind (``written_by``) and ``identity`` (another is
  ``CheckpointMismatch``); a feed restored per partition keeps its restored ``floors`` until it consumes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from forkless.controller.errors import CheckpointMismatch
from forkless.io_loop.connectors.connector import PositionCodec, RestoredPosition
from forkless.io_loop.counters import SourceStats
from forkless.io_loop.crossing import Origin, PositionUnknown, Resume
from forkless.io_loop.errors import PositionLost
from forkless.io_loop.feedspec import FeedSpec

__all__ = ["SourcePositions", "UserPositions"]


class UserPositions:
    """The ``PositionCodec`` of the user's own source ``name`` that gives positions: ``{"position", "index",
    "last"}``, its own position kept as it gave it; no results stream to wait for."""

    kind = "a user's source"

    def __init__(self, name: str) -> None:
        self.name = name

    def written_by(self, entry: Mapping[str, Any]) -> bool:
        return "position" in entry

    def identity(self) -> dict[str, Any]:
        return {}

    def record(self, consumed: Origin | None, replied: Origin | None, floors: Mapping[int, Origin] | None,
               io: SourceStats | None, created: str) -> dict[str, Any]:
        assert consumed is not None  # recorded only once consumed
        return {"position": consumed.seq, "index": consumed.index, "last": consumed.last, "replied": None}

    def restore(self, entry: Mapping[str, Any]) -> RestoredPosition:
        origin = Origin(entry["position"], int(entry["index"]), bool(entry["last"]))
        return RestoredPosition(origin, origin)

    def when_unknown(self, why: str) -> PositionUnknown | None:
        raise PositionLost(f"{why}: the position of source {self.name!r} is unknown, and what the lost state held "
                           "cannot be replayed exactly; FORKLESS_CHECKPOINT_RESTORE=never starts it fresh")


class SourcePositions:
    """The replayable feeds' positions in the main thread (see the module rules): each feed of ``specs`` whose
    name ``codecs`` gives a ``PositionCodec`` (the connectors' and the user's sources')."""

    def __init__(self, specs: Sequence[FeedSpec], codecs: Mapping[str, PositionCodec] | None = None) -> None:
        codecs = codecs or {}
        self.specs = {i: spec for i, spec in enumerate(specs) if spec.name in codecs}
        self.codecs = {i: codecs[spec.name] for i, spec in self.specs.items()}
        self.consumed: dict[int, Origin] = {}  # feed index -> last consumed origin
        self.replied: dict[int, Origin] = {}  # feed index -> origin of the last reply frame handed over
        self.applied: dict[int, int] = dict.fromkeys(self.specs, 0)  # messages consumed in this process
        self.floors: dict[int, dict[int, Origin]] = {}  # feeds restored per partition: partition -> position
        self.created: dict[int, str] = {}  # feed index -> the stream's identity the restore recorded

    def __bool__(self) -> bool:
        return bool(self.specs)

    # ---- after each batch (main thread) ------------------------------------------------------------

    def after_batch(self, feeds: Sequence[int], origins: Sequence[Origin | None],
                    frame_origins: Sequence[Origin | None], frame_feeds: Sequence[int]) -> None:
        """A batch ran: ``feeds``/``origins`` per message, ``frame_origins``/``frame_feeds`` per
        reply frame handed to the IO side."""
        consumed, applied = self.consumed, self.applied
        for feed, origin in zip(feeds, origins):
            if origin is not None:
                consumed[feed] = origin
                applied[feed] += 1
        for feed, origin in zip(frame_feeds, frame_origins):
            if origin is not None:
                self.replied[feed] = origin

    # ---- checkpoints ----------------------------------------------------------------------------------

    def record(self, io: Mapping[str, SourceStats] | None = None) -> dict[str, dict[str, Any]]:
        """The positions as a checkpoint's header holds them, by feed name, each its codec's entry. ``io``: the IO
        side's ``SourceStats`` by feed name (what the feed covered, the stream's identity), for the codecs."""
        io = io or {}
        out = {}
        for i in sorted(set(self.consumed) | set(self.floors)):
            name = self.specs[i].name
            out[name] = self.codecs[i].record(self.consumed.get(i), self.replied.get(i), self.floors.get(i),
                                              io.get(name), self.created.get(i, ""))
        return out

    def restore(self, saved: Mapping[str, Any], path: Path | str) -> dict[str, Origin | Resume]:
        """Take the positions of a restored checkpoint; returns what each feed's source is handed, by feed name
        (``ctx.resume_from``). A feed of the checkpoint that is not configured now is left out; one whose entry
        another kind of feed wrote, or whose identity differs (its codec's ``identity``), raises
        ``CheckpointMismatch``. The replies it recorded are not taken: it was committed once they were stored."""
        by_name = {spec.name: i for i, spec in self.specs.items()}
        out: dict[str, Origin | Resume] = {}
        for name, pos in saved.items():
            i = by_name.get(name)
            if i is None:
                continue
            codec = self.codecs[i]
            if not codec.written_by(pos):
                raise CheckpointMismatch(path, f"feed {name!r}: kind", "another kind of feed", codec.kind)
            for key, now in codec.identity().items():
                if pos.get(key) != now:
                    raise CheckpointMismatch(path, f"{codec.kind.removeprefix('a ')} {name!r}: {key}", pos.get(key),
                                             now)
            restored = codec.restore(pos)
            if restored.consumed is not None:
                self.consumed[i] = restored.consumed
            if restored.floors:
                self.floors[i] = dict(restored.floors)
            if restored.created:  # the feed refuses a stream created at another time than the one recorded
                self.created[i] = restored.created
            out[name] = restored.resume
        return out

    def when_unknown(self, why: str) -> dict[str, PositionUnknown]:
        """Every checkpoint was damaged (``why``): what each feed's source is handed instead of a position (a codec
        whose source cannot tell whether it still holds everything raises ``PositionLost``)."""
        out = {}
        for i, spec in self.specs.items():
            unknown = self.codecs[i].when_unknown(why)
            if unknown is not None:
                out[spec.name] = unknown
        return out

    @staticmethod
    def unconfirmed(recorded: Mapping[str, Any], confirmed: Mapping[str, tuple[int, int]]) -> list[str]:
        """The feeds of ``recorded`` (``record()``'s form) whose last reply is not yet acknowledged
        by the results stream (``confirmed``: by feed name, the IO side's ``SourceStats.confirmed``)."""
        behind = []
        for name, pos in recorded.items():
            replied = pos.get("replied")
            if replied is not None and tuple(confirmed.get(name, (0, -1))) < tuple(replied):
                behind.append(f"feed {name!r} (replies up to {replied[0]}:{replied[1]} "
                              f"not yet acknowledged)")
        return behind
