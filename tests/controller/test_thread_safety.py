"""The main thread's objects that other threads touch too, hammered from many threads at once
(tests/races.py): the logs' flood guard, which every thread's warnings pass through, and the books
``Controller.stats()`` reads while the IO thread and the main thread count (DESIGN.md, "What the
threads share")."""

from __future__ import annotations

import logging
import queue
import threading

import pytest

from forkless.controller.logs import RateLimitFilter
from forkless.controller.stats import MainStats, StatsSnapshot, whole_snapshot
from forkless.io_loop.counters import FeedSnapshot, IOSnapshot, IOStats, combine_io
from tests.races import hammer

pytestmark = pytest.mark.threads

THREADS = 4


def _warning(message: str) -> logging.LogRecord:
    return logging.LogRecord("forkless.test", logging.WARNING, __file__, 1, message, (), None)


def test_the_flood_guard_counts_every_repeat_once_whichever_thread_logs_it():
    """Every record is let through or counted as a repeat exactly once: the lines let through, each
    with the repeats it says were held back before it, plus what is still held at the stop, are all
    that were logged. The window is short, so the threads also cross the moment a repeat is let
    through and the count starts again."""
    guard = RateLimitFilter(window_s=1e-4)
    each = 3000
    shown: list[list[int]] = [[] for _ in range(THREADS)]  # per thread: 1 + the repeats each line it let through said

    def log_many(mine: list[int]) -> None:
        for _ in range(each):
            record = _warning("the same warning")
            if guard.filter(record):
                mine.append(1 + getattr(record, "repeated", 0))

    hammer([lambda mine=mine: log_many(mine) for mine in shown])
    held = sum(count for _, count, _ in guard.flush())
    assert sum(map(sum, shown)) + held == THREADS * each


def test_the_flood_guard_forgets_old_warnings_while_other_threads_log_new_ones():
    """With more distinct warnings than it remembers, one thread's new warning makes it forget the oldest
    while another thread is looking that one up: no thread's logging call raises (a filter that raises
    raises into the code that logged), and each new line is let through."""
    guard = RateLimitFilter(window_s=60.0, max_keys=4)

    let_through: list[list[str]] = [[] for _ in range(THREADS)]

    def log_distinct(offset: int, mine: list[str]) -> None:
        for i in range(4000):
            text = f"warning {(i + offset) % 8}"
            if guard.filter(_warning(text)):
                mine.append(text)

    hammer([lambda offset=offset, mine=mine: log_distinct(offset, mine) for offset, mine in enumerate(let_through)])
    assert {text for mine in let_through for text in mine} == {f"warning {n}" for n in range(8)}
    assert len(guard.flush()) <= 4


def test_the_books_read_from_a_third_thread_never_show_more_answered_than_received():
    """The IO thread counts a message in, the main thread counts it processed and either answered with no frame
    or dropped, or hands its result back for the IO thread to count written: a snapshot taken on any other
    thread meanwhile (a status line's, a user's) reads what each side counted later before what it counted
    first, so its books never show a message answered before it was received (``unanswered`` >= 0), each
    counter only grows from one snapshot to the next, and once both sides are done the books balance."""
    messages = 6000
    feed, own, main = IOStats(), IOStats(), MainStats.for_run([1, 2], feeds=1)
    inbound: queue.SimpleQueue[int] = queue.SimpleQueue()
    outbound: queue.SimpleQueue[int] = queue.SimpleQueue()
    done = threading.Event()

    def io_thread() -> None:  # reads a frame of one message, writes the results handed back
        for _ in range(messages):
            feed.frames_in += 1
            feed.messages_in += 1
            inbound.put(1)
            _write(outbound, feed, block=False)
        while feed.results_out + main.no_reply + sum(main.dropped.values()) < messages:
            _write(outbound, feed, block=True)

    def main_thread() -> None:  # answers two messages in three with a result, one with no frame, drops a few
        for i in range(messages):
            main.processed += inbound.get()
            if i % 3 == 0:
                main.no_reply += 1
            elif i % 97 == 0:
                main.dropped["lease lost"] += 1
            else:
                outbound.put(1)

    def io_side() -> IOSnapshot:  # IOThread.snapshot's way: the thread's own figures, then each feed's
        return combine_io(own.snapshot(), [FeedSnapshot("feed", True, "", feed.snapshot())])

    def snapshot() -> StatsSnapshot:  # Controller.stats()'s
        return whole_snapshot(main, io_side, at=0.0, compilations=0, devices=None, streams=(0, 0), checkpoints={})

    def observe() -> None:
        before = snapshot()
        while not done.is_set():
            now = snapshot()
            assert now.unanswered >= 0, f"{now.messages_in} in, {now.messages_out} answered, {now.no_reply} with " \
                                        f"no reply, {now.dropped_total} dropped"
            for name in ("messages_in", "frames_in", "messages_out", "processed", "no_reply", "dropped_total"):
                assert getattr(now, name) >= getattr(before, name), name
            before = now

    def both_sides() -> None:
        try:
            hammer([io_thread, main_thread])
        finally:
            done.set()

    hammer([both_sides, observe, observe])
    final = snapshot()
    assert (final.messages_in, final.unanswered, final.processed) == (messages, 0, messages)
    assert final.messages_out + final.no_reply + final.dropped_total == messages


def _write(outbound: queue.SimpleQueue[int], stats: IOStats, *, block: bool) -> None:
    """The IO thread's writer: results handed back, counted written."""
    try:
        stats.results_out += outbound.get(block=block, timeout=1.0 if block else None)
    except queue.Empty:
        pass

