"""Tests for the embedded demo feed: pure scoring, a real loopback round trip, reconnection.

Every network test runs its own event loop with ``asyncio.run`` and is bounded by
``asyncio.wait_for`` (scaled by FORKLESS_TEST_TIMEOUT_SCALE); assertions are about counts
and order, never about timing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any

import aiohttp
import pytest

from forkless.io_loop.connectors.websocket.demo_feed import DemoFeed, DemoScore, DemoSummary, _SensorBank
from tests.harness import UNIT_S
from tests.reference import EWMAReference

TEST_TIMEOUT_S = 30.0 * UNIT_S


def _run(coro: Awaitable[Any]) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, TEST_TIMEOUT_S)

    return asyncio.run(bounded())


def _reply(seq: int, stream: str, anomaly: bool) -> dict[str, Any]:
    return {"seq": seq, "stream": stream, "z": [0.0], "score": 0.0, "anomaly": anomaly}


# --- (a) pure scoring -------------------------------------------------------------------


def test_score_counts_hits_misses_false_flags_and_junk() -> None:
    score = DemoScore()
    injected = {2, 3, 5}
    for seq in range(6):
        score.record_sent(seq, "a" if seq % 2 == 0 else "b", seq in injected)

    score.record_reply(_reply(0, "a", False))  # true negative
    score.record_reply(_reply(1, "b", True))  # false flag
    score.record_reply(_reply(2, "a", True))  # detected
    score.record_reply(_reply(3, "b", False))  # missed
    score.record_reply({"error": "bad x", "seq": 4})  # refused: resolved, not answered
    score.record_reply({"error": "undecodable", "seq": None})
    score.record_reply(_reply(2, "a", True))  # duplicate of an answered seq
    score.record_reply(_reply(5, "a", True))  # wrong stream: invalid, 5 stays pending
    score.record_reply(_reply(99, "a", False))  # never sent
    score.record_reply({"seq": True, "stream": "a", "anomaly": False})  # bool is no seq
    score.record_reply({"seq": 5, "stream": "b"})  # no anomaly field
    score.record_reply(["not", "a", "dict"])
    score.record_invalid()

    assert score.outstanding == 1
    assert score.summary() == DemoSummary(
        sent=6, answered=4, errors=2, injected=3, detected=1, false_flags=1, missed=1,
        precision=0.5, recall=0.5, duplicates=1, invalid=6,
    )
    assert score.summary().line() == (
        "demo feed: 6 sent, 4 answered, 2 errors, 1 duplicates, 6 invalid; "
        "injected anomalies 3: detected 1 (recall 50.0%), false flags 1 (precision 50.0%)"
    )


def test_score_with_nothing_to_judge_is_vacuously_perfect() -> None:
    score = DemoScore()
    score.record_sent(10, "a", False)
    score.record_reply(_reply(10, "a", False))
    summary = score.summary()
    assert (summary.sent, summary.answered, summary.precision, summary.recall) == (1, 1, 1.0, 1.0)
    assert summary.line() == (
        "demo feed: 1 sent, 1 answered, 0 errors; "
        "injected anomalies 0: detected 0 (recall n/a), false flags 0 (precision n/a)"
    )


def test_score_gaps_in_seq_are_not_duplicates_and_seq_must_increase() -> None:
    score = DemoScore()
    score.record_sent(0, "a", False)
    score.record_sent(5, "a", False)
    score.record_reply(_reply(3, "a", False))  # inside the gap: never sent
    score.record_reply(_reply(0, "a", False))
    score.record_reply(_reply(0, "a", False))
    summary = score.summary()
    assert (summary.answered, summary.duplicates, summary.invalid) == (1, 1, 1)
    with pytest.raises(ValueError):
        score.record_sent(5, "a", False)


def test_summary_line_format() -> None:
    summary = DemoSummary(
        sent=12000, answered=12000, errors=0, injected=24, detected=23, false_flags=2,
        missed=1, precision=23 / 25, recall=23 / 24,
    )
    assert summary.line() == (
        "demo feed: 12000 sent, 12000 answered, 0 errors; injected anomalies 24: "
        "detected 23 (recall 95.8%), false flags 2 (precision 92.0%)"
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "localhost", "example.com"])
def test_feed_refuses_non_loopback_hosts(host: str) -> None:
    with pytest.raises(ValueError):
        DemoFeed(rate_hz=10, streams=1, features=1, warmup=20, host=host)


def test_synthetic_data_is_reproducible_and_gives_the_detector_few_false_flags() -> None:
    def messages(seed: int) -> list[Any]:
        bank = _SensorBank(streams=4, features=8, warmup=20, anomaly_rate=0.005, seed=seed)
        return [bank.next() for _ in range(8000)]

    first = messages(3)
    assert first == messages(3)
    assert [m.seq for m in first] == list(range(8000))

    detector = EWMAReference()
    per_stream: dict[str, int] = {}
    detected = false_flags = missed = 0
    for message in first:
        obj = json.loads(message.text)
        n = per_stream.get(message.stream, 0)
        per_stream[message.stream] = n + 1
        if message.injected:
            assert n >= 20 + 10, "anomalies are only planted once the detector is warm"
        _, _, anomaly = detector(obj["stream"], obj["x"])
        detected += anomaly and message.injected
        false_flags += anomaly and not message.injected
        missed += message.injected and not anomaly
    assert detected > 0
    # Deterministic for this seed; guards the noise design, which keeps false flags rare.
    assert false_flags <= detected // 4
    assert missed <= detected // 4


# --- (b) real round trip ----------------------------------------------------------------


async def _answer(ws: aiohttp.ClientWebSocketResponse, detector: EWMAReference,
                  seqs: list[int], flags: list[int], limit: int | None = None,
                  answered: tuple[int, asyncio.Event] | None = None) -> None:
    """Answer feed messages like the real client would, until closed or `limit` reached;
    ``answered=(n, event)`` sets the event once n messages are answered."""
    async for msg in ws:
        assert msg.type is aiohttp.WSMsgType.TEXT
        obj = json.loads(msg.data)
        z, score, anomaly = detector(obj["stream"], obj["x"])
        seqs.append(obj["seq"])
        if anomaly:
            flags.append(obj["seq"])
        await ws.send_str(json.dumps({"seq": obj["seq"], "stream": obj["stream"],
                                      "z": z.tolist(), "score": score, "anomaly": anomaly}))
        if answered is not None and len(seqs) >= answered[0]:
            answered[1].set()
        if limit is not None and len(seqs) >= limit:
            return


def test_round_trip_every_message_is_answered_and_scored() -> None:
    async def scenario() -> tuple[DemoSummary, list[int], list[int], int]:
        # A high anomaly rate so that about a second of data (seeded) surely holds some.
        feed = DemoFeed(rate_hz=500, streams=4, features=8, warmup=20, seed=1,
                        anomaly_rate=0.05)
        enough = asyncio.Event()
        url = await feed.start()
        assert url.startswith("ws://127.0.0.1:") and url.endswith("/feed")
        seqs: list[int] = []
        flags: list[int] = []
        try:
            async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
                client = asyncio.create_task(_answer(ws, EWMAReference(), seqs, flags, answered=(500, enough)))
                await enough.wait()
                feed.stop_sending()
                all_answered = await feed.wait_replies(timeout=10.0 * UNIT_S)
                await feed.stop()
                await client
        finally:
            await feed.stop()
        assert all_answered
        return feed.summary(), seqs, flags, feed.connections

    summary, seqs, flags, connections = _run(scenario())

    assert connections == 1
    assert summary.sent > 0
    assert seqs == list(range(summary.sent))
    assert summary.answered == summary.sent
    assert (summary.errors, summary.duplicates, summary.invalid) == (0, 0, 0)
    assert summary.injected > 0
    assert summary.detected > 0
    assert summary.detected + summary.missed == summary.injected
    assert summary.detected + summary.false_flags == len(flags)
    assert summary.precision == summary.detected / len(flags)
    assert summary.recall == summary.detected / summary.injected


def test_the_messages_due_in_a_tick_leave_in_one_write_in_seq_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from forkless.io_loop.net import aiohttp_compat

    writes: list[int] = []  # frames a write held
    real = aiohttp_compat.text_frames

    def counted(ws: Any) -> Any:
        framer = real(ws)
        write = framer.write

        def counting_write(frames: list[Any]) -> None:
            writes.append(len(frames))
            write(frames)

        framer.write = counting_write
        return framer

    monkeypatch.setattr(aiohttp_compat, "text_frames", counted)

    async def scenario() -> tuple[DemoSummary, list[int]]:
        # 20,000 a second: a tick (at least 2 ms) has 40 or more messages due
        feed = DemoFeed(rate_hz=20_000, streams=4, features=8, warmup=20, seed=1)
        enough = asyncio.Event()
        url = await feed.start()
        seqs: list[int] = []
        try:
            async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
                client = asyncio.create_task(_answer(ws, EWMAReference(), seqs, [], answered=(1000, enough)))
                await enough.wait()
                feed.stop_sending()
                assert await feed.wait_replies(timeout=10.0 * UNIT_S)
                await feed.stop()
                await client
        finally:
            await feed.stop()
        return feed.summary(), seqs

    summary, seqs = _run(scenario())
    assert seqs == list(range(summary.sent)) and summary.answered == summary.sent
    assert sum(writes) == summary.sent and min(writes) >= 1
    assert max(writes) >= 40 and len(writes) < summary.sent // 10  # a tick's messages, one write


# --- (c) reconnection -------------------------------------------------------------------


def test_reconnect_continues_seq_numbering() -> None:
    async def scenario() -> tuple[list[int], list[int], DemoSummary, int]:
        feed = DemoFeed(rate_hz=500, streams=3, features=4, warmup=20, seed=2)
        url = await feed.start()
        detector = EWMAReference()  # the app keeps detector state across reconnections
        first: list[int] = []
        second: list[int] = []
        flags: list[int] = []
        try:
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(url) as ws:
                    await _answer(ws, detector, first, flags, limit=25)
                async with session.ws_connect(url) as ws:
                    await _answer(ws, detector, second, flags, limit=25)
        finally:
            await feed.stop()
        return first, second, feed.summary(), feed.connections

    first, second, summary, connections = _run(scenario())

    assert connections == 2
    assert first == list(range(25))
    # Frames still in flight when the first client left are lost, so a gap is allowed,
    # but numbering must go on rather than restart.
    assert second[0] > first[-1]
    assert second == list(range(second[0], second[0] + 25))
    assert summary.answered == 50
    assert (summary.errors, summary.duplicates, summary.invalid) == (0, 0, 0)


def test_newer_connection_takes_over_and_older_is_told_to_go_away() -> None:
    async def scenario() -> tuple[int | None, list[int], list[int], int]:
        feed = DemoFeed(rate_hz=500, streams=2, features=2, warmup=20)
        url = await feed.start()
        detector = EWMAReference()
        old_seqs: list[int] = []
        new_seqs: list[int] = []
        flags: list[int] = []
        try:
            async with aiohttp.ClientSession() as session, session.ws_connect(url) as old:
                await _answer(old, detector, old_seqs, flags, limit=5)
                async with session.ws_connect(url) as new:
                    # The old client keeps answering until the feed closes it.
                    await _answer(old, detector, old_seqs, flags)
                    await _answer(new, detector, new_seqs, flags, limit=5)
                    old_code = old.close_code
        finally:
            await feed.stop()
        return old_code, old_seqs, new_seqs, feed.connections

    old_code, old_seqs, new_seqs, connections = _run(scenario())

    assert connections == 2
    assert old_code == aiohttp.WSCloseCode.GOING_AWAY
    assert new_seqs[0] > old_seqs[-1]
