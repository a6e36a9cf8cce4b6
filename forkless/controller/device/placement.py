"""Placement: which device owns each stream slot, and the host-side routing of a batch to it.

Rules:
- Pure numpy: no JAX, no threads, no clock. The device layer builds the mesh and the sharded step from a
  ``Placement``; the loop routes each batch with it.
- Slot ``s`` lives on device ``s % N`` at local row ``s // N``: strided, so new streams fill the devices evenly.
- Each device's shard has ``R = ceil(max_streams / N) + 1`` rows, the last its spare (its padding points there);
  the global table is ``[N * R, ...]``, device ``d`` holding rows ``d * R .. d * R + R - 1``.
- A batch of ``m`` messages becomes an ``[N, Bd]`` layout (flattened): each device's messages in arrival order,
  then padding; ``Bd`` is the busiest device's bucket. ``Route.positions[i]`` is where message ``i`` sits, so
  outputs come back in arrival order with one fancy index.
- Each batch crosses as ONE array and its results come back as ONE (each array is a transfer per device): ``pack``
  lays ``x``'s bits, the key and ``valid`` side by side in uint32 words ``[N * Bd, F * k + 2]``; the step packs its
  outputs and finiteness flags into bytes ``[N * Bd, T]``, read back by ``unpack_outputs`` as numpy views. The
  key never travels in a float array: a TPU's float64 is not IEEE double, and its copy can zero a small key.
- The canonical order (row ``s`` = slot ``s``, then the spare) is what checkpoints hold, so a file does not depend
  on the device count: ``to_sharded`` and ``CanonicalRows`` convert.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from forkless.controller.batching import bucket_for

__all__ = ["CanonicalRows", "OutputField", "Placement", "Route", "pack_words", "unpack_outputs", "words_per_row"]

# rows converted per piece when a sharded table is written in canonical order: each piece is
# a small copy (cache-sized), so the writer thread never holds one large buffer
CANONICAL_CHUNK_BYTES = 8 << 20


def words_per_row(features: int, dtype: Any) -> int:
    """uint32 words a message takes in a packed batch: ``x``'s bits, the key, ``valid``."""
    return features * np.dtype(dtype).itemsize // 4 + 2


def pack_words(x: np.ndarray, keys: np.ndarray, rows: int, spare: int, dtype: Any,
               positions: np.ndarray | None = None) -> np.ndarray:
    """A batch as one uint32 ``[rows, F * k + 2]`` array (k = ``dtype``'s itemsize / 4): per
    row ``x`` as ``dtype``'s bits, the key (int32's bits), ``valid`` (1 or 0); message i at row
    ``positions[i]`` (the first ``len(keys)`` rows when None), the other rows padding: key
    ``spare``, valid 0. Integer words only, so no copy can change a bit (``compiled.unpack_words``
    takes them apart on the device)."""
    dtype = np.dtype(dtype)
    features = x.shape[1]
    width = features * dtype.itemsize // 4
    words = np.zeros((rows, width + 2), np.uint32)
    at = slice(0, len(keys)) if positions is None else positions
    words[:, :width].view(dtype)[at] = x  # x cast to dtype as it is copied in (one copy)
    words[:, width] = np.uint32(spare)
    words[at, width] = np.asarray(keys).astype(np.int32).view(np.uint32)
    words[at, width + 1] = 1
    return words


class Route(NamedTuple):
    """Where a batch's messages go: ``bucket`` (Bd, rows per device), ``positions`` (int
    [m], message i's row in the ``[N * Bd]`` layout) and ``counts`` (int [N], messages per
    device)."""

    bucket: int
    positions: np.ndarray
    counts: np.ndarray


