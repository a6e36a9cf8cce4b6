"""Fault tests of the whole program: ``python app.py`` as a subprocess against a real loopback
server (tests/servers.py), where the behaviour belongs to the process: exit status, signals,
what reaches stdout/stderr. Every run is bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import aiohttp
import pytest

from tests.servers import (
    FeedServer,
    ServerConn,
    assert_results_match_reference,
    make_messages,
    parse_replies,
    self_signed_certificate,
    server_ssl_context,
)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 30.0
TOKEN = "tok-5ecret-d0-not-log-71c3"
HEADER_SECRET = "hdr-5ecret-a9f2"


def _env(url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKLESS_")}
    env.update(
        JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
        FORKLESS_WS_URL=url, FORKLESS_FEATURES="4", FORKLESS_MAX_BATCH="16", FORKLESS_MAX_STREAMS="64",
        FORKLESS_STATUS_S="0", FORKLESS_RECONNECT_MIN_S="0.05", FORKLESS_RECONNECT_MAX_S="0.2",
        FORKLESS_CONNECT_TIMEOUT_S="3",
    )
    env.update(extra)
    return env


def _start(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *(args or ("app.py",))], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the app did not exit within {timeout}s\nstdout:\n{out}\nstderr:\n{err}") from None
    return proc.returncode, out, err


def _wait_for(condition, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.01)


@pytest.mark.parametrize("status", [401, 404])
def test_handshake_4xx_exits_3_at_once_with_a_message_naming_the_status(status: int) -> None:
    with FeedServer(handshake_status=lambda i: status) as server:
        proc = _start(_env(server.url, FORKLESS_AUTH_TOKEN=TOKEN))
        code, out, err = _finish(proc)
        exited = time.monotonic()
    assert code == 3, err
    assert f"HTTP {status}" in err
    assert len(server.attempts) == 1, "a 4xx is not retried"
    assert exited - server.attempts[0] <= 5.0
    assert TOKEN not in out + err


def test_io_thread_crash_exits_non_zero_within_2s_with_the_traceback() -> None:
    crashed_at: list[float] = []

    async def script(conn: ServerConn) -> None:
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
        from controller.codec import JsonCodec

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
    with FeedServer(script) as server:
        proc = _start(_env(server.url), "-c", program)
        code, _out, err = _finish(proc)
        exited = time.monotonic()
    assert crashed_at, err
    assert code == 1, err
    assert exited - crashed_at[0] <= 2.0
    assert "Traceback" in err and "InjectedCrash: injected IO-thread failure" in err


def _flood_frame(index: int, items: int) -> list[dict]:
    """Frame ``index`` of an endless, reproducible flood: a fixed block of data, fresh seqs."""
    block = _FLOOD_BLOCK
    return [dict(block[(index * items + j) % len(block)], seq=index * items + j) for j in range(items)]


_FLOOD_BLOCK = make_messages(997, streams=8, seed=3)


def _flood_script(items: int, pause_s: float):
    """A server that sends frames of ``items`` messages, ``pause_s`` apart (0: as fast as TCP
    takes them), until the client closes, and records every reply."""

    async def script(conn: ServerConn) -> None:
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


def _sigterm_when_replies_flow(server: FeedServer, proc: subprocess.Popen,
                               timeout_s: float) -> tuple[int, str, str, float]:
    try:
        _wait_for(lambda: sum(len(c.received) for c in server.connections) >= 2000, 30, "replies flowing")
    except AssertionError:
        proc.kill()
        raise
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    code, out, err = _finish(proc, timeout=timeout_s)
    return code, out, err, time.monotonic() - signalled


def test_sigterm_while_fed_exits_0_and_answers_every_message_it_read() -> None:
    items = 20
    with FeedServer(_flood_script(items, pause_s=0.002)) as server:
        # one status line, at the stop: the client's own count of messages it read
        proc = _start(_env(server.url, FORKLESS_SHUTDOWN_TIMEOUT_S="10", FORKLESS_STATUS_S="3600"))
        code, out, err, elapsed = _sigterm_when_replies_flow(server, proc, 20)
        conn = server.connections[0]
        _wait_for(lambda: conn.closed_at is not None, 5, "the server saw the close")
    assert code == 0, err
    assert elapsed <= 10.0
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


def test_sigterm_under_a_flood_faster_than_processing_exits_0_within_10s() -> None:
    frame = json.dumps(_flood_frame(0, 200))  # the same frame over and over: no work for the server

    async def script(conn: ServerConn) -> None:
        async def flood() -> None:
            while True:
                await conn.send(frame)
                await asyncio.sleep(0)

        sender = asyncio.create_task(flood())
        try:
            await conn.read_until_closed(timeout=40)
        finally:
            sender.cancel()

    with FeedServer(script) as server:
        proc = _start(_env(server.url, FORKLESS_SHUTDOWN_TIMEOUT_S="10", FORKLESS_STATUS_S="3600"))
        code, _out, err, elapsed = _sigterm_when_replies_flow(server, proc, 12)
    assert code == 0, err
    assert elapsed <= 10.0


def test_self_signed_certificate_is_refused_by_default_with_a_certificate_error(tmp_path: Path) -> None:
    cert, key = self_signed_certificate(tmp_path)
    with FeedServer(ssl_context=server_ssl_context(cert, key)) as server:
        proc = _start(_env(server.url, FORKLESS_RECONNECT_TRIES="1"))
        code, _out, err = _finish(proc)
    assert code == 3, err
    assert "certificate" in err.lower()
    assert "FORKLESS_CA_FILE" in err
    assert server.connections == []


def test_secrets_reach_the_server_and_never_the_output_even_when_connections_fail() -> None:
    # 503 twice (failed attempts are logged), then accepted, then the server drops the
    # connection (a lost connection is logged), then 401 (a fatal error is printed)
    def status(attempt: int) -> int | None:
        return 503 if attempt < 2 else None if attempt == 2 else 401

    async def script(conn: ServerConn) -> None:
        for m in make_messages(3):
            await conn.send(m)
        for _ in range(3):
            await conn.recv(timeout=20)
        await conn.ws.close(code=aiohttp.WSCloseCode.INTERNAL_ERROR)

    with FeedServer(script, handshake_status=status) as server:
        env = _env(server.url, FORKLESS_AUTH_TOKEN=TOKEN, FORKLESS_HEADERS=json.dumps({"X-Api-Key": HEADER_SECRET}),
                   FORKLESS_LOG_LEVEL="DEBUG", FORKLESS_STATUS_S="0.2")
        proc = _start(env)
        code, out, err = _finish(proc)
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


def test_help_does_not_show_secret_values() -> None:
    env = _env("ws://127.0.0.1:9/feed", FORKLESS_AUTH_TOKEN=TOKEN, FORKLESS_HEADERS=json.dumps({"X": HEADER_SECRET}))
    code, out, err = _finish(_start(env, "app.py", "--help"))
    assert code == 0
    assert "FORKLESS_AUTH_TOKEN" in out
    assert TOKEN not in out + err and HEADER_SECRET not in out + err


def test_reconnect_tries_used_up_exits_3_instead_of_idling() -> None:
    with FeedServer() as server:
        url = server.url
    # the server is gone: every attempt is refused
    code, _out, err = _finish(_start(_env(url, FORKLESS_RECONNECT_TRIES="3")))
    assert code == 3, err
    assert "after 3 failed attempts" in err
