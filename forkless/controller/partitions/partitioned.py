"""Checkpoints of a partitioned instance: one object per partition in its connector's object store
(``FORKLESS_CHECKPOINT_BUCKET``), so that whichever instance owns a partition next restores exactly its rows.

Rules:
- An object is a checkpoint in the format of controller/checkpoints/ckptformat.py holding one partition only: its
  streams' names, last-seen times and rows of every per-stream leaf (compact: row i = its i-th stream), and the
  feed's position for that partition. No shared leaves (``restore_shared=True`` is refused) and no counts.
- Names: ``<stream>/<partition>/ckpt-<sequence:09d>.fkc``. Every checkpoint writes one object per owned partition,
  even an empty one (its position moves on), numbered above every object found at start, and keeps the newest
  ``keep`` per partition. A partition is a unit: each object carries its own position, so a process killed
  between two partitions' objects leaves each resuming from where its own state stands.
- The split runs on the checkpoint writer thread: each stream's partition is the connector's
  ``partition_of_names``, computed once per checkpoint, vectorised.
- A partition's position is written and read by the connector's ``PositionCodec`` (``partition_entry``,
  ``partition_position``), with the stream's created time: the feed refuses a stream made again since, and owned
  objects of different created times are ``PositionLost`` at the restore.
- Restore (``load``, before the compile): per owned partition, its newest object that reads back whole; a damaged
  one is skipped with a warning; every one of a partition damaged is ``PositionLost`` (starting it fresh would
  hide the loss); another processor, features or row layout is ``CheckpointMismatch``; so are more streams than
  ``FORKLESS_MAX_STREAMS``. The streams go into slots 0..n-1 of the init state (``restore_into``).
- I/O goes through the connector's ``OwnedPartitions``, whose puts refuse once a partition's lease is lost.
- ``PartitionOwner``: at start, before any restore, it asks the connector to own its partitions
  (``Connector.own_partitions``), makes the objects' reader and writer, is asked ``lost`` every cycle (``LeaseLost``,
  exit 3) and ``close``d after the stop's checkpoint. The replies' fence is the connector's business.
  ``NoPartitions`` has the same calls, called unconditionally. It is handed ``InstanceSettings``, never ``Config``.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import numpy as np

from forkless.controller.checkpoints.ckptformat import (
    CheckpointDamaged,
    check_fits,
    decode_names,
    no_pause,
    parse_checkpoint,
)
from forkless.controller.checkpoints.snapshot import Snapshot, checkpoint_bytes
from forkless.controller.device.compiled import per_stream_leaf
from forkless.controller.errors import CheckpointMismatch, ProcessorContractError
from forkless.controller.processor import Processor, description_of
from forkless.controller.settings.groups import InstanceSettings
from forkless.io_loop.connectors.connector import Connector, OwnedPartitions, PartitionLayout
from forkless.io_loop.errors import ACCEPT_LOSS, LeaseLost, ObjectDamaged, PositionLost

__all__ = ["NoPartitions", "PartitionOwner", "PartitionPieces", "PartitionedCheckpoints", "check_partitionable",
           "object_name", "partitioned_feed"]

log = logging.getLogger("forkless.checkpoint")

_NAME = re.compile(r"^(?P<prefix>.+)/(?P<partition>\d+)/ckpt-(?P<seq>\d{9,})\.fkc$")


class ObjectStore(Protocol):
    def put(self, name: str, data: bytes) -> None: ...
    def get(self, name: str) -> bytes | None: ...
    def names(self, prefix: str = "") -> list[str]: ...
    def delete(self, name: str) -> None: ...


def object_name(stream: str, partition: int, sequence: int) -> str:
    return f"{stream}/{partition}/ckpt-{sequence:09d}.fkc"


@dataclass
class PartitionPieces:
    """What ``load`` found: per partition, its streams and per-stream rows and its position."""

    names: list[str] = field(default_factory=list)
    last_seen: list[np.ndarray] = field(default_factory=list)
    rows: list[list[np.ndarray]] = field(default_factory=list)  # per partition, per per-stream leaf
    positions: dict[int, list[Any]] = field(default_factory=dict)  # partition -> [seq, index, last]
    created: dict[int, str] = field(default_factory=dict)  # partition -> the stream's created time recorded
    objects: list[str] = field(default_factory=list)
    wall_time: float = 0.0
    nbytes: int = 0

    @property
    def streams(self) -> int:
        return len(self.names)


class PartitionedCheckpoints:
    """The owned partitions' checkpoint objects in ``store`` (see the module rules).
    ``feed``: the partitioned feed's name (the key of its position); ``layout``: its partitions (the stream, the
    count, the owned ones); ``positions``: its connector's ``PositionCodec``; ``like``: the state's canonical
    shapes (``checkpoint_shapes``/``state_shapes``), whose per-stream leaves have ``slots`` rows."""

    def __init__(self, store: ObjectStore, *, feed: str, layout: PartitionLayout, positions: Any, keep: int,
                 like: Any, slots: int) -> None:
        self.store = store
        self.feed = feed
        self.layout = layout
        self.positions = positions
        self.stream = layout.stream
        self.count = layout.count
        self.partitions = tuple(layout.partitions)
        self.keep = keep
        self.slots = slots
        flat, _ = jax.tree_util.tree_flatten_with_path(like)
        self.leaf_names = ["state" + jax.tree_util.keystr(path) for path, _ in flat]
        self.per_stream = [per_stream_leaf(leaf, slots) for _, leaf in flat]
        self.row_shapes = [(tuple(leaf.shape[1:]), np.dtype(leaf.dtype)) for _, leaf in flat]
        self.label = f"bucket objects {self.stream}/<partition>/ (partitions {layout.shown(self.partitions)})"

    # ---- numbering ----------------------------------------------------------------------------------

    def _existing(self) -> dict[int, list[tuple[int, str]]]:
        """The owned partitions' objects, oldest first: partition -> [(sequence, name)]."""
        owned = set(self.partitions)
        found: dict[int, list[tuple[int, str]]] = {p: [] for p in self.partitions}
        for name in self.store.names(f"{self.stream}/"):
            m = _NAME.match(name)
            if m and m.group("prefix") == self.stream and int(m.group("partition")) in owned:
                found[int(m.group("partition"))].append((int(m.group("seq")), name))
        for items in found.values():
            items.sort()
        return found

    def start(self) -> None:
        """Nothing to prepare: the bucket is the store's (a ``CheckpointStore``:
        controller/checkpoints/checkpointer.py)."""

    def next_sequence(self) -> int:
        """Above every object of the owned partitions (whoever wrote them)."""
        seqs = [seq for items in self._existing().values() for seq, _ in items]
        return max(seqs) + 1 if seqs else 0

    # ---- writing (the checkpoint writer thread) -----------------------------------------------------

    def write(self, sequence: int, snapshot: Snapshot, pause: Callable[[], None] = no_pause) -> tuple[int, str]:
        """One object per owned partition; returns the bytes written and a label for the logs."""
        names = snapshot.names if isinstance(snapshot.names, list) else list(snapshot.names)
        parts = self.layout.partition_of_names(names)
        pause()
        slots = np.asarray(snapshot.slots)
        seen = np.asarray(snapshot.last_seen)
        leaves = jax.tree_util.tree_leaves(snapshot.state)
        per_stream = [np.asarray(leaf) for leaf, flag in zip(leaves, self.per_stream) if flag]
        order = np.argsort(parts, kind="stable")
        bounds = np.searchsorted(parts[order], np.arange(self.count + 1))
        total = 0
        for p in self.partitions:
            idx = order[bounds[p]:bounds[p + 1]]
            rows = slots[idx]
            piece = Snapshot(
                state=[leaf[rows] for leaf in per_stream],
                names=[names[i] for i in idx], slots=np.arange(len(idx), dtype=np.int32),
                last_seen=seen[idx], counts={},
                settings={**snapshot.settings, "partition": p, "partition_count": self.count,
                          "leaves": [n for n, flag in zip(self.leaf_names, self.per_stream) if flag]},
                wall_time=snapshot.wall_time, positions=self._position(snapshot.positions, p))
            data = checkpoint_bytes(piece, pause)
            self.store.put(object_name(self.stream, p, sequence), data)
            total += len(data)
            pause()
        return total, f"{self.stream}/*/ckpt-{sequence:09d}.fkc ({len(self.partitions)} partitions)"

    def _position(self, positions: Mapping[str, Any], partition: int) -> dict[str, Any]:
        entry = self.positions.partition_entry(positions.get(self.feed), partition)
        return {} if entry is None else {self.feed: entry}  # none: nothing consumed yet, no position restored

    def prune(self) -> None:
        for items in self._existing().values():
            for _, name in items[:-self.keep]:
                self.store.delete(name)

    # ---- restoring (the main thread, before the compile) -------------------------------------------

    def load(self, expect: Mapping[str, Any], like: Any = None, skipped: list[Any] | None = None
             ) -> PartitionPieces | None:
        """Each owned partition's newest good object (see the module rules); None if none has one.
        ``like`` and ``skipped`` (the ``CheckpointStore`` call) are not used: the objects' shapes
        are this object's. A damaged one is logged and the partition's previous one used; a
        partition whose every object is damaged raises ``PositionLost`` (its state and position
        are lost: started fresh, its later messages would be answered from an empty state)."""
        expect = {k: v for k, v in expect.items() if k != "max_streams"}  # rows are compact: any capacity
        pieces = PartitionPieces()
        found_any = False
        lost: dict[int, list[str]] = {}  # partition -> its objects, every one damaged
        for p, items in self._existing().items():
            damaged: list[str] = []
            for _, name in reversed(items):
                got = self._read_object(name, p, expect)
                if got is None:  # gone since it was listed (pruned): not damaged
                    continue
                if isinstance(got, str):
                    log.warning("skipping checkpoint object %s: %s", name, got)
                    damaged.append(name)
                    continue
                header, names, rows, seen, nbytes = got
                found_any = True
                self._add(pieces, f"{name} (bucket object)", p, header, names, rows, seen)
                pieces.objects.append(name)
                pieces.nbytes += nbytes
                break
            else:
                if damaged:
                    lost[p] = damaged
        if lost:
            raise PositionLost(
                f"{self.label}: every checkpoint object of partitions {self.layout.shown(sorted(lost))} is damaged "
                f"({', '.join(name for names in lost.values() for name in names)}), so the state they held and "
                f"their positions are unknown: refusing to start them fresh. To continue anyway, {ACCEPT_LOSS}")
        if len(pieces.names) > self.slots - 1:
            raise CheckpointMismatch(self.label, "streams in the owned partitions (FORKLESS_MAX_STREAMS)",
                                     len(pieces.names), self.slots - 1)
        return pieces if found_any else None

    def _read_object(self, name: str, p: int, expect: Mapping[str, Any]) -> Any:
        """Partition ``p``'s object ``name``: ``_read``'s parts and its size; None when it is gone;
        why it cannot be used (a ``str``) when it is damaged or unreadable. ``CheckpointMismatch``
        is raised, never skipped: it names the setting and both values."""
        try:
            data = self.store.get(name)
        except ObjectDamaged as exc:
            return str(exc)
        if data is None:
            return None
        try:
            return (*self._read(f"{name} (bucket object)", data, p, expect), len(data))
        except CheckpointMismatch:
            raise  # a ValueError too, but never skipped
        except CheckpointDamaged as exc:
            return str(exc)
        except (KeyError, ValueError) as exc:
            return f"unreadable: {exc}"

    def _read(self, where: str, data: bytes, p: int, expect: Mapping[str, Any]
              ) -> tuple[dict[str, Any], list[str], list[np.ndarray], np.ndarray]:
        """Partition ``p``'s object: its header, stream names, per-stream rows and last-seen
        times. ``CheckpointMismatch`` when it does not fit; ``CheckpointDamaged``, ``KeyError``,
        ``ValueError`` when it does not read back."""
        header, arrays = parse_checkpoint(data, where)
        settings = header.get("settings", {})
        check_fits(where, header, expect)
        if settings.get("partition") != p or settings.get("partition_count") != self.count:
            raise CheckpointMismatch(where, "partition / partition_count",
                                     [settings.get("partition"), settings.get("partition_count")], [p, self.count])
        leaf_names = [n for n, flag in zip(self.leaf_names, self.per_stream) if flag]
        if settings.get("leaves") != leaf_names:
            raise CheckpointMismatch(where, "the per-stream leaves", settings.get("leaves"), leaf_names)
        n = int(header.get("streams", 0))
        names = decode_names(arrays["streams.names"], header.get("names_encoding", "json"), n)
        rows = []
        rows_expected = [shape for shape, flag in zip(self.row_shapes, self.per_stream) if flag]
        for i, (shape, dtype) in enumerate(rows_expected):
            got = arrays[f"state[{i}]"]
            if got.shape != (n, *shape) or got.dtype != dtype:
                raise CheckpointMismatch(where, f"state leaf {leaf_names[i]!r}",
                                         f"{got.dtype.name}{list(got.shape[1:])}", f"{dtype.name}{list(shape)}")
            rows.append(got)
        return header, names, rows, arrays["streams.last_seen"]

    def _add(self, pieces: PartitionPieces, where: str, p: int, header: dict[str, Any], names: list[str],
             rows: list[np.ndarray], seen: np.ndarray) -> None:
        """Partition ``p``'s object read back, added to ``pieces`` (its position checked)."""
        pieces.names.extend(names)
        pieces.last_seen.append(np.asarray(seen, np.float64))
        pieces.rows.append(rows)
        pos = header.get("positions", {}).get(self.feed)
        if pos is not None:
            if pos.get("stream") != self.stream:
                raise CheckpointMismatch(where, f"feed {self.feed!r}: stream", pos.get("stream"), self.stream)
            pieces.positions[p], created = self.positions.partition_position(pos)
            if created:
                pieces.created[p] = created
        pieces.wall_time = max(pieces.wall_time, float(header.get("wall_time", 0.0)))

    def stream_created(self, pieces: PartitionPieces) -> str:
        """The stream's created time the partitions' objects recorded ("" where none did: not
        checked); ``PositionLost`` when they recorded different ones (the stream was made again
        between them: not every partition's position counts in the stream as it is now)."""
        by_time: dict[str, list[int]] = {}
        for p, created in sorted(pieces.created.items()):
            by_time.setdefault(created, []).append(p)
        if len(by_time) > 1:
            times = "; ".join(f"partitions {self.layout.shown(ps)}: created {t}" for t, ps in sorted(by_time.items()))
            raise PositionLost(
                f"{self.label}: the objects recorded their positions in streams {self.stream!r} created at different "
                f"times ({times}): it was deleted and made again between them, so not every partition's position "
                f"counts in the stream as it is now. To continue anyway, {ACCEPT_LOSS}")
        return next(iter(by_time), "")

    def restore_into(self, init: Any, pieces: PartitionPieces) -> Any:
        """``init`` (the processor's init state, canonical host arrays) with the partitions' rows in
        slots 0..n-1, in the order of ``pieces.names``."""
        leaves, treedef = jax.tree_util.tree_flatten(init)
        out, k = [], 0
        for leaf, flag in zip(leaves, self.per_stream):
            leaf = np.array(leaf)  # a writable copy
            if flag:
                at = 0
                for rows in pieces.rows:
                    block = rows[k]
                    leaf[at:at + len(block)] = block
                    at += len(block)
                k += 1
            out.append(leaf)
        return jax.tree_util.tree_unflatten(treedef, out)


