"""A controller's sinks (``Controller(sinks=[...])``, io_loop/sinks/results.py): each stepped batch's
results, as ``OnResults`` got them, handed to a user's ``ResultSink`` on the IO thread, over the one
outbound queue. Real parts: a WebSocket feed on loopback (tests/servers.py) or a user's own source,
the EWMA processor, a user's sink written against the public API only."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

import forkless
from forkless import EVENTS_ONLY, Config, Controller, FeedFatal, OnResults
from forkless.controller.ioside import feed_plan
from forkless.controller.processor import ewma_processor
from forkless.controller.stats import books_line, status_line
from tests.harness import UNIT_S, assert_books_balance, drive, quick_config, wait_until
from tests.servers import make_messages, parse_replies, send_frames

pytestmark = pytest.mark.timeout(90 * UNIT_S)

PROCESSOR = ewma_processor()
FEATURES = 4


def _config(**changes: Any) -> Config:
    return quick_config(features=FEATURES, **{"shutdown_timeout_s": 10.0 * UNIT_S, **changes})


class Collecting:
    """A user's sink: keeps every result it is handed, (feed, seq, stream, {output: row}), a batch at a time."""

    def __init__(self, name: str = "collect") -> None:
        self.name = name
        self.got: list[tuple[str, Any, str, dict[str, np.ndarray]]] = []
        self.kinds: set[type] = set()

    async def run(self, ctx: forkless.ResultContext) -> None:
        async for batch in ctx.batches():
            self.kinds.add(type(batch))
            self.got += batch.items
            batch.wrote(len(batch))


class Recording:
    """``on_results``: what it got, per message, as the sink's items are."""

    def __init__(self) -> None:
        self.got: list[tuple[Any, str, dict[str, np.ndarray]]] = []

    def __call__(self, seq: list, stream: list, outputs: dict[str, np.ndarray]) -> None:
        self.got += [(s, k, {name: np.array(rows[i]) for name, rows in outputs.items()})
                     for i, (s, k) in enumerate(zip(seq, stream))]


def _same(sink_items: list, recorded: list, feed: str) -> None:
    assert [(f, s, k) for f, s, k, _ in sink_items] == [(feed, s, k) for s, k, _ in recorded]
    for (_, _, _, row), (_, _, expected) in zip(sink_items, recorded):
        assert row.keys() == expected.keys()
        for name in row:
            np.testing.assert_array_equal(row[name], expected[name])


def _books(ctl: Controller, name: str) -> forkless.SinkStats:
    return dict(ctl.stats().sinks)[name]


def test_every_result_reaches_a_users_sink_in_order_with_the_values_on_results_got(feed_server):
    messages = make_messages(120, features=FEATURES)
    server = feed_server(send_frames(messages))
    sink, recorded = Collecting(), Recording()
    with Controller(_config(ws_url=server.url), processor=PROCESSOR, sinks=[OnResults(recorded), sink]) as ctl:
        drive(ctl, lambda: ctl.stats().processed >= 120, timeout_s=30 * UNIT_S, what="120 messages processed")
    assert [seq for _, seq, _, _ in sink.got] == [m["seq"] for m in messages]  # every one, in order
    _same(sink.got, recorded.got, "0")
    assert sink.kinds == {forkless.ResultBatch}
    results, _ = parse_replies(server.received)  # the feed's replies still go back on its connection
    assert sorted(results) == [m["seq"] for m in messages]
    books = _books(ctl, "collect")
    assert (books.taken, books.written, dict(books.dropped), books.held, books.unwritten) == (120, 120, {}, 0, 0)
    assert "sink 'collect': taken 120 = written 120 + dropped 0 + held 0" in books_line(ctl.stats())
    assert " | sink collect written 120 held 0 | " in status_line(ctl.stats(), None)  # the periodic line too
    assert ctl.stats().unsent == 0  # the feed's replies routed through its outbox are counted once
    assert_books_balance(ctl)


def test_results_reach_every_sink_even_when_the_feed_wants_no_replies(feed_server):
    messages = make_messages(40, features=FEATURES)
    server = feed_server(send_frames(messages))
    first, second = Collecting("first"), Collecting("second")
    with Controller(_config(ws_url=server.url, replies="none"), processor=PROCESSOR,
                    sinks=[first, second]) as ctl:
        drive(ctl, lambda: ctl.stats().processed >= 40, timeout_s=30 * UNIT_S, what="40 messages processed")
    assert [seq for _, seq, _, _ in first.got] == [m["seq"] for m in messages]
    assert [(f, s, k) for f, s, k, _ in second.got] == [(f, s, k) for f, s, k, _ in first.got]
    assert parse_replies(server.received) == ({}, [])  # no frame went back
    assert _books(ctl, "first").written == _books(ctl, "second").written == 40


