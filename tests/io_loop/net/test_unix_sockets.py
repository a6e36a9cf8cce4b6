"""Feeds, the demo feed and the metrics endpoint over unix-domain sockets (``FORKLESS_WS_UNIX_SOCKET``,
a ``FORKLESS_FEEDS`` entry's ``"unix_socket"``, ``FORKLESS_DEMO_UNIX_SOCKET``,
``FORKLESS_METRICS_ADDR=unix:/path``): the same results as over TCP, against aiohttp's and the
``websockets`` library's servers listening on a socket, TLS over it, ``--check``, and ``python
app.py`` run where every IPv4/IPv6 socket is refused (tests/no_inet.py, as on the TPU host we are
lent): it must open none."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from forkless.controller.codec import JsonCodec
from forkless.controller.commands.check import probe_feeds
from forkless.controller.config import Config
from forkless.controller.loop import Controller
from forkless.controller.processor import ewma_processor
from forkless.io_loop.errors import ConfigError, MetricsServerError
from forkless.io_loop.net.http import MetricsServer
from forkless.io_loop.net.unixsocket import listen_unix
from forkless.io_loop.probe import ProbeFailed
from tests.harness import UNIT_S, AppProcess, assert_books_balance, drive, quick_config, run_app
from tests.no_inet import REFUSED
from tests.program.test_app import STATUS, check_clean_run
from tests.servers import (
    FeedConn,
    assert_results_match_reference,
    make_messages,
    parse_replies,
    self_signed_certificate,
    send_frames,
    server_ssl_context,
)

pytestmark = pytest.mark.timeout(120 * UNIT_S)

PROCESSOR = ewma_processor()
FEATURES = 4
WAIT_S = 30 * UNIT_S
NO_INET = ("tests/no_inet.py", "app.py")  # python app.py where IPv4/IPv6 sockets are refused
BAD_FRAMES = ["not json at all", json.dumps({"seq": 9001, "stream": "s0", "x": [1.0]}),
              json.dumps({"seq": 9002, "stream": "s1", "x": [1.0, 2.0, "three", 4.0]})]


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for sockets (a socket's path is at most 107 bytes; pytest's tmp_path can be longer)."""
    path = tempfile.mkdtemp(prefix="fl-", dir="/tmp")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def _config(**changes: Any) -> Config:
    return quick_config(features=FEATURES, **{"connect_timeout_s": 5.0, "reconnect_reset_s": 1.0, **changes})


def _sender(messages: list[dict], done: threading.Event) -> Any:
    """A script: send ``messages``, then read until each is answered (``done`` set) and the client closes."""

    async def script(conn: FeedConn) -> None:
        reader = conn.reading(timeout=120)
        for i, m in enumerate(messages):
            await conn.send(m)
            if i % 8 == 0:
                await asyncio.sleep(0.001)
        while conn.server.received_count < len(messages):
            await asyncio.sleep(0.005)
        done.set()
        await reader

    return script


def _no_tcp(err: str) -> None:
    assert REFUSED not in err, f"the app tried to open an IPv4/IPv6 socket:\n{err}"


# ---- a feed over a unix socket: as over TCP -------------------------------------------------------


@pytest.mark.parametrize("impl", ["aiohttp", "websockets"])
def test_a_feed_over_a_unix_socket_answers_as_the_same_feed_over_tcp(feed_server, sock_dir, impl):
    messages = make_messages(240, streams=4, features=FEATURES, seed=7)
    done = {name: threading.Event() for name in ("tcp", "unix")}
    tcp = feed_server(_sender(messages, done["tcp"]), impl=impl)
    path = str(sock_dir / "feed.sock")
    unix = feed_server(_sender(messages, done["unix"]), impl=impl, unix_socket=path)
    assert unix.url == "ws://localhost/feed"
    feeds = json.dumps([{"name": "tcp", "url": tcp.url}, {"name": "unix", "url": unix.url, "unix_socket": path}])
    with Controller(_config(feeds=feeds), processor=PROCESSOR) as ctl:
        assert [feed.label for feed in ctl.config.feed_specs][1] == f"feed 'unix' (ws://localhost/feed via unix:{path})"
        drive(ctl, lambda: all(ev.is_set() for ev in done.values()), timeout_s=WAIT_S, what="both feeds answered")
    assert_books_balance(ctl)
    results = {}
    for name, server in (("tcp", tcp), ("unix", unix)):
        got, errors = parse_replies(server.received)
        assert errors == []
        assert_results_match_reference(messages, got)  # each feed its own streams: the same reference
        results[name] = {seq: (r[0]["z"], r[0]["score"], r[0]["anomaly"]) for seq, r in got.items()}
    assert results["unix"] == results["tcp"]
    assert len(unix.connections) == 1 and unix.attempts[0].headers["Host"] == "localhost"


