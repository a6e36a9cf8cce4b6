"""Probes from the first second: the endpoints bound and answering while the program compiles, and
what systemd is told (controller/lifetime/endpoints.py, controller/lifetime/sdnotify.py).

The program runs as a subprocess (tests/held_compile_program.py: the ``forkless`` program whose
compile waits for a file the test writes), so "while it compiles" is a state the test holds, not a
moment it races for. systemd is a real unix datagram socket this test binds and names in
``NOTIFY_SOCKET``. The pieces (binding before serving, the hand-over between loops, the protocol's
lines) are tested in process against real sockets too.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from forkless.controller.lifetime.sdnotify import ServiceManager, notify_address, service_manager, watchdog_interval_s
from forkless.io_loop.errors import MetricsServerError
from forkless.io_loop.net.http import MetricsServer
from tests.harness import UNIT_S, AppProcess, wait_until

WAIT_S = 60 * UNIT_S  # a start on a loaded machine (JAX's import and compile) fits well inside
HELD = ("tests/held_compile_program.py",)


class NotifySocket:
    """A unix datagram socket standing where systemd's would, its datagrams collected by a thread."""

    def __init__(self, address: str | bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(0.1)
        self.datagrams: list[str] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._read, name="notify-socket", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closed:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._cond:
                self.datagrams.append(data.decode())
                self._cond.notify_all()

    def wait_for(self, condition: Callable[[list[str]], bool], what: str) -> list[str]:
        with self._cond:
            if not self._cond.wait_for(lambda: condition(self.datagrams), WAIT_S):
                raise AssertionError(f"not within {WAIT_S:.0f}s: {what}; datagrams so far: {self.datagrams}")
            return list(self.datagrams)

    def close(self) -> None:
        self._closed = True
        self._thread.join(5)
        self.sock.close()


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10 * UNIT_S) as answer:
            body = answer.read().decode()
            status = answer.status
    except urllib.error.HTTPError as refused:
        body, status = refused.read().decode(), refused.code
    return status, body


def _phases(text: str) -> dict[str, float]:
    return {s.labels["phase"]: s.value for f in text_string_to_metric_families(text) if f.name == "forkless_phase"
            for s in f.samples}


@pytest.fixture(scope="module")
def held_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One run of the program: what it answered while its compile was held, then after, and every
    datagram systemd's socket received, up to its exit after a SIGTERM."""
    release = tmp_path_factory.mktemp("held") / "release"
    name = f"forkless-test-{uuid.uuid4().hex}"  # in the abstract namespace: nothing on disk
    notify = NotifySocket(b"\0" + name.encode())
    seen: dict[str, Any] = {}
    env = {"FORKLESS_METRICS_ADDR": "127.0.0.1:0", "FORKLESS_STATUS_S": "0", "NOTIFY_SOCKET": "@" + name,
           "WATCHDOG_USEC": "400000"}
    try:
        with AppProcess(str(release), env=env, program=HELD) as proc:
            line = proc.wait_for_line(r"metrics on (http://\S+)/metrics", stream="stderr", timeout_s=WAIT_S)
            url = re.search(r"metrics on (http://\S+)/metrics", line)[1]
            # the compile has begun (and is held until the test releases it): the phase is "compiling" from here
            seen["held_datagrams"] = notify.wait_for(lambda d: "STATUS=compiling" in d, "STATUS=compiling")
            seen["held"] = {path: _get(url + path) for path in ("/healthz", "/readyz", "/startedz", "/metrics")}
            seen["held_stderr"] = proc.stderr  # read after the answers: the compile had not ended by then
            release.touch()
            notify.wait_for(lambda d: d.count("WATCHDOG=1") >= 2, "READY=1 and two WATCHDOG=1")
            wait_until(lambda: _get(url + "/readyz")[0] == 200, timeout_s=WAIT_S, what="/readyz 200")
            seen["ready"] = {path: _get(url + path) for path in ("/healthz", "/readyz", "/startedz", "/metrics")}
            proc.signal(signal.SIGTERM)
            seen["result"] = proc.finish(WAIT_S)
            seen["datagrams"] = notify.wait_for(lambda d: "STATUS=stopped" in d, "STATUS=stopped")
    finally:
        notify.close()
    yield seen


