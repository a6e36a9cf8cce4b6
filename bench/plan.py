"""What a benchmark run is: its designs and loads, the plan's sizes, the bounds of its waits, the machine.

Rules:
- A run's sizes come from one frozen ``Plan`` (``full``, ``quick``, ``gpu``, ``tpu``); the sections read them
  from it and from nothing else.
- Every wait of a run ends on an event; its bound (``bound``, ``DRAIN_S``, ``CONNECT_S``) is only for when the
  event never comes, scaled by ``FORKLESS_BENCH_TIMEOUT_SCALE``: a slow machine makes a run longer, never
  incomplete.
- Imports no JAX (the designs run in processes of their own); the median and the format every table uses
  are here, once (``median``, ``fmt``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "bench" / "out"
BENCH_README = REPO_ROOT / "bench" / "README.md"  # the summary page: its block is the last run's main table
BENCH_DOCS = REPO_ROOT / "bench" / "docs"  # a page a topic
RESULTS_PAGE = BENCH_DOCS / "last-run.md"  # the whole results block
DEVICES_PAGE = BENCH_DOCS / "devices.md"
SUMMARY_BLOCK = "bench:summary"  # bench/README.md: <!-- bench:summary:start --> … <!-- bench:summary:end -->
RESULTS_BLOCK = "bench:results"  # bench/docs/last-run.md: <!-- bench:results:start --> … <!-- bench:results:end -->
DEVICES_BLOCK = "bench:devices"  # bench/docs/devices.md
DEVICE_COUNTS = (1, 2, 4)  # forced CPU devices (JAX_NUM_CPU_DEVICES) of the devices section
DESIGNS = ("forkless", "spawn", "inline", "io-ceiling", "forkless-nojax", "forkless-ft")
# forkless-ft: forkless on a free-threaded interpreter (PEP 703), run only when FORKLESS_BENCH_FT_PYTHON names
# one (its own site-packages: a venv's python; FORKLESS_BENCH_FT_PYTHONPATH is its PYTHONPATH, none if unset);
# every other design runs on the interpreter that runs the benchmark, as a user would run them
FT_PYTHON = os.environ.get("FORKLESS_BENCH_FT_PYTHON") or None
FT_DESIGNS = ("forkless-ft",)
# the designs that never step on a device: on an accelerator they run with JAX_PLATFORMS=cpu, so
# that they neither take the chip (one program at a time may hold a TPU) nor pay for opening it
HOST_DESIGNS = ("io-ceiling", "forkless-nojax")
JAX_DESIGNS = ("forkless", "spawn", "inline", "forkless-ft")
MAP_DESIGNS = ("forkless", "inline", "spawn")  # the designs measured at every step cost
HEAVIER = "heavier-steps"  # the compilation cache every design's heavier steps share (run_all)
DEFAULT_STEP = "default"


def active_designs(designs: tuple[str, ...] = DESIGNS) -> tuple[str, ...]:
    """Those of ``designs`` a run measures: forkless-ft only with a free-threaded interpreter named."""
    return designs if FT_PYTHON else tuple(d for d in designs if d not in FT_DESIGNS)

SAMPLE_S = 0.05
FEATURES = 8
STREAMS = 16
TABLES = (4096, 1_000_000)  # FORKLESS_MAX_STREAMS for the app part of "state scaling"
# Every wait below is on an event (the last reply in, a process's exit, a first result) and has
# a bound only for when that event never comes (a message lost, a process hung): a slow machine
# makes a run end later, never early. FORKLESS_BENCH_TIMEOUT_SCALE multiplies every bound, as
# FORKLESS_TEST_TIMEOUT_SCALE does the tests' (tests/quick_bench.py passes it on).
TIMEOUT_SCALE = float(os.environ.get("FORKLESS_BENCH_TIMEOUT_SCALE", "1"))
# after the last send, a run waits until every message sent has its reply, at most this long
# (bench.loadgen --drain-s; bench.ping_probe --drain-s for the pongs)
DRAIN_S = 60.0 * TIMEOUT_SCALE
# how long the load generator and the ping probe wait for the design to connect (its start-up:
# imports and the compilation of every bucket, before it connects)
CONNECT_S = 120.0 * TIMEOUT_SCALE


def bound(seconds: float) -> float:
    """A wait's bound, ``seconds`` times ``TIMEOUT_SCALE``."""
    return seconds * TIMEOUT_SCALE