def test_the_app_over_a_websockets_unix_socket_matches_the_reference_answers_bad_frames_and_exits_0_on_sigterm(
        feed_server, sock_dir, app):
    messages = make_messages(300, streams=5, features=FEATURES, seed=3)
    frames: list[Any] = [*messages[:100], BAD_FRAMES[0], *messages[100:200], *BAD_FRAMES[1:], *messages[200:]]
    path = str(sock_dir / "feed.sock")
    server = feed_server(send_frames(frames), impl="websockets", unix_socket=path)
    proc: AppProcess = app(env={"FORKLESS_WS_URL": server.url, "FORKLESS_WS_UNIX_SOCKET": path,
                                "FORKLESS_FEATURES": str(FEATURES), "FORKLESS_MAX_BATCH": "16"}, program=NO_INET)
    server.wait_for(lambda: server.received_count >= len(messages) + len(BAD_FRAMES), WAIT_S * 2,
                    "every message and bad frame answered")
    proc.signal(signal.SIGTERM)
    code, _, err, _ = proc.finish(30 * UNIT_S)
    assert code == 0, err
    _no_tcp(err)
    assert f"connection 1 to ws://localhost/feed via unix:{path} open" in err
    assert "closed with code 1000" in err and "Traceback" not in err
    results, errors = parse_replies(server.received)
    assert_results_match_reference(messages, results)
    assert sorted((e["seq"] is None, e["seq"]) for e in errors) == [(False, 9001), (False, 9002), (True, None)]
    assert all(e["error"] for e in errors)


def test_tls_over_a_unix_socket_is_verified_against_the_url_host(feed_server, sock_dir, tmp_path):
    cert, key = self_signed_certificate(tmp_path, host="localhost")
    messages = make_messages(60, streams=3, features=FEATURES, seed=11)
    done = threading.Event()
    path = str(sock_dir / "tls.sock")
    server = feed_server(_sender(messages, done), impl="websockets", unix_socket=path,
                         ssl_context=server_ssl_context(cert, key))
    assert server.url == "wss://localhost/feed"
    with Controller(_config(ws_url=server.url, ws_unix_socket=path, ca_file=str(cert)), processor=PROCESSOR) as ctl:
        drive(ctl, done.is_set, timeout_s=WAIT_S, what="every message answered over TLS")
    results, errors = parse_replies(server.received)
    assert errors == [] and len(results) == len(messages)
    assert_results_match_reference(messages, results)
    # without the CA the certificate is refused: the TLS really is there, and checked
    lines: list[str] = []
    with pytest.raises(ProbeFailed, match="TLS certificate verification failed"):
        probe_feeds(_config(ws_url=server.url, ws_unix_socket=path).io_settings(), JsonCodec(FEATURES), lines.append)
    # a URL host the certificate does not name is refused too, though the socket is the same
    with pytest.raises(ProbeFailed, match="TLS certificate verification failed"):
        probe_feeds(_config(ws_url="wss://feed.example/feed", ws_unix_socket=path, ca_file=str(cert)).io_settings(),
                   JsonCodec(FEATURES), lines.append)


# ---- --check ----------------------------------------------------------------------------------------


def test_check_probes_a_feed_through_its_unix_socket_and_names_a_missing_one(feed_server, sock_dir):
    path = str(sock_dir / "feed.sock")
    server = feed_server(send_frames([make_messages(1, features=2)[0]]), impl="websockets", unix_socket=path)
    env = {"FORKLESS_WS_URL": server.url, "FORKLESS_WS_UNIX_SOCKET": path, "FORKLESS_FEATURES": "2",
           "FORKLESS_MAX_BATCH": "1", "FORKLESS_CONNECT_TIMEOUT_S": "5"}
    proc = run_app("--check", env=env, program=NO_INET)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _no_tcp(proc.stderr)
    assert f"connected to ws://localhost/feed via unix:{path} in" in proc.stdout
    assert "1 good message(s), first stream 's0'" in proc.stdout
    assert f"FORKLESS_WS_UNIX_SOCKET      {path}" in proc.stdout
    assert len(server.connections) == 1
    missing = str(sock_dir / "nothing-here.sock")
    proc = run_app("--check", env={**env, "FORKLESS_WS_UNIX_SOCKET": missing}, program=NO_INET)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    _no_tcp(proc.stderr)
    assert (f"forkless: check failed: cannot connect to ws://localhost/feed via unix:{missing}: no such socket: is "
            f"the feed's server running, and is the path right? ({missing})") in proc.stderr


