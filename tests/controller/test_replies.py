"""What a feed is sent back (FORKLESS_REPLIES, a feed's "replies"; a codec's ``encode_error``
returning None), and the latency of the results whoever takes them.

The feed here is exchange-like: a ``websockets`` server (not aiohttp, tests/servers.py) that
waits for the subscription, acknowledges it, streams trades with some malformed frames among
them, and fails the test on any data frame it receives that its policy does not allow (with
``"replies": "none"``: anything but the subscription). On 127.0.0.1.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from forkless import Config, Controller, JsonCodec, OnResults, Runtime
from forkless.controller.metrics import metric_families
from forkless.controller.processor import default_processor
from forkless.controller.stats import status_line
from forkless.io_loop.crossing import Chunk, Trace
from forkless.io_loop.errors import ConfigError
from tests.fake_io import FakeIO, drain
from tests.harness import ROOT, UNIT_S, app_env, assert_books_balance, drive
from tests.servers import FeedConn

pytestmark = pytest.mark.timeout(90 * UNIT_S)

F = 3
WAIT_S = 30.0 * UNIT_S
SUBSCRIBE = '{"op": "subscribe", "args": ["trades"]}'
ACK = {"event": "subscribed", "channel": "trades"}  # no seq: bad input to the JSON codec
TRADES = 40
# malformed frames among the trades: reason -> frames (two "not JSON", to see one log line for both)
MALFORMED = {"not JSON": ["{nope", "nope}"], "x must have 3 numbers, got 1": ['{"seq": 900, "stream": "s0", "x": [1]}'],
             "not UTF-8": [b"\xff\xfe"]}
INPUT_ERRORS = {"missing field: seq": 1, **{reason: len(frames) for reason, frames in MALFORMED.items()}}
NEW_STREAM = {"seq": 999, "stream": "one-too-many", "x": [0.0, 0.0, 0.0]}  # max_streams=4: refused


def _trades() -> list[dict]:
    rng = np.random.default_rng(5)
    return [{"seq": i, "stream": f"s{i % 4}", "x": rng.normal(size=F).round(5).tolist()} for i in range(TRADES)]


def _frames() -> list[Any]:
    """The trades, the malformed frames spread among them, and one message of a fifth stream."""
    frames: list[Any] = [json.dumps(t) for t in _trades()]
    bad = [frame for group in MALFORMED.values() for frame in group]
    for k, frame in enumerate(bad):
        frames.insert(5 + 9 * k, frame)
    frames.insert(20, json.dumps(NEW_STREAM))
    return frames


def exchange(allowed: str):
    """The exchange's script: the subscription first, the acknowledgement, then the frames; it
    raises (failing the test through the ``feed_server`` fixture) on any frame the client sends
    that ``allowed`` does not allow: "none" (nothing but the subscription), "results" (no error
    frame) or "all" (anything)."""

    async def script(conn: FeedConn) -> None:
        first = await conn.recv(timeout=WAIT_S)
        if first != SUBSCRIBE:
            raise AssertionError(f"the first frame was not the subscription: {first!r}")
        await conn.send(ACK)
        for frame in _frames():
            await conn.send_frame(frame)
        while True:
            frame = await conn.recv(timeout=WAIT_S)
            if frame is None:
                if conn.closing():
                    return
                continue
            if allowed == "none" or (allowed == "results" and "error" in json.loads(frame)):
                raise AssertionError(f"the exchange was sent a frame it never asked for: {frame!r}")

    return script


def _config(url: str, **changes: Any) -> Config:
    base = dict(ws_url=url, subscribe=SUBSCRIBE, features=F, max_streams=4, max_batch=16, status_s=0,
                reconnect_min_s=0.1, shutdown_timeout_s=5, heartbeat_s=0)
    base.update(changes)
    return Config(**base)


def _run(feed_server, codec=None, **changes: Any) -> tuple[Any, list[str], list[tuple], Controller]:
    """Run a controller against the exchange until every frame is processed or refused, stop it,
    and wait for the connection's end: (final stats, frames the exchange received, on_results' rows, ctl)."""
    feed = feed_server(exchange(changes.get("replies", "all") if codec is None else "results"), impl="websockets")
    seen: list[tuple] = []

    def on_results(seq, stream, outputs):
        seen.extend(zip(seq, stream))

    expected_errors = sum(INPUT_ERRORS.values()) + 1
    with Controller(_config(feed.url, **changes), codec=codec, sinks=[OnResults(on_results)]) as ctl:
        drive(ctl, lambda: ctl.stats().processed >= TRADES and ctl.stats().errors_total >= expected_errors,
              timeout_s=WAIT_S, what="every trade processed and every bad frame counted")
    feed.wait_for(lambda: feed.connections and feed.connections[0].closed_at is not None, WAIT_S,
                  "the exchange's connection closed")
    assert not feed.script_errors, feed.script_errors
    assert len(feed.connections) == 1
    return ctl.stats(), list(feed.connections[0].received), seen, ctl


def _declined_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not sent" in r.getMessage()]


# ---- the exchange, under each policy ---------------------------------------------------------------


def test_replies_none_sends_the_exchange_nothing_but_the_subscription_and_counts_everything(feed_server, caplog):
    caplog.set_level(logging.INFO, logger="forkless")
    stats, received, seen, ctl = _run(feed_server, replies="none")
    assert received == [SUBSCRIBE]
    assert [s for s, _ in seen] == list(range(TRADES))  # on_results still gets every result
    assert stats.errors == {**INPUT_ERRORS, "too many streams": 1}  # errors by reason, as ever
    assert stats.replies_declined == {**INPUT_ERRORS, "too many streams": 1, "result": TRADES}
    assert (stats.messages_out, stats.errors_out, stats.answer_errors_out) == (0, 0, 0)
    assert stats.no_reply == TRADES + 1 and stats.messages_in == TRADES + 1
    assert_books_balance(ctl)
    logs = _declined_logs(caplog)  # once per reason, not per message
    assert len(logs) == len(INPUT_ERRORS) + 2, logs
    assert sum("'not JSON'" in line for line in logs) == 1
    assert all("the feed's replies are 'none'" in line for line in logs), logs


def test_replies_results_sends_the_results_and_no_error_frame(feed_server):
    stats, received, _, ctl = _run(feed_server, replies="results")
    assert received[0] == SUBSCRIBE
    replies = [json.loads(frame) for frame in received[1:]]
    assert [r["seq"] for r in replies] == list(range(TRADES)) and not any("error" in r for r in replies)
    assert stats.replies_declined == {**INPUT_ERRORS, "too many streams": 1}
    assert (stats.messages_out, stats.errors_out, stats.no_reply) == (TRADES, 0, 1)
    assert stats.errors == {**INPUT_ERRORS, "too many streams": 1}
    assert_books_balance(ctl)


def test_replies_all_answers_every_bad_frame_as_before(feed_server):
    stats, received, _, ctl = _run(feed_server)
    replies = [json.loads(frame) for frame in received[1:]]
    errors = [r["error"] for r in replies if "error" in r]
    assert sorted(errors) == sorted([reason for reason, n in INPUT_ERRORS.items() for _ in range(n)]
                                    + ["too many streams (FORKLESS_MAX_STREAMS=4)"])
    assert sorted(r["seq"] for r in replies if "error" not in r) == list(range(TRADES))
    assert stats.replies_declined == {} and stats.no_reply == 0
    assert (stats.messages_out, stats.errors_out, stats.answer_errors_out) == (TRADES, len(errors), 1)
    assert_books_balance(ctl)


class NoErrorFrames(JsonCodec):
    """A protocol with no error message: ``encode_error`` declines every one."""

    def encode_error(self, reason, seq):
        return None


def test_a_codec_whose_encode_error_returns_none_sends_no_error_frame_counted_and_logged_once(feed_server, caplog):
    caplog.set_level(logging.INFO, logger="forkless")
    stats, received, _, ctl = _run(feed_server, codec=NoErrorFrames(F))  # the exchange allows results only
    replies = [json.loads(frame) for frame in received[1:]]
    assert [r["seq"] for r in replies] == list(range(TRADES))
    assert stats.replies_declined == {**INPUT_ERRORS, "too many streams": 1}
    assert (stats.messages_out, stats.errors_out, stats.no_reply) == (TRADES, 0, 1)
    assert_books_balance(ctl)
    logs = _declined_logs(caplog)
    assert len(logs) == len(INPUT_ERRORS) + 1 and sum("'not JSON'" in line for line in logs) == 1, logs
    assert all("encode_error returned None" in line for line in logs), logs
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "None is a choice, not a codec failure"


# ---- latency: to the results, whoever takes them --------------------------------------------------


def test_latency_is_measured_to_the_results_when_they_go_only_to_on_results(feed_server):
    stats, received, seen, _ = _run(feed_server, replies="none")
    assert received == [SUBSCRIBE]
    assert stats.latency.n == stats.processed == len(seen) == TRADES
    assert stats.latency.total > 0 and 0 < stats.latency.quantile(0.5) <= stats.latency.quantile(0.99) < WAIT_S
    assert stats.write_latency.n == 0  # no frame was written
    line = status_line(stats, None)
    assert "latency p50 - " not in line and "write-latency p99 -" in line, line
    families = {fam.name: fam for fam in metric_families(stats)}

    def count(name: str) -> float:
        return next(s.value for s in families[name].samples if s.name == name + "_count")

    assert count("forkless_latency_seconds") == TRADES and count("forkless_write_latency_seconds") == 0
    # the sampled messages' traces end where their results were handed over: no outbound, no write
    hops = stats.hops
    assert hops["assemble"].n >= 1 and hops["total"].n == hops["assemble"].n
    assert hops["outbound"].n == hops["write"].n == 0
    assert hops["total"].total == pytest.approx(sum(hops[h].total for h in ("decode", "gather", "inbound", "batch",
                                                                               "step", "encode", "assemble")))


def test_with_replies_both_latencies_are_measured(feed_server):
    stats, _, _, _ = _run(feed_server)
    assert stats.latency.n == TRADES  # results only
    assert stats.write_latency.n == stats.messages_out + stats.answer_errors_out  # every frame answering a message
    assert stats.hops["write"].n == stats.hops["total"].n >= 1


# ---- several feeds, each its own policy (fake IO side: exact batches) ---------------------------


def _chunk(feed: int, seqs: list[int], stream: str, trace: bool = False) -> Chunk:
    x = np.arange(len(seqs) * 2, dtype=np.float32).reshape(len(seqs), 2)
    return Chunk(seqs, [stream] * len(seqs), x, 1_000, feed, Trace(feed, 1_000, 2_000) if trace else None)


def test_a_batch_mixing_feeds_of_different_policies_answers_each_as_its_feed_asks():
    feeds = json.dumps([{"url": "ws://h:1/quiet", "name": "quiet", "replies": "none"},
                        {"url": "ws://h:2/loud", "name": "loud"},
                        {"url": "ws://h:3/terse", "name": "terse", "replies": "results"}])
    cfg = Config(feeds=feeds, features=2, max_batch=16, max_streams=3, max_wait_ms=1000.0, status_s=0.0)
    fake = FakeIO()
    with Controller(cfg, processor=default_processor(cfg), runtime=Runtime(io_factory=fake)) as ctl:
        fake.inbound.put_nowait(_chunk(0, [1, 2], "a", trace=True))
        fake.inbound.put_nowait(_chunk(1, [3, 4], "b", trace=True))
        fake.inbound.put_nowait(_chunk(2, [5], "c"))
        fake.inbound.put_nowait(_chunk(0, [6], "d"))  # a fourth stream: refused
        fake.inbound.put_nowait(_chunk(1, [7], "e"))  # refused
        fake.inbound.put_nowait(_chunk(2, [8], "f"))  # refused
        assert ctl.process_pending() == 8
        items = drain(fake.outbound)
        stats = ctl.stats()
    (item,) = items  # one batch: one bundle, a part for each feed that is sent anything
    sent = {part.feed: [json.loads(frame) for frame in part.frames] for part in item.unbundled()}
    assert set(sent) == {1, 2}
    assert [r["seq"] for r in sent[1]] == [3, 4, 7] and sent[1][2]["error"].startswith("too many streams")
    assert [r["seq"] for r in sent[2]] == [5] and "error" not in sent[2][0]
    assert stats.replies_declined == {"result": 2, "too many streams": 2}
    assert stats.no_reply == 4 and stats.latency.n == 5
    assert [n.n for n in stats.feed_latency] == [2, 2, 1]
    # the quiet feed's sampled message ended on the main thread; the loud one's goes on to be written
    assert stats.hops["assemble"].n == 1 and stats.hops["outbound"].n == 0
    assert [trace.feed for part in item.unbundled() for trace in part.traces] == [1]


class EncodeFails(JsonCodec):
    def __init__(self) -> None:
        super().__init__(2)
        self.error_calls = 0

    def encode_results(self, seq, stream, outputs):
        raise RuntimeError("cannot encode")

    def encode_error(self, reason, seq):
        self.error_calls += 1
        return super().encode_error(reason, seq)


@pytest.mark.parametrize("replies", ["results", "none"])
def test_without_error_frames_an_encode_failure_encodes_no_error_frame(replies):
    cfg = Config(ws_url="ws://h:1/x", replies=replies, features=2, max_batch=4, max_streams=4, max_wait_ms=0.0,
                 status_s=0.0)
    codec = EncodeFails()
    fake = FakeIO()
    with Controller(cfg, processor=default_processor(cfg), codec=codec, runtime=Runtime(io_factory=fake)) as ctl:
        fake.inbound.put_nowait(_chunk(0, [1, 2, 3], "a"))
        assert ctl.process_pending() == 3
        assert drain(fake.outbound) == []
        stats = ctl.stats()
    assert codec.error_calls == 0  # nothing encoded that would not be sent
    if replies == "results":  # the encode was tried, and failed
        assert stats.errors == {"encode failed": 3} and stats.replies_declined == {"encode failed": 3}
    else:  # nothing was even encoded
        assert stats.errors == {} and stats.replies_declined == {"result": 3}
    assert stats.no_reply == 3 and stats.latency.n == 3


# ---- configuration ----------------------------------------------------------------------------------


def test_the_policy_is_read_per_feed_with_forkless_replies_as_the_default():
    assert Config().feed_specs[0].replies == "all"
    assert Config.from_env({"FORKLESS_WS_URL": "ws://h:1/x", "FORKLESS_REPLIES": " None "}).feed_specs[0].replies \
        == "none"
    feeds = json.dumps([{"url": "ws://h:1/a", "replies": "results"}, {"url": "ws://h:2/b"}])
    assert [f.replies for f in Config.from_env({"FORKLESS_FEEDS": feeds}).feed_specs] == ["results", "all"]
    assert [f.replies for f in Config.from_env({"FORKLESS_FEEDS": feeds, "FORKLESS_REPLIES": "none"}).feed_specs] \
        == ["results", "none"]
    bad = json.dumps([{"url": "ws://h:1/a", "name": "venue", "replies": "errors"}])
    with pytest.raises(ConfigError, match=r"FORKLESS_FEEDS=.*feed 0 \('venue'\): \"replies\" must be one of "
                                          r"'all', 'results', 'none'"):
        Config.from_env({"FORKLESS_FEEDS": bad})


def test_the_app_exits_2_naming_forkless_replies_for_a_bogus_policy():
    proc = subprocess.run([sys.executable, "app.py"], cwd=ROOT, env=app_env({"FORKLESS_REPLIES": "bogus"}),
                          capture_output=True, text=True, timeout=60 * UNIT_S)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("forkless: configuration error: FORKLESS_REPLIES='bogus' is invalid: expected "
                                   "all, results or none")
    assert proc.stdout == ""
