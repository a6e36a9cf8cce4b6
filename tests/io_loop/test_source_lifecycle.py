"""A user's ``Source`` and the controller's lifecycle: a source that dies, ends or fails in its
``before_stop``; what ``send`` does then; what the loop's lag shows of a source that blocks it.

Each source is written against the public API only (``controller.Source``: a ``name`` and
``async run(ctx)``) and run by a real ``Controller``; the books must balance in every case.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from forkless import Config, Controller, FeedFatal, OnResults
from forkless.controller.processor import ewma_processor
from tests.harness import UNIT_S, assert_books_balance, drive

pytestmark = pytest.mark.timeout(90 * UNIT_S)

PROCESSOR = ewma_processor()
FEATURES = 4


def _config(**changes: Any) -> Config:
    base: dict[str, Any] = dict(features=FEATURES, max_batch=4, max_streams=64, max_wait_ms=1.0, queue_size=4,
                                heartbeat_s=0.0, connect_timeout_s=2.0, shutdown_timeout_s=5.0, status_s=0.0)
    base.update(changes)
    return Config(**base)


def _frame(seq: int) -> str:
    return json.dumps({"seq": seq, "stream": f"s{seq % 3}", "x": [1.0] * FEATURES})


class DiesWhileRepliesWait:
    """Emits, never writes a reply, and fails once the main thread waits on a full outbound queue."""

    name = "dying"

    def __init__(self, main_waits: threading.Event) -> None:
        self.main_waits = main_waits

    async def run(self, ctx: Any) -> None:
        async def feed() -> None:
            for seq in range(10_000):
                await ctx.emit(_frame(seq))

        feeding = asyncio.create_task(feed())
        await asyncio.get_running_loop().run_in_executor(None, self.main_waits.wait)
        feeding.cancel()
        raise ConnectionResetError("the exchange reset the connection")


def test_a_source_that_dies_while_the_main_thread_puts_replies_raises_feedfatal_and_the_books_balance():
    main_waits = threading.Event()
    batches = [0]
    cfg = _config()

    def on_results(seq: list, stream: list, outputs: dict) -> None:
        batches[0] += 1
        if batches[0] > cfg.queue_size:  # this batch's put waits: outbound is full, nobody reads it
            main_waits.set()

    with pytest.raises(FeedFatal, match="source 'dying' failed: ConnectionResetError") as info, \
            Controller(cfg, processor=PROCESSOR, sources=[DiesWhileRepliesWait(main_waits)],
                       sinks=[OnResults(on_results)]) as ctl:
        drive(ctl, lambda: False, timeout_s=20 * UNIT_S, what="the failure raised")
    assert isinstance(info.value.__cause__, ConnectionResetError)
    snap = ctl.stats()
    assert snap.messages_in > 0 and snap.unanswered == 0, snap.dropped
    assert_books_balance(ctl)


class FailsBeforeStop:
    """Emits, writes its replies, and fails in ``before_stop``."""

    name = "closing"

    def __init__(self) -> None:
        self.written = 0

    async def run(self, ctx: Any) -> None:
        async def feed() -> None:
            seq = 0
            while not ctx.stopping.is_set():
                await ctx.emit(_frame(seq))
                seq += 1
                await asyncio.sleep(0.005)

        feeding = asyncio.create_task(feed())
        try:  # the failed before_stop cancels this run: the feeder is cancelled with it, not left pending
            async for _ in ctx.outgoing():
                self.written += 1
        finally:
            feeding.cancel()

    async def before_stop(self, ctx: Any) -> None:
        raise_in_before_stop()


def raise_in_before_stop() -> None:
    raise PermissionError("the exchange refused the cancel-all")


def test_an_exception_in_before_stop_reaches_the_main_thread_and_the_stop_does_not_wait_out_its_deadline():
    import time
    import traceback

    source = FailsBeforeStop()
    cfg = _config(shutdown_timeout_s=30 * UNIT_S, queue_size=64, max_batch=16)
    ctl = Controller(cfg, processor=PROCESSOR, sources=[source])
    ctl.start()
    try:
        drive(ctl, lambda: source.written >= 10, timeout_s=20 * UNIT_S, what="10 replies written")
    finally:
        began = time.monotonic()
        with pytest.raises(FeedFatal, match="source 'closing' failed in before_stop: PermissionError") as info:
            ctl.stop()
        stopped_s = time.monotonic() - began
    cause = info.value.__cause__
    assert isinstance(cause, PermissionError)
    assert "raise_in_before_stop" in [frame.name for frame in traceback.extract_tb(cause.__traceback__)]
    assert stopped_s < cfg.shutdown_timeout_s / 2, f"the stop took {stopped_s:.1f}s: it waited for its deadline"
    assert_books_balance(ctl)


class ExpiresAfterOneOrder:
    """Takes one order, then its session ends (a token expired, no re-login): ``run`` returns
    once the test says so, with the orders sent meanwhile unread."""

    name = "exchange"

    def __init__(self, may_end: threading.Event) -> None:
        self.may_end = may_end
        self.got: list[Any] = []

    async def run(self, ctx: Any) -> None:
        async for frame in ctx.outgoing():
            self.got.append(frame)
            break
        await asyncio.get_running_loop().run_in_executor(None, self.may_end.wait)


def test_send_to_a_source_whose_run_returned_raises_and_what_it_could_not_write_is_logged_once(caplog):
    may_end = threading.Event()
    source = ExpiresAfterOneOrder(may_end)
    with Controller(_config(queue_size=64), processor=PROCESSOR, sources=[source]) as ctl:
        ctl.send("exchange", {"order": 0})
        drive(ctl, lambda: len(source.got) == 1, timeout_s=10 * UNIT_S, what="the first order taken")
        for i in range(1, 40):  # sent while the session is still up, never read: it ends first
            ctl.send("exchange", {"order": i})
        may_end.set()
        drive(ctl, lambda: not ctl.stats().feeds[0].io.connected, timeout_s=10 * UNIT_S, what="the source ended")
        with pytest.raises(RuntimeError, match=r"send\('exchange'\): 1 frames not sent: the source has ended "
                                               r"\(its run returned\)"):
            ctl.send("exchange", {"order": 40})
        drive(ctl, lambda: ctl.stats().sent_unsent >= 39, timeout_s=10 * UNIT_S, what="39 orders counted")
    snap = ctl.stats()
    assert (snap.sent_out, snap.sent_unsent) == (1, 39) and snap.feeds[0].ended
    logged = [r.getMessage() for r in caplog.records if "could not be written" in r.getMessage()]
    assert len(logged) == 1 and "source 'exchange' has ended" in logged[0], logged
    assert_books_balance(ctl)


class BlocksItsLoop:
    """Blocks the IO loop once (a synchronous call in a coroutine: a blocking SDK, say), then says so."""

    name = "blocking"

    def __init__(self, block_s: float) -> None:
        self.block_s = block_s
        self.blocked = threading.Event()

    async def run(self, ctx: Any) -> None:
        import time

        await asyncio.sleep(0.1)  # the lag sampler's timer is waiting by now
        time.sleep(self.block_s)  # the misuse under test
        self.blocked.set()
        async for _ in ctx.outgoing():
            pass


def test_a_source_that_blocks_its_loop_shows_in_the_loop_lag_for_as_long_as_it_blocked():
    source = BlocksItsLoop(block_s=1.0)
    with Controller(_config(), processor=PROCESSOR, sources=[source]) as ctl:
        drive(ctl, source.blocked.is_set, timeout_s=10 * UNIT_S, what="the loop blocked")
        lag = ctl.stats().loop_lag
        drive(ctl, lambda: ctl.stats().loop_lag.n > lag.n, timeout_s=10 * UNIT_S, what="the lag sampled after it")
        lag = ctl.stats().loop_lag
    # the block delayed the sampler's timer by about 1 s less at most one sampling interval (100 ms):
    # at least one sample of 0.25 s or more, and quantiles that weigh the block by how long it lasted
    late = sum(count for bound, count in zip((*lag.bounds, float("inf")), lag.counts) if bound > 0.25)
    assert late >= 5, f"{late} samples above 0.25 s of {lag.n}; the largest about {lag.quantile(1.0):.4f} s"
    assert lag.quantile(0.99) > 0.25
