"""The checkpoint format: a checkpoint's bytes made from named host arrays and read back, the names of its files,
and the checks that one is whole and fits this run (pure).

Rules:
- No JAX, no files, no threads, no clock: the caller names the state's leaves, passes the library versions and
  the wall time, and writes or reads the bytes (a directory, or a bucket's objects).
- The bytes are made as buffers (``encode``): arrays are not copied, a ``CanonicalRows`` leaf stays lazy until
  written, and the stream names are encoded ``NAMES_CHUNK`` at a time with ``pause()`` between, so the writer
  thread holds the GIL only briefly.
- Every array keeps its shape: a 0-d leaf is saved and read back 0-d.
- Every checkpoint ends with the SHA-256 of all its bytes before it and an end marker; ``parse_checkpoint``
  refuses (``CheckpointDamaged``) bytes too short, without the magic or the end marker, or failing the checksum.
- A whole checkpoint that does not fit this run is ``CheckpointMismatch`` naming the setting and both values
  (``check_fits``), never skipped. An older checkpoint's processor id (``LEGACY_PROCESSOR_IDS``) is read as a
  name and version.
- File names: ``ckpt-<sequence:09d>.fkc`` (they sort in sequence order); a writer's temporary file is
  ``.tmp-`` + the final name + ``.`` + its pid.

Layout, format 1 (integers little-endian):
    MAGIC                          b"FORKLESS-CHECKPOINT\\n"
    u64 length, then the header    JSON: format, settings, versions, wall_time, counts,
                                   positions (the replayable feeds', by name), streams, and
                                   the table of arrays (name, dtype, shape,
                                   offset from the data start, nbytes)
    zeros up to a multiple of 64   then the arrays' bytes (C order), each 64-aligned:
                                   "state<path>" per state leaf, then "streams.names" (UTF-8:
                                   one name a line, or a JSON array if a name holds a
                                   newline), "streams.slots" (int32), "streams.last_seen"
                                   (float64)
    b"SHA256" + 32-byte digest     of every byte before it
    END                            b"FORKLESS-END\\n"
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from forkless.controller.device.placement import CanonicalRows
from forkless.controller.errors import CheckpointMismatch

__all__ = [
    "FORMAT",
    "LEGACY_PROCESSOR_IDS",
    "MIN_BYTES",
    "TEMP_PREFIX",
    "CheckpointDamaged",
    "check_fits",
    "decode_names",
    "encode",
    "file_name",
    "is_temporary",
    "join",
    "no_pause",
    "parse_checkpoint",
    "sequence_of",
    "temporary_name",
    "trailer",
]

FORMAT = 1
MAGIC = b"FORKLESS-CHECKPOINT\n"
DIGEST_TAG = b"SHA256"
END = b"FORKLESS-END\n"
TRAILER_BYTES = len(DIGEST_TAG) + 32 + len(END)
MIN_BYTES = len(MAGIC) + 8 + TRAILER_BYTES  # the magic, the header's length and the trailer
ALIGN = 64
SUFFIX = ".fkc"
TEMP_PREFIX = ".tmp-"
_FINAL_NAME = re.compile(r"^ckpt-(\d{9,})\.fkc$")
_TEMP_NAME = re.compile(r"^\.tmp-ckpt-\d{9,}\.fkc\.\d+$")  # TEMP_PREFIX + final name + "." + writer's pid
# stream names encoded per call on the writer thread: few enough that the main thread never waits long
# for the GIL (one call over a million names would hold it for tens of ms)
NAMES_CHUNK = 2048

# checkpoints written before processors declared a name and version recorded an id instead
LEGACY_PROCESSOR_IDS = {"ewma/1": ("ewma", "1")}
_ABSENT = "(not recorded)"


class CheckpointDamaged(ValueError):
    """A checkpoint file that is incomplete or corrupt (truncated, bad checksum, no end marker)."""


def no_pause() -> None:
    pass


# ---- names -------------------------------------------------------------------------------------------


def file_name(sequence: int) -> str:
    """The final name of checkpoint number ``sequence``."""
    return f"ckpt-{sequence:09d}{SUFFIX}"


def sequence_of(name: str) -> int | None:
    """The sequence number of a final name; None for any other name (a temporary file's too)."""
    m = _FINAL_NAME.match(name)
    return int(m.group(1)) if m else None


def temporary_name(name: str, pid: int) -> str:
    """The name a writer of process ``pid`` writes the file ``name`` under before renaming it."""
    return f"{TEMP_PREFIX}{name}.{pid}"


def is_temporary(name: str) -> bool:
    return _TEMP_NAME.match(name) is not None


# ---- encoding ----------------------------------------------------------------------------------------


def encode(leaves: Sequence[tuple[str, Any]], streams: tuple[Sequence[str], Any, Any], *,
           settings: Mapping[str, Any], versions: Mapping[str, str], wall_time: float,
           counts: Mapping[str, int], positions: Mapping[str, Any],
           pause: Callable[[], None] = no_pause) -> Iterator[Any]:
    """A checkpoint's bytes before the trailer, as buffers (the arrays are not copied).

    ``leaves``: ``("state<path>", array)`` per state leaf, an array or a ``CanonicalRows``;
    ``streams``: the table's ``(names, slots, last_seen)``. ``join`` (or the caller, hashing
    as it writes, with ``trailer``) completes it."""
    names, slots, last_seen = streams
    arrays, names_encoding = _arrays(leaves, names, slots, last_seen, pause)
    table: list[dict[str, Any]] = []
    offset = 0
    for name, dtype, shape, _, nbytes in arrays:
        table.append({"name": name, "dtype": dtype, "shape": shape, "offset": offset, "nbytes": nbytes})
        offset = _aligned(offset + nbytes)
    header = json.dumps({
        "format": FORMAT,
        "settings": settings,
        "versions": versions,
        "wall_time": wall_time,
        "processed": int(counts.get("processed", 0)),
        "counts": counts,
        "positions": positions,
        "streams": len(names),
        "names_encoding": names_encoding,
        "arrays": table,
    }, sort_keys=True).encode("utf-8")
    start = len(MAGIC) + 8 + len(header)
    yield MAGIC + struct.pack("<Q", len(header)) + header + bytes(_aligned(start) - start)
    position = 0
    for (_, _, _, buffers, _), entry in zip(arrays, table):
        if entry["offset"] > position:
            yield bytes(entry["offset"] - position)
        yield from buffers
        position = entry["offset"] + entry["nbytes"]


def _arrays(leaves: Sequence[tuple[str, Any]], names: Sequence[str], slots: Any, last_seen: Any,
            pause: Callable[[], None]) -> tuple[list[tuple[str, str, list[int], Any, int]], str]:
    """The checkpoint's arrays in order, ``(name, dtype, shape, buffers, nbytes)`` each, and the
    stream names' encoding."""
    arrays: list[tuple[str, str, list[int], Any, int]] = []
    for name, leaf in leaves:
        if isinstance(leaf, CanonicalRows):  # its bytes are made as they are written
            pieces = (piece.reshape(-1).view(np.uint8) for piece in leaf.pieces())
            arrays.append((name, leaf.dtype.name, list(leaf.shape), pieces, leaf.nbytes))
            continue
        # np.asarray, not np.ascontiguousarray: that one makes a 0-d leaf (a scalar weight) 1-d, and its
        # checkpoint then no longer fits the same program's state (every leaf keeps its shape here)
        arr = np.asarray(leaf, order="C")
        arrays.append((name, arr.dtype.name, list(arr.shape), [arr.reshape(-1).view(np.uint8)], arr.nbytes))
    names_encoding, encoded = _encode_names(names, pause)
    size = sum(len(b) for b in encoded)
    arrays.append(("streams.names", "uint8", [size], encoded, size))
    for name, column, dtype in (("streams.slots", slots, np.int32), ("streams.last_seen", last_seen, np.float64)):
        arr = np.ascontiguousarray(column, dtype)
        arrays.append((name, arr.dtype.name, list(arr.shape), [arr.view(np.uint8)], arr.nbytes))
    return arrays, names_encoding


def trailer(digest: bytes) -> bytes:
    """What ends a checkpoint whose bytes before it have the SHA-256 ``digest``."""
    return DIGEST_TAG + digest + END


def join(pieces: Iterable[Any]) -> bytes:
    """``encode``'s buffers as one checkpoint in memory, the trailer included."""
    out = bytearray()
    digest = hashlib.sha256()
    for piece in pieces:
        view = memoryview(piece).cast("B")
        digest.update(view)
        out += view
    out += trailer(digest.digest())
    return bytes(out)


def _encode_names(names: Sequence[str], pause: Callable[[], None] = no_pause) -> tuple[str, list[bytes]]:
    """The stream names as UTF-8 buffers: "lines" (joined by newlines: a few fast C calls per
    chunk) unless a name holds a newline, then "json" (a JSON array: a Python-speed encoder).
    Lone surrogates survive either way ("surrogatepass"; JSON escapes them)."""
    parts = []
    for i in range(0, len(names), NAMES_CHUNK):
        chunk = names[i:i + NAMES_CHUNK]
        text = "\n".join(chunk)
        if text.count("\n") != len(chunk) - 1:
            break
        parts.append(text.encode("utf-8", "surrogatepass"))
        pause()
    else:
        pieces = []
        for i, part in enumerate(parts):
            pieces += [b"\n", part] if i else [part]
        return "lines", pieces
    step = NAMES_CHUNK // 8  # json.dumps is slower per name than a join
    text = ",".join(json.dumps(names[i:i + step])[1:-1] for i in range(0, len(names), step))
    return "json", [("[" + text + "]").encode("ascii")]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ---- reading -----------------------------------------------------------------------------------------


def parse_checkpoint(data: bytes | np.ndarray, where: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header and the arrays of a checkpoint's bytes (writable arrays sharing one buffer:
    ``data`` itself when it is a uint8 array, else one aligned copy); ``where`` names it in
    errors. Raises ``CheckpointDamaged`` for bytes that are truncated, fail their checksum or
    lack the end marker."""
    if isinstance(data, np.ndarray):
        buf = data
    else:  # copied once into an aligned buffer (the arrays are views of it)
        buf = np.empty(len(data), np.uint8)
        buf[:] = np.frombuffer(data, np.uint8)
    _verify(buf, where)
    view = buf.data  # memoryview(buf): numpy types its buffer for Python 3.12 on
    try:
        (length,) = struct.unpack_from("<Q", view, len(MAGIC))
        start = len(MAGIC) + 8
        header = json.loads(bytes(view[start:start + length]))
        data_start = _aligned(start + length)
        arrays = {}
        for entry in header["arrays"]:
            lo = data_start + entry["offset"]
            raw = buf[lo:lo + entry["nbytes"]]
            arrays[entry["name"]] = raw.view(_dtype(entry["dtype"])).reshape(entry["shape"])
    except (ValueError, KeyError, TypeError, struct.error) as exc:  # the checksum passed: a writer bug
        raise CheckpointDamaged(f"{where}: unreadable header or array table: {exc}") from None
    return header, arrays


def _verify(buf: np.ndarray, where: str) -> None:
    """``CheckpointDamaged`` unless ``buf`` starts with the magic and ends with a trailer whose
    SHA-256 is that of every byte before it."""
    size = len(buf)
    view = buf.data
    if size < MIN_BYTES:
        raise CheckpointDamaged(f"{where}: {size} bytes, too short to be a checkpoint (truncated)")
    if bytes(view[:len(MAGIC)]) != MAGIC:
        raise CheckpointDamaged(f"{where}: not a forkless checkpoint (no {MAGIC!r} at the start)")
    body = size - TRAILER_BYTES
    if bytes(view[size - len(END):]) != END or bytes(view[body:body + len(DIGEST_TAG)]) != DIGEST_TAG:
        raise CheckpointDamaged(f"{where}: no end marker (truncated or half-written)")
    saved = bytes(view[body + len(DIGEST_TAG):size - len(END)])
    if hashlib.sha256(view[:body]).digest() != saved:
        raise CheckpointDamaged(f"{where}: checksum mismatch (the file is corrupt)")


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # bfloat16 and friends (installed with JAX) are not known to numpy by name

        return np.dtype(getattr(ml_dtypes, name))


def decode_names(raw: np.ndarray, encoding: str, count: int) -> list[str]:
    """The stream names of a checkpoint's ``streams.names`` array (``names_encoding`` and
    ``streams`` of its header); ``ValueError`` when they do not read back as ``count`` names."""
    if encoding == "json":
        names = json.loads(raw.tobytes())
    elif encoding == "lines":
        names = raw.tobytes().decode("utf-8", "surrogatepass").split("\n") if count else []
    else:
        raise ValueError(f"unknown names encoding {encoding!r}")
    if len(names) != count:
        raise ValueError(f"{len(names)} stream names, the header says {count}")
    return names


def check_fits(where: Path | str, header: Mapping[str, Any], expect: Mapping[str, Any]) -> None:
    """``CheckpointMismatch`` unless the checkpoint is of this format and every key of ``expect``
    was saved in its settings with an equal value (as it reads back from JSON: tuples become
    lists); a legacy processor id counts as the name and version it stood for."""
    if header.get("format") != FORMAT:
        raise CheckpointMismatch(where, "checkpoint format", header.get("format"), FORMAT)
    saved = header.get("settings", {})
    if saved.get("processor") in LEGACY_PROCESSOR_IDS and "processor_version" not in saved \
            and "processor_version" in expect:
        name, version = LEGACY_PROCESSOR_IDS[saved["processor"]]
        saved = {**saved, "processor": name, "processor_version": version}
    for key, value in expect.items():
        current = json.loads(json.dumps(value))  # as it would read back (tuples become lists)
        found = saved.get(key, _ABSENT)
        if found != current:
            raise CheckpointMismatch(where, key, found, current)
