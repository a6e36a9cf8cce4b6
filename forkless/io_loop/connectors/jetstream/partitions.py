"""Partitions of a JetStream stream: how a stream name becomes a subject token, which partition a token falls in
(nats-server's ``{{partition(P,n)}}`` function), and which partitions an instance owns.

Rules:
- Pure: no sockets, no clock, no threads, no third-party import at the top (numpy only inside ``partitions_of``).
- ``escape_stream`` maps a stream name reversibly onto one subject token: ``[A-Za-z0-9_-]`` stay, every other UTF-8
  byte becomes ``~XX``; ``unescape_stream`` inverts it exactly.
- ``partition_of(token, P)`` is nats-server's: FNV-1a (32 bit) of the token's bytes, modulo P
  (server/subject_transform.go, ``getHashPartition``); ``partitions_of`` computes it for many names at once.
- ``partition_transform`` reads a stream's subject transform as nats-server does, and ``transform_problems`` says
  where it disagrees with a feed's ``partition_count`` and subject (``--check``, and the feed at each connection).
- Instance i of N owns the contiguous share ``[i*P//N, (i+1)*P//N)`` (Flink's key-group ranges), so N instances
  cover 0..P-1 exactly once; partitions may also be given as ranges and lists (``"0,2,7-9"``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = ["PARTITION_FIELD", "Layout", "PartitionTransform", "escape_stream", "format_partitions", "instance_share",
           "parse_partitions", "partition_of", "partition_subjects", "partition_transform", "partitions_of",
           "transform_problems", "unescape_stream"]

PARTITION_FIELD = "{partition}"  # the placeholder in a partitioned feed's "subject"
_PLAIN = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPED = re.compile(r"~([0-9A-F]{2})")
_UNPLAIN = re.compile(r"[^A-Za-z0-9_-]+")
_BYTE_ESCAPES = tuple(f"~{b:02X}" for b in range(256))
# nats-server (server/subject_transform.go): a destination token that starts with "{{" and ends with
# "}}" is a function; "partition" or "Partition", arguments split at commas
_PARTITION_FN = re.compile(r"\{\{\s*[pP]artition\s*\((.*)\)\s*\}\}")
_FUNCTION = re.compile(r"\{\{.*\}\}|\$\d+")  # any function token (or the old $n wildcard)
_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193


def escape_stream(name: str) -> str:
    """The subject token for a stream name (see the module rules); ValueError for an empty name."""
    if not name:
        raise ValueError("an empty stream name has no subject token")
    if _PLAIN.fullmatch(name):
        return name
    # only the runs that need escaping go through Python, not every character: a table of a million
    # names is escaped at each checkpoint
    return _UNPLAIN.sub(_escape_run, name)


def _escape_run(m: re.Match[str]) -> str:
    return "".join(_BYTE_ESCAPES[b] for b in m.group().encode("utf-8"))


def unescape_stream(token: str) -> str:
    """The stream name a token stands for (``escape_stream``'s inverse); ValueError if the token
    was not made by ``escape_stream``."""
    if _PLAIN.fullmatch(token):
        return token
    raw = bytearray()
    i = 0
    while i < len(token):
        ch = token[i]
        if ch == "~":
            m = _ESCAPED.match(token, i)
            if m is None:
                raise ValueError(f"not an escaped stream name: {token!r} (a '~' must be followed by two hex digits)")
            raw.append(int(m.group(1), 16))
            i += 3
        elif _PLAIN.fullmatch(ch):
            raw.extend(ch.encode("ascii"))
            i += 1
        else:
            raise ValueError(f"not an escaped stream name: {token!r} ({ch!r} is escaped as ~XX)")
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"not an escaped stream name: {token!r} (not UTF-8)") from None
    if escape_stream(name) != token:
        raise ValueError(f"not an escaped stream name: {token!r} (escapes a character that needs none)")
    return name


def partition_of(token: str, count: int) -> int:
    """nats-server's ``partition(count, …)`` of one subject token: FNV-1a 32 of its bytes mod count."""
    h = _FNV_OFFSET
    for b in token.encode("utf-8"):
        h = ((h ^ b) * _FNV_PRIME) & 0xFFFFFFFF
    return h % count


def partitions_of(names: Sequence[str], count: int) -> np.ndarray:
    """The partition of every stream name (``partition_of(escape_stream(name), count)``), as int32;
    vectorised over the names' bytes (a million names in well under a second)."""
    # imported here: the configuration and the relay import this module, and numpy costs them ~50 ms and ~16 MiB
    # (-X importtime, ru_maxrss); only the checkpoints' split of the table by partition needs it
    import numpy as np

    n = len(names)
    if n == 0:
        return np.zeros(0, np.int32)
    tokens = [escape_stream(name).encode("utf-8") for name in names]
    lengths = np.fromiter((len(t) for t in tokens), np.int64, n)
    width = int(lengths.max())
    raw = np.frombuffer(b"".join(t.ljust(width, b"\0") for t in tokens), np.uint8).reshape(n, width)
    h = np.full(n, _FNV_OFFSET, np.uint32)
    prime = np.uint32(_FNV_PRIME)
    with np.errstate(over="ignore"):
        for j in range(width):
            live = lengths > j
            h = np.where(live, (h ^ raw[:, j].astype(np.uint32)) * prime, h)
    return (h % np.uint32(count)).astype(np.int32)


def parse_partitions(text: str, count: int) -> tuple[int, ...]:
    """``"0-5"``, ``"0,2,7-9"`` → the sorted partitions; ValueError naming the problem (outside
    0..count-1, a range backwards, a partition given twice, not a number)."""
    if count < 1:
        raise ValueError("partition_count must be at least 1")
    seen: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if m is None:
            raise ValueError(f"{part!r} is not a partition or a range a-b")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"the range {part!r} goes backwards")
        if hi >= count:
            raise ValueError(f"partition {hi} is outside 0-{count - 1} (partition_count is {count})")
        seen.extend(range(lo, hi + 1))
    if len(set(seen)) != len(seen):
        twice = sorted({p for p in seen if seen.count(p) > 1})
        raise ValueError(f"partition {twice[0]} is given twice")
    return tuple(sorted(seen))


