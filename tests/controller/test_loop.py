"""The main-thread loop's own logic (controller/loop.py) against a fake IO side: no threads.

``tests/fake_io.py`` stands in for the IO thread with in-memory queues, so each test puts
``Chunk``s on ``inbound``, drives the controller and reads the ``Outgoing`` items it put on
``outbound``. ``max_wait_ms=0`` makes batching deterministic: a batch is the first chunk
waiting, never more, whatever the clock says; the rest of a chunk larger than ``max_batch`` is
topped up with the next chunk waiting (controller/batching.py: a leftover begins collecting
with the first chunk added to it).
Every controller with the same processor and shapes reuses one compilation.
"""

from __future__ import annotations

import gc
import json
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from forkless import OnResults, Runtime
from forkless.controller.config import Config
from forkless.controller.device.compiled import compilations
from forkless.controller.loop import Controller
from forkless.controller.processor import Processor, default_processor
from forkless.io_loop.crossing import Chunk, Outgoing
from forkless.io_loop.errors import FeedFatal
from forkless.io_loop.gil import gil_status
from tests.fake_io import EndlessQueue, FakeIO, FakeQueue, drain
from tests.reference import EWMAReference

F = 2
CONFIG = Config(features=F, max_batch=4, max_streams=8, max_wait_ms=0.0, status_s=0.0)
PROCESSOR = default_processor(CONFIG)  # one object, so every controller below reuses its compilation


def chunk(seqs: Sequence[int], streams: Sequence[str], xs: Sequence[Sequence[float]] | None = None,
          received_ns: int = 0) -> Chunk:
    if xs is None:
        xs = [[float(s), 0.5] for s in seqs]
    return Chunk(list(seqs), list(streams), np.array(xs, np.float32).reshape(len(seqs), F), received_ns)


def started(fake: FakeIO, config: Config = CONFIG, processor: Processor = PROCESSOR) -> Controller:
    ctl = Controller(config, processor=processor, runtime=Runtime(io_factory=fake))
    ctl.start()
    return ctl


def process_all(ctl: Controller) -> int:
    """Call ``process_pending`` until a call finds nothing to do; how many messages it processed."""
    total = 0
    while done := ctl.process_pending():
        total += done
    return total


def frames(items: Iterable[Outgoing]) -> list[dict[str, Any]]:
    return [json.loads(frame) for item in items for frame in item.frames]


# ---- results ----------------------------------------------------------------------------------


