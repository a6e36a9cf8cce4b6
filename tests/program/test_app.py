"""`python app.py` as a user runs it: a real subprocess with the embedded demo feed."""

from __future__ import annotations

import asyncio
import re
import signal
import threading

import pytest

from tests.harness import UNIT_S, AppProcess, run_app
from tests.servers import AiohttpConn, make_messages

STATUS = re.compile(r"^(?:final \(whole run\): )?"
                    r"in \d+ msg \(\d+/s\) \| out \d+ msg \(\d+/s\) \| batch [\d.-]+ msg \| latency p50 \S+ p99 \S+"
                    r" \| write-latency p99 \S+ \| anomalies \d+ \| errors \d+ \| dropped \d+ \|")
SUMMARY = re.compile(r"^demo feed: (\d+) sent, (\d+) answered, (\d+) errors; injected anomalies (\d+): "
                     r"detected (\d+) \(recall [\d.]+%\), false flags (\d+) \(precision [\d.]+%\)")


def env(**extra):
    """The app's FORKLESS_* settings for these tests (the launcher adds JAX_PLATFORMS=cpu)."""
    return {"FORKLESS_DEMO_RATE": "500", "FORKLESS_MAX_BATCH": "64", **extra}


def check_clean_run(out: str, err: str) -> None:
    lines = out.strip().splitlines()
    statuses = [line for line in lines if STATUS.match(line)]
    assert len(statuses) >= 2, out
    assert statuses[-1].startswith("final (whole run): ") and statuses[-1].endswith("| stopped"), statuses[-1]
    assert not any(line.startswith("final") for line in statuses[:-1])
    summary = SUMMARY.match(lines[-1])
    assert summary, lines[-1]
    sent, answered, errors = (int(summary.group(i)) for i in (1, 2, 3))
    assert sent > 0 and answered == sent and errors == 0
    assert "closed with code 1000" in err
    assert "Traceback" not in err
    assert "demo feed: " not in err.replace("demo feed: client", "")  # the summary is printed once, on stdout


def test_demo_run_with_a_duration_exits_0_with_status_lines_and_a_summary():
    proc = run_app(env=env(FORKLESS_DURATION="3"), timeout_s=90 * UNIT_S)
    assert proc.returncode == 0, proc.stderr
    check_clean_run(proc.stdout, proc.stderr)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_cleanly_sending_every_result(app, sig):
    proc = app(env=env())
    proc.wait_for_line(STATUS, timeout_s=60 * UNIT_S)
    proc.signal(sig)
    code, out, err, _ = proc.finish(15 * UNIT_S)
    assert code == 0, err
    assert f"{sig.name} received" in err
    check_clean_run(out, err)


def test_a_second_ctrl_c_exits_at_once_with_status_130(feed_server, app):
    stop_feeding = threading.Event()

    async def script(conn: AiohttpConn) -> None:
        # never reads the replies, so the orderly stop after the first Ctrl-C cannot finish
        conn.stop_reading()
        seq = 0
        while not stop_feeding.is_set():
            await conn.send(make_messages(50, start=seq, features=8, seed=seq))
            seq += 50
            await asyncio.sleep(0.001)

    server = feed_server(script, compress=False)  # uncompressed replies fill the socket buffers sooner
    # a stop that is never aborted would take FORKLESS_SHUTDOWN_TIMEOUT_S, past finish()'s bound
    proc: AppProcess = app(env=env(FORKLESS_WS_URL=server.url, FORKLESS_SHUTDOWN_TIMEOUT_S="600"))
    try:
        proc.wait_for_line(STATUS, timeout_s=60 * UNIT_S)
        proc.signal(signal.SIGINT)
        # logged once the stop is requested (the handler requests it first): the next one is second
        proc.wait_for_line("SIGINT received", stream="stderr", timeout_s=10 * UNIT_S)
        proc.signal(signal.SIGINT)
        code, _, err, _ = proc.finish(60 * UNIT_S)
    finally:
        stop_feeding.set()
    assert code == 130, err
    assert "second interrupt: exiting now" in err
    assert "Traceback" not in err