def test_a_socket_nothing_listens_on_is_named_as_such(sock_dir):
    path = str(sock_dir / "stale.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)  # a file, but no listener: as a server that died leaves it
    try:
        with pytest.raises(ProbeFailed, match=r"nothing is listening on the socket \(its server has stopped\)"):
            probe_feeds(_config(ws_url="ws://localhost/feed", ws_unix_socket=path, connect_timeout_s=5.0)
                       .io_settings(), JsonCodec(FEATURES), lambda line: None)
    finally:
        stale.close()


# ---- the demo feed and the metrics endpoint: python app.py with no TCP socket at all ----------------


def test_the_demo_feed_and_metrics_run_on_unix_sockets_where_tcp_is_refused(sock_dir, app):
    demo, metrics = str(sock_dir / "demo.sock"), str(sock_dir / "metrics.sock")
    env = {"FORKLESS_DEMO_RATE": "500", "FORKLESS_MAX_BATCH": "64", "FORKLESS_DEMO_UNIX_SOCKET": demo,
           "FORKLESS_METRICS_ADDR": f"unix:{metrics}"}
    proc: AppProcess = app(env=env, program=NO_INET)
    proc.wait_for_line(STATUS, timeout_s=60 * UNIT_S)
    health = asyncio.run(_get_through(metrics, "/healthz"))
    assert health["status"] == "ok" and health["connected"] is True
    proc.signal(signal.SIGTERM)
    code, out, err, _ = proc.finish(30 * UNIT_S)
    assert code == 0, err
    _no_tcp(err)
    check_clean_run(out, err)
    assert f"demo feed listening on ws://localhost/feed via unix:{demo}" in err
    assert f"metrics on http://localhost/metrics via unix:{metrics}" in err
    assert not os.path.lexists(demo) and not os.path.lexists(metrics)  # removed at the stop
    check = run_app("--check", env={**env, "FORKLESS_MAX_BATCH": "1"}, program=NO_INET)
    assert check.returncode == 0, check.stdout + check.stderr
    _no_tcp(check.stderr)
    assert f"started the embedded demo feed on ws://localhost/feed via unix:{demo}" in check.stdout
    assert f"unix:{metrics}: free" in check.stdout
    assert not os.path.lexists(demo) and not os.path.lexists(metrics)


def test_without_unix_sockets_a_host_refusing_tcp_gets_a_clear_error_naming_the_setting():
    proc = run_app(env={"FORKLESS_MAX_BATCH": "1", "FORKLESS_DURATION": "5"}, program=NO_INET)
    assert proc.returncode != 0
    assert "no socket could be made to listen on 127.0.0.1" in proc.stderr
    assert "FORKLESS_DEMO_UNIX_SOCKET serves the demo feed on a unix-domain socket" in proc.stderr
    check = run_app("--check", env={"FORKLESS_MAX_BATCH": "1"}, program=NO_INET)
    assert check.returncode == 3, check.stdout + check.stderr
    assert ("forkless: check failed: cannot serve the demo feed on loopback TCP: no socket could be made to listen "
            "on 127.0.0.1") in check.stderr


async def _get_through(path: str, route: str) -> Any:
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as session:
        async with session.get(f"http://localhost{route}", timeout=aiohttp.ClientTimeout(total=WAIT_S)) as answer:
            assert answer.status == 200
            return await answer.json()


def test_the_metrics_server_on_a_unix_socket_never_takes_a_live_one_and_removes_its_own(sock_dir):
    path = str(sock_dir / "metrics.sock")

    async def scenario() -> tuple[str, Any]:
        first = MetricsServer(f"unix:{path}", snapshot=lambda: None, alive=lambda: True)
        url = await first.start()
        try:
            second = MetricsServer(f"unix:{path}", snapshot=lambda: None, alive=lambda: True)
            with pytest.raises(MetricsServerError, match=f"FORKLESS_METRICS_ADDR=unix:{path}: another server is "
                                                         f"listening on {path}"):
                await second.start()
            health = await _get_through(path, "/healthz")  # the first still serves
        finally:
            await first.stop()
        return url, health

    url, health = asyncio.run(scenario())
    assert url == f"unix:{path}" and health["io_loop"] == "alive"
    assert not os.path.lexists(path)


def test_a_listener_replaces_a_stale_socket_and_leaves_other_files_and_a_replaced_socket_alone(sock_dir):
    path = str(sock_dir / "x.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # the file stays, nothing listens: stale
    listener = listen_unix(path)
    os.unlink(path)
    other = listen_unix(path)  # another process's socket now at the path
    listener.close()
    assert os.path.lexists(path), "a socket that is no longer ours is left alone"
    other.close()
    assert not os.path.lexists(path)
    Path(path).write_text("not a socket")
    with pytest.raises(OSError) as refused:
        listen_unix(path)
    assert refused.value.errno == errno.EEXIST and Path(path).read_text() == "not a socket"


# ---- configuration ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("env", "variable", "expected"), [
    ({"FORKLESS_WS_URL": "ws://localhost/feed", "FORKLESS_WS_UNIX_SOCKET": "feed.sock"}, "FORKLESS_WS_UNIX_SOCKET",
     "an absolute path (starting with /), not 'feed.sock'"),
    ({"FORKLESS_WS_URL": "ws://localhost/feed", "FORKLESS_WS_UNIX_SOCKET": "/" + "d" * 120 + "/f.sock"},
     "FORKLESS_WS_UNIX_SOCKET", "at most 107 bytes (the kernel's limit for a socket's path), not 128"),
    ({"FORKLESS_WS_UNIX_SOCKET": "/run/feed.sock"}, "FORKLESS_WS_UNIX_SOCKET",
     "set together with FORKLESS_WS_URL, whose path and host the handshake sends through the socket"),
    ({"FORKLESS_FEEDS": '[{"url": "ws://localhost/feed"}]', "FORKLESS_WS_UNIX_SOCKET": "/run/feed.sock"},
     "FORKLESS_WS_UNIX_SOCKET", "empty with FORKLESS_FEEDS: give each feed's socket as its entry's \"unix_socket\""),
    ({"FORKLESS_WS_URL": "ws://localhost/feed", "FORKLESS_DEMO_UNIX_SOCKET": "/tmp/demo.sock"},
     "FORKLESS_DEMO_UNIX_SOCKET", "empty when FORKLESS_WS_URL is set: the embedded demo feed runs only"),
    ({"FORKLESS_DEMO_UNIX_SOCKET": "/no/such/dir/demo.sock"}, "FORKLESS_DEMO_UNIX_SOCKET",
     "the directory /no/such/dir does not exist"),
    ({"FORKLESS_DEMO_UNIX_SOCKET": "/tmp/"}, "FORKLESS_DEMO_UNIX_SOCKET",
     "the path of the socket itself, not of a directory"),
    ({"FORKLESS_METRICS_ADDR": "unix:metrics.sock"}, "FORKLESS_METRICS_ADDR", "an absolute path (starting with /)"),
    ({"FORKLESS_METRICS_ADDR": "unix:/no/such/dir/m.sock"}, "FORKLESS_METRICS_ADDR",
     "the directory /no/such/dir does not exist"),
    ({"FORKLESS_FEEDS": '[{"name": "a", "url": "ws://localhost/feed", "unix_socket": "rel.sock"}]'}, "FORKLESS_FEEDS",
     "feed 0 ('a'): \"unix_socket\" must be the absolute path of a unix-domain socket"),
    ({"FORKLESS_FEEDS": '[{"url": "ws://localhost/feed", "unix_socket": ""}]'}, "FORKLESS_FEEDS",
     "leave the field out for TCP"),
    ({"FORKLESS_FEEDS": '[{"url": "ws://localhost/feed", "unix_socket": 5}]'}, "FORKLESS_FEEDS",
     "feed 0 ('0'): \"unix_socket\" must be"),
    ({"FORKLESS_FEEDS": '[{"nats": "nats://localhost:4222", "stream": "S", "results": "r", "unix_socket": "/a"}]'},
     "FORKLESS_FEEDS", "unknown field(s) 'unix_socket' for a JetStream feed"),
])
def test_a_bad_unix_socket_setting_names_the_variable_and_what_is_right(env, variable, expected):
    with pytest.raises(ConfigError) as err:
        Config.from_env(env)
    assert err.value.variable == variable
    assert expected in str(err.value)


def test_a_feeds_entry_and_the_one_feed_shorthand_carry_the_socket():
    path = "/run/forkless/feed.sock"
    listed = Config.from_env({"FORKLESS_FEEDS": json.dumps([
        {"name": "side", "url": "wss://gateway.local/md", "unix_socket": path}, {"name": "tcp", "url": "ws://h:1/x"}])})
    assert [(f.unix_socket, f.label) for f in listed.feed_specs] == [
        (path, f"feed 'side' (wss://gateway.local/md via unix:{path})"), ("", "feed 'tcp' (ws://h:1/x)")]
    one = Config.from_env({"FORKLESS_WS_URL": "ws://localhost/feed", "FORKLESS_WS_UNIX_SOCKET": f" {path} "})
    assert one.ws_unix_socket == path and one.feed_specs[0].unix_socket == path
    assert f"unix_socket={path!r}" in repr(one.feed_specs[0])
