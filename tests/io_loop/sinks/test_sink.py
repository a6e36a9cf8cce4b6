"""The public ``Sink`` seam (io_loop/sinks/sink.py) and the source → sink run (``forkless.SinkRun``): a
user's own sink fed by a real WebSocket feed on loopback (tests/servers.py), its books, its stop,
its failure, and the reply writer as the per-feed implementation of ``SinkBatch``."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

import forkless
from forkless.controller.config import Config
from tests.harness import UNIT_S, wait_until
from tests.servers import make_messages, send_frames

pytestmark = pytest.mark.timeout(60 * UNIT_S)

FEATURES = 3


def _config(url: str) -> Config:
    return Config(ws_url=url, features=FEATURES, status_s=0, heartbeat_s=0, reconnect_min_s=0.05,
                  reconnect_max_s=0.2, shutdown_timeout_s=10 * UNIT_S)


class Collecting:
    """A user's sink: writes every message it is handed into ``got``, a batch at a time."""

    name = "collect"

    def __init__(self) -> None:
        self.got: list[tuple[Any, str, list[float]]] = []
        self.feeds: set[str] = set()
        self.saw_stopping = False

    async def run(self, ctx: forkless.RecordContext) -> None:
        async for batch in ctx.batches():
            assert isinstance(batch, forkless.MessageBatch)
            self.feeds.add(batch.feed)
            self.got += [(seq, stream, list(x)) for seq, stream, x in batch.items]
            batch.wrote(len(batch))
        self.saw_stopping = ctx.stopping.is_set()


class _Running:
    """``SinkRun.run()`` on a thread of the test's own; ``finish()`` stops it and returns its outcome."""

    def __init__(self, run: forkless.SinkRun) -> None:
        self.run = run
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._body, daemon=True)
        self.thread.start()

    def _body(self) -> None:
        try:
            self.result = self.run.run()
        except BaseException as exc:
            self.error = exc

    def finish(self) -> Any:
        self.run.request_stop()
        self.thread.join(30 * UNIT_S)
        assert not self.thread.is_alive()
        return self.result


def test_a_user_sink_is_handed_every_message_in_order_and_its_books_balance(feed_server):
    messages = make_messages(300, streams=3, features=FEATURES, seed=5)
    server = feed_server(send_frames(messages))
    sink = Collecting()
    running = _Running(forkless.SinkRun(sink, config=_config(server.url)))
    wait_until(lambda: len(sink.got) >= len(messages), timeout_s=30 * UNIT_S, what="every message written")
    final = running.finish()
    assert running.error is None
    assert [(seq, stream) for seq, stream, _ in sink.got] == [(m["seq"], m["stream"]) for m in messages]
    assert np.allclose([x for _, _, x in sink.got], [m["x"] for m in messages])
    assert sink.feeds == {"0"} and sink.saw_stopping
    books = final.sink
    assert (books.taken, books.written, books.held, books.unwritten, dict(books.dropped)) == (300, 300, 0, 0, {})
    assert final.io.messages_in == 300


class Holding:
    """A sink that writes only the first ``write`` items of each batch, drops none, and returns."""

    name = "holding"

    def __init__(self, write: int) -> None:
        self.write = write
        self.taken = 0

    async def run(self, ctx: forkless.RecordContext) -> None:
        async for batch in ctx.batches():
            self.taken += len(batch)
            batch.wrote(min(self.write, len(batch)))


def test_what_a_sink_still_holds_when_it_returns_is_counted_unwritten_at_the_stop(feed_server):
    messages = make_messages(40, features=FEATURES, seed=6)
    server = feed_server(send_frames(messages))
    sink = Holding(write=0)
    running = _Running(forkless.SinkRun(sink, config=_config(server.url)))
    wait_until(lambda: sink.taken >= len(messages), timeout_s=30 * UNIT_S, what="every message taken")
    books = running.finish().sink
    assert running.error is None
    assert (books.taken, books.written, books.held, books.unwritten) == (40, 0, 0, 40)
    assert dict(books.dropped) == {"unwritten at the stop": 40}


class Dropping:
    name = "dropping"

    async def run(self, ctx: forkless.RecordContext) -> None:
        async for batch in ctx.batches():
            batch.wrote(1)
            batch.drop("not wanted")


def test_a_sink_that_drops_counts_the_rest_of_each_batch_by_its_reason(feed_server):
    messages = make_messages(25, features=FEATURES, seed=7)
    server = feed_server(send_frames(messages))
    running = _Running(forkless.SinkRun(Dropping(), config=_config(server.url)))
    wait_until(lambda: running.run.sink_stats.taken >= 25, timeout_s=30 * UNIT_S, what="every message taken")
    books = running.finish().sink
    assert books.taken == books.written + books.dropped["not wanted"] == 25
    assert books.written >= 1 and books.held == 0 and books.unwritten == 0


class Failing:
    name = "failing"

    async def run(self, ctx: forkless.RecordContext) -> None:
        async for _batch in ctx.batches():
            raise ConnectionRefusedError("the warehouse is closed")


