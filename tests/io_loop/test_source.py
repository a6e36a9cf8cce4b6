"""The public ``Source`` protocol (io_loop/source.py): a user's own client on the IO thread.

Each source here is written against the public API only (``controller.Source``: a ``name`` and
``async run(ctx)``), as a user would write it, and talks to a real loopback server written with
another library (``websockets``) than the client (aiohttp). One ``Processor`` is shared so the
step compiles once for the file. Exactly-once across ``kill -9`` is tests/io_loop/test_source_restart.py's.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import aiohttp
import pytest

from forkless import Config, Controller, FeedFatal, OnResults, SourceStopped
from forkless.controller.ioside import feed_plan
from forkless.controller.processor import ewma_processor
from tests.harness import UNIT_S, assert_books_balance, drive, quick_config
from tests.servers import make_messages, parse_replies, send_frames

pytestmark = pytest.mark.timeout(90 * UNIT_S)

PROCESSOR = ewma_processor()
FEATURES = 4


def _config(**changes: Any) -> Config:
    return quick_config(features=FEATURES, **changes)


class WsSource:
    """A user's client: connects with aiohttp, hands every frame to the codec, answers the
    server's JSON pings itself, writes what the main thread sends."""

    def __init__(self, url: str, name: str = "mine", replies: str = "all") -> None:
        self.url, self.name, self.replies = url, name, replies

    async def run(self, ctx: Any) -> None:
        async with aiohttp.ClientSession() as http, http.ws_connect(self.url) as ws:
            async def read() -> None:
                async for msg in ws:
                    data = json.loads(msg.data)
                    if isinstance(data, dict) and data.get("type") == "ping":
                        await ws.send_str(json.dumps({"type": "pong", "id": data["id"]}))
                        ctx.count("pongs")
                    elif not ctx.stopping.is_set():
                        await ctx.emit(msg.data)

            reader = asyncio.create_task(read())
            async for frame in ctx.outgoing():
                await ws.send_str(frame.decode() if isinstance(frame, bytes) else frame)
            reader.cancel()


def test_a_users_own_client_feeds_the_processor_and_every_message_is_answered_on_its_connection(feed_server):
    messages = make_messages(60, features=FEATURES)
    pings = [{"type": "ping", "id": i} for i in range(3)]
    server = feed_server(send_frames([*pings[:1], *messages[:30], *pings[1:], *messages[30:]]), impl="websockets")
    with Controller(_config(), processor=PROCESSOR, sources=[WsSource(server.url)]) as ctl:
        drive(ctl, lambda: ctl.stats().messages_out >= 60, timeout_s=30 * UNIT_S, what="60 results written")
        server.wait_for(lambda: len(server.received) >= 63, 10 * UNIT_S, "60 results and 3 pongs received")
    results, errors = parse_replies([f for f in server.received if '"pong"' not in f])
    assert sorted(results) == [m["seq"] for m in messages] and all(len(r) == 1 for r in results.values())
    assert errors == []
    pongs = [json.loads(f) for f in server.received if '"pong"' in f]
    assert [p["id"] for p in pongs] == [0, 1, 2]
    snap = ctl.stats()
    assert snap.counts == {"pongs": 3} and snap.errors_total == 0  # a heartbeat is no error
    assert snap.feeds[0].name == "mine" and snap.feeds[0].io.messages_in == 60
    assert_books_balance(ctl)
    from forkless.controller.metrics import metric_families  # /metrics counts it as it counts a built-in feed

    samples = {(m.name, tuple(sorted(x.labels.items()))): x.value for m in metric_families(snap) for x in m.samples}
    assert samples[("forkless_source_counts", (("feed", "mine"), ("what", "pongs")))] == 3
    assert samples[("forkless_messages", (("direction", "in"), ("feed", "mine")))] == 60


class EventSource:
    """Hands objects over as they are, then waits for the stop."""

    name = "events"

    def __init__(self, events: list[Any]) -> None:
        self.events = events
        self.sent: list[Any] = []

    async def run(self, ctx: Any) -> None:
        for event in self.events:
            await ctx.emit_event(event)
        async for frame in ctx.outgoing():
            self.sent.append(frame)


