"""Every signal decided (docs/running.md, "Signals"): SIGHUP stops in order as SIGTERM does (never a
silent death), SIGUSR1 reports the run so far and the run goes on, a SIGHUP ignored under ``nohup``
stays ignored, and every handler taken is given back (controller/lifetime/host.py).

The program runs as a subprocess against a real loopback feed (tests/servers.py), which sees the
close frame; the handlers are checked in this process, whose main thread pytest runs."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import aiohttp
import pytest

from forkless.controller.lifetime.host import HANDLED_SIGNALS, StopSignals
from tests.harness import UNIT_S, AppProcess
from tests.servers import make_messages, parse_replies, send_frames

MESSAGES = 300


def test_sigusr1_reports_the_run_so_far_and_sighup_then_stops_it_in_order(feed_server: Any, app: Any) -> None:
    server = feed_server(send_frames(make_messages(MESSAGES, features=8)))
    proc: AppProcess = app(env={"FORKLESS_WS_URL": server.url, "FORKLESS_STATUS_S": "0"})
    server.wait_for(lambda: server.connections and len(server.connections[0].received) >= MESSAGES,
                    90 * UNIT_S, f"{MESSAGES} replies")
    proc.signal(signal.SIGUSR1)
    proc.wait_for_line(rf"SIGUSR1: books: in {MESSAGES} = results {MESSAGES} \+", stream="stderr",
                       timeout_s=30 * UNIT_S)
    proc.wait_for_line(rf"SIGUSR1: in {MESSAGES} msg", stream="stderr", timeout_s=30 * UNIT_S)
    proc.signal(signal.SIGHUP)
    code, _, err, _ = proc.finish(30 * UNIT_S)
    conn = server.connections[0]
    server.wait_for(lambda: conn.closed_at is not None, 10 * UNIT_S, "the server saw the close")
    assert code == 0, err
    assert "SIGHUP received: stopping" in err
    assert f"books: in {MESSAGES} = results {MESSAGES} + error replies 0 + no reply 0 + dropped 0 + unanswered 0" in err
    assert conn.client_close_code == aiohttp.WSCloseCode.OK, conn.end_message
    results, errors = parse_replies(conn.received)
    assert errors == [] and sorted(results) == list(range(MESSAGES))
    assert "Traceback" not in err


def _handlers() -> dict[int, Any]:
    return {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}


@pytest.fixture
def host_handlers() -> Any:
    """The handlers this process had, put back after the test whatever it did."""
    before = _handlers()
    yield before
    for sig, handler in before.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def test_sighup_and_sigusr1_reach_the_controller_while_installed_and_the_host_gets_its_handlers_back(
        host_handlers: dict[int, Any]) -> None:
    host_got: list[int] = []

    def host_handler(signum: int, frame: Any) -> None:  # the host's own, before and after
        host_got.append(signum)

    for sig in (signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, host_handler)
    got: list[int] = []

    def send(sig: int, seen: list[int]) -> None:
        os.kill(os.getpid(), sig)
        deadline = time.monotonic() + 10 * UNIT_S
        while sig not in seen and time.monotonic() < deadline:  # Python runs a handler between bytecodes
            time.sleep(0.01)

    signals = StopSignals(got.append)
    signals.install()
    try:
        for sig in (signal.SIGHUP, signal.SIGUSR1):
            send(sig, got)
    finally:
        signals.restore()
    assert got == [signal.SIGHUP, signal.SIGUSR1] and host_got == []
    assert all(signal.getsignal(sig) is host_handler for sig in (signal.SIGHUP, signal.SIGUSR1))
    send(signal.SIGHUP, host_got)
    assert host_got == [signal.SIGHUP]


def test_a_sighup_ignored_by_the_host_nohup_stays_ignored(host_handlers: dict[int, Any]) -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    got: list[int] = []
    signals = StopSignals(got.append)
    signals.install()
    try:
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is not host_handlers[signal.SIGTERM]  # the others are taken
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    assert got == []
