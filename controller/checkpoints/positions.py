"""Where each JetStream feed's messages have reached in the main thread: the positions a
checkpoint records beside the state, and the replies it must wait for.

Rules:
- Pure: no threads, no clock; written by the main thread only (``after_batch`` after every
  batch), read by it (``record`` at a checkpoint's T0) and by the stats snapshot.
- A feed's position is the ``Origin`` (io_loop/crossing.py) of the last of its messages that a
  batch consumed, whatever became of it (a result, an error reply, no reply): the state as of
  the same batch boundary holds exactly the effect of the messages up to it. Origins reach the
  main thread in order, so "the last" is the batch's last message of that feed.
- ``replied``: the origin of the last reply frame handed to the IO side for that feed. The
  checkpoint recording a position may be committed only once the results stream has
  acknowledged every reply up to it (``unconfirmed``): after a kill -9 the messages at or below
  the position are not replayed, so their replies must already be stored.
- In a checkpoint's header, ``record()`` gives, by feed name: the stream and subject filter
  (a position is kept per subject of the feed: a restore with another stream or filter stops
  with ``CheckpointMismatch``), the position (``seq``, ``index``, ``last``) and ``replied``;
  and ``covered`` where the IO side found the stream holding no further message of the
  feed's subjects up to it (``SourceStats.covered``): a restore then resumes after it, so
  retention of other subjects' messages there loses nothing of the feed's (issue 30); and
  ``created``, the stream's created time at the IO side's first connection (before it, the
  restored checkpoint's): a restore hands it over with the position (``Resume``), and a stream
  created at another time is refused; a checkpoint without it (older) is not checked.
- A partitioned feed (issue 24) restores one position per owned partition (``floors``: each
  partition's object holds its own, controller/partitions/partitioned.py); the IO side starts at the
  lowest and skips, per partition, what that partition's state already holds. ``record()``
  then also gives ``partitions`` (partition -> [seq, index, last]), and ``seq`` is None until
  this run consumed a message of the feed; each partition's object records the further of
  the two. Its ``SourceStats.covered`` is given whole (``covering``: [handed, through]), and
  each partition's object records ``covered`` where its own position is at or past ``handed``,
  and ``created`` as above: its restore hands the floors over in a ``Resume`` as well.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from forkless.controller.errors import CheckpointMismatch
from forkless.io_loop.counters import SourceStats
from forkless.io_loop.crossing import Origin, Resume
from forkless.io_loop.settings import FeedSpec

__all__ = ["SourcePositions"]


class SourcePositions:
    """The replayable feeds' positions in the main thread (see the module rules): the JetStream
    feeds', and those of the user's own sources (``user``, by name) that give positions."""

    def __init__(self, specs: Sequence[FeedSpec], user: frozenset[str] = frozenset()) -> None:
        self.specs = {i: spec for i, spec in enumerate(specs) if spec.jetstream is not None or spec.name in user}
        self.consumed: dict[int, Origin] = {}  # feed index -> last consumed origin
        self.replied: dict[int, Origin] = {}  # feed index -> origin of the last reply frame handed over
        self.applied: dict[int, int] = dict.fromkeys(self.specs, 0)  # messages consumed in this process
        self.floors: dict[int, dict[int, Origin]] = {}  # partitioned feeds: partition -> restored position
        self.created: dict[int, str] = {}  # feed index -> the stream's created time the restore recorded

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
        """The positions as a checkpoint's header holds them (see the module rules). ``io``: the IO
        side's ``SourceStats`` by feed name: its ``covered`` (with the messages up to ``handed``
        handed over, the stream held none further of the feed's subjects up to ``through``): where
        the position is at or past ``handed``, every message of the feed's subjects up to
        ``through`` is in the state, recorded as ``covered`` (a partitioned feed's pair as
        ``covering``, for each partition's object to judge by its own position); its
        ``stream_created``, recorded as ``created`` (the restored one until the IO side has it)."""
        out = {}
        io = io or {}
        for i in sorted(set(self.consumed) | set(self.floors)):
            js = self.specs[i].jetstream
            origin = self.consumed.get(i)
            if js is None:  # a user's source: its own position, opaque here; no results stream to wait for
                out[self.specs[i].name] = {"position": origin.seq, "index": origin.index, "last": origin.last,
                                           "replied": None}
                continue
            replied = self.replied.get(i)
            out[self.specs[i].name] = entry = {
                "stream": js.stream, "subject": js.subject,
                "seq": None if origin is None else origin.seq, "index": None if origin is None else origin.index,
                "last": None if origin is None else origin.last,
                "replied": [replied.seq, replied.index] if replied is not None else None}
            source = io.get(self.specs[i].name)
            handed, through = source.covered if source is not None else (0, 0)
            # judged per partition, against each one's own position (controller/partitions/partitioned.py)
            if js.partitioned:
                if through > handed:
                    entry["covering"] = [handed, through]
            elif origin is not None and origin.last and handed <= origin.seq < through:
                entry["covered"] = through
            created = (source.stream_created if source is not None else "") or self.created.get(i, "")
            if created:  # (a connection that found another created time stopped the run: PositionLost)
                entry["created"] = created
            if i in self.floors:
                entry["partitions"] = {str(p): list(o) for p, o in self.floors[i].items()}
        return out

    def restore(self, saved: Mapping[str, Any], path: Path | str) -> dict[str, Origin | Resume | dict[int, Origin]]:
        """Take the positions of a restored checkpoint; returns them by feed name, for the IO side
        (a partitioned feed's: by partition); a JetStream feed's always in a ``Resume``, with the
        stream's created time the checkpoint recorded ("" when it did not). A feed of the
        checkpoint that is not configured now is left out; one whose stream or subject differs
        raises ``CheckpointMismatch``."""
        by_name = {spec.name: i for i, spec in self.specs.items()}
        out: dict[str, Origin | Resume | dict[int, Origin]] = {}
        for name, pos in saved.items():
            i = by_name.get(name)
            if i is None:
                continue
            js = self.specs[i].jetstream
            if js is None:  # a user's source
                if "position" not in pos:
                    raise CheckpointMismatch(path, f"feed {name!r}: kind", "a JetStream feed", "a user's source")
                self.consumed[i] = out[name] = Origin(pos["position"], int(pos["index"]), bool(pos["last"]))
                continue
            if "position" in pos:
                raise CheckpointMismatch(path, f"feed {name!r}: kind", "a user's source", "a JetStream feed")
            for key, now in (("stream", js.stream), ("subject", js.subject)):
                if pos.get(key) != now:
                    raise CheckpointMismatch(path, f"JetStream feed {name!r}: {key}", pos.get(key), now)
            # "replied" is not taken: that checkpoint was committed once its replies were stored
            resume: Origin | dict[int, Origin]
            if "partitions" in pos:
                self.floors[i] = resume = {int(p): Origin(int(o[0]), int(o[1]), bool(o[2]))
                                           for p, o in pos["partitions"].items()}
            else:
                resume = Origin(int(pos["seq"]), int(pos["index"]), bool(pos["last"]))
                if resume.last and int(pos.get("covered") or 0) > resume.seq:
                    # no message of the feed's subjects between them: the state holds all of them up to it
                    resume = Origin(int(pos["covered"]), 0, True)
                self.consumed[i] = resume
            # the IO side refuses a stream created at another time than the one recorded ("": not recorded)
            if pos.get("created"):
                self.created[i] = str(pos["created"])
            out[name] = Resume(resume, str(pos.get("created") or ""))
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
