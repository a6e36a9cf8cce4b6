"""Overflow is a property of each source (io_loop/spill.py): a source's overflow drops only its
own items, counted under its own name, never a replayable source's; and a stalled main loop does
not silence a source's heartbeat.

Sources here are written against the public API only (a ``name`` and ``async run(ctx)``), as a
user would write them. Counts and content only, never speed: a stall is held until the feed has
sent a given number of frames, not for a given time.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from forkless import Config, Controller, OnResults
from forkless.controller.processor import ewma_processor
from tests.harness import UNIT_S, assert_books_balance, drive, wait_until

pytestmark = pytest.mark.timeout(120 * UNIT_S)

PROCESSOR = ewma_processor()
FEATURES = 4
REASON = "inbound overflow (drop_oldest)"


def _config(**changes: Any) -> Config:
    base: dict[str, Any] = dict(features=FEATURES, max_batch=16, max_streams=64, max_wait_ms=1.0, queue_size=4,
                                heartbeat_s=0.0, connect_timeout_s=2.0, shutdown_timeout_s=10.0, status_s=0.0)
    base.update(changes)
    return Config(**base)


def _frame(seq: int, stream: str) -> str:
    return json.dumps({"seq": seq, "stream": stream, "x": [float(seq % 7), 1.0, 2.0, 3.0]})


class Replayable:
    """A source that gives positions and replays from them: it must never be dropped from."""

    name = "ledger"
    replayable = True
    replies = "none"

    def __init__(self, n: int) -> None:
        self.n = n
        self.emitted = 0

    async def run(self, ctx: Any) -> None:
        for i in range(self.n):
            await ctx.emit(_frame(i, "ledger"), position=i)
            await ctx.emit_event({"ledger": i})
            self.emitted += 1
        await ctx.stopping.wait()


class Noisy:
    """A latest-value source: drops its own oldest when it cannot keep up, and says so."""

    name = "noisy"
    overflow = "drop_oldest"
    buffer = 8
    replies = "none"

    def __init__(self, n: int) -> None:
        self.n = n
        self.done = False

    async def run(self, ctx: Any) -> None:
        for i in range(self.n):
            await ctx.emit(_frame(10_000 + i, "noisy"))
            await ctx.emit_event({"noisy": i})
            if i % 4 == 0:
                await asyncio.sleep(0)  # a few frames a loop turn, as a socket's reads come
        self.done = True
        await ctx.stopping.wait()


def test_a_noisy_drop_oldest_source_drops_only_its_own_items_never_a_replayable_source_s():
    # FORKLESS_OVERFLOW=drop_oldest as well: it must not apply to the replayable source
    ledger, noisy = Replayable(300), Noisy(300)
    events: dict[str, list[Any]] = {"ledger": [], "noisy": []}
    results: dict[str, list[int]] = {"ledger": [], "noisy": []}

    def on_results(seqs: list[Any], streams: list[str], outputs: Any) -> None:
        for seq, stream in zip(seqs, streams):
            results[stream.split(":")[-1]].append(seq)

    with Controller(_config(overflow="drop_oldest"), processor=PROCESSOR, sources=[ledger, noisy],
                    sinks=[OnResults(on_results)],
                    on_event=lambda source, event: events[source].append(event)) as ctl:
        # the main loop takes nothing until the noisy source has emitted everything: inbound is
        # full all along, and the noisy source's overflow has every chance to take others' items
        wait_until(lambda: noisy.done, timeout_s=30 * UNIT_S, what="the noisy source's 300 frames emitted")
        drive(ctl, lambda: ledger.emitted == 300 and ctl.stats().unanswered == 0, timeout_s=60 * UNIT_S,
              what="the ledger's 300 frames emitted and every message processed or dropped")
    assert_books_balance(ctl)  # the stop handed over every event still waiting
    snap = ctl.stats()
    by_name = {feed.name: feed.io for feed in snap.feeds}
    assert results["ledger"] == list(range(300)), "the replayable source loses nothing, in order"
    assert events["ledger"] == [{"ledger": i} for i in range(300)]
    assert by_name["ledger"].dropped == {} and by_name["ledger"].events_dropped == {}
    noisy_io = by_name["noisy"]
    dropped, events_dropped = noisy_io.dropped.get(REASON, 0), noisy_io.events_dropped.get(REASON, 0)
    assert dropped > 0 and events_dropped > 0, "the noisy source's own overflow dropped, counted under its name"
    assert len(results["noisy"]) + dropped == 300  # each of its messages processed or counted dropped
    assert len(events["noisy"]) + events_dropped == 300  # each of its events delivered or counted dropped
    assert results["noisy"] == sorted(results["noisy"]) and events["noisy"] == sorted(events["noisy"],
                                                                                       key=lambda e: e["noisy"])
    assert noisy_io.buffered_peak <= Noisy.buffer + 1  # its bound, plus the one item that went over it
    assert snap.dropped == {REASON: dropped} and snap.events_dropped == {REASON: events_dropped}


# ---- a stalled main loop and the exchange's heartbeat ------------------------------------------------

STALL_TRADES = 3500  # the stall lasts while the exchange sends this many trades: ~7 s at 500/s, over 3x the
# inbound queue's 1024 items; held by count, not by time


def test_the_exchange_session_keeps_its_connection_through_a_stalled_main_loop_with_default_settings():
    from bench.exchange import Exchange
    from examples.exchange_session import ExchangeSession

    # pings every 0.2 s, each to be answered within 2 s (scaled) or the exchange closes with 4001
    ex = Exchange(rate=500.0, ping_every_s=0.2, pong_within_s=2.0 * UNIT_S)
    session = ExchangeSession(ex.start())
    trades: list[int] = []
    stall: dict[str, Any] = {}

    def on_event(source: str, event: dict[str, Any]) -> None:
        if event["type"] != "trade":
            return
        trades.append(event["seq"])
        if not stall:  # the first trade stalls the main loop (a wait that releases the GIL, as a step or a compile)
            at = ex.counters()["trades_sent"]
            stall["counters"] = ex.wait_for(
                lambda c: c["trades_sent"] >= at + STALL_TRADES or c["closes"]["4001"] or c["pings_missed"],
                120 * UNIT_S, f"{STALL_TRADES} trades sent during the stall")

    try:
        with Controller(Config(status_s=0.0), sources=[session], on_event=on_event) as ctl:
            drive(ctl, lambda: bool(stall), timeout_s=60 * UNIT_S, what="the stall begun and ended")
            drive(ctl, lambda: len(trades) > STALL_TRADES, timeout_s=60 * UNIT_S,
                  what="the trades of the stall delivered")
            snap = ctl.stats()
    finally:
        ex.stop()
    during = stall["counters"]
    assert during["closes"]["4001"] == 0 and during["pings_missed"] == 0, "the heartbeat was answered"
    after = ex.counters()
    assert (after["connections"], after["pings_missed"], session.logins) == (1, 0, 1), "one session throughout"
    assert trades == list(range(trades[0], trades[0] + len(trades))), "every trade, in order, none dropped"
    io = snap.feeds[0].io
    assert snap.events_dropped == {} and snap.dropped == {}
    # the stall was longer than the inbound queue holds: the source's own buffer took the rest,
    # within its bound (FORKLESS_SOURCE_BUFFER's default), so memory stayed bounded
    assert 0 < io.buffered_peak <= Config().source_buffer + 1


# ---- where a source's overflow is declared ------------------------------------------------------------


def test_a_feed_entry_takes_overflow_and_buffer_and_a_bad_one_is_refused_naming_the_field():
    from forkless.io_loop.errors import ValueProblem
    from forkless.io_loop.feedlist import feed_list

    spec = feed_list('[{"url": "ws://h/a", "name": "a", "overflow": "drop_oldest", "buffer": 100}, {"url": "ws://h/b"}]')
    assert [(s.overflow, s.buffer) for s in spec] == [("drop_oldest", 100), ("", None)]
    for bad, field in (('"overflow": "drop_newest"', '"overflow"'), ('"buffer": -1', '"buffer"'),
                       ('"buffer": 1.5', '"buffer"')):
        with pytest.raises(ValueProblem, match=f"feed 0 \\('a'\\): {field} must be"):
            feed_list(f'[{{"url": "ws://h/a", "name": "a", {bad}}}]')


def test_a_source_s_overflow_and_buffer_are_checked_and_a_replayable_source_cannot_drop():
    from forkless.controller.ioside import feed_plan

    class Mine:
        name = "mine"

        async def run(self, ctx: Any) -> None: ...

    for attrs, message in (({"overflow": "drop_newest"}, "overflow='drop_newest'; expected one of block, drop_oldest"),
                           ({"buffer": -5}, "buffer=-5; expected an int >= 0"),
                           ({"buffer": "10"}, "buffer='10'; expected an int >= 0"),
                           ({"replayable": True, "overflow": "drop_oldest"},
                            "replayable and has overflow='drop_oldest'")):
        source = Mine()
        for key, value in attrs.items():
            setattr(source, key, value)
        with pytest.raises(ValueError, match="source 'mine' .*" + message.replace("(", r"\(").replace(")", r"\)")):
            feed_plan(_config(), [source])
    source = Mine()
    source.overflow, source.buffer = "drop_oldest", 0
    assert [spec.name for spec in feed_plan(_config(), [source]).specs] == ["mine"]


def test_the_relay_refuses_a_feed_whose_overflow_drops():
    from forkless.controller.commands.relaycmd import relay_settings
    from forkless.io_loop.errors import ConfigError

    cfg = Config.from_env({"FORKLESS_FEEDS": '[{"url": "ws://h/a", "name": "a", "overflow": "drop_oldest"}]',
                           "FORKLESS_RELAY_NATS": "nats://127.0.0.1:4222", "FORKLESS_RELAY_SUBJECT": "md"})
    with pytest.raises(ConfigError, match="relay never drops a message"):
        relay_settings(cfg)
