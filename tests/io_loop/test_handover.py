"""io_loop/handover.py's ``Handover`` on a plain ``asyncio.Queue``: no sockets, no threads.

Each test runs its own loop with ``asyncio.run``. ``next_turn()`` lets the loop run what is
already scheduled (the ``call_soon`` put) and nothing else, so every step is deterministic.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from forkless.controller.codec import Decoded
from forkless.io_loop.counters import IOStats
from forkless.io_loop.crossing import Chunk, Events
from forkless.io_loop.handover import Handover
from forkless.io_loop.spill import EVENTS_PER_ITEM


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
    return Handover(queue, max_batch)  # no buffer of its own: the queue's bound alone, then block


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
    rows = np.concatenate(chunk.x_parts())
    np.testing.assert_array_equal(rows, np.array([[1, 1.5], [2, 2.5], [3, 3.5], [4, 4.5]], np.float32))
    assert rows.dtype == np.float32
    assert chunk.received_ns == 1_000  # latency is counted from the first frame of the chunk
    assert left == 0


def test_a_chunk_of_several_frames_holds_their_own_arrays_not_a_copy():
    # the IO thread copies no x: the main thread copies the frames' rows once, into the padded batch
    frames = [decoded([1], ["a"]), decoded([2, 3], ["b", "a"])]

    async def main() -> Chunk:
        queue: asyncio.Queue[Chunk] = asyncio.Queue(maxsize=10)
        handover = blocking(queue)
        for frame in frames:
            handover.add(frame, received_ns=1_000)
        await next_turn()
        return queue.get_nowait()

    chunk = asyncio.run(main())
    assert [part is frame.x for part, frame in zip(chunk.x_parts(), frames)] == [True, True]


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


def test_drop_oldest_drops_the_oldest_of_its_own_buffer_and_counts_it_never_a_queued_chunk():
    async def main() -> tuple[list[list[int]], dict[str, int], list[list[int]]]:
        queue: asyncio.Queue[Chunk] = asyncio.Queue(maxsize=2)
        stats = IOStats()
        handover = Handover(queue, 100, drop_oldest=True, buffer=2, stats=stats)
        for seq in range(1, 7):  # one chunk a loop turn: [1] [2] on the queue, [3] in the pump's hand,
            handover.add(decoded([seq], ["a"]), received_ns=seq)  # [4] waiting, [5] drops [4], [6] drops [5]
            await next_turn()
        queued = [queue.get_nowait().seq for _ in range(queue.qsize())]
        rest: list[list[int]] = []
        while not handover.idle:  # the rest goes on as room frees
            await next_turn()
            rest += [queue.get_nowait().seq for _ in range(queue.qsize())]
        return queued, dict(stats.dropped), rest

    queued, dropped, rest = asyncio.run(main())
    assert queued == [[1], [2]]  # what is on the shared queue is never taken back
    assert dropped == {"inbound overflow (drop_oldest)": 2}
    assert rest == [[3], [6]]  # the oldest waiting ones went, never the one being put; order kept


def test_drop_oldest_flush_never_waits_and_drops_only_its_own_waiting_chunks():
    async def main() -> tuple[list[list[int]], dict[str, int]]:
        queue: asyncio.Queue[Chunk] = asyncio.Queue(maxsize=1)
        stats = IOStats()
        handover = Handover(queue, 2, drop_oldest=True, buffer=0, stats=stats)
        for first in (1, 3, 5):
            handover.add(decoded([first, first + 1], ["a", "b"]), received_ns=first)
            await handover.flush()  # never waits in drop_oldest mode
        got = [queue.get_nowait().seq]
        while not handover.idle:
            await next_turn()
            got += [queue.get_nowait().seq for _ in range(queue.qsize())]
        return got, dict(stats.dropped)

    got, dropped = asyncio.run(main())
    assert got == [[1, 2], [3, 4]]  # [1, 2] queued, [3, 4] in the pump's hand, [5, 6] over a bound of 0
    assert dropped == {"inbound overflow (drop_oldest)": 2}


def test_a_noisy_drop_oldest_source_never_drops_a_blocking_source_s_items_and_events_are_counted():
    async def main() -> tuple[dict[int, list], IOStats, IOStats]:
        queue: asyncio.Queue = asyncio.Queue(maxsize=4)
        noisy_stats, quiet_stats = IOStats(), IOStats()
        noisy = Handover(queue, 100, drop_oldest=True, buffer=3, stats=noisy_stats, feed=0)
        quiet = Handover(queue, 100, drop_oldest=False, buffer=1000, stats=quiet_stats, feed=1)
        for n in range(20):
            quiet.add(decoded([n], ["q"]), received_ns=n)
            await quiet.put_event(Events(1, [f"q{n}"], n))
            noisy.add(decoded([100 + n], ["n"]), received_ns=n)
            await noisy.put_event(Events(0, [f"n{n}"], n))
            await next_turn()
        got: dict[int, list] = {0: [], 1: []}
        while not (noisy.idle and quiet.idle) or queue.qsize():
            while queue.qsize():
                item = queue.get_nowait()
                got[item.feed] += item.items if type(item) is Events else item.seq
            await next_turn()
        return got, noisy_stats, quiet_stats

    got, noisy, quiet = asyncio.run(main())
    assert got[1] == [x for n in range(20) for x in (n, f"q{n}")]  # the blocking source loses nothing, in order
    assert quiet.dropped == {} and quiet.events_dropped == {}
    kept = got[0]
    dropped_messages = noisy.dropped["inbound overflow (drop_oldest)"]
    dropped_events = noisy.events_dropped["inbound overflow (drop_oldest)"]
    assert dropped_messages > 0 and dropped_events > 0
    assert len(kept) + dropped_messages + dropped_events == 40  # every one of its items kept or counted
    assert kept == sorted(kept, key=lambda x: int(x[1:]) if isinstance(x, str) else x - 100)  # in order
    assert noisy.buffered_peak <= 3 and quiet.buffered == 0


def test_events_waiting_together_cross_as_one_item_and_an_aborted_stop_counts_what_waits():
    async def main() -> tuple[list[Any], int, IOStats]:
        queue: asyncio.Queue = asyncio.Queue(maxsize=1)
        stats = IOStats()
        handover = Handover(queue, 100, buffer=100, stats=stats)
        for n in range(5):
            await handover.put_event(Events(0, [n], n))  # never waits: within the bound
        await next_turn()
        first = queue.get_nowait()
        await next_turn()  # the pump puts the event in its hand
        second = queue.get_nowait()
        await next_turn()
        third = queue.get_nowait()  # the three that waited together, as one item
        handover.add(decoded([1, 2], ["a", "b"]), received_ns=1)
        await next_turn()  # on the queue
        handover.add(decoded([3], ["a"]), received_ns=2)
        await next_turn()  # in the pump's hand
        await handover.put_event(Events(0, ["late"], 3))  # waiting
        handover.add(decoded([4], ["a"]), received_ns=4)  # gathered
        return [first.items, second.items, third.items], handover.discard(), stats

    items, discarded, stats = asyncio.run(main())
    assert items == [[0], [1], [2, 3, 4]]
    assert discarded == 2  # [3] in the pump's hand and [4] gathered ([1, 2] is on the queue: the caller's)
    assert stats.events_dropped == {"not processed before the stop": 1}
    assert stats.buffered == 0


def test_events_waiting_together_are_gathered_up_to_their_own_cap_not_the_batch_size():
    async def main() -> list[list[Any]]:
        queue: asyncio.Queue = asyncio.Queue(maxsize=1)
        handover = Handover(queue, 2, buffer=1000)  # batches of 2: events are not a batch's
        for n in range(EVENTS_PER_ITEM + 44):
            await handover.put_event(Events(0, [n], n))
        items = []
        for _ in range(4):
            await next_turn()
            items.append(queue.get_nowait().items)
        return items

    first, second, third, fourth = asyncio.run(main())
    assert (first, second) == ([0], [1])  # on the queue at once, then the pump's hand
    assert third == list(range(2, 2 + EVENTS_PER_ITEM))  # the waiting ones, EVENTS_PER_ITEM to an item
    assert fourth == list(range(2 + EVENTS_PER_ITEM, EVENTS_PER_ITEM + 44))


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


def test_the_writer_observes_every_frame_s_write_latency_from_its_own_chunk_receipt():
    # the writer (io_loop/writer.py) observes a run of frames sharing a receipt at once: every frame
    # counted, each with its own chunk's receipt
    import time

    from forkless.io_loop.crossing import Outgoing
    from forkless.io_loop.writer import HeldReply

    stats = IOStats()
    held = HeldReply(None, stats)
    now = time.monotonic_ns()
    old = now - 1_000 * 10**9  # past the histogram's last bound
    held._took(Outgoing([b"1", b"2", b"3", b"4"], [old, old, now, old]))
    held.wrote(4)
    held.finish()
    latency = stats.write_latency
    assert latency.n == 4 and latency.counts[-1] == 3
    assert 3_000.0 <= latency.total < 3_000.0 + 60.0
