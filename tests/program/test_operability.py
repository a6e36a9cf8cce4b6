"""Operability: /metrics, /healthz, /readyz, JSON logs and their flood guard, ``--check``.

The feed is a real WebSocket server on 127.0.0.1:0 running on its own thread and loop
(tests/servers.py); the controller runs in-process on the test's main thread, or the real
app runs as a subprocess (tests/harness.py) where the behaviour is the process's (exit
codes, output). Every wait is bounded; no assertion is about speed.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import datetime
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from forkless.controller.config import Config
from forkless.controller.logs import JsonFormatter, RateLimitFilter
from forkless.controller.loop import Controller
from forkless.controller.metrics import KNOWN_REASONS, MAX_REASONS, exposition, make_registry, metric_families, render
from forkless.controller.stats import StatsSnapshot, status_line
from forkless.io_loop.counters import SECONDS_BOUNDS, Histogram
from forkless.io_loop.errors import MetricsServerError
from forkless.io_loop.net.http import MetricsServer
from tests.harness import UNIT_S, AppResult, drive, run_app
from tests.servers import FeedConn, FeedServer, LoopbackServer, send_frames

WAIT_S = 15.0 * UNIT_S  # liveness bound for anything the tests wait on


def _tally(server: LoopbackServer) -> tuple[int, int]:
    """(result replies, error replies) the server received."""
    replies = server.replies()
    errors = sum("error" in r for r in replies)
    return len(replies) - errors, errors


def _message(seq: int, stream: str = "s", features: int = 2) -> dict[str, Any]:
    return {"seq": seq, "stream": stream, "x": [float(seq % 7)] * features}


# ---- helpers -------------------------------------------------------------------------------------


def _config(url: str, **changes: Any) -> Config:
    base = dict(ws_url=url, features=2, max_batch=4, warmup=0, metrics_addr="127.0.0.1:0", status_s=0.0,
                heartbeat_s=0.0, reconnect_min_s=0.05, reconnect_max_s=0.2, reconnect_reset_s=0.1,
                shutdown_timeout_s=5.0)
    base.update(changes)
    return Config(**base)


def _metrics_url(ctl: Controller) -> str:
    url = ctl.metrics_url
    assert url, "the metrics server did not start"
    return url


def _pump(ctl: Controller, done: Callable[[], bool], what: str) -> None:
    """Drive the controller until ``done()``; fail naming ``what`` after ``WAIT_S``."""
    drive(ctl, done, timeout_s=WAIT_S, what=what)


def _get(url: str) -> tuple[int, str, str]:
    """(status, content type, body) of a GET; 4xx/5xx are answers too."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse an exposition with prometheus_client's own parser: (name, labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _labelled(samples: dict, name: str, label: str) -> dict[str, float]:
    return {dict(k[1])[label]: v for k, v in samples.items() if k[0] == name}


def _buckets(samples: dict, name: str) -> list[tuple[float, float]]:
    return sorted((float(le), v) for le, v in _labelled(samples, name + "_bucket", "le").items())


def _app(*args: str, **variables: str) -> AppResult:
    return run_app(*args, env=variables)


# ---- one real pipeline run, observed from every side --------------------------------------------

GOOD_SINGLE = 10  # frames of one message
GOOD_ARRAYS = 10  # frames of three messages
BAD_JSON = 3  # frames that are not JSON
BAD_X = 1  # a message with the wrong number of features
GOOD = GOOD_SINGLE + 3 * GOOD_ARRAYS


def _mixed_frames() -> list[Any]:
    frames: list[Any] = []
    seq = 0
    for _ in range(GOOD_SINGLE):
        frames.append(_message(seq, f"s{seq % 3}"))
        seq += 1
    for _ in range(GOOD_ARRAYS):
        frames.append([_message(seq + i, f"s{(seq + i) % 3}") for i in range(3)])
        seq += 3
    frames += ["{not json"] * BAD_JSON
    frames.append({"seq": 999, "stream": "s0", "x": [1.0, 2.0, 3.0]})
    return frames


