"""Controller: the main-thread loop (inbound -> batcher -> engine step -> outbound).

Rules:
- JAX runs only in the main thread. The device state is the engine's (controller/engine.py):
  the loop asks it to step a batch, reset recycled slots, begin a checkpoint and restore one;
  one device or several is the engine's business, never the loop's.
- Every bucket size is compiled ahead of time in ``start()`` before the IO thread opens a
  connection, so no message waits for XLA and nothing compiles after warm-up.
- One batch at a time: take what is waiting (``MicroBatcher`` rules), slot streams, step,
  encode, put one ``Outgoing`` item. Replies keep the order their messages arrived in.
- Each feed's reply policy (``FORKLESS_REPLIES``, a feed's ``"replies"``) is applied where the
  frames are made: ``none`` encodes nothing and puts nothing, ``results`` makes no error frame;
  what is not sent is counted (``no_reply`` in the books, ``replies_declined`` by reason) and
  logged once per reason. ``latency`` (receipt -> results handed over) is measured here, for
  every result, whatever is sent.
- A step that raises answers each message of its batch with "processing failed" and
  keeps the state from before that batch; the traceback is logged once per distinct error.
- The IO thread's health is checked at least every ``POLL_S``; if it died, the loop stops
  and raises (``FeedFatal`` or ``IOThreadError``).
- Checkpoints (``FORKLESS_CHECKPOINT_DIR``): the tick at the end of ``process_pending``
  begins one when due (``Engine.begin_snapshot``, kept exact by the engine), or copies up to
  a budget more of the one in progress (controller/checkpointer.py).
- The host process is left as it was found (controller/host.py): what ``start()`` changes
  process-wide, ``stop()`` gives back; ``run()`` never exits the process (a second SIGINT
  aborts the IO side and raises ``KeyboardInterrupt``).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import signal
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from queue import Empty, Full
from typing import Any, Protocol

import janus
import numpy as np

from controller.batching import (
    ENCODED,
    FETCHED,
    OUTBOUND,
    STEP,
    TAKEN,
    MicroBatcher,
    Outgoing,
    Taken,
    Trace,
)
from controller.checkpoint import PendingSnapshot, Restored, load_newest
from controller.checkpointer import Checkpointer
from controller.codec import ENCODE_FAILED, Codec, GuardedCodec, JsonCodec
from controller.compiled import codec_dtype, compilations, release_freed_memory
from controller.config import Config
from controller.engine import Engine, StepFailed, compile_step, state_shapes
from controller.errors import ProcessorContractError
from controller.host import ProcessSettings, StopSignals
from controller.positions import SourcePositions
from controller.processor import Processor, default_processor
from controller.slots import StreamSlots
from controller.stats import (
    SECONDS_BOUNDS,
    Histogram,
    IOSnapshot,
    IOStats,
    MainStats,
    SourceFigures,
    StatsSnapshot,
    add_hops,
    books_line,
    copy_counts,
    observe_hops,
    status_line,
)
from io_loop.on_connect import OnConnect
from io_loop.thread import IOThread

__all__ = ["Controller", "IOFactory", "IOSide", "OnConnect", "OnResults", "compilations"]

log = logging.getLogger("forkless.controller")

POLL_S = 0.1
# a checkpoint with JetStream positions waits (on the writer thread) this long at least for the
# results stream to acknowledge the replies it covers, polling every CONFIRM_POLL_S
CONFIRM_WAIT_S = 10.0
CONFIRM_POLL_S = 0.005
NON_FINITE_REASON = "processing produced a non-finite result (the stream starts again)"
STOP_RESERVE_S = 0.5  # of SHUTDOWN_TIMEOUT_S (at most a third), kept for ending the threads and the process
# How long a thread may hold the GIL while another waits for it (CPython's default is 5 ms).
# When XLA returns, the main thread needs the GIL back from a busy IO thread; 1 ms instead
# of 5 ms measured about +20% maximum throughput in an A/B run (see bench/README.md).
SWITCH_INTERVAL_S = 0.001
# After a second SIGINT: how long run() waits for the aborted IO thread before it raises
ABORT_JOIN_S = 0.5
MAX_LOGGED_REASONS = 1000  # declined replies: reasons logged (once each), then only counted


class IOSide(Protocol):
    """What the controller needs from the IO side; ``io_loop.thread.IOThread`` is the real one,
    and tests use a fake built on plain queues (tests/fake_io.py) with the same interface."""

    failure: BaseException | None
    metrics_url: str | None
    demo: Any

    def start(self) -> Any: ...  # -> an object with ``inbound`` and ``outbound`` sync queues

    def request_stop(self, deadline: float | None = None) -> None: ...

    def join(self, timeout: float | None = None) -> bool: ...

    def abort(self) -> None: ...

    def raise_if_failed(self) -> None: ...

    def snapshot(self) -> IOSnapshot: ...


OnResults = Callable[[list[Any], list[str], dict[str, np.ndarray]], None]
"""``on_results(seq, stream, outputs)``: called in the main thread after each step, before the
replies are handed to the IO thread; ``outputs`` maps each output name to a numpy array whose
leading axis is the batch's messages (padding already cut off), in arrival order."""

