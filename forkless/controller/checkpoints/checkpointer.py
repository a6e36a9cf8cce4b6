"""Checkpointer: writes checkpoints on one background thread, so the step is never stalled.

Rules:
- The main thread takes the snapshot and hands it over (``submit``, or ``tick``, which keeps the schedule).
  Encoding, hashing, writing, fsync, rename and rotation happen on the "forkless-checkpoint" daemon thread, at the
  OS's idle priority; an orderly stop's checkpoint is written by "forkless-checkpoint-final" at the caller's
  priority (an unprivileged thread cannot raise its own back), so a stop never waits for a core.
- A ``PendingSnapshot`` (copied between steps) is held here and advanced on each later ``tick`` for at most
  ``copy_budget_s`` of the main thread, then handed to the writer thread, which calls its ``finish()``.
- At most one checkpoint under way: a ``submit`` or due ``tick`` meanwhile returns False and counts ``skipped``;
  nothing queues behind a slow disk. A copy that cannot complete is dropped and counted (``failures``,
  ``abandoned``); one in progress at ``stop`` is dropped for the final checkpoint.
- A snapshot with positions is written only once ``before_write(positions)`` returns (the controller waits there
  until every reply they cover is stored); if it raises, that checkpoint fails.
- A failed write never raises into the caller: counted in ``failures``, kept in ``last_error``, logged once per
  distinct error.
- Each counter has one writer thread: ``skipped``, ``submitted``, ``abandoned``, ``last_copy_*`` and the
  schedule the main thread's; ``written``, ``finished``, ``failures``, ``last_*`` the writer thread's, then the
  final one's (which joins it first). The other side reads each with one attribute read; ``stats_fields``' reads
  may span two consecutive checkpoints.
- Every checkpoint goes through a ``CheckpointStore``, chosen in one place (``store_for``): the program's own, a
  partitioned instance's bucket objects, or the directory. Nothing here or in the loop depends on which; both
  functions read ``CheckpointSettings``, never the whole ``Config``.
- ``start(store)`` starts the store and the thread; ``stop(timeout, final=...)`` waits for the write under way,
  writes ``final`` and joins. One process per store. ``NoCheckpoints`` has the same calls, called unconditionally.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from forkless.controller.checkpoints.checkpoint import DirectoryStore, write_checkpoint
from forkless.controller.checkpoints.snapshot import PendingSnapshot, Snapshot
from forkless.controller.settings.groups import CheckpointSettings

__all__ = ["CheckpointStore", "Checkpointer", "NoCheckpoints", "WriteFn", "checkpoints_for", "store_for"]

log = logging.getLogger("forkless.checkpoint")

WriteFn = Callable[[Path, Snapshot], int]
"""``write(path, snapshot) -> size_bytes``: writes one checkpoint atomically or raises
(``checkpoint.write_checkpoint``; tests pass one that waits on an event first)."""



class NoCheckpoints:
    """The checkpointer of a run without checkpoints: the same calls, nothing taken or written."""

    def start(self, store: CheckpointStore | None = None, *, newest_at: float = 0.0, newest_bytes: int = 0) -> None:
        pass

    def tick(self, now: float, take: Callable[[], Snapshot | PendingSnapshot]) -> bool:
        return False

    def begin_stop(self, take_final: Callable[[], Snapshot | PendingSnapshot]) -> None:
        pass

    def end(self, deadline: float | None) -> bool:
        return True

    def stats_fields(self) -> dict[str, Any]:
        return {}


class CheckpointStore(Protocol):
    """Where a run's checkpoints are kept (see the module rules); ``label`` names it in the logs.

    ``start`` and ``load`` run on the main thread before the writer thread starts (``load``
    before the compile); ``write`` and ``prune`` on the writer thread, one call at a time."""

    label: str

    def start(self) -> None:
        """Before the first write (``Checkpointer.start``): create what it needs, clear what a
        killed writer left; raise (``OSError``) when it cannot be written."""

    def next_sequence(self) -> int:
        """The number of the next checkpoint: above every one it holds (0 when empty)."""

    def write(self, sequence: int, snapshot: Snapshot, pause: Callable[[], None]) -> tuple[int, Path | str]:
        """Checkpoint ``sequence`` kept whole or not at all (``snapshot.checkpoint_bytes`` are its
        bytes in the checkpoint format); its size in bytes and where it went. Call ``pause()``
        between chunks of work; raise on failure (counted, the previous one stays the newest)."""

    def prune(self) -> None:
        """Delete the old ones (after a successful write), keeping the newest few."""

    def load(self, expect: Mapping[str, Any], like: Any, skipped: list[Any] | None = None) -> Any:
        """The newest complete checkpoint that fits as a ``checkpoint.Restored`` (``checkpoint.as_restored``
        of its header and arrays), None when there is none; a damaged one skipped with a warning
        and appended to ``skipped``; ``CheckpointMismatch`` for one that does not fit (a partitioned
        instance's objects: ``partitioned.PartitionPieces``)."""


def store_for(checkpoints: CheckpointSettings, own: CheckpointStore | None,
              partitioned: CheckpointStore | None) -> CheckpointStore | None:
    """The run's checkpoint store, chosen here only: the embedding program's ``own``
    (``Runtime(checkpoint_store=...)``), a partitioned instance's bucket objects (``partitioned``,
    once its leases are taken), the directory ``FORKLESS_CHECKPOINT_DIR``; None: checkpoints are off."""
    if own is not None:
        return own
    if partitioned is not None:
        return partitioned
    if checkpoints.dir:
        return DirectoryStore(checkpoints.dir, keep=checkpoints.keep)
    return None


def checkpoints_for(checkpoints: CheckpointSettings, before_write: Callable[[dict[str, Any]], None] | None,
                    own: CheckpointStore | None = None, *, partitioned: bool,
                    bucket: str = "") -> Checkpointer | NoCheckpoints:
    """The controller's checkpoint writer as ``checkpoints`` sets it, or for a partitioned feed's ``bucket``
    (FORKLESS_CHECKPOINT_BUCKET) or the embedding program's ``own`` store (``NoCheckpoints`` when they are off); its
    store (``store_for``) is handed to ``start``. ``ValueError`` for an ``own`` store beside a configured one, or
    with a partitioned feed (``partitioned``: the run has one)."""
    if own is not None:
        if checkpoints.on or bucket:
            raise ValueError("Runtime(checkpoint_store=...) and FORKLESS_CHECKPOINT_DIR or FORKLESS_CHECKPOINT_BUCKET: "
                             "a run keeps its checkpoints in one store (give the one or set the other)")
        if partitioned:
            raise ValueError("Runtime(checkpoint_store=...) with a partitioned feed: its checkpoints are one object "
                             "per partition in FORKLESS_CHECKPOINT_BUCKET, where any instance can restore them")
    elif not (checkpoints.on or bucket):
        return NoCheckpoints()
    return Checkpointer(None, interval_s=checkpoints.every_s, background=checkpoints.priority == "idle",
                        before_write=before_write)


_STOP = object()
# main-thread time a tick may spend copying a pending checkpoint (a few chunks): what a step waiting
# behind it can be delayed by (bench/docs/checkpoints.md)
COPY_BUDGET_S = 0.0005
# The writer thread sleeps this long after each chunk of work (names encoded, times put in order, bytes hashed
# and written): a thread that keeps asking for the GIL makes every hand-back the main thread needs (queue waits,
# each XLA call) wait up to the switch interval (bench/checkpoint_stall.py measures it).
PAUSE_S = 0.001


def _background_thread() -> None:
    """Make the calling thread the OS's background work: SCHED_IDLE on Linux (it runs when a CPU
    has nothing else to run, and a thread that wakes takes the CPU from it at once), else the
    lowest priority (nice 19). Hashing and writing a file is then never what a step or the IO
    loop waits for a core behind; under a load that keeps every core busy the write takes
    longer, and the checkpoints due meanwhile are skipped and counted. Linux only (elsewhere
    a priority may be the whole process's)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


class Checkpointer:
    """The background writer of checkpoints into ``store``: a ``CheckpointStore``, or a directory
    (a ``DirectoryStore`` keeping the newest ``keep``, writing each file with ``write``), or None
    (the store is handed to ``start``).

    Usage, all from the main thread::

        ckpt = Checkpointer(dir, keep=3, interval_s=60.0)
        ckpt.start()
        ...each loop cycle: ckpt.tick(time.monotonic(), take)  # take() -> Snapshot or PendingSnapshot
        ckpt.stop(timeout, final=take())                       # after the last batch
    """

    def __init__(self, store: CheckpointStore | Path | str | None, *, keep: int = 3, interval_s: float = 60.0,
                 write: WriteFn = write_checkpoint, copy_budget_s: float = COPY_BUDGET_S,
                 pause_s: float = PAUSE_S, background: bool = True,
                 before_write: Callable[[dict[str, Any]], None] | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        # where the checkpoints go (None: the store handed to start()); keep= and write= are a directory's
        self.store: CheckpointStore | None = (DirectoryStore(store, keep=keep, write=write)
                                              if isinstance(store, (str, os.PathLike)) else store)
        self.interval_s = interval_s
        self.pause_s = pause_s
        self.background = background
        # called on the writer thread with a snapshot's positions before it is written (the
        # controller waits there for its replies to be stored); raising fails that checkpoint
        self.before_write = before_write
        self.copy_budget_s = copy_budget_s
        self._pending: PendingSnapshot | None = None
        self._pending_since = 0.0
        self._copy_s = 0.0
        self._logged_main: set[str] = set()
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._final: threading.Thread | None = None  # writes the checkpoint of the stop
        self._stopping = False
        self._sequence = 0  # the writer thread's once started
        self._next_due: float | None = None
        self._logged: set[str] = set()
        self._failing = False
        # written by the main thread only
        self.submitted = 0
        self.skipped = 0
        self.abandoned = 0  # copies that could not be completed (counted in the failures)
        self.last_copy_s = 0.0  # the newest copied checkpoint: its begin to its hand-over
        self.last_copy_main_s = 0.0  # of which the main thread spent copying (the sum of its ticks)
        # written by the writer thread only
        self.finished = 0  # submitted checkpoints done with, written or failed
        self.written = 0
        self.failures = 0
        self.last_success_at = 0.0  # wall time the newest written checkpoint's state was taken (0: none)
        self.last_duration_s = 0.0  # how long writing it took, encoding to directory fsync
        self.last_bytes = 0
        self.last_path: Path | str | None = None
        self.last_error = ""

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self, store: CheckpointStore | None = None, *, newest_at: float = 0.0, newest_bytes: int = 0) -> None:
        """Start the store (a directory: created, the temporary files a killed writer left
        deleted), number on from its newest checkpoint, start the thread; ``store``: the run's
        (``store_for``), when none was given at construction. ``newest_at``, ``newest_bytes``: the
        time and size of the checkpoint the run restored, reported as the newest written (its
        ``checkpoint_last_at``, its age) until this writer writes one: a restart is not a checkpoint
        missing.

        Raises ``OSError`` when the store cannot be written (call it before connecting)."""
        if self._thread is not None:
            return
        if newest_at:  # before the writer thread exists: it writes these from its first checkpoint on
            self.last_success_at, self.last_bytes = newest_at, newest_bytes
        if store is not None:
            self.store = store
        if self.store is None:
            raise RuntimeError("Checkpointer.start() needs a store: none was given here or at construction")
        self.store.start()
        self._sequence = self.store.next_sequence()
        self._thread = threading.Thread(target=self._run, name="forkless-checkpoint", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None, final: Snapshot | PendingSnapshot | None = None) -> bool:
        """Wait for the write under way, write ``final`` if given, and end the thread.

        Returns True when all of that finished within ``timeout`` seconds; False leaves the
        daemon thread writing (an exit then leaves a temporary file, removed by the next
        ``start``, and the previous checkpoints intact). Calling it again waits again
        (``final`` is taken from the first call only); before ``start()`` it does nothing."""
        thread = self._thread
        if thread is None:
            return True
        if not self._stopping:  # a second call only waits longer
            self._stopping = True
            if self._pending is not None:  # superseded by the final checkpoint
                self._pending.release()
                self._pending = None
                self.skipped += 1
            self._jobs.put(_STOP)
            if final is not None:
                self.submitted += 1
                self._final = threading.Thread(target=self._write_final, args=(thread, final),
                                               name="forkless-checkpoint-final", daemon=True)
                self._final.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for waited in (thread, self._final):
            if waited is not None:
                waited.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not thread.is_alive() and (self._final is None or not self._final.is_alive())

    def begin_stop(self, take_final: Callable[[], Snapshot | PendingSnapshot]) -> None:
        """The orderly stop's first half: ``take_final()`` now (after the last batch) and hand it to
        the final writer; ``stop(timeout)`` then waits for it."""
        self.stop(0.0, final=take_final())

    def end(self, deadline: float | None) -> bool:
        """The writer given back: waits for the stop's checkpoint until ``deadline``
        (``time.monotonic()``), or with None ends it at once; False: not written by the deadline."""
        if deadline is None:
            self.stop(0.0)
            return True
        return self.stop(max(0.0, deadline - time.monotonic()))

    # ---- handing over snapshots (main thread) -----------------------------------------------------

    @property
    def busy(self) -> bool:
        """A checkpoint is being copied or written (a ``submit`` now would be skipped)."""
        return self._pending is not None or self.finished != self.submitted

    @property
    def pending(self) -> PendingSnapshot | None:
        """The checkpoint being copied between steps, if any (tell it about state writes)."""
        return self._pending

    def submit(self, snapshot: Snapshot) -> bool:
        """Hand ``snapshot`` to the writer thread; False (and ``skipped`` += 1) if the previous
        checkpoint is still being written. Never blocks, never raises for a failed write."""
        if self._thread is None or self._stopping:
            raise RuntimeError("Checkpointer.submit() needs start() first and no stop() yet")
        if self.busy:
            self.skipped += 1
            return False
        self.submitted += 1
        self._jobs.put(snapshot)
        return True

    def tick(self, now: float, take: Callable[[], Snapshot | PendingSnapshot]) -> bool:
        """Call every loop cycle with ``time.monotonic()``: every ``interval_s`` (the first one
        ``interval_s`` after the first call) takes a snapshot with ``take()`` and submits it
        (a ``PendingSnapshot`` is first copied, a little on each tick). A checkpoint due while
        the previous one is still being copied or written is skipped without paying for
        ``take()``. Returns whether one was taken."""
        if self._next_due is None:
            self._next_due = now + self.interval_s
            return False
        due = now >= self._next_due
        if due:  # the next one an interval later; after a long pause, an interval from now (no burst)
            self._next_due += self.interval_s
            if self._next_due <= now:
                self._next_due = now + self.interval_s
        if self._pending is not None:
            if due:
                self.skipped += 1
            self._advance()
            return False
        if not due:
            return False
        if self.busy:
            self.skipped += 1
            return False
        taken = take()
        if isinstance(taken, Snapshot):
            return self.submit(taken)
        self._pending = taken
        self._pending_since = time.perf_counter()
        self._copy_s = 0.0
        self._advance()
        return True

    def _advance(self) -> None:
        """Copy the pending checkpoint for up to ``copy_budget_s``; hand it over once copied."""
        pending = self._pending
        assert pending is not None  # called with one pending
        t0 = time.perf_counter()
        try:
            while not pending.advance():
                if time.perf_counter() - t0 >= self.copy_budget_s:
                    return
        except Exception as exc:
            self._pending = None
            pending.release()
            self.abandoned += 1
            key = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if key not in self._logged_main:
                self._logged_main.add(key)
                log.error("checkpoint abandoned while being copied (the run goes on): %s", key)
            return
        finally:
            self._copy_s += time.perf_counter() - t0
        self._pending = None
        self.last_copy_s = time.perf_counter() - self._pending_since
        self.last_copy_main_s = self._copy_s
        self.submitted += 1
        self._jobs.put(pending)

    def schedule(self, at: float) -> None:
        """Make the next checkpoint due at ``at`` (``time.monotonic()``; ``float("inf")``: none
        until called again). The benchmark uses it to alternate phases with and without."""
        self._next_due = at

    def stats_fields(self) -> dict[str, Any]:
        """The ``checkpoint_*`` fields of ``StatsSnapshot``, read now."""
        return {"checkpoint_last_at": self.last_success_at, "checkpoint_duration_s": self.last_duration_s,
                "checkpoint_bytes": self.last_bytes, "checkpoint_failures": self.failures + self.abandoned,
                "checkpoint_skipped": self.skipped, "checkpoint_copy_s": self.last_copy_s, "checkpoints_on": True,
                "checkpoint_age_s": time.time() - self.last_success_at if self.last_success_at else math.nan}

    # ---- the writer thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        if self.background:
            _background_thread()
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            self._do(job)
            del job  # the host copy goes now, not when the next checkpoint arrives (a state's size)

    def _write_final(self, writer: threading.Thread, final: Snapshot | PendingSnapshot) -> None:
        writer.join()  # the write under way first: one writer at a time owns the numbering
        self._do(final)

    def _do(self, job: Snapshot | PendingSnapshot) -> None:
        try:
            self._write_one(job)
        finally:
            if isinstance(job, PendingSnapshot):
                job.release()
            self.finished += 1

    def _write_one(self, job: Snapshot | PendingSnapshot) -> None:
        store = self.store
        assert store is not None  # start() set it before it started this thread
        t0 = time.monotonic()
        try:
            # a copied PendingSnapshot becomes a Snapshot here (the stream table put in LRU order)
            snapshot = job if isinstance(job, Snapshot) else job.finish(self._pause)
            if self.before_write is not None and snapshot.positions:
                self.before_write(snapshot.positions)
            size, path = store.write(self._sequence, snapshot, self._pause)
        except Exception as exc:
            self._failed(exc)
            return
        self._sequence += 1
        self.written += 1
        self.last_duration_s = time.monotonic() - t0
        self.last_bytes = size
        self.last_path = path
        self.last_success_at = snapshot.wall_time
        if self._failing:
            self._failing = False
            log.info("checkpoints are written again: %s", path)
        log.debug("checkpoint %s: %d streams, %d bytes in %.3fs", getattr(path, "name", path), len(snapshot.names),
                  size, self.last_duration_s)
        try:
            store.prune()
        except Exception as exc:
            self._log_once(exc, "could not delete an old checkpoint")

    def _pause(self) -> None:
        if self.pause_s > 0:
            time.sleep(self.pause_s)

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._failing = True
        self._log_once(exc, "checkpoint failed (the run goes on; the previous checkpoint stays the newest)")

    def _log_once(self, exc: Exception, what: str) -> None:
        # the same cause with another file name (each attempt has its own) is the same error
        if isinstance(exc, OSError):
            key = f"{what}|{type(exc).__name__}|{exc.errno}"
        else:
            key = f"{what}|{type(exc).__name__}|{str(exc).splitlines()[0] if str(exc) else ''}"
        if key in self._logged:
            return
        self._logged.add(key)
        log.error("%s: %s: %s", what, type(exc).__name__, exc)

