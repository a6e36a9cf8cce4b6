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




def rows(seqs):
    """One frame's x: row i is [seq, seq + 0.5], so a row shows which message it is."""
    return np.array([[s, s + 0.5] for s in seqs], np.float32).reshape(len(seqs), 2)


def test_a_batch_x_is_made_in_its_padded_array_which_pad_batch_takes_without_a_copy():
    b = MicroBatcher(max_batch=8, max_wait_s=0.0, buckets=(1, 2, 4, 8))
    b.add(Chunk([1, 2, 3], ["a"] * 3, [rows([1]), rows([2, 3])], 0), 0.0)  # a chunk of two frames
    b.add(Chunk([4, 5], ["a"] * 2, rows([4, 5]), 0), 0.0)
    taken = b.take()
    np.testing.assert_array_equal(taken.x, rows([1, 2, 3, 4, 5]))
    padded = taken.x.padded
    assert padded.shape == (8, 2) and not padded[5:].any()  # the bucket's padding rows: zeros
    batch = pad_batch(taken.x, np.arange(5, dtype=np.int32), 8, spare_slot=9)
    assert batch.x is padded  # no second copy
    assert batch.key.tolist() == [0, 1, 2, 3, 4, 9, 9, 9] and batch.valid.sum() == 5
    # an array made from it (the rows that run, when some are refused) is padded by a copy, as any array
    part = pad_batch(taken.x[[0, 2]], np.zeros(2, np.int32), 2, spare_slot=9)
    assert part.x is not padded and part.x.tolist() == rows([1, 3]).tolist()
    shifted = pad_batch(taken.x[1:], np.zeros(4, np.int32), 8, spare_slot=9)
    assert shifted.x is not padded and shifted.x[:4].tolist() == rows([2, 3, 4, 5]).tolist()
    assert not shifted.x[4:].any()
    # another dtype: padded by the copy that converts it
    wide = pad_batch(taken.x, np.zeros(5, np.int32), 8, spare_slot=9, dtype=np.float64)
    assert wide.x.dtype == np.float64 and wide.x[:5].tolist() == rows([1, 2, 3, 4, 5]).tolist()


def test_a_chunk_of_frames_split_across_batches_keeps_each_message_its_row_feed_and_receipt():
    b = MicroBatcher(max_batch=3, max_wait_s=0.0, buckets=(1, 2, 4))
    b.add(Chunk([1, 2, 3, 4, 5], list("abcde"), [rows([1, 2]), rows([3]), rows([4, 5])], 111, feed=1), 0.0)
    b.add(Chunk([6, 7], list("fg"), [rows([6]), rows([7])], 222, feed=0), 0.0)
    batches = []
    while (t := b.take()) is not None:
        batches.append(t)
    assert [t.seq for t in batches] == [[1, 2, 3], [4, 5, 6], [7]]
    for t in batches:  # each message's own row, whatever frame and batch it fell in
        np.testing.assert_array_equal(t.x, rows(t.seq))
        assert t.stream == [chr(ord("a") + s - 1) for s in t.seq]
    assert [t.runs for t in batches] == [[(3, 1, 111)], [(2, 1, 111), (3, 0, 222)], [(1, 0, 222)]]
    assert [t.feed for t in batches] == [[1, 1, 1], [1, 1, 0], [0]]
    assert [t.received_ns for t in batches] == [[111] * 3, [111, 111, 222], [222]]
    assert [t.feeds_mixed for t in batches] == [False, True, False]
    assert [t.first_feed for t in batches] == [1, 1, 0]


def test_without_buckets_a_batch_x_is_the_chunks_rows_as_before():
    b = MicroBatcher(max_batch=8, max_wait_s=0.0)
    x = rows([1, 2])
    b.add(Chunk([1, 2], ["a", "b"], x, 0), 0.0)
    taken = b.take()
    assert taken.x is x  # one whole chunk: its own array, nothing copied
