"""io_loop/handover.py's ``Handover`` on a plain ``asyncio.Queue``: no sockets, no threads.

Each test runs its own loop with ``asyncio.run``. ``next_turn()`` lets the loop run what is
already scheduled (the ``call_soon`` put) and nothing else, so every step is deterministic.
"""

from __future__ import annotations

import asyncio

import numpy as np

from controller.batching import Chunk
from controller.codec import Decoded
from io_loop.handover import Handover


def decoded(seqs: list[int], streams: list[str]) -> Decoded:
    """Messages with ``x = [seq, seq + 0.5]``, so the rows show where they came from."""
    x = np.array([[s, s + 0.5] for s in seqs], np.float32).reshape(len(seqs), 2)
    return Decoded(list(seqs), list(streams), x)


async def next_turn() -> None:
    """Return after the callbacks already scheduled on the running loop have run."""
    loop = asyncio.get_running_loop()
    turned = loop.create_future()
    loop.call_soon(turned.set_result, None)
    await turned


def blocking(queue: asyncio.Queue, max_batch: int = 100) -> Handover:
    return Handover(queue, max_batch, drop_oldest=False, on_dropped=lambda n: None)


def test_frames_added_in_one_loop_turn_leave_as_one_chunk():
    async def main() -> tuple[int, Chunk, int]:
        queue: asyncio.Queue[Chunk] = asyncio.Queue(maxsize=10)
        handover = blocking(queue)
        handover.add(decoded([1], ["a"]), received_ns=1_000)
        handover.add(decoded([2, 3], ["b", "a"]), received_ns=2_000)
        handover.add(decoded([4], ["c"]), received_ns=3_000)
        before = queue.qsize()  # the put waits for the loop's next turn
        await next_turn()
        return before, queue.get_nowait(), queue.qsize()

    before, chunk, left = asyncio.run(main())
    assert before == 0
    assert chunk.seq == [1, 2, 3, 4]
    assert chunk.stream == ["a", "b", "a", "c"]
    np.testing.assert_array_equal(chunk.x, np.array([[1, 1.5], [2, 2.5], [3, 3.5], [4, 4.5]], np.float32))
    assert chunk.x.dtype == np.float32
    assert chunk.received_ns == 1_000  # latency is counted from the first frame of the chunk
    assert left == 0


def test_should_flush_once_max_batch_messages_are_gathered():
    async def main() -> tuple[list[bool], list[list[int]], int]:
        queue: asyncio.Queue[Chunk] = asyncio.Queue(maxsize=10)
        handover = blocking(queue, max_batch=3)
        answers = []
        handover.add(decoded([1, 2], ["a", "a"]), received_ns=10)
        answers.append(handover.should_flush())
        handover.add(decoded([3], ["b"]), received_ns=20)
        answers.append(handover.should_flush())
        await handover.flush()
        answers.append(handover.should_flush())
        await next_turn()  # the put scheduled by the first add finds nothing left to put
        chunks = [queue.get_nowait().seq for _ in range(queue.qsize())]
        return answers, chunks, len(handover)

    answers, chunks, gathered = asyncio.run(main())
    assert answers == [False, True, False]
    assert chunks == [[1, 2, 3]]
    assert gathered == 0


async def take(queue: asyncio.Queue[Chunk], n: int) -> list[Chunk]:
    return [await queue.get() for _ in range(n)]


def test_block_mode_keeps_the_order_when_a_put_waits_for_room():
    async def main() -> tuple[bool, bool, list[list[int]], list[int], bool]:
        queue: asyncio.Queue[Chunk] = asyncio.Queue(maxsize=1)
        handover = blocking(queue)
        handover.add(decoded([1], ["a"]), received_ns=1)
        await next_turn()  # chunk [1] fills the queue
        handover.add(decoded([2], ["a"]), received_ns=2)
        await next_turn()  # chunk [2] finds the queue full: its put waits for room
        must_flush, idle_while_waiting = handover.should_flush(), handover.idle
        handover.add(decoded([3], ["a"]), received_ns=3)
        first = queue.get_nowait()  # room for one chunk; the waiting put of [2] has not run yet
        consumer = asyncio.ensure_future(take(queue, 2))
        await handover.flush()  # [3] must not take the room [2] is waiting for
        got = [first, *await consumer]
        return must_flush, idle_while_waiting, [c.seq for c in got], [c.received_ns for c in got], handover.idle

    must_flush, idle_while_waiting, seqs, received, idle_at_end = asyncio.run(main())
    assert must_flush  # a waiting put makes the reader flush (and so wait) before reading on
    assert not idle_while_waiting
    assert seqs == [[1], [2], [3]]  # nothing lost, nothing overtaken
    assert received == [1, 2, 3]
    assert idle_at_end


