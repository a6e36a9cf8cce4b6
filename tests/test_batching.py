"""The micro-batcher, bucket padding and stream slots, with literal inputs and explicit `now`."""

from __future__ import annotations

import numpy as np
import pytest
from forkless.controller.batching import MicroBatcher, bucket_for, pad_batch
from forkless.io_loop.crossing import Chunk


def chunk(seqs, t=0):
    n = len(seqs)
    return Chunk(list(seqs), [f"s{s}" for s in seqs], np.arange(n * 2, dtype=np.float32).reshape(n, 2), t)


def test_a_lone_message_is_ready_at_once_when_nothing_else_waits():
    b = MicroBatcher(max_batch=8, max_wait_s=1.0)
    b.add(chunk([1]), now=0.0)
    # the caller only keeps collecting what is already queued; the batch is taken right away
    taken = b.take()
    assert taken.seq == [1] and len(b) == 0


def test_wants_more_until_full_or_max_wait_passed():
    b = MicroBatcher(max_batch=4, max_wait_s=0.010)
    b.add(chunk([1]), now=100.0)
    assert b.wants_more(100.005)
    assert not b.wants_more(100.010)
    b.add(chunk([2, 3, 4]), now=100.001)
    assert not b.wants_more(100.002)  # full


def test_a_leftover_is_topped_up_from_what_waits_after_a_step_longer_than_max_wait():
    b = MicroBatcher(max_batch=4, max_wait_s=0.002)
    b.add(chunk([1, 2, 3, 4, 5, 6]), now=0.0)
    assert b.take().seq == [1, 2, 3, 4]
    # the caller steps that batch for 10 ms; meanwhile more arrived, and the leftover is topped up
    assert b.wants_more(0.010)
    b.add(chunk([7]), now=0.010)
    assert b.wants_more(0.010)
    b.add(chunk([8, 9]), now=0.010)
    assert not b.wants_more(0.010)  # full
    assert b.take().seq == [5, 6, 7, 8]
    assert len(b) == 1


def test_a_leftovers_deadline_starts_with_the_first_chunk_added_to_it():
    b = MicroBatcher(max_batch=8, max_wait_s=0.002)
    b.add(chunk(range(10)), now=0.0)
    assert len(b.take()) == 8
    b.add(chunk([10]), now=0.050)
    assert b.wants_more(0.0515)
    assert not b.wants_more(0.0525)


def test_a_leftover_with_nothing_added_is_taken_alone():
    b = MicroBatcher(max_batch=4, max_wait_s=0.002)
    b.add(chunk([1, 2, 3, 4, 5]), now=0.0)
    b.take()
    assert b.wants_more(1.0)  # the caller finds the queue empty and cuts the batch: it does not wait
    assert b.take().seq == [5] and len(b) == 0
    b.add(chunk([6]), now=2.0)  # an empty batcher starts a fresh deadline, as before
    assert b.wants_more(2.001) and not b.wants_more(2.0025)


def test_a_large_chunk_is_split_and_order_is_kept_across_batches():
    b = MicroBatcher(max_batch=3, max_wait_s=0.0)
    b.add(chunk([1, 2]), 0.0)
    b.add(chunk([3, 4, 5, 6]), 0.0)
    batches = []
    while (t := b.take()) is not None:
        batches.append(t.seq)
    assert batches == [[1, 2, 3], [4, 5, 6]]


def test_taken_rows_carry_their_frames_receive_time():
    b = MicroBatcher(max_batch=8, max_wait_s=0.0)
    b.add(chunk([1, 2], t=111), 0.0)
    b.add(chunk([3], t=222), 0.0)
    t = b.take()
    assert t.received_ns == [111, 111, 222]
    assert t.x.shape == (3, 2)


@pytest.mark.parametrize(("n", "bucket"), [(1, 1), (2, 2), (3, 4), (5, 8), (100, 128), (200, 200)])
def test_bucket_is_the_smallest_that_fits(n, bucket):
    assert bucket_for(n, (1, 2, 4, 8, 16, 32, 64, 128, 200)) == bucket


def test_padding_rows_are_invalid_and_use_the_spare_slot():
    batch = pad_batch(np.ones((3, 2), np.float32), np.array([0, 1, 0], np.int32), 4, spare_slot=9)
    assert batch.x.shape == (4, 2) and batch.x[3].tolist() == [0, 0]
    assert batch.key.tolist() == [0, 1, 0, 9]
    assert batch.valid.tolist() == [True, True, True, False]


