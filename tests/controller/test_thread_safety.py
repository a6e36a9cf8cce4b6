"""The main thread's objects that other threads touch too, hammered from many threads at once
(tests/races.py): the logs' flood guard, which every thread's warnings pass through, and the books
``Controller.stats()`` reads while the IO thread and the main thread count (DESIGN.md, "What the
threads share")."""

from __future__ import annotations

import logging

import pytest

from forkless.controller.logs import RateLimitFilter
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

    def log_distinct(offset: int) -> None:
        for i in range(4000):
            guard.filter(_warning(f"warning {(i + offset) % 8}"))

    hammer([lambda offset=offset: log_distinct(offset) for offset in range(THREADS)])
    assert len(guard.flush()) <= 4
