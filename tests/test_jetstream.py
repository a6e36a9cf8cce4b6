"""JetStream feeds (FORKLESS_FEEDS entries with "nats"): configuration, a JetStream feed beside a
WebSocket feed in one process, replies published with their ids, and exactly-once state across
kill -9, server restarts and retention, against a real nats-server (tests/natsserver.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from controller.config import Config, ConfigError
from controller.loop import Controller
from controller.processor import ewma_processor
from tests.harness import UNIT_S, assert_books_balance, drive, run_app
from tests.servers import FeedConn, assert_results_match_reference, make_messages, parse_replies

pytestmark = pytest.mark.timeout(120 * UNIT_S)

FEATURES = 4


def _js_feed(url: str, **extra: Any) -> dict[str, Any]:
    return {"name": "ticks", "nats": url, "stream": "TICKS", "subject": "ticks.>", "results": "scores", **extra}


def _config(feeds: list[dict], **changes: Any) -> Config:
    base: dict[str, Any] = dict(
        feeds=json.dumps(feeds), features=FEATURES, max_batch=16, max_streams=64, max_wait_ms=1.0, queue_size=64,
        heartbeat_s=0.0, connect_timeout_s=2.0, reconnect_min_s=0.05, reconnect_max_s=0.3,
        reconnect_reset_s=1.0, shutdown_timeout_s=5.0, status_s=0.0)
    base.update(changes)
    return Config(**base)


def _results(url: str, stream: str = "SCORES") -> tuple[dict[str, dict], list[str]]:
    """The results stream: each reply by its Nats-Msg-Id, and every id in stream order."""
    from tests.natsserver import read_stream

    ids, by_id = [], {}
    for headers, data in read_stream(url, stream):
        ids.append(headers["Nats-Msg-Id"])
        by_id[headers["Nats-Msg-Id"]] = json.loads(data)
    return by_id, ids


# ---- configuration ------------------------------------------------------------------------------


def test_a_jetstream_entry_is_read_with_its_fields_and_defaults():
    cfg = Config(feeds=json.dumps([_js_feed("nats://u:PASS@127.0.0.1:4222,nats://127.0.0.1:4223"),
                                   {"url": "ws://127.0.0.1:9/feed", "name": "w"}]))
    js, ws = cfg.feed_specs
    assert js.jetstream is not None and ws.jetstream is None
    assert (js.jetstream.stream, js.jetstream.subject, js.jetstream.results, js.jetstream.start) == (
        "TICKS", "ticks.>", "scores", "first")
    assert js.label == "feed 'ticks' (nats://127.0.0.1:4222,nats://127.0.0.1:4223)"  # no credentials
    assert "PASS" not in repr(cfg) + repr(js)
    whole = Config(feeds=json.dumps([{"name": "t", "nats": "tls://h:1", "stream": "S", "replies": "none",
                                      "start": "new"}])).feed_specs[0].jetstream
    assert (whole.subject, whole.results, whole.start) == ("", "", "new")


@pytest.mark.parametrize(("entry", "expected"), [
    ({"stream": "TI CKS"}, '"stream" must name a JetStream stream'),
    ({"stream": None}, '"stream" must name a JetStream stream'),
    ({"nats": "ws://127.0.0.1:4222"}, '"nats" must be one nats:// or tls:// URL'),
    ({"nats": "nats://127.0.0.1:99999"}, '"nats" must be one nats:// or tls:// URL'),
    ({"subject": "ticks.>.x"}, '"subject" must be a NATS subject filter'),
    ({"results": "scores.*"}, '"results" must be a NATS subject without wildcards'),
    ({"results": ""}, '"results" is required'),
    ({"start": "last"}, '"start" must be "first" or "new"'),
    ({"creds": "/no/such.creds"}, '"creds" must be the path of an existing NATS .creds file'),
    ({"headers": {}}, "unknown field(s) 'headers' for a JetStream feed"),
    ({"nats": "nats://u:PASS-SECRET@h:1", "token": "TOKEN-SECRET"}, "one source of credentials"),
])
def test_a_bad_jetstream_entry_names_the_feed_and_the_field_and_no_secret(entry, expected):
    with pytest.raises(ConfigError) as err:
        Config.from_env({"FORKLESS_FEEDS": json.dumps([{**_js_feed("nats://127.0.0.1:4222"), **entry}])})
    text = str(err.value)
    assert "FORKLESS_FEEDS" in text and "feed 0 ('ticks')" in text and expected in text, text
    assert "SECRET" not in text


def test_a_bad_jetstream_entry_exits_2_naming_the_field():
    result = run_app(env={"FORKLESS_FEEDS": json.dumps([_js_feed("nats://127.0.0.1:4222", results="a b")])},
                     timeout_s=60 * UNIT_S)
    assert result.returncode == 2, result.stderr
    assert "feed 0 ('ticks'): \"results\" must be a NATS subject" in result.stderr


# ---- a JetStream feed beside a WebSocket feed --------------------------------------------------------


def _sender(messages: list[dict], done: threading.Event):
    async def script(conn: FeedConn) -> None:
        reader = conn.reading(timeout=60)
        for i, m in enumerate(messages):
            await conn.send(m)
            if i % 8 == 0:
                await asyncio.sleep(0.001)
        while conn.server.received_count < len(messages):
            await asyncio.sleep(0.005)
        done.set()
        await reader

    return script


def test_a_websocket_feed_and_a_jetstream_feed_in_one_process_each_reply_to_its_own_origin(feed_server, nats_server):
    from tests.natsserver import create_streams, publish

    create_streams(nats_server.url)
    ws_messages = make_messages(150, streams=3, seed=11)
    js_messages = make_messages(150, streams=4, seed=12, start=10_000)
    # one payload holds a list of three elements, the middle one bad: ids :0 and :1 for the good
    # ones, :2 for the error reply (the good elements are numbered first)
    listed = [make_messages(1, streams=1, seed=13, start=20_000)[0] | {"stream": "L"}, {"seq": 20_001, "x": [1]},
              make_messages(1, streams=1, seed=14, start=20_002)[0] | {"stream": "L"}]
    done = threading.Event()
    ws = feed_server(_sender(ws_messages, done), impl="websockets")
    seqs = publish(nats_server.url, lambda i: f"ticks.s{i % 4}", [json.dumps(m) for m in js_messages])
    (list_seq,) = publish(nats_server.url, "ticks.list", [json.dumps(listed)])
    cfg = _config([{"url": ws.url, "name": "w"}, _js_feed(nats_server.url)])
    with Controller(cfg, processor=ewma_processor()) as ctl:
        drive(ctl, lambda: done.is_set() and ctl.stats().feeds[1].io.results_out == 152, timeout_s=30 * UNIT_S,
              what="both feeds answered")
        snap = ctl.stats()
    # the WebSocket feed: its own messages' replies only, equal to the reference
    results, errors = parse_replies(ws.received)
    assert errors == []
    assert_results_match_reference(ws_messages, results)
    # the JetStream feed: one reply per element in the results stream, named by the input's sequence
    by_id, ids = _results(nats_server.url)
    assert len(ids) == len(set(ids)) == 153
    js_results = {seq: [by_id[f"TICKS:{s}:0"]] for seq, s in zip((m["seq"] for m in js_messages), seqs)}
    assert_results_match_reference(js_messages, js_results)
    assert by_id[f"TICKS:{list_seq}:0"]["seq"] == 20_000 and by_id[f"TICKS:{list_seq}:1"]["seq"] == 20_002
    assert by_id[f"TICKS:{list_seq}:2"] == {"error": "missing field: stream", "seq": 20_001}
    ws_feed, js_feed = snap.feeds
    assert ws_feed.io.results_out == 150 and js_feed.io.results_out == 152 and js_feed.io.errors_out == 1
    (src,) = snap.sources
    assert (src.name, src.fetched, src.applied, src.applied_seq, src.lag) == ("ticks", 151, 152, list_seq, 0)
    assert_books_balance(ctl)
