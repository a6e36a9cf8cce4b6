"""Subscriptions: ``Config(subscribe=<JSON value>)``, the on-connect hook, and acknowledgement frames.

Against real loopback servers (tests/servers.py): what the server received first on each
connection is compared frame for frame. The hook's rules are io_loop/connectors/websocket/on_connect.py's; the
acknowledgement is a codec's ``decode`` returning ``Decoded()`` (no message, no error).
One ``Processor`` object is shared so the step is compiled once for the file.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import threading
from typing import Any

import pytest

from forkless import ConnectHooks
from forkless.controller.codec import Decoded, JsonCodec
from forkless.controller.config import Config
from forkless.controller.loop import Controller
from forkless.controller.processor import ewma_processor
from forkless.controller.stats import books_line
from forkless.io_loop.connectors.websocket.on_connect import call_hook, frames_of
from forkless.io_loop.errors import ConfigError
from forkless.io_loop.hooks import HookFailed
from tests.harness import UNIT_S, assert_books_balance, drive, quick_config
from tests.servers import SERVERS, FeedConn, make_messages, parse_replies

pytestmark = pytest.mark.timeout(60 * UNIT_S)

PROCESSOR = ewma_processor()
FEATURES = 4


def _config(url: str, **changes: Any) -> Config:
    return quick_config(ws_url=url, features=FEATURES, **{"reconnect_reset_s": 1.0, **changes})


# ---- Config(subscribe=<a JSON value>) ---------------------------------------------------------


def test_subscribe_given_a_json_value_in_code_is_kept_as_its_compact_text():
    value = {"op": "subscribe", "args": ["book.A", 5], "auth": {"key": "subscr1be-key"}}
    text = '{"op":"subscribe","args":["book.A",5],"auth":{"key":"subscr1be-key"}}'
    cfg = Config(ws_url="ws://127.0.0.1:9/feed", subscribe=value)
    assert cfg.subscribe == text and cfg == Config(ws_url="ws://127.0.0.1:9/feed", subscribe=text)
    assert cfg.feed_specs[0].subscribe == text
    cfg.validate()  # the round trip of validate() holds for the stored text
    assert cfg.replace(features=3).subscribe == text
    assert Config.from_env({}, subscribe=["a", 1]).subscribe == '["a",1]'
    assert Config(subscribe=None).subscribe == ""
    assert "subscr1be" not in repr(cfg)
    # the same value in FORKLESS_FEEDS becomes the same text
    feeds = Config(feeds=json.dumps([{"url": "ws://127.0.0.1:9/feed", "subscribe": value}]))
    assert feeds.feed_specs[0].subscribe == text


@pytest.mark.parametrize("bad", [{"a", "b"}, {"key": b"subscr1be"}, {"x": float("nan")}, {"k": object()}])
def test_a_subscribe_value_json_cannot_write_is_a_config_error_naming_the_variable_and_hiding_it(bad):
    with pytest.raises(ConfigError) as err:
        Config(subscribe=bad)
    assert err.value.variable == "FORKLESS_SUBSCRIBE" and err.value.value == "<hidden>"
    assert "JSON-serialisable value" in str(err.value) and "subscr1be" not in str(err.value)
    assert type(bad).__name__ in str(err.value)


@pytest.mark.parametrize("impl", sorted(SERVERS))
def test_a_subscribe_value_is_the_first_frame_the_server_receives_exactly(feed_server, impl):
    value = {"op": "subscribe", "args": ["s0", "s1"], "depth": 5}
    messages = make_messages(4)

    async def script(conn: FeedConn) -> None:
        first = await conn.recv(timeout=10)
        if first == '{"op":"subscribe","args":["s0","s1"],"depth":5}':  # the exact frame, or no data
            for m in messages:
                await conn.send(m)
        await conn.read_until_closed(timeout=30)

    server = feed_server(script, impl=impl)
    with Controller(_config(server.url, subscribe=value), processor=PROCESSOR) as ctl:
        drive(ctl, lambda: server.received_count >= 1 + len(messages), timeout_s=15 * UNIT_S,
              what="the subscription and a reply to each message")
    results, errors = parse_replies(server.connections[0].received[1:])
    assert sorted(results) == [m["seq"] for m in messages] and errors == []
    assert_books_balance(ctl)


# ---- the on-connect hook ----------------------------------------------------------------------------


def test_frames_of_takes_none_a_frame_or_a_list_of_them():
    assert frames_of(None) == [] and frames_of([]) == []
    assert frames_of("a") == ["a"] and frames_of(b"b") == [b"b"]
    assert frames_of({"op": "sub", "n": [1, 2]}) == ['{"op":"sub","n":[1,2]}']
    assert frames_of(["a", b"b", {"c": 1}, ("t", 1)]) == ["a", b"b", '{"c":1}', '["t",1]']  # inside: a value
    assert frames_of(("a", {"c": 1})) == ["a", '{"c":1}']  # a tuple of frames, like a list
    for bad in ({1, 2}, [object()], {"x": float("inf")}):
        with pytest.raises(TypeError, match="on_connect returned a"):
            frames_of(bad)


def test_call_hook_bounds_an_async_hook_and_names_what_failed():
    async def slow(feed: str, connection: int) -> str:
        await asyncio.sleep(10)
        return "late"

    async def raises_timeout(feed: str, connection: int) -> str:
        raise TimeoutError("the hook's own")

    async def fine(feed: str, connection: int) -> list:
        return [feed, {"n": connection}]

    with pytest.raises(HookFailed, match=r"did not return within FORKLESS_CONNECT_TIMEOUT_S=0\.05s"):
        asyncio.run(call_hook(slow, "a", 1, 0.05))
    with pytest.raises(HookFailed, match="the on_connect hook failed: TimeoutError: the hook's own") as err:
        asyncio.run(call_hook(raises_timeout, "a", 1, 5.0))
    assert isinstance(err.value.__cause__, TimeoutError)
    assert asyncio.run(call_hook(fine, "a", 7, 5.0)) == ["a", '{"n":7}']


SECRET = b"test-secret"


def _signed(feed: str, connection: int) -> dict:
    payload = f"{feed}:{connection}"
    return {"op": "auth", "feed": feed, "connection": connection,
            "sig": hmac.new(SECRET, payload.encode(), hashlib.sha256).hexdigest()}


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_hook_is_called_on_the_io_loop_for_every_connection_and_its_frames_follow_the_subscribe(
        feed_server, kind):
    calls: list[tuple[str, int, str]] = []

    def frames(feed: str, connection: int) -> list:
        calls.append((feed, connection, threading.current_thread().name))
        return [_signed(feed, connection), f"plain {connection}", b'{"bytes":true}']

    if kind == "sync":
        hook = frames
    else:
        async def hook(feed: str, connection: int) -> list:
            await asyncio.sleep(0.01)  # an async hook may wait (a token from elsewhere, say)
            return frames(feed, connection)

    async def script(conn: FeedConn) -> None:
        for _ in range(4):  # the fixed subscribe text, then the hook's three frames
            await conn.recv(timeout=10)
        if conn.index < 2:
            await conn.send(make_messages(1, start=conn.index)[0])
            await conn.recv(timeout=10)
            await conn.close_keep_reading()  # the server ends it: the client reconnects
        else:
            await conn.read_until_closed(timeout=30)

    server = feed_server(script, impl="websockets")
    cfg = _config(server.url, subscribe={"op": "subscribe", "args": ["s0"]})
    with Controller(cfg, processor=PROCESSOR, connect=ConnectHooks(on_connect=hook)) as ctl:
        drive(ctl, lambda: len(server.connections) >= 3 and len(server.connections[2].received) >= 4,
              timeout_s=15 * UNIT_S, what="three connections, each subscribed")
    assert calls == [("0", 1, "forkless-io"), ("0", 2, "forkless-io"), ("0", 3, "forkless-io")]
    for n, conn in enumerate(server.connections[:3], start=1):
        signed = json.dumps(_signed("0", n), separators=(",", ":"))
        assert conn.received[:4] == ['{"op":"subscribe","args":["s0"]}', signed, f"plain {n}", '{"bytes":true}']
    assert [json.loads(conn.received[4])["seq"] for conn in server.connections[:2]] == [0, 1]
    assert_books_balance(ctl)


def test_a_hook_that_fails_fails_the_attempt_is_retried_and_logged_once_per_distinct_error(feed_server, caplog):
    calls: list[int] = []
    messages = make_messages(3)

    def hook(feed: str, connection: int) -> Any:
        calls.append(connection)
        if len(calls) <= 3:
            raise ValueError("no signing key yet")
        if len(calls) == 4:
            return {"not", "a frame"}  # a set: not a frame
        return {"op": "auth", "connection": connection}

    async def script(conn: FeedConn) -> None:
        first = await conn.recv(timeout=10)
        if first is not None:  # the connection the hook succeeded on
            for m in messages:
                await conn.send(m)
        await conn.read_until_closed(timeout=30)

    server = feed_server(script)
    with caplog.at_level(logging.WARNING, logger="forkless"):
        with Controller(_config(server.url), processor=PROCESSOR, connect=ConnectHooks(on_connect=hook)) as ctl:
            drive(ctl, lambda: server.received_count >= 1 + len(messages), timeout_s=15 * UNIT_S,
                  what="the subscription after the failures, and the replies")
            assert ctl._io.alive
            stats = ctl.stats()
    # the four failed attempts were connections the client closed with 1011 (internal error)
    # before sending anything; none of them used up a connection number
    assert calls == [1, 1, 1, 1, 1]
    assert [conn.received for conn in server.connections[:4]] == [[]] * 4
    assert [conn.client_close_code for conn in server.connections[:4]] == [1011] * 4
    assert server.connections[4].received[0] == '{"op":"auth","connection":1}'
    assert stats.connect_failures == 4 and stats.connects == 1
    results, errors = parse_replies(server.connections[4].received[1:])
    assert sorted(results) == [0, 1, 2] and errors == []
    # the traceback once per distinct error; each retry is a warning like any failed connect
    logged = [r for r in caplog.records if r.levelno == logging.ERROR and "on_connect" in r.getMessage()]
    assert [r.exc_info[0] for r in logged] == [ValueError, TypeError], [r.getMessage() for r in logged]
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) == 4 and "the on_connect hook failed: ValueError: no signing key yet" in retries[0]
    assert_books_balance(ctl)


# ---- acknowledgement frames ---------------------------------------------------------------------------


class AckAwareCodec(JsonCodec):
    """The JSON protocol, plus the exchange's control frames (``{"event": ...}``): no message."""

    def decode(self, frame: str | bytes) -> Decoded:
        text = frame.decode() if isinstance(frame, bytes) else frame
        if text.startswith('{"event"'):
            return Decoded()
        return super().decode(frame)