class Emitting:
    """A user's source: emits ``n`` messages (awaiting while inbound is full), then waits for the stop."""

    name = "mine"

    def __init__(self, n: int) -> None:
        self.messages = make_messages(n, features=FEATURES)

    async def run(self, ctx: Any) -> None:
        import json

        for m in self.messages:
            await ctx.emit(json.dumps(m))
        async for _ in ctx.outgoing():
            pass


class HeldUntilStop:
    """A sink that takes nothing until the stop begins, then writes everything: the stop delivers it."""

    name = "late"

    def __init__(self) -> None:
        self.got: list[Any] = []
        self.took_before_stop = 0

    async def run(self, ctx: forkless.ResultContext) -> None:
        await ctx.stopping.wait()
        async for batch in ctx.batches():
            for _, seq, _, _ in batch.items:  # one write a result, each a turn of the loop (a server's round trip)
                await asyncio.sleep(0.001)
                self.got.append(seq)
                batch.wrote(1)


def test_the_stop_delivers_the_results_a_sink_had_not_taken_yet():
    source, sink = Emitting(50), HeldUntilStop()
    with Controller(_config(), processor=PROCESSOR, sources=[source], sinks=[sink]) as ctl:
        drive(ctl, lambda: ctl.stats().processed >= 50, timeout_s=30 * UNIT_S, what="50 messages processed")
        assert _books(ctl, "late").taken == 0
    assert sink.got == [m["seq"] for m in source.messages]
    books = _books(ctl, "late")
    assert (books.taken, books.written, books.unwritten, books.held) == (50, 50, 0, 0)
    assert_books_balance(ctl)


class Raising:
    name = "bad"

    async def run(self, ctx: forkless.ResultContext) -> None:
        async for batch in ctx.batches():
            batch.wrote(1)
            raise RuntimeError("the database is gone")


def test_a_sink_that_raises_ends_the_run_with_feed_fatal_naming_it():
    with pytest.raises(FeedFatal, match="sink 'bad' failed: RuntimeError\\('the database is gone'\\)") as caught:
        with Controller(_config(), processor=PROCESSOR, sources=[Emitting(20)], sinks=[Raising()]) as ctl:
            drive(ctl, lambda: False, timeout_s=30 * UNIT_S, what="the sink's failure")
    assert isinstance(caught.value.__cause__, RuntimeError)
    books = _books(ctl, "bad")
    assert books.written == 1 and books.taken == books.written + sum(books.dropped.values())  # held: counted


class Exiting:
    name = "exits"

    async def run(self, ctx: forkless.ResultContext) -> None:
        async for batch in ctx.batches():
            batch.wrote(len(batch))
            raise SystemExit(7)


def test_a_sink_that_raises_system_exit_ends_the_run_with_feed_fatal_naming_it_and_the_process_goes_on():
    with pytest.raises(FeedFatal, match=r"sink 'exits' failed: SystemExit\(7\)") as caught:
        with Controller(_config(), processor=PROCESSOR, sources=[Emitting(20)], sinks=[Exiting()]) as ctl:
            drive(ctl, lambda: False, timeout_s=30 * UNIT_S, what="the sink's failure")
    assert isinstance(caught.value.__cause__, SystemExit) and caught.value.__cause__.code == 7
    books = _books(ctl, "exits")
    assert books.written > 0 and books.taken == books.written + sum(books.dropped.values())


class Gated:
    """A slow sink: takes nothing until ``open()`` (from any thread), then writes everything."""

    name = "slow"

    def __init__(self) -> None:
        self.got: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gate: asyncio.Event | None = None
        self.ready = threading.Event()

    async def run(self, ctx: forkless.ResultContext) -> None:
        self._loop, self._gate = asyncio.get_running_loop(), asyncio.Event()
        self.ready.set()
        await self._gate.wait()
        async for batch in ctx.batches():
            self.got += [seq for _, seq, _, _ in batch.items]
            batch.wrote(len(batch))

    def open(self) -> None:
        self.ready.wait()
        self._loop.call_soon_threadsafe(self._gate.set)


