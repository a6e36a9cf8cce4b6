"""The stop is a deadline and the books balance, with the app as users run it (a subprocess)
against a feed written with the ``websockets`` library that never reads: SIGTERM at each of
three points of a flood (while the first batches run, once the whole flood is sent, once the
replies are held back by the socket and the outbound queue is full) and the app exits rather
than wait for a socket that never drains, and every received message is a result, an error
reply, a drop (by reason) or counted as unanswered.

Each point is a condition the test waits for (the app's metrics, the feed's own event), not a
time; how long the stop takes is not asserted here (no wall-clock threshold): an app that
waited for the socket would never exit, and the bound on that wait only decides then.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import signal
import threading
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from forkless.io_loop.errors import EXIT_LOSSY_STOP
from tests.harness import UNIT_S, AppProcess, wait_until

SHUTDOWN_S = 1.5
QUEUE_SIZE = 16
BOOKS = re.compile(r"books: in (\d+) = results (\d+) \+ error replies (\d+) \+ no reply (\d+) \+ dropped (\d+)"
                   r"(?: \(([^)]*)\))? \+ unanswered (\d+);")


def _flood_then_never_read(sent: threading.Event, frames: int = 60, per_frame: int = 500):
    """A script: a flood of batch frames, then never read (the socket buffers fill)."""
    payload = [json.dumps([{"seq": f * per_frame + j, "stream": f"s{j % 50}", "x": [float(j % 7)] * 4}
                           for j in range(per_frame)]) for f in range(frames)]

    async def script(conn) -> None:
        for frame in payload:
            await conn.send_frame(frame)
        sent.set()
        await asyncio.Event().wait()

    return script


def _metric(url: str, family: str, **labels: str) -> float:
    """The sum of ``family``'s samples with these labels, scraped from the app now (0 for a scrape the
    start-up's hand-over of the endpoints to the IO thread dropped: docs/metrics.md, a scraper retries)."""
    try:
        with urllib.request.urlopen(url, timeout=10 * UNIT_S) as resp:
            text = resp.read().decode()
    except (http.client.RemoteDisconnected, ConnectionResetError):
        return 0.0
    return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == family
               for s in fam.samples if not s.name.endswith("_created")
               and all(s.labels.get(k) == v for k, v in labels.items()))


# the stop points: (metrics URL, the feed's "flood sent" event) -> whether to send SIGTERM now
STOP_POINTS: dict[str, Callable[[str, threading.Event], bool]] = {
    "while-the-first-batches-run": lambda url, sent: _metric(url, "forkless_processed") > 0,
    "once-the-flood-is-sent": lambda url, sent: sent.is_set(),
    "once-replies-are-held-back":
        lambda url, sent: _metric(url, "forkless_queue_depth", queue="outbound") == QUEUE_SIZE,
}


@pytest.mark.parametrize("point", list(STOP_POINTS))
def test_sigterm_with_a_feed_that_never_reads_exits_with_the_books_balanced(feed_server, app, point):
    sent = threading.Event()
    feed = feed_server(_flood_then_never_read(sent), impl="websockets")
    proc: AppProcess = app(env=dict(
        FORKLESS_WS_URL=feed.url, FORKLESS_FEATURES="4",
        FORKLESS_MAX_BATCH="64", FORKLESS_QUEUE_SIZE=str(QUEUE_SIZE), FORKLESS_STATUS_S="0.5",
        FORKLESS_SHUTDOWN_TIMEOUT_S=str(SHUTDOWN_S), FORKLESS_RECONNECT_MIN_S="5",
        FORKLESS_METRICS_ADDR="127.0.0.1:0"))
    url = re.search(r"metrics on (\S+)", proc.wait_for_line("metrics on ", stream="stderr", timeout_s=60 * UNIT_S))
    assert url
    wait_until(lambda: STOP_POINTS[point](url.group(1), sent), timeout_s=60 * UNIT_S, what=point, poll_s=0.02)
    proc.signal(signal.SIGTERM)
    # generous: a healthy app exits about SHUTDOWN_S after the signal; one that waits for the socket never does
    result = proc.finish(timeout_s=30 * UNIT_S)
    out, err = result.stdout, result.stderr
    books = BOOKS.search(err)
    assert books, err[-3000:]
    n_in, results, errors, no_reply, dropped, unanswered = map(int, books.group(1, 2, 3, 4, 5, 7))
    assert n_in > 0
    # an orderly stop exits 0 when it lost nothing, 4 when it dropped or left messages unanswered
    assert result.returncode == (EXIT_LOSSY_STOP if dropped + unanswered else 0), err[-3000:]
    assert n_in == results + errors + no_reply + dropped + unanswered
    if unanswered:  # only when the IO thread had to be left behind: said, with its number
        assert "leaving it behind" in err and f"unanswered {unanswered}" in out, err[-3000:]
    if point == "once-replies-are-held-back":  # the feed never reads them: the stop gave them up at its deadline
        assert dropped + unanswered > 0 and "stop deadline" in err, err[-3000:]
    final = out.strip().splitlines()[-1]
    assert final.startswith("final (whole run): ")
    assert final.endswith("| stopped") or final.endswith("| connection still open at the stop deadline"), final
