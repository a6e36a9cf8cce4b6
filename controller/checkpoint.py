"""Checkpoints of the processor state and the stream table: the file format, writing one
atomically, finding and restoring the newest complete one.

Rules:
- No threads and no clock here: times are passed in. ``write_checkpoint`` runs on the
  checkpointer's thread (controller/checkpointer.py) and holds the GIL only briefly:
  hashing and large writes release it, and the stream names are encoded in small chunks.
- The controller's checkpoints are a ``PendingSnapshot``: begun between two steps (T0),
  copied a chunk at a time between the following steps (``advance``, 256 KiB each),
  exact as of T0 by copy-on-write (``before_state_write`` before every step and slot reset;
  the stream table does its own, ``StreamSlots.begin_copy``), then turned into a
  ``Snapshot`` on the writer thread (``finish``). Why: on the CPU ``jax.device_get``
  returns views of the device buffers, and the next step, given the state donated, then
  copies the whole table once instead of updating it in place (about 40 ms for 1M streams
  x 8 features, on the main thread), and listing a 1M-stream table took about 1.1 s; here
  each view lives only inside one call, so steps stay in place (tests pin the buffer).
  On an accelerator ``device_get`` is a real transfer, and the state is copied whole at T0
  (``shares_device_memory`` chooses); so is the checkpoint of an orderly stop.
- ``take_snapshot`` (the whole state at once, ``jax.device_get``) remains for callers
  with their own state.
- One checkpoint is one file, ``ckpt-<sequence>.fkc``. It is written to a temporary
  ``.tmp-ckpt-…`` file in the same directory, fsynced, renamed into place with
  ``os.replace``, and the directory fsynced; so a file with a final name is complete, and
  a process killed mid-write leaves only a temporary file (``remove_temporary_files``).
- Every file ends with the SHA-256 of all its bytes before it and an end marker. A file that
  is truncated, fails its checksum or lacks the marker is damaged: ``load_newest`` skips it
  with a warning and falls back to the one before it, and tells its caller which it skipped
  (every one damaged is not "no checkpoint": controller/recovery.py).
- A complete checkpoint that does not fit this run (a shape-defining setting, the state's
  structure or a leaf's shape or dtype differs) is never skipped silently:
  ``CheckpointMismatch`` names the setting and both values.
- On the CPU, ``device_get`` returns views of the device buffers (no copy); they stay as
  taken while later steps run, even a step that donates its state (JAX then copies the
  donated buffer instead of writing into it; tests pin this). A processor's step must
  write only its batch's rows of a per-stream leaf (the processor contract's O(B) rule):
  the copy-on-write keeps exactly those rows.
- The file holds the state in canonical slot order (row s = slot s, the spare last) whatever
  the device count, so a checkpoint taken on N devices restores on M. A state sharded over
  several devices (controller/placement.py) is taken as views of its device shards, and
  each per-stream leaf is put back in canonical order piece by piece as it is written, on the
  checkpointer's thread (``placement.CanonicalRows``); the main thread still pays only the
  transfer. Restore returns canonical host arrays; the caller converts them to its mesh
  (``Placement.to_sharded``) and ``jax.device_put``s them.
- Why not orbax-checkpoint: measured in bench/checkpoint_stall.py (its docstring has the
  numbers): its save blocks the main thread 126-281 ms per checkpoint where ``take_snapshot``
  blocks 0.2 ms (with the state not donated), it does not detect a corrupted byte, and it
  brings 13 packages (106 MB).

File layout, format 1 (integers little-endian):
    MAGIC                          b"FORKLESS-CHECKPOINT\\n"
    u64 length, then the header    JSON: format, settings, versions, wall_time, counts,
                                   positions (the JetStream feeds', by name), streams, and
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

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import re
import struct
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from controller.errors import CheckpointMismatch
from controller.placement import CanonicalRows, Placement
from controller.rowcopy import RowCopy
from controller.slots import TableCopy

__all__ = [
    "FORMAT",
    "CheckpointAbandoned",
    "CheckpointDamaged",
    "CheckpointMismatch",
    "PendingSnapshot",
    "Restored",
    "Snapshot",
    "StateCopy",
    "checkpoint_bytes",
    "checkpoint_path",
    "library_versions",
    "list_checkpoints",
    "load_newest",
    "next_sequence",
    "parse_checkpoint",
    "prune",
    "read_checkpoint",
    "remove_temporary_files",
    "restore_state",
    "shares_device_memory",
    "take_snapshot",
    "write_checkpoint",
]

log = logging.getLogger("forkless.checkpoint")

FORMAT = 1
MAGIC = b"FORKLESS-CHECKPOINT\n"
DIGEST_TAG = b"SHA256"
END = b"FORKLESS-END\n"
TRAILER_BYTES = len(DIGEST_TAG) + 32 + len(END)
ALIGN = 64
SUFFIX = ".fkc"
TEMP_PREFIX = ".tmp-"
_FINAL_NAME = re.compile(r"^ckpt-(\d{9,})\.fkc$")
_TEMP_NAME = re.compile(r"^\.tmp-ckpt-\d{9,}\.fkc\.\d+$")  # TEMP_PREFIX + final name + "." + writer's pid
# stream names encoded per call on the writer thread: well under 1 ms of GIL each, so the main
# thread never waits long for it (one call over a million names holds it for tens of ms)
NAMES_CHUNK = 2048
# bytes hashed and written per call: the hash stays in cache, and each call releases the GIL
WRITE_CHUNK = 1 << 20
# bytes written between two fdatasync calls: the disk writes a checkpoint as it goes, on this
# (idle-priority) thread, instead of the kernel's flusher writing ~100 MB at the final fsync
SYNC_EVERY = 8 << 20
_datasync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync


# bytes of rows copied per PendingSnapshot.advance(): about 0.25 ms of the main thread into fresh
# (not yet faulted-in) host pages (1 MiB took about 1 ms, a tick then up to 2 ms; 256 KiB with a
# 0.5 ms budget halved the median gap while copying: bench/checkpoint_stall.py)
COPY_CHUNK_BYTES = 1 << 18


def _no_pause() -> None:
    pass


class CheckpointAbandoned(RuntimeError):
    """A checkpoint being copied between steps cannot be completed (the state it was copying
    was replaced); it is counted as a failure and the next one is taken at the next interval."""


class CheckpointDamaged(ValueError):
    """A checkpoint file that is incomplete or corrupt (truncated, bad checksum, no end marker)."""


# ---- what a checkpoint holds ---------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """Everything one checkpoint holds, on the host; made by ``take_snapshot`` on the main thread,
    or by ``PendingSnapshot.finish`` on the writer thread.

    ``state`` is a pytree of numpy arrays. ``names``/``slots``/``last_seen`` are the stream
    table (``StreamSlots.export()``): fresh values the caller does not change afterwards.
    ``counts`` are the counters needed to continue (``processed``, ``anomalies`` …);
    ``settings`` the values a restore must match (see ``load_newest``) plus any others worth
    recording; ``wall_time`` is Unix seconds when it was taken.
    """

    state: Any
    names: list[str]
    slots: np.ndarray
    last_seen: np.ndarray
    counts: dict[str, int]
    settings: dict[str, Any]
    wall_time: float
    # the replayable sources' positions as of the same moment (controller/positions.py), by feed name
    positions: dict[str, Any] = field(default_factory=dict)

    @property
    def processed(self) -> int:
        return int(self.counts.get("processed", 0))


def take_snapshot(state: Any, streams: tuple[list[str], np.ndarray, np.ndarray], counts: Mapping[str, int],
                  settings: Mapping[str, Any], wall_time: float, *,
                  host_copy: Callable[[Any], Any] | None = None) -> Snapshot:
    """The main thread's whole share of a checkpoint: one ``jax.device_get`` of the state.

    ``streams`` is ``(names, slots, last_seen)`` as ``StreamSlots.export()`` returns them.
    Hand the result to ``Checkpointer.submit``; serialising and writing happen there. The
    state's arrays are immutable, so the copy stays valid while later steps run.
    ``host_copy(state)`` takes the host copy when the state is not one plain array a leaf
    (the engine's: a sharded state's per-stream leaves shard by shard, as ``CanonicalRows``,
    put in canonical order only when written); by default ``jax.device_get``.
    """
    names, slots, last_seen = streams
    slots = np.asarray(slots, np.int32)
    last_seen = np.asarray(last_seen, np.float64)
    if not (len(names) == len(slots) == len(last_seen)):
        raise ValueError(f"the stream table's columns differ in length: {len(names)} names, "
                         f"{len(slots)} slots, {len(last_seen)} last-seen times")
    host = jax.tree.map(np.asarray, jax.device_get(state)) if host_copy is None else host_copy(state)
    names = names if isinstance(names, list) else list(names)  # export() gives a fresh list: no copy
    return Snapshot(host, names, slots, last_seen, {k: int(v) for k, v in counts.items()},
                    dict(settings), float(wall_time))


def canonical_rows(leaf: Any, placement: Placement) -> CanonicalRows:
    """A sharded leaf's device shards, in mesh order, as a lazily canonical host leaf."""
    shards = sorted(leaf.addressable_shards, key=lambda shard: shard.index[0].start or 0)
    return CanonicalRows([np.asarray(shard.data) for shard in shards], placement)
