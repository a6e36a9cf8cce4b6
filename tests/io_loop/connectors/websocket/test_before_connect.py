"""Credentials per connection: ``Controller(config, before_connect=hook)`` and its ``Handshake``.

The hook's rules are io_loop/connectors/websocket/before_connect.py's. ``resolve`` (what the hook returned, made the
attempt's URL and headers) is tested with literal values; the rest against a real loopback
exchange that wants a login first (tests/login_server.py: ``POST /login`` issues tokens, the
feed refuses an expired one with 401), with the hook logging in over ``aiohttp.ClientSession``
as an embedder's would. One ``Processor`` object is shared so the step is compiled once.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pytest

from forkless import ConnectHooks, FeedFatal, Handshake
from forkless.controller.config import Config
from forkless.controller.loop import Controller
from forkless.controller.processor import ewma_processor
from forkless.io_loop.connectors.websocket.before_connect import resolve
from tests.harness import UNIT_S, assert_books_balance, drive, quick_config
from tests.login_server import LOGIN_KEY, LoginFeedServer, token_of
from tests.servers import FeedConn, make_messages, parse_replies, self_signed_certificate, server_ssl_context

pytestmark = pytest.mark.timeout(60 * UNIT_S)

PROCESSOR = ewma_processor()
FEATURES = 4
REFRESH = "asking before_connect for new credentials"


def _config(url: str, **changes: Any) -> Config:
    return quick_config(ws_url=url, features=FEATURES, **{"reconnect_reset_s": 1.0, **changes})


@pytest.fixture
def login_server() -> Iterator[Callable[..., LoginFeedServer]]:
    """A factory like ``feed_server``: started, always stopped, a script that raised fails the test."""
    started: list[LoginFeedServer] = []

    def start(script: Any = None, **options: Any) -> LoginFeedServer:
        server = LoginFeedServer(script, **options)
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop()
    assert not [exc for server in started for exc in server.script_errors]


async def _log_in(server: LoginFeedServer, tls: ssl.SSLContext | bool = True) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.post(server.login_url, json={"key": LOGIN_KEY}, ssl=tls) as response:
            response.raise_for_status()
            return (await response.json())["token"]


async def _answered(conn: FeedConn, messages: list[dict]) -> None:
    """A script step: send ``messages`` and read a reply to each."""
    for m in messages:
        await conn.send(m)
    for _ in messages:
        await conn.recv(timeout=10)


def _log_text(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() + (str(r.exc_info[1]) if r.exc_info and r.exc_info[1] else "")
                     for r in caplog.records)


# ---- resolve: what the hook returned, as the attempt's URL and headers --------------------------


CONFIGURED = {"X-Static": "configured", "Authorization": "Bearer configured-t0ken"}


def test_none_means_the_configured_url_and_headers():
    assert resolve(None, "ws://h:1/feed", CONFIGURED) == ("ws://h:1/feed", CONFIGURED)


def test_a_handshake_s_url_replaces_the_configured_one_and_its_headers_win_by_name_in_any_case():
    url, headers = resolve(Handshake(url="wss://other:2/ws?token=t", headers={"authorization": "Bearer new",
                                                                              "X-Attempt": "3"}),
                           "ws://h:1/feed", CONFIGURED)
    assert url == "wss://other:2/ws?token=t"
    assert headers == {"X-Static": "configured", "authorization": "Bearer new", "X-Attempt": "3"}
    assert resolve(Handshake(headers={"X-A": "1"}), "ws://h:1/feed", {}) == ("ws://h:1/feed", {"X-A": "1"})


@pytest.mark.parametrize(("result", "error", "says"), [
    ("ws://h/ws?token=s3cret", TypeError, "before_connect returned a str; return a Handshake(url=..., headers"),
    ({"url": "ws://h/"}, TypeError, "before_connect returned a dict"),
    (Handshake(url="http://h/ws?token=s3cret"), ValueError, "the URL 'http://h/ws': expected a ws:// or wss://"),
    (Handshake(url="ws:///ws?token=s3cret"), ValueError, "expected a ws:// or wss:// URL with a host"),
    (Handshake(url="ws://[::1/ws?token=s3cret"), ValueError, "expected a ws:// or wss:// URL with a host"),
    (Handshake(url="ws://h:99999/ws"), ValueError, "port 1-65535"),
    (Handshake(url=b"ws://h/"), TypeError, "a URL that is a bytes, not a str"),
    (Handshake(headers=[("X-A", "s3cret")]), TypeError, "headers that are a list, not a mapping"),
    (Handshake(headers={"X A": "s3cret"}), ValueError, "the header name 'X A', which is not an HTTP token"),
    (Handshake(headers={"X-A": "s3cret\r\nX-B: 1"}), ValueError, "for the header 'X-A' that is not a str without"),
    (Handshake(headers={"X-A": 5}), ValueError, "for the header 'X-A' that is not a str"),
    (Handshake(url="ws://u:s3cret@h/"), ValueError, "two sources of credentials"),
])
def test_anything_else_is_refused_saying_what_is_wrong_without_the_secret(result, error, says):
    with pytest.raises(error) as err:
        resolve(result, "ws://h:1/feed", CONFIGURED)
    assert says in str(err.value) and "s3cret" not in str(err.value)


def test_a_handshake_s_repr_shows_neither_the_query_nor_credentials_nor_header_values():
    shown = repr(Handshake(url="wss://u:pw@h/ws?token=s3cret", headers={"Authorization": "Bearer s3cret"}))
    assert shown == "Handshake(url='wss://h/ws', headers=<1 hidden>)"


# ---- against the login server ---------------------------------------------------------------------


def test_the_hook_s_url_and_headers_are_used_on_each_attempt_and_it_runs_on_the_io_loop(login_server):
    calls: list[tuple[str, int, str]] = []

    async def hook(feed: str, attempt: int) -> Handshake:
        calls.append((feed, attempt, threading.current_thread().name))
        token = await _log_in(server)
        return Handshake(url=f"{server.url}?token={token}", headers={"x-static": "from the hook",
                                                                     "X-Login": token})

    async def script(conn: FeedConn) -> None:
        if conn.index < 2:
            await _answered(conn, make_messages(1, start=conn.index))
            await conn.close_keep_reading()  # the server ends it: the client reconnects
        else:
            await conn.read_until_closed(timeout=30)

    server = login_server(script)
    cfg = _config("ws://127.0.0.1:9/not-used", headers=(("X-Static", "configured"), ("X-Other", "kept")))
    with Controller(cfg, processor=PROCESSOR, connect=ConnectHooks(before_connect=hook)) as ctl:
        # the server sees the third connection before the client has counted it open (a race the
        # suite on two workers lost): both are waited for
        drive(ctl, lambda: len(server.connections) >= 3 and ctl.stats().connects >= 3, timeout_s=15 * UNIT_S,
              what="three connections, seen by the server and counted by the client")
        stats = ctl.stats()
    assert calls == [("0", 1, "forkless-io")] * 3  # 1 each time: every attempt before it was served
    assert server.logins == ["tok-1", "tok-2", "tok-3"]
    assert [(seen.token, seen.status) for seen in server.handshakes] == [("tok-1", None), ("tok-2", None),
                                                                          ("tok-3", None)]
    for seen in server.handshakes:
        assert seen.headers.getall("X-Static") == ["from the hook"]  # replaced, not sent twice
        assert seen.headers["X-Login"] == seen.token and seen.headers["X-Other"] == "kept"
    results, errors = parse_replies([f for conn in server.connections[:2] for f in conn.received])
    assert sorted(results) == [0, 1] and errors == []
    assert stats.connect_failures == 0 and stats.connects == 3
    assert_books_balance(ctl)


@pytest.mark.parametrize("status", [401, 403])
def test_an_expired_token_refused_on_the_reconnect_makes_the_hook_log_in_again_and_the_session_goes_on(
        login_server, caplog, status):
    calls: list[int] = []
    token: list[str] = []  # the cached token: reused on a first attempt, renewed after a failed one
    first, second = make_messages(3), make_messages(3, start=3)

    async def hook(feed: str, attempt: int) -> Handshake:
        calls.append(attempt)
        if not token or attempt > 1:
            token[:] = [await _log_in(server)]
        return Handshake(headers={"Authorization": f"Bearer {token[0]}"})

    async def script(conn: FeedConn) -> None:
        if conn.index == 0:
            await _answered(conn, first)
            conn.server.expire(token_of(conn))  # the token expires while the connection is open
            await conn.close_keep_reading(4003)  # the exchange's "token expired"
        else:
            await _answered(conn, second)
            await conn.read_until_closed(timeout=30)

    server = login_server(script, refusal=status)
    with caplog.at_level(logging.INFO, logger="forkless"):
        with Controller(_config(server.url), processor=PROCESSOR, connect=ConnectHooks(before_connect=hook)) as ctl:
            drive(ctl, lambda: server.received_count >= len(first) + len(second), timeout_s=15 * UNIT_S,
                  what="replies on both connections")
            stats = ctl.stats()
            assert ctl._io.alive
    # the reconnect reused the expired token and was refused; the next attempt logged in again
    assert calls == [1, 1, 2] and server.logins == ["tok-1", "tok-2"]
    assert [(seen.token, seen.status) for seen in server.handshakes] == [("tok-1", None), ("tok-1", status),
                                                                          ("tok-2", None)]
    assert stats.connect_failures == 1 and stats.connects == 2
    results, errors = parse_replies(server.received)
    assert sorted(results) == list(range(6)) and errors == []
    text = _log_text(caplog)
    assert f"handshake refused with HTTP {status}: {REFRESH}" in text
    assert "closed by the server (code 4003)" in text
    assert "tok-1" not in text and "tok-2" not in text  # the tokens are never logged
    assert_books_balance(ctl)


def test_a_close_with_an_application_code_reconnects_with_a_fresh_hook_call(login_server, caplog):
    calls: list[int] = []

    async def hook(feed: str, attempt: int) -> Handshake:
        calls.append(attempt)
        return Handshake(url=f"{server.url}?token={await _log_in(server)}")

    async def script(conn: FeedConn) -> None:
        await _answered(conn, make_messages(1, start=conn.index))
        if conn.index == 0:
            await conn.close_keep_reading(4003)
        else:
            await conn.read_until_closed(timeout=30)

    server = login_server(script)
    with caplog.at_level(logging.WARNING, logger="forkless"):
        with Controller(_config(server.url), processor=PROCESSOR, connect=ConnectHooks(before_connect=hook)) as ctl:
            drive(ctl, lambda: server.received_count >= 2, timeout_s=15 * UNIT_S, what="a reply on each connection")
            stats = ctl.stats()
    assert calls == [1, 1] and [seen.token for seen in server.handshakes] == ["tok-1", "tok-2"]
    assert stats.reconnects == 1 and stats.connect_failures == 0
    assert "closed by the server (code 4003)" in _log_text(caplog)
    assert_books_balance(ctl)


def test_a_wss_url_from_the_hook_is_opened_with_tls_and_the_configured_ca_file(login_server, tmp_path):
    cert, key = self_signed_certificate(tmp_path)
    trusted = ssl.create_default_context(cafile=str(cert))

    async def hook(feed: str, attempt: int) -> Handshake:
        return Handshake(url=f"{server.url}?token={await _log_in(server, trusted)}")

    async def script(conn: FeedConn) -> None:
        await _answered(conn, make_messages(2))
        await conn.read_until_closed(timeout=30)

    server = login_server(script, ssl_context=server_ssl_context(cert, key))
    assert server.url.startswith("wss://")
    configured = server.url.replace("wss://", "ws://")  # the configured URL is plain: no TLS context made at start
    with Controller(_config(configured, ca_file=str(cert)), processor=PROCESSOR,
                    connect=ConnectHooks(before_connect=hook)) as ctl:
        drive(ctl, lambda: server.received_count >= 2, timeout_s=15 * UNIT_S, what="replies over TLS")
        stats = ctl.stats()
    assert [seen.token for seen in server.handshakes] == ["tok-1"] and stats.connect_failures == 0
    assert_books_balance(ctl)


def test_a_hook_that_fails_is_retried_counted_and_logged_once_per_distinct_error_and_the_io_thread_lives(
        login_server, caplog):
    calls: list[int] = []

    async def hook(feed: str, attempt: int) -> Any:
        calls.append(attempt)
        if attempt <= 2:
            raise ConnectionError("login server down")
        if attempt == 3:
            return "not a handshake"
        if attempt == 4:
            return Handshake(url="http://127.0.0.1:9/feed?token=s3cret")
        if attempt == 5:
            await asyncio.sleep(30)  # past FORKLESS_CONNECT_TIMEOUT_S
        return Handshake(url=f"{server.url}?token={await _log_in(server)}")

    async def script(conn: FeedConn) -> None:
        await _answered(conn, make_messages(2))
        await conn.read_until_closed(timeout=30)

    server = login_server(script)
    with caplog.at_level(logging.WARNING, logger="forkless"):
        with Controller(_config(server.url, connect_timeout_s=0.3), processor=PROCESSOR,
                        connect=ConnectHooks(before_connect=hook)) as ctl:
            drive(ctl, lambda: server.received_count >= 2, timeout_s=15 * UNIT_S, what="replies after the failures")
            assert ctl._io.alive
            stats = ctl.stats()
    assert calls == [1, 2, 3, 4, 5, 6]
    assert [seen.token for seen in server.handshakes] == ["tok-1"]  # a failed hook makes no request
    assert stats.connect_failures == 5 and stats.connects == 1
    logged = [r for r in caplog.records if r.levelno == logging.ERROR and "before_connect" in r.getMessage()]
    assert [r.exc_info[0] if r.exc_info else None for r in logged] == [ConnectionError, TypeError, ValueError,
                                                                        None], [r.getMessage() for r in logged]
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) == 5
    assert "the before_connect hook failed: ConnectionError: login server down" in retries[0]
    assert "the before_connect hook failed: TypeError: before_connect returned a str" in retries[2]
    assert "before_connect returned the URL 'http://127.0.0.1:9/feed': expected a ws:// or wss://" in retries[3]
    assert "did not return within FORKLESS_CONNECT_TIMEOUT_S=0.3s" in retries[4]
    assert "s3cret" not in _log_text(caplog)
    assert_books_balance(ctl)


def test_a_hook_that_keeps_giving_a_refused_token_ends_in_feed_fatal_after_the_tries(login_server):
    calls: list[int] = []

    def hook(feed: str, attempt: int) -> Handshake:  # a plain function works too
        calls.append(attempt)
        return Handshake(url=f"{server.url}?token=revoked")

    server = login_server()
    with pytest.raises(FeedFatal, match=rf"after 3 failed attempts in a row: handshake refused with HTTP 401: "
                                        rf"{REFRESH}"):  # at start() or at a later call: whichever comes first
        with Controller(_config(server.url, reconnect_tries=3), processor=PROCESSOR,
                        connect=ConnectHooks(before_connect=hook)) as ctl:
            drive(ctl, lambda: False, timeout_s=15 * UNIT_S, what="FeedFatal")
    assert calls == [1, 2, 3] and [seen.status for seen in server.handshakes] == [401] * 3


def test_without_a_hook_a_401_stays_fatal_at_once(login_server):
    server = login_server()
    with pytest.raises(FeedFatal, match=r"refused the WebSocket handshake with HTTP 401 \(unauthorised: check "
                                        r"FORKLESS_AUTH_TOKEN\)"):
        with Controller(_config(f"{server.url}?token=revoked"), processor=PROCESSOR) as ctl:
            drive(ctl, lambda: False, timeout_s=15 * UNIT_S, what="FeedFatal")
    assert [seen.status for seen in server.handshakes] == [401]


def test_the_hook_runs_for_the_embedded_demo_feed_too_and_none_keeps_its_address():
    calls: list[tuple[str, int]] = []

    def hook(feed: str, attempt: int) -> None:
        calls.append((feed, attempt))

    cfg = _config("", demo_rate=200.0)
    with Controller(cfg, processor=PROCESSOR, connect=ConnectHooks(before_connect=hook)) as ctl:
        drive(ctl, lambda: ctl.stats().messages_in > 0, timeout_s=15 * UNIT_S, what="demo messages")
    assert calls == [("0", 1)]
