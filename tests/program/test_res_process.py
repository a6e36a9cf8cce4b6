"""Fault tests of the whole program: ``python app.py`` as a subprocess (tests/harness.py)
against a real loopback server (tests/servers.py), where the behaviour belongs to the process:
exit status, signals, what reaches stdout/stderr. Every run is bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.harness import UNIT_S, AppProcess, AppResult
from tests.servers import (
    SERVERS,
    FeedConn,
    LoopbackServer,
    assert_results_match_reference,
    make_messages,
    parse_replies,
    self_signed_certificate,
    server_ssl_context,
)

pytestmark = pytest.mark.timeout(60 * UNIT_S)

RUN_TIMEOUT_S = 30.0 * UNIT_S
TOKEN = "tok-5ecret-d0-not-log-71c3"
HEADER_SECRET = "hdr-5ecret-a9f2"


def _env(url: str, **extra: str) -> dict[str, str]:
    """The app's FORKLESS_* settings for these tests (the launcher adds JAX_PLATFORMS=cpu)."""
    env = dict(
        PYTHONUNBUFFERED="1",
        FORKLESS_WS_URL=url, FORKLESS_FEATURES="4", FORKLESS_MAX_BATCH="16", FORKLESS_MAX_STREAMS="64",
        FORKLESS_STATUS_S="0", FORKLESS_RECONNECT_MIN_S="0.05", FORKLESS_RECONNECT_MAX_S="0.2",
        FORKLESS_CONNECT_TIMEOUT_S="3",
    )
    env.update(extra)
    return env


App = Callable[..., AppProcess]


@pytest.mark.parametrize("status", [401, 404])
def test_handshake_4xx_exits_3_at_once_with_a_message_naming_the_status(feed_server: Any, app: App,
                                                                        status: int) -> None:
    server = feed_server(handshake_status=lambda i: status)
    code, out, err, exited = app(env=_env(server.url, FORKLESS_AUTH_TOKEN=TOKEN)).finish(RUN_TIMEOUT_S)
    assert code == 3, err
    assert f"HTTP {status}" in err
    assert len(server.attempts) == 1, "a 4xx is not retried"
    assert exited - server.attempts[0].at <= 5.0 * UNIT_S
    assert TOKEN not in out + err


def test_io_thread_crash_exits_non_zero_promptly_with_the_traceback(feed_server: Any, app: App) -> None:
    crashed_at: list[float] = []

    async def script(conn: FeedConn) -> None:
        for m in make_messages(3):
            await conn.send(m)
        for _ in range(3):
            await conn.recv(timeout=20)
        crashed_at.append(time.monotonic())
        await conn.send("boom")
        await conn.read_until_closed(timeout=20)

    program = textwrap.dedent("""
        import sys
        import app
        from forkless.controller.codec import JsonCodec

        class InjectedCrash(BaseException):  # not an Exception: passes the codec guard, as an IO-side bug would
            pass

        class Boom(JsonCodec):
            def decode(self, frame):
                text = frame if isinstance(frame, str) else bytes(frame).decode("utf-8", "replace")
                if "boom" in text:
                    raise InjectedCrash("injected IO-thread failure")
                return super().decode(frame)

        sys.exit(app.main([], codec=Boom(4)))
    """)
    server = feed_server(script)
    # the stop's deadline is a minute: an exit that waited for it, not noticing the crash, shows
    env = _env(server.url, FORKLESS_SHUTDOWN_TIMEOUT_S="60")
    code, _out, err, exited = app(env=env, program=("-c", program)).finish(RUN_TIMEOUT_S + 60 * UNIT_S)
    assert crashed_at, err
    # a BaseException out of a source's run (the built-in feed's, here through its codec) gives that source
    # up as FeedFatal naming it, with its traceback logged (docs/embedding/exceptions.md): exit 3
    assert code == 3, err
    assert exited - crashed_at[0] < 30 * UNIT_S  # under a second here; the bound leaves a slow machine room
    assert "Traceback" in err and "InjectedCrash: injected IO-thread failure" in err


