"""bench/gpu.sh, the benchmark's one GPU command, checked for shape on the CPU.

No GPU is needed: the script runs with ``FORKLESS_GPU_SKIP_INSTALL=1`` (it prints the install
command instead of running it), ``JAX_PLATFORMS=cpu`` and ``FORKLESS_BENCH_QUICK=1`` (the smoke
size of ``python -m bench.run --accelerator``). That run is the session's one small benchmark
run (the ``quick_benchmark`` fixture, tests/quick_bench.py), which tests/test_bench_smoke.py
checks too; here: the script's own part. The assertions are on what it runs and writes, never
on how fast anything was.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.quick_bench import ROOT, SCRIPT, TEST_TIMEOUT_S, QuickBench


def test_the_gpu_script_is_valid_bash() -> None:
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_the_gpu_script_installs_cuda_jax_in_the_project_s_range_and_writes_the_tables_on_the_cpu(
        quick_benchmark: QuickBench) -> None:
    run, out = quick_benchmark, quick_benchmark.out
    assert run.returncode == 0, run.failure()

    # the install it would run: the dev requirements and jax[cuda12] pinned to requirements.txt's range
    jax_range = re.search(r"^jax([<>=][^\s#]*)", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    install = next(line for line in run.stdout.splitlines() if "install skipped" in line)
    assert f"-m pip install -r requirements-dev.txt jax[cuda12]{jax_range}" in install
    assert f"JAX_PLATFORMS=cpu {sys.executable} -m bench.run --accelerator --quick --out {out}" in run.stdout

    data = run.data
    assert data["command"] == "python -m bench.run --accelerator --quick"
    assert data["plan"]["accelerator"] is True
    assert "state_scaling" not in data and not (out / "devices.json").exists()  # the CPU's own sections
    assert {r["design"] for r in data["runs"]} == {"forkless", "spawn", "inline", "io-ceiling", "forkless-nojax"}
    for r in data["runs"] + data["step_costs"]["runs"]:
        assert r["loadgen"]["sent"] == r["loadgen"]["answered"] > 0, r["tag"]
    assert set(data["summary"]["step_map"]["costs"]) == {"default", "1ms"}

    # the same tables as bench/README.md's block, the platform and the device stated first
    tables = (out / "results.md").read_text()
    first = tables.splitlines()[0]
    assert "`python -m bench.run --accelerator --quick` with `JAX_PLATFORMS=cpu`" in first
    assert "JAX device cpu" in first
    for heading in ("| design | p50 @1k |", "#### Step cost: forkless, inline and spawn", "#### Latency budget"):
        assert heading in tables
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