@dataclass(frozen=True)
class Placement:
    """Slots spread over ``devices`` devices for a table of ``max_streams`` streams."""

    devices: int
    max_streams: int

    def __post_init__(self) -> None:
        if self.devices < 1 or self.max_streams < 1:
            raise ValueError(f"devices and max_streams must be >= 1, got {self.devices}, {self.max_streams}")

    @property
    def rows_per_device(self) -> int:
        """R: the rows of one device's shard, its spare row (the last) included."""
        return -(-self.max_streams // self.devices) + 1

    @property
    def spare_row(self) -> int:
        """The local row that padding points at on every device (``R - 1``)."""
        return self.rows_per_device - 1

    @property
    def table_rows(self) -> int:
        """Rows of the global sharded table: ``N * R``."""
        return self.devices * self.rows_per_device

    def device_of(self, slots: np.ndarray) -> np.ndarray:
        """The device index owning each slot."""
        return np.asarray(slots) % self.devices

    def global_rows(self, slots: np.ndarray) -> np.ndarray:
        """Each slot's row in the global ``[N * R]`` table."""
        slots = np.asarray(slots)
        return (slots % self.devices) * self.rows_per_device + slots // self.devices

    def route(self, slots: np.ndarray, buckets: Sequence[int]) -> Route:
        """Group the batch's slots by owning device, arrival order kept within a device;
        ``Bd`` is the smallest bucket that holds the busiest device's messages."""
        n = self.devices
        dev = np.asarray(slots) % n
        counts = np.bincount(dev, minlength=n)
        bucket = bucket_for(int(counts.max()) if len(dev) else 1, tuple(buckets))
        # sorted by device (a stable sort keeps arrival order within a device), message j of
        # the sorted order goes to row j - (messages on earlier devices) + device * Bd
        order = np.argsort(dev, kind="stable")
        shift = np.arange(0, n * bucket, bucket) - (np.cumsum(counts) - counts)
        positions = np.empty(len(dev), np.int64)
        positions[order] = np.arange(len(dev)) + shift[dev[order]]
        return Route(bucket, positions, counts)

    def pack(self, x: np.ndarray, slots: np.ndarray, route: Route, dtype: Any = np.float32) -> np.ndarray:
        """The batch as one uint32 ``[N * Bd, F * k + 2]`` array (``pack_words``): each
        message's ``x`` (``dtype``, the processor's input dtype) and its local row at its
        route's position, padding pointing at the spare row; the step unpacks it on each device."""
        return pack_words(x, np.asarray(slots) // self.devices, self.devices * route.bucket, self.spare_row, dtype,
                          route.positions)

    def reset_index(self, slots: Sequence[int] | np.ndarray, per_device: int) -> np.ndarray:
        """Local rows to reset, as an int32 ``[N * per_device]`` layout padded with the spare
        row (resetting it is harmless); at most ``per_device`` slots per device."""
        idx = np.full((self.devices, per_device), self.spare_row, np.int32)
        slots = np.asarray(slots, np.int64)
        if len(slots):
            route = self.route(slots, (per_device,))
            idx.reshape(-1)[route.positions] = slots // self.devices
        return idx.reshape(-1)

    def to_sharded(self, canonical: np.ndarray) -> np.ndarray:
        """A per-stream leaf in canonical order (``[max_streams + 1, ...]``, the spare last) as
        the global ``[N * R, ...]`` table; rows no slot maps to get the spare's value."""
        canonical = np.asarray(canonical)
        n, r, s = self.devices, self.rows_per_device, self.max_streams
        if canonical.shape[0] != s + 1:
            raise ValueError(f"expected {s + 1} rows (max_streams + 1), got {canonical.shape[0]}")
        tail = canonical.shape[1:]
        padded = np.empty((n * (r - 1), *tail), canonical.dtype)
        padded[:s] = canonical[:s]
        padded[s:] = canonical[s]
        table = np.empty((n, r, *tail), canonical.dtype)
        # slot s = local row s // N of device s % N: a transpose of the padded [R - 1, N] grid
        table[:, :r - 1] = padded.reshape((r - 1, n, *tail)).swapaxes(0, 1)
        table[:, r - 1] = canonical[s]
        return table.reshape((n * r, *tail))


class CanonicalRows:
    """A sharded per-stream leaf read in canonical order (row s = slot s, then the spare),
    built lazily from its device shards, so the copy happens where it is written.

    ``shards`` are the N device shards (``[R, ...]`` each, device order), e.g. views of the
    device buffers; nothing is copied until ``pieces()`` runs.
    """

    def __init__(self, shards: Sequence[Any], placement: Placement) -> None:
        self.shards = [np.asarray(shard) for shard in shards]
        self.placement = placement
        first = self.shards[0]
        if len(self.shards) != placement.devices or any(sh.shape != first.shape for sh in self.shards):
            raise ValueError(f"expected {placement.devices} shards of equal shape")
        self.dtype = first.dtype
        self.shape = (placement.max_streams + 1, *first.shape[1:])

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def pieces(self) -> Iterator[np.ndarray]:
        """Contiguous pieces whose concatenation is the canonical array."""
        n, s = self.placement.devices, self.placement.max_streams
        row_bytes = max(1, int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize)
        step = max(1, CANONICAL_CHUNK_BYTES // (row_bytes * n))  # local rows per piece
        local_rows = -(-s // n)
        for lo in range(0, local_rows, step):
            hi = min(local_rows, lo + step)
            piece = np.stack([shard[lo:hi] for shard in self.shards], axis=1)  # [hi - lo, N, ...]
            piece = piece.reshape((-1, *self.shape[1:]))
            yield piece[:max(0, s - lo * n)] if hi * n > s else piece
        spare = self.placement.spare_row
        yield np.ascontiguousarray(self.shards[0][spare:spare + 1])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.concatenate(list(self.pieces()), axis=0)
        return out if dtype is None else out.astype(dtype)


class OutputField(NamedTuple):
    """Where one output sits in a row of the step's packed results: bytes ``offset`` to
    ``offset + nbytes`` hold it, C order, as ``dtype`` with shape ``tail`` (bool as 0/1 bytes)."""

    name: str
    dtype: np.dtype
    tail: tuple[int, ...]
    offset: int
    nbytes: int


def unpack_outputs(packed: np.ndarray, layout: Sequence[OutputField], positions: np.ndarray | slice
                   ) -> list[np.ndarray]:
    """The fields of ``layout`` for the messages at ``positions`` (arrival order; a slice: the
    rows one device's batch fills), from the step's packed results (uint8 ``[N * Bd, T]``):
    one array per field, in ``layout`` order."""
    width = packed.shape[1]
    # each row as one opaque item: picking rows is then one copy a row, not one a byte
    picked = np.ascontiguousarray(packed).view(np.dtype((np.void, width))).reshape(-1)[positions]
    m = len(picked)
    rows = picked.view(np.uint8).reshape(m, width)
    return [np.ascontiguousarray(rows[:, field.offset:field.offset + field.nbytes]).view(field.dtype)
            .reshape((m, *field.tail)) for field in layout]