def _flood_frame(index: int, items: int) -> list[dict]:
    """Frame ``index`` of an endless, reproducible flood: a fixed block of data, fresh seqs."""
    block = _FLOOD_BLOCK
    return [dict(block[(index * items + j) % len(block)], seq=index * items + j) for j in range(items)]


_FLOOD_BLOCK = make_messages(997, streams=8, seed=3)


def _flood_script(items: int, pause_s: float):
    """A server that sends frames of ``items`` messages, ``pause_s`` apart (0: as fast as TCP
    takes them), until the client closes, and records every reply."""

    async def script(conn: FeedConn) -> None:
        async def flood() -> None:
            index = 0
            while True:
                await conn.send(_flood_frame(index, items))
                index += 1
                await asyncio.sleep(pause_s)  # also lets the reply reader run

        sender = asyncio.create_task(flood())
        try:
            await conn.read_until_closed(timeout=40)
        finally:
            sender.cancel()

    return script


def _sigterm_when_replies_flow(server: LoopbackServer, proc: AppProcess, timeout_s: float) -> tuple[AppResult, float]:
    """SIGTERM once 2000 replies reached the server; how the run ended and how long after the signal."""
    server.wait_for(lambda: server.received_count >= 2000, 30 * UNIT_S, "replies flowing")
    signalled = proc.signal(signal.SIGTERM)
    result = proc.finish(timeout_s)
    return result, result.exited_at - signalled


