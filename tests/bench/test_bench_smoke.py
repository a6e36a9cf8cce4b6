"""Smoke run of the whole benchmark (``python -m bench.run --tpu --unix --quick``) through
``bench/tpu.sh``, and of ``bench/gpu.sh``'s dry run, so none can rot.

One short repeat of every design and every figure (the start-up figure forkless's only, as
``bench/tpu.sh`` measures it), the step-cost section with one calibrated step (~1 ms) and the
ping probe included. The run is the session's one small benchmark run
(the ``quick_benchmark`` fixture, tests/quick_bench.py: ``bench/tpu.sh`` on the CPU, that is
``python -m bench.run --tpu --unix --quick`` over unix sockets, about 1.5 minutes alone on 2 cores): every test that
checks it is in this file, so that the suite's workers (``pytest -n 4 --dist loadfile``) run it
once, on one worker, while the others go on; the two sections that a plain ``--quick`` run
adds on a CPU (state scaling, forced CPU devices) and the partitioned section are run and
checked on their own (tests/bench/test_bench_sections.py). The assertions are on
completeness and accounting only — every design has numbers, every message sent was answered,
every ping got its pong — never on how fast anything was: every run waits until its last reply
is in (bench/plan.py, ``DRAIN_S``), however slow the machine.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import UNIT_S, app_env
from tests.quick_bench import GPU_SCRIPT, ROOT, SCRIPT, TEST_TIMEOUT_S, UNIX_SOCKETS, QuickBench


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.fixture
def results(quick_benchmark: QuickBench) -> tuple[dict[str, Any], Path, str]:
    assert quick_benchmark.returncode == 0, quick_benchmark.failure()
    return quick_benchmark.data, quick_benchmark.out, quick_benchmark.stdout


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_quick_benchmark_answers_every_message_of_every_run(results: tuple[dict[str, Any], Path, str]) -> None:
    data, out, _ = results
    designs = {run["design"] for run in data["runs"]}
    assert designs == {"forkless", "spawn", "inline", "io-ceiling", "forkless-nojax"}
    for run in data["runs"] + data["step_costs"]["runs"]:
        lg = run["loadgen"]
        assert lg["sent"] > 0, run["tag"]
        assert lg["sent"] == lg["answered"], run["tag"]
        assert lg["missing"] == 0 and lg["errors"] == 0 and lg["duplicates"] == 0, run["tag"]
        assert run["client_rc"] == 0, run["tag"]
    # forkless-nojax's client runs no step on a device: its engine answers on the host (bench/forkless_client.py)
    nojax = sorted((out / "logs").glob("forkless-nojax-*.log"))
    assert nojax and all("no device step" in log.read_text(errors="replace") for log in nojax)
    heavy = [run for run in data["runs"] if run["heavy"]]  # the plan's lighter heavy step (bench/README.md)
    assert sorted(run["design"] for run in heavy) == ["forkless", "inline", "spawn"]
    assert all(run["step"] == {"size": 0, "iters": data["plan"]["heavy_iters"]} for run in heavy)


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
        assert row["compilations_after_warmup"] == 0, design
    # start-up: forkless's only, as bench/tpu.sh's own plan measures (the others' rows show none)
    assert _number(summary["forkless"]["first_result_s"]["cold_s"])
    assert _number(summary["forkless"]["first_result_s"]["warm_s"])
    assert summary["spawn"]["first_result_s"] == summary["inline"]["first_result_s"] == {}
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


# ---- bench/tpu.sh and bench/gpu.sh, the benchmark's accelerator commands, checked on the CPU ------
# No TPU or GPU is needed: the session's one small benchmark run above is ``bench/tpu.sh`` with
# ``JAX_PLATFORMS=cpu`` and ``FORKLESS_BENCH_QUICK=1`` (the smoke size of ``python -m bench.run
# --tpu --unix``); ``bench/gpu.sh`` runs the same ``bench.run`` (``--accelerator``) and is checked
# by its dry run. Here: the scripts' own part, what they run and write, never how fast anything was.


@pytest.mark.parametrize("script", [SCRIPT, GPU_SCRIPT], ids=["tpu.sh", "gpu.sh"])
def test_the_accelerator_scripts_are_valid_bash(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_the_gpu_script_would_install_cuda_jax_in_the_project_s_range_and_run_the_accelerator_plan(
        tmp_path: Path) -> None:
    env = app_env({"FORKLESS_BENCH_DRY_RUN": "1", "FORKLESS_BENCH_QUICK": "1", "FORKLESS_BENCH_UNIX": "1",
                   "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"})
    proc = subprocess.run(["bash", str(GPU_SCRIPT), str(tmp_path / "out")], capture_output=True, text=True,
                          env=env, timeout=30 * UNIT_S)
    assert proc.returncode == 0, proc.stderr
    jax_range = re.search(r"^jax([<>=][^\s#]*)", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert f"dry run: {sys.executable} -m pip install -r requirements-dev.txt jax[cuda12]{jax_range}" in proc.stdout
    assert (f"dry run: JAX_PLATFORMS=cpu {sys.executable} -m bench.run --accelerator --unix --quick --out "
            f"{tmp_path / 'out'}") in proc.stdout
    assert not (tmp_path / "out").exists()  # nothing run


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_the_tpu_script_runs_every_design_and_the_device_floor_and_writes_the_tables_on_the_cpu(
        quick_benchmark: QuickBench) -> None:
    run, out = quick_benchmark, quick_benchmark.out
    assert run.returncode == 0, run.failure()
    assert "pip install" not in run.stdout + run.stderr  # the TPU host has no package index
    flag = " --unix" if UNIX_SOCKETS else ""
    assert f"JAX_PLATFORMS=cpu {sys.executable} -m bench.run --tpu{flag} --quick --out {out}" in run.stdout

    data = run.data
    assert data["command"] == f"python -m bench.run --tpu{flag} --quick"
    assert data["plan"]["accelerator"] is True and data["plan"]["floor_s"] > 0
    assert "state_scaling" not in data and not (out / "devices.json").exists()  # the CPU's own sections
    assert {r["design"] for r in data["runs"]} == {"forkless", "spawn", "inline", "io-ceiling", "forkless-nojax"}
    for r in data["runs"] + data["step_costs"]["runs"]:
        assert r["loadgen"]["sent"] == r["loadgen"]["answered"] > 0, r["tag"]
    assert set(data["summary"]["step_map"]["costs"]) == {"default", "1ms"}

    floor = data["summary"]["device_floor"]  # the device's own round trip of a trivial step
    assert floor["platform"] == "cpu" and floor["steps"] > 0
    assert 0 < floor["round_trip_ms"]["p50"] <= floor["round_trip_ms"]["p99"]
    for design in ("forkless", "forkless-nojax"):  # CPU µs a message, the IO and main threads apart
        for load in ("rate_1k", "rate_10k", "window"):
            cpu = data["summary"][design]["cpu_us_per_msg"][load]
            assert all(_number(cpu[k]) and cpu[k] > 0 for k in ("process", "io_thread", "main_thread")), (design, load)
    for design in ("spawn", "inline", "io-ceiling"):
        assert _number(data["summary"][design]["cpu_us_per_msg"]["window"]["process"]), design

    # the same tables as bench/README.md's block, the platform and the device stated first
    tables = (out / "results.md").read_text()
    first = tables.splitlines()[0]
    assert f"`python -m bench.run --tpu{flag} --quick` with `JAX_PLATFORMS=cpu`" in first
    assert "JAX device cpu" in first
    for heading in ("| design | p50 @1k |", "#### Step cost: forkless, inline and spawn", "#### Latency budget",
                    "#### CPU per message and the device's floor", "| design | 1,000 msg/s: all / IO thread"):
        assert heading in tables
    assert "The device's own round trip of a trivial per-stream state step" in tables


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_the_tpu_script_s_run_is_over_unix_sockets_and_opens_no_inet_socket(quick_benchmark: QuickBench) -> None:
    """Every process of the run refused inet sockets (bench/unix.py's audit hook, loaded by
    bench/no_inet/sitecustomize.py), so a run that went through answered everything over unix
    sockets: the load generator and the probe printed unix addresses, the clients reached them."""
    if not UNIX_SOCKETS:
        pytest.skip("this checkout's forkless has no FORKLESS_WS_UNIX_SOCKET yet: the session's run was made "
                    "over TCP (tests/quick_bench.py)")
    run = quick_benchmark
    assert run.returncode == 0, run.failure()
    data = run.data
    assert data["unix_sockets"] is True
    runs = data["runs"] + data["step_costs"]["runs"]
    assert {r["design"] for r in runs} == {"forkless", "spawn", "inline", "io-ceiling", "forkless-nojax"}
    for r in runs:
        assert r["feed"].startswith("ws+unix://"), r["tag"]
        assert r["loadgen"]["sent"] == r["loadgen"]["answered"] > 0, r["tag"]
    assert all(r["probe"]["pongs"] == r["probe"]["pings"] > 0 for r in runs if "probe" in r)
    assert not any("PermissionError" in p.read_text(errors="replace") for p in (run.out / "logs").glob("*.log"))


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_the_tpu_script_measures_packed_transfers_and_the_checkpoint_gap(quick_benchmark: QuickBench) -> None:
    """Issue 48's figures: a step's round trip with one array each against one packed array each
    way (bench/packed_io.py), the checkpoint gap cloned on the device against the host copy on
    the main thread (bench/checkpoint_stall.py), and both as one table (bench/transfers.py)."""
    import json

    run, out = quick_benchmark, quick_benchmark.out
    assert run.returncode == 0, run.failure()
    packed = json.loads((out / "packed_io.json").read_text())
    assert packed["platform"] == "cpu" and set(packed["sizes"]) == {"1", "256"}
    for modes in packed["sizes"].values():
        for mode in ("arrays", "packed"):
            assert modes[mode]["steps"] > 0 and _number(modes[mode]["round_trip_ms"]["p50"]), mode
    stall = json.loads((out / "checkpoint_stall.json").read_text())
    assert set(stall["modes"]) == {"off", "whole", "device-get"} and stall["checkpoint_failures"] == 0
    for mode in ("whole", "device-get"):
        assert stall["modes"][mode]["checkpoints"] > 0 and stall["modes"][mode]["written"] > 0, mode
        assert _number(stall["modes"][mode]["gaps_during_checkpoint"]["max_ms"]), mode
    table = (out / "transfers.md").read_text()
    assert table.startswith("## Transfers (cpu:0, ") and "| device-get |" in table and "| 256 |" in table
