"""Controller: the main-thread loop (inbound -> batcher -> engine step -> outbound).

Rules:
- JAX runs only in the main thread. The device state is the engine's (controller/engine.py); one device or
  several is its business, never the loop's.
- Every bucket size is compiled in ``start()`` before the IO thread connects: nothing compiles after warm-up.
- Batches in order: ``Intake`` takes what waits, ``BatchStep`` slots, steps, answers and puts one ``Outgoing``,
  up to ``FORKLESS_STEPS_IN_FLIGHT`` steps at once; replies keep arrival order.
- The IO thread's health is checked at least every ``POLL_S``; if it died, the loop stops and raises.
- A checkpoint is begun, or copied on by a budget, at the end of ``process_pending`` (the checkpointer's tick).
- One exit path: ``start()`` puts each resource on one exit stack as it takes it; ``stop()``, a failed or stopped
  start and the end of ``run()`` unwind it, so each is given back once, in reverse. A feature that is off is an
  object with the same calls (``NoCheckpoints``, ``NoPartitions``, ``NoIOSide``), called unconditionally.
- A stop requested during ``start()`` ends it there: no IO side is started, leases taken are released.
- The host process is left as it was found (controller/lifetime/host.py); ``run()`` never exits the process.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from forkless.controller.batching import MicroBatcher
from forkless.controller.batchstep import BatchStep
from forkless.controller.checkpoints.checkpointer import Checkpointer, checkpoints_for, store_for
from forkless.controller.checkpoints.snapshot import PendingSnapshot
from forkless.controller.codec import Codec, guarded_codec
from forkless.controller.config import Config
from forkless.controller.device.compiled import codec_dtype, compilations, release_freed_memory
from forkless.controller.engine import Engine, compile_step
from forkless.controller.eventsonly import NO_WEIGHTS, DroppedMessages, check_events_only
from forkless.controller.inflight import StepsInFlight
from forkless.controller.ioside import IOSide, NoIOSide, feed_plan, io_thread, with_hooks
from forkless.controller.lifetime.endpoints import Endpoints, NoEndpoints, open_endpoints
from forkless.controller.lifetime.host import ProcessSettings, StopSignals
from forkless.controller.lifetime.lifecycle import ABORTED, FAILED, LEASE_LOST, ORDERLY, Lifetime
from forkless.controller.lifetime.sdnotify import NoServiceManager, ServiceManager, service_manager
from forkless.controller.lifetime.serving import serve
from forkless.controller.partitions.partitioned import NoPartitions, PartitionOwner, partitioned_feed
from forkless.controller.processor import Processor, StateShape, default_processor
from forkless.controller.queues import POLL_S, Intake, Outlet, StopDeadline
from forkless.controller.recovery import Recovery
from forkless.controller.replies import Replies
from forkless.controller.slots import StreamSlots
from forkless.controller.stats import MainStats, StatsSnapshot, books_line, status_line, whole_snapshot
from forkless.controller.wiring import (
    ConnectHooks,
    EventCallback,
    EventsOnly,
    OnEvent,
    OnResults,
    ReplacedAttribute,
    Runtime,
    checked_group,
    event_callback,
    main_thread_results,
    runs_no_processor,
    split_sinks,
    taking_old_keywords,
)
from forkless.io_loop.connectors.websocket.on_connect import frames_of
from forkless.io_loop.counters import IOStats
from forkless.io_loop.crossing import Outgoing
from forkless.io_loop.errors import LeaseLost, StopRequested
from forkless.io_loop.gil import gil_status, log_gil
from forkless.io_loop.sends import checked_max_age, sent_frames
from forkless.io_loop.sinks.sink import ResultSink
from forkless.io_loop.source import Source
from forkless.io_loop.waiting import PARK, WaitSettings, wait_settings

__all__ = ["Controller"]

log = logging.getLogger("forkless.controller")

# How long a thread may hold the GIL while another waits (CPython's default 5 ms): when XLA returns, the main
# thread needs it back from a busy IO thread soon (bench/docs/levers.md). Events only: no step, host's left.
SWITCH_INTERVAL_S = 0.001


class Controller:
    """Runs a processor over its feeds (the configured ones, and the sources it is given).

    Either ``run()`` (blocking, handles signals, prints status lines), or drive it yourself::

        with Controller(config, processor=..., codec=...) as ctl:
            while ...:
                ctl.process_pending(timeout=0.1)

    Its eight arguments, each a value of one kind, and the old keywords that still warn: docs/embedding/controller.md
    (the groups: controller/wiring.py).
    """

    # replaced by sinks: assigning it would be read by nothing, so reading or assigning it says so
    on_results = ReplacedAttribute("Controller.on_results is gone: results leave through sinks, given when the "
                                   "controller is built: Controller(sinks=[forkless.OnResults(f)])")

    @taking_old_keywords
    def __init__(self, config: Config | None = None, *, processor: Processor | EventsOnly | None = None,
                 codec: Codec | None = None, sources: Sequence[Source] = (),
                 sinks: Sequence[OnResults | ResultSink] = (), on_event: EventCallback | OnEvent | None = None,
                 connect: ConnectHooks | None = None, runtime: Runtime | None = None) -> None:
        """The wiring; nothing runs and nothing is compiled until ``start()`` (see the class)."""
        connect = checked_group(connect, ConnectHooks, "connect", "forkless.ConnectHooks(on_connect=..., "
                                "before_connect=...)")
        runtime = checked_group(runtime, Runtime, "runtime", "forkless.Runtime(out=..., freeze_gc=..., ...)")
        events = event_callback(on_event)
        on_results, result_sinks = split_sinks(sinks)
        self.events_only = events_only = runs_no_processor(processor)
        self.config = cfg = config if config is not None else Config.from_env()
        store, io_factory = runtime.checkpoint_store, runtime.io_factory or io_thread
        if events_only:  # before the plan: no demo feed's settings are checked when none runs
            check_events_only(cfg.checkpoints, cfg.feed_variable, bucket=cfg.partitioning.checkpoint_bucket,
                              sinks=(*on_results, *result_sinks),
                              sources=sources, store=store)
        # the feeds this controller runs: the configured ones and the user's own sources
        self.plan = feed_plan(cfg, sources, check_demo=io_factory is io_thread, sinks=result_sinks)
        self.feed_specs = specs = self.plan.specs
        self.on_event = events.fn if events is not None else None
        self.connection_events = events is not None and events.connections
        self.processor: Processor | None = (None if isinstance(processor, EventsOnly) else processor
                                            if processor is not None else default_processor(cfg))
        # a custom codec's exceptions become error replies, never a dead thread (codec.py)
        self.codec = guarded_codec(codec, cfg.step.features, max_frame_items=cfg.limits.max_frame_items,
                                   dtype=np.dtype(np.float32) if self.processor is None else
                                   codec_dtype(self.processor))
        self._on_results = main_thread_results(on_results)  # the main thread's sinks, one call a batch
        # a partitioned feed's connector: leases and per-partition checkpoint objects
        self._partition_feed = partitioned_feed(self.plan.connectors, self.processor)
        # False: each checkpoint copies the whole state at once, as on an accelerator (tests and
        # bench/checkpoint_stall.py compare it with the copy between steps)
        self.incremental_checkpoints = True
        self._print = runtime.out if runtime.out is not None else _print_line
        self.io_stats = IOStats()
        self.main_stats = MainStats.for_run(cfg.buckets, len(specs))
        # what each message gets back, under its feed's reply policy
        self.replies = Replies(self.codec, self.main_stats, [spec.replies for spec in specs], cfg.step.max_streams)
        self.batcher = MicroBatcher(cfg.step.max_batch, cfg.loop.max_wait_ms / 1000, cfg.buckets)
        self.slots = StreamSlots(cfg.step.max_streams, idle_s=cfg.loop.stream_idle_s)
        self._io: IOSide | NoIOSide = NoIOSide(self.io_stats)  # the real one once start() starts it
        # checkpoints: what they hold beside the state, restoring one, the replayable feeds' positions
        # a partitioned feed's bucket (FORKLESS_CHECKPOINT_BUCKET) or the program's own store turn checkpoints on too
        elsewhere = store is not None or cfg.partitioning.checkpoint_bucket != ""
        self.recovery = recovery = Recovery(cfg.checkpoints, StateShape.of(cfg.step), self.processor,
                                            self.slots, self.main_stats, lambda: self._io.snapshot(), specs,
                                            codecs=self.plan.position_codecs(), own_store=elsewhere)
        self.positions = recovery.positions  # the replayable feeds' (controller/checkpoints/positions.py)
        self._own_store = store  # the embedding program's own, instead of FORKLESS_CHECKPOINT_DIR
        self._checkpoints = checkpoints_for(recovery.checkpoints, recovery.await_replies if self.positions else None,
                                            store, partitioned=self._partition_feed is not None,
                                            bucket=cfg.partitioning.checkpoint_bucket)
        self._owner: PartitionOwner | NoPartitions = NoPartitions()  # a partitioned instance's, once started
        self.engine: Engine | None = None  # the device state's owner, made by compile()
        self._io_factory = with_hooks(io_factory, on_connect=connect.on_connect, before_connect=connect.before_connect)
        # made by start() once the IO side runs: its queues' main-thread ends (each batch's way between them)
        self._intake: Intake = None  # type: ignore[assignment]  # start() makes it; read only after
        self._outbound: Outlet = None  # type: ignore[assignment]  # as _intake
        self._stop_requested = threading.Event()
        self._deadline = StopDeadline(cfg.timeouts.shutdown_timeout_s)  # fixed by request_stop()
        self._started = False
        self._running = False  # start() started the IO side (a stop during start() leaves it False)
        self._stopped = False
        self._aborting = False  # a second SIGINT: run() raises KeyboardInterrupt
        self._sends = 0  # send() calls so far: a send's id unless the caller gives one
        self._host = ProcessSettings(switch_interval_s=None if events_only else SWITCH_INTERVAL_S,
                                     freeze_gc=runtime.freeze_gc)
        self._signals = StopSignals(self._on_signal)
        self._report_wanted = threading.Event()  # SIGUSR1: run()'s loop reports the run so far
        self._reported: StatsSnapshot | None = None  # the snapshot of the last report (or of the serving's start)
        # the endpoints from the first second of start() (bound there), and systemd told where the run is (run())
        self._endpoints: Endpoints | NoEndpoints = NoEndpoints()
        self._service: ServiceManager | NoServiceManager = (service_manager() if runtime.notify_systemd
                                                            else NoServiceManager())
        # what start() takes, given back once, in reverse, by stop(), a failed start or run()'s end
        self._life = Lifetime(self._deadline)
        self._handoff: WaitSettings | None = None  # resolved once, after the compile (``handoff``)

    @property
    def abandoned_io(self) -> bool:
        """True if the IO thread still ran when the stop gave up on it (left behind: a daemon)."""
        return self._life.abandoned_io

    @property
    def handoff(self) -> WaitSettings:
        """How the threads wait for each other (FORKLESS_HANDOFF resolved on the engine's platform and this
        interpreter's GIL: io_loop/waiting.py), resolved once, so both threads are handed the same; ``park``
        before the compile and without a processor."""
        if self.engine is None:
            return PARK
        if self._handoff is None:
            self._handoff = wait_settings(self.config.loop.handoff, self.engine.platform)
        return self._handoff

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The checkpoint writer (None when checkpoints are off)."""
        return self._checkpoints if isinstance(self._checkpoints, Checkpointer) else None

    # ---- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> Controller:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Compile every bucket, put the state on the device, start the IO thread. A failure, or a
        stop requested meanwhile (a signal while it compiles, waits for a dead holder's lease,
        restores), gives back what it took (``_take``) and starts no IO side."""
        if self._started:
            return
        self._started = True
        try:
            self._take(self._life)
        except StopRequested as stopped:  # its message names what the stop interrupted
            log.info("stop requested during %s: not starting", stopped)
            self._life.end(FAILED)
            self._enter("stopped")
        except BaseException:
            self._life.end(FAILED)
            self._enter("stopped")
            raise

    def _take(self, life: Lifetime) -> None:
        """``start()``'s resources, each held by ``life`` as soon as it is taken, so they are
        given back in reverse: the IO side ended, the checkpoint writer ended, the leases
        released, the host's process settings restored (controller/lifetime/lifecycle.py)."""
        cfg, recovery = self.config, self.recovery
        life.hold(self._host.restore)  # last: nothing to give back until apply() below
        # the endpoints first: a taken port is refused before anything compiles, and they answer meanwhile
        self._endpoints = open_endpoints(cfg, self.stats)
        life.hold(self._endpoints.close)
        # a checkpoint that does not fit is refused before the compile (CheckpointMismatch); a
        # partitioned instance compiles first, then takes its leases and reads its partitions'
        # objects: its partitions go unserved from the old owners' stop to its first connection
        # (a rescale), and the compile need not fall inside that window (bench/partitioned.py)
        self._owner = self._open_owner()
        life.hold(self._close_owner)
        # the one place the run's checkpoint store is chosen (None: checkpoints are off)
        store = store_for(recovery.checkpoints, self._own_store, self._owner.checkpoints)
        restored = None
        if store is not None and recovery.checkpoints.restore == "auto":
            self._enter("restoring")
            restored = recovery.load(store)
        self._compile(self._stop_between_buckets)
        self._check_stop("the restore and compile")
        if restored is not None:
            assert self.engine is not None  # compiled: a checkpoint needs a processor
            self._enter("restoring")
            recovery.restore(self.engine, restored)
        self._checkpoints.start(store, newest_at=recovery.restored_at, newest_bytes=recovery.restored_bytes)
        life.hold_checkpoints(self._checkpoints)
        self._host.apply()
        log_gil(log)  # once JAX and every extension the run needs are loaded: any that turned the GIL on is named
        self._io = io = self._io_factory(cfg, self.codec, self.io_stats, self.stats, **self._io_arguments(),
                                         **self._endpoints.hand_over())
        side = io.start()
        life.hold_io(io)
        self._wire(io, side)
        self._running = True
        self._enter("running")

    def _wire(self, io: IOSide, side: Any) -> None:
        """The main thread's ends of the started IO side's queues, and each batch's way between them."""
        stats = self.main_stats
        self._outbound = Outlet(side.outbound, io, stats, self._deadline)
        prefixes = self.plan.stream_prefixes(self.config.feeding.shared_streams)
        counters = self.recovery.declared.counters
        names = [spec.name for spec in self.feed_specs]
        wait = self.handoff
        step = DroppedMessages(stats, names) if self.engine is None else StepsInFlight(BatchStep(
            self.engine, self.slots, self.replies, self.positions, stats, put=self._outbound.put,
            on_results=self._on_results, feed_prefixes=prefixes, counters=counters,
            # the IO thread's CPU clock around each step (MainStats.step_io_cpu_s); None where unknown (NaN)
            io_cpu=None if math.isnan(io.cpu_seconds()) else io.cpu_seconds, to_sinks=bool(self.plan.sinks)),
            int(self.engine.settings.steps_in_flight), expect=side.expect if wait.spins else None)
        self._intake = Intake(side.inbound, self.batcher, stats, step, names=names, on_event=lambda: self.on_event,
                              wait=wait, stop=self._deadline)

    def _check_stop(self, during: str) -> None:
        if self._stop_requested.is_set():
            raise StopRequested(during)

    def _stop_between_buckets(self, bucket: int, seconds: float) -> None:
        self._check_stop("the compile")

    def _open_owner(self) -> PartitionOwner | NoPartitions:
        """A partitioned instance's leases, after the compile (blocking: a dead holder's are waited out)."""
        feed = self._partition_feed
        if feed is None:
            return NoPartitions()
        self._compile(self._stop_between_buckets)
        self._check_stop("the compile")
        try:
            settings = self.config.instance_settings()  # its leases' and checkpoint objects'
            self._enter("waiting_for_leases")
            assert self.engine is not None  # compiled: a partitioned feed needs a processor
            return PartitionOwner.open(settings, feed, self.engine.checkpoint_shapes, stop=self._stop_requested)
        except StopRequested:
            raise StopRequested("the wait for the partitions' leases") from None

    def _io_arguments(self) -> dict[str, Any]:
        """What the IO side is given beside its settings, each only where there is one: the restored positions, the
        plan (the user's sources, sinks, the feeds' connectors: a partitioned feed's fences its own source),
        ``acknowledged``, ``connection_events``."""
        positions, plan, acked = self.recovery.resume_from, self.plan, {"acknowledged": self.recovery.acknowledged}
        planned = {"plan": plan} if plan.sources or plan.sinks or plan.connectors else {}
        spin = {"wait": self.handoff} if self.handoff.spins else {}  # the IO loop's selector spins (io_loop/waiting.py)
        return {**({"positions": positions} if positions else {}), **planned, **(acked if self.positions else {}),
                **spin, **({"connection_events": True} if self.connection_events else {})}

    def _close_owner(self) -> None:
        """Release a partitioned instance's leases (after the stop's checkpoint)."""
        owner = self._owner
        self._owner = NoPartitions(owner.lease_losses)  # the last books still say a lease was lost
        owner.close()

    def compile(self) -> None:
        """Initialise the state on the device and compile the step for every bucket (AOT); events only: nothing."""
        self._compile(None)

    def _compile(self, after_bucket: Callable[[int, float], None] | None) -> None:
        """``compile``; ``after_bucket`` is called after each bucket's compile (``start`` checks
        there whether a stop was requested, so a stop waits for one bucket, not all of them)."""
        if self.engine is not None or self.events_only:  # events only: nothing to compile
            return
        cfg, t0 = self.config, time.monotonic()
        assert self.processor is not None  # (events only returned above)
        self._enter("compiling")
        self.engine = compile_step(self.processor, cfg.step, after_bucket)
        self.main_stats.compilations_at_ready = compilations()
        release_freed_memory()
        log.info("compiled the step for batch sizes %s on %s in %.2fs", ",".join(map(str, cfg.buckets)),
                 self.engine.describe(), time.monotonic() - t0)

    def set_weights(self, params: Any, *, version: str | None = None) -> str:
        """Swap the processor's weights for ``params`` (same structure, shapes, dtypes) before the next batch's
        step, nothing compiled again; from any thread, between ``start()`` and ``stop()``
        (controller/device/weights.py). Their version. ``RuntimeError`` before or after: no step would apply them."""
        if self.events_only:
            raise RuntimeError(NO_WEIGHTS)
        if not self._running:  # a compile() alone runs no step, and start() may yet restore other weights
            raise RuntimeError("set_weights(): call start() (or use the controller as a context manager) first: "
                               "weights are swapped between the steps of a started controller")
        if self._stopped:
            raise RuntimeError("set_weights(): the controller has stopped (stop() was called): no step will run to "
                               "apply new weights")
        assert self.engine is not None  # running, with a processor
        return self.engine.offer_weights(params, version)

    @property
    def state(self) -> Any:
        """The device state as it is now, to look at (tests, inspection): the engine owns it, and
        the next step is given it donated, so keep no reference across a step."""
        return self.engine.state if self.engine is not None else None

    # ---- checkpoints --------------------------------------------------------------------------

    def _begin_checkpoint(self, incremental: bool | None = None) -> PendingSnapshot:
        """A checkpoint as of now, every step in flight finished first; see ``Recovery.begin``."""
        if self._intake is not None:  # None: not started (a test's own call)
            self._intake.settle()
        assert self.engine is not None  # a checkpoint needs a processor: compiled
        return self.recovery.begin(self.engine, self.incremental_checkpoints if incremental is None else incremental)

    @property
    def restored_from(self) -> str | None:
        """The checkpoint this run continued from (None: it started fresh)."""
        return self.recovery.restored_from

    # ---- stopping ---------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask ``run()`` to stop; safe from signal handlers and other threads. Fixes the stop's
        deadline, ``shutdown_timeout_s`` from now; processing and sending end ``stop_reserve_s``
        before it, so that the IO thread can end and the process exit by it whatever the socket does."""
        self._deadline.fix()
        self._stop_requested.set()

    def stop(self) -> None:
        """Orderly stop: stop reading, process what is queued, send every result, join.

        Bounded by ``shutdown_timeout_s``; what could not be sent by then is counted as
        dropped and logged. Raises if the IO thread failed; else, once stopped, the first
        exception an ``OnResults`` raised during the stop (the stop goes on past it). A
        partitioned instance whose lease is lost (or ran out) stops without answering or
        checkpointing anything more, then raises ``LeaseLost`` (``_drop_unanswered``).
        """
        if not self._running or self._stopped:  # not started, its start failed or was stopped, or stopped
            return
        self._stopped = True
        self._enter("stopping")
        self.request_stop()  # fixes the stop deadline, if a signal or the caller has not already
        self._io.request_stop(self._deadline.work)
        raised: Exception | None = None  # the OnResults' first failure, raised once stopped
        how = LEASE_LOST if self._owner.lost else ORDERLY
        try:
            if how == LEASE_LOST:
                unanswered = self._drop_unanswered()
            else:
                work = self._deadline.work
                assert work is not None  # request_stop() fixed it
                raised = self._finish(work)
        finally:
            self._life.end(ABORTED if self._aborting else how)
            self._enter("stopped")
        if how == LEASE_LOST:
            log.error("the lease of a partition is lost: %d received messages dropped unanswered (%d of them "
                      "unprocessed) and no checkpoint written; their new owner answers them from its checkpoint",
                      self.stats().dropped.get("lease lost", 0), unanswered)
            assert self._partition_feed is not None  # a lease is lost only where a feed is partitioned
            raise LeaseLost(f"{self._partition_feed.feed.label}: the lease of a partition was lost or ran out "
                            "unrenewed (FORKLESS_LEASE_S): another instance may own it now, so this one stopped "
                            "without publishing what it held")
        self._io.raise_if_failed()
        if raised is not None:
            raise raised

    def _finish(self, work_deadline: float) -> Exception | None:
        """An orderly stop's work: process what is queued until inbound is shut and drained (or the work
        deadline), finish the steps in flight, count what is left, shut outbound, hand over the stop's
        checkpoint (written while the IO thread ends). Returns the ``OnResults``' first failure meanwhile."""
        raised = self._intake.finish(work_deadline, lambda: self._io.failure is not None)
        unapplied = self.engine.live_weights.offered() if self.engine is not None and self.engine.live_weights else None
        if unapplied is not None:  # set_weights() returned their version: say that no step took them
            log.warning("weights %r offered by set_weights() were never applied: no batch was stepped after them "
                        "before the stop", unapplied)
        left = self._intake.drain()
        if left:
            self.main_stats.dropped["not processed before the stop"] += left
            log.error("%d received messages were not processed before the stop deadline "
                      "(FORKLESS_SHUTDOWN_TIMEOUT_S=%s)", left, self.config.timeouts.shutdown_timeout_s)
        self._outbound.shutdown()
        # after the last batch: the stop's checkpoint, copied at once (nothing runs after it)
        self._checkpoints.begin_stop(lambda: self._begin_checkpoint(incremental=False).complete())
        return raised

    def _drop_unanswered(self) -> int:
        """The stop of a partitioned instance whose lease is lost or ran out: another may own its
        partitions and answer from their checkpoint, so what this one has unanswered (steps in flight too)
        is dropped, never published (the IO side's fence drops what is queued to publish), and no
        checkpoint is written. How many messages it dropped unanswered."""
        unanswered = self._intake.drain()
        self.main_stats.dropped["lease lost"] += unanswered
        self._outbound.shutdown()
        return unanswered

    # ---- running ----------------------------------------------------------------------------

    def run(self) -> None:
        """Start, process until a signal / ``duration_s`` / ``request_stop()``, then stop.

        SIGINT, SIGTERM and SIGHUP (when called from the main thread) stop it in order; a second
        SIGINT aborts the IO side and raises ``KeyboardInterrupt`` (within about a second: what
        was not sent is counted as dropped, no checkpoint is written); SIGUSR1 logs the status and
        the books so far (docs/running.md, "Signals"). Prints a status line every ``status_s``
        seconds. With ``notify_systemd``, tells systemd when it is ready, that its loops turn and
        when it stops. Returns None once stopped in order (the books logged). What
        an ``OnResults`` or ``out`` raised is raised after an orderly stop; ``start()``'s errors and
        the IO side's (``FeedFatal``, ``IOThreadError``) at once. Never exits the process; the
        host's signal handlers and process settings are back as they were when it returns or raises.
        """
        self._signals.install()
        try:
            self.start()
            cfg = self.config  # steps may stay in flight between its calls (settle=False)
            if cfg.run.duration_s:  # a stop requested when it is over, whatever the main thread waits on then
                self._deadline.plan(time.monotonic() + cfg.run.duration_s)
            self._reported = self.stats()
            first = serve(self._serve_turn, self.stats, self._print, self._stop_requested,
                          duration_s=cfg.run.duration_s, status_s=cfg.run.status_s, poll_s=POLL_S)
            if self._running:  # else the start was stopped or failed: nothing runs to stop
                self._enter("stopping")
            self.stop()
            final = self.stats()
            if cfg.run.status_s > 0:
                self._print(status_line(final, first, final=True))
            log.log(logging.ERROR if final.unanswered else logging.INFO, "%s", books_line(final))
        except KeyboardInterrupt:
            if self._started and not self._stopped:  # interrupted before stop(): the IO side is aborted
                self._aborting = self._stopped = True
                self._io.abort()
            raise
        except Exception as exc:
            if self._aborting and _interrupted(exc):
                # the second SIGINT's KeyboardInterrupt, raised by its handler inside threading's own lock
                # handling (a Condition's wait), can surface as another error there ("release unlocked lock")
                raise KeyboardInterrupt from exc
            # the host program's code failed (OnResults, out) with the IO side well: stop in
            # order (every reply sent, the stop's checkpoint written), then raise what it raised
            if self._running and not self._stopped and self._io.failure is None:
                with contextlib.suppress(Exception):
                    self.stop()
            raise
        finally:
            try:  # what start() took, also when stop() never ran (the IO side failed, a second SIGINT)
                self._life.end(ABORTED if self._aborting else FAILED)
            finally:
                self._signals.restore()
                self._enter("stopped")
                self._service.close()
        if self._aborting:  # a second SIGINT that came while the host's settings were given back
            raise KeyboardInterrupt

    def _serve_turn(self, timeout: float) -> int:
        """One turn of ``run()``'s loop: what is waiting processed (steps may stay in flight: settle=False),
        systemd's watchdog fed while both loops turn, and the report SIGUSR1 asked for."""
        done = self._process(timeout, settle=False)
        now = time.monotonic()
        if self._service.watchdog_due(now):  # the IO loop turned since the last ping: its lag samples moved on
            self._service.keep_alive(now, self._io.snapshot().loop_lag.n)
        if self._report_wanted.is_set():
            self._report_wanted.clear()
            snap = self.stats()
            log.info("SIGUSR1: %s", status_line(snap, self._reported))
            log.info("SIGUSR1: %s", books_line(snap))
            self._reported = snap
        return done

    def _enter(self, phase: str) -> None:
        """The run is in ``phase`` now (controller/stats.py ``PHASES``; main thread only): ``forkless_phase``,
        ``/readyz``, and systemd's status, with READY=1 at "running" and STOPPING=1 at "stopping"."""
        if self.main_stats.phase == phase:
            return
        self.main_stats.phase = phase
        status = phase.replace("_", " ")
        if phase == "running":
            self._service.ready(status)
        elif phase == "stopping":
            self._service.stopping(status)
        else:
            self._service.status(status)

    def process_pending(self, timeout: float = 0.0) -> int:
        """Process what is waiting (waiting up to ``timeout`` for a first message); returns
        how many messages were processed. Raises if the IO thread has failed.

        It returns once what was queued when it was called has been processed (its steps in
        flight finished: every result handed over), so a feed that never pauses cannot keep the
        caller waiting. Its last batch is topped up from what arrived since; what that leaves
        waits in the batcher for the next call, as it would have in the queue."""
        return self._process(timeout, settle=True)

    def _process(self, timeout: float, settle: bool) -> int:  # settle=False: steps may stay in flight
        if not self._started:
            raise RuntimeError("call start() (or use the controller as a context manager) first")
        if not self._running:  # a stop was requested during start(): nothing was started
            return 0
        self._io.raise_if_failed()
        self._owner.raise_if_lost()
        done = self._intake.pending(timeout, settle)
        self._checkpoints.tick(time.monotonic(), self._begin_checkpoint)
        return done

    def send(self, feed: str, frame: Any, *, max_age_s: float | None = None, id: Any = None) -> Any:
        """Hand a frame (``str``, UTF-8 ``bytes``, a list of them, or a JSON value) to the feed or source
        ``feed`` now, in order with the replies before it (docs/embedding/controller.md). ``max_age_s``:
        written within this many seconds or never (default: the source's ``send_max_age_s``; None: no
        deadline); one not written in time reaches ``on_event`` as ``SendFailed`` with ``id`` (default:
        this controller's count of sends, 1, 2, …), which ``send`` returns (None when there is nothing to
        send: an empty list). From the driving thread; waits while outbound is full. ``RuntimeError``
        once the feed has ended."""
        index = self.plan.sendable(feed)
        sent_at = time.monotonic()
        max_age_s = checked_max_age(max_age_s, "send(max_age_s=)")
        if max_age_s is None and self.plan.send_max_age_s:
            max_age_s = self.plan.send_max_age_s[index]
        if not self._running:
            raise RuntimeError("call start() (or use the controller as a context manager) before send()")
        if self._stopped:
            raise RuntimeError("the controller has stopped: nothing more is sent")
        frames = frames_of(frame, "send() was given")
        if not frames:
            return None  # nothing to send: no send, no id
        self._io.raise_if_failed()
        self.plan.refuse_ended(self._io.feed_ended(index), index, len(frames))
        self._sends += 1
        send_id = self._sends if id is None else id
        deadline = None if max_age_s is None else sent_at + max_age_s
        self._outbound.put(Outgoing(sent_frames(frames, send_id, deadline, sent_at), answers=False, feed=index,
                                    sent=True, send_id=send_id, sent_at=sent_at, deadline=deadline), None)
        return send_id

    # ---- observing --------------------------------------------------------------------------

    def stats(self) -> StatsSnapshot:
        """A consistent-enough snapshot for the status line, the metrics and embedding code;
        callable from any thread (the metrics endpoint calls it on the IO thread)."""
        io_side, engine = self._io, self.engine
        return whole_snapshot(  # the main thread's counters, then the IO side's: the books' order (controller/stats.py)
            self.main_stats, io_side.snapshot, at=time.monotonic(), compilations=compilations(),
            devices=(engine.devices, tuple(int(v) for v in engine.device_messages), engine.device_rows)
            if engine is not None else ((), (), 0) if self.events_only else None,
            streams=(len(self.slots), self.slots.evicted), checkpoints=self._checkpoints.stats_fields(),
            sources=self.recovery.source_figures, io_cpu_s=io_side.cpu_seconds(),
            partitions_unowned=self._owner.unowned, lease_losses=self._owner.lease_losses,
            weights=engine.weights if engine is not None else None, gil=str(gil_status()))

    @property
    def metrics_url(self) -> str | None:  # http://host:port of /metrics, /healthz, /readyz from start() on
        return self._endpoints.url or self._io.metrics_url

    def summaries(self) -> list[str]:  # each source's summary() line (the demo feed's tally), printed by the program
        return self._io.summaries()

    # ---- signals ----------------------------------------------------------------------------

    def _on_signal(self, signum: int) -> None:
        """A signal while ``run()`` runs (docs/running.md, "Signals"): SIGUSR1 asks for a report of the run so
        far (made by ``run()``'s loop, not here); SIGINT, SIGTERM and SIGHUP for an orderly stop; a second
        SIGINT aborts."""
        if signum == getattr(signal, "SIGUSR1", None):
            self._report_wanted.set()
            return
        if signum == signal.SIGINT and self._aborting:  # raised once: not again inside the unwinding it began
            log.warning("interrupt while aborting: the abort is under way (about a second)")
            return
        if signum == signal.SIGINT and self._stop_requested.is_set():
            log.warning("second interrupt: aborting (what was not sent is dropped, no checkpoint is written)")
            self._aborting = True
            self._io.abort()
            if self._life.interruptible:  # else run() raises it once the host's settings are given back
                raise KeyboardInterrupt
        self.request_stop()  # first: once the line below is logged, a second SIGINT aborts
        log.info("%s received: stopping (reading stopped, sending what is left)", signal.Signals(signum).name)


def _interrupted(exc: BaseException) -> bool:
    """Whether a ``KeyboardInterrupt`` is among what ``exc`` was raised while handling."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__context__
    return False


def _print_line(line: str) -> None:
    print(line, flush=True)