@pytest.mark.parametrize("impl", sorted(SERVERS))
def test_an_ack_frame_decoded_to_nothing_gets_no_reply_and_no_error_count_and_the_books_balance(feed_server, impl):
    messages = make_messages(5)
    acks = ['{"event":"subscribed","channel":"book"}', b'{"event":"heartbeat"}']

    async def script(conn: FeedConn) -> None:
        reader = conn.reading()
        await conn.send_frame(acks[0])
        for m in messages[:3]:
            await conn.send(m)
        await conn.send_frame(acks[1])
        for m in messages[3:]:
            await conn.send(m)
        await reader

    server = feed_server(script, impl=impl)
    with Controller(_config(server.url, subscribe={"op": "subscribe"}), processor=PROCESSOR,
                    codec=AckAwareCodec(FEATURES)) as ctl:
        drive(ctl, lambda: server.received_count >= 1 + len(messages), timeout_s=15 * UNIT_S,
              what="a reply to each message")
    stats = ctl.stats()
    received = server.connections[0].received
    results, errors = parse_replies(received[1:])
    assert sorted(results) == [m["seq"] for m in messages] and errors == []
    assert stats.frames_in == len(messages) + len(acks) and stats.messages_in == len(messages)
    assert stats.errors == {} and stats.errors_out == 0
    assert_books_balance(ctl)
    assert f"in {len(messages)} = results {len(messages)} + error replies 0" in books_line(stats)