def shares_device_memory(state: Any) -> bool:
    """Whether ``np.asarray`` of every leaf of ``state`` is a view of its device buffer (one
    CPU device), so that a copy can be taken from it in chunks. False on an accelerator (the
    host copy is a real transfer) and for a leaf spread over several devices."""
    for leaf in jax.tree.leaves(state):
        devices = leaf.devices() if hasattr(leaf, "devices") else ()
        if len(devices) != 1 or next(iter(devices)).platform != "cpu":
            return False
        try:
            view = np.asarray(leaf)
            if view.size and view.ctypes.data != leaf.unsafe_buffer_pointer():
                return False
        except Exception:  # no buffer pointer for this kind of array: take the plain path
            return False
    return True


class StateCopy:
    """The device state as it was when made, copied to the host a chunk of rows at a time
    between steps (copy-on-write, ``controller/rowcopy.py``). For one CPU device, where
    ``np.asarray`` of a leaf is a view of its buffer (``shares_device_memory``).

    Why: on the CPU ``jax.device_get`` returns such views, and the next step, which is given
    the state donated, must then copy the whole table once instead of updating it in place
    (about 40 ms for 1M streams x 8 features, on the main thread). Here every view is made
    inside a call and dropped before it returns, so steps stay in place.

    Leaves whose leading axis is ``rows`` (``max_streams + 1``, the per-stream ones) are
    copied in chunks; the others are small and copied whole at once. Call
    ``before_write(state, slots)`` before every step or reset that writes ``slots`` (the
    processor contract: a step writes only its batch's rows), ``advance`` between steps.
    """

    def __init__(self, state: Any, rows: int) -> None:
        flat, self._treedef = jax.tree_util.tree_flatten(state)
        self._per_stream = [i for i, leaf in enumerate(flat) if np.ndim(leaf) and np.shape(leaf)[0] == rows]
        self._whole = {i: np.array(leaf, copy=True) for i, leaf in enumerate(flat) if i not in self._per_stream}
        self._rows = RowCopy(self._views(state), rows)
        row_bytes = sum(flat[i].nbytes for i in self._per_stream) // max(1, rows)
        self.chunk_rows = max(1, COPY_CHUNK_BYTES // max(1, row_bytes))

    def _views(self, state: Any) -> list[np.ndarray]:
        leaves = jax.tree_util.tree_leaves(state)
        return [np.asarray(leaves[i]) for i in self._per_stream]

    @property
    def done(self) -> bool:
        return self._rows.done

    def before_write(self, state: Any, slots: np.ndarray) -> None:
        if not self._rows.done:
            self._rows.before_write(self._views(state), slots)

    def advance(self, state: Any, count: int | None = None) -> bool:
        return self._rows.advance(self._views(state), self.chunk_rows if count is None else count)

    def result(self) -> Any:
        """The state at the time this was made, as a tree of host arrays; once ``done``."""
        copied = iter(self._rows.result())
        leaves = [self._whole[i] if i in self._whole else next(copied)
                  for i in range(len(self._per_stream) + len(self._whole))]
        return jax.tree_util.tree_unflatten(self._treedef, leaves)


class PendingSnapshot:
    """One checkpoint as of the moment it was begun (T0), being copied on the main thread.

    The main thread begins it between two steps, calls ``before_state_write`` before every
    step or slot reset (the stream table keeps its own copy-on-write: ``StreamSlots.begin_copy``)
    and ``advance`` between steps until it returns True; then the checkpointer's thread calls
    ``finish()`` for the ``Snapshot`` (the stream table put in LRU order there).

    ``incremental``: copy the state in chunks where that is possible (``shares_device_memory``:
    one CPU device); otherwise, on an accelerator, ``jax.device_get`` copies it at T0 (a real
    transfer, after which the device buffers are free to be updated in place). ``intact()``
    returns False once the state being copied was replaced (a failed step lost it): ``advance``
    then raises ``CheckpointAbandoned``. ``seen_shift`` is added to the table's last-seen times
    (monotonic -> wall clock); ``wall_time`` is Unix seconds at T0.
    """

    def __init__(self, state: Any, table: TableCopy, counts: Mapping[str, int], settings: Mapping[str, Any],
                 wall_time: float, *, rows: int, get_state: Callable[[], Any], seen_shift: float = 0.0,
                 incremental: bool = True, intact: Callable[[], bool] | None = None,
                 host_copy: Callable[[Any], Any] = jax.device_get,
                 positions: Mapping[str, Any] | None = None) -> None:
        self.incremental = incremental and shares_device_memory(state)
        self._state_copy = StateCopy(state, rows) if self.incremental else None
        self._host = None
        if not self.incremental:  # at T0: an accelerator's transfer, or the shards of several devices
            self._host = host_copy(state)
        self._table = table
        self._get_state = get_state
        self._intact = intact
        self.counts = {k: int(v) for k, v in counts.items()}
        self.settings = dict(settings)
        self.positions = dict(positions or {})
        self.wall_time = float(wall_time)
        self.seen_shift = float(seen_shift)
        self.chunks = 0  # advance() calls that copied something
        self._released = False

    @property
    def wants_writes(self) -> bool:
        """True while the state is still being copied: every write to it must be announced
        first (``before_state_write``)."""
        return self._state_copy is not None and not self._state_copy.done and not self._released

    @property
    def done(self) -> bool:
        return (self._state_copy is None or self._state_copy.done) and self._table.done

    def before_state_write(self, state: Any, slots: np.ndarray) -> None:
        """The step or reset about to run writes these rows of the state (padding included)."""
        if self._state_copy is not None:
            self._state_copy.before_write(state, slots)

    def advance(self) -> bool:
        """Copy one more chunk (state first, then the stream table); True when all is copied."""
        if self._intact is not None and not self._intact():
            raise CheckpointAbandoned("the state was replaced while its checkpoint was being copied "
                                      "(a failed step lost it); the next checkpoint is taken at the next interval")
        if self.done:
            return True
        self.chunks += 1
        if self._state_copy is not None and not self._state_copy.done:
            self._state_copy.advance(self._get_state())
        else:
            self._table.advance(max(1, COPY_CHUNK_BYTES // 16))  # last-seen and sighting number: 16 bytes a row
        return self.done

    def complete(self) -> PendingSnapshot:
        """Copy everything now (the checkpoint of an orderly stop: nothing runs after it)."""
        while not self.advance():
            pass
        return self

    def finish(self, pause: Callable[[], None] = _no_pause) -> Snapshot:
        """The ``Snapshot`` of T0; on the checkpointer's thread, once ``advance`` returned True
        (``pause`` as for ``write_checkpoint``)."""
        state = self._state_copy.result() if self._state_copy is not None else self._host
        names, slots, last_seen = self._table.result(pause)
        last_seen += self.seen_shift
        return Snapshot(jax.tree.map(lambda leaf: leaf if isinstance(leaf, CanonicalRows) else np.asarray(leaf), state),
                        names, slots, last_seen,
                        self.counts, self.settings, self.wall_time, self.positions)

    def release(self) -> None:
        """Call once the file is written or failed, or the copy dropped: the stream table stops
        keeping the names of recycled slots for it (``TableCopy.release``)."""
        self._released = True
        self._table.release()


@dataclass(frozen=True)
class Restored:
    """A checkpoint read back by ``load_newest``: host arrays in the expected state structure
    (``jax.device_put`` it), the stream table for ``StreamSlots.restore``, counts, metadata."""

    path: Path
    state: Any
    names: list[str]
    slots: np.ndarray
    last_seen: np.ndarray
    counts: dict[str, int]
    settings: dict[str, Any]
    versions: dict[str, str]
    wall_time: float
    nbytes: int
    positions: dict[str, Any] = field(default_factory=dict)  # by feed name (controller/positions.py)

    @property
    def processed(self) -> int:
        return int(self.counts.get("processed", 0))

    @property
    def streams(self) -> int:
        return len(self.names)


# ---- file names ------------------------------------------------------------------------------------


def checkpoint_path(directory: Path | str, sequence: int) -> Path:
    """The final name of checkpoint number ``sequence`` (names sort in sequence order)."""
    return Path(directory) / f"ckpt-{sequence:09d}{SUFFIX}"


def list_checkpoints(directory: Path | str) -> list[Path]:
    """Checkpoint files with a final name, oldest first (temporary files left out)."""
    directory = Path(directory)
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), name) for name in entries if (m := _FINAL_NAME.match(name))]
    return [directory / name for _, name in sorted(found)]


