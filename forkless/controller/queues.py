"""The main thread's ends of the two queues: what it takes from *inbound* and puts on *outbound*.

Rules:
- Main thread only (``StopDeadline.fix`` also from a signal handler or another thread).
- ``Intake`` takes chunks from *inbound* into the micro-batcher and hands a source's events to ``on_event`` at
  once, in order. Once a batch has begun it never waits on an empty queue: a batch is topped up only from what
  already waits. ``pending`` (``process_pending``) ends once what was queued when it was called is processed,
  however fast the feed produces; the orderly stop's batches (``finish``) run until *inbound* is drained or the
  work deadline passes, then every step in flight is finished.
- Steps in flight (controller/inflight.py): a step that is done is handed over before the next batch is
  collected. The next batch is dispatched once closed (full, or ``max_wait_s`` old: the batcher's rule), never cut
  early to queue behind the running step (bench/docs/steps-in-flight.md); meanwhile the oldest step is looked at
  every ``READY_POLL_S``.
- How it waits (``WaitSettings``, FORKLESS_HANDOFF): it blocks on *inbound*. With steps in flight, under ``park``
  it polls the oldest step; under ``spin`` it blocks on it while the IO loop spins, as under one GIL two spinners
  take the GIL from each other (docs/performance.md). Without a GIL it spins too, for ``spin_s`` after its last
  work.
- ``Outlet.put`` waits while *outbound* is full, checking the IO side's health every ``POLL_S``, and once a stop
  was requested only until the work deadline: what is unput then is dropped ("outbound full at stop"). An item
  the IO side can no longer take is dropped ("IO side ended") and the IO side's failure raised.
- ``StopDeadline`` is fixed once, by the first request (a planned stop is a request at its time); processing and
  sending end ``STOP_RESERVE_S`` before it, so the IO thread can end and the process exit by it whatever the
  socket does.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from queue import Empty, Full
from typing import Any

import janus

from forkless.controller.batching import MicroBatcher, Taken
from forkless.controller.inflight import StepsInFlight
from forkless.controller.stats import MainStats
from forkless.io_loop.crossing import TAKEN, Chunk, Events, Outgoing, count_unsent
from forkless.io_loop.waiting import PARK, WaitSettings, pause, spin

__all__ = ["POLL_S", "READY_POLL_S", "STOP_RESERVE_S", "Intake", "Outlet", "StopDeadline"]

log = logging.getLogger("forkless.controller")

POLL_S = 0.1
READY_POLL_S = 0.0001  # with steps in flight and nothing waiting: how often the oldest is looked at
STOP_RESERVE_S = 0.5  # of SHUTDOWN_TIMEOUT_S (at most a third), kept for ending the threads and the process
IO_ENDED_REASON = "IO side ended"  # dropped: replies the IO side ended before taking


class StopDeadline:
    """When the stop must be over (``at``) and when processing and sending end (``work``), both
    ``time.monotonic()`` seconds; None until the stop is requested: ``fix`` (a request now) or
    the time given to ``plan`` (a request then: the run's duration) passed."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._at: float | None = None
        self._work: float | None = None
        self._planned = math.inf

    def plan(self, when: float) -> None:
        """A stop requested at ``when`` (monotonic seconds) unless one is requested before (the run's
        duration): every wait that reads the deadline (a put to a full outbound, a backlog's work)
        ends by it whatever the thread it runs on is doing, as it would for ``fix`` called then."""
        self._planned = when

    def fix(self) -> None:
        """Fix both deadlines from now (or from the planned stop, if that was earlier), unless an
        earlier request did."""
        self._fix(min(time.monotonic(), self._planned))

    def _fix(self, requested_at: float) -> None:
        if self._at is None:
            timeout = self.timeout_s
            at = requested_at + timeout
            self._work = at - min(STOP_RESERVE_S, timeout / 3)
            self._at = at  # last: a reader that sees ``at`` sees ``work`` too

    @property
    def at(self) -> float | None:
        if self._at is None and time.monotonic() >= self._planned:
            self._fix(self._planned)
        return self._at

    @property
    def work(self) -> float | None:
        return None if self.at is None else self._work

    @property
    def requested(self) -> bool:
        """A stop was requested (``fix``), or the planned one is due."""
        return self.at is not None


class Intake:
    """*inbound*'s sync side as the main thread reads it (see the module rules): each batch
    collected is handed to ``step(taken, deadline)`` (controller/batchstep.py's ``BatchStep``)."""

    def __init__(self, inbound: Any, batcher: MicroBatcher, stats: MainStats,
                 step: Callable[[Taken, float | None], None], *, names: Sequence[str],
                 on_event: Callable[[], Callable[[str, Any], None] | None],
                 wait: WaitSettings = PARK, stop: StopDeadline | None = None) -> None:
        self.inbound = inbound
        self.wait = wait
        self._stop = stop if stop is not None else StopDeadline(math.inf)  # never requested: nothing ends pending
        self.batcher = batcher
        self.stats = stats
        self._step = step
        # the steps in flight (controller/inflight.py), when the step is a StepsInFlight
        self.flight: StepsInFlight | None = step if isinstance(step, StepsInFlight) else None
        self.names = names  # each feed's name, by index
        self._on_event = on_event  # the controller's on_event as it is now (None: none)
        self._logged_unhandled_event = False
        self.closed = False  # inbound is shut down and drained
        # process_pending's bound: chunks taken from inbound so far, and messages; the messages
        # added to the batcher up to the call's last chunk (``_owed``) and the messages taken
        self._pulled = 0
        self._pull_target = 0
        self._added = self._owed = self._taken = 0
        self._spin_until = 0.0  # without a GIL: it spins until then (its last work plus spin_s), then blocks

    def pending(self, timeout: float, settle: bool = True) -> int:
        """``process_pending``'s work: batches until what was queued when it was called has been
        processed (waiting up to ``timeout`` for a first message); how many messages. A chunk may
        hold more than one batch, so chunks are counted, and the messages they hold once pulled
        (``_owed``; what the batcher holds is owed too). ``settle``: every step in flight is
        finished before it returns (else they may stay in flight until the next call). Once the stop
        is requested it returns after the batch in hand: the stop's own work (``finish``) takes the
        rest, bounded by its deadline, which a backlog worked through here would overrun."""
        inbound, stop = self.inbound, self._stop
        target = self._pull_target = self._pulled + (0 if self.closed else inbound.qsize())
        self._owed = self._added
        done = self.cycle(timeout, stop.work)
        while (self._taken < self._owed or (self._pulled < target and not self.closed and inbound.qsize())) \
                and not stop.requested:
            done += self.cycle(0.0)
        if settle and self.flight is not None:
            self.flight.settle()
        return done

    def settle(self) -> None:
        """Finish every step in flight (before a checkpoint, at the end of ``pending``)."""
        if self.flight is not None:
            self.flight.settle()

    def finish(self, work_deadline: float, failed: Callable[[], bool]) -> Exception | None:
        """An orderly stop's batches: until inbound is shut down and drained, the work deadline
        passes or ``failed()`` (the IO side's); the first exception a batch raised meanwhile (its
        replies were handed over: the stop goes on past it)."""
        raised: Exception | None = None
        while (not self.closed or len(self.batcher)) and time.monotonic() < work_deadline:
            if failed():
                break
            try:
                self.cycle(POLL_S, deadline=work_deadline)
            except Exception as exc:
                raised = raised or exc
        if self.flight is not None:  # what was dispatched is answered, whatever ended the loop
            raised = raised or self.flight.settle_all(work_deadline)
        return raised

    def cycle(self, timeout: float, deadline: float | None = None) -> int:
        """Collect one batch and step it; how many messages it held. With steps in flight, a
        step that is done is finished instead (0), and while nothing is waiting the oldest is
        awaited instead of the first message (the module rules)."""
        flight, batcher, wait = self.flight, self.batcher, self.wait
        while flight is not None and len(flight):
            if flight.oldest_ready() or self.closed:
                flight.finish_oldest(deadline)
                self._worked()
                return 0
            if len(batcher) and not self._top_up(deadline):  # closed: full, or collected for max_wait
                taken = self.collect(0.0, deadline)
                if taken is not None:
                    self._step(taken, deadline)
                    self._worked()
                    return len(taken)
            if not wait.spins:
                self._await(READY_POLL_S)
            elif wait.both and time.monotonic() < self._spin_until:
                if not self._pull():  # no GIL to take from the IO loop: look again after a pause
                    pause(wait.nap_s)
            elif not self._pull():  # nothing waiting: block on the step (the GIL released; the IO loop spins)
                flight.finish_oldest(deadline)
                self._worked()
                return 0
        taken = self.collect(timeout, deadline)
        if taken is None:
            return 0
        self._step(taken, deadline)
        self._worked()
        return len(taken)

    def _worked(self) -> None:
        """Work was done (a step dispatched or finished): without a GIL the main thread spins for the
        next ``spin_s`` instead of blocking (the module rules)."""
        if self.wait.both:
            self._spin_until = time.monotonic() + self.wait.spin_s

    def _get(self, timeout: float) -> Chunk | Events:
        """The first item of a batch: blocking up to ``timeout`` on *inbound*; without a GIL, spinning on
        it first while work is recent (``_spin_until``), so that a put is seen without a wake-up."""
        inbound = self.inbound
        if timeout <= 0:
            return inbound.get_nowait()
        if self.wait.both:
            end = time.monotonic() + timeout
            if spin(inbound.qsize, min(end, self._spin_until), self.wait.nap_s):
                return inbound.get_nowait()
            timeout = end - time.monotonic()
            if timeout <= 0:
                raise Empty
        return inbound.get(timeout=timeout)

    def _top_up(self, deadline: float | None) -> bool:
        """The batch collecting while steps run, topped up from what is already waiting under the
        batcher's rules; whether it is still open (has room and has collected for less than
        ``max_wait_s``, and the stop's ``deadline`` has not passed)."""
        inbound, batcher = self.inbound, self.batcher
        while batcher.wants_more(now := time.monotonic()) and (deadline is None or now < deadline):
            if self.closed or not inbound.qsize():
                return not batcher.leftover  # a full batch's rest goes out at once, as it would alone
            try:
                self._add(inbound.get_nowait())
            except Empty:
                return True
            except janus.SyncQueueShutDown:
                self.closed = True
        return False

    def _pull(self) -> bool:
        """A chunk already waiting on *inbound*, into the batcher, without waiting; whether there was one."""
        if self.closed or not self.inbound.qsize():
            return False
        try:
            self._add(self.inbound.get_nowait())
        except Empty:
            return False
        except janus.SyncQueueShutDown:
            self.closed = True
        return True

    def _await(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a chunk on *inbound*, into the batcher."""
        try:
            self._add(self.inbound.get(timeout=timeout))
        except Empty:
            pass
        except janus.SyncQueueShutDown:
            self.closed = True

    def collect(self, timeout: float, deadline: float | None = None) -> Taken | None:
        """One batch: blocking up to ``timeout`` for its first message when the batcher is empty,
        topping up what it holds from what is already waiting (not past ``deadline``, the stop's:
        a slow ``on_event`` does not take the events queued behind it past it); None if there is none."""
        inbound, batcher = self.inbound, self.batcher
        if not len(batcher) and not self.closed:
            try:
                self._add(self._get(timeout))
            except Empty:
                return None
            except janus.SyncQueueShutDown:
                self.closed = True
        # qsize() first (no lock): an empty queue's get_nowait raises, which costs more than the look
        while (not self.closed and inbound.qsize() and batcher.wants_more(now := time.monotonic())
               and (deadline is None or now < deadline)):
            try:
                self._add(inbound.get_nowait())
            except Empty:
                break
            except janus.SyncQueueShutDown:
                self.closed = True
        taken = batcher.take()
        if taken is not None:
            self._taken += len(taken)
        return taken

    def _add(self, chunk: Chunk | Events) -> None:
        """A chunk taken from inbound, into the batcher (and counted for ``owed``); a user
        source's events go to ``on_event`` at once."""
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

    def _deliver(self, events: Events) -> None:
        """A user source's events, in order, to ``on_event``; without one they are counted."""
        stats = self.stats
        on_event = self._on_event()
        name = self.names[events.feed]
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

    def drain(self) -> int:
        """Take what is still queued (at the stop deadline); how many messages it, the batcher and
        the steps still in flight (forgotten unanswered) held (events left are counted in
        ``events_unhandled``)."""
        left, events = len(self.batcher) + (self.flight.discard() if self.flight is not None else 0), 0
        while not self.closed:
            try:
                item = self.inbound.get_nowait()
                if type(item) is Events:
                    events += len(item.items)
                left += len(item)
            except Empty:
                break
            except janus.SyncQueueShutDown:
                self.closed = True
        if events:  # a source's replies handed over through the stop (docs/embedding/stop.md), say
            self.stats.events_unhandled += events
            log.error("%d events were not delivered to on_event before the stop deadline: counted in "
                      "events_unhandled", events)
        return left


class Outlet:
    """*outbound*'s sync side as the main thread writes it (see the module rules); ``io``: the
    IO side, whose failure is raised while a put waits."""

    def __init__(self, outbound: Any, io: Any, stats: MainStats, deadline: StopDeadline) -> None:
        self.outbound = outbound
        self.io = io
        self.stats = stats
        self.deadline = deadline

    def put(self, item: Outgoing, deadline: float | None = None) -> None:
        """Hand replies to the IO thread, waiting while ``outbound`` is full: until ``deadline``,
        or the stop's work deadline once a stop was requested, else for as long as it takes."""
        outbound = self.outbound
        while True:
            if deadline is None:
                deadline = self.deadline.work
            wait = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            try:
                if wait > 0:
                    outbound.put(item, timeout=wait)
                else:
                    outbound.put_nowait(item)
                return
            except Full:
                self._raise_if_failed(item)
                if deadline is not None and time.monotonic() >= deadline:
                    self.stats.dropped["outbound full at stop"] += item.frame_count
                    self._count_sink_results(item)
                    log.error("%d replies dropped: the outbound queue stayed full until the stop deadline",
                              item.frame_count)
                    return

            except janus.SyncQueueShutDown:  # the IO side ended and shut outbound: it takes nothing more
                self._count_unput(item)
                self.io.join(self.deadline.timeout_s)  # its failure is kept once its loop has ended
                self.io.raise_if_failed()
                return  # no failure: it was aborted (a second SIGINT), which the caller raises

    def _raise_if_failed(self, item: Outgoing) -> None:
        """The IO side's failure raised, ``item`` (never put) counted first."""
        if self.io.failure is not None:
            self._count_unput(item)
            self.io.raise_if_failed()

    def _count_unput(self, item: Outgoing) -> None:
        """Replies the IO side will never take: those answering messages counted as dropped."""
        self._count_sink_results(item)
        answers = count_unsent([(item, 0)]).answers
        if answers:
            self.stats.dropped[IO_ENDED_REASON] += answers
            log.error("%d replies dropped: the IO side ended before taking them", answers)

    def _count_sink_results(self, item: Outgoing) -> None:
        """The results ``item`` carried for the controller's sinks, which will never reach them: counted, logged."""
        if item.for_sinks is not None:
            self.stats.sink_results_unsent += len(item.for_sinks)
            log.error("%d results for the sinks were not handed to the IO side before the stop", len(item.for_sinks))

    def shutdown(self) -> None:
        """No more puts: the IO thread sends what is queued, then ends (io_loop/bridge.py)."""
        self.outbound.shutdown()