def instance_share(instance: int, instances: int, count: int) -> tuple[int, ...]:
    """The contiguous partitions instance ``instance`` (0-based) of ``instances`` owns out of
    ``count``: ``[i*count//n, (i+1)*count//n)``; ValueError if there are more instances than
    partitions or the instance is out of range."""
    if instances < 1 or not 0 <= instance < instances:
        raise ValueError(f"instance {instance} is not in 0-{instances - 1}")
    if instances > count:
        raise ValueError(f"{instances} instances for {count} partitions: some would own none")
    return tuple(range(instance * count // instances, (instance + 1) * count // instances))


def partition_subjects(template: str, partitions: Iterable[int]) -> tuple[str, ...]:
    """The filter subjects of a partitioned feed: ``template`` with ``{partition}`` replaced by each."""
    return tuple(template.replace(PARTITION_FIELD, str(p)) for p in partitions)


def format_partitions(partitions: Iterable[int]) -> str:
    """Partitions as ranges, ``parse_partitions``'s form: ``(0, 1, 2, 7)`` → ``"0-2,7"``."""
    parts: list[str] = []
    run: list[int] = []
    for p in sorted(partitions):
        if run and p == run[-1] + 1:
            run.append(p)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [p]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


@dataclass(frozen=True)
class PartitionTransform:
    """A subject transform whose destination has a ``{{partition(count, wildcards…)}}`` token."""

    src: str
    dest: str
    count: int  # P
    position: int  # the destination token (0-based) the partition number is written to
    wildcards: tuple[int, ...]  # the source's wildcards (1-based) whose tokens are hashed, in order

    def __str__(self) -> str:
        return f"{self.src!r} -> {self.dest!r}"


def partition_transform(src: str, dest: str) -> PartitionTransform | None:
    """The partition function of the subject transform ``src`` → ``dest``, read as nats-server reads
    it; None if no destination token is a partition function (one embedded in a longer token is not:
    the server writes it out literally)."""
    for position, token in enumerate(dest.split(".")):
        if not (len(token) > 4 and token.startswith("{{") and token.endswith("}}")):
            continue
        m = _PARTITION_FN.search(token)
        if m is None:
            continue
        try:
            args = [int(a.strip()) for a in re.split(r",\s*", m.group(1))]
        except ValueError:
            continue  # the server refuses such a transform: there is none to read
        if args:
            return PartitionTransform(src, dest, args[0], position, tuple(args[1:]))
    return None


def transform_problems(template: str, count: int, transform: PartitionTransform) -> list[str]:
    """Where a partitioned feed (its ``subject`` template and ``partition_count``) disagrees with the
    stream's partition transform; empty when they agree. Each problem names both values."""
    problems = []
    if transform.count != count:
        problems.append(f"the subject transform {transform} makes {transform.count} partitions, the feed's "
                        f'"partition_count" is {count}')
    if len(transform.wildcards) != 1:
        hashed = ", ".join(map(str, transform.wildcards)) or "none"
        problems.append(f"the subject transform {transform} hashes the source's wildcards {hashed}: forkless "
                        "computes a stream's partition from its name's token alone "
                        "(io_loop/connectors/jetstream/partitions.py), so "
                        "the destination must be {{partition(P,n)}} with the one wildcard n holding the stream")
    want = template.split(".")
    have = transform.dest.split(".")
    at = want.index(PARTITION_FIELD) if PARTITION_FIELD in want else -1
    if at != transform.position:
        problems.append(f"the feed's subject {template!r} has {PARTITION_FIELD} at token {at + 1}, the subject "
                        f"transform {transform} writes the partition at token {transform.position + 1}")
    elif not _shape_matches(want, have):
        problems.append(f"the feed's subject {template!r} matches none of the subjects the subject transform "
                        f"{transform} stores")
    return problems


def _shape_matches(want: list[str], have: list[str]) -> bool:
    """Can the filter ``want`` (tokens; ``{partition}``, ``*``, ``>`` wildcards) match a subject made
    by the destination ``have`` (tokens; function tokens stand for any one token)?"""
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have):
            return False
        made = have[i]
        if made == ">":  # the rest of the source's tokens, one or more
            return True
        literal = not _FUNCTION.fullmatch(made)
        if token not in ("*", PARTITION_FIELD) and literal and token != made:
            return False
    return len(want) == len(have)


@dataclass(frozen=True)
class Layout:
    """A partitioned feed's partitions (io_loop/connectors/connector.py's ``PartitionLayout``): its ``stream``,
    ``count`` partitions, the ``partitions`` this instance owns."""

    stream: str
    count: int
    partitions: tuple[int, ...]

    def partition_of_names(self, names: Sequence[str]) -> np.ndarray:
        """Each stream name's partition, as the server computes it (``partitions_of``)."""
        return partitions_of(names, self.count)

    def shown(self, partitions: Sequence[int]) -> str:
        return format_partitions(partitions)