def next_sequence(directory: Path | str) -> int:
    """The sequence number after the newest checkpoint in ``directory`` (0 when there is none)."""
    paths = list_checkpoints(directory)
    return int(_FINAL_NAME.match(paths[-1].name).group(1)) + 1 if paths else 0


def prune(directory: Path | str, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints; call after a successful write. Returns
    what was deleted."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    old = list_checkpoints(directory)[:-keep]
    for path in old:
        path.unlink(missing_ok=True)
    return old


def remove_temporary_files(directory: Path | str) -> list[Path]:
    """Delete the temporary files a killed writer left behind; call before writing starts
    (one process per checkpoint directory). Returns what was deleted."""
    directory = Path(directory)
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    removed = [directory / name for name in sorted(entries) if _TEMP_NAME.match(name)]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


# ---- writing -----------------------------------------------------------------------------------------


def write_checkpoint(path: Path | str, snapshot: Snapshot, pause: Callable[[], None] = _no_pause) -> int:
    """Write ``snapshot`` to ``path`` atomically; returns the file's size in bytes.

    ``pause()`` is called between chunks of work (names encoded, bytes hashed and written):
    the checkpointer passes a short sleep, so its thread does not keep asking for the GIL
    the main thread needs (see ``Checkpointer``).

    Temporary file in the same directory, fsync, ``os.replace``, fsync of the directory. On
    any error the temporary file is removed and the error raised; ``path`` is then untouched.
    """
    path = Path(path)
    temp = path.with_name(f"{TEMP_PREFIX}{path.name}.{os.getpid()}")
    digest = hashlib.sha256()
    size = 0
    try:
        with open(temp, "wb") as f:
            since_pause = unsynced = 0
            for piece in _encode(snapshot, pause):
                view = memoryview(piece).cast("B")
                for start in range(0, len(view), WRITE_CHUNK):
                    chunk = view[start:start + WRITE_CHUNK]
                    digest.update(chunk)
                    f.write(chunk)
                    since_pause += len(chunk)
                    unsynced += len(chunk)
                    if since_pause >= WRITE_CHUNK:  # per 1 MiB, not per piece (a names part is small)
                        since_pause = 0
                        pause()
                    if unsynced >= SYNC_EVERY:
                        unsynced = 0
                        f.flush()
                        _datasync(f.fileno())
                size += len(view)
            trailer = DIGEST_TAG + digest.digest() + END
            f.write(trailer)
            size += len(trailer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            temp.unlink(missing_ok=True)
        except OSError:
            pass  # the directory itself is gone or read-only: the first error is the one to report
        raise
    _fsync_directory(path.parent)
    return size


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable: without it a power cut may lose the new name."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_bytes(snapshot: Snapshot, pause: Callable[[], None] = _no_pause) -> bytes:
    """A checkpoint's bytes in memory, exactly as ``write_checkpoint`` writes its file (the
    SHA-256 trailer and end marker included): an object of a bucket (controller/partitioned.py)."""
    out = bytearray()
    digest = hashlib.sha256()
    for piece in _encode(snapshot, pause):
        view = memoryview(piece).cast("B")
        digest.update(view)
        out += view
    out += DIGEST_TAG + digest.digest() + END
    return bytes(out)


def _encode(snapshot: Snapshot, pause: Callable[[], None] = _no_pause) -> Iterator[Any]:
    """The file's bytes before the trailer, as buffers (the arrays are not copied)."""
    arrays: list[tuple[str, str, list[int], list[Any]]] = []  # name, dtype, shape, buffers
    lazy: dict[int, int] = {}  # index in arrays -> nbytes, for leaves whose bytes are made as written
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(snapshot.state)[0]:
        name = "state" + jax.tree_util.keystr(key_path)
        if isinstance(leaf, CanonicalRows):
            lazy[len(arrays)] = leaf.nbytes
            pieces = (piece.reshape(-1).view(np.uint8) for piece in leaf.pieces())
            arrays.append((name, leaf.dtype.name, list(leaf.shape), pieces))
            continue
        arr = np.ascontiguousarray(leaf)
        arrays.append((name, arr.dtype.name, list(arr.shape), [arr.reshape(-1).view(np.uint8)]))
    names_encoding, names = _encode_names(snapshot.names, pause)
    arrays.append(("streams.names", "uint8", [sum(len(b) for b in names)], names))
    for name, column, dtype in (("streams.slots", snapshot.slots, np.int32),
                                ("streams.last_seen", snapshot.last_seen, np.float64)):
        arr = np.ascontiguousarray(column, dtype)
        arrays.append((name, arr.dtype.name, list(arr.shape), [arr.view(np.uint8)]))
    table = []
    offset = 0
    for i, (name, dtype, shape, buffers) in enumerate(arrays):
        nbytes = lazy[i] if i in lazy else sum(len(memoryview(b).cast("B")) for b in buffers)
        table.append({"name": name, "dtype": dtype, "shape": shape, "offset": offset, "nbytes": nbytes})
        offset = _aligned(offset + nbytes)
    header = json.dumps({
        "format": FORMAT,
        "settings": snapshot.settings,
        "versions": library_versions(),
        "wall_time": snapshot.wall_time,
        "processed": snapshot.processed,
        "counts": snapshot.counts,
        "positions": snapshot.positions,
        "streams": len(snapshot.names),
        "names_encoding": names_encoding,
        "arrays": table,
    }, sort_keys=True).encode("utf-8")
    start = len(MAGIC) + 8 + len(header)
    yield MAGIC + struct.pack("<Q", len(header)) + header + bytes(_aligned(start) - start)
    position = 0
    for (_, _, _, buffers), entry in zip(arrays, table):
        if entry["offset"] > position:
            yield bytes(entry["offset"] - position)
        yield from buffers
        position = entry["offset"] + entry["nbytes"]


def _encode_names(names: list[str], pause: Callable[[], None] = _no_pause) -> tuple[str, list[bytes]]:
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


def _decode_names(raw: np.ndarray, encoding: str, count: int) -> list[str]:
    if encoding == "json":
        names = json.loads(raw.tobytes())
    elif encoding == "lines":
        names = raw.tobytes().decode("utf-8", "surrogatepass").split("\n") if count else []
    else:
        raise ValueError(f"unknown names encoding {encoding!r}")
    if len(names) != count:
        raise ValueError(f"{len(names)} stream names, the header says {count}")
    return names


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def library_versions() -> dict[str, str]:
    """The versions recorded in every checkpoint's metadata."""
    return {"forkless": _forkless_version(), "jax": jax.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


@functools.cache  # importlib.metadata scans every distribution on sys.path: once per process
def _forkless_version() -> str:
    try:
        return importlib.metadata.version("forkless")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout: pyproject.toml holds it
        try:
            with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
                return str(tomllib.load(f)["project"]["version"])
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


# ---- reading -----------------------------------------------------------------------------------------


def read_checkpoint(path: Path | str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header and the arrays of one checkpoint file (writable arrays sharing one buffer).

    Raises ``CheckpointDamaged`` for a file that is truncated, fails its checksum or lacks its
    end marker, and ``OSError`` when it cannot be read.
    """
    path = Path(path)
    size = os.path.getsize(path)
    if size < len(MAGIC) + 8 + TRAILER_BYTES:
        raise CheckpointDamaged(f"{path}: {size} bytes, too short to be a checkpoint (truncated)")
    buf = np.empty(size, np.uint8)  # numpy's allocation is aligned, so are the arrays in it
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        filled = 0
        while filled < size:
            n = f.readinto(view[filled:])
            if not n:
                raise CheckpointDamaged(f"{path}: ended after {filled} of {size} bytes (truncated)")
            filled += n
    return parse_checkpoint(buf, str(path))


def parse_checkpoint(data: bytes | np.ndarray, where: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``read_checkpoint`` of a checkpoint's bytes already in memory (an object of a bucket:
    controller/partitioned.py); ``where`` names it in errors. ``CheckpointDamaged`` as there."""
    if isinstance(data, np.ndarray):
        buf = data
    else:  # copied once into an aligned buffer (the arrays are views of it)
        buf = np.empty(len(data), np.uint8)
        buf[:] = np.frombuffer(data, np.uint8)
    size = len(buf)
    view = memoryview(buf)
    if size < len(MAGIC) + 8 + TRAILER_BYTES:
        raise CheckpointDamaged(f"{where}: {size} bytes, too short to be a checkpoint (truncated)")
    if bytes(view[:len(MAGIC)]) != MAGIC:
        raise CheckpointDamaged(f"{where}: not a forkless checkpoint (no {MAGIC!r} at the start)")
    body = size - TRAILER_BYTES
    if bytes(view[size - len(END):]) != END or bytes(view[body:body + len(DIGEST_TAG)]) != DIGEST_TAG:
        raise CheckpointDamaged(f"{where}: no end marker (truncated or half-written)")
    saved = bytes(view[body + len(DIGEST_TAG):size - len(END)])
    if hashlib.sha256(view[:body]).digest() != saved:
        raise CheckpointDamaged(f"{where}: checksum mismatch (the file is corrupt)")
    try:
        (length,) = struct.unpack_from("<Q", buf, len(MAGIC))
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


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # bfloat16 and friends (installed with JAX) are not known to numpy by name

        return np.dtype(getattr(ml_dtypes, name))


def load_newest(directory: Path | str, expect: Mapping[str, Any], like: Any,
                skipped: list[Path] | None = None) -> Restored | None:
    """Read the newest complete checkpoint in ``directory`` (None when there is none).

    A damaged file (truncated, bad checksum, no end marker, unreadable) is skipped with a
    warning on "forkless.checkpoint" and the one before it is tried; each skipped file is
    appended to ``skipped`` when given (None returned with files skipped: every checkpoint
    is damaged, not "there was none"). Temporary files are
    ignored. The first complete one must fit this run, else ``CheckpointMismatch``:
    - every key of ``expect`` (e.g. ``features``, ``max_streams``, ``processor``) must be
      saved with an equal value; saved settings not in ``expect`` are only recorded;
    - its state must have the structure, leaf shapes and dtypes of ``like``: the processor's
      init state, or its ``jax.eval_shape`` (a tree of ``ShapeDtypeStruct``).
    Call it before the first connection; ``jax.device_put(restored.state)`` and
    ``StreamSlots.restore(restored.names, restored.slots, restored.last_seen)`` follow.
    """
    for path in reversed(list_checkpoints(directory)):
        try:
            header, arrays = read_checkpoint(path)
        except (CheckpointDamaged, OSError) as exc:
            log.warning("skipping checkpoint %s: %s", path.name, exc)
            if skipped is not None:
                skipped.append(path)
            continue
        if header.get("format") != FORMAT:
            raise CheckpointMismatch(path, "checkpoint format", header.get("format"), FORMAT)
        _check_settings(path, header.get("settings", {}), expect)
        state = restore_state(path, arrays, like)
        try:
            names = _decode_names(arrays["streams.names"], header.get("names_encoding", "json"),
                                  int(header.get("streams", 0)))
            slots, last_seen = arrays["streams.slots"], arrays["streams.last_seen"]
        except (KeyError, ValueError) as exc:
            log.warning("skipping checkpoint %s: unreadable stream table: %s", path.name, exc)
            if skipped is not None:
                skipped.append(path)
            continue
        return Restored(path=path, state=state, names=names, slots=slots, last_seen=last_seen,
                        counts=dict(header.get("counts", {})), settings=dict(header.get("settings", {})),
                        versions=dict(header.get("versions", {})), wall_time=float(header.get("wall_time", 0.0)),
                        nbytes=os.path.getsize(path), positions=dict(header.get("positions", {})))
    return None


_ABSENT = "(not recorded)"


# checkpoints written before processors declared a name and version recorded an id instead
LEGACY_PROCESSOR_IDS = {"ewma/1": ("ewma", "1")}


def _check_settings(path: Path, saved: Mapping[str, Any], expect: Mapping[str, Any]) -> None:
    if saved.get("processor") in LEGACY_PROCESSOR_IDS and "processor_version" not in saved \
            and "processor_version" in expect:
        name, version = LEGACY_PROCESSOR_IDS[saved["processor"]]
        saved = {**saved, "processor": name, "processor_version": version}
    for key, value in expect.items():
        current = json.loads(json.dumps(value))  # as it would read back (tuples become lists)
        found = saved.get(key, _ABSENT)
        if found != current:
            raise CheckpointMismatch(path, key, found, current)


def restore_state(path: Path | str, arrays: Mapping[str, np.ndarray], like: Any) -> Any:
    """The saved state leaves rebuilt in the structure of ``like``; ``CheckpointMismatch``
    naming the leaf when a leaf is missing, extra, or of another shape or dtype."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    expected = ["state" + jax.tree_util.keystr(key_path) for key_path, _ in flat]
    saved = [name for name in arrays if name.startswith("state")]
    if saved != expected:
        raise CheckpointMismatch(path, "the state's leaves", saved, expected)
    leaves = []
    for name, (_, leaf) in zip(expected, flat):
        shape = tuple(np.shape(leaf))
        dtype = np.dtype(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype)
        got = arrays[name]
        if got.shape != shape or got.dtype != dtype:
            raise CheckpointMismatch(path, f"state leaf {name!r}", f"{got.dtype.name}{list(got.shape)}",
                                     f"{dtype.name}{list(shape)}")
        leaves.append(got)
    return jax.tree_util.tree_unflatten(treedef, leaves)
