"""Histograms and the status line, with literal values (no clock, no threads)."""

from __future__ import annotations

import math
from dataclasses import FrozenInstanceError, replace

import pytest

from forkless.controller.stats import StatsSnapshot, status_line
from forkless.io_loop.counters import SECONDS_BOUNDS, Histogram


def test_quantiles_land_in_the_right_bucket():
    h = Histogram(SECONDS_BOUNDS)
    h.observe_many([0.001] * 98 + [0.1, 0.2])
    snap = h.snapshot()
    assert 0.0008 < snap.quantile(0.5) <= 0.001
    assert 0.08 < snap.quantile(0.99) <= 0.1
    assert snap.n == 100 and math.isclose(snap.total, 0.098 + 0.3)


def test_an_empty_histogram_has_no_quantile():
    assert math.isnan(Histogram([1, 2]).snapshot().quantile(0.5))


def test_snapshot_difference_is_what_happened_in_between():
    h = Histogram([1, 2, 4])
    h.observe(1)
    before = h.snapshot()
    h.observe_many([3, 3, 10])
    delta = h.snapshot() - before
    assert delta.counts == (0, 0, 2, 1) and delta.n == 3 and delta.mean == 16 / 3
    assert delta.cumulative() == [(1, 0), (2, 0), (4, 2), (math.inf, 3)]


def snapshot(at, messages_in, messages_out, latency=(), batches=()):
    lat = Histogram(SECONDS_BOUNDS)
    lat.observe_many(latency)
    bs = Histogram([1, 2, 4, 8])
    bs.observe_many(batches)
    empty = Histogram(SECONDS_BOUNDS).snapshot()
    return StatsSnapshot(
        at=at, messages_in=messages_in, frames_in=messages_in, messages_out=messages_out, errors_out=1,
        processed=messages_out, counters={"anomalies": 3}, batches=len(batches), errors={"not JSON": 1}, dropped={},
        connects=1, reconnects=0, connect_failures=0, connected=True, connection_since=0.0,
        inbound_depth=0, outbound_depth=0, unsent=0, batch_size=bs.snapshot(), latency=lat.snapshot(),
        loop_lag=empty, step_seconds=empty, compilations=9, compilations_after_warmup=0, devices=("cpu:0",),
        ready=True)


def test_the_status_line_shows_rates_and_window_latency_with_units():
    before = snapshot(10.0, 100, 100, latency=[0.5] * 10, batches=[1] * 10)
    now = snapshot(12.0, 300, 290, latency=[0.5] * 10 + [0.002] * 190, batches=[1] * 10 + [2] * 95)
    line = status_line(now, before)
    assert line.startswith("in 300 msg (100/s) | out 290 msg (95/s) | batch 2.0 msg | latency p50 ")
    # only the window's latencies (2 ms, within one bucket's resolution): the old 0.5 s ones are gone
    p99 = float(line.split("p99 ")[1].split("ms")[0])
    assert 2.0 <= p99 <= 2.52
    assert "anomalies 3 | errors 1 | dropped 0" in line and line.endswith("connected")


def test_the_status_line_says_when_disconnected():
    snap = replace(snapshot(1.0, 0, 0), connected=False)
    assert status_line(snap, None).endswith("DISCONNECTED")
    assert "batch - msg" in status_line(snap, None) and "latency p50 - p99 -" in status_line(snap, None)


def test_unanswered_is_the_rest_of_the_books():
    snap = replace(snapshot(1.0, 20, 12), no_reply=3, answer_errors_out=1, dropped={"lease lost": 2})
    assert snap.unanswered == 20 - 12 - 3 - 1 - 2
    assert "unanswered 2 | stopped" in status_line(replace(snap, connected=False), None, final=True)
    # its old name, in_flight, was removed in 0.2.0: tests/controller/test_renamed.py


def test_histogram_snapshot_is_immutable_data():
    h = Histogram([1.0, 2.0])
    h.observe(0.5)
    snap = h.snapshot()
    with pytest.raises(FrozenInstanceError):
        snap.n = 5  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        snap.counts = (9, 9, 9)  # type: ignore[misc]
    with pytest.raises(TypeError):
        snap.counts[0] = 9  # type: ignore[index]
    h.observe_many([1.5, 3.0])  # later observations go to the histogram, not to an earlier snapshot
    assert (snap.counts, snap.total, snap.n) == ((1, 0, 0), 0.5, 1)
    assert snap.cumulative() == [(1.0, 1), (2.0, 1), (math.inf, 1)]
    assert h.snapshot().counts == (1, 1, 1)


# ---- copying counters another thread writes: one function, copy_counts ---------------------------


class _GrowingWhileCopied(dict):
    """A counter dict whose copy fails ``fails`` times as if its writer thread added a key meanwhile."""

    def __init__(self, fails: int, **counts: int) -> None:
        super().__init__(**counts)
        self.fails = fails

    def keys(self):  # dict(self) iterates keys() when a subclass defines it
        if self.fails:
            self.fails -= 1
            raise RuntimeError("dictionary changed size during iteration")
        return super().keys()


def test_copy_counts_tries_again_when_the_writer_added_a_key_meanwhile():
    from forkless.io_loop.counters import copy_counts

    copied = copy_counts(_GrowingWhileCopied(3, bad=2, worse=1))
    assert copied == {"bad": 2, "worse": 1} and type(copied) is dict


def test_the_io_side_s_snapshot_copies_its_counter_dicts_with_copy_counts():
    from forkless.io_loop.counters import IOStats

    stats = IOStats(errors=_GrowingWhileCopied(2, bad=2), dropped=_GrowingWhileCopied(1, lost=1))
    snap = stats.snapshot()
    assert (snap.errors, snap.dropped) == ({"bad": 2}, {"lost": 1})
    assert type(snap.errors) is dict and snap.errors is not stats.errors