def test_a_slow_sink_holds_outbound_back_and_loses_nothing():
    """While the sink takes nothing, its queue and then outbound fill (the main thread's put waits), so
    results wait rather than being dropped; once it takes them, every one arrives, in order."""
    n, queue_size = 400, 2
    source, sink = Emitting(n), Gated()
    with Controller(_config(queue_size=queue_size, max_batch=4, max_wait_ms=0.0), processor=PROCESSOR,
                    sources=[source], sinks=[sink]) as ctl:
        opened: list[str] = []

        def open_when_full() -> None:  # outbound full: the writer is held back by the sink
            wait_until(lambda: ctl.stats().outbound_depth >= queue_size, timeout_s=30 * UNIT_S, what="outbound full")
            snap = ctl.stats()
            opened.append(f"{snap.processed} {snap.dropped_total} {_books(ctl, 'slow').taken}")
            sink.open()

        opener = threading.Thread(target=open_when_full, daemon=True)
        opener.start()
        drive(ctl, lambda: len(sink.got) >= n, timeout_s=60 * UNIT_S, what="every result written by the sink")
        opener.join(10 * UNIT_S)
    processed, dropped, taken = map(int, opened[0].split())
    assert processed < n and dropped == 0 and taken == 0  # held back, nothing dropped, nothing taken yet
    assert sink.got == [m["seq"] for m in source.messages]
    books = _books(ctl, "slow")
    assert (books.taken, books.written, dict(books.dropped)) == (n, n, {})
    assert_books_balance(ctl)


def test_sinks_are_checked_when_the_controller_is_built():
    with pytest.raises(TypeError, match="a sink is an object with a name"):
        feed_plan(Config(), (), sinks=[object()])
    with pytest.raises(ValueError, match="two sinks are named alike"):
        feed_plan(Config(), (), sinks=[Collecting("a"), Collecting("a")])
    with pytest.raises(ValueError, match=r"processor=forkless\.EVENTS_ONLY runs no processor, so there are no results"):
        Controller(_config(), processor=EVENTS_ONLY, sources=[Emitting(1)], sinks=[Collecting()])


def _stopped_once_outbound_is_full(sink: Any, n: int = 400, queue_size: int = 2) -> Controller:
    """A run of ``n`` messages into ``sink`` (which takes nothing), stopped by ``request_stop()`` once
    outbound is full (the main thread's put waits), with a stop deadline of 1 s; the stopped controller."""
    ctl = Controller(_config(queue_size=queue_size, max_batch=4, max_wait_ms=0.0, shutdown_timeout_s=1.0 * UNIT_S),
                     processor=PROCESSOR, sources=[Emitting(n)], sinks=[sink])

    def stop_when_full() -> None:
        wait_until(lambda: ctl.stats().outbound_depth >= queue_size, timeout_s=30 * UNIT_S, what="outbound full")
        ctl.request_stop()

    with ctl:
        stopper = threading.Thread(target=stop_when_full, daemon=True)
        stopper.start()
        drive(ctl, lambda: not stopper.is_alive(), timeout_s=60 * UNIT_S, what="the stop asked")
    return ctl


def test_results_a_sink_still_holds_when_the_stop_deadline_passes_are_counted_unwritten():
    """A sink that never takes: the stop waits for it until its deadline, then the IO side is aborted;
    every result is accounted for, in the sink's books (unwritten) or as never handed over."""
    ctl = _stopped_once_outbound_is_full(Gated())  # never opened
    snap = ctl.stats()
    books = dict(snap.sinks)["slow"]
    assert books.written == 0 and books.held == 0
    assert books.taken == books.unwritten == books.dropped["unwritten at the stop"] > 0
    assert books.taken + snap.sink_results_unsent == snap.processed  # every result: in the books or never handed over
    assert "sink 'slow': taken" in books_line(snap)
    assert not ctl.abandoned_io  # the abort ended the IO thread: a writer waiting on its outbox ended too
    assert_books_balance(ctl)


class Named(Emitting):
    def __init__(self, name: str, n: int, start: int) -> None:
        self.name = name
        self.messages = make_messages(n, features=FEATURES, start=start)


def test_each_result_names_the_feed_its_message_came_from():
    first, second, sink = Named("left", 30, 0), Named("right", 30, 1000), Collecting()
    recorded = Recording()
    with Controller(_config(), processor=PROCESSOR, sources=[first, second], sinks=[OnResults(recorded), sink]) as ctl:
        drive(ctl, lambda: ctl.stats().processed >= 60, timeout_s=30 * UNIT_S, what="60 messages processed")
    by_feed = {name: [seq for feed, seq, _, _ in sink.got if feed == name] for name in ("left", "right")}
    assert by_feed == {"left": list(range(30)), "right": list(range(1000, 1030))}  # each feed's in its order
    assert [(s, k) for _, s, k, _ in sink.got] == [(s, k) for s, k, _ in recorded.got]
    assert_books_balance(ctl)


class Quitting:
    """A sink that writes its first batch and returns: what comes after is counted, never waited for."""

    name = "quits"

    async def run(self, ctx: forkless.ResultContext) -> None:
        batch = await ctx.next_batch()
        batch.wrote(len(batch))