@pytest.fixture(scope="module")
def observed() -> dict[str, Any]:
    """Run the controller against the mixed script; at quiescence record the snapshot, the
    scraped /metrics, /healthz, /readyz, the status line and the server's own tallies."""
    with FeedServer(send_frames(_mixed_frames())) as feed:
        ctl = Controller(_config(feed.url))
        with ctl:
            url = _metrics_url(ctl)
            _pump(ctl, lambda: feed.received_count == GOOD + BAD_JSON + BAD_X, "every reply")
            # the writer counts a batch just after its last frame went out
            _pump(ctl, lambda: ctl.stats().messages_out + ctl.stats().errors_out == GOOD + BAD_JSON + BAD_X,
                  "the writer's tally")
            before = ctl.stats()
            status, ctype, text = _get(url + "/metrics")
            after = ctl.stats()
            results, error_replies = _tally(feed)
            record = {
                "feed": {"results": results, "error_replies": error_replies},
                "snap": before,
                "snap_after_scrape": after,
                "status_line": status_line(before, None),
                "metrics": (status, ctype, text),
                "healthz": _get(url + "/healthz"),
                "readyz": _get(url + "/readyz"),
            }
    return record


def test_metrics_parse_and_count_what_the_feed_server_sent_and_received(observed: dict) -> None:
    status, ctype, text = observed["metrics"]
    assert status == 200
    assert ctype.startswith("text/plain") and "version=" in ctype
    m = _samples(text)
    feed = observed["feed"]
    assert _value(m, "forkless_messages_total", feed="0", direction="in") == GOOD
    assert _value(m, "forkless_messages_total", feed="0", direction="out") == feed["results"] == GOOD
    assert _value(m, "forkless_error_replies_total", feed="0") == feed["error_replies"] == BAD_JSON + BAD_X
    assert _value(m, "forkless_frames_received_total", feed="0") == GOOD_SINGLE + GOOD_ARRAYS + BAD_JSON + 1
    assert _labelled(m, "forkless_errors_total", "reason") == {**dict.fromkeys(KNOWN_REASONS["forkless_errors"], 0),
                                                              "not JSON": BAD_JSON,
                                                              "x must have 2 numbers, got 3": BAD_X}
    assert _value(m, "forkless_processed_total") == GOOD
    assert _value(m, "forkless_latency_seconds_count", feed="0") == GOOD
    assert _value(m, "forkless_connects_total", feed="0") == 1
    assert _value(m, "forkless_reconnects_total", feed="0") == 0
    assert _value(m, "forkless_connected", feed="0") == 1
    assert _value(m, "forkless_ready") == 1
    assert _value(m, "forkless_device_info", device="cpu:0") == 1
    assert _labelled(m, "forkless_queue_depth", "queue") == {"inbound": 0, "outbound": 0, "unsent": 0}


def test_metrics_histograms_are_the_snapshot_buckets(observed: dict) -> None:
    m = _samples(observed["metrics"][2])
    snap: StatsSnapshot = observed["snap"]
    exact = dict(snap.latency.cumulative())
    exposed = _buckets(m, "forkless_latency_seconds")
    assert exposed[-1] == (math.inf, GOOD)
    assert {b for b, _ in exposed[:-1]} == set(SECONDS_BOUNDS[::5])
    for bound, count in exposed:
        assert count == exact[bound], bound
    assert _value(m, "forkless_latency_seconds_sum", feed="0") == pytest.approx(snap.latency.total)
    assert _buckets(m, "forkless_batch_size") == [(float(b), c) for b, c in snap.batch_size.cumulative()]
    assert _value(m, "forkless_batch_size_sum") == GOOD
    assert _value(m, "forkless_step_seconds_count") == snap.batches == _value(m, "forkless_batches_total")


def test_the_io_threads_cpu_time_is_counted_and_split_by_whether_the_main_thread_was_stepping(
        observed: dict) -> None:
    before, after = observed["snap"], observed["snap_after_scrape"]
    # the IO thread read, decoded and wrote every frame: it used CPU; some of it, or none, fell in steps
    assert 0 < before.io_cpu_s <= after.io_cpu_s
    assert 0 <= before.step_io_cpu_s <= before.io_cpu_s
    split = _labelled(_samples(observed["metrics"][2]), "forkless_io_thread_cpu_seconds_total", "main_thread")
    assert set(split) == {"in_step", "outside_step"}
    # the scrape ran on the IO thread between the two snapshots, and no step ran meanwhile
    assert split["in_step"] == before.step_io_cpu_s == after.step_io_cpu_s
    assert before.io_cpu_s <= split["in_step"] + split["outside_step"] <= after.io_cpu_s


def test_the_io_cpu_time_is_the_io_threads_own_not_the_callers() -> None:
    with FeedServer(send_frames([_message(0, "s0")])) as feed:
        with Controller(_config(feed.url)) as ctl:
            _pump(ctl, lambda: feed.received_count == 1, "the reply")
            io_before, main_before = ctl.stats().io_cpu_s, time.thread_time()
            while time.thread_time() - main_before < 0.3:  # the main thread busy; the IO thread idle
                pass
            io_used, main_used = ctl.stats().io_cpu_s - io_before, time.thread_time() - main_before
    assert 0 <= io_used < main_used / 2


