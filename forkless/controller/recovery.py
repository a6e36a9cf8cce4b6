"""Recovery: what a checkpoint holds beside the device state, and how a run continues from one.

Rules:
- A checkpoint is restored only into the processor that wrote it: its declared name and version, the
  shape-defining settings and ``Description.settings`` are written into every checkpoint and matched on restore
  with the state's structure, leaf shapes and dtypes (``load``, before the compile: ``CheckpointMismatch`` naming
  the setting and both values). ``recorded`` settings are written, never matched.
- The counts (``processed`` and each declared counter) are restored by name into ``MainStats.restored_*``, never
  into the counters, which start at 0 in each process and only grow (Prometheus counters); a checkpoint records
  the sum. What a processor declares is read from its ``Description``, never by attribute name.
- Shared leaves come from the processor's ``init`` at every start unless ``restore_shared=True``; the per-stream
  state, stream table and counts from the checkpoint; the start log says which leaves came from where. Every
  checkpoint records the live weights' version and digest (recorded, not matched).
- Replayable feeds: a checkpoint records each feed's position as of the same moment as the state, and is written
  only once the feeds confirmed the replies it covers (``await_replies`` waits on ``acknowledged``, on the
  writer's thread: no poll); a restore hands the positions to the IO side, which resumes after them.
- The device state is the engine's: this module asks it to begin a snapshot or restore one, never holds it.
- ``load(store)`` reads the newest checkpoint of the run's ``CheckpointStore``; a partitioned instance's are its
  owned partitions' objects, put into slots 0..n-1 of the init state, with no counts (each instance counts its own).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from forkless.controller.checkpoints.checkpoint import Restored
from forkless.controller.checkpoints.checkpointer import CheckpointStore
from forkless.controller.checkpoints.positions import SourcePositions
from forkless.controller.checkpoints.snapshot import PendingSnapshot
from forkless.controller.declared import Description, counts_from
from forkless.controller.engine import Engine, state_shapes
from forkless.controller.errors import ProcessorContractError
from forkless.controller.partitions.partitioned import PartitionedCheckpoints, PartitionPieces
from forkless.controller.processor import Processor, StateShape, description_of
from forkless.controller.settings.groups import CheckpointSettings
from forkless.controller.slots import StreamSlots
from forkless.controller.stats import MainStats, SourceFigures
from forkless.io_loop.connectors.connector import PositionCodec
from forkless.io_loop.counters import IOSnapshot, SourceStats
from forkless.io_loop.crossing import Origin, PositionUnknown, Resume
from forkless.io_loop.feedspec import FeedSpec
from forkless.io_loop.sinks.sink import Acknowledged

__all__ = ["CONFIRM_WAIT_S", "Recovery"]

log = logging.getLogger("forkless.controller")

# a checkpoint with positions waits (on the writer thread) this long at least for the feeds to
# confirm the replies it covers (woken by each confirmation, no poll)
CONFIRM_WAIT_S = 10.0


class Recovery:
    """The controller's checkpoints: the settings they must match, loading and restoring one,
    beginning one, and the replayable feeds' positions (``positions``, in the codecs ``codecs`` gives by feed name)
    recorded in each; ``resume_from``: where a restored checkpoint left each replayable feed, what its source is
    handed (``ctx.resume_from``)."""

    def __init__(self, checkpoints: CheckpointSettings, shape: StateShape, processor: Processor | None,
                 slots: StreamSlots, stats: MainStats, io_snapshot: Callable[[], IOSnapshot | None],
                 specs: Sequence[FeedSpec], *,
                 codecs: Mapping[str, PositionCodec] | None = None, own_store: bool = False) -> None:
        # own_store: the embedding program's checkpoint store (Runtime(checkpoint_store=...)): checkpoints on
        # what the processor declared (controller/declared.py, checked when it was built): its identity, its
        # counters (kept here and in every checkpoint's counts) and the settings its checkpoints record;
        # no processor (events only) declares nothing
        self.declared = Description() if processor is None else description_of(processor)
        if (checkpoints.on or own_store) and self.declared.name is None:
            # a checkpoint is restored only into the processor that wrote it: it must say which it is
            raise ProcessorContractError(
                "checkpoints (FORKLESS_CHECKPOINT_DIR) need a processor that declares its identity: build it with "
                "Processor(init, step, description=Description(name=..., version=...)) (the name and version are "
                "stored in each checkpoint and matched on restore)")
        self.checkpoints = checkpoints
        self.shape = shape  # the state's sizes, which a checkpoint must match
        self.specs = tuple(specs)  # the run's feeds (a user's sources among them), in order
        self.processor = processor
        stats.counters.update(dict.fromkeys(self.declared.counters, 0))  # every key there before the first batch
        self.slots = slots
        self.stats = stats
        self._io_snapshot = io_snapshot
        # the replayable feeds' positions, recorded in every checkpoint beside the state (exactly-once)
        self.positions = SourcePositions(self.specs, codecs)
        # signalled by the IO side as replies are acknowledged (handed to it where feeds keep positions)
        self.acknowledged = Acknowledged()
        # where a restored checkpoint left each replayable feed (PositionUnknown: every checkpoint damaged)
        self.resume_from: Mapping[str, Origin | Resume | PositionUnknown | dict[int, Origin]] = {}
        self.restored_from: str | None = None
        self.restored_at = 0.0  # wall time the restored checkpoint's state was taken (0: none restored)
        self.restored_bytes = 0  # its size
        self._partitioned: PartitionedCheckpoints | None = None  # a partitioned instance's bucket objects

    def settings(self) -> dict[str, Any]:
        """What a checkpoint must match to be restored: the core's shape-defining settings, the
        processor's identity and the settings it declared (``Description.settings``), as every
        checkpoint written before the Description holds them too."""
        return {"features": self.shape.features, "max_streams": self.shape.max_streams,
                "processor": self.declared.name, "processor_version": self.declared.version, **self.declared.settings}

    def load(self, store: CheckpointStore) -> Restored | PartitionPieces | None:
        """The newest complete checkpoint in the run's ``store`` (``checkpointer.store_for``), read
        before the compile; raises ``CheckpointMismatch`` if it was written by another processor
        (name, version), with other shape-defining settings, or with another state structure, leaf
        shape or dtype. Every one damaged: an empty state, the replayable feeds' positions unknown."""
        # a checkpoint holds the canonical layout (row s = slot s), whatever the device count
        damaged: list[Any] = []
        assert self.processor is not None  # checkpoints need one (events only: refused up front)
        restored = store.load(self.settings(), like=state_shapes(self.processor, self.shape), skipped=damaged)
        if isinstance(restored, PartitionPieces):  # merged into the init state by restore()
            assert isinstance(store, PartitionedCheckpoints)  # the one store that loads pieces
            self._partitioned = store
        if restored is None and damaged:
            # the replayable feeds' positions are unknown: each feed decides at its first connection whether its
            # stream still holds everything (then it replays all of it), else PositionLost; a user's source cannot
            # say whether it still holds everything: PositionLost now, never started fresh silently
            why = (f"every checkpoint in {store.label} is damaged "
                   f"({', '.join(getattr(p, 'name', str(p)) for p in damaged)})")
            self.resume_from = dict(self.positions.when_unknown(why))
            log.warning("%s: starting with an empty state%s", why, "; the replayable feeds' positions are unknown"
                        if self.resume_from else "")
        elif restored is None:
            log.info("no checkpoint in %s: starting fresh", store.label)
        return restored

    def restore(self, engine: Engine, restored: Restored | PartitionPieces) -> None:
        """Put a loaded checkpoint's state on the device and its stream table and counts in place
        (before the first connection)."""
        if isinstance(restored, PartitionPieces):
            self._restore_partitions(engine, restored)
            return
        shared = self.declared.restore_shared
        engine.restore(restored.state, shared=shared)
        if shared and engine.live_weights is not None:  # the checkpoint's weights are in force again
            engine.live_weights.restored(restored.settings.get("weights"))
        leaves = engine.shared_leaves()
        log.info("per-stream state taken from the checkpoint%s", "" if not leaves else (
            f"; shared leaves {', '.join(leaves)} " + ("from it too (restore_shared=True)" if shared else
                                                       "taken from the processor's init (restore_shared=False)")))
        # last-seen times travel as wall-clock seconds (monotonic clocks differ between processes)
        shift = time.monotonic() - time.time()
        self.slots.restore(restored.names, restored.slots, np.asarray(restored.last_seen) + shift)
        main = self.stats
        main.restored_processed = int(restored.counts.get("processed", 0))
        main.restored_counters = counts_from(self.declared.counters, restored.counts)
        # each replayable feed goes on from the message after the one its state holds
        self.resume_from = self.positions.restore(restored.positions, restored.path)
        self.restored_from = str(restored.path)
        self.restored_at, self.restored_bytes = restored.wall_time, restored.nbytes
        log.info("restored %d streams from %s (checkpoint of %s, %d messages processed before)",
                 restored.streams, restored.path,
                 datetime.datetime.fromtimestamp(restored.wall_time).isoformat(timespec="seconds"),
                 main.restored_processed)

    def _restore_partitions(self, engine: Engine, pieces: PartitionPieces) -> None:
        part = self._partitioned
        assert part is not None and self.processor is not None  # load() set it from the processor's store
        created = part.stream_created(pieces)  # (objects of streams created at different times: PositionLost)
        init = jax.device_get(self.processor.init(self.shape))
        engine.restore(part.restore_into(init, pieces), shared=False)
        shift = time.monotonic() - time.time()
        seen = np.concatenate(pieces.last_seen) if pieces.last_seen else np.zeros(0)
        self.slots.restore(pieces.names, np.arange(pieces.streams, dtype=np.int32), seen + shift)
        self.resume_from = self.positions.restore(
            {part.feed: part.positions.from_partitions(pieces.positions, created)}, part.label)
        self.restored_from = f"{len(pieces.objects)} objects of {part.label}"
        self.restored_at = pieces.wall_time  # the newest of its objects' (no size: several objects)
        log.info("restored %d streams from %s (newest written %s): %s", pieces.streams, part.label,
                 datetime.datetime.fromtimestamp(pieces.wall_time).isoformat(timespec="seconds"),
                 ", ".join(pieces.objects))

    def begin(self, engine: Engine, incremental: bool) -> PendingSnapshot:
        """A checkpoint as of now (between two steps), which ``Checkpointer.tick`` copies a
        chunk at a time between the next steps; the engine keeps it exact."""
        wall = time.time()
        # which weights the state was produced with (live weights, controller/device/weights.py): recorded, never
        # matched
        weights = {"weights": engine.weights.record()} if engine.weights is not None else {}
        return engine.begin_snapshot(
            self.slots.begin_copy(), self.counts(),
            {**self.settings(), **self.declared.recorded, "devices": len(engine.devices), **weights}, wall,
            seen_shift=wall - time.monotonic(),
            incremental=incremental, positions=self.positions.record(self._io_sources()) if self.positions else None)

    def counts(self) -> dict[str, int]:
        """What a checkpoint records as its counts: this process's counters plus what the restored checkpoint
        had counted before it (so they go on across restarts)."""
        main = self.stats
        before = main.restored_counters
        return {"processed": main.restored_processed + main.processed,
                **{name: before.get(name, 0) + n for name, n in main.counters.items()}}

    def _io_sources(self) -> dict[str, SourceStats]:
        """Each replayable feed's ``SourceStats`` (the IO side's: how far the stream holds no further
        message of its subjects, the stream's created time), by feed name, for ``SourcePositions.record``."""
        io = self._io_snapshot()
        return {f.name: f.io.source for f in (io.feeds if io is not None else ()) if f.io.source is not None}

    def await_replies(self, positions: dict[str, Any]) -> None:
        """On the checkpoint writer's thread, before a checkpoint with positions is
        written: wait until the feeds have confirmed every reply to the messages at or
        below them (after a kill -9 those are not replayed, so their replies must be stored).
        Raises (the checkpoint fails, the previous one stays the newest) if that takes longer
        than ``CONFIRM_WAIT_S`` or a checkpoint interval, whichever is longer. Woken by the IO
        side's ``acknowledged`` (the snapshot read once now and once after each acknowledgement)."""
        behind: list[str] = []

        def caught_up() -> bool:
            io = self._io_snapshot()
            feeds = io.feeds if io is not None else ()
            confirmed = {f.name: f.io.source.confirmed for f in feeds if f.io.source is not None}
            behind[:] = SourcePositions.unconfirmed(positions, confirmed)
            return not behind

        if not self.acknowledged.wait_for(caught_up, max(CONFIRM_WAIT_S, self.checkpoints.every_s)):
            raise TimeoutError("replies not stored by the results stream in time: " + "; ".join(behind))

    def source_figures(self, io: IOSnapshot) -> tuple[SourceFigures, ...]:
        """Each replayable feed's figures: the IO side's fetching and confirmations, the main thread's position."""
        if not self.positions:
            return ()
        positions, out = self.positions, []
        for feed in io.feeds:
            src = feed.io.source
            if src is None:
                continue
            index = next(i for i, spec in positions.specs.items() if spec.name == feed.name)
            applied = positions.consumed.get(index)
            applied_seq = 0 if applied is None else applied.seq - (0 if applied.last else 1)
            out.append(SourceFigures(feed.name, src.fetched, positions.applied.get(index, 0), applied_seq,
                                     src.confirmed[0], src.stream_last_seq, src.skipped, src.duplicates))
        return tuple(out)
