"""BatchStep: one taken batch, from its messages to its results handed over and its replies put.

Rules:
- Main thread only, no threads or queues of its own: what it makes goes to ``put`` (the outbound put; a test's
  list), so it runs and is tested without an IO side.
- Each message gets exactly one of: a result frame, an error frame (too many streams, processing failed, a
  non-finite result, encode failed) or no frame, counted as ``no_reply``; each feed's reply policy is
  controller/replies.py's. Replies keep arrival order.
- A batch's order: ``begin`` slots its streams (recycled slots reset first) and dispatches its step through the
  engine; ``end``, in the order begun, takes its results to the host, counts the declared counters over finite
  rows, refuses non-finite rows and resets their streams, calls ``on_results``, encodes, stamps ``OUTBOUND``, puts
  the one ``Outgoing`` (carrying the results for the IO-side sinks, ``to_sinks``) and moves the replayable feeds'
  positions. What ``on_results`` raised is raised once the batch's replies are put.
- A step that raises answers its batch with "processing failed" (the engine kept or replaced the state); the
  traceback is logged once per distinct error, a non-finite result once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from forkless.controller.batching import Taken
from forkless.controller.checkpoints.positions import SourcePositions
from forkless.controller.declared import count
from forkless.controller.engine import Engine, Pending, StepFailed
from forkless.controller.replies import NON_FINITE_REASON, Replies
from forkless.controller.slots import StreamSlots
from forkless.controller.stats import MainStats
from forkless.io_loop.crossing import ENCODED, FETCHED, OUTBOUND, STEP, Outgoing, Results, Trace

__all__ = ["BatchStep", "Begun", "Put"]

log = logging.getLogger("forkless.controller")

Put = Callable[[Outgoing, float | None], None]
"""``put(item, deadline)``: hand one batch's ``Outgoing`` to the IO side (``deadline``: the stop's
work deadline, or None)."""


@dataclass(eq=False)
class Begun:
    """One batch begun (``BatchStep.begin``): its messages, their slots, those refused, the rows
    stepped, the engine's pending step (None: nothing to step), and when it began."""

    taken: Taken
    slots: np.ndarray
    refused: dict[int, str]
    rows: Sequence[int]
    pending: Pending | None
    t0: float
    io_cpu_0: float

    def __len__(self) -> int:
        return len(self.taken)


