"""Sinks' books on ``/metrics`` (controller/metrics.py ``sink_families``): a controller's sinks of results
(``Controller(sinks=[...])``) and a ``forkless.SinkRun``'s one sink, scraped over real HTTP on 127.0.0.1
after messages from a real WebSocket feed on loopback (tests/servers.py) flowed through them."""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import forkless
from forkless import Config, Controller
from forkless.controller.metrics import KNOWN_REASONS
from forkless.controller.processor import ewma_processor
from tests.harness import UNIT_S, drive, wait_until
from tests.servers import make_messages, send_frames

pytestmark = pytest.mark.timeout(90 * UNIT_S)

FEATURES = 3


class WritingOne:
    """A user's sink of either kind (a controller's results, a SinkRun's records): writes the first item of each
    batch and drops the rest as "not wanted"."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def run(self, ctx: forkless.SinkContext) -> None:  # either kind: it writes one, drops the rest
        async for batch in ctx.batches():
            batch.wrote(1)
            batch.drop("not wanted")


def _scrape(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics parsed with prometheus_client's own parser: (sample name, labels) -> value."""
    with urllib.request.urlopen(base.rstrip("/") + "/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _sink_samples(samples: dict, sink: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(name, tuple((k, v) for k, v in labels if k != "sink")): value
            for (name, labels), value in samples.items()
            if name.startswith("forkless_sink_") and dict(labels).get("sink") == sink}


def _expected(books: forkless.SinkStats) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {("forkless_sink_taken_total", ()): books.taken, ("forkless_sink_written_total", ()): books.written,
            ("forkless_sink_held", ()): books.held, ("forkless_sink_unwritten_total", ()): books.unwritten,
            ("forkless_sink_batches_total", ()): books.batches,
            **{("forkless_sink_dropped_total", (("reason", reason),)): n  # the known reasons there at 0 from the start
               for reason, n in {**dict.fromkeys(KNOWN_REASONS["forkless_sink_dropped"], 0), **books.dropped}.items()}}


def test_a_controllers_sinks_books_are_served_on_its_metrics_endpoint(feed_server):
    messages = make_messages(60, features=FEATURES)
    server = feed_server(send_frames(messages))
    config = Config(ws_url=server.url, features=FEATURES, max_batch=16, max_wait_ms=1.0, heartbeat_s=0.0,
                    reconnect_min_s=0.05, reconnect_max_s=0.2, shutdown_timeout_s=10.0 * UNIT_S, status_s=0.0,
                    metrics_addr="127.0.0.1:0")
    with Controller(config, processor=ewma_processor(), sinks=[WritingOne("first"), WritingOne("second")]) as ctl:
        def settled() -> bool:
            books = dict(ctl.stats().sinks)
            return all(books[name].taken == 60 and books[name].held == 0 for name in ("first", "second"))

        drive(ctl, settled, timeout_s=30 * UNIT_S, what="60 results taken and dealt with by both sinks")
        assert ctl.metrics_url
        samples = _scrape(ctl.metrics_url)
        books = dict(ctl.stats().sinks)
    assert samples[("forkless_sink_results_unsent_total", ())] == 0  # every result reached the IO thread
    for name in ("first", "second"):
        got, expected = _sink_samples(samples, name), _expected(books[name])
        assert got == expected, name
        assert got[("forkless_sink_written_total", ())] >= 1
        assert got[("forkless_sink_written_total", ())] + got[("forkless_sink_dropped_total",
                                                               (("reason", "not wanted"),))] == 60


def test_a_sink_runs_metrics_endpoint_serves_its_sinks_books(feed_server):
    import threading

    messages = make_messages(25, features=FEATURES, seed=7)
    server = feed_server(send_frames(messages))
    config = Config(ws_url=server.url, features=FEATURES, status_s=0, heartbeat_s=0, reconnect_min_s=0.05,
                    reconnect_max_s=0.2, shutdown_timeout_s=10 * UNIT_S, metrics_addr="127.0.0.1:0")
    run = forkless.SinkRun(WritingOne("mine"), config=config)
    outcome: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: outcome.update(final=run.run()), daemon=True)
    thread.start()
    try:
        wait_until(lambda: run.sink_stats.taken >= 25 and run.sink_stats.held == 0 and run.io.metrics_url,
                   timeout_s=30 * UNIT_S, what="every message taken and dealt with, /metrics served")
        samples = _scrape(run.io.metrics_url)
        books = run.sink_stats.snapshot()
    finally:
        run.request_stop()
        thread.join(30 * UNIT_S)
    assert not thread.is_alive() and "final" in outcome
    assert _sink_samples(samples, "mine") == _expected(books)
    assert samples[("forkless_sink_taken_total", (("sink", "mine"),))] == 25
