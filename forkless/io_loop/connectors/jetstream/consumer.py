"""Where a JetStream feed's consuming has reached and what each delivery means, pure: the stream's state, reply
subjects and subjects in, decisions out (websockets' protocol core is the model). No socket, no event loop, no
clock: source.py is the pump that asks ``Consumer`` at each step. What it guarantees, fault by fault:
docs/jetstream-exactly-once.md.

Rules:
- The position is ``next``: (the next stream sequence, good elements of it already handed over). It starts at the
  restored checkpoint's (``resume``), else, once the stream is known (``check_stream``), at the entry's ``start``.
  It moves past a message only once the pump has handed it over (``consumed``), never when the server delivers
  it: every connection's new consumer starts there, and the server's consumer holds nothing the feed needs.
- ``deliver`` reads a delivery's numbers from its reply subject (both token layouts): below the position, ``SKIP``;
  a gap in consumer sequences, a redelivery of a message never consumed, or no numbers, ``Drop`` (the connection
  is dropped and the next consumer starts at the position); else a ``Take``.
- ``check_stream`` at every connection: the stream must still hold what the position needs, judged by what the
  feed has *covered* (``SourceStats.covered``), else ``PositionLost`` (exit 2). For a whole-stream feed a first
  sequence past it means retention removed the feed's messages. A filtered feed's stream cannot say which
  subjects lost messages: the refusal says what is known and the fixes, unless ``Retention`` proves none was lost
  (removal by subject only, ``by_subject_only``, and no subject of the feed's at its limit). Messages deleted or
  purged by hand are not told apart from none.
- Covered: every message of the feed's subjects up to a sequence is handed over, proved by a survey
  (``surveyed``: the stream's last sequence, then the consumer's state, then the first sequence) when nothing was
  removed past what it covered before, or when it was caught up with a pull waiting and nothing delivered since
  (``idle_from``). A message removed before delivery is never covered.
- ``PositionUnknown`` (every checkpoint damaged) starts at the stream's first message only if ``start`` is "first"
  and the stream holds every message from sequence 1; else ``PositionLost``.
- A partitioned feed starts at its lowest partition's position and skips per partition what that position covers
  (``in_state``). An element whose stream is not in its subject's partition (``own_partition``, the server's
  function) is an error reply, never applied.
- It writes the position's figures in the feed's ``SourceStats`` (one writer: the IO thread).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from forkless.io_loop.connectors.jetstream.partitions import escape_stream, partition_of
from forkless.io_loop.connectors.jetstream.settings import JetStreamSpec
from forkless.io_loop.counters import SourceStats
from forkless.io_loop.crossing import PositionUnknown, Resume
from forkless.io_loop.errors import ACCEPT_LOSS, PositionLost

__all__ = ["FOREIGN_REASON", "SKIP", "Consumer", "Drop", "Retention", "Take", "covers", "delivery_numbers"]

FOREIGN_REASON = "stream not in this subject's partition"
PARTITION_CACHE = 1 << 20  # streams whose partition is remembered (the cache is emptied when full)


def delivery_numbers(reply: bytes) -> tuple[int, int, int, int] | None:
    """A JetStream delivery's ``(times delivered, stream sequence, consumer sequence, pending)``
    from its reply subject, ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer
    seq>.<timestamp>.<pending>``, or with a domain and an account hash after ``$JS.ACK`` (11 or
    more tokens, the newer servers'); None for anything else."""
    tokens = reply.split(b".")
    n = len(tokens)
    if n == 9:
        at = 4
    elif n >= 11:
        at = 6
    else:
        return None
    if tokens[0] != b"$JS" or tokens[1] != b"ACK":
        return None
    try:
        return int(tokens[at]), int(tokens[at + 1]), int(tokens[at + 2]), int(tokens[at + 4])
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Take:
    """A delivery to decode and hand over, after its first ``skip`` good elements (handed over
    before: a restored position inside it); ``in_state``: the partition's restored state holds all
    of it, nothing is handed over. ``partition``: the one its subject names (-1: not partitioned)."""

    seq: int
    pending: int
    partition: int = -1
    skip: int = 0
    in_state: bool = False


@dataclass(frozen=True, slots=True)
class Drop:
    """The connection must be dropped (the next consumer starts at the position again): ``reason``."""

    reason: str


@dataclass(frozen=True)
class Retention:
    """What the stream says of what its retention may have removed (read by the pump where ``filtered_behind``):
    ``subjects``, those it stores (its configuration's; empty: not known, such as a mirror's); ``by_subject_only``:
    nothing but ``max_msgs_per_subject`` removes messages (see the module rules); ``per_subject``, that limit (0:
    none removes); ``counts``, the messages each of the feed's subjects holds now (None: not read); ``first_of``,
    the first sequence some subjects at their limit hold."""

    subjects: tuple[str, ...] = ()
    by_subject_only: bool = False
    per_subject: int = 0
    counts: Mapping[str, int] | None = None
    first_of: Mapping[str, int] = field(default_factory=dict)


def covers(pattern: str, subject: str) -> bool:
    """Every subject ``subject`` (a NATS subject, wildcards allowed) matches is matched by ``pattern``."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or have[i] == ">" or (token != "*" and (token != have[i] or have[i] == "*")):
            return False
    return len(want) == len(have)


class _Skip:
    """A redelivery of a message consumed already: nothing to do."""

    def __repr__(self) -> str:
        return "SKIP"


SKIP = _Skip()


class Consumer:
    """One JetStream feed's position and its decisions (see the module rules). ``label`` names
    the feed in errors; ``source``: the feed's figures, written here; ``resume``: what the
    restored checkpoint recorded (an ``Origin``, partition -> ``Origin``, either in a ``Resume``
    with the stream's created time, a ``PositionUnknown``), None to start per ``start``."""

    def __init__(self, spec: JetStreamSpec, label: str, source: SourceStats, resume: Any = None) -> None:
        self.spec = spec
        self.label = label
        self.source = source
        self.unknown = ""  # why the checkpoints' position is unknown (all damaged: PositionUnknown)
        if isinstance(resume, PositionUnknown):
            self.unknown, resume = resume.why, None
        self.recorded_created = ""  # the stream's created time the restored checkpoint recorded
        if isinstance(resume, Resume):
            self.recorded_created, resume = resume.stream_created, resume.origin
        # a partitioned feed's restored positions: partition -> (next sequence, elements to skip)
        self.floors: dict[int, tuple[int, int]] | None = None
        if isinstance(resume, dict):
            self.floors = {p: origin.resume() for p, origin in resume.items()}
            resume = None
        self.floors_end = 0  # at and after this sequence no floor can apply
        self.next: tuple[int, int] | None = resume.resume() if resume is not None else None
        self.from_checkpoint = resume is not None or bool(self.floors)  # until the first message is handed over
        if self.next is not None:
            source.next_seq = self.next[0]
        self.expected = 1  # the consumer sequence of the next first delivery
        self.received = 0  # the consumer sequence of the last delivery read (``deliver``)
        self.settled = 0  # the consumer sequence of the last delivery handed over, held or skipped
        self.activity = 0  # moves at every delivery and every new consumer (``surveyed`` sees a change)
        self.idle_from: int | None = None  # ``activity`` when the feed was last known caught up, a pull waiting
        self._partitions: dict[str, int] = {}

    @property
    def _next(self) -> tuple[int, int]:
        """``next``, which ``check_stream`` sets before anything reads it."""
        assert self.next is not None, "check_stream sets the position first"
        return self.next

    # ---- at a connection ------------------------------------------------------------------------

    def check_stream(self, first: int, last: int, deleted: int = 0,
                     retention: Retention | None = None) -> list[tuple[int, str]]:
        """Where consuming starts, from the stream's first and last sequence and its count of
        messages removed from its middle (``deleted``); ``PositionLost`` when the stream cannot
        give what the position needs (where ``filtered_behind`` then says ``retention`` could tell more, called
        again with it, the same check). Returns what to log: (logging level, line)."""
        source = self.source
        notes = []
        if self.unknown and self.next is None:
            notes.append(self._start_without_position(first, last, deleted))
        source.stream_last_seq = max(source.stream_last_seq, last)
        if self.next is None and self.floors:  # a partitioned feed's restored positions: start at the lowest
            fresh = (max(first, 1), 0) if self.spec.start == "first" else (last + 1, 0)
            for p in self.spec.partitions:
                self.floors.setdefault(p, fresh)
            self.next = min(self.floors.values())
            self.floors_end = max(seq for seq, _ in self.floors.values()) + 1
            source.next_seq = self.next[0]
        if self.next is None:
            self.next = (max(first, 1), 0) if self.spec.start == "first" else (last + 1, 0)
            source.next_seq = self.next[0]
            return [*notes, (logging.INFO, f"{self.label}: no recorded position; starting at stream sequence "
                                           f"{self.next[0]} (\"start\": {self.spec.start!r})")]
        notes += self._check_held(first, last, retention)
        need, skip = self.next
        whose = "the checkpoint" if self.from_checkpoint else "this run"
        return [*notes, (logging.INFO, f"{self.label}: resuming at stream sequence {need}"
                                       f"{f', after its first {skip} elements' if skip else ''} ({whose}'s position)")]

    def _check_held(self, first: int, last: int, retention: Retention | None) -> list[tuple[int, str]]:
        """``PositionLost`` when the stream no longer holds what the position needs, or ends before it; what to
        log where the stream's retention proves the feed lost nothing past its first sequence."""
        need, skip = self._next
        applied = need if skip else need - 1
        whose = "the checkpoint" if self.from_checkpoint else "this run"
        stream = self.spec.stream
        if need > last + 1:
            raise PositionLost(
                f"{self.label}: stream {stream!r} ends at sequence {last}, but {whose} recorded "
                f"{applied} as the last applied: was the stream deleted and made again? To continue anyway, "
                f"{ACCEPT_LOSS}")
        covered = self._covered()
        if not self._behind(first, last):
            return []
        beyond = f", and none of its subjects' up to {covered}" if covered >= need else ""
        known = (f"its first sequence is {first}, {whose} recorded {applied} as the last applied (the next needed is "
                 f"{need}{beyond})")
        subjects = self.spec.subjects()
        if not subjects or (retention is not None and retention.subjects and all(
                any(covers(mine, theirs) for mine in subjects) for theirs in retention.subjects)):
            # every message the stream stores is one of the feed's: those before its first sequence were ours
            raise PositionLost(
                f"{self.label}: stream {stream!r} no longer holds messages {whose} needs: {known}; retention "
                f"removed them. Keep messages longer in the stream (max_age, max_msgs, max_bytes), or {ACCEPT_LOSS}")
        filters = ", ".join(map(repr, subjects))
        if retention is None or not retention.by_subject_only or retention.counts is None:
            raise PositionLost(self._may_have_removed(known, filters, first, whose))
        limit = retention.per_subject
        full = sorted(subject for subject, held in retention.counts.items() if limit and held >= limit)
        if full:
            named = "; ".join(f"subject {subject} holds its limit of {limit} messages (max_msgs_per_subject)"
                              + (f", from sequence {retention.first_of[subject]}" if subject in retention.first_of
                                 else "") for subject in full[:3])
            more = f" (and {len(full) - 3} more subjects)" if len(full) > 3 else ""
            raise PositionLost(
                f"{self.label}: stream {stream!r} may no longer hold messages of {filters} that {whose} needs: "
                f"{known}. It removes messages by subject only, each for newer ones of the same subject, and "
                f"{named}{more}: its messages after {applied} may have been removed. Raise max_msgs_per_subject "
                f"(or keep messages longer), or {ACCEPT_LOSS}")
        why = f"max_msgs_per_subject {limit}" if limit else "no limit removes any"
        return [(logging.WARNING,
                 f"{self.label}: stream {stream!r}'s first sequence is {first}, past {whose}'s position ({applied} "
                 f"the last applied), but it removes messages by subject only ({why}) and no subject of {filters} "
                 f"holds its limit: retention removed only other subjects' messages (messages of {filters} deleted "
                 "or purged by hand are not told apart)")]

    def _covered(self) -> int:
        """How far no message of the feed's own subjects is missing from its position on (a survey proved every one
        of them up to there handed over: other subjects' messages there are not ours); 0: not known."""
        need, skip = self._next
        return self.source.covered[1] if self.source.covered[0] == need - 1 and not skip else 0

    def _behind(self, first: int, last: int) -> bool:
        """The stream's first sequence is past what the position needs (and what the feed covered)."""
        need, _ = self._next
        return first > max(need, self._covered() + 1) and need <= last

    def filtered_behind(self, first: int, last: int) -> bool:
        """After ``check_stream`` refused: a filtered feed behind the stream's first sequence, whose refusal what
        the stream says of its retention (``Retention``) may lift or sharpen."""
        return self.next is not None and bool(self.spec.subjects()) and self._behind(first, last)

    def _may_have_removed(self, known: str, filters: str, first: int, whose: str) -> str:
        """The refusal of a filtered feed whose stream cannot say of which subjects the removed messages were."""
        return (f"{self.label}: stream {self.spec.stream!r} may no longer hold messages of {filters} that {whose} "
                f"needs: {known}. Retention removed every message before sequence {first} and the stream does not "
                f"say of which subjects they were: messages of other subjects share its limits, so it may have "
                f"removed messages of {filters}; the stream holds from sequence {first}. To keep a filtered feed's "
                "messages while other subjects are busy, give the stream per-subject limits (max_msgs_per_subject) "
                f"instead of stream-wide ones, or keep messages longer (max_age, max_msgs, max_bytes); or "
                f"{ACCEPT_LOSS}")

    def _start_without_position(self, first: int, last: int, deleted: int) -> tuple[int, str]:
        """Every checkpoint was damaged: the position they recorded is unknown. Consuming the
        stream from its first message rebuilds the same state only if the feed's ``start`` is
        "first" and the stream still holds every message it ever stored (first sequence 1,
        none deleted); anything else may lose messages the state held: ``PositionLost``."""
        why, self.unknown = self.unknown, ""
        stream, start = self.spec.stream, self.spec.start
        if (start == "first" or last == 0) and first <= 1 and not deleted:  # (or it never held any)
            return (logging.WARNING,
                    f"{self.label}: {why}, but stream {stream!r} holds every message from sequence 1 (to {last}): "
                    "consuming all of it again rebuilds the state (replies older than the results stream's "
                    "duplicate window are stored again)")
        holds = (f"its first sequence is {first}" if first > 1 else f"{deleted} of its messages were deleted"
                 if deleted else "it holds every message")
        unsafe = (f"messages the lost state held may be gone from stream {stream!r} ({holds})"
                  if start == "first" and (first > 1 or deleted) else
                  f"the feed's \"start\" is \"new\", which would skip what arrived since (stream "
                  f"{stream!r}: {holds})")
        raise PositionLost(
            f"{self.label}: {why}, so the position they recorded is unknown, and {unsafe}: refusing to start "
            f"fresh. To start fresh anyway, accepting the loss, start with FORKLESS_CHECKPOINT_RESTORE=never (the "
            f"state starts empty and the feed at its \"start\")")

    def new_consumer(self) -> int:
        """A new consumer is made at the position: the stream sequence it starts at."""
        self.expected = 1
        self.received = self.settled = 0
        self.activity += 1
        self.idle_from = None
        return self._next[0]

    # ---- each delivery ---------------------------------------------------------------------------

    def deliver(self, reply: bytes, subject: bytes | str = b"") -> Take | Drop | _Skip:
        """What a delivery with reply subject ``reply``, on ``subject``, means (the module rules)."""
        numbers = delivery_numbers(reply)
        if numbers is None:
            return Drop(f"a delivery without JetStream's reply subject: {reply[:200]!r}")
        delivered, seq, consumer_seq, pending = numbers
        self.activity += 1
        self.received = consumer_seq
        if delivered == 1:
            if consumer_seq != self.expected:
                return Drop(f"delivery gap at stream sequence {seq} (consumer sequence {consumer_seq}, expected "
                            f"{self.expected})")
            self.expected += 1
        position = self._next
        if seq < position[0]:  # consumed already (a redelivery)
            self.source.skipped += 1
            self.settled = consumer_seq
            return SKIP
        if delivered > 1:
            return Drop(f"stream sequence {seq} redelivered before it was consumed")
        source = self.source
        source.fetched += 1
        source.stream_last_seq = max(source.stream_last_seq, seq + pending)
        need, skip = position
        if seq != need:
            skip = 0
        if not self.spec.partitioned:
            return Take(seq, pending, -1, skip)
        partition = self.spec.partition_of_subject(subject.decode() if isinstance(subject, bytes) else subject)
        if self.floors:
            floor = self.floors.get(partition)
            if floor is not None and seq < floor[0]:  # the partition's restored state holds it already
                source.skipped += 1
                return Take(seq, pending, partition, 0, True)
            if floor is not None and seq == floor[0]:
                skip = max(skip, floor[1])
            if seq >= self.floors_end:
                self.floors = None  # past every partition's position: no more checks
        return Take(seq, pending, partition, skip)

    def handing_over(self) -> None:
        """Good elements of a delivery are being handed over: the position is this run's now."""
        self.from_checkpoint = False

    def consumed(self, take: Take) -> None:
        """``take`` is handed over (or held): the position moves past it. With nothing pending
        after it, the feed is caught up (its pull still waiting: ``idle_from``)."""
        self.next = (take.seq + 1, 0)
        self.source.next_seq = take.seq + 1
        self.settled = self.received
        if take.pending == 0:
            self.idle_from = self.activity

    # ---- what the feed covered -----------------------------------------------------------------

    def may_cover(self, last: int) -> bool:
        """A survey could prove more covered than now, the stream having reached ``last``."""
        if self.next is None or self.next[1]:
            return False
        handed, through = self.source.covered
        return handed != self.next[0] - 1 or through < last

    def surveyed(self, mark: int, last: int, pending: int, delivered: int, waiting: bool, first: int) -> bool:
        """A survey (the module rules): ``mark``, ``activity`` before the stream's last sequence
        ``last`` was read; then the consumer's state: ``pending`` messages of the feed's subjects
        (its num_pending), ``delivered`` (the consumer sequence of its last delivery), ``waiting``
        (a pull of ours waits); then the stream's ``first`` sequence. True when it proved every
        message of the feed's subjects up to ``last`` handed over (``SourceStats.covered``)."""
        if (self.next is None or self.next[1] or mark != self.activity or pending
                or delivered != self.settled or self.received != self.settled):
            return False  # a delivery moved meanwhile, one is not handed over yet, or one is pending
        need = self.next[0]
        handed, through = self.source.covered
        known = through if handed == need - 1 else need - 1  # covered before this survey
        caught_up = waiting and self.idle_from == self.activity
        if first > known + 1 and not caught_up:
            return False  # retention removed messages past what was covered: some may have been ours
        if last >= need - 1 and (last > through or handed != need - 1):
            self.source.covered = (need - 1, last)
        if waiting:
            self.idle_from = self.activity
        return True

    # ---- a partitioned feed's elements ------------------------------------------------------------

    def own_partition(self, decoded: Any, partition: int) -> Any:
        """``decoded`` without the elements whose stream is not in ``partition`` (each an error
        reply, ``FOREIGN_REASON``, before the decoder's own errors)."""
        cache, count = self._partitions, self.spec.partition_count
        foreign = []
        for i, stream in enumerate(decoded.stream):
            p = cache.get(stream)
            if p is None:
                if len(cache) >= PARTITION_CACHE:
                    cache.clear()
                try:
                    p = cache[stream] = partition_of(escape_stream(stream), count)
                except ValueError:
                    p = -1
            if p != partition:
                foreign.append(i)
        if not foreign:
            return decoded
        dropped = set(foreign)
        keep = [i for i in range(len(decoded)) if i not in dropped]
        out = copy.copy(decoded)
        out.seq = [decoded.seq[i] for i in keep]
        out.stream = [decoded.stream[i] for i in keep]
        out.x = decoded.x[keep]
        out.errors = [(FOREIGN_REASON, decoded.seq[i]) for i in foreign] + list(decoded.errors)
        return out