def test_stats_agree_with_the_status_line_and_metrics(observed: dict) -> None:
    snap: StatsSnapshot = observed["snap"]
    m = _samples(observed["metrics"][2])
    line = observed["status_line"]
    fields = dict(re.findall(r"(in|out|anomalies|errors|dropped|reconnects) (\d+)", line))
    assert int(fields["in"]) == snap.messages_in == _value(m, "forkless_messages_total", feed="0", direction="in")
    assert int(fields["out"]) == snap.messages_out == _value(m, "forkless_messages_total", feed="0", direction="out")
    assert int(fields["anomalies"]) == snap.anomalies == _value(m, "forkless_anomalies_total")
    errors = sum(_labelled(m, "forkless_errors_total", "reason").values())
    dropped = sum(_labelled(m, "forkless_dropped_total", "reason").values())
    assert int(fields["errors"]) == snap.errors_total == errors
    assert int(fields["dropped"]) == snap.dropped_total == dropped
    assert int(fields["reconnects"]) == snap.reconnects == _value(m, "forkless_reconnects_total", feed="0")
    assert line.endswith("| connected") and snap.connected
    # the status line's p50 lies inside the exposed latency bucket that holds the median
    p50_s = float(re.search(r"latency p50 ([\d.]+)ms", line).group(1)) / 1000
    buckets = _buckets(m, "forkless_latency_seconds")
    i = next(i for i, (_, c) in enumerate(buckets) if c >= GOOD / 2)
    lo = buckets[i - 1][0] if i else 0.0
    assert lo - 5e-6 <= p50_s <= buckets[i][0] + 5e-6
    # nothing moved while scraping (the pipeline was quiet): the scrape saw these values too
    after: StatsSnapshot = observed["snap_after_scrape"]
    assert (after.messages_in, after.messages_out, after.errors) == (snap.messages_in, snap.messages_out, snap.errors)
    assert _value(m, "forkless_compilations_total") == snap.compilations
    assert snap.compilations_after_warmup == 0


def test_health_endpoints_say_ok_and_ready_while_connected(observed: dict) -> None:
    status, ctype, body = observed["healthz"]
    detail = json.loads(body)
    assert (status, ctype.split(";")[0]) == (200, "application/json")
    assert detail["status"] == "ok" and detail["io_thread_alive"] and detail["connected"]
    status, _, body = observed["readyz"]
    assert (status, json.loads(body)) == (200, {"status": "ready", "reasons": []})


# ---- health follows the connection ---------------------------------------------------------------


def test_healthz_and_readyz_follow_the_feed_disconnecting_and_reconnecting(feed_server: Any) -> None:
    feed = feed_server()
    with Controller(_config(feed.url)) as ctl:
        url = _metrics_url(ctl)
        _pump(ctl, lambda: _get(url + "/readyz")[0] == 200, "ready")

        feed.handshake_status = lambda attempt: 503  # refuse the reconnects until told otherwise
        feed.drop(aiohttp.WSCloseCode.GOING_AWAY)
        _pump(ctl, lambda: _get(url + "/readyz")[0] == 503, "not ready after the drop")
        _pump(ctl, lambda: ctl.stats().connect_failures >= 1, "a refused reconnect")
        status, _, body = _get(url + "/readyz")
        assert status == 503
        assert json.loads(body)["reasons"][0].startswith("not connected to the feed (disconnected")
        status, _, body = _get(url + "/healthz")
        assert status == 200  # the process and the IO loop are fine; only the feed is gone
        assert json.loads(body)["connected"] is False
        m = _samples(_get(url + "/metrics")[2])
        assert (_value(m, "forkless_connected", feed="0"), _value(m, "forkless_ready")) == (0, 0)

        feed.handshake_status = None
        _pump(ctl, lambda: _get(url + "/readyz")[0] == 200, "ready again after reconnecting")
        m = _samples(_get(url + "/metrics")[2])
        assert _value(m, "forkless_connects_total", feed="0") == 2 == len(feed.connections)
        assert _value(m, "forkless_reconnects_total", feed="0") == 1
        assert _value(m, "forkless_connect_failures_total", feed="0") == len(feed.attempts) - 2 >= 1
        assert (_value(m, "forkless_connected", feed="0"), _value(m, "forkless_ready")) == (1, 1)


