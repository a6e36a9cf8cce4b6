"""Checkpoints in a directory: writing one atomically, listing and pruning them, reading back the newest complete
one; ``DirectoryStore``, the ``CheckpointStore`` of ``FORKLESS_CHECKPOINT_DIR``.

Rules:
- No threads and no clock here. ``write_checkpoint`` runs on the checkpointer's thread and holds the GIL only
  briefly: hashing and large writes release it, the stream names are encoded in small chunks.
- One checkpoint is one file, ``ckpt-<sequence>.fkc`` (controller/checkpoints/ckptformat.py), written to a
  temporary ``.tmp-ckpt-…`` file in the same directory, fsynced, renamed into place and the directory fsynced:
  a file with a final name is complete; a killed writer leaves only a temporary file (``remove_temporary_files``).
- A damaged file (truncated, bad checksum, no end marker) is skipped with a warning by ``load_newest``, which
  falls back to the one before and tells its caller which it skipped (all damaged is not "no checkpoint").
- A complete checkpoint that does not fit this run is never skipped silently: ``CheckpointMismatch`` names the
  setting and both values.
- Not orbax-checkpoint: its save blocks the main thread far longer, it does not detect a corrupted byte, and it
  brings 13 packages (bench/docs/checkpoints.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from forkless.controller.checkpoints.ckptformat import (
    MIN_BYTES,
    CheckpointDamaged,
    check_fits,
    decode_names,
    file_name,
    is_temporary,
    no_pause,
    parse_checkpoint,
    sequence_of,
    temporary_name,
    trailer,
)
from forkless.controller.checkpoints.snapshot import Snapshot, encode_snapshot, restore_state

__all__ = [
    "DirectoryStore",
    "Restored",
    "as_restored",
    "checkpoint_path",
    "list_checkpoints",
    "load_newest",
    "next_sequence",
    "prune",
    "read_checkpoint",
    "remove_temporary_files",
    "write_checkpoint",
]

log = logging.getLogger("forkless.checkpoint")

# bytes hashed and written per call: the hash stays in cache, and each call releases the GIL
WRITE_CHUNK = 1 << 20
# bytes written between two fdatasync calls: the disk writes a checkpoint as it goes, on this
# (idle-priority) thread, instead of the kernel's flusher writing ~100 MB at the final fsync
SYNC_EVERY = 8 << 20
_datasync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync


@dataclass(frozen=True)
class Restored:
    """A checkpoint read back by ``load_newest``: host arrays in the expected state structure
    (``jax.device_put`` it), the stream table for ``StreamSlots.restore``, counts, metadata."""

    path: Path | str  # the file, or where a store of another kind kept it
    state: Any
    names: list[str]
    slots: np.ndarray
    last_seen: np.ndarray
    counts: dict[str, int]
    settings: dict[str, Any]
    versions: dict[str, str]
    wall_time: float
    nbytes: int
    positions: dict[str, Any] = field(default_factory=dict)  # by feed name (controller/checkpoints/positions.py)

    @property
    def processed(self) -> int:
        return int(self.counts.get("processed", 0))

    @property
    def streams(self) -> int:
        return len(self.names)


# ---- file names ------------------------------------------------------------------------------------


def checkpoint_path(directory: Path | str, sequence: int) -> Path:
    """The final name of checkpoint number ``sequence`` (names sort in sequence order)."""
    return Path(directory) / file_name(sequence)


def list_checkpoints(directory: Path | str) -> list[Path]:
    """Checkpoint files with a final name, oldest first (temporary files left out)."""
    directory = Path(directory)
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(sequence, name) for name in entries if (sequence := sequence_of(name)) is not None]
    return [directory / name for _, name in sorted(found)]


def next_sequence(directory: Path | str) -> int:
    """The sequence number after the newest checkpoint in ``directory`` (0 when there is none)."""
    paths = list_checkpoints(directory)
    if not paths:
        return 0
    last = sequence_of(paths[-1].name)
    assert last is not None  # list_checkpoints lists final names only
    return last + 1


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
    removed = [directory / name for name in sorted(entries) if is_temporary(name)]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


# ---- writing -----------------------------------------------------------------------------------------


def write_checkpoint(path: Path | str, snapshot: Snapshot, pause: Callable[[], None] = no_pause) -> int:
    """Write ``snapshot`` to ``path`` atomically; returns the file's size in bytes.

    ``pause()`` is called between chunks of work (names encoded, bytes hashed and written):
    the checkpointer passes a short sleep, so its thread does not keep asking for the GIL
    the main thread needs (see ``Checkpointer``).

    Temporary file in the same directory, fsync, ``os.replace``, fsync of the directory. On
    any error the temporary file is removed and the error raised; ``path`` is then untouched.
    """
    path = Path(path)
    temp = path.with_name(temporary_name(path.name, os.getpid()))
    digest = hashlib.sha256()
    size = 0
    try:
        with open(temp, "wb") as f:
            since_pause = unsynced = 0
            for piece in encode_snapshot(snapshot, pause):
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
            end = trailer(digest.digest())
            f.write(end)
            size += len(end)
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


# ---- reading -----------------------------------------------------------------------------------------


def read_checkpoint(path: Path | str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The header and the arrays of one checkpoint file (writable arrays sharing one buffer).

    Raises ``CheckpointDamaged`` for a file that is truncated, fails its checksum or lacks its
    end marker, and ``OSError`` when it cannot be read.
    """
    path = Path(path)
    size = os.path.getsize(path)
    if size < MIN_BYTES:
        raise CheckpointDamaged(f"{path}: {size} bytes, too short to be a checkpoint (truncated)")
    buf = np.empty(size, np.uint8)  # numpy's allocation is aligned, so are the arrays in it
    view = buf.data  # memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        filled = 0
        while filled < size:
            n = f.readinto(view[filled:])
            if not n:
                raise CheckpointDamaged(f"{path}: ended after {filled} of {size} bytes (truncated)")
            filled += n
    return parse_checkpoint(buf, str(path))