def test_events_reach_on_event_as_they_are_in_order_without_a_processor_step():
    book = {"type": "book", "symbol": "BTCUSDT", "bids": [["37000.10", "0.5"]] * 5, "asks": [["37000.20", "1"]] * 5}
    events = [{"type": "trade", "price": "37000.1000000000", "seq": i} for i in range(200)] + [book, ("a", 1)]
    got: list[tuple[str, Any]] = []
    with Controller(_config(), processor=PROCESSOR, sources=[EventSource(events)],
                    on_event=lambda source, event: got.append((source, event))) as ctl:
        drive(ctl, lambda: len(got) >= len(events), timeout_s=20 * UNIT_S, what="every event delivered")
    assert got == [("events", e) for e in events]
    assert got[0][1]["price"] == "37000.1000000000"  # the text as it was, no float round trip
    snap = ctl.stats()
    assert (snap.events_in, snap.events, snap.events_unhandled, snap.processed, snap.errors_total) == \
        (len(events), len(events), 0, 0, 0)


def test_events_with_no_on_event_are_counted_not_lost_silently(caplog):
    with Controller(_config(), processor=PROCESSOR, sources=[EventSource(list(range(5)))]) as ctl:
        drive(ctl, lambda: ctl.stats().events_unhandled >= 5, timeout_s=20 * UNIT_S, what="5 events counted")
    assert "has no on_event" in caplog.text


def test_send_hands_a_frame_to_the_source_at_once_with_no_message_flowing():
    source = EventSource([])
    with Controller(_config(), processor=PROCESSOR, sources=[source]) as ctl:
        ctl.send("events", {"type": "order", "qty": "0.001"})
        ctl.send("events", ["a", b"b"])
        drive(ctl, lambda: len(source.sent) >= 3, timeout_s=10 * UNIT_S, what="the sent frames yielded")
        assert ctl.stats().processed == 0  # no batch carried them
        with pytest.raises(ValueError, match="no feed or source is named 'nope'"):
            ctl.send("nope", "x")
    assert source.sent == ['{"type":"order","qty":"0.001"}', "a", b"b"]
    snap = ctl.stats()
    assert snap.sent_out == 3 and snap.sent_unsent == 0 and snap.messages_out == 0 and snap.errors_out == 0


def test_send_writes_a_frame_to_a_configured_websocket_feed_beside_a_source(feed_server):
    server = feed_server(impl="websockets")
    source = EventSource([{"hello": 1}])
    got: list[Any] = []
    with Controller(_config(ws_url=server.url), processor=PROCESSOR, sources=[source],
                    on_event=lambda s, e: got.append(e)) as ctl:
        server.wait_for(lambda: len(server.connections) == 1, 10 * UNIT_S, "the feed connected")
        ctl.send("0", '{"op":"order"}')
        server.wait_for(lambda: server.received == ['{"op":"order"}'], 10 * UNIT_S, "the order received")
        drive(ctl, lambda: got == [{"hello": 1}], timeout_s=10 * UNIT_S, what="the source's event")
        assert [feed.name for feed in ctl.stats().feeds] == ["0", "events"]
    assert ctl.stats().sent_out == 1


class RowsSource:
    """Hands messages over already decoded (``emit_rows``), then waits for the stop."""

    name = "rows"

    def __init__(self, batches: list[tuple[list[int], list[str], Any]]) -> None:
        self.batches = batches
        self.answers: list[Any] = []  # not `replies`: that attribute is the source's reply policy

    async def run(self, ctx: Any) -> None:
        for seq, stream, x in self.batches:
            await ctx.emit_rows(seq, stream, x)
        async for frame in ctx.outgoing():
            self.answers.append(json.loads(frame))


class ReadPassSource:
    """A user's client that hands the frames of each read over together (``emit(frames)``)."""

    name = "reads"

    def __init__(self, reads: list[list[str]]) -> None:
        self.reads = reads
        self.answers: list[Any] = []

    async def run(self, ctx: Any) -> None:
        for frames in self.reads:
            await ctx.emit(frames)
        async for frame in ctx.outgoing():
            self.answers.append(json.loads(frame))