def _serve_once(paths: list[str], addr: str = "127.0.0.1:0") -> dict[str, tuple[int, str, str]]:
    """Serve the endpoints before any controller exists (no snapshot yet) and GET ``paths``."""

    async def main() -> dict[str, tuple[int, str, str]]:
        server = MetricsServer(addr, snapshot=lambda: None, alive=lambda: True, render=exposition(lambda: None))
        base = await server.start()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", base) and not base.endswith(":0")
        try:
            out = {}
            async with aiohttp.ClientSession() as session:
                for path in paths:
                    async with session.get(base + path) as resp:
                        out[path] = (resp.status, resp.headers["Content-Type"], await resp.text())
            return out
        finally:
            await server.stop()

    return asyncio.run(asyncio.wait_for(main(), WAIT_S))


def test_readyz_is_503_with_every_reason_before_compile_and_connection() -> None:
    got = _serve_once(["/readyz", "/healthz", "/metrics"])
    status, _, body = got["/readyz"]
    assert status == 503
    assert json.loads(body) == {"status": "not ready", "reasons": [
        "the step is not compiled yet", "not connected to the feed (no connection yet)"]}
    assert got["/healthz"][0] == 200
    status, _, text = got["/metrics"]
    assert status == 200
    names = {f.name for f in text_string_to_metric_families(text)}
    assert not any(n.startswith("forkless_") for n in names)  # no snapshot yet: nothing made up


def test_metrics_server_on_a_taken_port_fails_naming_the_variable() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsServerError, match=rf"FORKLESS_METRICS_ADDR=127\.0\.0\.1:{port}"):
            _serve_once([], addr=f"127.0.0.1:{port}")


def test_the_app_exits_2_with_one_line_when_the_metrics_port_is_taken_before_it_compiles() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _app(FORKLESS_METRICS_ADDR=f"127.0.0.1:{port}", FORKLESS_DURATION="5")
    assert proc.returncode == 2
    assert f"configuration error: cannot serve metrics on FORKLESS_METRICS_ADDR=127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "compiled the step" not in proc.stderr  # refused at the start: nothing was compiled


# ---- metrics from literal snapshots (pure) -------------------------------------------------------


def _snapshot(**changes: Any) -> StatsSnapshot:
    seconds = Histogram(SECONDS_BOUNDS).snapshot()
    base = dict(at=0.0, messages_in=0, frames_in=0, messages_out=0, errors_out=0, processed=0,
                batches=0, errors={}, dropped={}, connects=0, reconnects=0, connect_failures=0, connected=False,
                connection_since=0.0, inbound_depth=0, outbound_depth=0, unsent=0,
                batch_size=Histogram((1, 2, 4)).snapshot(), latency=seconds, loop_lag=seconds,
                step_seconds=seconds, compilations=0, compilations_after_warmup=None, devices=("cpu:0",),
                ready=False)
    base.update(changes)
    return StatsSnapshot(**base)


def test_each_registry_reports_its_own_controller() -> None:
    a = make_registry(lambda: _snapshot(messages_in=5), process=False)
    b = make_registry(lambda: _snapshot(messages_in=7), process=False)
    assert _value(_samples(render(a).decode()), "forkless_messages_total", feed="0", direction="in") == 5
    assert _value(_samples(render(b).decode()), "forkless_messages_total", feed="0", direction="in") == 7


def test_error_reasons_beyond_the_cap_are_summed_as_other() -> None:
    errors = {f"x must have 2 numbers, got {n}": n + 1 for n in range(MAX_REASONS + 10)}
    (family,) = [f for f in metric_families(_snapshot(errors=errors)) if f.name == "forkless_errors"]
    by_reason = {s.labels["reason"]: s.value for s in family.samples}
    assert len(by_reason) == MAX_REASONS + 1
    assert sum(by_reason.values()) == sum(errors.values())
    assert by_reason["other"] == sum(range(1, 11))  # the ten rarest


# ---- logs -----------------------------------------------------------------------------------------

FLOOD = 600


async def _flood_script(conn: FeedConn) -> None:
    reader = conn.reading()
    if conn.index == 0:
        for i in range(FLOOD):
            await conn.send("{the same bad frame")
            if i % 30 == 29:
                await asyncio.sleep(0.05)  # spread over ~1 s: several rate-limit windows
    await reader


