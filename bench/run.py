"""The benchmark: every design against the same load, in one run, one table.

    python -m bench.run [--quick] [--out bench/out] [--report-only]

Designs (each a process of its own, the load generator in another):

- ``forkless``  this project as a user runs it (``bench.forkless_client``: the real
  ``Controller``, default codec and processor, status line on);
- ``spawn``     the aiohttp client in a spawned child, JAX in the parent, two
  ``multiprocessing.Queue``s (``bench.spawn_client``);
- ``inline``    one asyncio loop, no thread, no queue: decode, the same compiled step, encode and
  write, all on the event loop (``bench.inline_client``);
- ``io-ceiling`` replies from the event loop, no queue, no thread, no JAX (``bench.io_ceiling``);
- ``compute-ceiling`` the jitted step alone on pre-built batches (``bench.compute_ceiling``).

Figures, medians over repeats (the design order is rotated between repeats): latency
p50/p99/p99.9 from the due time at 1,000 and 10,000 msg/s; throughput with a bounded
in-flight window; peak RSS of every process of a design (sampled every 50 ms, children and
the multiprocessing resource tracker included); IO-loop lag at 1,000 msg/s with the default
and with a heavy step (``bench.heavy``); compilations after warm-up; time from process
start to first result with an empty and with a warm persistent compilation cache.

JetStream (``--jetstream-only``, bench/jetstream.py): a JetStream feed's maximum throughput and
latency at 1,000 msg/s beside the WebSocket feed's, against a real nats-server, and the
checkpoint stall with a JetStream feed; written to ``OUT/jetstream.json``.
Partitioned instances (``--partitioned-only``, bench/partitioned.py, issue 24): throughput of 1, 2
and 4 instances over one partitioned JetStream stream, and the rescale time 2 -> 4 instances with
10^6 streams of state; written to ``OUT/partitioned.json``. Neither JetStream section is part of
the full run (each takes minutes of its own and needs nats-server).
Step cost: forkless, inline and spawn with the default detector, a ~1 ms and a ~10 ms step
(``bench.heavy`` calibrated on this machine by ``bench.step_cost``): latency at 1,000 msg/s,
maximum throughput, and how long a WebSocket ping waits for its pong while the design steps
(``bench.ping_probe``, a second connection on the loop that answers the feed). Summarised in
``summary["step_map"]`` and the "Step cost" part of the results block.

Devices (``--devices-only`` runs just this section): the controller's compiled step alone
(``bench.devices``) and forkless's maximum throughput with 1, 2 and 4 forced CPU devices
(``JAX_NUM_CPU_DEVICES``), each in a process of its own, in one run; written to
``OUT/devices.json`` and, into the default ``bench/out``, the devices block of bench/docs/devices.md.

On an accelerator (``--accelerator``, bench/gpu.sh; ``--tpu``, bench/tpu.sh: ``Plan.tpu``) the CPU's own
sections are left out and ``OUT/results.md`` is written. ``--unix`` (or ``FORKLESS_BENCH_UNIX=1``):
every socket of the run a unix-domain one and every process of it refusing inet sockets
(bench/unix.py), as the lent TPU host requires; the compute ceiling's process also measures the
device floor (bench/device_floor.py) where the plan asks for it, and every design's CPU µs a
message (forkless's IO and main threads apart) is in the tables (bench/per_message.py).

Writes ``OUT/results.json`` (every run's numbers), ``OUT/bench.png`` and ``OUT/logs/``. A full
run into the default ``bench/out`` also rewrites the results block of ``bench/docs/last-run.md`` and the
summary block of ``bench/README.md``
(``results_markdown``); ``--report-only`` rewrites it from the existing ``results.json``
without running anything.

Rules:
- This module is the command: which plan (bench/plan.py), which sections in which order, what it writes where,
  and ``targets()``, the judgement of a run. A run of a design is bench/loads.py's, a section's work
  bench/sections.py's, the medians bench/summary.py's, the tables and the documents' blocks bench/tables.py's,
  the processes and their sampling bench/processes.py's.
- Imports no JAX: every design, ceiling and calibration runs in a process of its own.
- Only a full CPU run into the default ``bench/out`` rewrites the documents' blocks; any other run writes its
  files under ``--out`` alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import unix
from bench.loads import run_load, time_to_first_result
from bench.plan import (
    BENCH_README,
    DEFAULT_OUT,
    DESIGNS,
    DEVICES_PAGE,
    FEATURES,
    HEAVIER,
    JAX_DESIGNS,
    LOADS,
    MAP_DESIGNS,
    REPO_ROOT,
    RESULTS_PAGE,
    STREAMS,
    Plan,
    active_designs,
    machine,
    rotated,
    step_name,
)
from bench.processes import client_env, use_unix_sockets
from bench.sections import (
    compute_ceiling,
    cpu_sections,
    devices_results,
    heavy_runs,
    lag_floor,
    run_devices_only,
    step_cost_section,
)
from bench.summary import summarise
from bench.tables import (
    devices_markdown,
    plot,
    report,
    results_markdown,
    write_devices_block,
    write_results_block,
    write_summary_block,
)


def targets(s: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value, the limit and whether it is met."""
    f, sp, io = s["forkless"], s["spawn"], s["io-ceiling"]
    out = []

    def add(name: str, value: float | None, limit: float | None, le: bool = True) -> None:
        met = None if value is None or limit is None else (value <= limit if le else value >= limit)
        out.append({"target": name, "value": value, "limit": limit, "met": met})

    def mul(a: float | None, k: float) -> float | None:
        return None if a is None else a * k

    for q in ("p50", "p99"):
        add(f"latency {q} @1k <= spawn", f["rate_1k"][q], sp["rate_1k"][q])
    add("latency p50 @10k <= spawn", f["rate_10k"]["p50"], sp["rate_10k"]["p50"])
    for q in ("p50", "p99"):
        add(f"latency {q} @1k <= 0.6 x spawn", f["rate_1k"][q], mul(sp["rate_1k"][q], 0.6))
        add(f"latency {q} @1k <= 1.5 x io-ceiling", f["rate_1k"][q], mul(io["rate_1k"][q], 1.5))
    add("throughput >= 2 x spawn", f["throughput_msg_s"], mul(sp["throughput_msg_s"], 2.0), le=False)
    add("throughput >= io-ceiling", f["throughput_msg_s"], io["throughput_msg_s"], le=False)
    add("IO-loop lag p99 @1k < 1 ms", f["loop_lag_ms_1k"]["p99"], 1.0)
    add("peak RSS <= 0.8 x spawn", f["peak_rss_mib"], mul(sp["peak_rss_mib"], 0.8))
    add("compilations after warm-up == 0", f["compilations_after_warmup"], 0)
    add("first result with a warm cache < 2 s", (f["first_result_s"] or {}).get("warm_s"), 2.0)
    inline = s.get("inline")
    if inline is not None:  # issue 23: against the peer written without a thread
        add("latency p50 @1k <= 1.1 x inline", f["rate_1k"]["p50"], mul(inline["rate_1k"]["p50"], 1.1))
        costs = (s.get("step_map") or {}).get("costs") or {}
        for ms in (1.0, 10.0):
            designs = (costs.get(step_name(ms)) or {}).get("designs") or {}
            add(f"max throughput with a ~{ms:g} ms step >= 1.3 x inline",
                (designs.get("forkless") or {}).get("throughput_msg_s"),
                mul((designs.get("inline") or {}).get("throughput_msg_s"), 1.3), le=False)
    return out