@dataclass(frozen=True)
class Plan:
    """How long and how often; ``--quick`` is the smoke-test size."""

    repeats: int
    duration_s: float
    warmup_s: float
    window: int
    compute_s: float
    lag_floor_s: float
    # the step-cost section: the calibrated step costs (ms), whether the default step's ping
    # runs are made, and each of its runs' length (its warm-up is warmup_s)
    step_costs_ms: tuple[float, ...] = (1.0, 10.0)
    default_step_pings: bool = True
    step_duration_s: float = 2.5
    calibrate_s: float = 0.3  # timing per candidate in bench.step_cost
    # an accelerator's reduced plan (bench/gpu.sh): no state scaling, no forced CPU devices
    accelerator: bool = False
    # the heavy runs' matmuls a step (bench.heavy's HEAVY_SIZE): None, its HEAVY_ITERS (~100 ms
    # on 2 cores); the smoke size's fewer, its lag figure a check that the section runs, not a figure
    heavy_iters: int | None = None
    # which sections run: the designs with a start-up figure, the heavy-step runs, the step-cost
    # section; the device floor's seconds (bench.device_floor in the compute ceiling's process)
    startup_designs: tuple[str, ...] = ("forkless", "spawn", "inline")
    heavy_runs: bool = True
    step_cost: bool = True
    floor_s: float = 0.0

    @classmethod
    def full(cls) -> Plan:
        return cls(repeats=3, duration_s=4.0, warmup_s=1.0, window=1024, compute_s=2.0, lag_floor_s=3.0)

    @classmethod
    def quick(cls) -> Plan:
        return cls(repeats=1, duration_s=0.3, warmup_s=0.1, window=256, compute_s=0.2, lag_floor_s=0.3,
                   step_costs_ms=(1.0,), default_step_pings=False, step_duration_s=0.3, calibrate_s=0.1, heavy_iters=2)

    @classmethod
    def gpu(cls, quick: bool = False) -> Plan:
        """bench/gpu.sh's plan (under 8 minutes with the install): one repeat of 2.5 s, the designs
        and the step costs only (no ping runs at the default step: its row takes the main table's
        latencies). ``quick``: the smoke size, to check its shape on a CPU."""
        if quick:
            return dataclasses.replace(cls.quick(), accelerator=True)
        return cls(repeats=1, duration_s=2.5, warmup_s=0.8, window=1024, compute_s=1.0, lag_floor_s=1.0,
                   step_duration_s=2.0, default_step_pings=False, calibrate_s=0.2, accelerator=True)

    @classmethod
    def tpu(cls, quick: bool = False) -> Plan:
        """bench/tpu.sh's plan, in one command of at most ~9 minutes on a TPU host where every
        program that opens the chip pays ~15 s: every design at the three loads, one repeat of
        2.5 s; the compute ceiling and the device floor in one process; the start-up figure of
        forkless only; no heavy-step runs and no step-cost section (~20 more openings of the chip).
        ``quick``: the smoke size on a CPU, and there every section (the suite's one benchmark
        run, tests/quick_bench.py, checks them all with it), with forkless's start-up only, as
        here (the other designs' cold starts cost the suite ~10 CPU-s and run the same code)."""
        if quick:
            return dataclasses.replace(cls.gpu(quick=True), floor_s=0.2, startup_designs=("forkless",))
        return dataclasses.replace(cls.gpu(), startup_designs=("forkless",), heavy_runs=False, step_cost=False,
                                   floor_s=1.0)


LOADS = {
    "rate_1k": ["--mode", "rate", "--rate", "1000"],
    "rate_10k": ["--mode", "rate", "--rate", "10000"],
    "window": ["--mode", "window"],
}
LOADS_RATE = {"rate_1k": 1000, "rate_10k": 10000}  # msg/s of the open-loop loads


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = {}
    for mod in ("jax", "jaxlib", "aiohttp", "janus", "numpy"):
        try:
            from importlib.metadata import version

            versions[mod] = version(mod)
        except Exception:
            versions[mod] = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        **versions,
    }


def rotated(items: tuple[str, ...], k: int) -> Iterator[str]:
    k %= len(items)
    yield from items[k:] + items[:k]


def step_name(ms: float) -> str:
    """The key of a calibrated step cost: ``1ms``, ``10ms``."""
    return f"{ms:g}ms"


def median(values: list[Any]) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
    return statistics.median(vals) if vals else None


def fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and digits == 0:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)