def test_a_flood_of_identical_bad_frames_logs_a_few_json_lines_with_a_count(feed_server: Any) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RateLimitFilter(window_s=0.25))
    logger = logging.getLogger("forkless")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        feed = feed_server(_flood_script)
        with Controller(_config(feed.url, metrics_addr="")) as ctl:
            _pump(ctl, lambda: feed.received_count == FLOOD, "an error reply to every bad frame")
            assert _tally(feed) == (0, FLOOD)
            assert ctl.stats().errors == {"not JSON": FLOOD}
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)

    records = [json.loads(line) for line in stream.getvalue().splitlines()]  # every line is JSON
    for rec in records:
        assert {"timestamp", "level", "logger", "message"} <= rec.keys()
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", rec["timestamp"])
    opened = [r for r in records if r["level"] == "INFO" and "open" in r["message"]]
    assert opened and opened[0]["connection"] == 1  # context travels as a field
    warnings = [r for r in records if r["level"] == "WARNING" and r["logger"] == "forkless.source"]
    # at most one line per 0.25 s window (plus the first), however long the flood took to read
    first, last = (datetime.fromisoformat(warnings[i]["timestamp"]) for i in (0, -1))
    assert 2 <= len(warnings) <= (last - first).total_seconds() / 0.25 + 2
    assert len(warnings) < FLOOD / 20
    with_count = [r for r in warnings if "repeated" in r]
    assert with_count, warnings
    for rec in with_count:
        assert rec["repeated"] > 0
        assert f"(repeated {rec['repeated']} more times in the last 0.25s)" in rec["message"]
    assert len(warnings) + sum(r["repeated"] for r in with_count) <= FLOOD  # real repeats only, none invented


def test_the_app_writes_one_json_object_per_log_line() -> None:
    proc = _app(FORKLESS_LOG_FORMAT="json", FORKLESS_DURATION="1", FORKLESS_STATUS_S="0", FORKLESS_MAX_BATCH="2",
                FORKLESS_METRICS_ADDR="127.0.0.1:0")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stderr.splitlines()]
    assert records and all({"timestamp", "level", "logger", "message"} <= r.keys() for r in records)
    assert any(r["logger"] == "forkless.http" and r["message"].startswith("metrics on http://127.0.0.1:")
               for r in records)
    assert any(r.get("connection") == 1 for r in records)


# ---- --check ----------------------------------------------------------------------------------------


def test_check_passes_against_a_working_loopback_feed_and_hides_the_token(feed_server: Any) -> None:
    feed = feed_server(send_frames([_message(0, "probe")]))
    proc = _app("--check", FORKLESS_WS_URL=feed.url, FORKLESS_FEATURES="2", FORKLESS_MAX_BATCH="2",
                FORKLESS_AUTH_TOKEN="s3cret-token", FORKLESS_METRICS_ADDR="127.0.0.1:0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [a.headers.get("Authorization") for a in feed.attempts] == ["Bearer s3cret-token"]  # sent, exactly once
    assert len(feed.connections) == 1
    out = proc.stdout
    assert "s3cret" not in out + proc.stderr
    assert "FORKLESS_AUTH_TOKEN          <hidden>" in out
    assert re.search(r"backend cpu, 1 device\(s\): cpu:0", out)
    assert re.search(r"batch size +1: compiled in \d+ ms", out) and re.search(r"batch size +2: compiled", out)
    assert "0 compilations after warm-up" in out
    assert f"connected to {feed.url} in" in out
    assert "1 good message(s), first stream 'probe'" in out
    assert out.rstrip().endswith("check passed")


def test_check_against_a_refused_port_exits_3_saying_so(free_port: int) -> None:
    url = f"ws://127.0.0.1:{free_port}/feed"
    proc = _app("--check", FORKLESS_WS_URL=url, FORKLESS_MAX_BATCH="1", FORKLESS_CONNECT_TIMEOUT_S="5")
    assert proc.returncode == 3
    assert f"forkless: check failed: cannot connect to {url}: Connection refused" in proc.stderr
    assert "check passed" not in proc.stdout


def test_check_against_a_handshake_refused_with_401_exits_3_naming_the_token(feed_server: Any) -> None:
    feed = feed_server(handshake_status=lambda attempt: 401)
    proc = _app("--check", FORKLESS_WS_URL=feed.url, FORKLESS_MAX_BATCH="1")
    assert proc.returncode == 3
    assert "refused the WebSocket handshake with HTTP 401 (unauthorised: check FORKLESS_AUTH_TOKEN)" in proc.stderr


def test_check_with_a_bad_variable_exits_2_naming_it() -> None:
    proc = _app("--check", FORKLESS_MAX_BATCH="lots")
    assert proc.returncode == 2
    assert "FORKLESS_MAX_BATCH='lots' is invalid: expected an integer from 1 to 65536" in proc.stderr
    assert proc.stdout == ""