def as_restored(where: Path | str, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
                expect: Mapping[str, Any], like: Any, nbytes: int) -> Restored:
    """One checkpoint's header and arrays (``read_checkpoint``, or ``ckptformat.parse_checkpoint``
    of its bytes: a store of another kind) as a ``Restored`` for this run. ``CheckpointMismatch``
    when it does not fit (see ``load_newest``); ``CheckpointDamaged`` when its stream table does
    not read back (skip it, as a damaged file is skipped)."""
    check_fits(where, header, expect)
    state = restore_state(where, arrays, like)
    try:
        names = decode_names(arrays["streams.names"], header.get("names_encoding", "json"),
                             int(header.get("streams", 0)))
        slots, last_seen = arrays["streams.slots"], arrays["streams.last_seen"]
    except (KeyError, ValueError) as exc:
        raise CheckpointDamaged(f"unreadable stream table: {exc}") from exc
    return Restored(path=where, state=state, names=names, slots=slots, last_seen=last_seen,
                    counts=dict(header.get("counts", {})), settings=dict(header.get("settings", {})),
                    versions=dict(header.get("versions", {})), wall_time=float(header.get("wall_time", 0.0)),
                    nbytes=nbytes, positions=dict(header.get("positions", {})))


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
            return as_restored(path, header, arrays, expect, like, os.path.getsize(path))
        except (CheckpointDamaged, OSError) as exc:  # a mismatch is neither: raised, never skipped
            log.warning("skipping checkpoint %s: %s", path.name, exc)
            if skipped is not None:
                skipped.append(path)
    return None


# ---- the store ---------------------------------------------------------------------------------------


class DirectoryStore:
    """Checkpoints as files in ``directory`` (the rules above), the newest ``keep`` kept: the
    checkpoint store of ``FORKLESS_CHECKPOINT_DIR`` (``CheckpointStore``, controller/checkpoints/checkpointer.py).
    One process per directory. ``write(path, snapshot) -> size_bytes``, when given, writes each
    file instead of ``write_checkpoint`` (tests pass one that waits on an event first)."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 3,
                 write: Callable[[Path, Snapshot], int] = write_checkpoint) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.label = str(self.directory)
        self._write = write

    def start(self) -> None:
        """Create the directory and delete the temporary files a killed writer left (logged);
        ``OSError`` when it cannot be created. Before the first write."""
        self.directory.mkdir(parents=True, exist_ok=True)
        removed = remove_temporary_files(self.directory)
        if removed:
            log.info("removed %d unfinished checkpoint file(s) left by an earlier run: %s",
                     len(removed), ", ".join(p.name for p in removed))

    def next_sequence(self) -> int:
        """The number after the newest file's (0 when there is none)."""
        return next_sequence(self.directory)

    def write(self, sequence: int, snapshot: Snapshot, pause: Callable[[], None] = no_pause) -> tuple[int, Path]:
        """Checkpoint number ``sequence`` written atomically (``write_checkpoint``, pausing between
        its chunks; a custom ``write`` is called as given): its size and its path."""
        path = checkpoint_path(self.directory, sequence)
        if self._write is write_checkpoint:
            return write_checkpoint(path, snapshot, pause), path
        return self._write(path, snapshot), path

    def prune(self) -> None:
        """Delete all but the newest ``keep`` files (after a successful write)."""
        prune(self.directory, self.keep)

    def load(self, expect: Mapping[str, Any], like: Any, skipped: list[Path] | None = None) -> Restored | None:
        """The newest complete checkpoint that fits (``load_newest``)."""
        return load_newest(self.directory, expect, like, skipped)
