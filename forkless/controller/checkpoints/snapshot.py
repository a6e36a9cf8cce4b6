"""The device snapshot: the processor state and the stream table as one checkpoint holds them, copied to the host
without stalling the steps, and the state rebuilt from a checkpoint's arrays.

Rules:
- No threads and no clock here: times are passed in. The main thread begins and copies a snapshot; the
  checkpointer's thread finishes and encodes it.
- The controller's checkpoints are a ``PendingSnapshot``: begun between two steps (T0), copied a chunk at a time
  between the following steps (``advance``), exact as of T0 by copy-on-write (``before_state_write`` before every
  step and slot reset; the stream table keeps its own), then made a ``Snapshot`` on the writer thread (``finish``).
  On one CPU device a leaf's ``device_get`` is a view of its buffer, and a donated step would then copy the whole
  table instead of updating it in place: each view here lives only inside one call (tests pin the buffer).
- Elsewhere (an accelerator, several devices, an orderly stop's checkpoint) the state is copied whole at T0: with
  a ``clone`` the main thread only copies it on the device(s) and starts its copy to the host, which ``finish``
  waits for; the clone costs the state's size in device memory meanwhile (docs/checkpoints.md). The writer
  thread reads host values only: it dispatches nothing to JAX.
- A step writes only its batch's rows of a per-stream leaf (the processor contract): the copy-on-write keeps
  exactly those rows.
- A checkpoint holds the state in canonical slot order (row s = slot s, the spare last) whatever the device count,
  so one taken on N devices restores on M; a sharded state is put in order piece by piece on the writer thread
  (``CanonicalRows``). ``restore_state`` returns canonical host arrays for the caller to place.
- A snapshot's bytes are the checkpoint format's: each state leaf named ``"state" + keystr(path)``, the library
  versions beside them.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from forkless import __version__
from forkless.controller.checkpoints import ckptformat
from forkless.controller.checkpoints.ckptformat import no_pause
from forkless.controller.device.placement import CanonicalRows
from forkless.controller.errors import CheckpointMismatch
from forkless.controller.rowcopy import RowCopy
from forkless.controller.slots import TableCopy

__all__ = [
    "COPY_CHUNK_BYTES",
    "CheckpointAbandoned",
    "PendingSnapshot",
    "Snapshot",
    "StateCopy",
    "checkpoint_bytes",
    "encode_snapshot",
    "library_versions",
    "restore_state",
    "shares_device_memory",
    "take_snapshot",
]

# bytes of rows copied per PendingSnapshot.advance(): a short piece of the main thread's time into fresh host
# pages, so a tick stays within its budget (bench/docs/checkpoints.md, "Smaller copy ticks")
COPY_CHUNK_BYTES = 1 << 18


class CheckpointAbandoned(RuntimeError):
    """A checkpoint being copied between steps cannot be completed (the state it was copying
    was replaced); it is counted as a failure and the next one is taken at the next interval."""


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
    names: Sequence[str]
    slots: np.ndarray
    last_seen: np.ndarray
    counts: dict[str, int]
    settings: dict[str, Any]
    wall_time: float
    # the replayable sources' positions as of the same moment (controller/checkpoints/positions.py), by feed name
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

    Why: a view of a donated buffer alive at the next step makes that step copy the whole table
    instead of updating it in place; here every view is dropped before its call returns.

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
    one CPU device); otherwise ``clone(state)`` copies it on the device(s) at T0 and its host
    copy is started, waited for in ``finish``; without a clone ``host_copy`` (``jax.device_get``)
    copies it at T0. ``intact()``
    returns False once the state being copied was replaced (a failed step lost it): ``advance``
    then raises ``CheckpointAbandoned``. ``seen_shift`` is added to the table's last-seen times
    (monotonic -> wall clock); ``wall_time`` is Unix seconds at T0.
    """

    def __init__(self, state: Any, table: TableCopy, counts: Mapping[str, int], settings: Mapping[str, Any],
                 wall_time: float, *, rows: int, get_state: Callable[[], Any], seen_shift: float = 0.0,
                 incremental: bool = True, intact: Callable[[], bool] | None = None,
                 host_copy: Callable[[Any], Any] = jax.device_get,
                 positions: Mapping[str, Any] | None = None, clone: Callable[[Any], Any] | None = None) -> None:
        self.incremental = incremental and shares_device_memory(state)
        self._state_copy = StateCopy(state, rows) if self.incremental else None
        self._host = None
        self._host_copy = host_copy
        self._on_device: Any = None  # the state cloned on its device(s) at T0, its host copy started
        if not self.incremental and clone is not None:
            self._on_device = clone(state)
            for leaf in jax.tree.leaves(self._on_device):
                start = getattr(leaf, "copy_to_host_async", None)  # not every array kind has it
                if start is not None:
                    start()
        elif not self.incremental:  # at T0: an accelerator's transfer, or the shards of several devices
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

    def finish(self, pause: Callable[[], None] = no_pause) -> Snapshot:
        """The ``Snapshot`` of T0; on the checkpointer's thread, once ``advance`` returned True
        (``pause`` as for ``write_checkpoint``)."""
        if self._on_device is not None:  # waits for the copy the main thread started
            self._host, self._on_device = self._host_copy(self._on_device), None
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
        self._on_device = None  # the device memory of a clone not finished
        self._table.release()


# ---- a snapshot's bytes and back ---------------------------------------------------------------------


def encode_snapshot(snapshot: Snapshot, pause: Callable[[], None] = no_pause) -> Iterator[Any]:
    """The checkpoint's bytes before the trailer, as buffers (``ckptformat.encode``)."""
    leaves = [("state" + jax.tree_util.keystr(key_path), leaf)
              for key_path, leaf in jax.tree_util.tree_flatten_with_path(snapshot.state)[0]]
    yield from ckptformat.encode(
        leaves, (snapshot.names, snapshot.slots, snapshot.last_seen), settings=snapshot.settings,
        versions=library_versions(), wall_time=snapshot.wall_time, counts=snapshot.counts,
        positions=snapshot.positions, pause=pause)


def checkpoint_bytes(snapshot: Snapshot, pause: Callable[[], None] = no_pause) -> bytes:
    """A checkpoint's bytes in memory, exactly as ``write_checkpoint`` writes its file (the
    SHA-256 trailer and end marker included): an object of a bucket (controller/partitions/partitioned.py)."""
    return ckptformat.join(encode_snapshot(snapshot, pause))


def library_versions() -> dict[str, str]:
    """The versions recorded in every checkpoint's metadata."""
    return {"forkless": __version__, "jax": jax.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def restore_state(path: Path | str, arrays: Mapping[str, np.ndarray], like: Any) -> Any:
    """The saved state leaves rebuilt in the structure of ``like``; ``CheckpointMismatch``
    naming the leaf when a leaf is missing, extra, or of another shape or dtype. A 0-d leaf saved
    as one element of shape [1] (an older checkpoint's) is read back 0-d."""
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
        if shape == () and got.shape == (1,):  # an older checkpoint's 0-d leaf: the same one value
            got = got.reshape(())
        if got.shape != shape or got.dtype != dtype:
            raise CheckpointMismatch(path, f"state leaf {name!r}", f"{got.dtype.name}{list(got.shape)}",
                                     f"{dtype.name}{list(shape)}")
        leaves.append(got)
    return jax.tree_util.tree_unflatten(treedef, leaves)
