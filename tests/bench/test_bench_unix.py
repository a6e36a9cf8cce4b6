"""The benchmark over unix-domain sockets (bench/unix.py), in seconds: the guard that makes a
run refuse inet sockets as the lent TPU host does, the address form, and a real load generator
serving a real client over a unix socket inside that guard. The whole benchmark over unix
sockets is the session's one benchmark run (tests/bench/test_bench_smoke.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import unix
from bench.loadgen import start_loadgen, wait_result
from tests.harness import ROOT, UNIT_S, app_env

PROBE = """
import socket, sys
a, b = socket.socketpair()            # a unix pair (asyncio's own wake-up pipe is one)
u = socket.socket(socket.AF_UNIX)     # a unix socket
for family in (socket.AF_INET, socket.AF_INET6):
    try:
        socket.socket(family, socket.SOCK_DGRAM if family == socket.AF_INET6 else socket.SOCK_STREAM)
    except PermissionError as exc:
        print("refused", family.name, exc)
    else:
        print("opened", family.name)
"""


def _guarded(extra: dict[str, str] | None = None) -> dict[str, str]:
    return unix.child_env(app_env({unix.UNIX_ENV: "1", **(extra or {})}))


def test_a_process_of_a_unix_run_refuses_tcp_and_udp_sockets_and_keeps_unix_ones() -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE], env=_guarded(), capture_output=True, text=True,
                          timeout=60 * UNIT_S, cwd="/")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [["refused", "AF_INET"], ["refused", "AF_INET6"]]
    assert "FORKLESS_BENCH_UNIX=1" in lines[0] and "the TPU host refuses them" in lines[0]


def test_without_the_variable_the_same_process_opens_inet_sockets() -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE], env=_guarded({unix.UNIX_ENV: "0"}), capture_output=True,
                          text=True, timeout=60 * UNIT_S, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[:2] for line in proc.stdout.splitlines()] == [["opened", "AF_INET"], ["opened", "AF_INET6"]]


def test_a_sitecustomize_the_guard_hides_still_runs(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['HIDDEN_SITECUSTOMIZE_RAN'] = '1'\n")
    env = _guarded()
    env["PYTHONPATH"] += f":{tmp_path}"
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('HIDDEN_SITECUSTOMIZE_RAN'))"],
                          env=env, capture_output=True, text=True, timeout=60 * UNIT_S, cwd="/")
    assert proc.stdout.strip() == "1", proc.stderr


@pytest.mark.parametrize("path", ["/tmp/fkb-x/forkless-rate_1k-r0.sock", "/a dir/with%/sock"])
def test_a_unix_address_names_its_socket_and_hands_the_handshake_a_host_and_path(path: str) -> None:
    url = unix.unix_url(path, "/feed")
    assert url.startswith("ws+unix://") and unix.socket_path(url) == path
    assert unix.handshake_url(url) == "ws://localhost/feed"
    assert unix.forkless_env(url) == {"FORKLESS_WS_URL": "ws://localhost/feed", "FORKLESS_WS_UNIX_SOCKET": path}
    assert unix.forkless_feed(url, "f0") == {"url": "ws://localhost/feed", "name": "f0", "unix_socket": path}
    tcp = "ws://127.0.0.1:8765/"
    assert unix.socket_path(tcp) is None and unix.handshake_url(tcp) == tcp
    assert unix.forkless_env(tcp) == {"FORKLESS_WS_URL": tcp}


def test_the_load_generator_serves_the_io_ceiling_over_a_unix_socket_inside_the_guard(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both processes refuse inet sockets: every message answered means it went over the unix socket."""
    for name, value in _guarded().items():
        monkeypatch.setenv(name, value)  # start_loadgen's process inherits this environment
    sock = tmp_path / "feed.sock"
    loadgen, url = start_loadgen(["--mode", "window", "--window", "16", "--duration", "0.5", "--warmup-s", "0.1",
                                  "--unix-socket", str(sock), "--connect-timeout", str(60 * UNIT_S)])
    assert url == unix.unix_url(sock)
    client = subprocess.Popen([sys.executable, "-m", "bench.io_ceiling", "--url", url], cwd=ROOT,
                              env=_guarded(), stderr=subprocess.PIPE, text=True)
    try:
        result = wait_result(loadgen, timeout=90 * UNIT_S)
    finally:
        _, err = client.communicate(timeout=60 * UNIT_S)
    assert client.returncode == 0, err
    assert result["sent"] == result["answered"] > 0 and result["missing"] == 0 and result["errors"] == 0