# ---- while it compiles, and after ---------------------------------------------------------------


def test_healthz_answers_200_while_the_program_compiles(held_run: dict[str, Any]) -> None:
    status, body = held_run["held"]["/healthz"]
    assert status == 200, body
    health = json.loads(body)
    assert health["status"] == "ok" and health["phase"] == "compiling" and health["io_thread_alive"] is False
    assert "compiled the step" not in held_run["held_stderr"]  # the compile was still held when it answered


def test_readyz_is_503_naming_the_compile_until_ready_then_200(held_run: dict[str, Any]) -> None:
    status, body = held_run["held"]["/readyz"]
    assert status == 503
    assert json.loads(body)["reasons"][0] == "compiling"
    status, body = held_run["ready"]["/readyz"]
    assert (status, json.loads(body)) == (200, {"status": "ready", "reasons": []})
    assert json.loads(held_run["ready"]["/healthz"][1])["phase"] == "running"


def test_startedz_is_503_while_the_start_runs_and_200_once_it_is_over(held_run: dict[str, Any]) -> None:
    status, body = held_run["held"]["/startedz"]
    assert (status, json.loads(body)) == (503, {"status": "starting", "phase": "compiling"})
    status, body = held_run["ready"]["/startedz"]
    assert (status, json.loads(body)) == (200, {"status": "started", "phase": "running"})


def test_metrics_show_the_phase_from_the_start(held_run: dict[str, Any]) -> None:
    status, text = held_run["held"]["/metrics"]
    assert status == 200
    held = _phases(text)
    assert held["compiling"] == 1 and sum(held.values()) == 1
    assert "forkless_ready 0.0" in text
    ready = _phases(held_run["ready"]["/metrics"][1])
    assert ready["running"] == 1 and sum(ready.values()) == 1


def test_systemd_is_told_the_phase_then_ready_then_the_watchdog_then_stopping(held_run: dict[str, Any]) -> None:
    code, _, err, _ = held_run["result"]
    assert code == 0, err
    assert not any("READY=1" in d for d in held_run["held_datagrams"])  # not ready while it compiles
    datagrams = held_run["datagrams"]
    ready = datagrams.index("READY=1\nSTATUS=running")
    stopping = datagrams.index("STOPPING=1\nSTATUS=stopping")
    assert datagrams.index("STATUS=compiling") < ready
    watchdog = [i for i, d in enumerate(datagrams) if d == "WATCHDOG=1"]
    assert len(watchdog) >= 2 and ready < watchdog[0]
    assert stopping < datagrams.index("STATUS=stopped")
    assert all(d == "WATCHDOG=1" or d.startswith(("STATUS=", "READY=1", "STOPPING=1")) for d in datagrams), datagrams


# ---- the pieces, in process ---------------------------------------------------------------------


def test_a_taken_port_is_refused_by_bind_before_any_loop_runs() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = MetricsServer(f"127.0.0.1:{port}", snapshot=lambda: None, alive=lambda: True)
        with pytest.raises(MetricsServerError, match=rf"FORKLESS_METRICS_ADDR=127\.0\.0\.1:{port}: Address already"):
            server.bind()


