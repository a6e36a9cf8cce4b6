"""The one small benchmark run of the test session, shared by the tests that check it.

``bench/tpu.sh`` run on the CPU at the smoke size: ``JAX_PLATFORMS=cpu`` and
``FORKLESS_BENCH_QUICK=1``, so it runs ``python -m bench.run --tpu --unix --quick``: every design,
every load, the heavy step, start-up, the ceilings and the device floor, and the step-cost
section, one short repeat each, every socket a unix-domain one and every process of the run
refusing TCP and UDP sockets (``bench/unix.py``), as on the lent TPU host. The two sections a
plain ``--quick`` run adds on a CPU (state scaling, forced CPU devices) are checked on their own
(``tests/bench/test_bench_sections.py``), so nothing is run twice; ``bench/gpu.sh`` runs the same
``bench.run`` (``--accelerator``) and is checked by its dry run (``FORKLESS_BENCH_DRY_RUN=1``).

Where this checkout's forkless has no ``FORKLESS_WS_UNIX_SOCKET`` yet (``bench.unix.
product_takes_unix_socket``), the forkless designs cannot reach a unix socket: the run is then
made over TCP (``FORKLESS_BENCH_UNIX=0``) and the unix check is skipped, saying why
(``UNIX_SOCKETS``).

``tests/bench/test_bench_smoke.py`` checks the script's part (the command it runs, the reduced plan,
``results.md``) and the benchmark's (every message of every run answered, every figure a
number). The run is made once, by the session-scoped ``quick_benchmark`` fixture
(tests/conftest.py), whichever test asks for it first.

Every wait in the benchmark ends on an event and has a bound only for when the event never
comes; ``FORKLESS_BENCH_TIMEOUT_SCALE`` scales those bounds as ``FORKLESS_TEST_TIMEOUT_SCALE``
scales the tests', so a slow machine makes the run longer, never incomplete.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from bench.unix import product_takes_unix_socket
from tests.harness import ROOT, TIMEOUT_SCALE, UNIT_S, app_env

SCRIPT = ROOT / "bench" / "tpu.sh"
GPU_SCRIPT = ROOT / "bench" / "gpu.sh"
# whether the run is over unix sockets: only where forkless takes FORKLESS_WS_UNIX_SOCKET
UNIX_SOCKETS = product_takes_unix_socket()
# The run's backstop, for a hang only: every wait inside the benchmark ends on its event and has
# its own bound (bench/plan.py), so this one is set for a machine far slower than a free 2-core
# one (about 1.5 minutes there alone, 2.3 beside the suite; 420 s was outlasted at a load average of 7 to 11 on 2 cores,
# where the run had reached its step-cost section). A test that may be the first to ask for
# the run waits this long.
RUN_TIMEOUT_S = 900 * UNIT_S
TEST_TIMEOUT_S = RUN_TIMEOUT_S + 30


@dataclass
class QuickBench:
    """How the run ended and where it wrote (``out``: results.json, results.md, bench.png)."""

    returncode: int
    stdout: str
    stderr: str
    out: Path

    @cached_property
    def data(self) -> dict[str, Any]:
        """``results.json``, read once."""
        result: dict[str, Any] = json.loads((self.out / "results.json").read_text())
        return result

    def failure(self) -> str:
        return self.stdout[-3000:] + self.stderr[-3000:]


def shared_run(root: Path) -> QuickBench:
    """The run, made once for the whole session however many pytest-xdist workers ask: the first
    to take ``root/quick-bench.lock`` runs it under ``root/quick-bench`` and writes how it ended,
    the others wait on the lock and read that (the recipe of xdist's documentation)."""
    import fcntl

    workdir, ended = root / "quick-bench", root / "quick-bench.json"
    with open(root / "quick-bench.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ended.exists():
            workdir.mkdir(exist_ok=True)
            run = run_script(workdir)
            ended.write_text(json.dumps({"returncode": run.returncode, "stdout": run.stdout, "stderr": run.stderr}))
        got = json.loads(ended.read_text())
    return QuickBench(got["returncode"], got["stdout"], got["stderr"], workdir / "out")


def run_script(workdir: Path) -> QuickBench:
    """``bash bench/tpu.sh WORKDIR/out`` from ``workdir``, as the CPU check runs it; the script and
    everything it started are killed if it runs past ``RUN_TIMEOUT_S``."""
    out = workdir / "out"
    env = app_env({"FORKLESS_BENCH_QUICK": "1", "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu",
                   "FORKLESS_BENCH_UNIX": "1" if UNIX_SOCKETS else "0",
                   "FORKLESS_BENCH_TIMEOUT_SCALE": str(TIMEOUT_SCALE)}, shared_cache=False)
    proc = subprocess.Popen(["bash", str(SCRIPT), str(out)], cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"bench/tpu.sh did not finish within {RUN_TIMEOUT_S:.0f} s\n"
                             f"{stdout[-3000:]}{stderr[-3000:]}") from None
    return QuickBench(proc.returncode, stdout, stderr, out)
