"""The IO side's objects that another thread reads or writes while the IO thread works, hammered from many
threads at once (tests/races.py): a feed's books and unsent count and a sink's books, read by
``Controller.stats()`` while the IO thread counts, and the ids of what the main thread puts on an
``IOPortal``'s ``from_main`` with a deadline (DESIGN.md, "What the threads share")."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import pytest

from forkless.io_loop.counters import IOStats
from forkless.io_loop.crossing import Outgoing
from forkless.io_loop.portal import IOPortal
from forkless.io_loop.sinks.sink import SinkStats
from forkless.io_loop.writer import HeldReply
from tests.harness import UNIT_S
from tests.races import hammer, switching_often

pytestmark = pytest.mark.threads

THREADS = 4
LONGEST = 8  # frames in the longest item the writer takes


class _Items:
    """A feed's outbox as ``HeldReply.poll`` takes from it: the items of ``items``, then empty."""

    def __init__(self, items: Iterator[Outgoing]) -> None:
        self._items = items

    def get_nowait(self) -> Outgoing:
        try:
            return next(self._items)
        except StopIteration:
            raise asyncio.QueueEmpty from None


def test_a_feeds_unsent_count_read_from_another_thread_is_one_of_its_items_frames():
    """The IO thread takes an item, writes part of it, then the rest, and takes the next, while the main
    thread reads the feed's unsent count (its snapshot): each read is a count of frames of one item, from 0
    to the longest item's, never an error (the item given up between a look and a read) nor below 0."""
    items = 20_000
    held = HeldReply(_Items(Outgoing([f"r{i}"] * (1 + i % LONGEST)) for i in range(items)), IOStats())
    done = threading.Event()
    seen: list[int] = []

    def write() -> None:
        try:
            for _ in range(items):
                held.poll()
                n = len(held.item.frames)
                held.wrote(n // 2)
                held.wrote(n)
                held.finish()
        finally:
            done.set()

    def read() -> None:
        while not done.is_set():
            seen.append(held.held_frames())

    hammer([write, read, read])
    assert held.stats.results_out == sum(1 + i % LONGEST for i in range(items))
    assert min(seen) >= 0 and max(seen) <= LONGEST


def test_an_unsent_count_read_between_two_items_stays_within_the_item_it_read():
    """What the read above may meet without a GIL, made here in one thread: the item of one take beside the
    offset of another (a longer item's, or one not reset yet) counts within the item read, never below 0 or
    above its frames; the race test alone cannot show this on a build with a GIL."""
    held = HeldReply(_Items(iter(())), IOStats())
    held.item = Outgoing(["a", "b", "c"])
    for offset, unsent in ((7, 0), (3, 0), (1, 2), (0, 3), (-1, 3)):
        held.offset = offset
        assert held.held_frames() == unsent, offset


def test_items_put_with_a_deadline_from_several_threads_each_get_an_id_of_their_own():
    """``from_main`` is a ``queue.Queue`` to whoever puts on it: threads that put items with a deadline at
    once get the ids 1 … n, each once (an id names the item a ``SendFailed`` reports)."""
    each = 5000

    async def worker(to_main, from_main):  # takes every item, then waits for the stop
        for _ in range(THREADS * each):
            await from_main.get()
        await from_main.stopping.wait()

    ids: list[list[int]] = [[] for _ in range(THREADS)]
    with IOPortal(worker, queue_size=THREADS * each, stop_timeout_s=10 * UNIT_S) as portal:
        def put_many(mine: list[int]) -> None:
            for i in range(each):
                mine.append(portal.from_main.put(i, max_age_s=600.0))

        hammer([lambda mine=mine: put_many(mine) for mine in ids])
    assert sorted(i for mine in ids for i in mine) == list(range(1, THREADS * each + 1))


def test_a_feeds_snapshot_never_shows_more_answered_than_received():
    """The IO thread counts each message received, then its reply written (or an error reply, or a drop),
    while other threads copy its counters (``IOStats.snapshot``): a copy reads what is counted later before
    what is counted first, so none shows more messages answered or dropped than received."""
    stats = IOStats()

    def count(i: int) -> None:
        stats.frames_in += 1
        stats.messages_in += 1
        if i % 10 == 0:
            stats.dropped["unsent at stop"] += 1
        elif i % 10 == 1:
            stats.errors_out += 1
            stats.answer_errors_out += 1
        else:
            stats.results_out += 1

    def books() -> tuple[int, int]:  # (answered or dropped, received)
        snap = stats.snapshot()
        return snap.results_out + snap.answer_errors_out + sum(snap.dropped.values()), snap.messages_in

    _copied_while_counted(count, books)


def test_a_sinks_books_never_show_more_written_than_taken():
    """A sink's books on the IO loop (taken = written + dropped + held) copied by another thread
    (``SinkStats.snapshot``, a status line's or a scrape's): what a sink took is counted before what it
    wrote or dropped of it, and is read after, so no copy shows a negative ``held``."""
    stats = SinkStats()

    def count(i: int) -> None:
        stats.taken += 1
        stats.batches += 1
        if i % 10 == 0:
            stats.dropped["unwritten at the stop"] += 1
        else:
            stats.written += 1

    def books() -> tuple[int, int]:  # (written or dropped, taken)
        snap = stats.snapshot()
        return snap.written + sum(snap.dropped.values()), snap.taken

    _copied_while_counted(count, books)


def _copied_while_counted(count: Callable[[int], None], books: Callable[[], tuple[int, int]],
                          times: int = 100_000) -> None:
    """``count(i)`` ``times`` on one thread while two others read ``books()`` (out, in) until it is done:
    out <= in in every copy, and out == in == ``times`` at the end."""
    done = threading.Event()

    def counting() -> None:
        try:
            for i in range(times):
                count(i)
        finally:
            done.set()

    def copying() -> None:
        while not done.is_set():
            out, received = books()
            assert out <= received, f"{out} out of {received} in"

    hammer([counting, copying, copying])
    assert books() == (times, times)


def test_a_run_is_up_once_whichever_threads_put_its_first_items_and_the_up_comes_before_them():
    """An unchanged worker's first item says its run is up: puts from several executor threads at once make
    one ``ConnectionEvent``, ahead of every item, never two (seen failing with ``_up_lock`` taken out of
    ``IOPortal._came_up``: two threads each checked ``_up`` and put an up event, [0, 92])."""
    from forkless.io_loop.crossing import ConnectionEvent

    each, rounds = 200, 200  # 25 rounds caught a missing lock in 4 of 11 runs on a GIL build
    for _ in range(rounds):
        async def worker(to_main, from_main):
            loop = asyncio.get_running_loop()
            start = threading.Barrier(THREADS)

            def put_many(k: int) -> None:
                start.wait()
                for i in range(each):
                    to_main.put((k, i))

            await asyncio.gather(*(loop.run_in_executor(None, put_many, k) for k in range(THREADS)))
            await to_main.stopping.wait()

        with switching_often(), IOPortal(worker, connection_events=True, queue_size=0,
                                         stop_timeout_s=10 * UNIT_S) as portal:
            got = [portal.to_main.get(timeout=30 * UNIT_S) for _ in range(THREADS * each + 1)]
        ups = [i for i, item in enumerate(got) if isinstance(item, ConnectionEvent)]
        assert ups == [0], ups
        assert portal.connections == 1
