"""A source -> sink run's view read from any thread while the IO side and the sink count
(tests/races.py; DESIGN.md, "What the threads share")."""

from __future__ import annotations

import threading

import pytest

from forkless.controller.config import Config
from forkless.controller.lifetime.sinkrun import SinkRun
from tests.races import hammer

pytestmark = pytest.mark.threads


def test_a_sink_runs_view_never_shows_more_written_than_read():
    """A source → sink run's view (its status line's ``read N written M``, any thread): a message is counted
    read by the IO side before the sink takes and writes it, and the view reads the sink's books first."""
    run = SinkRun(_Sink(), config=Config())
    done = threading.Event()

    def count() -> None:
        try:
            for _ in range(50_000):
                run.io_stats.messages_in += 1
                run.sink_stats.taken += 1
                run.sink_stats.written += 1
        finally:
            done.set()

    def look() -> None:
        while not done.is_set():
            view = run.view()
            assert view.sink.written <= view.io.messages_in, (view.sink.written, view.io.messages_in)

    hammer([count, look, look])


class _Sink:
    name = "books"

    async def run(self, ctx) -> None:  # never run: the view is read from counters the test writes
        pass
