"""Events-only controllers (controller/eventsonly.py): the user's own source hands the main loop
events, no processor runs, nothing is compiled, and no demo feed's settings are checked.

The source is a user's client written against the public API, talking to a real loopback
exchange written with ``websockets``: trades come as events, orders go out with ``send``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from forkless import EVENTS_ONLY, Config, Controller, OnResults, Runtime
from forkless.controller.device.compiled import compilations
from forkless.controller.eventsonly import EVENTS_ONLY_DROPPED
from tests.harness import UNIT_S, assert_books_balance, drive
from tests.servers import send_frames

pytestmark = pytest.mark.timeout(60 * UNIT_S)

# FORKLESS_MAX_STREAMS below FORKLESS_DEMO_STREAMS (8): refused only where the demo feed runs
ENV = {"FORKLESS_MAX_STREAMS": "4", "FORKLESS_STATUS_S": "0", "FORKLESS_SHUTDOWN_TIMEOUT_S": "5",
       "FORKLESS_FEATURES": "2"}


class Exchange:
    """A user's exchange client: every frame the exchange sends is an event (prices stay text),
    every frame the main loop sends is written to the exchange; ``rows``: also hands over this
    many messages for a processor (``emit_rows``), which an events-only controller has not."""

    name = "exchange"
    replies = "none"

    def __init__(self, url: str, rows: int = 0) -> None:
        self.url, self.rows = url, rows

    async def run(self, ctx: Any) -> None:
        async with aiohttp.ClientSession() as http, http.ws_connect(self.url) as ws:
            async def read() -> None:
                async for msg in ws:
                    if not ctx.stopping.is_set():
                        await ctx.emit_event(json.loads(msg.data))

            if self.rows:
                await ctx.emit_rows(list(range(self.rows)), ["s0"] * self.rows, [[1.0, 2.0]] * self.rows)
            reader = asyncio.create_task(read())
            async for frame in ctx.outgoing():
                await ws.send_str(frame)
            reader.cancel()


def _trades(n: int) -> list[dict[str, Any]]:
    return [{"type": "trade", "symbol": "BTCUSDT", "price": f"37000.{i:04d}", "seq": i} for i in range(n)]


def test_an_events_only_session_compiles_nothing_and_runs_its_source_to_the_books(feed_server):
    server = feed_server(send_frames(_trades(20)), impl="websockets")
    config = Config.from_env(ENV)  # max_streams 4 < demo_streams 8: no demo feed runs, nothing refused
    got: list[Any] = []
    before = compilations()
    with Controller(config, processor=EVENTS_ONLY, sources=[Exchange(server.url)],
                    on_event=lambda source, event: got.append(event)) as ctl:
        assert ctl.engine is None and ctl.processor is None and ctl.state is None
        drive(ctl, lambda: len(got) >= 20, timeout_s=20 * UNIT_S, what="20 trades delivered")
        ctl.send("exchange", {"type": "order", "symbol": "BTCUSDT", "qty": "0.01"})
        server.wait_for(lambda: len(server.received) >= 1, 10 * UNIT_S, "the order received")
    assert compilations() == before  # nothing compiled: no processor, no default detector
    assert [event["price"] for event in got] == [t["price"] for t in _trades(20)]
    assert json.loads(server.received[0]) == {"type": "order", "symbol": "BTCUSDT", "qty": "0.01"}
    snap = ctl.stats()
    assert (snap.events_in, snap.events, snap.sent_out, snap.messages_in, snap.processed) == (20, 20, 1, 0, 0)
    assert snap.compiled and snap.compilations_after_warmup is None and snap.devices == ()
    assert_books_balance(ctl)


def test_messages_an_events_only_source_hands_over_are_dropped_counted_and_logged(feed_server, caplog):
    server = feed_server(send_frames(_trades(3)), impl="websockets")
    got: list[Any] = []
    with Controller(Config.from_env(ENV), processor=EVENTS_ONLY, sources=[Exchange(server.url, rows=5)],
                    on_event=lambda source, event: got.append(event)) as ctl:
        drive(ctl, lambda: len(got) >= 3 and ctl.stats().dropped_total >= 5, timeout_s=20 * UNIT_S,
              what="3 trades delivered and 5 messages dropped")
    snap = ctl.stats()
    assert snap.messages_in == 5 and snap.dropped == {EVENTS_ONLY_DROPPED: 5} and snap.processed == 0
    assert_books_balance(ctl)
    assert "'exchange' handed over 5 message(s)" in caplog.text and "ctx.emit_event" in caplog.text


class _ResultSink:
    name = "results"

    async def run(self, ctx: Any) -> None: ...


@pytest.mark.parametrize(("changes", "kwargs", "named"), [
    ({}, {"sinks": [OnResults(print)]}, "no results for sinks="),
    ({}, {"sinks": [_ResultSink()]}, "no results for sinks="),
    ({}, {"sources": []}, "needs sources"),
    ({"ws_url": "ws://127.0.0.1:1/"}, {}, "FORKLESS_WS_URL"),
    ({"checkpoint_dir": "/tmp/x"}, {}, "FORKLESS_CHECKPOINT_DIR"),
    ({}, {"runtime": Runtime(checkpoint_store=object())}, "Runtime(checkpoint_store=...)"),
])
def test_what_contradicts_events_only_is_refused_naming_it(changes, kwargs, named):
    config = Config(max_streams=4, **changes)
    arguments: dict[str, Any] = {"sources": [Exchange("ws://127.0.0.1:1/")], **kwargs}
    with pytest.raises(ValueError, match=r"processor=forkless\.EVENTS_ONLY") as raised:
        Controller(config, processor=EVENTS_ONLY, **arguments)
    assert named in str(raised.value)


def test_sources_without_a_processor_still_run_the_default_detector_unless_events_only():
    config = Config(max_streams=4)
    ctl = Controller(config, sources=[Exchange("ws://127.0.0.1:1/")], on_event=print)
    assert ctl.processor is not None and ctl.processor.description.name == "ewma"


def test_the_demo_feeds_settings_are_checked_where_it_runs():
    with pytest.raises(ValueError, match="FORKLESS_DEMO_STREAMS"):
        Controller(Config.from_env(ENV))


def test_an_events_only_controller_leaves_the_switch_interval_as_the_host_set_it(feed_server):
    # the 1 ms interval is for a processor's step (the main thread gets the GIL back soon after
    # XLA); an events-only controller steps nothing, and it measured no gain in an exchange session
    # (bench/docs/exchange-session.md): it changes nothing process-wide that the host did not ask for
    import sys

    server = feed_server(send_frames(_trades(3)), impl="websockets")
    host = sys.getswitchinterval()
    sys.setswitchinterval(0.0123)
    try:
        got: list[Any] = []
        with Controller(Config.from_env(ENV), processor=EVENTS_ONLY, sources=[Exchange(server.url)],
                        on_event=lambda s, e: got.append(e)) as ctl:
            drive(ctl, lambda: len(got) >= 3, timeout_s=20 * UNIT_S, what="3 trades delivered")
            during = sys.getswitchinterval()
        assert during == 0.0123
        assert sys.getswitchinterval() == 0.0123
    finally:
        sys.setswitchinterval(host)
