"""Smoke run of the GIL-stall benchmark (``python -m bench.gil_stall --quick``), so it cannot rot:
every section's figures are there, in the shape bench/docs/gil-stall.md reads them. Shape and
accounting, never speed, and one verdict that no machine's speed can turn: a C call that held the
GIL for 2 s (``c-sleep``: a wait in C that keeps the GIL, exactly as long on any machine), longer
than the exchange's ping interval and its deadline together, lost the connection of the
one-process design (its IO thread could not run meanwhile: docs/reliability.md, "Stalls that hold
the GIL"), and the IO-loop lag on /metrics shows a sample over 1 s for it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import UNIT_S, app_env

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 300 * UNIT_S  # a hang backstop: the run takes about 20 s on 2 loaded cores


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_quick_gil_stall_run_has_every_section_and_a_long_c_call_loses_the_one_process_session(tmp_path: Path) -> None:
    out = tmp_path / "gil_stall.json"
    done = subprocess.run([sys.executable, "-m", "bench.gil_stall", "--quick", "--out", str(out),
                           "--logs", str(tmp_path / "logs")], cwd=ROOT, env=app_env(), capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((tmp_path / "logs").glob("*")))
    assert done.returncode == 0, done.stderr[-3000:] + logs
    data = json.loads(out.read_text())

    threads = data["threads"]
    assert [row["kind"] for row in threads["rows"]] == ["c-call", "chunked", "python", "sleep"]
    assert all(_number(row["stall_s"]) and _number(row["ticker_longest_gap_s"]) for row in threads["rows"])

    session = data["session"]
    rows = session["rows"]
    assert [(r["design"], r["kind"], r["phase"], r["target_s"]) for r in rows] == [
        ("forkless", "none", "after-ping", 0.0), ("forkless", "c-sleep", "after-ping", 2.0),
        ("forkless", "chunked", "before-ping", 0.05), ("forkless", "python", "before-ping", 0.05),
        ("forkless", "sleep", "before-ping", 0.05)]
    for r in rows:
        assert isinstance(r["survived"], bool) and _number(r["measured_s"]), r
        assert r["survived"] == ((r["pings_missed"], r["closes_4001"], r["connections"]) == (0, 0, 0)
                                 and r["pongs_on_time_after"] > 0), r
        assert r["lag_samples"] > 0 and _number(r["lag_largest_in_s"][0]), r  # forkless: /metrics scraped
    held = rows[1]
    # held for over three times the ping interval and its deadline together (0.3 + 0.3 s): some ping came
    # while no thread of the client could answer it
    assert held["measured_s"] >= 2.0 > 3 * (session["ping_every_s"] + session["pong_within_s"])
    assert not held["survived"] and held["pings_missed"] >= 1, held
    assert held["lag_samples_over_1s"] >= 1 and held["lag_largest_in_s"][0] >= 1.0, held
    exchange = session["exchange"]["forkless"]
    assert exchange["pings_missed"] >= sum(r["pings_missed"] for r in rows)
    assert exchange["connections"] >= 2, exchange  # the session came back after the drop
    assert session["thresholds"]["forkless"]["after-ping"]["shortest_dropped_s"] == held["measured_s"]
    assert session["clients"]["forkless"]["exit"] == 0

    (probe,) = data["gc"]
    assert probe["size"] == 20_000 and probe["frozen_objects"] >= probe["size"]
    for key in ("collect", "collect_frozen"):
        assert len(probe[key]["pause_ms"]) == 3 and _number(probe[key]["ticker_held_ms_median"]), key
    for key in ("workload_default", "workload_raised_thresholds", "workload_frozen"):
        collections = probe[key]["collections"]
        assert set(collections) == {"gen0", "gen1", "gen2"}, key
        assert all(isinstance(c["n"], int) and _number(c["max_ms"]) for c in collections.values()), key
    assert probe["workload_default"]["collections"]["gen0"]["n"] > 0  # 10,000 rows kept: the collector ran
    assert "### gc: 20,000 live lists" in done.stdout and "| forkless | c-sleep | after-ping | 2 |" in done.stdout
