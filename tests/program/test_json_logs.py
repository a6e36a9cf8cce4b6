"""Logs for a pipeline: with FORKLESS_LOG_FORMAT=json every line the program writes to stderr is one JSON object
with forkless's version, the configuration error and the unknown variable's warning included; connection lines
carry ``feed`` and ``connection``. The app runs as a process (what it writes to stderr is the process's)."""

from __future__ import annotations

import io
import json
import logging
import signal
from datetime import UTC, datetime
from typing import Any

import forkless
from forkless.controller.logs import JsonFormatter, RateLimitFilter, flush_log_repeats
from tests.harness import UNIT_S, run_app
from tests.servers import FeedConn


def _records(stderr: str) -> list[dict[str, Any]]:
    """Every line of ``stderr`` as JSON (fails naming the first line that is not), each with the version."""
    records = []
    for line in stderr.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"a line that is not JSON: {line!r}\nstderr:\n{stderr}") from None
        assert {"timestamp", "level", "logger", "message"} <= record.keys(), record
        assert record["version"] == forkless.__version__, record
        records.append(record)
    assert records, "nothing on stderr"
    return records


def test_a_bad_configuration_and_an_unknown_variable_are_json_lines_in_json_mode() -> None:
    # TZ: the timestamps say Z, so they are UTC whatever the local zone (Kolkata: 5:30 ahead, no summer time)
    proc = run_app(env={"FORKLESS_LOG_FORMAT": "json", "FORKLESS_MAX_BATCH": "lots", "FORKLESS_MAX_BACTH": "8",
                        "TZ": "Asia/Kolkata"})
    assert proc.returncode == 2
    warning, error = _records(proc.stderr)
    assert (warning["level"], warning["variable"]) == ("WARNING", "FORKLESS_MAX_BACTH")
    assert warning["message"] == "FORKLESS_MAX_BACTH is not a forkless variable and is ignored (see --help)"
    assert (error["level"], error["logger"], error["exit_status"]) == ("ERROR", "forkless", 2)
    assert error["message"] == ("configuration error: FORKLESS_MAX_BATCH='lots' is invalid: expected an integer from "
                                "1 to 65536")
    written = datetime.fromisoformat(error["timestamp"])
    assert abs((datetime.now(UTC) - written).total_seconds()) < 3600, written  # an hour: far below the zone's offset


def test_the_same_lines_as_text_without_json() -> None:
    proc = run_app(env={"FORKLESS_MAX_BATCH": "lots", "FORKLESS_MAX_BACTH": "8"})
    assert proc.returncode == 2
    assert proc.stderr == ("forkless: warning: FORKLESS_MAX_BACTH is not a forkless variable and is ignored (see "
                           "--help)\nforkless: configuration error: FORKLESS_MAX_BATCH='lots' is invalid: expected an "
                           "integer from 1 to 65536\n")


async def _lost_once(conn: FeedConn) -> None:
    """The first connection: two messages, then closed by the server (the client reconnects); later ones: read."""
    if conn.index == 0:
        for seq in range(2):
            await conn.send({"seq": seq, "stream": "s", "x": [1.0, 2.0]})
            assert await conn.recv(timeout=30 * UNIT_S) is not None
        await conn.close()
        return
    await conn.read_until_closed(timeout=60 * UNIT_S)


def test_every_line_of_a_run_is_json_and_connection_lines_name_their_feed_and_connection(feed_server, app) -> None:
    feed = feed_server(_lost_once)
    proc = app(env={"FORKLESS_LOG_FORMAT": "json", "FORKLESS_WS_URL": feed.url, "FORKLESS_FEATURES": "2",
                    "FORKLESS_MAX_BATCH": "4", "FORKLESS_STATUS_S": "0", "FORKLESS_RECONNECT_MIN_S": "0.05",
                    "FORKLESS_METRICS_ADDR": "127.0.0.1:0", "FORKLESS_NOT_A_SETTING": "1"})
    proc.wait_for_line(r'"connection 2 to .* open"', stream="stderr", timeout_s=120 * UNIT_S)
    proc.signal(signal.SIGTERM)
    result = proc.finish(timeout_s=60 * UNIT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    records = _records(result.stderr)
    assert records[0]["variable"] == "FORKLESS_NOT_A_SETTING"
    lines = {r["message"].split(" to ")[0] + (" lost" if " lost: " in r["message"] else ""): r for r in records
             if r["logger"] == "forkless.client"}
    for key, connection in (("connection 1", 1), ("connection 1 lost", 1), ("connection 2", 2)):
        assert (lines[key]["feed"], lines[key]["connection"]) == ("0", connection), lines[key]
    assert "reconnecting in" in lines["connection 1 lost"]["message"]


def test_a_failed_check_is_json_too(free_port: int) -> None:
    proc = run_app("--check", env={"FORKLESS_LOG_FORMAT": "json", "FORKLESS_WS_URL": f"ws://127.0.0.1:{free_port}/",
                                   "FORKLESS_MAX_BATCH": "1", "FORKLESS_CONNECT_TIMEOUT_S": "5"})
    assert proc.returncode == 3
    (failed,) = [r for r in _records(proc.stderr) if r["logger"] == "forkless"]
    assert failed["exit_status"] == 3 and failed["message"].startswith("check failed: cannot connect to ")


def test_repeats_held_back_until_the_stop_are_logged_with_the_fields_of_the_line_they_repeat() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RateLimitFilter(window_s=3600))
    root, logger = logging.getLogger(), logging.getLogger("forkless.source")
    root.addHandler(handler)
    try:
        for _ in range(5):
            logger.warning("bad input on connection %d: %s", 3, "not JSON", extra={"connection": 3, "feed": "ticks"})
        flush_log_repeats()
    finally:
        root.removeHandler(handler)
    first, held = (json.loads(line) for line in stream.getvalue().splitlines())
    assert (first["feed"], first["connection"]) == ("ticks", 3)
    assert (held["feed"], held["connection"], held["repeated"]) == ("ticks", 3, 4)
    assert held["message"] == "bad input on connection 3: not JSON (repeated 4 more times before the stop)"
