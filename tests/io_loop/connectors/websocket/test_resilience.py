"""Fault tests, in process: a real ``Controller`` against a real loopback server (tests/servers.py).

Each test scripts the server (close mid-stream, refuse, 503, ignore pings, go silent, stop
reading, send junk), drives the controller from the main thread (``drive``) and asserts on
what the server received. Every wait is bounded (tests/harness.py: scaled by
FORKLESS_TEST_TIMEOUT_SCALE); delays are made small with the ``reconnect_*`` settings and
the backoff's jitter is seeded (the ``seeded_backoff`` fixture). The reconnect tests that
are cheap to repeat run against the ``websockets`` server too. One ``Processor`` object is
shared so the step is compiled once for the whole file (same shapes in every ``Config``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import jax
import jax.numpy as jnp
import numpy as np
import psutil
import pytest

from forkless.controller.config import Config
from forkless.controller.loop import Controller
from forkless.controller.processor import Processor, ewma_processor
from forkless.io_loop.backoff import Backoff
from forkless.io_loop.handover import Handover
from tests.harness import BACKOFF_SEED, UNIT_S, assert_books_balance, drive, quick_config, wait_until
from tests.servers import (
    SERVERS,
    AiohttpConn,
    FeedConn,
    LoopbackServer,
    assert_results_match_reference,
    make_messages,
    parse_replies,
    self_signed_certificate,
    server_ssl_context,
)

pytestmark = pytest.mark.timeout(60 * UNIT_S)

PROCESSOR = ewma_processor()
FEATURES = 4


def _config(url: str, **changes: Any) -> Config:
    return quick_config(ws_url=url, features=FEATURES, **{"reconnect_reset_s": 1.0, **changes})




def _all_closed(server: LoopbackServer) -> Callable[[], bool]:
    """For ``server.wait_for``: every connection so far has ended (nothing more can arrive)."""
    return lambda: bool(server.connections) and all(conn.closed_at is not None for conn in server.connections)


# ---- reconnects ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", sorted(SERVERS))
def test_five_closes_and_a_refusal_lose_nothing_and_answer_each_message_once(feed_server: Any, impl: str) -> None:
    per_connection, closes = 120, 5
    messages = make_messages(per_connection * (closes + 1), streams=5, seed=11)
    sent = [0]
    done = threading.Event()

    async def script(conn: FeedConn) -> None:
        reader = conn.reading(timeout=30)
        last = conn.index >= closes
        stop = len(messages) if last else min(len(messages), sent[0] + per_connection)
        while sent[0] < stop:
            i = sent[0]
            if i % 7 == 0 and i + 3 <= stop:  # now and then a batch frame
                await conn.send(messages[i:i + 3])
                sent[0] += 3
            else:
                await conn.send(messages[i])
                sent[0] += 1
            if i % 10 == 0:
                await asyncio.sleep(0.002)  # mid-stream: replies flow while we send
        if not last:
            await conn.send_close(aiohttp.WSCloseCode.GOING_AWAY)
            await reader
            if conn.index == 2:
                await conn.server.refuse_for(2.0)
            return
        while conn.server.received_count < len(messages):
            await asyncio.sleep(0.01)
        done.set()
        await reader

    server = feed_server(script, impl=impl)
    with Controller(_config(server.url), processor=PROCESSOR) as ctl:
        drive(ctl, done.is_set, timeout_s=30 * UNIT_S, what="every message answered")
        stats = ctl.stats()
    assert not server.script_errors
    results, errors = parse_replies(server.received)
    assert errors == []
    assert_results_match_reference(messages, results)
    assert len(server.connections) == closes + 1
    assert stats.reconnects == closes
    assert stats.connect_failures >= 1  # the refusal was seen as failed attempts
    assert stats.dropped == {}
    assert_books_balance(ctl)


def test_accept_then_close_is_retried_with_growing_delays_not_hammered(feed_server: Any) -> None:
    min_s, max_s, reset_s, attempts_n = 0.05, 1.0, 5.0, 8

    async def script(conn: FeedConn) -> None:
        await conn.close()

    server = feed_server(script)
    cfg = _config(server.url, reconnect_min_s=min_s, reconnect_max_s=max_s, reconnect_reset_s=reset_s)
    with Controller(cfg, processor=PROCESSOR) as ctl:
        drive(ctl, lambda: len(server.attempts) >= attempts_n, timeout_s=15 * UNIT_S, what=f"{attempts_n} attempts")
    gaps = np.diff([attempt.at for attempt in server.attempts[:attempts_n]])
    # the client's jitter is seeded (the seeded_backoff fixture): these are the delays it drew,
    # growing because a connection closed at once is a failure, not a reason to reset
    planned = Backoff(min_s, max_s, reset_s, rng=random.Random(BACKOFF_SEED))
    delays = np.array([planned.failed() for _ in gaps])
    assert (gaps >= delays - 1e-3).all(), list(zip(gaps.round(3), delays.round(3)))
    assert gaps.min() >= min_s * 0.9
    # ~0.05 s apart, i.e. ~50 attempts in 2.5 s, if the backoff reset on every open
    assert gaps.sum() >= delays.sum() > 3 * min_s * len(gaps)
    # the later attempts are spaced by a larger cap than the first ones
    assert gaps[3:].mean() > gaps[:2].mean()


@pytest.mark.parametrize("impl", sorted(SERVERS))
def test_handshake_503_is_retried_until_the_server_recovers(feed_server: Any, impl: str) -> None:
    messages = make_messages(5)

    async def script(conn: FeedConn) -> None:
        for m in messages:
            await conn.send(m)
        await conn.read_until_closed(timeout=20)

    server = feed_server(script, impl=impl, handshake_status=lambda i: 503 if i < 3 else None)
    with Controller(_config(server.url), processor=PROCESSOR) as ctl:
        drive(ctl, lambda: server.received_count >= len(messages), timeout_s=20 * UNIT_S, what="replies after the 503s")
        stats = ctl.stats()
    assert [attempt.status for attempt in server.attempts] == [503, 503, 503, None]
    assert len(server.connections) == 1
    assert stats.connect_failures == 3
    results, errors = parse_replies(server.received)
    assert errors == []
    assert_results_match_reference(messages, results)


def test_server_that_stops_answering_pings_is_dropped_and_reconnected_within_the_heartbeat_bound(
        feed_server: Any) -> None:
    heartbeat_s = 1.0
    silent_since: list[float] = []

    async def script(conn: AiohttpConn) -> None:
        if conn.index == 0:
            for m in make_messages(3):
                await conn.send(m)
            for _ in range(3):
                await conn.recv(timeout=10)
            silent_since.append(time.monotonic())
            await conn.read_until_closed(timeout=30)  # TCP open, pings ignored (autoping off)
        else:
            conn.answer_pings = True
            await conn.read_until_closed(timeout=30)

    server = feed_server(script, autoping=False)
    with Controller(_config(server.url, heartbeat_s=heartbeat_s), processor=PROCESSOR) as ctl:
        drive(ctl, lambda: len(server.connections) >= 2, timeout_s=15 * UNIT_S, what="a second connection")
    first, second = server.connections[:2]
    assert isinstance(first, AiohttpConn) and first.pings >= 1
    # a ping after heartbeat_s of silence, heartbeat_s / 2 for the pong, then the backoff (at
    # most reconnect_max_s), and one unit of slack
    bound = heartbeat_s + heartbeat_s / 2 + 0.2 + 1.0 * UNIT_S
    assert second.opened_at - silent_since[0] <= bound
    assert_books_balance(ctl)


def test_stale_feed_watchdog_reconnects_a_silent_feed(feed_server: Any) -> None:
    stale_s = 0.5
    silent_since: list[float] = []

    async def script(conn: FeedConn) -> None:
        if conn.index == 0:
            await conn.send(make_messages(1)[0])
            await conn.recv(timeout=10)
            silent_since.append(time.monotonic())
        await conn.read_until_closed(timeout=30)  # pings are answered: only the data is missing

    server = feed_server(script)
    with Controller(_config(server.url, stale_s=stale_s, heartbeat_s=0.2), processor=PROCESSOR) as ctl:
        drive(ctl, lambda: len(server.connections) >= 2, timeout_s=15 * UNIT_S, what="a second connection")
        stats = ctl.stats()
    assert stats.reconnects >= 1
    # stale_s of silence, then the backoff (at most reconnect_max_s), and slack
    assert server.connections[1].opened_at - silent_since[0] <= stale_s + 0.2 + 1.5 * UNIT_S


def test_subscribe_is_the_first_frame_on_every_connection(feed_server: Any) -> None:
    subscribe = json.dumps({"op": "subscribe", "channels": ["a", "b"]})

    async def script(conn: FeedConn) -> None:
        await conn.recv(timeout=10)
        if conn.index < 2:
            await conn.send(make_messages(1, start=conn.index)[0])
            await conn.recv(timeout=10)
            await conn.close_keep_reading()
        else:
            await conn.read_until_closed(timeout=30)

    server = feed_server(script)
    with Controller(_config(server.url, subscribe=subscribe), processor=PROCESSOR) as ctl:
        drive(ctl, lambda: len(server.connections) >= 3, timeout_s=15 * UNIT_S, what="three connections")
    assert [conn.received[0] for conn in server.connections[:3]] == [subscribe] * 3
    assert [json.loads(conn.received[1])["seq"] for conn in server.connections[:2]] == [0, 1]


def test_oversized_frame_closes_with_1009_and_the_feed_goes_on_after_reconnecting(feed_server: Any) -> None:
    messages = make_messages(4)

    async def script(conn: FeedConn) -> None:
        if conn.index == 0:
            await conn.send(messages[0])
            await conn.send("[" + " " * 4096 + "]")  # larger than max_msg_bytes
            await conn.read_until_closed(timeout=10)
        else:
            for m in messages[1:]:
                await conn.send(m)
            await conn.read_until_closed(timeout=30)

    server = feed_server(script)
    with Controller(_config(server.url, max_msg_bytes=1024), processor=PROCESSOR) as ctl:
        drive(ctl, lambda: server.received_count >= len(messages), timeout_s=15 * UNIT_S, what="every message answered")
        stats = ctl.stats()
    assert server.connections[0].client_close_code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
    assert stats.errors.get("frame too large") == 1
    results, errors = parse_replies(server.received)
    assert errors == []
    assert_results_match_reference(messages, results)
    assert_books_balance(ctl)


# ---- backpressure and bounds ----------------------------------------------------------------


def test_drop_oldest_counts_every_dropped_message(feed_server: Any) -> None:
    messages = make_messages(50)
    queue_size = 4

    async def script(conn: FeedConn) -> None:
        for m in messages:
            await conn.send(m)
            await asyncio.sleep(0.005)  # separate arrivals: the client cannot merge them
        await conn.read_until_closed(timeout=30)

    server = feed_server(script)
    buffer = 8  # the feed's own buffer: what waits beyond it is dropped, the oldest first
    cfg = _config(server.url, queue_size=queue_size, overflow="drop_oldest", source_buffer=buffer)
    with Controller(cfg, processor=PROCESSOR) as ctl:
        # the main thread takes nothing until the IO thread has read every frame (at most the
        # frames of its last loop turn are then still on their way into inbound: one chunk)
        wait_until(lambda: ctl.stats().frames_in >= len(messages), timeout_s=10 * UNIT_S, what="every frame read")

        def accounted() -> bool:
            snap = ctl.stats()
            return snap.processed + snap.dropped_total >= len(messages)

        drive(ctl, accounted, timeout_s=10 * UNIT_S, what="every message processed or dropped")
        drive(ctl, lambda: server.received_count >= ctl.stats().processed, timeout_s=10 * UNIT_S,
              what="the kept messages answered")
    # the client closed with 1000 after sending every result: nothing more can arrive
    server.wait_for(_all_closed(server), 5 * UNIT_S, "the client's close")
    stats = ctl.stats()
    results, errors = parse_replies(server.received)
    assert errors == []
    assert all(len(answers) == 1 for answers in results.values()), "each kept message answered once"
    kept = sorted(results)
    seqs = [m["seq"] for m in messages]
    assert 0 < len(kept) <= queue_size * cfg.max_batch + buffer + 1
    # what reached the shared queue is never taken back; of what waited, the oldest went
    first = next(i for i, seq in enumerate(seqs) if seq not in results)
    assert kept == seqs[:first] + seqs[first + len(seqs) - len(kept):], "one run of the oldest waiting dropped"
    assert seqs[-1] in results, "the newest is kept"
    assert stats.processed == len(kept)
    assert stats.dropped == {"inbound overflow (drop_oldest)": len(messages) - len(kept)}
    assert_books_balance(ctl)


def test_full_inbound_queue_stops_reading_the_socket(feed_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # nobody drains inbound: the reader waits in Handover.flush for room, aiohttp's buffer fills
    # and it pauses the socket, the kernel's buffers fill, and TCP holds back the server's writes
    queue_size, per_frame = 4, 16  # a frame of max_batch messages is handed over as one chunk
    reader_waits = threading.Event()  # set while the reader awaits flush() with inbound full
    flush = Handover.flush

    async def watched_flush(handover: Handover) -> None:
        if handover.queue.full():  # the bridge's inbound: janus's async side
            reader_waits.set()
        try:
            await flush(handover)
        finally:
            reader_waits.clear()

    monkeypatch.setattr(Handover, "flush", watched_flush)
    sent = [0]
    stop_sending, finished = threading.Event(), threading.Event()
    pad = "p" * 2000  # a field the codec ignores: the buffers fill after fewer messages (less to drain)

    async def script(conn: FeedConn) -> None:
        while not stop_sending.is_set():  # as fast as TCP lets it: a send waits while writes are held back
            await conn.send([m | {"pad": pad} for m in make_messages(per_frame, start=sent[0], seed=sent[0])])
            sent[0] += per_frame
        finished.set()
        await conn.read_until_closed(timeout=30)

    server = feed_server(script, compress=False)  # uncompressed: the bytes fill the buffers sooner

    def pushed_back() -> bool:
        conns = server.connections
        return reader_waits.is_set() and bool(conns) and isinstance(conns[0], AiohttpConn) and conns[0].writes_blocked()

    buffer = 64  # the feed's own buffer (FORKLESS_SOURCE_BUFFER): the reader reads on until it is full
    cfg = _config(server.url, queue_size=queue_size, source_buffer=buffer)
    with Controller(cfg, processor=PROCESSOR) as ctl:
        wait_until(pushed_back, timeout_s=20 * UNIT_S,
                   what="the reader waiting for room and the server's writes held back")
        held = ctl.stats()
        assert held.inbound_depth == queue_size
        # what the client took is bounded by the queue (full), the feed's own buffer (its bound
        # and the chunk that went over it) and one chunk being gathered, not by what the server sent
        assert held.messages_in <= (queue_size + 2) * cfg.max_batch + buffer < sent[0]
        assert held.buffered > buffer
        assert reader_waits.is_set()  # still: nothing was read meanwhile
        stop_sending.set()
        drive(ctl, lambda: finished.is_set() and server.received_count >= sent[0], timeout_s=30 * UNIT_S,
              what="everything answered once inbound drains")
        assert ctl.stats().dropped_total == 0


class _NonReadingFeed:
    """A script that sends batch frames as fast as TCP lets it and never reads a reply until
    ``resume()``; ``start`` runs it on an aiohttp server (it pauses the TCP transport), without
    compression, so the replies take their full size and fill the socket buffers sooner."""

    def __init__(self) -> None:
        self.frames_sent = 0
        self.stop_sending = threading.Event()
        self.server: LoopbackServer | None = None

    def start(self, feed_server: Any) -> LoopbackServer:
        self.server = feed_server(self._script, compress=False)
        return self.server

    async def _script(self, conn: AiohttpConn) -> None:
        conn.stop_reading()
        # the reading starts at ``resume()`` whether or not a send is blocked then: a send held
        # back by the client (which does not read while its own writes are held back) would
        # otherwise keep this script from ever reading again, once aiohttp's own flow control
        # paused the transport anew (a deadlock of the test server's, seen in CI)
        reader = asyncio.create_task(self._read_once_resumed(conn))
        i = 0
        while not self.stop_sending.is_set():
            await conn.send(make_messages(50, start=i, seed=i))
            i += 50
            self.frames_sent += 1
            await asyncio.sleep(0)
        await reader

    async def _read_once_resumed(self, conn: AiohttpConn) -> None:
        while not self.stop_sending.is_set():
            await asyncio.sleep(0.01)
        await conn.read_until_closed(timeout=30)

    def resume(self) -> None:
        self.stop_sending.set()
        assert self.server is not None
        for conn in list(self.server.connections):
            assert isinstance(conn, AiohttpConn)
            conn.resume_reading_threadsafe()


def _pushed_back(ctl: Controller, feed: _NonReadingFeed, queue_size: int) -> Callable[[], bool]:
    """For ``wait_until``: the push-back reached all the way round: the client's writes backed up
    into a full outbound queue, and so (the main thread blocked, inbound full, the client's
    reader stopped) the server's own writes are held back too."""

    def pushed_back() -> bool:
        conns = feed.server.connections if feed.server is not None else []
        if not conns or ctl.stats().outbound_depth != queue_size:
            return False
        conn = conns[0]
        assert isinstance(conn, AiohttpConn)
        return conn.writes_blocked()

    return pushed_back