def test_drop_oldest_drops_the_oldest_queued_chunk_and_reports_its_message_count():
    async def main() -> tuple[list[list[int]], list[int]]:
        queue: asyncio.Queue[Chunk] = asyncio.Queue(maxsize=2)
        dropped: list[int] = []
        handover = Handover(queue, 100, drop_oldest=True, on_dropped=dropped.append)
        handover.add(decoded([1], ["a"]), received_ns=1)
        await next_turn()
        handover.add(decoded([2, 3], ["a", "b"]), received_ns=2)
        await next_turn()  # the queue is full now: [1], [2, 3]
        handover.add(decoded([4, 5, 6], ["a", "b", "c"]), received_ns=3)
        await next_turn()
        return [queue.get_nowait().seq for _ in range(queue.qsize())], dropped

    left, dropped = asyncio.run(main())
    assert left == [[2, 3], [4, 5, 6]]  # the new chunk is never the one dropped
    assert dropped == [1]


def test_drop_oldest_flush_drops_the_oldest_queued_chunk_not_the_flushed_one():
    async def main() -> tuple[list[list[int]], list[int]]:
        queue: asyncio.Queue[Chunk] = asyncio.Queue(maxsize=1)
        dropped: list[int] = []
        handover = Handover(queue, 2, drop_oldest=True, on_dropped=dropped.append)
        handover.add(decoded([1, 2], ["a", "b"]), received_ns=1)
        await handover.flush()
        handover.add(decoded([3, 4], ["a", "b"]), received_ns=2)
        await handover.flush()  # never waits in drop_oldest mode
        return [queue.get_nowait().seq for _ in range(queue.qsize())], dropped

    left, dropped = asyncio.run(main())
    assert left == [[3, 4]]
    assert dropped == [2]


def test_an_empty_decoded_is_ignored_and_does_not_start_a_chunk():
    async def main() -> tuple[int, bool, int, Chunk]:
        queue: asyncio.Queue[Chunk] = asyncio.Queue(maxsize=10)
        handover = blocking(queue)
        handover.add(Decoded(), received_ns=100)
        handover.add(Decoded(errors=[("not JSON", None)]), received_ns=200)  # a frame with no good message
        gathered, idle = len(handover), handover.idle
        await next_turn()
        queued = queue.qsize()
        handover.add(decoded([7], ["a"]), received_ns=300)
        await next_turn()
        return gathered, idle, queued, queue.get_nowait()

    gathered, idle, queued, chunk = asyncio.run(main())
    assert (gathered, idle, queued) == (0, True, 0)
    assert chunk.seq == [7]
    assert chunk.received_ns == 300  # not the time of the ignored frames


def test_idle_is_true_only_with_nothing_gathered_and_no_put_waiting():
    async def main() -> list[bool]:
        queue: asyncio.Queue[Chunk] = asyncio.Queue(maxsize=1)
        handover = blocking(queue)
        seen = [handover.idle]  # new
        handover.add(decoded([1], ["a"]), received_ns=1)
        seen.append(handover.idle)  # gathered
        await next_turn()
        seen.append(handover.idle)  # put
        handover.add(decoded([2], ["a"]), received_ns=2)
        await next_turn()
        seen.append(handover.idle)  # its put waits for room
        await queue.get()
        await queue.get()
        seen.append(handover.idle)  # the waiting put went through
        return seen

    assert asyncio.run(main()) == [True, False, True, False, True]