def check_partitionable(processor: Processor) -> None:
    """``ProcessorContractError`` (exit 2) for a processor whose state cannot be split by partition."""
    described = description_of(processor)
    if not described.per_stream:
        raise ProcessorContractError(
            "a partitioned feed needs a processor whose step keeps streams apart: this one declares per_stream=False "
            "(its step mixes streams), so a partition's state would depend on other partitions' streams")
    if described.restore_shared:
        raise ProcessorContractError(
            "a partitioned feed needs a processor whose shared leaves come from its init: this one declares "
            "restore_shared=True (it learns shared leaves online), which no single partition's checkpoint can hold")


def partitioned_feed(connectors: Sequence[Connector], processor: Processor | None) -> Connector | None:
    """The connector among ``connectors`` whose feed is partitioned (config.py allows one at most), its processor
    checked (``check_partitionable``; None: no processor runs, ``events_only``); None when there is none."""
    connector = next((c for c in connectors if c.partitioned), None)
    if connector is not None and processor is not None:
        check_partitionable(processor)
    return connector


class PartitionOwner:
    """The leases and checkpoint objects of a partitioned instance (see the module rules)."""

    def __init__(self, owned: OwnedPartitions, feed: Connector, checkpoints: PartitionedCheckpoints | None) -> None:
        self.owned = owned
        self.feed = feed
        self.checkpoints = checkpoints
        # times this process found its partitions' leases lost: 0, then 1 (it stops; forkless_lease_losses_total),
        # written by the main thread (``lost``), read by any
        self.lease_losses = 0

    @classmethod
    def open(cls, settings: InstanceSettings, feed: Connector, like: Any,
             stop: threading.Event | None = None) -> PartitionOwner:
        """Own the partitions of ``feed`` (its connector: blocking, a dead holder's leases are waited out), and make
        the checkpoint objects' reader/writer if a bucket is configured. ``stop`` set meanwhile (a signal during the
        wait): ``StopRequested``, with nothing held. ``settings``: the instance's (``Config.instance_settings()``),
        what it reads of the configuration."""
        owned = feed.own_partitions(settings.partitioning, timeouts=settings.timeouts, reconnect=settings.reconnect,
                                    tls=settings.tls, stop=stop)
        try:
            checkpoints = None
            if owned.objects:
                checkpoints = PartitionedCheckpoints(
                    owned, feed=feed.feed.name, layout=owned.layout, positions=feed.positions, keep=settings.keep,
                    like=like, slots=settings.max_streams + 1)
        except BaseException:
            owned.close()
            raise
        return cls(owned, feed, checkpoints)

    @property
    def unowned(self) -> int:
        """How many of the stream's partitions have had no live lease for longer than a lease."""
        return len(self.owned.unowned)

    @property
    def lost(self) -> bool:
        """A lease lost, or run out unrenewed (a pause past the lease): the partitions' fence no longer holds.
        Asked by the controller while it runs (and by its stop, before ``close``); once true, counted."""
        if not self.owned.fence.holds():
            self.lease_losses = 1
        return bool(self.lease_losses)

    def raise_if_lost(self) -> None:
        """``LeaseLost`` if a lease could not be renewed in time (the controller asks every cycle)."""
        if self.lost:
            raise LeaseLost(f"{self.feed.feed.label}: the lease of a partition could not be renewed in time "
                            "(FORKLESS_LEASE_S): another instance may own it now, so this one stops")

    def close(self) -> None:
        """Release the leases and close the connection (idempotent)."""
        self.owned.close()


class NoPartitions:
    """The owner of an instance that is not partitioned (or no longer: its leases closed, ``lease_losses``
    kept for its last books): the same calls, nothing held, nothing lost from now on."""

    checkpoints = None
    lost = False
    unowned = 0

    def __init__(self, lease_losses: int = 0) -> None:
        self.lease_losses = lease_losses

    def raise_if_lost(self) -> None:
        pass

    def close(self) -> None:
        pass