@pytest.mark.parametrize("impl", sorted(SERVERS))
def test_sigterm_while_fed_exits_0_and_answers_every_message_it_read(feed_server: Any, app: App, impl: str) -> None:
    items, shutdown_timeout_s = 20, 10.0
    server = feed_server(_flood_script(items, pause_s=0.002), impl=impl)
    # one status line, at the stop: the client's own count of messages it read
    proc = app(env=_env(server.url, FORKLESS_SHUTDOWN_TIMEOUT_S=str(shutdown_timeout_s), FORKLESS_STATUS_S="3600"))
    (code, out, err, _), elapsed = _sigterm_when_replies_flow(server, proc, 20 * UNIT_S)
    conn = server.connections[0]
    server.wait_for(lambda: conn.closed_at is not None, 5 * UNIT_S, "the server saw the close")
    assert code == 0, err
    assert elapsed <= shutdown_timeout_s * UNIT_S
    results, errors = parse_replies(conn.received)
    assert errors == []
    answered = len(results)
    counts = re.search(r"\bin (\d+) msg .*\bout (\d+) msg", out.strip().splitlines()[-1])
    assert counts is not None, out
    read_by_client, sent_by_client = int(counts[1]), int(counts[2])
    # every message the client read was answered, once, and every answer reached the server
    # (even though unread frames were left in the client's socket at the stop)
    assert read_by_client == sent_by_client == answered
    # the client reads in order, so what it read is a prefix of what was sent
    assert sorted(results) == list(range(answered))
    messages = [m for index in range(answered // items + 1) for m in _flood_frame(index, items)][:answered]
    assert_results_match_reference(messages, results)
    assert conn.client_close_code == aiohttp.WSCloseCode.OK, conn.end_message


def test_sigterm_under_a_flood_faster_than_processing_exits_0_within_10s(feed_server: Any, app: App) -> None:
    shutdown_timeout_s = 10.0
    frame = json.dumps(_flood_frame(0, 200))  # the same frame over and over: no work for the server

    async def script(conn: FeedConn) -> None:
        async def flood() -> None:
            while True:
                await conn.send(frame)
                await asyncio.sleep(0)

        sender = asyncio.create_task(flood())
        try:
            await conn.read_until_closed(timeout=40)
        finally:
            sender.cancel()

    server = feed_server(script)
    # inbound holds at most 16 frames of 200 messages and the source buffers none beyond it, so what
    # was read before the signal can be answered well within the deadline however loaded the machine
    # (1024 frames and the source's default buffer, 45,000 messages, took past 10 s at load 17 on 2 cores;
    # past 10 s the app aborts at the deadline, and a stop that dropped messages exits 4)
    proc = app(env=_env(server.url, FORKLESS_SHUTDOWN_TIMEOUT_S=str(shutdown_timeout_s), FORKLESS_STATUS_S="3600",
                        FORKLESS_QUEUE_SIZE="16", FORKLESS_SOURCE_BUFFER="0"))
    (code, _out, err, _), elapsed = _sigterm_when_replies_flow(server, proc, 12 * UNIT_S)
    assert code == 0, err
    assert elapsed <= shutdown_timeout_s * UNIT_S
    assert "closed with code 1000 after sending every result" in err  # an orderly stop, not the deadline's abort


def test_self_signed_certificate_is_refused_by_default_with_a_certificate_error(feed_server: Any, app: App,
                                                                              tmp_path: Path) -> None:
    cert, key = self_signed_certificate(tmp_path)
    server = feed_server(ssl_context=server_ssl_context(cert, key))
    code, _out, err, _ = app(env=_env(server.url, FORKLESS_RECONNECT_TRIES="1")).finish(RUN_TIMEOUT_S)
    assert code == 3, err
    assert "certificate" in err.lower()
    assert "FORKLESS_CA_FILE" in err
    assert server.connections == []


def test_secrets_reach_the_server_and_never_the_output_even_when_connections_fail(feed_server: Any,
                                                                                 app: App) -> None:
    # 503 twice (failed attempts are logged), then accepted, then the server drops the
    # connection (a lost connection is logged), then 401 (a fatal error is printed)
    def status(attempt: int) -> int | None:
        return 503 if attempt < 2 else None if attempt == 2 else 401

    async def script(conn: FeedConn) -> None:
        for m in make_messages(3):
            await conn.send(m)
        for _ in range(3):
            await conn.recv(timeout=20)
        await conn.close(code=aiohttp.WSCloseCode.INTERNAL_ERROR)

    server = feed_server(script, handshake_status=status)
    env = _env(server.url, FORKLESS_AUTH_TOKEN=TOKEN, FORKLESS_HEADERS=json.dumps({"X-Api-Key": HEADER_SECRET}),
               FORKLESS_LOG_LEVEL="DEBUG", FORKLESS_STATUS_S="0.2")
    code, out, err, _ = app(env=env).finish(RUN_TIMEOUT_S)
    assert code == 3, err
    assert len(server.connections) == 1
    headers = server.connections[0].headers
    assert headers["Authorization"] == f"Bearer {TOKEN}"
    assert headers["X-Api-Key"] == HEADER_SECRET
    results, errors = parse_replies(server.connections[0].received)
    assert errors == [] and len(results) == 3
    for secret in (TOKEN, HEADER_SECRET, "5ecret"):
        assert secret not in out
        assert secret not in err
    assert "503" in err and "401" in err  # the failures were reported, only the secrets kept out


def test_help_does_not_show_secret_values(app: App) -> None:
    env = _env("ws://127.0.0.1:9/feed", FORKLESS_AUTH_TOKEN=TOKEN, FORKLESS_HEADERS=json.dumps({"X": HEADER_SECRET}))
    code, out, err, _ = app("--help", env=env).finish(RUN_TIMEOUT_S)
    assert code == 0
    assert "FORKLESS_AUTH_TOKEN" in out
    assert TOKEN not in out + err and HEADER_SECRET not in out + err


def test_reconnect_tries_used_up_exits_3_instead_of_idling(app: App, free_port: int) -> None:
    # nothing listens on the port: every attempt is refused
    url = f"ws://127.0.0.1:{free_port}/feed"
    code, _out, err, _ = app(env=_env(url, FORKLESS_RECONNECT_TRIES="3")).finish(RUN_TIMEOUT_S)
    assert code == 3, err
    assert "after 3 failed attempts" in err