IOFactory = Callable[[Config, Codec, IOStats, Callable[[], StatsSnapshot]], IOSide]
"""Builds the IO side; ``Controller(on_connect=...)`` is bound into the default one (the real
IO thread), and a custom factory (the tests' fake IO side) makes no connections to call it on."""


def _io_thread(config: Config, codec: Codec, stats: IOStats, snapshot: Callable[[], StatsSnapshot], *,
               on_connect: OnConnect | None = None, positions: dict[str, Any] | None = None) -> IOSide:
    """The real IO side; ``positions``: the JetStream feeds' positions a restored checkpoint
    recorded (passed only when there are some)."""
    render = None
    if config.metrics_addr:
        from controller.metrics import exposition  # only when served: prometheus_client is about 10 MiB of RSS

        render = exposition(snapshot)
    return IOThread(config.io_settings(), codec, stats, stats_snapshot=snapshot, render_metrics=render,
                    on_connect=on_connect, positions=positions)


class Controller:
    """Runs a processor over a WebSocket feed; see the README's "Embedding" section.

    Either ``run()`` (blocking, handles signals, prints status lines), or drive it yourself::

        with Controller(config, processor=..., codec=...) as ctl:
            while ...:
                ctl.process_pending(timeout=0.1)
    """

    def __init__(self, config: Config | None = None, *, processor: Processor | None = None,
                 codec: Codec | None = None, out: Callable[[str], None] | None = None,
                 on_results: OnResults | None = None, io_factory: IOFactory = _io_thread,
                 freeze_gc: bool = False, on_connect: OnConnect | None = None) -> None:
        """``freeze_gc=True``: freeze the objects alive when the run starts (``gc.freeze``: JAX's
        modules, the compiled steps, the stream table's containers), so the collector does not
        walk them again while it runs — a full collection walked them all, holding the GIL 15-67
        ms between two steps (bench/checkpoint_stall.py, 1M streams). Only if nothing is frozen
        yet, undone by the stop (controller/host.py). The ``forkless`` program asks for it; an
        embedded controller leaves the collector alone unless asked.

        ``on_connect(feed, connection)``: frames to send first on every new connection of a feed,
        computed then (a signed, timestamped subscription); it runs on the IO thread's loop
        (io_loop/on_connect.py has the rules, EMBEDDING.md an example)."""
        self.config = config if config is not None else Config.from_env()
        self.processor = processor if processor is not None else default_processor(self.config)
        x_dtype = codec_dtype(self.processor)
        user_codec = codec if codec is not None else JsonCodec(
            self.config.features, max_frame_items=self.config.max_frame_items, dtype=x_dtype)
        # a custom codec's exceptions become error replies, never a dead thread (codec.py); its
        # x is cast to the processor's input dtype if it differs
        self.codec = GuardedCodec(user_codec, self.config.features, dtype=x_dtype)
        self.on_results = on_results
        cfg = self.config
        if cfg.checkpoints_on and not getattr(self.processor, "name", None):
            # a checkpoint is restored only into the processor that wrote it: it must say which it is
            raise ProcessorContractError(
                "checkpoints (FORKLESS_CHECKPOINT_DIR) need a processor that declares its identity: build it with "
                "Processor(init, step, name=..., version=...) (the name and version are stored in each checkpoint "
                "and matched on restore)")
        # the JetStream feeds' positions, recorded in every checkpoint beside the state (exactly-once)
        self.sources = SourcePositions(cfg.feed_specs)
        self._restored_positions: dict[str, Any] = {}
        self.checkpointer = Checkpointer(cfg.checkpoint_dir, keep=cfg.checkpoint_keep, interval_s=cfg.checkpoint_s,
                                         background=cfg.checkpoint_priority == "idle",
                                         before_write=self._await_replies if self.sources else None) \
            if cfg.checkpoints_on else None
        self.restored_from: str | None = None
        # False: each checkpoint copies the whole state at once, as on an accelerator (tests and
        # bench/checkpoint_stall.py compare it with the copy between steps)
        self.incremental_checkpoints = True
        self._print = out if out is not None else _print_line
        self.io_stats = IOStats()
        specs = self.config.feed_specs
        self.main_stats = MainStats(batch_size=Histogram(self.config.buckets),
                                    latency=[Histogram(SECONDS_BOUNDS) for _ in specs])
        # what each feed is sent back; one policy for the whole batch when every feed has the same
        self._policies = tuple(spec.replies for spec in specs)
        self._policy = self._policies[0] if len(set(self._policies)) == 1 else None
        self._too_many = f"too many streams (FORKLESS_MAX_STREAMS={self.config.max_streams})"
        # an error reply's reason -> its errors counter's (and replies_declined's) key
        self._counted_as = {self._too_many: "too many streams", NON_FINITE_REASON: "non-finite result"}
        self._declined_logged: set[str] = set()
        self.batcher = MicroBatcher(self.config.max_batch, self.config.max_wait_ms / 1000)
        self.slots = StreamSlots(self.config.max_streams, idle_s=self.config.stream_idle_s)
        # with several feeds (unless FORKLESS_SHARED_STREAMS=1) a stream's key is "feed:stream"
        self._feed_prefixes = [spec.name + ":" for spec in self.config.feed_specs] \
            if self.config.stream_keys_by_feed else None
        self.engine: Engine | None = None  # the device state's owner, made by compile()
        self._io_factory = functools.partial(io_factory, on_connect=on_connect) \
            if io_factory is _io_thread and on_connect is not None else io_factory
        self._io: IOSide | None = None
        self._side: Any = None  # io_loop.bridge.MainSide once started
        self._inbound_closed = False
        self._pulled = 0  # chunks taken from inbound so far (process_pending's bound)
        self.abandoned_io = False
        self._logged_non_finite = False  # True if the IO thread still ran when stop() gave up on it
        self._stop_requested = threading.Event()
        self._started = False
        self._stopped = False
        self._logged_failures: set[str] = set()
        self._host = ProcessSettings(switch_interval_s=SWITCH_INTERVAL_S, freeze_gc=freeze_gc)
        self._signals = StopSignals(self._on_signal)
        self._aborting = False  # a second SIGINT: run() raises KeyboardInterrupt
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
        # a checkpoint that does not fit is refused before the compile (CheckpointMismatch)
        restored = self._load_checkpoint() if self.checkpointer and self.config.checkpoint_restore == "auto" else None
        self.compile()
        if self.checkpointer is not None:
            if restored is not None:
                self._restore(restored)
            self.checkpointer.start()
        self._host.apply()
        extra = {"positions": self._restored_positions} if self._restored_positions else {}
        try:
            self._io = self._io_factory(self.config, self.codec, self.io_stats, self.stats, **extra)
            self._side = self._io.start()
        except BaseException:  # no IO side (MetricsServerError, say): give back what apply() changed
            self._host.restore()
            if self.checkpointer is not None:
                self.checkpointer.stop(0.0)
            raise

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

    def _checkpoint_settings(self) -> dict[str, Any]:
        cfg = self.config
        return {"features": cfg.features, "max_streams": cfg.max_streams,
                "processor": getattr(self.processor, "name", None),
                "processor_version": str(getattr(self.processor, "version", "1"))}

    def _load_checkpoint(self) -> Restored | None:
        """The newest complete checkpoint, read before the compile; raises ``CheckpointMismatch``
        if it was written by another processor (name, version), with other shape-defining
        settings, or with another state structure, leaf shape or dtype."""
        # the file holds the canonical layout (row s = slot s), whatever the device count
        restored = load_newest(self.config.checkpoint_dir, self._checkpoint_settings(),
                               like=state_shapes(self.processor, self.config))
        if restored is None:
            log.info("no checkpoint in %s: starting fresh", self.config.checkpoint_dir)
        return restored

    def _restore(self, restored: Restored) -> None:
        """Put a loaded checkpoint's state on the device and its stream table in place (before
        the first connection). Shared leaves (not per-stream: weights) come from the processor's
        ``init``, unless it says ``restore_shared=True`` (state it learns online)."""
        engine = self.engine
        shared = bool(getattr(self.processor, "restore_shared", False))
        engine.restore(restored.state, shared=shared)
        leaves = engine.shared_leaves()
        log.info("per-stream state taken from the checkpoint%s", "" if not leaves else (
            f"; shared leaves {', '.join(leaves)} " + ("from it too (restore_shared=True)" if shared else
                                                       "taken from the processor's init (restore_shared=False)")))
        # last-seen times travel as wall-clock seconds (monotonic clocks differ between processes)
        shift = time.monotonic() - time.time()
        self.slots.restore(restored.names, restored.slots, np.asarray(restored.last_seen) + shift)
        main = self.main_stats
        main.processed = int(restored.counts.get("processed", 0))
        main.anomalies = int(restored.counts.get("anomalies", 0))
        # each JetStream feed goes on from the message after the one its state holds
        self._restored_positions = self.sources.restore(restored.positions, restored.path)
        self.restored_from = str(restored.path)
        log.info("restored %d streams from %s (checkpoint of %s, %d messages processed before)",
                 restored.streams, restored.path,
                 datetime.datetime.fromtimestamp(restored.wall_time).isoformat(timespec="seconds"), main.processed)

    def _take_checkpoint(self) -> PendingSnapshot:
        """The checkpoint of an orderly stop, copied at once (nothing runs after it)."""
        return self._begin_checkpoint(incremental=False).complete()

    def _begin_checkpoint(self, incremental: bool | None = None) -> PendingSnapshot:
        """A checkpoint as of now (between two steps), which ``Checkpointer.tick`` copies a
        chunk at a time between the next steps; the engine keeps it exact."""
        wall = time.time()
        main, cfg = self.main_stats, self.config
        return self.engine.begin_snapshot(
            self.slots.begin_copy(), {"processed": main.processed, "anomalies": main.anomalies},
            {**self._checkpoint_settings(), "alpha": cfg.alpha, "threshold": cfg.threshold,
             "warmup": cfg.warmup, "devices": len(self.engine.devices)}, wall, seen_shift=wall - time.monotonic(),
            incremental=self.incremental_checkpoints if incremental is None else incremental,
            positions=self.sources.record() if self.sources else None)

    def _await_replies(self, positions: dict[str, Any]) -> None:
        """On the checkpoint writer's thread, before a checkpoint with JetStream positions is
        written: wait until the results stream has acknowledged every reply to the messages at or
        below them (after a kill -9 those are not replayed, so their replies must be stored).
        Raises (the checkpoint fails, the previous one stays the newest) if that takes longer
        than ``CONFIRM_WAIT_S`` or a checkpoint interval, whichever is longer."""
        deadline = time.monotonic() + max(CONFIRM_WAIT_S, self.config.checkpoint_s)
        while True:
            io = self._io
            feeds = io.snapshot().feeds if io is not None else ()
            confirmed = {f.name: f.io.source.confirmed for f in feeds if f.io.source is not None}
            behind = SourcePositions.unconfirmed(positions, confirmed)
            if not behind:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError("replies not stored by the results stream in time: " + "; ".join(behind))
            time.sleep(CONFIRM_POLL_S)

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
        exception ``on_results`` raised during the stop (the stop goes on past it).
        """
        if not self._started or self._stopped or self._side is None:  # not started, or its start failed
            return
        self._stopped = True
        io = self._io
        self.request_stop()  # fixes the stop deadline, if a signal or the caller has not already
        deadline, work_deadline = self._stop_deadline, self._work_deadline
        io.request_stop(work_deadline)
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
            if self.checkpointer is not None and not self.checkpointer.stop(max(0.0, deadline - time.monotonic())):
                log.error("the checkpoint of the stop was not written within FORKLESS_SHUTDOWN_TIMEOUT_S=%s",
                          self.config.shutdown_timeout_s)
        finally:
            self._host.restore()

    def _drain_inbound(self) -> int:
        """Take what is still queued inbound (at the stop deadline); how many messages it held."""
        left = 0
        while not self._inbound_closed:
            try:
                left += len(self._side.inbound.get_nowait())
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
            self._host.restore()  # also when the IO thread failed and stop() never ran
            self._signals.restore()

    def process_pending(self, timeout: float = 0.0) -> int:
        """Process what is waiting (waiting up to ``timeout`` for a first message); returns
        how many messages were processed. Raises if the IO thread has failed.

        It returns once what was queued when it was called has been processed, so a feed
        that never pauses cannot keep the caller (or ``run()``'s stop check) waiting.
        """
        if not self._started:
            raise RuntimeError("call start() (or use the controller as a context manager) first")
        self._io.raise_if_failed()
        # chunks queued now; a chunk may hold more than one batch, so chunks are counted
        target = self._pulled + (0 if self._inbound_closed else self._side.inbound.qsize())
        done = self._cycle(timeout)
        while len(self.batcher) or (self._pulled < target and not self._inbound_closed
                                    and self._side.inbound.qsize()):
            done += self._cycle(0.0, pull=self._pulled < target)
        if self.checkpointer is not None:
            self.checkpointer.tick(time.monotonic(), self._begin_checkpoint)
        return done

    def _cycle(self, timeout: float, deadline: float | None = None, *, pull: bool = True) -> int:
        """Collect one batch (blocking up to ``timeout`` for its first message) and process it;
        ``pull=False`` only takes a batch from what the batcher already holds."""
        inbound = self._side.inbound
        batcher = self.batcher
        if pull and not len(batcher) and not self._inbound_closed:
            try:
                chunk = inbound.get(timeout=timeout) if timeout > 0 else inbound.get_nowait()
                self._pulled += 1
                if chunk.trace is not None:
                    chunk.trace.ns[TAKEN] = time.monotonic_ns()
                batcher.add(chunk, time.monotonic())
            except Empty:
                return 0
            except janus.SyncQueueShutDown:
                self._inbound_closed = True
        while pull and not self._inbound_closed and batcher.wants_more(time.monotonic()):
            try:
                chunk = inbound.get_nowait()
                if chunk.trace is not None:
                    chunk.trace.ns[TAKEN] = time.monotonic_ns()
                batcher.add(chunk, time.monotonic())
                self._pulled += 1
            except Empty:
                break
            except janus.SyncQueueShutDown:
                self._inbound_closed = True
        taken = batcher.take(time.monotonic())
        if taken is None:
            return 0
        self._process(taken, deadline)
        return len(taken)

    def _process(self, taken: Taken, deadline: float | None) -> None:
        """Slot, step, hand the batch's results to ``on_results``, encode, put one ``Outgoing``.

        Each message gets exactly one of: a result frame, an error frame (refused: too many
        streams; processing failed; a non-finite result; encode failed) or no frame, counted as
        ``no_reply`` (the codec's choice, or a reply declined: see ``_assemble``)."""
        stats = self.main_stats
        n = len(taken)
        keys = taken.stream
        if self._feed_prefixes is not None:  # several feeds: a stream is (feed, stream)
            prefixes = self._feed_prefixes
            keys = [prefixes[feed] + stream for feed, stream in zip(taken.feed, keys)]
        slots, ok, recycled = self.slots.lookup(keys, time.monotonic())
        if recycled:
            self._reset_slots(recycled)
        refused: dict[int, str] = {}  # message index -> error reason
        if not ok.all():
            too_many = np.flatnonzero(~ok).tolist()
            refused.update(dict.fromkeys(too_many, self._too_many))
            stats.errors["too many streams"] += len(too_many)
        traces = taken.traces
        _stamp(traces, STEP)
        if refused:
            rows: Sequence[int] = [i for i in range(n) if i not in refused]
            ran = self._run_step(taken.x[rows], slots[rows]) if rows else None
        else:  # the common case: every message runs, no copies
            rows = range(n)
            ran = self._run_step(taken.x, slots)
        _stamp(traces, FETCHED)
        host_error: BaseException | None = None
        policy = self._batch_policy(taken)  # None: feeds with different reply policies
        answered: list[str | bytes | None] = []  # one per row of ``encoded`` still to answer
        encoded: Sequence[int] = []  # the rows whose results were encoded (their feeds want results)
        are_results = False
        if rows and ran is None:
            refused.update(dict.fromkeys(rows, "processing failed"))
            rows = []
        elif rows:
            outputs, bad = ran
            if bad.any():
                rows, outputs = self._refuse_non_finite(taken, rows, outputs, bad, slots, refused)
            if isinstance(rows, range):
                seq, stream = taken.seq, taken.stream
            else:
                seq, stream = [taken.seq[i] for i in rows], [taken.stream[i] for i in rows]
            if self.on_results is not None and rows:
                try:
                    self.on_results(seq, stream, outputs)
                except BaseException as exc:
                    # the host program's own code failed: raised to the caller of run() or
                    # process_pending() once this batch's replies are handed over (not lost)
                    host_error = exc
            encoded = rows if policy != "none" else []  # "none": nothing is encoded
            if policy is None:  # feeds with different policies: encode only for those that want results
                encoded = [i for i in rows if self._policies[taken.feed[i]] != "none"]
                if len(encoded) < len(rows):
                    keep = [j for j, i in enumerate(rows) if self._policies[taken.feed[i]] != "none"]
                    seq, stream = [seq[j] for j in keep], [stream[j] for j in keep]
                    outputs = {k: v[keep] for k, v in outputs.items()}
            if encoded:
                answered, are_results = self.codec.encode_batch(seq, stream, outputs, errors=policy != "results")
                if not are_results:
                    stats.errors["encode failed"] += len(encoded)
        _stamp(traces, ENCODED)
        stats.batches += 1
        stats.batch_size.observe(n)
        frames, received, error_at, origin = self._assemble(taken, rows, encoded, answered, are_results, refused,
                                                            policy)
        handed = time.monotonic_ns()  # results handed over: on_results has returned, the frames are made
        for trace in traces:
            trace.ns[OUTBOUND] = handed
        if rows:
            self._observe_latency(taken, rows, handed)
        # JetStream feeds: each reply carries its message's origin (its id), and the feed's position moves
        sources = None if taken.origin is None else [taken.origin[i] for i in origin]
        if not frames:
            self._end_traces(traces)  # nothing goes to the IO thread: the sampled messages end here
        elif not taken.feeds_mixed:
            self._put_outbound(Outgoing(frames, received, error_at, feed=taken.feed[0], traces=traces,
                                        origin=sources), deadline)
        else:  # several feeds in one batch: each feed's replies go back on its own connection
            parts = _split_by_feed(frames, received, error_at, [taken.feed[i] for i in origin], traces, sources)
            sent = {part.feed for part in parts}
            self._end_traces([trace for trace in traces if trace.feed not in sent])
            self._put_outbound(parts[0] if len(parts) == 1 else Outgoing([], parts=tuple(parts)), deadline)
        if sources is not None:
            self.sources.after_batch(taken.feed, taken.origin, sources, [taken.feed[i] for i in origin])
        if host_error is not None:
            raise host_error

    def _refuse_non_finite(self, taken: Taken, rows: Sequence[int], outputs: dict[str, np.ndarray],
                           bad: np.ndarray, slots: np.ndarray, refused: dict[int, str]) -> tuple[list, dict]:
        """Messages whose outputs or stream state came out non-finite are answered with an
        error, and those streams' rows are reset, so each starts again like a new stream.
        Counted and logged once."""
        stats = self.main_stats
        bad_rows = [rows[j] for j in np.flatnonzero(bad).tolist()]
        refused.update(dict.fromkeys(bad_rows, NON_FINITE_REASON))
        stats.errors["non-finite result"] += len(bad_rows)
        streams = {int(slots[i]) for i in bad_rows}
        self._reset_slots(sorted(streams))
        stats.resets["stream reset: non-finite"] += len(streams)
        if not self._logged_non_finite:
            self._logged_non_finite = True
            log.error("the step produced non-finite values for stream %r (and %d more this batch): its state "
                      "was reset and it starts again like a new stream (logged once; counted in resets)",
                      taken.stream[bad_rows[0]], len(streams) - 1)
        keep = np.flatnonzero(~bad)
        return [rows[j] for j in keep.tolist()], {k: v[keep] for k, v in outputs.items()}

    def _batch_policy(self, taken: Taken) -> str | None:
        """The reply policy of every message of the batch, or None when its feeds' policies differ."""
        if self._policy is not None:
            return self._policy
        if not taken.feeds_mixed:
            return self._policies[taken.feed[0]]
        policies = {self._policies[feed] for feed in set(taken.feed)}
        return policies.pop() if len(policies) == 1 else None

    def _assemble(self, taken: Taken, rows: Sequence[int], encoded: Sequence[int], answered: list,
                  are_results: bool, refused: dict[int, str],
                  policy: str | None) -> tuple[list, list[int], tuple[int, ...], Sequence[int]]:
        """The batch's frames in arrival order, their messages' receive times, the positions
        of the error frames, and each frame's message (its index in ``taken``). ``rows``: the
        messages with results; ``encoded``: those encoded, ``answered`` holding one frame (or
        None) each; ``policy``: the batch's reply policy (None: each message's feed's). A message
        the codec answered with None gets no frame (``no_reply``); one whose reply the policy or
        ``encode_error`` declines gets none either (``no_reply`` and ``replies_declined``)."""
        if (policy == "all" or (policy == "results" and are_results)) and not refused and None not in answered:
            # the common case: one reply per message
            return (answered, taken.received_ns, () if are_results else tuple(range(len(answered))),
                    range(len(answered)))
        if policy == "none":  # nothing goes back and nothing was encoded: every message declined
            if rows:
                self._decline("result", len(rows), policy)
            for reason, count in Counter(refused.values()).items():
                self._decline(self._counted_as.get(reason, reason), count, policy)
            return [], [], (), []
        reply = dict(zip(encoded, answered))
        policies = self._policies
        frames, received, error_at, origin = [], [], [], []
        for i in range(len(taken)):
            replies = policy or policies[taken.feed[i]]
            reason = refused.get(i)
            if reason is not None:
                frame = self.codec.encode_error(reason, taken.seq[i]) if replies == "all" else None
                if frame is None:
                    self._decline(self._counted_as.get(reason, reason), 1, replies)
                    continue
                error_at.append(len(frames))
            elif i not in reply:  # not encoded: its feed's replies are "none"
                self._decline("result", 1, replies)
                continue
            else:
                frame = reply[i]
                if not are_results and (frame is None or replies != "all"):  # an "encode failed" error reply
                    self._decline(ENCODE_FAILED, 1, replies)
                    continue
                if frame is None:
                    self.main_stats.no_reply += 1  # the codec's choice
                    continue
                if not are_results:
                    error_at.append(len(frames))
            frames.append(frame)
            received.append(taken.received_ns[i])
            origin.append(i)
        return frames, received, tuple(error_at), origin

    def _decline(self, reason: str, count: int, replies: str) -> None:
        """``count`` messages get no frame, by the feed's reply policy (``replies``) or, under
        ``all``, because ``encode_error`` returned None: counted, each reason logged once."""
        stats = self.main_stats
        stats.no_reply += count
        stats.replies_declined[reason] += count
        if reason not in self._declined_logged and len(self._declined_logged) < MAX_LOGGED_REASONS:
            self._declined_logged.add(reason)
            why = f"the feed's replies are {replies!r}" if replies != "all" else \
                "the codec's encode_error returned None"
            what = "results are" if reason == "result" else f"error replies for {reason!r} are"
            log.info("%s not sent (%s); counted in replies_declined and no_reply, logged once per reason", what, why)

    def _observe_latency(self, taken: Taken, rows: Sequence[int], handed_ns: int) -> None:
        """``latency``: receipt -> results handed over, for each message of ``rows``; one
        observation per chunk (its messages share a receipt time), not per message."""
        if isinstance(rows, range):
            received, feeds = taken.received_ns, taken.feed
        else:
            received, feeds = [taken.received_ns[i] for i in rows], [taken.feed[i] for i in rows]
        latency = self.main_stats.latency
        if not taken.feeds_mixed:
            histogram = latency[taken.feed[0]]
            for arrived, count in Counter(received).items():
                histogram.observe_each((handed_ns - arrived) * 1e-9, count)
        else:
            for (feed, arrived), count in Counter(zip(feeds, received)).items():
                latency[feed].observe_each((handed_ns - arrived) * 1e-9, count)

    def _end_traces(self, traces: list[Trace]) -> None:
        """Sampled messages whose batch sent their feed no frame: their trace ends at ``assemble``
        (the results handed over), observed here on the main thread's own hop histograms."""
        for trace in traces:
            observe_hops(self.main_stats.hops, trace.hops_s(OUTBOUND))

    def _reset_slots(self, recycled: list[int]) -> None:
        """Give recycled slots a fresh stream's state (before the step that uses them)."""
        self.engine.reset(recycled)

    def _run_step(self, x: np.ndarray, key: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
        """Run the engine's step on one batch: its outputs on the host cut to the batch's
        messages, and which messages came out non-finite; None if the step failed (logged and
        counted; the engine kept the state, or replaced it if the failed step had lost it)."""
        stats = self.main_stats
        m = len(key)
        t0 = time.perf_counter()
        try:
            outputs, bad = self.engine.step(x, key)
        except StepFailed as failed:
            self._log_failure(failed.__cause__ or failed)
            stats.errors["processing failed"] += m
            if failed.state_lost:
                stats.resets["state lost with a failed step"] += 1
                log.error("the failed step had been given the state (donated): every stream starts again "
                          "from a fresh state")
            return None
        stats.step_seconds.observe(time.perf_counter() - t0)
        stats.processed += m
        anomaly = outputs.get("anomaly")
        if anomaly is not None:
            stats.anomalies += int(np.count_nonzero(anomaly[~bad] if bad.any() else anomaly))
        return outputs, bad

    def _log_failure(self, exc: BaseException) -> None:
        key = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if key in self._logged_failures:
            log.warning("processing failed again: %s", key[:200])
            return
        self._logged_failures.add(key)
        log.error("processing failed; the batch is answered with errors and the state is kept:\n%s",
                  "".join(traceback.format_exception(exc)))

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
        main = self.main_stats
        io = self._io.snapshot() if self._io is not None else self.io_stats.snapshot()
        at_ready = main.compilations_at_ready
        errors = _merged(io.errors, copy_counts(main.errors))
        feed_latency = [histogram.snapshot() for histogram in main.latency]
        latency = feed_latency[0]
        for more in feed_latency[1:]:
            latency = latency + more
        engine = self.engine
        compiled = engine is not None
        return StatsSnapshot(
            at=time.monotonic(),
            messages_in=io.messages_in,
            frames_in=io.frames_in,
            messages_out=io.results_out,
            errors_out=io.errors_out,
            processed=main.processed,
            anomalies=main.anomalies,
            batches=main.batches,
            errors=errors,
            dropped=_merged(io.dropped, copy_counts(main.dropped)),
            connects=io.connects,
            reconnects=io.reconnects,
            connect_failures=io.connect_failures,
            connected=io.connected,
            connection_since=io.state_since,
            inbound_depth=io.inbound_depth,
            outbound_depth=io.outbound_depth,
            unsent=io.unsent,
            batch_size=main.batch_size.snapshot(),
            latency=latency,
            write_latency=io.write_latency,
            feed_latency=tuple(feed_latency),
            replies_declined=_merged(io.replies_declined, copy_counts(main.replies_declined)),
            loop_lag=io.loop_lag,
            step_seconds=main.step_seconds.snapshot(),
            compilations=compilations(),
            compilations_after_warmup=None if at_ready is None else compilations() - at_ready,
            devices=engine.devices if engine is not None else (),
            device_messages=tuple(int(v) for v in engine.device_messages) if engine is not None else (),
            device_rows=engine.device_rows if engine is not None else 0,
            ready=compiled and io.connected,
            compiled=compiled,
            no_reply=main.no_reply,
            resets=copy_counts(main.resets),
            streams_active=len(self.slots),
            streams_evicted=self.slots.evicted,
            **(self.checkpointer.stats_fields() if self.checkpointer is not None else {}),
            answer_errors_out=io.answer_errors_out,
            written_unconfirmed=io.written_unconfirmed,
            last_error=io.last_error,
            feeds=io.feeds,
            hops=add_hops(io.hops, {hop: histogram.snapshot() for hop, histogram in main.hops.items()}),
            sources=self._source_figures(io) if self.sources else (),
        )

    def _source_figures(self, io: IOSnapshot) -> tuple[SourceFigures, ...]:
        """Each JetStream feed's figures: the IO side's fetching and confirmations, the main thread's position."""
        out = []
        for feed in io.feeds:
            src = feed.io.source
            if src is None:
                continue
            index = next(i for i, spec in self.sources.specs.items() if spec.name == feed.name)
            applied = self.sources.consumed.get(index)
            applied_seq = 0 if applied is None else applied.seq - (0 if applied.last else 1)
            out.append(SourceFigures(feed.name, src.fetched, self.sources.applied.get(index, 0), applied_seq,
                                     src.confirmed[0], src.stream_last_seq, src.skipped, src.duplicates))
        return tuple(out)

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


def _split_by_feed(frames: list, received: list[int], error_at: tuple[int, ...],
                   feeds: list[int], traces: list[Trace], origin: list | None = None) -> list[Outgoing]:
    """One ``Outgoing`` per feed, each keeping its frames' order (``feeds``: each frame's feed),
    the sampled messages' traces of that feed and, from JetStream feeds, each frame's ``origin``."""
    errors = set(error_at)
    by_feed: dict[int, list[int]] = {}
    for j, feed in enumerate(feeds):
        by_feed.setdefault(feed, []).append(j)
    return [Outgoing([frames[j] for j in picked], [received[j] for j in picked],
                     tuple(k for k, j in enumerate(picked) if j in errors), feed=feed,
                     traces=[trace for trace in traces if trace.feed == feed],
                     origin=None if origin is None else [origin[j] for j in picked])
            for feed, picked in by_feed.items()]


def _stamp(traces: list[Trace], stamp: int) -> None:
    """Stamp the batch's sampled messages (the latency budget, batching.HOPS)."""
    if traces:
        now = time.monotonic_ns()
        for trace in traces:
            trace.ns[stamp] = now


def _merged(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    out = dict(a)
    for reason, count in b.items():
        out[reason] = out.get(reason, 0) + count
    return out


def _print_line(line: str) -> None:
    print(line, flush=True)
