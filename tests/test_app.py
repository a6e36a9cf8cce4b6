"""`python app.py` as a user runs it: a real subprocess with the embedded demo feed."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.servers import FeedServer, ServerConn, make_messages

ROOT = Path(__file__).resolve().parent.parent
STATUS = re.compile(r"^(?:final \(whole run\): )?"
                    r"in \d+ msg \(\d+/s\) \| out \d+ msg \(\d+/s\) \| batch [\d.-]+ msg \| latency p50 \S+ p99 \S+"
                    r" \| anomalies \d+ \| errors \d+ \| dropped \d+ \|")
SUMMARY = re.compile(r"^demo feed: (\d+) sent, (\d+) answered, (\d+) errors; injected anomalies (\d+): "
                     r"detected (\d+) \(recall [\d.]+%\), false flags (\d+) \(precision [\d.]+%\)")


def env(**extra):
    e = {k: v for k, v in os.environ.items() if not k.startswith("FORKLESS_")}
    e.update({"JAX_PLATFORMS": "cpu", "FORKLESS_DEMO_RATE": "500", "FORKLESS_MAX_BATCH": "64"})
    e.update(extra)
    return e


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
    proc = subprocess.run([sys.executable, "app.py"], cwd=ROOT, env=env(FORKLESS_DURATION="3"),
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    check_clean_run(proc.stdout, proc.stderr)


def wait_for_status_line(proc: subprocess.Popen, timeout: float = 60) -> list[str]:
    seen = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if STATUS.match(line):
            return seen
    raise AssertionError(f"no status line: {seen}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_cleanly_sending_every_result(sig):
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        head = wait_for_status_line(proc)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert f"{sig.name} received" in err
    check_clean_run("".join(head) + out, err)



def test_a_second_ctrl_c_exits_at_once():
    stop_feeding = threading.Event()

    async def script(conn: ServerConn) -> None:
        # never reads the replies, so the orderly stop after the first Ctrl-C cannot finish
        conn.stop_reading()
        seq = 0
        while not stop_feeding.is_set():
            await conn.send(make_messages(50, start=seq, features=8, seed=seq))
            seq += 50
            await asyncio.sleep(0.001)

    with FeedServer(script) as server:
        proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env(FORKLESS_WS_URL=server.url, FORKLESS_SHUTDOWN_TIMEOUT_S="30"))
        try:
            wait_for_status_line(proc)
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
            started = time.monotonic()
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=15)
            took = time.monotonic() - started
        finally:
            stop_feeding.set()
            proc.kill()
    assert proc.returncode == 130, err
    assert "second interrupt: exiting now" in err
    assert took < 5  # at once, not after FORKLESS_SHUTDOWN_TIMEOUT_S (30 s)
