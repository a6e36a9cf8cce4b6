"""The sections of a run beside its main table: the compute ceiling and the idle loop's lag, the heavy step,
the step costs, state scaling and the forced CPU devices.

Rules:
- A section is a function of the plan, a work folder and compilation caches; it returns its figures, which go
  into the results as they are; nothing here writes a document (bench/tables.py does).
- Designs (and table sizes, device counts) are rotated between repeats (``rotated``), as in the main table, so
  a drift of the machine falls on every one.
- A heavier step is one program whichever design runs it: one compilation cache for them all (``HEAVIER``).
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import state_scaling
from bench.loads import run_load
from bench.plan import (
    DEFAULT_STEP,
    DEVICE_COUNTS,
    FEATURES,
    HEAVIER,
    JAX_DESIGNS,
    MAP_DESIGNS,
    REPO_ROOT,
    STREAMS,
    TABLES,
    Plan,
    active_designs,
    bound,
    machine,
    median,
    rotated,
    step_name,
)
from bench.processes import client_env


def compute_ceiling(plan: Plan, work: Path, cache_dir: str) -> dict[str, Any]:
    path = work / "compute-ceiling.json"
    subprocess.run([sys.executable, "-m", "bench.compute_ceiling", "--seconds", str(plan.compute_s),
                    "--streams", str(STREAMS), "--out", str(path), "--floor-s", f"{plan.floor_s:g}"],
                   cwd=REPO_ROOT, env=client_env(cache_dir), check=True, timeout=bound(120))
    figures = json.loads(path.read_text())
    print(f"  compute-ceiling              {figures['throughput_msg_s']:.0f} msg/s", flush=True)
    if figures.get("device_floor"):
        floor = figures["device_floor"]["round_trip_ms"]
        print(f"  device floor (trivial step)  p50 {floor['p50']:.3f} p99 {floor['p99']:.3f} ms a round trip on "
              f"{figures['device_floor']['device']}", flush=True)
    return figures


def devices_section(plan: Plan, work: Path, cache_dir: str | None = None) -> dict[str, Any]:
    """The step alone and the app's maximum throughput on 1, 2 and 4 forced CPU devices. Each
    count's compilation cache is its own unless ``cache_dir`` is given (one for all: the keys
    differ by device count anyway)."""
    by_count: dict[int, dict[str, Any]] = {}
    caches = {n: cache_dir or str(work / f"jax-cache-devices-{n}") for n in DEVICE_COUNTS}
    for n in DEVICE_COUNTS:
        path = work / f"devices-compute-{n}.json"
        subprocess.run([sys.executable, "-m", "bench.devices", "--seconds", str(plan.compute_s),
                        "--streams", str(STREAMS), "--out", str(path)], cwd=REPO_ROOT,
                       env={**client_env(caches[n]), "JAX_NUM_CPU_DEVICES": str(n)},
                       check=True, timeout=bound(180))
        by_count[n] = {"compute": json.loads(path.read_text()), "runs": []}
        print(f"  step alone on {n} device(s)     {by_count[n]['compute']['throughput_msg_s']:.0f} msg/s, host "
              f"routing {by_count[n]['compute']['host_routing_us']:.1f} µs a batch", flush=True)
    for rep in range(plan.repeats):
        for n in rotated(DEVICE_COUNTS, rep):
            by_count[n]["runs"].append(run_load("forkless", "window", plan, work, caches[n],
                                                f"forkless-devices{n}-r{rep}", env={"JAX_NUM_CPU_DEVICES": str(n)}))
    rows = {}
    for n, got in by_count.items():
        clients = [r["client"] or {} for r in got["runs"]]
        rows[str(n)] = {
            "devices": got["compute"]["devices"],
            "compute_msg_s": got["compute"]["throughput_msg_s"],
            "step_ms": got["compute"]["step_ms_mean"],
            "batch_size": got["compute"]["batch_size"],
            "host_routing_us": got["compute"]["host_routing_us"],
            "app_max_msg_s": median([r["loadgen"].get("throughput_msg_s") for r in got["runs"]]),
            "app_max_msg_s_runs": [r["loadgen"].get("throughput_msg_s") for r in got["runs"]],
            "batch_size_mean": median([c.get("batch_size_mean") for c in clients]),
            "device_fill": median([c.get("device_fill") for c in clients]),
            "compilations_after_warmup": max((c.get("compilations_after_warmup") or 0 for c in clients), default=None),
            "answered_all": all(r["loadgen"].get("sent") == r["loadgen"].get("answered") for r in got["runs"]),
        }
    one, most = rows[str(DEVICE_COUNTS[0])]["app_max_msg_s"], rows[str(DEVICE_COUNTS[-1])]["app_max_msg_s"]
    return {"counts": list(DEVICE_COUNTS), "by_devices": rows,
            "app_ratio_most_vs_one": most / one if one and most else None}


def calibrate_steps(plan: Plan, work: Path, cache_dir: str | None = None) -> dict[str, Any]:
    """``bench.step_cost``'s calibration of the heavy step to ``plan.step_costs_ms``, in a process of its own.
    ``cache_dir``: the compilation cache of the heavier steps, so that the design to run a
    calibrated step first loads what the calibration compiled (``compile_step``, the same
    program) instead of compiling it again (~4 CPU-s a step cost on 2 cores)."""
    path = work / "step-cost.json"
    subprocess.run([sys.executable, "-m", "bench.step_cost", "--targets-ms", *(f"{ms:g}" for ms in plan.step_costs_ms),
                    "--seconds", str(plan.calibrate_s), "--out", str(path)],
                   cwd=REPO_ROOT, env=client_env(cache_dir), check=True, timeout=bound(600))
    figures = json.loads(path.read_text())
    for t in figures["targets"]:
        print(f"  step ~{t['target_ms']:g} ms: {t['iters']} matmuls of {figures['size']}x{figures['size']}, "
              f"{t['step_ms']:.2f} ms a step of 1 message, {t['step_ms_full']:.2f} ms of {figures['batch_full']}",
              flush=True)
    return figures


def step_cost_section(plan: Plan, work: Path, caches: dict[str, str]) -> dict[str, Any]:
    """Forkless, inline and spawn at the default step and at each calibrated step cost: at
    1,000 msg/s with the ping probe, and at the bounded window (the default step's window runs
    are the main table's). Designs rotated between repeats, as in the main table."""
    calibration = calibrate_steps(plan, work, caches[HEAVIER])
    steps = {step_name(t["target_ms"]): {"cost": step_name(t["target_ms"]), "size": calibration["size"],
                                         "iters": t["iters"]} for t in calibration["targets"]}
    runs: list[dict[str, Any]] = []

    def one(design: str, load: str, cost: str, rep: int) -> None:
        step = steps.get(cost)
        cache = caches[design] if step is None else caches[HEAVIER]
        run = run_load(design, load, plan, work, cache, f"{design}-step{cost}-{load}-r{rep}", step=step,
                       probe=load == "rate_1k", duration_s=plan.step_duration_s)
        run["cost"] = cost
        run.pop("latency_quantiles_ms", None)  # for the main table's plot only: results.json stays small
        runs.append(run)

    for rep in range(plan.repeats):
        if plan.default_step_pings:
            for design in rotated(MAP_DESIGNS, rep):
                one(design, "rate_1k", DEFAULT_STEP, rep)
        for cost in steps:
            for load in ("rate_1k", "window"):
                for design in rotated(MAP_DESIGNS, rep):
                    one(design, load, cost, rep)
    return {"calibration": calibration, "steps": steps, "runs": runs}


def lag_floor(seconds: float) -> dict[str, Any]:
    """Lag of an idle asyncio loop measured like the IO thread's (sleep 50 ms, overshoot):
    the floor of the lag figures on this machine (the epoll timeout has 1 ms granularity)."""
    code = (
        "import asyncio,json,time\n"
        "async def m(n):\n"
        "    loop=asyncio.get_running_loop(); out=[]\n"
        "    for _ in range(n):\n"
        "        e=loop.time()+0.05; await asyncio.sleep(0.05); out.append(max(0.0,loop.time()-e))\n"
        "    return out\n"
        f"print(json.dumps(asyncio.run(m({max(10, int(seconds / 0.05))}))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=bound(60))
    ms = np.asarray(json.loads(out.stdout)) * 1000
    figures = {"p50": float(np.quantile(ms, 0.5)), "p99": float(np.quantile(ms, 0.99)), "samples": len(ms)}
    print(f"  idle asyncio loop lag        p50 {figures['p50']:.2f} p99 {figures['p99']:.2f} ms", flush=True)
    return figures


def heavy_runs(plan: Plan, work: Path, caches: dict[str, str]) -> list[dict[str, Any]]:
    """forkless, spawn and inline at 1,000 msg/s with the heavy step (the IO loop's lag while a
    long step runs), where the plan has them."""
    if not plan.heavy_runs:
        return []
    print("heavy step at 1,000 msg/s:", flush=True)
    # size 0: bench.heavy's HEAVY_SIZE (bench.run imports no JAX)
    lighter = None if plan.heavy_iters is None else {"size": 0, "iters": plan.heavy_iters}
    return [run_load(design, "rate_1k", plan, work, caches[HEAVIER], f"{design}-heavy", heavy=True, step=lighter)
            for design in active_designs(JAX_DESIGNS)]


def cpu_sections(plan: Plan, work: Path, caches: dict[str, str]) -> dict[str, Any]:
    """The CPU's own sections of a run, which an ``--accelerator`` run leaves out: state scaling
    (forkless at 1,000 msg/s with each of ``TABLES``, then ``bench.state_scaling``'s step alone)
    and the devices section. ``state_scaling`` and ``devices`` go into the results as they are;
    ``table_runs``: the state-scaling load runs, for a check of their accounting.
    ``caches["devices"]``, where given: the devices section's one compilation cache."""
    table_runs: dict[int, list[dict[str, Any]]] = {size: [] for size in TABLES}
    print(f"state scaling: forkless at 1,000 msg/s with FORKLESS_MAX_STREAMS {' and '.join(map(str, TABLES))}:",
          flush=True)
    for rep in range(plan.repeats):
        for size in rotated(TABLES, rep):
            table_runs[size].append(run_load("forkless", "rate_1k", plan, work, caches["forkless"],
                                             f"forkless-streams{size}-r{rep}", env={"FORKLESS_MAX_STREAMS": str(size)}))
    print("state scaling: the step alone", flush=True)
    scaling = state_scaling.measure(quick=plan.repeats == 1)
    print("devices: the step alone, then forkless at its maximum throughput:", flush=True)
    devices_started = time.monotonic()
    section = devices_section(plan, work, caches.get("devices"))
    app_1k = {str(size): {q: median([(r["loadgen"].get("latency_ms") or {}).get(q) for r in rs])
                          for q in ("p50", "p99")} for size, rs in table_runs.items()}
    return {"state_scaling": {**scaling, "app_1k": app_1k}, "devices": section,
            "devices_elapsed_s": time.monotonic() - devices_started,
            "table_runs": {str(size): rs for size, rs in table_runs.items()}}


def run_devices_only(plan: Plan, out: Path, command: str) -> dict[str, Any]:
    """Only the devices section; writes ``OUT/devices.json``."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="forkless-bench-") as tmp:
        work = Path(tmp)
        (work / "logs").mkdir()
        print("devices: the step alone, then forkless at its maximum throughput:", flush=True)
        section = devices_section(plan, work)
    results = devices_results(section, plan, command, time.monotonic() - started)
    (out / "devices.json").write_text(json.dumps(results, indent=1))
    return results


def devices_results(section: dict[str, Any], plan: Plan, command: str, elapsed_s: float) -> dict[str, Any]:
    return {"command": command, "jax_platforms": client_env(None).get("JAX_PLATFORMS"),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "machine": machine(),
            "plan": plan.__dict__, "loadgen_settings": {"streams": STREAMS, "features": FEATURES},
            "elapsed_s": round(elapsed_s, 1), "devices": section}
