"""The per-batch pipeline (controller/batchstep.py) on its own: no IO side, no thread, no queue.

A ``BatchStep`` is built from a real compiled step (a running product per stream, which
overflows float32 to inf on purpose), a real stream table, the real reply assembly and codec;
its ``put`` is a list. Each test hands it batches taken from a real ``MicroBatcher`` and reads
the items it put, the results ``on_results`` got and the counters.
"""

from __future__ import annotations

import json
import time
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from forkless.controller.batching import MicroBatcher, Taken
from forkless.controller.batchstep import BatchStep
from forkless.controller.checkpoints.positions import SourcePositions
from forkless.controller.codec import guarded_codec
from forkless.controller.config import Config
from forkless.controller.engine import compile_step
from forkless.controller.processor import Processor
from forkless.controller.replies import NON_FINITE_REASON, Replies
from forkless.controller.slots import StreamSlots
from forkless.controller.stats import MainStats
from forkless.io_loop.crossing import Chunk, Outgoing

F = 2
CONFIG = Config(features=F, max_batch=4, max_streams=3, max_wait_ms=0.0, status_s=0.0)


def _init(config: Config) -> Any:
    return jnp.ones(config.max_streams + 1, jnp.float32)


def _step(prod: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
    """Per stream, the running product of x[0]; a padding row writes 1 to the spare row."""
    new = prod[batch.key] * batch.x[:, 0]
    prod = prod.at[jnp.where(batch.valid, batch.key, prod.shape[0] - 1)].set(jnp.where(batch.valid, new, 1.0))
    return prod, {"prod": new}


PRODUCT = Processor(_init, _step)


@pytest.fixture
def engine_factory():
    """A fresh engine (a fresh state) for each test, compiled for every bucket like the controller's."""
    return lambda: compile_step(PRODUCT, CONFIG)


class Run:
    """A BatchStep and everything it writes to, as the controller wires it, minus the IO side."""

    def __init__(self, engine: Any, on_results: Any = None) -> None:
        self.stats = MainStats.for_run(CONFIG.buckets, 1)
        codec = guarded_codec(None, F, max_frame_items=CONFIG.max_frame_items, dtype=np.float32)
        self.replies = Replies(codec, self.stats, ["all"], CONFIG.max_streams)
        self.slots = StreamSlots(CONFIG.max_streams)
        self.put: list[tuple[Outgoing, float | None]] = []
        self.results: list[tuple[list, list, dict]] = []
        self.batcher = MicroBatcher(CONFIG.max_batch, 0.0)
        self.step = BatchStep(engine, self.slots, self.replies, SourcePositions(CONFIG.feed_specs), self.stats,
                              put=lambda item, deadline: self.put.append((item, deadline)),
                              on_results=on_results or (lambda *args: self.results.append(args)))

    def batch(self, seqs: list[int], streams: list[str], xs: list[float]) -> Taken:
        x = np.array([[v, 0.0] for v in xs], np.float32)
        self.batcher.add(Chunk(seqs, streams, x, 1_000), 0.0)
        taken = self.batcher.take()
        assert taken is not None and len(taken) == len(seqs)
        return taken

    def frames(self) -> list[dict[str, Any]]:
        return [json.loads(frame) for item, _ in self.put for frame in item.frames]


def test_a_batch_is_stepped_answered_in_arrival_order_counted_and_put_as_one_item(engine_factory):
    run = Run(engine_factory())
    run.step(run.batch([0, 1, 2], ["a", "b", "c"], [2.0, 3.0, 5.0]), 12.5)

    assert run.frames() == [{"seq": 0, "stream": "a", "prod": 2.0}, {"seq": 1, "stream": "b", "prod": 3.0},
                            {"seq": 2, "stream": "c", "prod": 5.0}]
    [(item, deadline)] = run.put
    assert (item.results, item.error_at, deadline) == (3, (), 12.5)  # the caller's deadline goes with the put
    [(seq, stream, outputs)] = run.results
    assert (seq, stream) == ([0, 1, 2], ["a", "b", "c"])
    np.testing.assert_array_equal(outputs["prod"], np.array([2.0, 3.0, 5.0], np.float32))
    stats = run.stats
    assert (stats.batches, stats.processed, stats.batch_size.n) == (1, 3, 1)
    assert stats.step_seconds.n == 1 and not stats.errors and not stats.resets
    assert stats.latency[0].n == 3  # every result's latency, receipt -> handed over


def test_a_non_finite_row_is_refused_its_stream_reset_and_the_rest_of_the_batch_answered(engine_factory):
    run = Run(engine_factory())
    run.step(run.batch([0, 1], ["a", "b"], [1e30, 3.0]), None)
    run.step(run.batch([2, 3], ["a", "b"], [1e30, 2.0]), None)  # a: 1e30 * 1e30 = inf in float32
    run.step(run.batch([4], ["a"], [5.0]), None)  # a starts again from a fresh state: 5, not inf

    assert run.frames() == [
        {"seq": 0, "stream": "a", "prod": float(np.float32(1e30))}, {"seq": 1, "stream": "b", "prod": 3.0},
        {"error": NON_FINITE_REASON, "seq": 2}, {"seq": 3, "stream": "b", "prod": 6.0},
        {"seq": 4, "stream": "a", "prod": 5.0}]
    assert [(item.results, item.error_at) for item, _ in run.put] == [(2, ()), (1, (0,)), (1, ())]
    # on_results gets only the finite rows
    assert [(seq, stream) for seq, stream, _ in run.results] == [([0, 1], ["a", "b"]), ([3], ["b"]), ([4], ["a"])]
    stats = run.stats
    assert stats.errors == {"non-finite result": 1}
    assert stats.resets == {"stream reset: non-finite": 1}
    assert (stats.batches, stats.processed) == (3, 5)  # the refused row ran through the step too


def test_a_stream_beyond_the_table_is_refused_before_the_step_and_the_others_run(engine_factory):
    run = Run(engine_factory())
    run.step(run.batch([0, 1, 2, 3], ["a", "b", "c", "d"], [2.0, 3.0, 4.0, 5.0]), None)  # 3 slots

    assert run.frames() == [{"seq": 0, "stream": "a", "prod": 2.0}, {"seq": 1, "stream": "b", "prod": 3.0},
                            {"seq": 2, "stream": "c", "prod": 4.0},
                            {"error": "too many streams (FORKLESS_MAX_STREAMS=3)", "seq": 3}]
    assert run.stats.errors == {"too many streams": 1}
    assert run.stats.processed == 3


def test_what_on_results_raised_is_raised_once_the_batch_s_replies_are_put(engine_factory):
    def failing(seq, stream, outputs):
        raise KeyError("the host's bug")

    run = Run(engine_factory(), on_results=failing)
    with pytest.raises(KeyError, match="the host's bug"):
        run.step(run.batch([0], ["a"], [2.0]), None)
    assert run.frames() == [{"seq": 0, "stream": "a", "prod": 2.0}]
    assert run.stats.batches == 1


def test_the_latency_of_a_batch_of_several_chunks_is_observed_once_per_message_from_its_own_chunk(engine_factory):
    # chunks that arrived 1,000 s apart share a batch: each message's latency is from its own
    # chunk's receipt (runs of one receipt are observed together, never merged across chunks)
    run = Run(engine_factory())
    now = time.monotonic_ns()
    x = np.array([[1.0, 0.0]] * 2, np.float32)
    run.batcher.add(Chunk([0, 1], ["a", "b"], x, now - 1_000 * 10**9), 0.0)
    run.batcher.add(Chunk([2, 3], ["a", "c"], x, now), 0.0)
    run.batcher.add(Chunk([4], ["b"], x[:1], now - 1_000 * 10**9), 0.0)  # a third chunk: the next batch
    taken = run.batcher.take()
    assert taken is not None and taken.received_ns == [now - 1_000 * 10**9] * 2 + [now] * 2
    run.step(taken, None)
    latency = run.stats.latency[0]
    assert latency.n == 4 and latency.counts[-1] == 2  # the two from the old chunk: past the last bound
    assert 2_000.0 <= latency.total < 2_000.0 + latency.bounds[-1] * 2


def test_several_feeds_with_the_same_stream_name_keep_distinct_slots(engine_factory):
    # a stream is (feed, stream): "a" of feed 0 and "a" of feed 1 are two streams, each with its own
    # running product, in batches that mix the feeds and in batches of one feed
    run = Run(engine_factory())
    run.stats = stats = MainStats.for_run(CONFIG.buckets, 2)
    run.replies = Replies(run.replies.codec, stats, ["all", "all"], CONFIG.max_streams)
    run.step = BatchStep(engine_factory(), run.slots, run.replies, SourcePositions(CONFIG.feed_specs), stats,
                         put=lambda item, deadline: run.put.append((item, deadline)),
                         on_results=lambda *args: run.results.append(args), feed_prefixes=["f0:", "f1:"])

    def batch(*chunks: tuple[int, list[int], list[str], list[float]]) -> Taken:
        for feed, seqs, streams, xs in chunks:
            run.batcher.add(Chunk(seqs, streams, [np.array([[v, 0.0]], np.float32) for v in xs], 1_000, feed), 0.0)
        taken = run.batcher.take()
        assert taken is not None and len(taken) == sum(len(c[1]) for c in chunks)
        return taken

    run.step(batch((0, [0], ["a"], [2.0]), (1, [1], ["a"], [3.0]), (0, [2], ["b"], [5.0])), None)
    run.step(batch((0, [3], ["a"], [7.0]), (0, [4], ["b"], [2.0])), None)  # one feed: its keys found again
    run.step(batch((1, [5], ["a"], [11.0])), None)
    frames = [json.loads(frame) for item, _ in run.put for part in item.unbundled() for frame in part.frames]
    assert {frame["seq"]: frame["prod"] for frame in frames} == {0: 2.0, 1: 3.0, 2: 5.0, 3: 14.0, 4: 10.0, 5: 33.0}
    assert sorted((name, slot) for name, slot, _ in run.slots.items()) == [("f0:a", 0), ("f0:b", 2), ("f1:a", 1)]


def test_a_feeds_stream_keeps_its_slot_when_the_keys_it_made_are_forgotten(engine_factory):
    # each feed's keys are kept for at most max_streams names (3 here): the fourth name clears them,
    # and a stream seen before gets its key made again, the same key: its slot and state go on
    run = Run(engine_factory())
    run.step = BatchStep(engine_factory(), run.slots, run.replies, SourcePositions(CONFIG.feed_specs), run.stats,
                         put=lambda item, deadline: run.put.append((item, deadline)),
                         on_results=lambda *args: run.results.append(args), feed_prefixes=["f0:"])
    run.step(run.batch([0, 1, 2], ["a", "b", "c"], [2.0, 3.0, 5.0]), None)
    run.step(run.batch([3], ["d"], [1.0]), None)  # a fourth stream: refused (3 slots)
    run.step(run.batch([4, 5], ["a", "c"], [7.0, 2.0]), None)
    frames = run.frames()
    assert frames[3] == {"error": "too many streams (FORKLESS_MAX_STREAMS=3)", "seq": 3}
    assert [frame.get("prod") for frame in frames[4:]] == [14.0, 10.0]
    assert sorted((name, slot) for name, slot, _ in run.slots.items()) == [("f0:a", 0), ("f0:b", 1), ("f0:c", 2)]
