"""The IO side's objects that another thread reads or writes while the IO thread works, hammered from many
threads at once (tests/races.py): a feed's unsent count read by ``Controller.stats()`` while its writer
takes and writes items, and the ids of what the main thread puts on an ``IOPortal``'s ``from_main`` with a
deadline (DESIGN.md, "What the threads share")."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from forkless.io_loop.counters import IOStats
from forkless.io_loop.crossing import Outgoing
from forkless.io_loop.portal import IOPortal
from forkless.io_loop.writer import HeldReply
from tests.harness import UNIT_S
from tests.races import hammer

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
