"""The stop is a deadline and the books balance, with the app as users run it (a subprocess)
against a feed written with the ``websockets`` library that stops reading: every run exits
within FORKLESS_SHUTDOWN_TIMEOUT_S + 0.5 s of SIGTERM, and every received message is a result,
an error reply, a drop (by reason) or counted as unanswered."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.harness import UNIT_S

ROOT = Path(__file__).resolve().parent.parent
SHUTDOWN_S = 1.5
RUNS = 10
BOOKS = re.compile(r"books: in (\d+) = results (\d+) \+ error replies (\d+) \+ no reply (\d+) \+ dropped (\d+)"
                   r"(?: \(([^)]*)\))? \+ unanswered (\d+);")


def _flood_then_stop_reading(sent: threading.Event, frames: int = 60, per_frame: int = 500):
    """A script: a flood of batch frames, then never read again (the socket buffers fill)."""
    payload = [json.dumps([{"seq": f * per_frame + j, "stream": f"s{j % 50}", "x": [float(j % 7)] * 4}
                           for j in range(per_frame)]) for f in range(frames)]

    async def script(conn) -> None:
        for frame in payload:
            await conn.send_frame(frame)
        sent.set()
        await asyncio.Event().wait()

    return script


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("jax-cache"))


@pytest.mark.timeout(300)
def test_sigterm_with_a_feed_that_stops_reading_exits_by_the_deadline_every_time_with_the_books_balanced(
        cache_dir, feed_server):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKLESS_")}
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache_dir, FORKLESS_FEATURES="4",
               FORKLESS_MAX_BATCH="64", FORKLESS_QUEUE_SIZE="16", FORKLESS_STATUS_S="0.5",
               FORKLESS_SHUTDOWN_TIMEOUT_S=str(SHUTDOWN_S), FORKLESS_RECONNECT_MIN_S="5")
    took = []
    for run in range(RUNS):
        sent = threading.Event()
        feed = feed_server(_flood_then_stop_reading(sent), impl="websockets")
        proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env={**env, "FORKLESS_WS_URL": feed.url},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert sent.wait(60 * UNIT_S), "the feed never got its flood out"
            time.sleep(0.3 + 0.1 * run)  # the stop lands at a different point each run
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            out, err = proc.communicate(timeout=30 * UNIT_S)
            took.append(time.monotonic() - signalled)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        feed.stop()
        assert proc.returncode == 0, err[-3000:]
        assert took[-1] <= SHUTDOWN_S + 0.5 * UNIT_S, f"run {run}: exit {took[-1]:.2f}s after SIGTERM\n{err[-3000:]}"
        books = BOOKS.search(err)
        assert books, err[-3000:]
        n_in, results, errors, no_reply, dropped, _reasons, unanswered = books.groups()
        assert int(n_in) > 0
        assert int(n_in) == int(results) + int(errors) + int(no_reply) + int(dropped) + int(unanswered)
        if int(unanswered):  # only when the IO thread had to be left behind: said, with its number
            assert "leaving it behind" in err and f"unanswered {unanswered}" in out, err[-3000:]
        final = out.strip().splitlines()[-1]
        assert final.startswith("final (whole run): ")
        assert final.endswith("| stopped") or final.endswith("| connection still open at the stop deadline"), final
    assert len(took) == RUNS