def test_results_come_out_in_arrival_order_and_equal_the_one_at_a_time_reference():
    rng = np.random.default_rng(7)
    streams = [f"s{i % 3}" for i in range(96)]
    xs = rng.normal(size=(96, F)).round(4)
    xs[80, 0] += 40.0  # spikes after the warm-up, so some results are anomalies
    xs[85, 1] -= 40.0
    sizes = [1, 3, 6, 2]  # 6 > max_batch: that chunk is split across two batches
    chunks, start = [], 0
    while start < 96:
        stop = min(96, start + sizes[len(chunks) % len(sizes)])
        chunks.append(chunk(range(start, stop), streams[start:stop], xs[start:stop], received_ns=1_000 * len(chunks)))
        start = stop
    fake = FakeIO()
    with started(fake) as ctl:
        for c in chunks:
            fake.inbound.put_nowait(c)
        processed = process_all(ctl)
        items = drain(fake.outbound)
        stats = ctl.stats()

    replies = frames(items)
    assert processed == 96
    assert [r["seq"] for r in replies] == list(range(96))
    reference = EWMAReference(alpha=CONFIG.alpha, threshold=CONFIG.threshold, warmup=CONFIG.warmup)
    flagged = 0
    for r, stream, x in zip(replies, streams, xs):
        z, score, anomaly = reference(stream, x)
        assert r["stream"] == stream
        np.testing.assert_allclose(r["z"], z, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(r["score"], score, rtol=1e-4, atol=1e-4)
        assert r["anomaly"] == anomaly, r
        flagged += anomaly
    assert flagged >= 2  # the two spikes at least
    # the chunk of 6: 4, then its last 2 topped up with the next chunk waiting (of 2)
    assert [len(item.frames) for item in items] == [1, 3, 4, 4] * 8
    assert [ns for item in items for ns in item.received_ns] == [c.received_ns for c in chunks for _ in c.seq]
    assert sum(item.results for item in items) == 96
    assert (stats.processed, stats.anomalies, stats.batches, stats.errors) == (96, flagged, 32, {})
    assert stats.gil == str(gil_status())  # whether this interpreter runs with the GIL, and why


def test_no_compilation_after_warm_up_whatever_the_batch_sizes():
    config = CONFIG.replace(max_batch=16)  # buckets 1, 4 and 16: one between the smallest and the largest
    fake = FakeIO()
    with started(fake, config) as ctl:
        after_warmup = compilations()  # in the whole process, not only what the controller counts
        for n in range(1, 21):  # every size up to max_batch, and beyond it (split: 16 + 1 … 16 + 4)
            fake.inbound.put_nowait(chunk(range(100 * n, 100 * n + n), [f"s{i % 8}" for i in range(n)]))
        assert process_all(ctl) == 210
        stats = ctl.stats()
    assert compilations() == after_warmup
    assert stats.compilations_after_warmup == 0
    # every bucket ran, exact and padded: sizes 1 | 2-4 | 5-16, nothing beyond (the chunks of
    # 1-16 one batch each; those of 17-20 split into 16s, each rest topped up by the next chunk)
    assert (stats.batch_size.bounds, stats.batch_size.counts) == ((1, 4, 16), (1, 3, 17, 0))


def frozen(obj: object) -> bool:
    """True if ``obj`` is in the collector's permanent generation (``gc.get_objects`` leaves those out)."""
    return not any(o is obj for o in gc.get_objects())


def test_an_embedded_controller_leaves_the_collector_and_the_hosts_frozen_objects_alone():
    alive = ["alive at start"]
    with started(FakeIO()):
        assert not frozen(alive) and gc.get_freeze_count() == 0  # not asked to freeze: freezes nothing
    hosts = [["the host's"]]
    gc.freeze()  # the host froze its own objects before starting the controller
    try:
        assert frozen(hosts)
        fake = FakeIO()
        with started(fake) as ctl:
            mine = ["made after the host's freeze"]
            fake.inbound.put_nowait(chunk([1, 2], ["a", "b"]))
            assert process_all(ctl) == 2
            assert frozen(hosts) and not frozen(mine)  # not asked to freeze: freezes nothing
        assert frozen(hosts)  # and thaws nothing of the host's
        assert gc.isenabled()
    finally:
        gc.unfreeze()


def test_freeze_gc_freezes_the_objects_alive_at_start_and_the_stop_thaws_exactly_those():
    # a full collection would walk JAX's objects and the stream table between two steps
    assert gc.get_freeze_count() == 0
    keep = [[i] for i in range(3)]  # tracked objects alive when the run starts
    fake = FakeIO()
    with Controller(CONFIG, processor=PROCESSOR, runtime=Runtime(freeze_gc=True, io_factory=fake)) as ctl:
        assert all(frozen(obj) for obj in keep)
        fake.inbound.put_nowait(chunk([1, 2], ["a", "b"]))
        assert process_all(ctl) == 2
    assert not any(frozen(obj) for obj in keep)  # stop() gave them back to the collector
    assert gc.get_freeze_count() == 0


def test_freeze_gc_freezes_nothing_when_the_host_has_frozen_objects_already():
    gc.freeze()
    try:
        mine = ["alive at start, made after the host's freeze"]
        fake = FakeIO()
        with Controller(CONFIG, processor=PROCESSOR, runtime=Runtime(freeze_gc=True, io_factory=fake)):
            assert not frozen(mine)
        assert gc.get_freeze_count() > 0  # the host's are still frozen
    finally:
        gc.unfreeze()


def test_a_stream_beyond_max_streams_gets_a_too_many_streams_error_and_is_counted():
    fake = FakeIO()
    with started(fake) as ctl:
        fake.inbound.put_nowait(chunk(range(4), [f"s{i}" for i in range(4)]))  # two batches, neither split
        fake.inbound.put_nowait(chunk(range(4, 7), [f"s{i}" for i in range(4, 7)]))
        # one batch: the 8th stream takes the last slot, the 9th is refused, a known one still works
        fake.inbound.put_nowait(chunk([7, 8, 9], ["s7", "s8", "s0"]))
        process_all(ctl)
        items = drain(fake.outbound)
        stats = ctl.stats()

    replies = frames(items)
    assert [r["seq"] for r in replies] == list(range(10))
    assert replies[8] == {"error": "too many streams (FORKLESS_MAX_STREAMS=8)", "seq": 8}
    assert all("error" not in r for i, r in enumerate(replies) if i != 8)
    assert [(len(item.frames), item.results) for item in items] == [(4, 4), (3, 3), (3, 2)]
    assert stats.errors == {"too many streams": 1}
    assert stats.processed == 9


# ---- stopping -------------------------------------------------------------------------------------


def test_stop_processes_what_was_queued_before_it_then_shuts_outbound():
    fake = FakeIO()
    ctl = started(fake)
    fake.inbound.put_nowait(chunk([0, 1], ["a", "b"]))
    fake.inbound.put_nowait(chunk([2], ["a"]))
    fake.inbound.put_nowait(chunk([3, 4, 5], ["c", "a", "b"]))
    ctl.stop()

    assert fake.stop_requested and fake.inbound.is_shutdown
    assert fake.outbound.is_shutdown
    assert [r["seq"] for r in frames(drain(fake.outbound))] == [0, 1, 2, 3, 4, 5]
    assert ctl.stats().processed == 6
    assert ctl.stats().errors == {}
    assert not fake.aborted


def full_outbound() -> FakeQueue:
    """An outbound queue of one place, taken by a reply the IO side never sends."""
    outbound = FakeQueue(maxsize=1)
    outbound.put_nowait(Outgoing([b'{"seq": -1}']))
    return outbound


def test_replies_that_find_outbound_full_until_the_stop_deadline_are_counted_as_outbound_full_at_stop():
    fake = FakeIO(outbound=full_outbound())
    ctl = started(fake, CONFIG.replace(shutdown_timeout_s=0.05))
    fake.inbound.put_nowait(chunk([0, 1, 2], ["a", "b", "c"]))
    ctl.stop()  # the batch waits for room until the deadline, 0.05 s after the stop began

    assert ctl.stats().dropped == {"outbound full at stop": 3} and ctl.stats().errors == {}
    assert [r["seq"] for r in frames(drain(fake.outbound))] == [-1]  # only what was there before
    assert fake.outbound.is_shutdown


def test_messages_still_queued_inbound_at_the_stop_deadline_are_counted_as_not_processed():
    fake = FakeIO(outbound=full_outbound())
    ctl = started(fake, CONFIG.replace(shutdown_timeout_s=0.05))
    fake.inbound.put_nowait(chunk([0, 1, 2], ["a", "b", "c"]))
    fake.inbound.put_nowait(chunk([3, 4], ["a", "b"]))  # still queued when the deadline passes
    ctl.stop()

    assert ctl.stats().dropped == {"outbound full at stop": 3, "not processed before the stop": 2}


@pytest.mark.parametrize(("in_flight", "handoff"), [(1, "park"), (3, "park"), (3, "spin")])
def test_a_stop_requested_inside_run_s_backlog_ends_the_work_at_its_deadline_not_after_the_backlog(in_flight, handoff):
    """run() is inside one call working through a deep backlog when the stop is requested (by the first
    batch's on_results, which then outlasts the stop's work deadline): the work on the backlog ends
    there, not once the backlog is done, and what it never reached is counted, not lost."""
    n, timeout_s = 60, 0.3
    fake = FakeIO()
    for i in range(n):  # one message a batch (max_wait_ms=0): 60 batches queued before the call
        fake.inbound.put_nowait(chunk([i], [f"s{i % 4}"]))
    handed: list[int] = []

    def on_results(seq, stream, outputs):
        handed.extend(seq)
        if len(handed) == 1:
            ctl.request_stop()
            time.sleep(timeout_s)  # past the work deadline (timeout_s less its reserve, from the request)

    ctl = Controller(CONFIG.replace(shutdown_timeout_s=timeout_s, steps_in_flight=in_flight, handoff=handoff),
                     processor=PROCESSOR, sinks=[OnResults(on_results)], runtime=Runtime(io_factory=fake))
    ctl.run()
    snap = ctl.stats()
    # the steps already dispatched when the stop came are answered; nothing after them is stepped
    assert 1 <= snap.processed <= in_flight and handed == list(range(snap.processed))
    assert snap.dropped == {"not processed before the stop": n - snap.processed}
    assert [r["seq"] for r in frames(drain(fake.outbound))] == handed


def test_stop_aborts_an_io_side_that_does_not_finish_by_the_deadline():
    fake = FakeIO(finishes=False)
    ctl = started(fake, CONFIG.replace(shutdown_timeout_s=0.05))
    ctl.stop()

    assert fake.aborted
    assert len(fake.joins) == 2  # and one more join after the abort


# ---- failures -------------------------------------------------------------------------------------

POISON = 12345.0  # a message with this value in x makes the step below raise


def _refuse_poison(x: np.ndarray) -> np.ndarray:
    if (x == POISON).any():
        raise ValueError("poisoned batch")
    return np.zeros((), np.float32)


def _init_totals(config: Config) -> jax.Array:
    return jnp.zeros((config.max_streams + 1,), jnp.float32)


def _step_totals(state: jax.Array, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per stream, the running total of x[0]; raises at run time (a host callback) on POISON."""
    zero = jax.pure_callback(_refuse_poison, jax.ShapeDtypeStruct((), jnp.float32), batch.x)
    totals = state.at[batch.key].add(jnp.where(batch.valid, batch.x[:, 0], 0.0))
    return totals, {"total": totals[batch.key] + zero}


TOTALS = Processor(_init_totals, _step_totals)


def test_a_step_that_raises_answers_its_batch_with_processing_failed_and_starts_from_a_fresh_state():
    fake = FakeIO()
    with started(fake, processor=TOTALS) as ctl:
        fake.inbound.put_nowait(chunk([0, 1], ["a", "b"], [[1.0, 0], [10.0, 0]]))
        fake.inbound.put_nowait(chunk([2, 3], ["a", "b"], [[POISON, 0], [5.0, 0]]))
        fake.inbound.put_nowait(chunk([4, 5], ["a", "b"], [[2.0, 0], [20.0, 0]]))
        process_all(ctl)
        items = drain(fake.outbound)
        stats = ctl.stats()

    assert frames(items) == [
        {"seq": 0, "stream": "a", "total": 1.0},
        {"seq": 1, "stream": "b", "total": 10.0},
        {"error": "processing failed", "seq": 2},
        {"error": "processing failed", "seq": 3},
        # the state was donated to the step that failed at run time: every stream starts again
        {"seq": 4, "stream": "a", "total": 2.0},
        {"seq": 5, "stream": "b", "total": 20.0},
    ]
    assert [item.results for item in items] == [2, 0, 2]
    assert stats.errors == {"processing failed": 2}
    assert stats.resets == {"state lost with a failed step": 1}
    assert stats.processed == 4


def test_a_failure_on_the_io_side_makes_process_pending_raise_it():
    fake = FakeIO()
    ctl = started(fake)
    fake.inbound.put_nowait(chunk([0], ["a"]))
    fake.failure = FeedFatal("the feed refused the handshake: HTTP 403")

    with pytest.raises(FeedFatal, match="HTTP 403"):
        ctl.process_pending()
    assert fake.inbound.qsize() == 1  # nothing was taken after the failure
    with pytest.raises(FeedFatal):  # stop() reports it too, after stopping
        ctl.stop()


def test_the_io_sides_cpu_time_read_around_each_step_is_counted_as_overlapping_the_steps():
    reads = iter(range(1, 1000))  # the IO side's CPU clock: one second more at every read
    fake = FakeIO()
    fake.cpu_clock = lambda: float(next(reads))
    with started(fake) as ctl:
        for i in range(3):
            fake.inbound.put_nowait(chunk([i], ["a"]))
        process_all(ctl)
        stats = ctl.stats()
    # read once at the start, then before and after each of the 3 steps, then by stats()
    assert (stats.batches, stats.step_io_cpu_s, stats.io_cpu_s) == (3, 3.0, 8.0)


def test_no_cpu_time_is_counted_when_the_io_side_cannot_tell_it():
    fake = FakeIO()  # cpu_seconds() is NaN
    with started(fake) as ctl:
        fake.inbound.put_nowait(chunk([0], ["a"]))
        process_all(ctl)
        stats = ctl.stats()
    assert stats.step_io_cpu_s == 0.0 and math.isnan(stats.io_cpu_s)


# ---- process_pending returns ------------------------------------------------------------------------


def test_process_pending_returns_after_what_was_queued_at_the_call_while_the_feed_keeps_producing():
    endless = EndlessQueue(lambda n: chunk([n], ["a"]), initial=3, limit=100)
    fake = FakeIO(inbound=endless)
    with started(fake) as ctl:
        done = ctl.process_pending()
        seqs = [r["seq"] for r in frames(drain(fake.outbound))]

    # it returned (a caller that never stops taking fails inside EndlessQueue at its limit)
    assert done >= 3  # at least what was waiting at the call
    assert seqs == list(range(done))  # in order, each reply once


def test_a_split_chunks_rest_is_topped_up_from_the_queue_not_sent_alone():
    fake = FakeIO()
    with started(fake) as ctl:
        fake.inbound.put_nowait(chunk(range(6), ["a"] * 6))
        fake.inbound.put_nowait(chunk([6, 7], ["b"] * 2))
        assert ctl.process_pending() == 8
        items = drain(fake.outbound)
    assert [[r["seq"] for r in frames([item])] for item in items] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_process_pending_tops_up_its_last_batch_from_what_arrived_since_and_leaves_the_rest_queued():
    # one chunk of 6 waits at the call; each chunk taken is replaced by one of 3 (the feed goes on)
    endless = EndlessQueue(lambda n: chunk(range(6), ["a"] * 6) if n == 0 else
                           chunk(range(3 + 3 * n, 6 + 3 * n), ["b"] * 3), initial=1, limit=100)
    fake = FakeIO(inbound=endless)
    with started(fake) as ctl:
        assert ctl.process_pending() == 8  # 0-3, then 4-5 topped up with 6-7 of the chunk that came next
        assert len(ctl.batcher) == 1  # 8 waits for the next call, as it would have in the queue
        first = [[r["seq"] for r in frames([item])] for item in drain(fake.outbound)]
        assert ctl.process_pending() == 4  # 8, topped up with 9-11 that were queued at the call
        second = [[r["seq"] for r in frames([item])] for item in drain(fake.outbound)]
    assert first == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert second == [[8, 9, 10, 11]]


def test_process_pending_processes_queued_chunks_larger_than_max_batch_completely():
    fake = FakeIO()
    with started(fake) as ctl:
        for i in range(3):
            fake.inbound.put_nowait(chunk(range(6 * i, 6 * i + 6), ["a", "b", "c", "d", "e", "f"]))
        assert ctl.process_pending() == 18


def test_a_stop_requested_during_the_compile_ends_it_after_the_bucket_being_compiled(caplog):
    # every bucket compiled would be seconds (cold, 2 cores); a stop waits for one bucket only
    cfg = Config(features=F, max_batch=64, max_streams=8, max_wait_ms=0.0, status_s=0.0)
    assert len(cfg.buckets) > 1
    compiled: list[int] = []
    ctl = Controller(cfg, processor=PROCESSOR, runtime=Runtime(io_factory=FakeIO()))
    ctl.request_stop()  # as a SIGTERM that came while the first bucket compiled
    original = ctl._stop_between_buckets

    def counting(bucket: int, seconds: float) -> None:
        compiled.append(bucket)
        original(bucket, seconds)

    ctl._stop_between_buckets = counting
    with caplog.at_level("INFO", logger="forkless"):
        ctl.start()
    assert compiled == [cfg.buckets[0]]
    assert ctl.engine is None
    assert "stop requested during the compile: not starting" in caplog.text
    ctl.stop()  # nothing was started: nothing to stop