def test_a_bound_server_is_served_by_one_loop_then_another_on_the_same_port_missing_no_scrape() -> None:
    server = MetricsServer("127.0.0.1:0", snapshot=lambda: None, alive=lambda: True)
    url = server.bind()
    port = int(url.rsplit(":", 1)[1])

    def serve_once(then: Callable[[], None], keep: bool) -> None:
        async def main() -> None:
            await server.start()
            await asyncio.to_thread(then)
            await server.stop(keep_sockets=keep)

        asyncio.run(asyncio.wait_for(main(), 30 * UNIT_S))

    first: list[tuple[int, Any]] = []
    serve_once(lambda: first.append(_get(url + "/healthz")), keep=True)
    # between the two loops a client connects and sends its request: it waits in the backlog
    waiting = socket.create_connection(("127.0.0.1", port), timeout=10 * UNIT_S)
    waiting.sendall(b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n")
    second: list[tuple[int, Any]] = []
    serve_once(lambda: second.append((_get(url + "/healthz"), waiting.recv(4096))), keep=False)
    waiting.close()
    assert first[0][0] == 200 and second[0][0][0] == 200
    assert second[0][1].startswith(b"HTTP/1.0 200") or second[0][1].startswith(b"HTTP/1.1 200")
    with pytest.raises(OSError):  # released: nothing listens there any more
        socket.create_connection(("127.0.0.1", port), timeout=5 * UNIT_S).close()


def test_notify_socket_names_a_path_or_an_abstract_socket_and_nothing_else() -> None:
    assert notify_address("/run/systemd/notify") == "/run/systemd/notify"
    assert notify_address("@forkless") == b"\0forkless"
    assert notify_address("") is None and notify_address("vsock:2:1234") is None
    assert service_manager({}).__class__.__name__ == "NoServiceManager"


@pytest.mark.parametrize(("environ", "expected"), [
    ({"WATCHDOG_USEC": "30000000"}, 30.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 30.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # another process's watchdog
    ({"WATCHDOG_USEC": "0"}, None), ({"WATCHDOG_USEC": "soon"}, None), ({}, None),
])
def test_the_watchdog_is_on_only_for_this_process_with_a_positive_interval(environ: dict, expected: Any) -> None:
    assert watchdog_interval_s(environ, 4242) == expected


def test_the_watchdog_pings_every_half_interval_only_while_the_io_loop_turns(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    receiver = NotifySocket(path)
    try:
        manager = ServiceManager(path, watchdog_s=10.0)
        assert not manager.keep_alive(0.0, io_turns=1)  # not ready yet: systemd arms it at READY=1
        manager.ready("running")
        assert manager.keep_alive(100.0, io_turns=1)  # the first at once
        assert not manager.keep_alive(104.0, io_turns=50)  # not due: every half interval (5 s)
        assert not manager.keep_alive(105.0, io_turns=1)  # due, but the IO loop has not turned since
        assert not manager.keep_alive(130.0, io_turns=1)  # ... however long
        assert manager.keep_alive(130.5, io_turns=2)
        manager.stopping("stopping")
        got = receiver.wait_for(lambda d: len(d) == 4, "four datagrams")
        assert got == ["READY=1\nSTATUS=running", "WATCHDOG=1", "WATCHDOG=1", "STOPPING=1\nSTATUS=stopping"]
        manager.close()
    finally:
        receiver.close()


def test_a_notify_socket_that_is_gone_is_logged_once_and_the_run_goes_on(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    manager = ServiceManager(str(tmp_path / "nobody-listens"), watchdog_s=None)
    with caplog.at_level("WARNING", logger="forkless.controller"):
        assert not manager.send("STATUS=one") and not manager.send("STATUS=two")
    assert [r.getMessage() for r in caplog.records if "NOTIFY_SOCKET" in r.getMessage()] == [
        "could not notify the service manager on NOTIFY_SOCKET ([Errno 2] No such file or directory); "
        "the run goes on"]
    manager.close()


def test_an_unusable_notify_socket_variable_is_warned_about_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="forkless.controller"):
        manager = service_manager({"NOTIFY_SOCKET": "vsock:2:9"})
    assert manager.__class__.__name__ == "NoServiceManager"
    assert "NOTIFY_SOCKET=vsock:2:9 is not a unix socket's path or @name" in caplog.text


def test_without_notify_socket_no_datagram_is_sent_and_nothing_fails() -> None:
    manager = service_manager({"WATCHDOG_USEC": "1000000"}, pid=os.getpid())
    manager.ready("running")
    assert not manager.keep_alive(0.0, io_turns=1)
    manager.close()