def run_all(plan: Plan, out: Path, command: str) -> dict[str, Any]:
    """Every section the plan has, in order; writes ``OUT/results.json`` (and ``devices.json``, ``bench.png``)."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="forkless-bench-") as tmp:
        work = Path(tmp)
        (work / "logs").mkdir()
        caches = compilation_caches(work, plan.startup_designs)
        startup = startup_section(plan, work, caches)
        print("ceilings:", flush=True)
        compute = compute_ceiling(plan, work, str(work / "jax-cache-compute"))
        floor = lag_floor(plan.lag_floor_s)
        runs = main_runs(plan, work, caches) + heavy_runs(plan, work, caches)
        steps = None
        if plan.step_cost:
            print(f"step cost: {', '.join(MAP_DESIGNS)} with the default step and ~"
                  f"{', ~'.join(f'{ms:g}' for ms in plan.step_costs_ms)} ms steps ({plan.step_duration_s:g} s runs; "
                  "at 1,000 msg/s with the ping probe, and at the window):", flush=True)
            steps_started = time.monotonic()
            steps = step_cost_section(plan, work, caches)
            steps["elapsed_s"] = round(time.monotonic() - steps_started, 1)
        cpu = None if plan.accelerator else cpu_sections(plan, work, caches)
        logs = out / "logs"
        shutil.rmtree(logs, ignore_errors=True)
        shutil.copytree(work / "logs", logs)
    summary = summarise(runs, startup, compute, floor, steps)
    results = {
        "command": command,
        "jax_platforms": client_env(None).get("JAX_PLATFORMS"),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "plan": plan.__dict__,
        "loadgen_settings": {"streams": STREAMS, "features": FEATURES, "loads": LOADS},
        "elapsed_s": round(time.monotonic() - started, 1),
        "summary": summary,
        "targets": targets(summary),
        "compute_ceiling": compute,
        "jax_device": (steps or {}).get("calibration", {}).get("device") or (compute.get("device_floor") or {}).get(
            "device"),
        "unix_sockets": unix.enabled(),
        "step_costs": steps,
        "runs": runs,
    }
    write_results(results, cpu, plan, out, command)
    return results


def compilation_caches(work: Path, startup_designs: tuple[str, ...]) -> dict[str, str]:
    """One persistent compilation cache per design with a start-up figure: empty for the cold
    start, then warm for the warm start and every later run (so no load run pays for, or
    measures, XLA). A design without one (the TPU plan's spawn and inline) takes forkless's,
    warm by then: the same step, so its first run does not compile it again, measuring nothing."""
    caches = {design: str(work / f"jax-cache-{design}") for design in DESIGNS}
    if "forkless" in startup_designs:
        caches.update({design: caches["forkless"] for design in JAX_DESIGNS if design not in startup_designs})
    # forkless-nojax has no start-up figure: it compiles what forkless does, so it takes
    # forkless's cache, warm once forkless's cold start is measured (its first run paid a
    # cold compile, ~7 s on 2 cores); a heavier step (the heavy runs, the step-cost section)
    # is the same program whichever design runs it: one cache for them all, so only the
    # first design to run it compiles it (~6 s each for the others, measuring nothing)
    caches["forkless-nojax"] = caches["forkless"]
    caches[HEAVIER] = str(work / "jax-cache-heavier-steps")
    return caches


def startup_section(plan: Plan, work: Path, caches: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Process start to first result, with an empty and then a warm compilation cache."""
    startup: dict[str, dict[str, Any]] = {}
    print("start-up (process start to first result):", flush=True)
    for design in plan.startup_designs:
        cold = time_to_first_result(design, caches[design], work, f"{design}-first-cold")
        warm = time_to_first_result(design, caches[design], work, f"{design}-first-warm")
        startup[design] = {"cold_s": cold, "warm_s": warm}
    return startup


def main_runs(plan: Plan, work: Path, caches: dict[str, str]) -> list[dict[str, Any]]:
    """The main table's runs: every design at every load, designs rotated between repeats."""
    print(f"loads ({plan.repeats} repeat(s), {plan.duration_s:g} s each, first {plan.warmup_s:g} s not counted):",
          flush=True)
    runs: list[dict[str, Any]] = []
    for rep in range(plan.repeats):
        for load in LOADS:
            for design in rotated(active_designs(), rep):
                runs.append(run_load(design, load, plan, work, caches[design], f"{design}-{load}-r{rep}"))
    return runs


def write_results(results: dict[str, Any], cpu: dict[str, Any] | None, plan: Plan, out: Path, command: str) -> None:
    """``OUT/results.json``; with the CPU's sections, ``OUT/devices.json``; ``OUT/bench.png`` where matplotlib is."""
    if cpu is not None:
        results["state_scaling"] = cpu["state_scaling"]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if cpu is not None:
        (out / "devices.json").write_text(json.dumps(devices_results(cpu["devices"], plan, command,
                                                                     cpu["devices_elapsed_s"]), indent=1))
    try:
        plot(results, out / "bench.png")
    except ImportError as exc:  # a host without matplotlib (the lent TPU host): the tables are the results
        print(f"no {out / 'bench.png'}: {exc}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description="Run the forkless benchmark.")
    p.add_argument("--quick", action="store_true", help="one short repeat of everything (a smoke run, ~2 min)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="where results.json and bench.png go")
    p.add_argument("--devices-only", action="store_true",
                   help="run only the devices section (1, 2, 4 forced CPU devices) into OUT/devices.json, and "
                        "rewrite bench/docs/devices.md's devices block from it")
    p.add_argument("--jetstream-only", action="store_true",
                   help="run only the JetStream section (a real nats-server; max throughput and latency at "
                        "1,000 msg/s beside the WebSocket feed's, the checkpoint stall) into OUT/jetstream.json")
    p.add_argument("--partitioned-only", action="store_true",
                   help="run only the partitioned-instances section (a real nats-server; throughput of 1, 2, 4 "
                        "instances, the rescale 2 -> 4 with 10^6 streams) into OUT/partitioned.json")
    p.add_argument("--accelerator", action="store_true",
                   help="the reduced plan for an accelerator (bench/gpu.sh): the designs and the step costs, one "
                        "repeat, no state scaling and no forced CPU devices; writes OUT/results.md, never this "
                        "repository's bench/README.md or bench/docs/")
    p.add_argument("--tpu", action="store_true",
                   help="the accelerator plan sized for the lent TPU host (bench/tpu.sh): every design at the three "
                        "loads, the compute ceiling and the device floor, forkless's start-up, in ~9 minutes; "
                        "writes OUT/results.md")
    p.add_argument("--unix", action="store_true",
                   help="every socket of the run a unix-domain one (also FORKLESS_BENCH_UNIX=1): the servers, the "
                        "load generator, the clients and forkless (FORKLESS_WS_UNIX_SOCKET); every process of the run "
                        "refuses TCP and UDP sockets, as the TPU host does")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: print the report of OUT/results.json and rewrite the results blocks of "
                        "bench/docs/last-run.md and bench/README.md from it")
    a = p.parse_args(argv)
    out = Path(a.out)
    # bench/README.md and bench/docs/ describe bench/out/results.json (tests/docs/test_docs.py holds them together)
    is_default_out = out.resolve() == DEFAULT_OUT.resolve()
    if a.report_only:
        results = json.loads((out / "results.json").read_text())
        print(report(results))
        if is_default_out:
            changed = write_results_block(results) | write_summary_block(results)
            print(f"\n{RESULTS_PAGE.relative_to(REPO_ROOT)} and {BENCH_README.relative_to(REPO_ROOT)}: "
                  f"{'rewritten' if changed else 'already up to date'}")
        return 0
    if a.tpu:
        plan = Plan.tpu(quick=a.quick)
    elif a.accelerator:
        plan = Plan.gpu(quick=a.quick)
    else:
        plan = Plan.quick() if a.quick else Plan.full()
    a.unix = a.unix or unix.enabled()
    command = ("python -m bench.run" + (" --tpu" if a.tpu else " --accelerator" if a.accelerator else "")
               + (" --unix" if a.unix else "") + (" --quick" if a.quick else ""))
    if a.unix:
        if not unix.product_takes_unix_socket():
            print("bench.run --unix: this checkout's forkless has no FORKLESS_WS_UNIX_SOCKET, so its designs cannot "
                  "reach a feed over a unix socket; run without --unix (and FORKLESS_BENCH_UNIX unset)",
                  file=sys.stderr)
            return 2
        sockets = use_unix_sockets()
        try:
            return run_and_report(a, plan, out, command, is_default_out)
        finally:
            shutil.rmtree(sockets, ignore_errors=True)
    return run_and_report(a, plan, out, command, is_default_out)


def run_and_report(a: argparse.Namespace, plan: Plan, out: Path, command: str, is_default_out: bool) -> int:
    """The run ``main`` chose, its report, and the files it writes."""
    if a.jetstream_only:
        from bench import jetstream  # it imports this module (and nats-py): only when asked for

        out.mkdir(parents=True, exist_ok=True)
        figures = {**jetstream.section(a.quick), "command": command + " --jetstream-only"}
        (out / "jetstream.json").write_text(json.dumps(figures, indent=1))
        print()
        print(jetstream.markdown(figures))
        return 0
    if a.partitioned_only:
        from bench import partitioned  # it imports this module (and nats-py): only when asked for

        out.mkdir(parents=True, exist_ok=True)
        figures = {**partitioned.section(a.quick), "command": command + " --partitioned-only"}
        (out / "partitioned.json").write_text(json.dumps(figures, indent=1))
        print()
        print(partitioned.markdown(figures))
        if not a.quick and is_default_out:
            partitioned.write_block(figures)
            print(f"rewrote the partitioned block of {partitioned.PAGE.relative_to(REPO_ROOT)}")
        return 0
    if a.devices_only:
        results = run_devices_only(plan, out, command + " --devices-only")
        print()
        print(devices_markdown(results))
        if not a.quick and is_default_out:
            write_devices_block(results)
            print(f"rewrote the devices block of {DEVICES_PAGE.relative_to(REPO_ROOT)}")
        return 0
    results = run_all(plan, out, command)
    print()
    print(report(results))
    print(f"\nwrote {out / 'results.json'}" + (f" and {out / 'bench.png'}" if (out / "bench.png").exists() else ""))
    if not is_default_out:  # the results block, for a run kept elsewhere (bench/gpu.sh, tpu.sh)
        (out / "results.md").write_text(results_markdown(results), encoding="utf-8")
        print(f"wrote {out / 'results.md'}")
    elif a.accelerator or a.tpu or a.unix:
        print("an --accelerator, --tpu or --unix run into bench/out does not rewrite bench/README.md or "
              "bench/docs/: keep it with --out")
    elif not a.quick:
        write_results_block(results)
        write_summary_block(results)
        write_devices_block(json.loads((out / "devices.json").read_text()))
        print(f"rewrote the results blocks of {RESULTS_PAGE.relative_to(REPO_ROOT)} and "
              f"{BENCH_README.relative_to(REPO_ROOT)}, and the devices block of {DEVICES_PAGE.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
