"""Counters that are counters (Prometheus's instrumentation rules), from literal snapshots: labelled series at 0
from the start, what a checkpoint restored in gauges of its own, the build's gauge. The same across a real kill -9
and restore, with the app as a process: tests/program/test_restart.py."""

from __future__ import annotations

import platform
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import forkless
from forkless.controller.metrics import KNOWN_REASONS, MAX_REASONS, build_info, metric_families, sink_families
from forkless.controller.stats import StatsSnapshot, books_line
from forkless.io_loop.counters import SECONDS_BOUNDS, Histogram

ROOT = Path(__file__).resolve().parents[2]


def _snapshot(**changes: Any) -> StatsSnapshot:
    seconds = Histogram(SECONDS_BOUNDS).snapshot()
    base = dict(at=0.0, messages_in=0, frames_in=0, messages_out=0, errors_out=0, processed=0,
                batches=0, errors={}, dropped={}, connects=0, reconnects=0, connect_failures=0, connected=False,
                connection_since=0.0, inbound_depth=0, outbound_depth=0, unsent=0,
                batch_size=Histogram((1, 2, 4)).snapshot(), latency=seconds, loop_lag=seconds,
                step_seconds=seconds, compilations=0, compilations_after_warmup=None, devices=("cpu:0",),
                ready=False)
    base.update(changes)
    return StatsSnapshot(**base)


def _samples(snap: StatsSnapshot, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    (fam,) = [f for f in metric_families(snap) if f.name == family]
    return {tuple(sorted(s.labels.items())): s.value for s in fam.samples}


def test_the_reasons_forkless_counts_are_series_at_0_before_their_first_event() -> None:
    for family in ("forkless_dropped", "forkless_errors", "forkless_state_resets"):
        assert _samples(_snapshot(), family) == {(("reason", r),): 0 for r in KNOWN_REASONS[family]}, family
    counted = _samples(_snapshot(dropped={"feed given up": 3, "a reason of its own": 1}), "forkless_dropped")
    assert counted[(("reason", "feed given up"),)] == 3 and counted[(("reason", "a reason of its own"),)] == 1
    assert counted[(("reason", "unsent at stop"),)] == 0


def test_known_reasons_at_0_never_push_a_counted_reason_out_nor_make_an_other() -> None:
    errors = {f"x must have 2 numbers, got {n}": n + 1 for n in range(MAX_REASONS)}
    by_reason = {dict(k)["reason"]: v for k, v in _samples(_snapshot(errors=errors), "forkless_errors").items()}
    assert by_reason == errors  # the cap is full of counted reasons: the zeros wait, "other" is not invented


def test_each_sink_has_its_known_drop_reason_at_0() -> None:
    books = SimpleNamespace(taken=0, written=0, dropped={}, held=0, unwritten=0, batches=0)
    (dropped,) = [f for f in sink_families([("results", books), ("audit", books)]) if f.name == "forkless_sink_dropped"]
    assert {(s.labels["sink"], s.labels["reason"], s.value) for s in dropped.samples} == {
        ("results", "unwritten at the stop", 0), ("audit", "unwritten at the stop", 0)}


def test_every_known_reason_is_one_the_code_counts() -> None:
    """The list is written out in controller/metrics.py (a pure module cannot import where each is counted): each
    of its reasons must be a string the code outside it writes, so that a renamed reason fails here."""
    code = "".join(p.read_text(encoding="utf-8") for d in ("controller", "io_loop") for p in (ROOT / d).rglob("*.py")
                   if p != ROOT / "controller" / "metrics.py")
    for family, reasons in KNOWN_REASONS.items():
        for reason in reasons:
            assert f'"{reason}"' in code, f"{family}: {reason!r} is counted nowhere"


def test_the_restored_counts_are_gauges_beside_counters_of_this_process() -> None:
    snap = _snapshot(processed=30, counters={"anomalies": 2, "spikes": 1}, restored_processed=382_631,
                     restored_counters={"anomalies": 40, "spikes": 7})
    families = {f.name: f for f in metric_families(snap)}
    assert families["forkless_processed"].type == "counter"
    assert families["forkless_processed"].samples[0].value == 30
    assert families["forkless_anomalies"].samples[0].value == 2
    for name, value in (("forkless_restored_processed", 382_631), ("forkless_restored_anomalies", 40)):
        assert families[name].type == "gauge" and families[name].samples[0].value == value
    restored = families["forkless_restored_processor_counts"]
    assert restored.type == "gauge" and [(s.labels, s.value) for s in restored.samples] == [({"name": "spikes"}, 7)]
    assert books_line(snap).endswith("; before this process (its checkpoint): processed 382631, anomalies 40, spikes 7")
    assert "before this process" not in books_line(_snapshot(processed=30))  # a fresh start says nothing of it


def test_the_build_gauge_says_what_runs() -> None:
    (build,) = [f for f in metric_families(_snapshot()) if f.name == "forkless_build"]
    (sample,) = build.samples
    assert sample.name == "forkless_build_info" and sample.value == 1
    assert sample.labels == build_info()
    assert sample.labels["version"] == forkless.__version__ and sample.labels["python"] == platform.python_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", sample.labels["jax"]), sample.labels
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'version = { attr = "forkless.__version__" }' in pyproject  # one place for the version


def test_the_gil_gauge_is_1_while_the_gil_is_on_and_says_why() -> None:
    """``forkless_gil_enabled{status}``: the snapshot's ``gil`` (io_loop/gil.py) as it is, 1 for any "on: …"."""
    assert _samples(_snapshot(gil="off"), "forkless_gil_enabled") == {(("status", "off"),): 0}
    assert _samples(_snapshot(gil="on: enabled by module 'x'"), "forkless_gil_enabled") == {
        (("status", "on: enabled by module 'x'"),): 1}
    assert _samples(_snapshot(gil="on: the build has a GIL"), "forkless_gil_enabled") == {
        (("status", "on: the build has a GIL"),): 1}
    assert _samples(_snapshot(), "forkless_gil_enabled") == {}  # a snapshot made by hand: not known