def test_results_after_a_sink_returned_are_counted_sink_ended_and_the_run_goes_on():
    source = Emitting(100)
    with Controller(_config(max_batch=4, queue_size=2), processor=PROCESSOR, sources=[source],
                    sinks=[Quitting()]) as ctl:
        drive(ctl, lambda: ctl.stats().messages_out >= 100, timeout_s=30 * UNIT_S, what="100 replies written")
    snap = ctl.stats()
    books = dict(snap.sinks)["quits"]
    assert books.taken == snap.processed == 100 and books.written > 0
    assert books.written + books.dropped["sink ended"] == 100 and books.unwritten == 0
    assert_books_balance(ctl)


def test_a_jetstream_feeds_results_reach_the_sink_and_its_replies_are_still_published(nats_server):
    import json

    from tests.natsserver import create_streams, publish, read_stream

    create_streams(nats_server.url)
    messages = make_messages(80, streams=4, seed=5)
    seqs = publish(nats_server.url, lambda i: f"ticks.s{i % 4}", [json.dumps(m) for m in messages])
    feed = {"name": "ticks", "nats": nats_server.url, "stream": "TICKS", "subject": "ticks.>", "results": "scores"}
    sink = Collecting()
    with Controller(_config(feeds=json.dumps([feed])), processor=PROCESSOR, sinks=[sink]) as ctl:
        drive(ctl, lambda: ctl.stats().messages_out >= 80 and len(sink.got) >= 80, timeout_s=30 * UNIT_S,
              what="80 replies published and 80 results in the sink")
    assert [(f, s) for f, s, _, _ in sink.got] == [("ticks", m["seq"]) for m in messages]
    ids = [headers["Nats-Msg-Id"] for headers, _ in read_stream(nats_server.url, "SCORES")]
    assert ids == [f"TICKS:{s}:0" for s in seqs]  # each reply published once, named by its input
    assert _books(ctl, "collect").written == 80
    assert_books_balance(ctl)


def test_the_duration_ends_a_run_whose_sink_takes_nothing_and_the_books_balance():
    """FORKLESS_DURATION is a stop requested when it is over, whatever the main thread waits on: here to
    hand a batch to a sink that takes nothing (outbound full). run() returns, and every result is in the
    sink's books or counted as never handed over."""
    n, queue_size, duration_s = 400, 2, 2.0 * UNIT_S
    source, sink = Emitting(n), Gated()  # never opened
    ctl = Controller(_config(queue_size=queue_size, max_batch=4, max_wait_ms=0.0, shutdown_timeout_s=1.0 * UNIT_S,
                             duration_s=duration_s), processor=PROCESSOR, sources=[source], sinks=[sink])
    returned, rescued = threading.Event(), []

    def watchdog() -> None:  # a run() that never returns fails the test instead of hanging it
        if not returned.wait(duration_s + 60 * UNIT_S):
            snap = ctl.stats()
            rescued.append(f"processed {snap.processed}, outbound depth {snap.outbound_depth}")
            ctl.request_stop()

    threading.Thread(target=watchdog, daemon=True).start()
    ctl.run()
    returned.set()
    assert not rescued, f"run() went on past its duration ({rescued[0]})"
    snap = ctl.stats()
    books = dict(snap.sinks)["slow"]
    assert books.written == 0 and books.held == 0 and books.taken == books.unwritten
    # the main thread was waiting on outbound when the duration ended: the batch it held was never handed over
    assert snap.sink_results_unsent > 0 and snap.dropped["outbound full at stop"] > 0
    assert books.taken + snap.sink_results_unsent == snap.processed
    assert not ctl.abandoned_io  # the abort at the deadline ended the IO thread
    assert_books_balance(ctl)


class Swallowing:
    """A sink of results that never gets its writes acknowledged and swallows its cancellation."""

    name = "stubborn"

    def __init__(self) -> None:
        self.cancels = 0

    async def run(self, ctx: forkless.ResultContext) -> None:
        async for _batch in ctx.batches():
            while True:  # the write, retried whatever happens
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    self.cancels += 1


def test_a_sink_that_swallows_its_cancellation_is_given_up_at_the_deadline_and_every_result_is_counted():
    sink = Swallowing()
    ctl = _stopped_once_outbound_is_full(sink)
    assert sink.cancels >= 1 and not ctl.abandoned_io  # given up, and the IO thread ended all the same
    snap = ctl.stats()
    books = dict(snap.sinks)["stubborn"]
    assert books.written == 0 and books.held == 0 and books.taken == books.unwritten > 0
    assert books.taken + snap.sink_results_unsent == snap.processed  # every result: in the books or never handed over
    assert_books_balance(ctl)