def _sample(ctl: Controller, feed: _NonReadingFeed, samples: list, done: threading.Event) -> threading.Thread:
    """Record (time, inbound depth, outbound depth, RSS, frames sent) every 50 ms until ``done``."""
    process = psutil.Process()

    def sample() -> None:
        while not done.is_set():
            snap = ctl.stats()
            samples.append((time.monotonic(), snap.inbound_depth, snap.outbound_depth,
                            process.memory_info().rss, feed.frames_sent))
            time.sleep(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    return thread


def test_server_that_stops_reading_keeps_queues_and_memory_bounded(feed_server: Any) -> None:
    queue_size, hold_s = 8, 1.5
    feed = _NonReadingFeed()
    samples: list[tuple[float, int, int, int, int]] = []
    done = threading.Event()
    problems: list[AssertionError] = []
    server = feed.start(feed_server)
    with Controller(_config(server.url, queue_size=queue_size), processor=PROCESSOR) as ctl:
        rss_start = psutil.Process().memory_info().rss
        sampler = _sample(ctl, feed, samples, done)
        started = time.monotonic()
        stall_end: list[float] = []

        def stall_then_resume() -> None:
            # the stall under test: once the push-back went all the way round, hold_s more with
            # the server not reading; then it reads again, which unblocks the client
            try:
                wait_until(_pushed_back(ctl, feed, queue_size), timeout_s=20 * UNIT_S,
                           what="outbound full and the server's writes held back")
                time.sleep(hold_s)
            except AssertionError as exc:
                problems.append(exc)
            stall_end.append(time.monotonic())
            feed.resume()

        # the main thread blocks inside process_pending while outbound is full
        staller = threading.Thread(target=stall_then_resume, daemon=True)
        staller.start()
        try:
            drive(ctl, feed.stop_sending.is_set, timeout_s=30 * UNIT_S, what="the end of the stall")
            drive(ctl, lambda: ctl.stats().outbound_depth < queue_size, timeout_s=10 * UNIT_S,
                  what="outbound draining once the server reads again")
        finally:
            feed.resume()
            staller.join(5)
            done.set()
            sampler.join(2)
    # the push-back came all the way round (``_pushed_back``: outbound full and the server's own
    # writes held back), which the staller waited for; a sampled window is not asserted on, as
    # loopback kernel buffers keep growing a little for a while (TCP autotuning)
    assert not problems
    stall_s = stall_end[0] - started
    during = [s for s in samples if s[0] < started + stall_s]
    assert during, "no samples during the stall"
    assert max(s[1] for s in during) <= queue_size
    assert max(s[2] for s in during) <= queue_size
    assert max(s[3] for s in during) - rss_start < 150 * 2**20
    assert_books_balance(ctl)


@pytest.mark.timeout(30 * UNIT_S)
def test_stop_ends_within_the_shutdown_timeout_while_the_server_does_not_read(feed_server: Any) -> None:
    queue_size = 8
    feed = _NonReadingFeed()
    server = feed.start(feed_server)
    cfg = _config(server.url, queue_size=queue_size, shutdown_timeout_s=1.0)
    ctl = Controller(cfg, processor=PROCESSOR)
    stop_at: list[float] = []
    problems: list[AssertionError] = []
    returned = threading.Event()

    def stop_once_backed_up() -> None:
        # stop once the unread replies have backed up all the way round
        try:
            wait_until(_pushed_back(ctl, feed, queue_size), timeout_s=60 * UNIT_S,
                       what="outbound full and the server's writes held back")
        except AssertionError as exc:
            problems.append(exc)
        stop_at.append(time.monotonic())
        ctl.request_stop()
        # a safety net so a hang fails in bounded time instead of blocking the suite
        if not returned.wait(cfg.shutdown_timeout_s + 4.0 * UNIT_S):
            feed.resume()

    stopper = threading.Thread(target=stop_once_backed_up, daemon=True)
    stopper.start()
    try:
        ctl.run()
    finally:
        returned_at = time.monotonic()
        returned.set()
        feed.resume()
        stopper.join(5)
    elapsed = returned_at - stop_at[0]
    stats = ctl.stats()
    assert not problems
    assert elapsed <= cfg.shutdown_timeout_s + 3.0 * UNIT_S
    # Replies the kernel already took (socket buffers) cannot be counted from here; what is
    # still in our queues or the transport's buffer is. Either way the books must balance:
    # every message read was answered on the wire, or counted as unsent or not processed.
    unsent = sum(stats.dropped.values()) + stats.errors.get("outbound full at stop", 0)
    assert stats.messages_out + unsent + stats.errors.get("not processed before the stop", 0) >= stats.processed
    assert stats.processed > 0
    assert_books_balance(ctl)


# ---- hostile input --------------------------------------------------------------------------


class _Fuzz:
    """Seeded frames: good messages (with known seqs) mixed with many kinds of bad ones.

    ``good`` is every good message in send order; ``bad_seqs`` the seqs whose error reply
    must carry that seq; ``null_errors`` how many error replies carry ``seq: null``."""

    def __init__(self, seed: int, frames: int, max_frame_items: int) -> None:
        self.rng = random.Random(seed)
        self.max_frame_items = max_frame_items
        self.next_seq = 0
        self.good: list[dict] = []
        self.bad_seqs: list[int] = []
        self.null_errors = 0
        self.either: list[int] = []  # seqs answered with that seq or with seq null (see below)
        self.frames: list[str | bytes] = [self._frame() for _ in range(frames)]

    def _seq(self) -> int:
        self.next_seq += 1
        return self.next_seq - 1

    def _good(self) -> dict:
        rng = self.rng
        k = rng.randrange(6)
        m = {"seq": self._seq(), "stream": f"s{k}", "x": [round(k + rng.gauss(0, 1), 5) for _ in range(FEATURES)]}
        if rng.random() < 0.1:
            m["extra"] = {"ignored": [1, 2]}
        self.good.append(m)
        return m

    def _bad_item(self) -> Any:
        """One bad element; records the error reply it must get."""
        rng = self.rng
        x = [1.0] * FEATURES
        kind = rng.randrange(16)
        if kind < 4:
            self.null_errors += 1
            return [42, "text", None, True][kind]  # not an object
        if kind == 4:
            self.null_errors += 1
            return {"stream": "s0", "x": x}  # no seq
        if kind == 5:
            self.null_errors += 1
            return {"seq": rng.choice(["7", 1.5, True, None, [1]]), "stream": "s0", "x": x}
        seq = self._seq()
        self.bad_seqs.append(seq)
        return [
            {"seq": seq, "x": x},
            {"seq": seq, "stream": rng.choice([5, "", None, ["s"], "s" * 300]), "x": x},
            {"seq": seq, "stream": "s0"},
            {"seq": seq, "stream": "s0", "x": rng.choice(["1,2", 3, None, {"a": 1}])},
            {"seq": seq, "stream": "s0", "x": x[: rng.randrange(FEATURES)] or x * 2},
            {"seq": seq, "stream": "s0", "x": [*x[:-1], rng.choice(["1", None, True, [1.0], {}])]},
            {"seq": seq, "stream": "s0", "x": [*x[:-1], rng.choice([1e39, -1e300, 2**130])]},
            {"seq": seq, "stream": "s1", "x": x * 40},
            {"seq": seq, "stream": "s0", "x": [*x[:-1], -3.5e38]},
            {"seq": seq, "stream": 7, "x": x},
        ][kind - 6]

    def _not_a_json_number(self) -> str:
        """A lone message holding NaN, Infinity or a 400-digit integer: not JSON to a strict
        parser (the whole frame fails, seq null), a number out of float32 range to a lenient one
        (an error with the seq). Either is a correct answer; exactly one error is required."""
        seq = self._seq()
        self.either.append(seq)
        value = self.rng.choice(["NaN", "Infinity", "-Infinity", "1" + "0" * 400])
        x = ", ".join(["1.0"] * (FEATURES - 1) + [value])
        return f'{{"seq": {seq}, "stream": "s0", "x": [{x}]}}'

    def _frame(self) -> str | bytes:
        rng = self.rng
        roll = rng.random()
        if roll < 0.3:
            return json.dumps(self._good())
        if roll < 0.4:
            items = [self._good() if rng.random() < 0.5 else self._bad_item() for _ in range(rng.randint(1, 6))]
            return json.dumps(items)
        if roll < 0.6:
            return json.dumps(self._bad_item())
        if roll < 0.65:
            return self._not_a_json_number()
        self.null_errors += 1  # the whole frame is one error with seq null
        kind = rng.randrange(6)
        if kind == 0:  # truncated JSON
            text = json.dumps([{"seq": 10**9, "stream": "s0", "x": [1.0] * FEATURES}])
            return text[: rng.randrange(1, len(text) - 1)]
        if kind == 1:  # not UTF-8
            return b"\xff" + bytes(rng.randrange(256) for _ in range(rng.randrange(20)))
        if kind == 2:  # random printable junk
            return "".join(rng.choice("{}[]:,\"'abc0123 \\") for _ in range(rng.randint(1, 40))) + "}{"
        if kind == 3:  # too deep to parse
            depth = rng.choice([3000, 100_000])
            return "[" * depth + "]" * depth
        if kind == 4:  # a batch frame over the item limit: refused as a whole
            return json.dumps([{"seq": 10**9, "stream": "s0", "x": [1.0] * FEATURES}] * (self.max_frame_items + 1))
        return ""  # empty frame


def test_fuzzed_frames_each_get_an_error_good_ones_are_correct_and_the_connection_stays_up(feed_server: Any) -> None:
    fuzz = _Fuzz(seed=2024, frames=2000, max_frame_items=20)
    bad = len(fuzz.bad_seqs) + fuzz.null_errors + len(fuzz.either)
    expected = len(fuzz.good) + bad
    assert bad >= 1000

    async def script(conn: FeedConn) -> None:
        reader = conn.reading(timeout=40)
        for i, frame in enumerate(fuzz.frames):
            await conn.send_frame(frame)
            if i % 50 == 0:
                await asyncio.sleep(0.001)
        await reader

    server = feed_server(script)
    cfg = _config(server.url, max_frame_items=20, max_msg_bytes=1 << 20)
    logging.getLogger("forkless.source").setLevel(logging.ERROR)  # 1,000s of bad-input warnings
    try:
        with Controller(cfg, processor=PROCESSOR) as ctl:
            drive(ctl, lambda: server.received_count >= expected, timeout_s=40 * UNIT_S, what=f"{expected} replies")
            stats = ctl.stats()
    finally:
        logging.getLogger("forkless.source").setLevel(logging.NOTSET)
    # the client closed with 1000 after sending every reply: nothing more may have come
    server.wait_for(_all_closed(server), 5 * UNIT_S, "the client's close")
    assert len(server.connections) == 1 and stats.reconnects == 0
    assert server.connections[0].client_close_code == aiohttp.WSCloseCode.OK
    results, errors = parse_replies(server.received)
    assert len(server.received) == expected
    with_seq = sorted(e["seq"] for e in errors if e["seq"] is not None)
    either_with_seq = [s for s in with_seq if s in set(fuzz.either)]
    assert sorted(set(with_seq) - set(either_with_seq)) == sorted(fuzz.bad_seqs)
    assert len(with_seq) == len(set(with_seq)), "one error per bad element"
    assert sum(e["seq"] is None for e in errors) == fuzz.null_errors + len(fuzz.either) - len(either_with_seq)
    assert all(isinstance(e["error"], str) and e["error"] for e in errors)
    assert_results_match_reference(fuzz.good, results)
    assert_books_balance(ctl)


# ---- processor failures -------------------------------------------------------------------

MARK = 7777.0


def _processor_failing_on_mark() -> Processor:
    """The EWMA detector, but the step raises (through a host callback) when x holds MARK."""
    base = ewma_processor()

    def check(x: np.ndarray) -> np.ndarray:
        if np.any(np.asarray(x) == MARK):
            raise ValueError("marked batch: injected processing failure")
        return np.zeros((), np.float32)

    def step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        zero = jax.pure_callback(check, jax.ShapeDtypeStruct((), jnp.float32), batch.x)
        new_state, out = base.step(state, batch)
        return new_state, dict(out, score=out["score"] + zero)  # keeps the callback alive

    return Processor(base.init, step)


def test_processor_failure_errors_that_batch_resets_the_state_and_goes_on(feed_server: Any,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    messages = make_messages(80, streams=3, seed=5)
    marked_batches = [messages[30:33], messages[60:63]]
    for batch in marked_batches:
        batch[1] = dict(batch[1], x=[MARK] * FEATURES)
    marked = {m["seq"] for batch in marked_batches for m in batch}
    done = threading.Event()

    async def script(conn: FeedConn) -> None:
        i = 0
        while i < len(messages):  # lock-step, so each frame is exactly one batch
            frame = next((b for b in marked_batches if b[0]["seq"] == i), [messages[i]])
            await conn.send(frame)
            for _ in frame:
                await conn.recv(timeout=10)
            i += len(frame)
        done.set()
        await conn.read_until_closed(timeout=30)

    caplog.set_level(logging.WARNING, logger="forkless.controller")
    server = feed_server(script)
    with Controller(_config(server.url), processor=_processor_failing_on_mark()) as ctl:
        drive(ctl, done.is_set, timeout_s=30 * UNIT_S, what="every message answered")
        stats = ctl.stats()
    results, errors = parse_replies(server.received)
    assert sorted(e["seq"] for e in errors) == sorted(marked)
    assert {e["error"] for e in errors} == {"processing failed"}
    # the state was donated to each failed step: after each, every stream starts again fresh
    starts = [0] + [batch[-1]["seq"] + 1 for batch in marked_batches] + [len(messages)]
    for lo, hi in itertools.pairwise(starts):
        segment = [m for m in messages[lo:hi] if m["seq"] not in marked]
        assert_results_match_reference(segment, {m["seq"]: results[m["seq"]] for m in segment})
    assert sorted(results) == sorted(m["seq"] for m in messages if m["seq"] not in marked)
    assert stats.errors == {"processing failed": len(marked)}
    assert stats.resets == {"state lost with a failed step": len(marked_batches)}
    tracebacks = [r for r in caplog.records if r.levelno >= logging.ERROR and "processing failed" in r.getMessage()]
    assert len(tracebacks) == 1, "the traceback is logged once per distinct error"
    assert "injected processing failure" in tracebacks[0].getMessage()
    assert_books_balance(ctl)


# ---- TLS ----------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", sorted(SERVERS))
def test_self_signed_certificate_is_accepted_with_ca_file(feed_server: Any, tmp_path: Any, impl: str) -> None:
    cert, key = self_signed_certificate(tmp_path)
    messages = make_messages(3)

    async def script(conn: FeedConn) -> None:
        for m in messages:
            await conn.send(m)
        await conn.read_until_closed(timeout=20)

    server = feed_server(script, impl=impl, ssl_context=server_ssl_context(cert, key))
    assert server.url.startswith("wss://")
    with Controller(_config(server.url, ca_file=str(cert)), processor=PROCESSOR) as ctl:
        drive(ctl, lambda: server.received_count >= len(messages), timeout_s=15 * UNIT_S, what="replies over TLS")
    results, errors = parse_replies(server.received)
    assert errors == []
    assert_results_match_reference(messages, results)


def test_tls_insecure_connects_and_warns_at_every_connect(feed_server: Any, tmp_path: Any,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    cert, key = self_signed_certificate(tmp_path)

    async def script(conn: FeedConn) -> None:
        if conn.index == 0:
            await conn.close()
        else:
            await conn.read_until_closed(timeout=20)

    caplog.set_level(logging.WARNING, logger="forkless.client")
    server = feed_server(script, ssl_context=server_ssl_context(cert, key))
    with Controller(_config(server.url, tls_insecure=True), processor=PROCESSOR) as ctl:
        drive(ctl, lambda: len(server.connections) >= 2, timeout_s=15 * UNIT_S, what="two connections")
    warnings = [r for r in caplog.records if "verification is OFF" in r.getMessage()]
    assert len(warnings) >= 2


def test_a_stop_asked_again_while_the_io_loop_closes_leaves_no_task_unrun(feed_server: Any,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop asked while the IO thread's loop is closing (after its main coroutine ended: a
    signal's stop beside ``stop()``'s) makes no task: one made then would never run, its
    coroutine "never awaited" (a RuntimeWarning seen in the suite, 2026-12-04)."""
    from forkless.io_loop.thread import IOThread

    threads: list[IOThread] = []
    run, closing = IOThread._outcome, asyncio.BaseEventLoop.shutdown_asyncgens

    async def recorded(self: IOThread) -> None:
        threads.append(self)
        await run(self)

    def stop_again(loop: asyncio.AbstractEventLoop) -> Any:
        for io in threads:
            if io._loop is loop:
                io.request_stop()  # arrives on the loop as it runs shutdown_asyncgens, after the main ended
        return closing(loop)

    monkeypatch.setattr(IOThread, "_outcome", recorded)
    monkeypatch.setattr(asyncio.BaseEventLoop, "shutdown_asyncgens", stop_again)
    server = feed_server()
    with Controller(_config(server.url), processor=PROCESSOR) as ctl:
        wait_until(lambda: len(server.connections) >= 1, timeout_s=30 * UNIT_S, what="the feed connected")
        ctl.process_pending(timeout=0.05)
    assert len(threads) == 1 and threads[0].join(10 * UNIT_S)
    assert threads[0]._stopping and all(task.done() for task in threads[0]._stopping)