def test_a_sink_that_raises_ends_the_run_with_feed_fatal_naming_it(feed_server):
    server = feed_server(send_frames(make_messages(5, features=FEATURES)))
    run = forkless.SinkRun(Failing(), config=_config(server.url))
    with pytest.raises(forkless.FeedFatal, match="sink 'failing' failed") as raised:
        run.run()
    assert isinstance(raised.value.__cause__, ConnectionRefusedError)
    assert run.sink_stats.unwritten == run.sink_stats.taken > 0  # what it held, counted


class Miscounting:
    name = "miscounting"

    def __init__(self) -> None:
        self.refused: list[str] = []

    async def run(self, ctx: forkless.RecordContext) -> None:
        async for batch in ctx.batches():
            for wrong in (len(batch) + 1, -1, 1.0, True, None):
                try:
                    batch.wrote(wrong)
                except (TypeError, ValueError) as exc:
                    self.refused.append(type(exc).__name__)
            batch.wrote(len(batch))


def test_a_wrong_count_of_items_written_is_refused_and_counts_nothing(feed_server):
    server = feed_server(send_frames(make_messages(3, features=FEATURES)))
    sink = Miscounting()
    running = _Running(forkless.SinkRun(sink, config=_config(server.url)))
    wait_until(lambda: running.run.sink_stats.written >= 3, timeout_s=30 * UNIT_S, what="3 written")
    books = running.finish().sink
    assert (books.taken, books.written) == (3, 3)
    per_batch = ["ValueError", "ValueError", "TypeError", "TypeError", "TypeError"]
    assert sink.refused and len(sink.refused) % 5 == 0 and sink.refused[:5] == per_batch


def test_an_object_without_a_name_and_run_is_refused_as_a_sink():
    with pytest.raises(TypeError, match="a sink is an object with a name"):
        forkless.SinkRun(object(), config=Config(features=FEATURES))


def test_the_reply_writer_is_the_per_feed_implementation_of_sink_batch():
    from forkless.io_loop.counters import IOStats
    from forkless.io_loop.crossing import Outgoing
    from forkless.io_loop.writer import HeldReply

    stats = IOStats()
    held = HeldReply(asyncio.Queue(), stats)
    held._took(Outgoing(["r1", "r2", "r3"], received_ns=[0, 0, 0]))  # a feed's batch of three results
    batch = forkless.ReplyBatch(held)
    assert isinstance(batch, forkless.SinkBatch)
    assert batch.items == ["r1", "r2", "r3"] and batch.positions is None
    batch.wrote(2)
    assert batch.items == ["r3"] and stats.results_out == 2
    assert isinstance(Collecting(), forkless.RecordSink)


def test_a_sink_run_is_ready_on_its_health_endpoint_once_its_feed_is_connected(feed_server):
    import urllib.error
    import urllib.request

    server = feed_server(send_frames(make_messages(5, features=FEATURES)))
    sink = Collecting()
    running = _Running(forkless.SinkRun(sink, config=_config(server.url).replace(metrics_addr="127.0.0.1:0")))
    wait_until(lambda: len(sink.got) >= 5 and running.run.io.metrics_url is not None, timeout_s=30 * UNIT_S,
               what="every message written, the health endpoints served")
    base = running.run.io.metrics_url.rstrip("/")
    with urllib.request.urlopen(f"{base}/readyz", timeout=10) as ready:
        assert ready.status == 200
    with urllib.request.urlopen(f"{base}/healthz", timeout=10) as healthy:
        assert healthy.status == 200
    assert running.finish().sink.written == 5 and running.error is None


class Swallowing:
    """A sink that never gets its writes acknowledged and swallows its cancellation (a retry loop that
    catches ``CancelledError`` too): the stop must still end, give it up and count what it held. When
    cancelled again (its loop closing, after it was given up) it says its batch is written: too late,
    that batch is counted unwritten already, and must not be counted twice."""

    name = "stubborn"

    def __init__(self) -> None:
        self.taken = 0
        self.cancels = 0

    async def run(self, ctx: forkless.RecordContext) -> None:
        async for batch in ctx.batches():
            self.taken += len(batch)
            while True:  # the write, retried whatever happens
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    self.cancels += 1
                    if self.cancels == 2:
                        batch.wrote(len(batch))


def test_a_sink_that_swallows_its_cancellation_is_given_up_at_the_deadline_and_every_message_is_counted(feed_server):
    messages = make_messages(400, features=FEATURES, seed=8)
    server = feed_server(send_frames(messages))
    sink = Swallowing()
    config = _config(server.url).replace(shutdown_timeout_s=1.0 * UNIT_S, queue_size=4, max_batch=4)
    run = forkless.SinkRun(sink, config=config)
    running = _Running(run)
    wait_until(lambda: sink.taken > 0 and run.view().io.messages_in >= 16, timeout_s=30 * UNIT_S,
               what="the sink holding a batch while the feed is read")
    final = running.finish()  # bounded: finish() fails if run() has not returned
    assert running.error is None and sink.cancels == 2 and not run.io.alive  # the thread ended: not left behind
    books, io = final.sink, final.io
    assert books.written == 0 and books.held == 0 and books.taken == books.unwritten == sink.taken
    # every message read: taken by the sink (and counted unwritten) or never handed to it
    assert io.messages_in == books.taken + io.dropped["not processed before the stop"], (io.messages_in, io.dropped)