class BatchStep:
    """A batch taken from the micro-batcher, stepped, answered and counted (see the module rules).

    ``on_results(seq, stream, outputs)`` gets every batch that has results; ``feed_prefixes``:
    with several feeds (unless their streams are shared) a stream's key is "feed:stream";
    ``io_cpu``: the IO thread's CPU clock, read around each step (None: not known); ``counters``:
    the processor's declared counters (controller/declared.py), each summed into ``stats.counters``."""

    def __init__(self, engine: Engine, slots: StreamSlots, replies: Replies, positions: SourcePositions,
                 stats: MainStats, *, put: Put, on_results: Callable[[list, list, dict], None],
                 feed_prefixes: Sequence[str] | None = None, io_cpu: Callable[[], float] | None = None,
                 counters: Mapping[str, str] | None = None, to_sinks: bool = False) -> None:
        self.engine = engine
        self.slots = slots
        self.replies = replies
        self.positions = positions
        self.stats = stats
        self._put = put
        self._on_results = on_results
        self._feed_prefixes = feed_prefixes
        self._keys: list[dict[str, str]] = [{} for _ in feed_prefixes or ()]  # per feed: stream -> its key
        self._io_cpu = io_cpu
        self._counters = dict(counters or {})
        self._to_sinks = to_sinks  # each batch's results ride on its Outgoing to the controller's sinks
        self._logged_failures: set[str] = set()
        self._logged_non_finite = False
        self._io_cpu_counted = 0.0  # the IO thread's CPU clock when the last step ended

    def __call__(self, taken: Taken, deadline: float | None = None) -> None:
        """Slot, step, hand the results to ``on_results``, encode, put one ``Outgoing``."""
        self.end(self.begin(taken), deadline)

    def begin(self, taken: Taken) -> Begun:
        """Slot the batch's streams and dispatch its step (not waiting for it); ``end`` it, in
        the order begun, for the rest. Several may be begun before the first is ended (steps
        in flight, controller/inflight.py)."""
        n = len(taken)
        slots, refused = self._slot(taken)
        _stamp(taken.traces, STEP)
        io_cpu = self._io_cpu
        begun = Begun(taken, slots, refused, range(n), None, time.perf_counter(),
                      io_cpu() if io_cpu is not None else 0.0)
        if refused:
            begun.rows = [i for i in range(n) if i not in refused]
            if begun.rows:
                begun.pending = self.engine.dispatch(taken.x[begun.rows], slots[begun.rows])
        else:  # the common case: every message runs, no copies
            begun.pending = self.engine.dispatch(taken.x, slots)
        return begun

    def ready(self, begun: Begun) -> bool:
        """Whether ``end(begun)`` would not wait for the device."""
        return begun.pending is None or self.engine.ready(begun.pending)

    def end(self, begun: Begun, deadline: float | None = None) -> None:
        """The begun batch's results: refusals, ``on_results``, encoding, the one ``Outgoing`` put,
        the positions moved. What ``on_results`` raised is raised once the replies are put."""
        stats, replies = self.stats, self.replies
        taken, slots, refused, rows = begun.taken, begun.slots, begun.refused, begun.rows
        n = len(taken)
        ran = self._finish_step(begun) if begun.pending is not None else None
        _stamp(taken.traces, FETCHED)
        host_error: BaseException | None = None
        policy = replies.policy_of(taken)  # None: feeds with different reply policies
        answered: list[str | bytes | None] = []  # one per row of ``encoded`` still to answer
        encoded: Sequence[int] = []  # the rows whose results were encoded (their feeds want results)
        are_results = False
        results: Results | None = None  # for the controller's sinks
        if rows and ran is None:
            refused.update(dict.fromkeys(rows, "processing failed"))
            rows = []
        elif rows and ran is not None:  # (rows without a step: refused above)
            outputs, bad = ran
            if bad.any():
                rows, outputs = self._refuse_non_finite(taken, rows, outputs, bad, slots, refused)
            seq, stream = (taken.seq, taken.stream) if isinstance(rows, range) else \
                ([taken.seq[i] for i in rows], [taken.stream[i] for i in rows])
            if rows:
                try:
                    self._on_results(seq, stream, outputs)
                except BaseException as exc:
                    # the host program's own code failed: raised to the caller of run() or
                    # process_pending() once this batch's replies are handed over (not lost)
                    host_error = exc
                if self._to_sinks:
                    feeds = taken.feed if isinstance(rows, range) else [taken.feed[i] for i in rows]
                    results = Results(list(feeds), seq, stream, outputs)
            encoded, answered, are_results = replies.encode(taken, rows, seq, stream, outputs, policy)
        _stamp(taken.traces, ENCODED)
        stats.batches += 1
        stats.batch_size.observe(n)
        self._hand_over(taken, rows, encoded, answered, are_results, refused, policy, deadline, results)
        if host_error is not None:
            raise host_error

    def _slot(self, taken: Taken) -> tuple[np.ndarray, dict[int, str]]:
        """Each message's state slot (recycled slots reset first), and the messages refused (too many streams)."""
        keys = taken.stream
        if self._feed_prefixes is not None:  # several feeds: a stream is (feed, stream)
            keys = self._stream_keys(taken, self._feed_prefixes)
        slots, ok, recycled = self.slots.lookup(keys, time.monotonic())
        if recycled:
            self.engine.reset(recycled)
        refused: dict[int, str] = {}  # message index -> error reason
        if not ok.all():
            too_many = np.flatnonzero(~ok).tolist()
            refused.update(dict.fromkeys(too_many, self.replies.too_many))
            self.stats.errors["too many streams"] += len(too_many)
        return slots, refused

    def _stream_keys(self, taken: Taken, prefixes: Sequence[str]) -> list[str]:
        """Each message's slot key, "feed:stream", made once per stream of a feed and then found
        in that feed's dict (cleared once it holds more names than the table has slots), in C
        loops: one per run of the batch's messages from one feed."""
        stream, keys, start = taken.stream, [], 0
        runs = taken.runs if taken.feeds_mixed else taken.runs[-1:]  # unmixed: one run, the whole batch
        for i, (end, feed, _) in enumerate(runs):
            if i + 1 < len(runs) and runs[i + 1][1] == feed:
                continue  # the next piece is of the same feed: one run
            names = stream if start == 0 and end == len(stream) else stream[start:end]
            cache = self._keys[feed]
            try:
                keys += list(map(cache.__getitem__, names))
            except KeyError:  # a stream not seen yet (or since the dict was cleared)
                if len(cache) >= self.slots.max_streams:
                    cache.clear()
                prefix = prefixes[feed]
                keys += [cache.get(name) or cache.setdefault(name, prefix + name) for name in names]
            start = end
        return keys

    def _hand_over(self, taken: Taken, rows: Sequence[int], encoded: Sequence[int], answered: list,
                   are_results: bool, refused: dict[int, str], policy: str | None, deadline: float | None,
                   results: Results | None = None) -> None:
        """The batch's frames in arrival order, stamped and put as one item; its latency; the positions moved."""
        replies = self.replies
        frames, received, error_at, origin = replies.assemble(taken, rows, encoded, answered, are_results, refused,
                                                              policy)
        handed = time.monotonic_ns()  # results handed over: on_results has returned, the frames are made
        for trace in taken.traces:
            trace.ns[OUTBOUND] = handed
        if rows:
            replies.observe_latency(taken, rows, handed)
        # replayable feeds: each reply carries its message's origin (its id), and the feed's position moves
        sources = None if taken.origin is None else [taken.origin[i] for i in origin]
        item = replies.outgoing(taken, frames, received, error_at, origin, sources)
        if results is not None:  # the sinks' results ride on the batch's one item (no frame: an item of its own)
            item = Outgoing([], feed=taken.first_feed, for_sinks=results) if item is None else \
                dataclasses.replace(item, for_sinks=results)
        if item is not None:
            self._put(item, deadline)
        if sources is not None and taken.origin is not None:  # (sources: made from taken.origin)
            self.positions.after_batch(taken.feed, taken.origin, sources, [taken.feed[i] for i in origin])

    def _refuse_non_finite(self, taken: Taken, rows: Sequence[int], outputs: dict[str, np.ndarray],
                           bad: np.ndarray, slots: np.ndarray, refused: dict[int, str]) -> tuple[list, dict]:
        """Messages whose outputs came out non-finite are answered with an error and their streams'
        rows reset (by the step itself with steps in flight), so each starts again like a new
        stream. Counted and logged once."""
        stats = self.stats
        bad_rows = [rows[j] for j in np.flatnonzero(bad).tolist()]
        refused.update(dict.fromkeys(bad_rows, NON_FINITE_REASON))
        stats.errors["non-finite result"] += len(bad_rows)
        streams = {int(slots[i]) for i in bad_rows}
        if not self.engine.resets_in_step:  # with steps in flight the step reset them itself (compiled.guarded)
            self.engine.reset(sorted(streams))
        stats.resets["stream reset: non-finite"] += len(streams)
        if not self._logged_non_finite:
            self._logged_non_finite = True
            log.error("the step produced non-finite values for stream %r (and %d more this batch): its state "
                      "was reset and it starts again like a new stream (logged once; counted in resets)",
                      taken.stream[bad_rows[0]], len(streams) - 1)
        keep = np.flatnonzero(~bad)
        return [rows[j] for j in keep.tolist()], {k: v[keep] for k, v in outputs.items()}

    def _finish_step(self, begun: Begun) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
        """The begun step's outputs on the host cut to the batch's messages (waiting for them),
        and which messages came out non-finite; None if the step failed (logged and counted;
        the engine kept the state, or replaced it if the failed step had lost it)."""
        stats, pending = self.stats, begun.pending
        assert pending is not None  # end() calls it for a step begun
        m = pending.m
        try:
            outputs, bad = self.engine.finish(pending)
        except StepFailed as failed:
            self._log_failure(failed.__cause__ or failed)
            stats.errors["processing failed"] += m
            if failed.state_lost:
                stats.resets["state lost with a failed step"] += 1
                log.error("the failed step had been given the state (donated): every stream starts again "
                          "from a fresh state")
            return None
        stats.step_seconds.observe(time.perf_counter() - begun.t0)
        io_cpu = self._io_cpu
        if io_cpu is not None:  # the IO thread's CPU time while steps ran: overlapping steps counted once
            now = io_cpu()
            stats.step_io_cpu_s += now - max(begun.io_cpu_0, self._io_cpu_counted)
            self._io_cpu_counted = now
        stats.processed += m
        if self._counters:  # the processor's declared counters, over the messages answered with results
            count(self._counters, outputs, ~bad if bad.any() else None, stats.counters)
        return outputs, bad

    def _log_failure(self, exc: BaseException) -> None:
        key = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if key in self._logged_failures:
            log.warning("processing failed again: %s", key[:200])
            return
        self._logged_failures.add(key)
        log.error("processing failed; the batch is answered with errors and the state is kept:\n%s",
                  "".join(traceback.format_exception(exc)))


def _stamp(traces: list[Trace], stamp: int) -> None:
    """Stamp the batch's sampled messages (the latency budget, crossing.HOPS)."""
    if traces:
        now = time.monotonic_ns()
        for trace in traces:
            trace.ns[stamp] = now