@pytest.mark.parametrize("own_codec", [False, True], ids=["json-codec", "users-codec"])
def test_frames_emitted_together_are_answered_as_if_emitted_one_by_one_a_bad_one_on_its_own(own_codec):
    from forkless.controller.codec import JsonCodec

    class CountingCodec(JsonCodec):  # a user's codec: its decode is called a frame at a time
        calls = 0

        def decode(self, frame: Any) -> Any:
            CountingCodec.calls += 1
            return super().decode(frame)

    messages = make_messages(12, features=FEATURES)
    good = [json.dumps(m) for m in messages]
    reads = [good[:6], [*good[6:9], '{"seq": 99, "stream": "s0"}', *good[9:]], [json.dumps(messages[0] | {"seq": 100})]]
    source = ReadPassSource(reads)
    codec = CountingCodec(FEATURES) if own_codec else None
    with Controller(_config(), processor=PROCESSOR, sources=[source], codec=codec) as ctl:
        drive(ctl, lambda: len(source.answers) >= 14, timeout_s=20 * UNIT_S, what="14 replies")
    assert_books_balance(ctl)
    assert [a["seq"] for a in source.answers if "error" not in a] == [m["seq"] for m in messages] + [100]
    assert [a for a in source.answers if "error" in a] == [{"error": "missing field: x", "seq": 99}]
    snap = ctl.stats()
    assert (snap.messages_in, snap.feeds[0].io.frames_in, snap.errors) == (13, 14, {"missing field: x": 1})
    if own_codec:
        assert CountingCodec.calls == 14  # the user's decode, a frame at a time


def test_rows_a_source_decoded_itself_are_processed_and_answered_in_the_processor_dtype():
    import numpy as np

    seen: list[Any] = []
    rows = [([i, i + 1], ["a", "b"], [[float(i)] * FEATURES, [0.1] * FEATURES]) for i in range(0, 20, 2)]
    source = RowsSource(rows)
    with Controller(_config(), processor=PROCESSOR, sources=[source],
                    sinks=[OnResults(lambda seq, stream, outputs: seen.extend(seq))]) as ctl:
        drive(ctl, lambda: len(source.answers) >= 20, timeout_s=20 * UNIT_S, what="20 replies yielded")
    assert sorted(seen) == list(range(20)) and sorted(r["seq"] for r in source.answers) == list(range(20))
    snap = ctl.stats()
    assert (snap.messages_in, snap.processed, snap.errors_total) == (20, 20, 0)
    # x is built in the codec's (the processor's) dtype: float64 values are not rounded through float32
    from types import SimpleNamespace

    from forkless.controller.codec import GuardedCodec, JsonCodec
    from forkless.io_loop.source import SourceContext

    class Runner:  # the parts of a SourceRunner emit_rows uses: its codec's dtype, then take()
        feed, features = SimpleNamespace(name="rows"), 1
        codec = GuardedCodec(JsonCodec(1, dtype=np.float64), 1, dtype=np.float64)
        got: Any = None

        def enter(self) -> None: ...

        def leave(self) -> None: ...

        async def take(self, rows: Any, received: int, origins: Any) -> int:
            Runner.got = rows.x
            return len(rows)

    asyncio.run(SourceContext(Runner(), None, None).emit_rows([1], ["a"], [[37000.10]]))
    assert Runner.got.dtype == np.float64 and Runner.got[0, 0] == 37000.10


def test_rows_of_the_wrong_shape_fail_the_source_with_a_clear_error():
    source = RowsSource([([1, 2], ["a", "b"], [[1.0] * (FEATURES + 1)] * 2)])
    with pytest.raises(FeedFatal, match=r"emit_rows takes seq and stream of one length n and x of shape \(n, 4\)"), \
            Controller(_config(), processor=PROCESSOR, sources=[source]) as ctl:
        drive(ctl, lambda: False, timeout_s=10 * UNIT_S, what="the failure raised")


