"""Controller: the main-thread loop (inbound -> batcher -> engine step -> outbound).

Rules:
- JAX runs only in the main thread. The device state is the engine's (controller/engine.py):
  the loop asks it to step a batch, reset recycled slots, begin a checkpoint and restore one;
  one device or several is the engine's business, never the loop's.
- Every bucket size is compiled ahead of time in ``start()`` before the IO thread opens a
  connection, so no message waits for XLA and nothing compiles after warm-up.
- One batch at a time: take what is waiting (``MicroBatcher`` rules), then ``BatchStep``
  (controller/batchstep.py) slots, steps, answers and puts one ``Outgoing`` item. Replies keep
  the order their messages arrived in; each feed's reply policy is applied where the frames are
  made (controller/replies.py).
- The IO thread's health is checked at least every ``POLL_S``; if it died, the loop stops
  and raises (``FeedFatal`` or ``IOThreadError``).
- Checkpoints (``FORKLESS_CHECKPOINT_DIR``): the tick at the end of ``process_pending``
  begins one when due (``Engine.begin_snapshot``, kept exact by the engine), or copies up to
  a budget more of the one in progress (controller/checkpointer.py).
- A stop requested during ``start()`` (a signal while it compiles, waits for a dead holder's
  lease, restores) ends the start there: no IO side is started, leases taken are released.
- The host process is left as it was found (controller/host.py): what ``start()`` changes
  process-wide, ``stop()`` gives back; ``run()`` never exits the process (a second SIGINT
  aborts the IO side and raises ``KeyboardInterrupt``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Sequence
from queue import Empty, Full
from typing import Any

import janus
import numpy as np

from controller.batching import TAKEN, Chunk, MicroBatcher
from controller.batchstep import BatchStep
from controller.checkpointer import Checkpointer
from controller.codec import Codec, GuardedCodec, JsonCodec
from controller.compiled import codec_dtype, compilations, release_freed_memory
from controller.config import Config
from controller.engine import Engine, compile_step
from controller.host import ProcessSettings, StopSignals
from controller.ioside import IOFactory, IOSide, OnEvent, OnResults, feed_plan, io_thread
from controller.partitioned import PartitionOwner, check_partitionable
from controller.processor import Processor, default_processor
from controller.recovery import Recovery
from controller.replies import Replies
from controller.slots import StreamSlots
from controller.snapshot import PendingSnapshot
from controller.stats import (
    SECONDS_BOUNDS,
    Histogram,
    IOStats,
    MainStats,
    StatsSnapshot,
    books_line,
    status_line,
    whole_snapshot,
)
from io_loop.before_connect import BeforeConnect
from io_loop.crossing import Events, Outgoing
from io_loop.errors import LeaseLost, StopRequested
from io_loop.on_connect import OnConnect, frames_of
from io_loop.source import Source

__all__ = ["BeforeConnect", "Controller", "IOFactory", "IOSide", "OnConnect", "OnEvent", "OnResults",
           "compilations"]

log = logging.getLogger("forkless.controller")

POLL_S = 0.1
STOP_RESERVE_S = 0.5  # of SHUTDOWN_TIMEOUT_S (at most a third), kept for ending the threads and the process
# How long a thread may hold the GIL while another waits for it (CPython's default is 5 ms).
# When XLA returns, the main thread needs the GIL back from a busy IO thread; 1 ms instead
# of 5 ms measured about +20% maximum throughput in an A/B run (see bench/README.md).
SWITCH_INTERVAL_S = 0.001
# After a second SIGINT: how long run() waits for the aborted IO thread before it raises
ABORT_JOIN_S = 0.5


class Controller:
    """Runs a processor over a WebSocket feed; see the README's "Embedding" section.

    Either ``run()`` (blocking, handles signals, prints status lines), or drive it yourself::

        with Controller(config, processor=..., codec=...) as ctl:
            while ...:
                ctl.process_pending(timeout=0.1)
    """

    def __init__(self, config: Config | None = None, *, processor: Processor | None = None,
                 codec: Codec | None = None, out: Callable[[str], None] | None = None,
                 on_results: OnResults | None = None, io_factory: IOFactory = io_thread,
                 freeze_gc: bool = False, on_connect: OnConnect | None = None,
                 before_connect: BeforeConnect | None = None, sources: Sequence[Source] = (),
                 on_event: OnEvent | None = None) -> None:
        """``freeze_gc=True``: freeze the objects alive when the run starts (``gc.freeze``: JAX's
        modules, the compiled steps, the stream table's containers), so the collector does not
        walk them again while it runs — a full collection walked them all, holding the GIL 15-67
        ms between two steps (bench/checkpoint_stall.py, 1M streams). Only if nothing is frozen
        yet, undone by the stop (controller/host.py). The ``forkless`` program asks for it; an
        embedded controller leaves the collector alone unless asked.

        ``on_connect(feed, connection)``: frames to send first on every new connection of a feed,
        computed then (a signed, timestamped subscription); it runs on the IO thread's loop
        (io_loop/on_connect.py has the rules, EMBEDDING.md an example).

        ``before_connect(feed, attempt)``: this attempt's URL and headers, a ``Handshake`` (or
        None for the configured ones), before every opening handshake (a login, a token
        refresh); with it a handshake refused with HTTP 401/403 asks it again instead of giving
        up. It runs on the IO thread's loop (io_loop/before_connect.py, EMBEDDING.md).

        ``sources``: the user's own clients (``controller.Source``, io_loop/source.py), run on the
        IO thread beside the configured feeds, or instead of the demo feed when none is
        configured; ``on_event(source, event)`` gets, in the main thread, what they hand over as
        it is (``ctx.emit_event``)."""
        self.config = config if config is not None else Config.from_env()
        # the feeds this controller runs: the configured ones and the user's own sources
        self.plan = feed_plan(self.config, sources)
        self.feed_specs = self.plan.specs
        self._feed_index = {spec.name: i for i, spec in enumerate(self.feed_specs)}
        self.on_event = on_event
        self._logged_unhandled_event = False
        self.processor = processor if processor is not None else default_processor(self.config)
        x_dtype = codec_dtype(self.processor)
        user_codec = codec if codec is not None else JsonCodec(
            self.config.features, max_frame_items=self.config.max_frame_items, dtype=x_dtype)
        # a custom codec's exceptions become error replies, never a dead thread (codec.py); its
        # x is cast to the processor's input dtype if it differs
        self.codec = GuardedCodec(user_codec, self.config.features, dtype=x_dtype)
        self.on_results = on_results
        cfg = self.config
        # a partitioned JetStream feed (issue 24): leases and per-partition checkpoint objects
        self._partition_feed = next((spec for spec in cfg.feed_specs
                                     if spec.jetstream is not None and spec.jetstream.partitioned), None)
        self._owner: PartitionOwner | None = None
        if self._partition_feed is not None:
            check_partitionable(self.processor)
        # False: each checkpoint copies the whole state at once, as on an accelerator (tests and
        # bench/checkpoint_stall.py compare it with the copy between steps)
        self.incremental_checkpoints = True
        self._print = out if out is not None else _print_line
        self.io_stats = IOStats()
        specs = self.feed_specs
        self.main_stats = MainStats(batch_size=Histogram(self.config.buckets),
                                    latency=[Histogram(SECONDS_BOUNDS) for _ in specs])
        # what each message gets back, under its feed's reply policy
        self.replies = Replies(self.codec, self.main_stats, [spec.replies for spec in specs], self.config.max_streams)
        self.batcher = MicroBatcher(self.config.max_batch, self.config.max_wait_ms / 1000)
        self.slots = StreamSlots(self.config.max_streams, idle_s=self.config.stream_idle_s)
        # checkpoints: what they hold beside the state, restoring one, the JetStream feeds' positions
        self.recovery = Recovery(cfg, self.processor, self.slots, self.main_stats,
                                 lambda: self._io.snapshot() if self._io is not None else None, specs=specs,
                                 user_sources=frozenset(self.plan.sources))
        self.sources = self.recovery.sources
        self.checkpointer = Checkpointer(cfg.checkpoint_dir, keep=cfg.checkpoint_keep, interval_s=cfg.checkpoint_s,
                                         background=cfg.checkpoint_priority == "idle",
                                         before_write=self.recovery.await_replies if self.sources else None) \
            if cfg.checkpoints_on else None
        # with several feeds (unless FORKLESS_SHARED_STREAMS=1) a stream's key is "feed:stream"
        self._feed_prefixes = [spec.name + ":" for spec in specs] \
            if len(specs) > 1 and not cfg.shared_streams else None
        self.engine: Engine | None = None  # the device state's owner, made by compile()
        hooks = {name: hook for name, hook in (("on_connect", on_connect), ("before_connect", before_connect))
                 if hook is not None}
        self._io_factory = functools.partial(io_factory, **hooks) if io_factory is io_thread and hooks else io_factory
        self._io: IOSide | None = None
        self._side: Any = None  # io_loop.bridge.MainSide once started
        self._step: BatchStep | None = None  # each batch's way from taken to put, once started
        self._inbound_closed = False
        # process_pending's bound: chunks taken from inbound so far, and messages; the messages
        # added to the batcher up to the call's last chunk (``_owed``) and the messages taken
        self._pulled = 0
        self._pull_target = 0
        self._added = self._owed = self._taken = 0
        self.abandoned_io = False
        # True if the IO thread still ran when stop() gave up on it
        self._stop_requested = threading.Event()
        self._started = False
        self._stopped = False
        self._host = ProcessSettings(switch_interval_s=SWITCH_INTERVAL_S, freeze_gc=freeze_gc)
        self._signals = StopSignals(self._on_signal)
        self._aborting = False  # a second SIGINT: run() raises KeyboardInterrupt
        self._lease_lost = False  # a partitioned instance's lease lost: the stop drops what it holds
        # set by request_stop(): a put that waits for a socket that never drains gives up then
        self._stop_deadline: float | None = None
        self._work_deadline: float | None = None  # processing and sending end here (request_stop)

    # ---- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> Controller:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Compile every bucket, put the state on the device, start the IO thread."""
        if self._started:
            return
        self._started = True
        # a checkpoint that does not fit is refused before the compile (CheckpointMismatch); a
        # partitioned instance compiles first, then takes its leases and reads its partitions'
        # objects: its partitions go unserved from the old owners' stop to its first connection
        # (a rescale), and the compile need not fall inside that window (bench/partitioned.py)
        # a stop requested during the start (a signal while compiling, waiting for a dead holder's
        # lease, restoring) ends it there: nothing more is started and the leases taken are released
        recovery = self.recovery
        if self._partition_feed is not None:
            self.compile()
            if self._stop_requested.is_set():
                return self._stopped_in_start("the compile")
            try:
                self._owner = PartitionOwner.open(self.config, self._partition_feed, self.engine.checkpoint_shapes,
                                                  stop=self._stop_requested)
            except StopRequested:
                return self._stopped_in_start("the wait for the partitions' leases")
        # a partitioned instance's bucket objects, instead of files
        target = self._owner.checkpoints if self._owner is not None else None
        try:
            restored = recovery.load(target) if self.checkpointer and self.config.checkpoint_restore == "auto" else None
            self.compile()
        except BaseException:
            self._close_owner()
            raise
        if self._stop_requested.is_set():
            return self._stopped_in_start("the restore and compile")
        if self.checkpointer is not None:
            if restored is not None:
                recovery.restore(self.engine, restored)
            self.checkpointer.start(target)
        self._host.apply()
        extra: dict[str, Any] = {"positions": recovery.positions} if recovery.positions else {}
        if self.plan.sources:
            extra["plan"] = self.plan
        if self._owner is not None:  # the IO side asks before publishing: never after the leases ran out
            extra["fence"] = self._owner.holds
        try:
            self._io = self._io_factory(self.config, self.codec, self.io_stats, self.stats, **extra)
            self._side = self._io.start()
            # the IO thread's CPU clock, read around each step (pipelining: MainStats.step_io_cpu_s);
            # not read at all where it is unknown (NaN)
            io_cpu = self._io.cpu_seconds if not math.isnan(self._io.cpu_seconds()) else None
            self._step = BatchStep(self.engine, self.slots, self.replies, self.sources, self.main_stats,
                                   put=self._put_outbound, on_results=self._hand_results,
                                   feed_prefixes=self._feed_prefixes, io_cpu=io_cpu)
        except BaseException:  # no IO side (MetricsServerError, say): give back what apply() changed
            self._host.restore()
            if self.checkpointer is not None:
                self.checkpointer.stop(0.0)
            self._close_owner()
            raise

    def _stopped_in_start(self, during: str) -> None:
        """``start()`` ends early: a stop was requested during ``during``; no IO side is started
        (``stop()`` and ``process_pending()`` then do nothing), the leases taken are released."""
        log.info("stop requested during %s: not starting", during)
        self._close_owner()

    def _close_owner(self) -> None:
        """Release a partitioned instance's leases (after the stop's checkpoint)."""
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.close()

    def compile(self) -> None:
        """Initialise the state on the device and compile the step for every bucket (AOT)."""
        if self.engine is not None:
            return
        cfg = self.config
        t0 = time.monotonic()
        self.engine = compile_step(self.processor, cfg)
        self.main_stats.compilations_at_ready = compilations()
        release_freed_memory()
        log.info("compiled the step for batch sizes %s on %s in %.2fs", ",".join(map(str, cfg.buckets)),
                 self.engine.describe(), time.monotonic() - t0)

    @property
    def state(self) -> Any:
        """The device state as it is now, to look at (tests, inspection): the engine owns it, and
        the next step is given it donated, so keep no reference across a step."""
        return self.engine.state if self.engine is not None else None

    # ---- checkpoints --------------------------------------------------------------------------

    def _take_checkpoint(self) -> PendingSnapshot:
        """The checkpoint of an orderly stop, copied at once (nothing runs after it)."""
        return self._begin_checkpoint(incremental=False).complete()

    def _begin_checkpoint(self, incremental: bool | None = None) -> PendingSnapshot:
        """A checkpoint as of now (between two steps); see ``Recovery.begin``."""
        return self.recovery.begin(self.engine, self.incremental_checkpoints if incremental is None else incremental)

    @property
    def restored_from(self) -> str | None:
        """The checkpoint this run continued from (None: it started fresh)."""
        return self.recovery.restored_from

    def request_stop(self) -> None:
        """Ask ``run()`` to stop; safe from signal handlers and other threads.

        Fixes the stop's deadline, ``shutdown_timeout_s`` from now. Processing and sending
        end ``stop_reserve_s`` before it (the work deadline), so that the IO thread can end
        and the process exit by the deadline whatever the socket does."""
        if self._stop_deadline is None:
            timeout = self.config.shutdown_timeout_s
            self._stop_deadline = time.monotonic() + timeout
            self._work_deadline = self._stop_deadline - min(STOP_RESERVE_S, timeout / 3)
        self._stop_requested.set()

    def stop(self) -> None:
        """Orderly stop: stop reading, process what is queued, send every result, join.

        Bounded by ``shutdown_timeout_s``; what could not be sent by then is counted as
        dropped and logged. Raises if the IO thread failed; else, once stopped, the first
        exception ``on_results`` raised during the stop (the stop goes on past it). A
        partitioned instance whose lease is lost (or ran out) stops without answering or
        checkpointing anything more, then raises ``LeaseLost`` (``_stop_lease_lost``).
        """
        if not self._started or self._stopped or self._side is None:  # not started, or its start failed
            return
        self._stopped = True
        io = self._io
        self.request_stop()  # fixes the stop deadline, if a signal or the caller has not already
        deadline, work_deadline = self._stop_deadline, self._work_deadline
        io.request_stop(work_deadline)
        if self._owner is not None and self._owner.lost:
            self._stop_lease_lost(deadline, work_deadline)
        raised: Exception | None = None  # on_results' first failure, raised once stopped
        try:
            while (not self._inbound_closed or len(self.batcher)) and time.monotonic() < work_deadline:
                if io.failure is not None:
                    break
                try:
                    self._cycle(POLL_S, deadline=work_deadline)
                except Exception as exc:  # the batch's replies were handed over: the stop goes on
                    raised = raised or exc
            left = len(self.batcher) + self._drain_inbound()
            if left:
                self.main_stats.dropped["not processed before the stop"] += left
                log.error("%d received messages were not processed before the stop deadline "
                          "(FORKLESS_SHUTDOWN_TIMEOUT_S=%s)", left, self.config.shutdown_timeout_s)
            self._side.outbound.shutdown()
            if self.checkpointer is not None:  # after the last batch: written while the IO thread ends
                self.checkpointer.stop(0.0, final=self._take_checkpoint())
        finally:
            self._end_threads(deadline, work_deadline)
        io.raise_if_failed()
        if raised is not None:
            raise raised

    def _stop_lease_lost(self, deadline: float, work_deadline: float) -> None:
        """The stop of a partitioned instance whose lease is lost or ran out unrenewed: another
        instance may own its partitions and answer from their checkpoint, so what this one holds
        is dropped, never processed or published (the IO side's fence drops what is queued to
        publish), no checkpoint is written, and ``LeaseLost`` is raised (exit 3)."""
        self._lease_lost = True  # _end_threads waits for no checkpoint: one in flight is fenced (LeaseLost)
        try:
            held = len(self.batcher) + self._drain_inbound()
            self.main_stats.dropped["lease lost"] += held
            self._side.outbound.shutdown()
            if self.checkpointer is not None:
                self.checkpointer.stop(0.0)  # no final checkpoint: the partitions may be another's now
        finally:
            self._end_threads(deadline, work_deadline)
        snap = self.stats()
        log.error("the lease of a partition is lost: %d received messages dropped unanswered (%d of them "
                  "unprocessed) and no checkpoint written; their new owner answers them from its checkpoint",
                  snap.dropped.get("lease lost", 0), held)
        raise LeaseLost(f"{self._partition_feed.label}: the lease of a partition was lost or ran out unrenewed "
                        "(FORKLESS_LEASE_S): another instance may own it now, so this one stopped without "
                        "publishing what it held")

    def _end_threads(self, deadline: float, work_deadline: float) -> None:
        """The end of ``stop()``: join the IO thread, write the stop's checkpoint, give the process back."""
        io = self._io
        try:
            if self._aborting:  # a second SIGINT: the IO side is aborted; nothing more is written
                if not io.join(ABORT_JOIN_S):
                    self.abandoned_io = True
                if self.checkpointer is not None:
                    self.checkpointer.stop(0.0)
                return
            # the process must be able to exit by the deadline, whatever the socket does: the
            # IO thread has half the reserve to finish, is then aborted, and a thread that
            # still hangs at the deadline is left behind (a daemon: it cannot hold the exit)
            if not io.join(max(0.0, (work_deadline + deadline) / 2 - time.monotonic())):
                log.error("the IO thread did not finish within FORKLESS_SHUTDOWN_TIMEOUT_S=%s; aborting",
                          self.config.shutdown_timeout_s)
                io.abort()
                if not io.join(max(0.0, deadline - time.monotonic())):
                    self.abandoned_io = True
                    log.error("the IO thread did not end after the abort; leaving it behind (it is a daemon)")
            if self.checkpointer is not None and not self._lease_lost \
                    and not self.checkpointer.stop(max(0.0, deadline - time.monotonic())):
                log.error("the checkpoint of the stop was not written within FORKLESS_SHUTDOWN_TIMEOUT_S=%s",
                          self.config.shutdown_timeout_s)
        finally:
            self._close_owner()
            self._host.restore()

    def _drain_inbound(self) -> int:
        """Take what is still queued inbound (at the stop deadline); how many messages it held
        (events left are counted in ``events_unhandled``)."""
        left = 0
        while not self._inbound_closed:
            try:
                item = self._side.inbound.get_nowait()
                if type(item) is Events:
                    self.main_stats.events_unhandled += len(item.items)
                left += len(item)
            except Empty:
                break
            except janus.SyncQueueShutDown:
                self._inbound_closed = True
        return left

    # ---- running ----------------------------------------------------------------------------

    def run(self) -> None:
        """Start, process until a signal / ``duration_s`` / ``request_stop()``, then stop.

        SIGINT and SIGTERM (when called from the main thread) stop it in order; a second
        SIGINT aborts the IO side and raises ``KeyboardInterrupt`` (within about a second: what
        was not sent is counted as dropped, no checkpoint is written). Prints a status line
        every ``status_s`` seconds. Returns None once stopped in order (the books logged). What
        ``on_results`` or ``out`` raised is raised after an orderly stop; ``start()``'s errors and
        the IO side's (``FeedFatal``, ``IOThreadError``) at once. Never exits the process; the
        host's signal handlers and process settings are back as they were when it returns or raises.
        """
        self._signals.install()
        try:
            self.start()
            cfg = self.config
            started = time.monotonic()
            end = started + cfg.duration_s if cfg.duration_s else None
            next_status = started + cfg.status_s if cfg.status_s > 0 else None
            first = last = self.stats()
            while not self._stop_requested.is_set():
                now = time.monotonic()
                if end is not None and now >= end:
                    break
                if next_status is not None and now >= next_status:
                    snap = self.stats()
                    self._print(status_line(snap, last))
                    last = snap
                    next_status += cfg.status_s
                    if next_status < now:
                        next_status = now + cfg.status_s
                self.process_pending(timeout=POLL_S)
            self.stop()
            final = self.stats()
            if cfg.status_s > 0:
                self._print(status_line(final, first, final=True))
            log.log(logging.ERROR if final.in_flight else logging.INFO, "%s", books_line(final))
        except KeyboardInterrupt:
            if self._started and not self._stopped:  # interrupted before stop(): end the threads briefly
                self._aborting = self._stopped = True
                if self._io is not None:
                    self._io.abort()
                    self._end_threads(time.monotonic(), time.monotonic())
            raise
        except Exception:
            # the host program's code failed (on_results, out) with the IO side well: stop in
            # order (every reply sent, the stop's checkpoint written), then raise what it raised
            if self._side is not None and not self._stopped and self._io.failure is None:
                with contextlib.suppress(Exception):
                    self.stop()
            raise
        finally:
            self._close_owner()  # a partitioned instance's leases, also when stop() never ran
            self._host.restore()  # also when the IO thread failed and stop() never ran
            self._signals.restore()

    def process_pending(self, timeout: float = 0.0) -> int:
        """Process what is waiting (waiting up to ``timeout`` for a first message); returns
        how many messages were processed. Raises if the IO thread has failed.

        It returns once what was queued when it was called has been processed, so a feed
        that never pauses cannot keep the caller (or ``run()``'s stop check) waiting. Its last
        batch is topped up from what arrived since, like any batch; what that leaves waits in
        the batcher for the next call, as it would have in the queue.
        """
        if not self._started:
            raise RuntimeError("call start() (or use the controller as a context manager) first")
        if self._side is None:  # a stop was requested during start(): nothing was started
            return 0
        self._io.raise_if_failed()
        if self._owner is not None and self._owner.lost:
            raise LeaseLost(f"{self._partition_feed.label}: the lease of a partition could not be renewed in time "
                            "(FORKLESS_LEASE_S): another instance may own it now, so this one stops")
        # chunks queued now; a chunk may hold more than one batch, so chunks are counted, and
        # the messages they hold once pulled (``_owed``; what the batcher holds is owed too)
        target = self._pull_target = self._pulled + (0 if self._inbound_closed else self._side.inbound.qsize())
        self._owed = self._added
        done = self._cycle(timeout)
        while self._taken < self._owed or (self._pulled < target and not self._inbound_closed
                                           and self._side.inbound.qsize()):
            done += self._cycle(0.0)
        if self.checkpointer is not None:
            self.checkpointer.tick(time.monotonic(), self._begin_checkpoint)
        return done

    def _cycle(self, timeout: float, deadline: float | None = None) -> int:
        """Collect one batch (blocking up to ``timeout`` for its first message when the batcher
        is empty; topping up what it holds from what is already waiting) and process it."""
        inbound = self._side.inbound
        batcher = self.batcher
        if not len(batcher) and not self._inbound_closed:
            try:
                self._add(inbound.get(timeout=timeout) if timeout > 0 else inbound.get_nowait())
            except Empty:
                return 0
            except janus.SyncQueueShutDown:
                self._inbound_closed = True
        while not self._inbound_closed and batcher.wants_more(time.monotonic()):
            try:
                self._add(inbound.get_nowait())
            except Empty:
                break
            except janus.SyncQueueShutDown:
                self._inbound_closed = True
        taken = batcher.take()
        if taken is None:
            return 0
        self._taken += len(taken)
        self._step(taken, deadline)
        return len(taken)

    def _add(self, chunk: Chunk | Events) -> None:
        """A chunk taken from inbound, into the batcher (and counted for ``process_pending``); a
        user source's events go to ``on_event`` at once."""
        if type(chunk) is Events:
            self._pulled += 1
            if self._pulled <= self._pull_target:
                self._owed = self._added
            self._deliver(chunk)
            return
        if chunk.trace is not None:
            chunk.trace.ns[TAKEN] = time.monotonic_ns()
        self.batcher.add(chunk, time.monotonic())
        self._pulled += 1
        self._added += len(chunk)
        if self._pulled <= self._pull_target:
            self._owed = self._added

    def _hand_results(self, seq: list[Any], stream: list[str], outputs: dict[str, np.ndarray]) -> None:
        """A batch's results to ``on_results``, read at each batch (it may be replaced meanwhile)."""
        on_results = self.on_results
        if on_results is not None:
            on_results(seq, stream, outputs)

    def _deliver(self, events: Events) -> None:
        """A user source's events, in order, to ``on_event``; without one they are counted."""
        stats = self.main_stats
        on_event = self.on_event
        name = self.feed_specs[events.feed].name
        if on_event is None:
            stats.events_unhandled += len(events.items)
            if not self._logged_unhandled_event:
                self._logged_unhandled_event = True
                log.error("source %r handed over events, but the controller has no on_event: counted in "
                          "events_unhandled (logged once)", name)
            return
        for i, event in enumerate(events.items):
            stats.events += 1
            try:
                on_event(name, event)
            except BaseException:
                stats.events_unhandled += len(events.items) - i - 1
                raise

    def send(self, feed: str, frame: Any) -> None:
        """Hand a frame to the feed or source named ``feed`` now, not with the next batch's replies
        (an order, say): it is written (a WebSocket feed) or yielded by ``ctx.outgoing()`` (a user
        source) as soon as the IO loop turns, in order with the replies before it. ``frame`` is a
        ``str``, UTF-8 ``bytes``, a list of frames, or a JSON value (sent as its compact text).
        Call it from the thread that drives the controller; it waits while outbound is full."""
        index = self._feed_index.get(feed)
        if index is None:
            raise ValueError(f"no feed or source is named {feed!r}; there are: "
                             f"{', '.join(repr(spec.name) for spec in self.feed_specs)}")
        spec = self.feed_specs[index]
        if spec.jetstream is not None:
            raise ValueError(f"{spec.label} is a JetStream feed: it publishes replies to its results subject and "
                             "is sent no frames")
        if not self._started or self._side is None:
            raise RuntimeError("call start() (or use the controller as a context manager) before send()")
        if self._stopped:
            raise RuntimeError("the controller has stopped: nothing more is sent")
        try:
            frames = frames_of(frame)
        except TypeError as exc:
            raise TypeError(f"send(): {exc}") from None
        if frames:
            self._io.raise_if_failed()
            self._put_outbound(Outgoing(frames, answers=False, feed=index, sent=True), None)

    def _put_outbound(self, item: Any, deadline: float | None) -> None:
        """Hand replies to the IO thread, waiting while ``outbound`` is full (the socket is
        slow): until the stop deadline once a stop was requested, else for as long as it takes."""
        outbound = self._side.outbound
        while True:
            if deadline is None:
                deadline = self._work_deadline
            wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            try:
                if wait > 0:
                    outbound.put(item, timeout=wait)
                else:
                    outbound.put_nowait(item)
                return
            except Full:
                self._io.raise_if_failed()
                if deadline is not None and time.monotonic() >= deadline:
                    self.main_stats.dropped["outbound full at stop"] += item.frame_count
                    log.error("%d replies dropped: the outbound queue stayed full until the stop deadline",
                              item.frame_count)
                    return

    # ---- observing --------------------------------------------------------------------------

    def stats(self) -> StatsSnapshot:
        """A consistent-enough snapshot for the status line, the metrics and embedding code;
        callable from any thread (the metrics endpoint calls it on the IO thread)."""
        io = self._io.snapshot() if self._io is not None else self.io_stats.snapshot()
        engine = self.engine
        return whole_snapshot(
            self.main_stats, io, at=time.monotonic(), compilations=compilations(),
            devices=(engine.devices, tuple(int(v) for v in engine.device_messages), engine.device_rows)
            if engine is not None else None,
            streams=(len(self.slots), self.slots.evicted),
            checkpoints=self.checkpointer.stats_fields() if self.checkpointer is not None else {},
            sources=self.recovery.source_figures(io),
            io_cpu_s=self._io.cpu_seconds() if self._io is not None else math.nan,
            partitions_unowned=owner.unowned if (owner := self._owner) is not None else 0)

    @property
    def metrics_url(self) -> str | None:
        """``http://host:port`` of /metrics, /healthz, /readyz once started (None when off)."""
        return self._io.metrics_url if self._io is not None else None

    @property
    def demo(self) -> Any:
        """The embedded demo feed (its ``summary()``), or None when a real feed is used."""
        return self._io.demo if self._io is not None else None

    # ---- signals ----------------------------------------------------------------------------

    def _on_signal(self, signum: int) -> None:
        """SIGINT/SIGTERM while ``run()`` runs: an orderly stop; a second SIGINT aborts."""
        if signum == signal.SIGINT and self._stop_requested.is_set():
            log.warning("second interrupt: aborting (what was not sent is dropped, no checkpoint is written)")
            self._aborting = True
            if self._io is not None:
                self._io.abort()
            raise KeyboardInterrupt
        self.request_stop()  # first: once the line below is logged, a second SIGINT aborts
        log.info("%s received: stopping (reading stopped, sending what is left)", signal.Signals(signum).name)


def _print_line(line: str) -> None:
    print(line, flush=True)
