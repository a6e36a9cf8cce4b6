"""bench/gpu.sh, the benchmark's one GPU command, checked for shape on the CPU.

No GPU is needed: the script runs with ``FORKLESS_GPU_SKIP_INSTALL=1`` (it prints the install
command instead of running it), ``JAX_PLATFORMS=cpu`` and ``FORKLESS_BENCH_QUICK=1`` (the smoke
size of ``python -m bench.run --accelerator``). The assertions are on what it runs and writes,
never on how fast anything was.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import UNIT_S

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu.sh"
RUN_TIMEOUT_S = 360 * UNIT_S


def test_the_gpu_script_is_valid_bash() -> None:
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_the_gpu_script_installs_cuda_jax_in_the_project_s_range_and_writes_the_tables_on_the_cpu(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "FORKLESS_GPU_SKIP_INSTALL": "1", "JAX_PLATFORMS": "cpu", "FORKLESS_BENCH_QUICK": "1",
           "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # the install it would run: the dev requirements and jax[cuda12] pinned to requirements.txt's range
    jax_range = re.search(r"^jax([<>=][^\s#]*)", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    install = next(line for line in proc.stdout.splitlines() if "install skipped" in line)
    assert f"-m pip install -r requirements-dev.txt jax[cuda12]{jax_range}" in install
    assert f"JAX_PLATFORMS=cpu {sys.executable} -m bench.run --accelerator --quick --out {out}" in proc.stdout

    data = json.loads((out / "results.json").read_text())
    assert data["command"] == "python -m bench.run --accelerator --quick"
    assert data["plan"]["accelerator"] is True
    assert "state_scaling" not in data and not (out / "devices.json").exists()  # the CPU's own sections
    assert {r["design"] for r in data["runs"]} == {"forkless", "spawn", "inline", "io-ceiling", "forkless-nojax"}
    for run in data["runs"] + data["step_costs"]["runs"]:
        assert run["loadgen"]["sent"] == run["loadgen"]["answered"] > 0, run["tag"]
    assert set(data["summary"]["step_map"]["costs"]) == {"default", "1ms"}

    # the same tables as bench/README.md's block, the platform and the device stated first
    tables = (out / "results.md").read_text()
    first = tables.splitlines()[0]
    assert "`python -m bench.run --accelerator --quick` with `JAX_PLATFORMS=cpu`" in first
    assert "JAX device cpu" in first
    for heading in ("| design | p50 @1k |", "#### Step cost: forkless, inline and spawn", "#### Latency budget"):
        assert heading in tables
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