class PositionedSource:
    """Decodes each frame itself (``ctx.decode``), drops its elements of stream "skip" as a user's
    filter would, hands the rest over at the frame's position (``emit``; the first frame
    from its second message on, as a source resuming inside it does), and writes its replies a
    batch at a time, keeping each frame's position and giving up the error replies to bad input."""

    name = "positioned"
    replayable = True

    def __init__(self, frames: list[str]) -> None:
        self.frames = frames
        self.written: list[tuple[Any, int, int]] = []  # (reply, position, index)

    async def run(self, ctx: Any) -> None:
        for position, frame in enumerate(self.frames, start=1):
            decoded = ctx.decode(frame)
            await ctx.emit(decoded, position, first=1 if position == 1 else 0)
        async for batch in ctx.replies():
            if not batch.answers:
                batch.drop("error replies not wanted")
                continue
            self.written += [(json.loads(f), o.seq, o.index) for f, o in zip(batch.frames, batch.positions)]
            batch.wrote(len(batch.frames))


def test_a_source_hands_over_what_it_decoded_itself_at_positions_and_its_replies_carry_them():
    messages = make_messages(9, features=FEATURES)
    frames = [json.dumps(messages[i:i + 3]) for i in range(0, 9, 3)]
    frames[2] = json.dumps([*messages[6:9], {"seq": 99}])  # a bad element: its error reply is index 3
    source = PositionedSource(frames)
    with Controller(_config(), processor=PROCESSOR, sources=[source]) as ctl:
        drive(ctl, lambda: len(source.written) >= 8, timeout_s=20 * UNIT_S, what="8 replies written")
    by_seq = {reply["seq"]: (position, index) for reply, position, index in source.written}
    assert by_seq == {m["seq"]: (1 + i // 3, i % 3) for i, m in enumerate(messages) if i}  # frame 1 from index 1
    snap = ctl.stats()
    assert (snap.messages_in, snap.feeds[0].io.frames_in) == (8, 3)
    assert sum(snap.errors.values()) == 1
    assert snap.feeds[0].io.dropped == {"error replies not wanted": 1}


def test_a_replayable_source_is_never_dropped_from_even_with_overflow_drop_oldest():
    from forkless.controller.codec import JsonCodec
    from forkless.io_loop.counters import IOStats
    from forkless.io_loop.source import SourceRunner

    cfg = _config(overflow="drop_oldest")
    feed = feed_plan(cfg, [EventSource([])]).specs[0]
    kinds = {}
    for source in (EventSource([]), PositionedSource([])):
        io = cfg.io_settings()
        runner = SourceRunner(source, io.limits, JsonCodec(FEATURES), IOStats(), feed, features=io.features,
                              max_batch=io.max_batch, timeouts=io.timeouts,
                              inbound=asyncio.Queue(), outbox=asyncio.Queue(), index=0)
        kinds[type(source).__name__] = runner.handover.drop_oldest
    assert kinds == {"EventSource": True, "PositionedSource": False}


def test_error_replies_of_the_frame_resumed_inside_keep_the_ids_a_full_replay_gives():
    from forkless.controller.codec import JsonCodec
    from forkless.io_loop.counters import IOStats
    from forkless.io_loop.crossing import Origin
    from forkless.io_loop.source import SourceRunner

    cfg = _config()
    feed = feed_plan(cfg, [EventSource([])]).specs[0]
    good = make_messages(2, features=FEATURES)
    frame = json.dumps([good[0], good[1], {"seq": 99}])  # two good messages, then a bad one

    async def run(resume: Any) -> tuple[list[Origin], list[Origin]]:
        inbound, outbox = asyncio.Queue(), asyncio.Queue()
        io = cfg.io_settings()
        runner = SourceRunner(EventSource([]), io.limits, JsonCodec(FEATURES), IOStats(), feed, features=io.features,
                              max_batch=io.max_batch, timeouts=io.timeouts,
                              inbound=inbound, outbox=outbox, index=0, resume=resume)
        await runner.ctx.emit(frame, 5)
        await runner.handover.flush()
        return inbound.get_nowait().origin, outbox.get_nowait().origin

    whole = asyncio.run(run(None))
    resumed = asyncio.run(run(Origin(5, 0, False)))  # the restored state holds message 0 of the frame
    assert whole == ([Origin(5, 0, False), Origin(5, 1, True)], [Origin(5, 2, True)])
    assert resumed == ([Origin(5, 1, True)], [Origin(5, 2, True)])  # the error reply's id as in the whole frame


class FailingSource:
    name = "failing"

    async def run(self, ctx: Any) -> None:
        await asyncio.sleep(0.05)
        raise_the_users_error()


def raise_the_users_error() -> None:
    raise RuntimeError("the exchange said no")


def test_a_source_that_raises_reaches_the_main_thread_with_its_traceback():
    with pytest.raises(FeedFatal, match="source 'failing' failed: RuntimeError: the exchange said no") as info, \
            Controller(_config(), processor=PROCESSOR, sources=[FailingSource()]) as ctl:
        drive(ctl, lambda: False, timeout_s=10 * UNIT_S, what="the failure raised")
    cause = info.value.__cause__
    assert isinstance(cause, RuntimeError)
    frames = [frame.name for frame in __import__("traceback").extract_tb(cause.__traceback__)]
    assert "raise_the_users_error" in frames


class StopWatcher:
    """Emits until the stop begins, then records what an emit does."""

    name = "watcher"

    def __init__(self) -> None:
        self.after_stop: list[str] = []
        self.emitted = 0

    async def run(self, ctx: Any) -> None:
        async def feed() -> None:
            i = 0
            while not ctx.stopping.is_set():
                await ctx.emit(json.dumps({"seq": i, "stream": "s", "x": [1.0] * FEATURES}))
                self.emitted += 1
                i += 1
                await asyncio.sleep(0.002)
            try:
                await ctx.emit(json.dumps({"seq": -1, "stream": "s", "x": [1.0] * FEATURES}))
                self.after_stop.append("taken")
            except SourceStopped:
                self.after_stop.append("SourceStopped")

        task = asyncio.create_task(feed())
        async for _ in ctx.outgoing():
            pass
        await task


def test_the_stop_ends_a_source_in_order_and_an_emit_after_it_began_is_refused():
    source = StopWatcher()
    with Controller(_config(), processor=PROCESSOR, sources=[source]) as ctl:
        drive(ctl, lambda: ctl.stats().processed >= 20, timeout_s=20 * UNIT_S, what="20 messages processed")
    assert source.after_stop == ["SourceStopped"]
    snap = ctl.stats()
    assert snap.messages_in == source.emitted == snap.processed  # nothing emitted was lost
    assert snap.messages_out == source.emitted and snap.unanswered == 0


def test_the_plan_puts_sources_beside_configured_feeds_or_in_the_demo_feeds_place():
    source = EventSource([])
    alone = feed_plan(Config(), [source])
    assert [s.name for s in alone.specs] == ["events"] and not alone.uses_demo_feed
    beside = feed_plan(Config(ws_url="ws://127.0.0.1:9/x"), [source])
    assert [s.name for s in beside.specs] == ["0", "events"]
    assert feed_plan(Config(), ()).uses_demo_feed
    with pytest.raises(ValueError, match="two feeds or sources are named '0'"):
        feed_plan(Config(ws_url="ws://127.0.0.1:9/x"), [type("S", (), {"name": "0", "run": source.run})()])
    with pytest.raises(TypeError, match="non-empty str name"):
        feed_plan(Config(), [object()])
    with pytest.raises(ValueError, match="replies='some'"):
        feed_plan(Config(), [type("S", (), {"name": "x", "replies": "some", "run": source.run})()])


def test_the_io_thread_the_source_runs_on_is_forkless_own():
    seen: list[str] = []

    class Where:
        name = "where"

        async def run(self, ctx: Any) -> None:
            seen.append(threading.current_thread().name)
            async for _ in ctx.outgoing():
                pass

    with Controller(_config(), processor=PROCESSOR, sources=[Where()]) as ctl:
        drive(ctl, lambda: bool(seen), timeout_s=10 * UNIT_S, what="the source started")
    assert seen == ["forkless-io"]
