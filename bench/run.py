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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench import per_message, state_scaling, unix
from bench.loadgen import start_loadgen, wait_result
from bench.ping_probe import start_probe

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
DESIGNS = ("forkless", "spawn", "inline", "io-ceiling", "forkless-nojax")
# the designs that never step on a device: on an accelerator they run with JAX_PLATFORMS=cpu, so
# that they neither take the chip (one program at a time may hold a TPU) nor pay for opening it
HOST_DESIGNS = ("io-ceiling", "forkless-nojax")
JAX_DESIGNS = ("forkless", "spawn", "inline")
MAP_DESIGNS = ("forkless", "inline", "spawn")  # the designs measured at every step cost
HEAVIER = "heavier-steps"  # the compilation cache every design's heavier steps share (run_all)
DEFAULT_STEP = "default"
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
        run, tests/quick_bench.py, checks them all with it)."""
        if quick:
            return dataclasses.replace(cls.gpu(quick=True), floor_s=0.2)
        return dataclasses.replace(cls.gpu(), startup_designs=("forkless",), heavy_runs=False, step_cost=False,
                                   floor_s=1.0)


LOADS = {
    "rate_1k": ["--mode", "rate", "--rate", "1000"],
    "rate_10k": ["--mode", "rate", "--rate", "10000"],
    "window": ["--mode", "window"],
}
LOADS_RATE = {"rate_1k": 1000, "rate_10k": 10000}  # msg/s of the open-loop loads


# ---- the machine ---------------------------------------------------------------------------


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


# ---- processes ------------------------------------------------------------------------------


def unix_args(tag: str) -> list[str]:
    """A server's ``--unix-socket`` (bench.loadgen, bench.ping_probe) in a unix run, else nothing."""
    return ["--unix-socket", unix.new_socket_path(tag)] if unix.enabled() else []


def use_unix_sockets() -> str:
    """From now on every socket of this run is a unix one and no process of it may open an inet
    socket (``bench.unix``): this process's environment, inherited by everything it starts, and
    its own audit hook. Returns the run's socket folder (the caller removes it)."""
    folder = tempfile.mkdtemp(prefix="fkb-")
    os.environ.update(unix.child_env({**os.environ, unix.UNIX_ENV: "1", unix.SOCKET_DIR_ENV: folder}))
    unix.refuse_inet()
    return folder


def client_env(cache_dir: str | None) -> dict[str, str]:
    """The clients' environment: CPU JAX, and the persistent compilation cache if given."""
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        env.pop(name, None)
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        # JAX caches only compilations longer than 1 s by default; ours take ~0.2 s each
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
    return env


def client_cmd(design: str, url: str, figures: Path, heavy: bool = False, step: dict[str, Any] | None = None,
               probe_url: str | None = None, max_s: float | None = None) -> list[str]:
    """The design's command line; ``step``: a calibrated heavy step (``size``, ``iters``);
    ``probe_url``: a ``bench.ping_probe`` to connect to as well (forkless: a second feed);
    ``max_s``: the client's own backstop (``--max-s``, forkless and spawn) instead of its default."""
    if design == "io-ceiling":
        return [sys.executable, "-m", "bench.io_ceiling", "--url", url, "--features", str(FEATURES)]
    module = {"forkless": "bench.forkless_client", "forkless-nojax": "bench.forkless_client",
              "spawn": "bench.spawn_client", "inline": "bench.inline_client"}[design]
    extra = ["--heavy"] if heavy else []
    if step is not None:
        extra += ["--heavy-size", str(step["size"]), "--heavy-iters", str(step["iters"])]
    if max_s is not None and design in ("forkless", "forkless-nojax", "spawn"):
        extra += ["--max-s", f"{max_s:g}"]
    if probe_url and design.startswith("forkless"):
        url = json.dumps([url, probe_url])  # the probe is a second feed (FORKLESS_FEEDS)
    elif probe_url:
        extra += ["--probe-url", probe_url]
    return ([sys.executable, "-m", module, "--url", url, "--out", str(figures)] + extra
            + (["--no-jax"] if design == "forkless-nojax" else []))


class TreeSampler:
    """Peak summed RSS of a process and all its descendants, sampled every ``SAMPLE_S``; and
    their CPU time (user + system, every thread, summed over the processes), as a series of
    ``(perf_counter, seconds)`` for ``cpu_cores`` to read a window from."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_bytes = 0
        self.peak_processes: list[dict[str, Any]] = []
        self.max_processes = 0
        self.cpu_series: list[tuple[float, float]] = []
        self._cpu: dict[int, float] = {}  # pid -> its CPU seconds when last seen (kept once it has gone)
        self._procs: dict[int, psutil.Process] = {}  # the descendants seen, by pid
        self._proc_children = os.path.exists(f"/proc/{pid}/task/{pid}/children")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def _run(self) -> None:
        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.is_set():
            self.sample(root)
            self._stop.wait(SAMPLE_S)

    def sample(self, root: psutil.Process) -> None:
        try:
            procs = [root, *self._descendants(root)]
        except psutil.NoSuchProcess:
            return
        total = 0
        seen = []
        for p in procs:
            try:
                rss = p.memory_info().rss
                seen.append({"pid": p.pid, "rss_mib": round(rss / 2**20, 1), "cmd": _short_cmd(p)})
                cpu = p.cpu_times()
                self._cpu[p.pid] = cpu.user + cpu.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            total += rss
        self.cpu_series.append((time.perf_counter(), sum(self._cpu.values())))
        self.max_processes = max(self.max_processes, len(seen))
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_processes = seen

    def _descendants(self, root: psutil.Process) -> list[psutil.Process]:
        """Every process below ``root``. On Linux from each thread's ``/proc/PID/task/TID/children``
        (0.16 ms a sample of a JAX process, against 1.3 ms for psutil's ``children``, which reads
        every process of the machine: the sampler took ~5% of a core beside the run it measures);
        psutil's elsewhere."""
        if not self._proc_children:
            return root.children(recursive=True)
        found, todo = [], [root.pid]
        while todo:
            pid = todo.pop()
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                        kids = [int(k) for k in f.read().split()]
                except OSError:
                    continue
                todo += kids
                for kid in kids:
                    if kid not in self._procs:
                        try:
                            self._procs[kid] = psutil.Process(kid)
                        except psutil.NoSuchProcess:
                            continue
                    found.append(self._procs[kid])
        return found


def _short_cmd(p: psutil.Process) -> str:
    try:
        cmd = p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"
    text = " ".join(os.path.basename(c) if i == 0 else c for i, c in enumerate(cmd))
    if "resource_tracker" in text:
        return "python (multiprocessing resource tracker)"
    if "multiprocessing.spawn" in text or "spawn_main" in text:
        return "python (multiprocessing spawn child)"
    return text[:80]


def cpu_cores(series: list[tuple[float, float]], start: float, end: float) -> float | None:
    """CPU seconds per second (cores kept busy) between ``start`` and ``end`` (perf_counter),
    from a ``TreeSampler``'s series, read at the samples nearest inside the window. Where the
    samples inside span under half of it (a short window on a loaded machine, where the sampler
    thread waits its turn: a quick run's 0.4 s once had fewer than two), at the nearest samples
    around it instead, so the figure covers a little more than the window rather than being
    missing; None only with no sample on one side of it."""
    inside = [(t, c) for t, c in series if start <= t <= end]
    if len(inside) >= 2 and inside[-1][0] - inside[0][0] >= (end - start) / 2:
        first, last = inside[0], inside[-1]
    else:
        before = [(t, c) for t, c in series if t <= start]
        after = [(t, c) for t, c in series if t >= end]
        if not before or not after:
            return None
        first, last = before[-1], after[0]
    return (last[1] - first[1]) / (last[0] - first[0])


def stop_tree(proc: subprocess.Popen[Any], timeout: float) -> int | None:
    """Wait for ``proc``; past ``timeout`` SIGTERM it, then kill it and what it started."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    return None


# ---- one run ----------------------------------------------------------------------------------


def run_load(design: str, load: str, plan: Plan, work: Path, cache_dir: str, tag: str,
             heavy: bool = False, env: dict[str, str] | None = None, step: dict[str, Any] | None = None,
             probe: bool = False, duration_s: float | None = None) -> dict[str, Any]:
    """One design against one load-generator run; the loadgen RESULT plus the client's figures.

    ``step``: a calibrated heavy step (``size``, ``iters``, ``cost``); ``probe``: a
    ``bench.ping_probe`` pings the design over a second connection (its RESULT under ``"probe"``);
    ``duration_s``: instead of the plan's."""
    duration = plan.duration_s if duration_s is None else duration_s
    args = [*LOADS[load], "--duration", str(duration), "--warmup-s", str(plan.warmup_s),
            "--streams", str(STREAMS), "--features", str(FEATURES), "--host", "127.0.0.1", "--port", "0",
            *unix_args(tag)]
    if load == "window":
        args += ["--window", str(plan.window)]
    # the run ends once every message is answered (see DRAIN_S); the design connects once it has
    # compiled, which a loaded machine can take a minute over
    args += ["--drain-s", f"{DRAIN_S:g}", "--connect-timeout", f"{CONNECT_S:g}"]
    figures_path = work / f"{tag}.json"
    log_path = work / "logs" / f"{tag}.log"
    prober, probe_url, ping = None, None, None
    if probe:
        prober, probe_url = start_probe(["--duration", str(duration), "--warmup-s", str(plan.warmup_s),
                                         "--drain-s", f"{DRAIN_S:g}", "--connect-timeout", f"{CONNECT_S:g}",
                                         *unix_args(f"{tag}-probe")])
    loadgen, url = start_loadgen(args)
    started = time.perf_counter()
    try:
        with open(log_path, "w", encoding="utf-8") as log:
            client = subprocess.Popen(client_cmd(design, url, figures_path, heavy, step, probe_url,
                                                 max_s=CONNECT_S + duration + DRAIN_S + bound(60)), cwd=REPO_ROOT,
                                      env={**client_env(cache_dir), **host_only(design, plan), **(env or {})},
                                      stdout=log,
                                      stderr=subprocess.STDOUT)
            with TreeSampler(client.pid) as rss, TreeSampler(loadgen.pid) as generator:
                try:
                    result = wait_result(loadgen, timeout=CONNECT_S + duration + DRAIN_S + bound(30))
                    reported = time.perf_counter()
                    if prober is not None:
                        ping = wait_result(prober, timeout=DRAIN_S + bound(30))
                finally:
                    rc = stop_tree(client, bound(30))
    finally:
        if prober is not None and prober.poll() is None:
            prober.kill()
            prober.wait()
    figures = None
    if figures_path.exists():
        figures = json.loads(figures_path.read_text())
    # the measured window on this clock: the generator reports when its run (connect to the last
    # reply) ended, elapsed_s after it began; the CPU the design and the generator used in it
    begun = reported - float(result.get("elapsed_s") or 0.0)
    window = (begun + plan.warmup_s, begun + duration)
    client_cores = cpu_cores(rss.cpu_series, *window)
    answered_per_s = result.get("throughput_msg_s") if load == "window" else float(LOADS_RATE.get(load, 0))
    cpu = {"client_cores": client_cores, "loadgen_cores": cpu_cores(generator.cpu_series, *window),
           "client_us_per_msg": (client_cores / answered_per_s * 1e6) if client_cores and answered_per_s else None}
    sample = result.pop("latencies_ms_sample", None) or []
    run = {
        "design": design, "load": load, "heavy": heavy, "tag": tag, "feed": url,
        **({"step": step} if step is not None else {}), **({"probe": ping} if probe else {}),
        "wall_s": round(time.perf_counter() - started, 2),
        "client_rc": rc,
        "loadgen": result,
        "client": figures,
        "peak_rss_mib": round(rss.peak_bytes / 2**20, 1),
        "cpu": cpu,
        "processes": rss.max_processes,
        "peak_processes": rss.peak_processes,
        # a compact sketch of the latency distribution, for the plot
        "latency_quantiles_ms": (np.quantile(np.asarray(sample), np.linspace(0, 1, 501)).round(4).tolist()
                                 if sample else []),
    }
    lat = result.get("latency_ms") or result.get("rtt_ms") or {}
    pinged = f"  ping p99 {_fmt(((ping or {}).get('rtt_ms') or {}).get('p99'))} ms" if probe else ""
    print(f"  {tag:<28} sent {result.get('sent')} answered {result.get('answered')} "
          f"p50 {_fmt(lat.get('p50'))} p99 {_fmt(lat.get('p99'))} ms  "
          f"{_fmt(result.get('throughput_msg_s'), 0)} msg/s  rss {run['peak_rss_mib']} MiB{pinged}", flush=True)
    return run


def host_only(design: str, plan: Plan) -> dict[str, str]:
    """``JAX_PLATFORMS=cpu`` for a design that never steps on a device, in an accelerator's plan."""
    return {"JAX_PLATFORMS": "cpu"} if plan.accelerator and design in HOST_DESIGNS else {}


# ---- start-up: process start to first result --------------------------------------------------


class FirstResultFeed:
    """A one-connection feed in a background thread: sends a message every 2 ms until the
    first result comes back, notes when (``perf_counter``), then closes the connection."""

    def __init__(self) -> None:
        self.first_result_at: float | None = None
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="first-result-feed", daemon=True)

    def start(self) -> str:
        self._thread.start()
        self._ready.wait(10)
        return self.url

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop_event.set)
        self._thread.join(10)

    def _run(self) -> None:
        self._loop.run_until_complete(self._main())
        self._loop.close()

    async def _main(self) -> None:
        from aiohttp import WSMsgType, web

        self._stop_event = asyncio.Event()

        async def handle(request: web.Request) -> web.WebSocketResponse:
            ws = web.WebSocketResponse()
            await ws.prepare(request)

            async def send() -> None:
                seq = 0
                while not ws.closed:
                    await ws.send_str(json.dumps({"seq": seq, "stream": "s0", "x": [0.5] * FEATURES}))
                    seq += 1
                    await asyncio.sleep(0.002)

            sender = asyncio.create_task(send())
            try:
                async for msg in ws:
                    if msg.type is WSMsgType.TEXT and '"z"' in msg.data:
                        self.first_result_at = time.perf_counter()
                        self._done.set()
                        break
            finally:
                sender.cancel()
                await asyncio.gather(sender, return_exceptions=True)
                await ws.close()
            return ws

        app = web.Application()
        app.router.add_get("/", handle)
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        self.url = await unix.start_site(runner, "127.0.0.1", unix.new_socket_path("first-result")
                                         if unix.enabled() else None)
        self._ready.set()
        await self._stop_event.wait()
        await runner.cleanup()


def time_to_first_result(design: str, cache_dir: str, work: Path, tag: str) -> float | None:
    """Seconds from starting the design's process to its first result on the feed.

    forkless is started exactly as a user starts it: ``python app.py`` with FORKLESS_WS_URL.
    """
    feed = FirstResultFeed()
    url = feed.start()
    env = client_env(cache_dir)
    if design == "forkless":
        env.update(unix.forkless_env(url), FORKLESS_SHUTDOWN_TIMEOUT_S="3")
        cmd = [sys.executable, "app.py"]
    else:
        cmd = client_cmd(design, url, work / f"{tag}.json")
    with open(work / "logs" / f"{tag}.log", "w", encoding="utf-8") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            feed.wait(bound(60))
        finally:
            if proc.poll() is None and design == "forkless":
                proc.send_signal(signal.SIGTERM)  # the orderly stop a user gets with Ctrl-C
            stop_tree(proc, bound(15))
            feed.close()
    if feed.first_result_at is None:
        return None
    seconds = feed.first_result_at - started
    print(f"  {tag:<28} first result after {seconds:.2f} s", flush=True)
    return round(seconds, 3)


# ---- the two ceilings that are not designs -----------------------------------------------------


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
            "app_max_msg_s": _median([r["loadgen"].get("throughput_msg_s") for r in got["runs"]]),
            "app_max_msg_s_runs": [r["loadgen"].get("throughput_msg_s") for r in got["runs"]],
            "batch_size_mean": _median([c.get("batch_size_mean") for c in clients]),
            "device_fill": _median([c.get("device_fill") for c in clients]),
            "compilations_after_warmup": max((c.get("compilations_after_warmup") or 0 for c in clients), default=None),
            "answered_all": all(r["loadgen"].get("sent") == r["loadgen"].get("answered") for r in got["runs"]),
        }
    one, most = rows[str(DEVICE_COUNTS[0])]["app_max_msg_s"], rows[str(DEVICE_COUNTS[-1])]["app_max_msg_s"]
    return {"counts": list(DEVICE_COUNTS), "by_devices": rows,
            "app_ratio_most_vs_one": most / one if one and most else None}


# ---- step cost: forkless, inline and spawn with heavier steps --------------------------------


def step_name(ms: float) -> str:
    """The key of a calibrated step cost: ``1ms``, ``10ms``."""
    return f"{ms:g}ms"


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


def summarise_steps(section: dict[str, Any], summary: dict[str, Any],
                    main_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step cost and design: medians over the repeats of p50/p99 at 1,000 msg/s, the ping
    round trip, the step time the design saw, the maximum throughput and the CPU used at it
    (the default step's from the main table's window runs); and forkless's ratios to inline."""
    calibration = section["calibration"]
    by_target = {step_name(t["target_ms"]): t for t in calibration["targets"]}
    out: dict[str, Any] = {"size": calibration["size"], "platform": calibration.get("platform"),
                           "device": calibration.get("device"), "costs": {}}
    for cost in (DEFAULT_STEP, *section["steps"]):
        target = by_target.get(cost, {})
        row: dict[str, Any] = {"target_ms": target.get("target_ms"), "iters": target.get("iters"),
                               "calibrated_step_ms": target.get("step_ms"),
                               "calibrated_step_ms_full": target.get("step_ms_full"), "designs": {}}
        for design in MAP_DESIGNS:
            mine = [r for r in section["runs"] if r["design"] == design and r["cost"] == cost]
            rate = [r for r in mine if r["load"] == "rate_1k"]
            window = [r for r in mine if r["load"] == "window"]
            main = summary.get(design) or {}
            cpu_runs = window or ([r for r in main_runs if r["design"] == design and r["load"] == "window"
                                   and not r["heavy"]] if cost == DEFAULT_STEP else [])
            if rate:
                latency = {q: _median([(r["loadgen"].get("latency_ms") or {}).get(q) for r in rate])
                           for q in ("p50", "p99", "p999")}
            else:  # no ping runs at the default step (--quick): the main table's latencies
                latency = dict(main.get("rate_1k") or {})
            pings = [(r.get("probe") or {}) for r in rate]
            row["designs"][design] = {
                "rate_1k": latency,
                "throughput_msg_s": (_median([r["loadgen"].get("throughput_msg_s") for r in window]) if window
                                     else main.get("throughput_msg_s") if cost == DEFAULT_STEP else None),
                "ping_ms": {q: _median([(p.get("rtt_ms") or {}).get(q) for p in pings]) for q in ("p50", "p99", "max")},
                "pings": sum(p.get("pings") or 0 for p in pings),
                "pings_lost": sum(p.get("lost") or 0 for p in pings),
                "step_ms_mean": _median([(r["client"] or {}).get("step_ms_mean") for r in mine]),
                "batch_size_mean_1k": _median([(r["client"] or {}).get("batch_size_mean") for r in rate]),
                "batch_size_mean_window": _median([(r["client"] or {}).get("batch_size_mean") for r in cpu_runs]),
                # at the maximum throughput: cores the design and the generator kept busy, the design's CPU a message
                "cpu_window": {k: _median([(r.get("cpu") or {}).get(k) for r in cpu_runs])
                               for k in ("client_cores", "loadgen_cores", "client_us_per_msg")},
                # at the maximum throughput: pipelining (forkless only: its IO thread against its steps)
                "overlap_window": _median_overlap(cpu_runs),
                "answered_all": all(r["loadgen"].get("sent") == r["loadgen"].get("answered") for r in mine),
                "runs": len(mine),
            }
        f, i = row["designs"]["forkless"], row["designs"]["inline"]

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a and b else None

        # forkless's throughput over inline's in each repeat (the two ran minutes apart at most):
        # the spread says how far the machine's other work moved the ratio of the medians
        windows = [r for r in section["runs"] if r["cost"] == cost and r["load"] == "window"] or (
            [r for r in main_runs if r["load"] == "window" and not r["heavy"]] if cost == DEFAULT_STEP else [])
        by_repeat: dict[str, dict[str, float]] = {}
        for r in windows:
            by_repeat.setdefault(r["tag"].rsplit("-r", 1)[-1], {})[r["design"]] = r["loadgen"].get("throughput_msg_s")
        row["forkless_vs_inline"] = {
            "p50_1k": ratio(f["rate_1k"].get("p50"), i["rate_1k"].get("p50")),
            "p99_1k": ratio(f["rate_1k"].get("p99"), i["rate_1k"].get("p99")),
            "throughput": ratio(f["throughput_msg_s"], i["throughput_msg_s"]),
            "throughput_by_repeat": [ratio(pair.get("forkless"), pair.get("inline"))
                                     for _, pair in sorted(by_repeat.items())],
            "ping_p99": ratio(f["ping_ms"]["p99"], i["ping_ms"]["p99"]),
        }
        out["costs"][cost] = row
    return out


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


# ---- summary, targets, table, plot ------------------------------------------------------------


def _median(values: list[Any]) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float)) and not math.isnan(v)]
    return statistics.median(vals) if vals else None


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and digits == 0:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def summarise(runs: list[dict[str, Any]], startup: dict[str, Any], compute: dict[str, Any],
              floor: dict[str, Any], steps: dict[str, Any] | None = None) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for design in DESIGNS:
        mine = [r for r in runs if r["design"] == design and not r["heavy"]]
        row: dict[str, Any] = {}
        for load in ("rate_1k", "rate_10k"):
            lats = [r["loadgen"].get("latency_ms") or {} for r in mine if r["load"] == load]
            row[load] = {q: _median([lat.get(q) for lat in lats]) for q in ("p50", "p99", "p999")}
        row["throughput_msg_s"] = _median([r["loadgen"].get("throughput_msg_s") for r in mine if r["load"] == "window"])
        row["peak_rss_mib"] = max((r["peak_rss_mib"] for r in mine), default=None)
        row["processes"] = max((r["processes"] for r in mine), default=None)
        if design != "io-ceiling":  # the latency budget: median over the repeats of each hop's quantiles
            row["hops_us"] = {load: _median_hops([(r["client"] or {}).get("hops_us") or {} for r in mine
                                                  if r["load"] == load]) for load in ("rate_1k", "rate_10k")}
            row["overlap"] = {load: _median_overlap([r for r in mine if r["load"] == load]) for load in LOADS}
        row["peak_processes"] = max(mine, key=lambda r: r["peak_rss_mib"])["peak_processes"] if mine else []
        row["cpu_us_per_msg"] = {load: cpu_per_message([r for r in mine if r["load"] == load]) for load in LOADS}
        if design in JAX_DESIGNS:
            lags = [(r["client"] or {}).get("loop_lag_ms") or {} for r in mine if r["load"] == "rate_1k"]
            row["loop_lag_ms_1k"] = {q: _median([lag.get(q) for lag in lags]) for q in ("p50", "p99")}
            heavy = [r for r in runs if r["design"] == design and r["heavy"]]
            hl = [(r["client"] or {}).get("loop_lag_ms") or {} for r in heavy]
            row["loop_lag_ms_heavy"] = {q: _median([lag.get(q) for lag in hl]) for q in ("p50", "p99")}
            row["heavy_latency_ms"] = {q: _median([(r["loadgen"].get("latency_ms") or {}).get(q) for r in heavy])
                                       for q in ("p50", "p99")}
            row["heavy_step_ms"] = _median([(r["client"] or {}).get("step_ms_mean") for r in heavy])
            after = [(r["client"] or {}).get("compilations_after_warmup") for r in runs if r["design"] == design]
            row["compilations_after_warmup"] = max((a for a in after if a is not None), default=None)
            row["first_result_s"] = startup.get(design, {})
        summary[design] = row
    summary["compute-ceiling"] = {"throughput_msg_s": compute.get("throughput_msg_s")}
    if compute.get("device_floor"):
        summary["device_floor"] = compute["device_floor"]
    summary["idle_loop_lag_ms"] = floor
    if steps is not None:
        summary["step_map"] = summarise_steps(steps, summary, runs)
    return summary


def cpu_per_message(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Medians over ``runs`` of the CPU µs a message: the design's whole process tree (sampled by
    ``TreeSampler``), and forkless's IO thread and main thread apart (its own clocks of them)."""
    own = [((r.get("client") or {}).get("cpu_us_per_msg") or {}) for r in runs]
    return {"process": _median([r["cpu"].get("client_us_per_msg") for r in runs]),
            "io_thread": _median([o.get("io_thread") for o in own]),
            "main_thread": _median([o.get("main_thread") for o in own])}


OVERLAP = ("io_cpu_in_steps_share", "io_busy_in_steps", "steps_wall_share", "io_cores")


def _median_overlap(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Medians over ``runs`` of the client's pipelining figures (``bench.forkless_client.overlap``);
    empty for a design that has none."""
    each = [(r.get("client") or {}).get("overlap") or {} for r in runs]
    return {k: _median([o.get(k) for o in each]) for k in OVERLAP} if any(each) else {}


def _median_hops(per_run: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    hops = [hop for hop in (per_run[0] if per_run else {})]
    return {hop: {q: _median([run.get(hop, {}).get(q) for run in per_run]) for q in ("p50", "p99")} for hop in hops}


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


def table(s: dict[str, Any]) -> str:
    head = ["design", "p50@1k", "p99@1k", "p99.9@1k", "p50@10k", "p99@10k", "p99.9@10k", "max msg/s",
            "peak RSS MiB", "lag p50/p99 ms", "lag p99 heavy", "compiles", "1st result cold/warm s"]
    rows = [head]
    for design in (*DESIGNS, "compute-ceiling"):
        if design not in s:  # a design this stored run did not have
            continue
        r = s[design]
        if design == "compute-ceiling":
            rows.append([design, *["-"] * 6, _fmt(r["throughput_msg_s"], 0), *["-"] * 5])
            continue
        lag = r.get("loop_lag_ms_1k")
        heavy = r.get("loop_lag_ms_heavy")
        first = r.get("first_result_s") or {}
        rows.append([
            design,
            *(_fmt(r[load][q]) for load in ("rate_1k", "rate_10k") for q in ("p50", "p99", "p999")),
            _fmt(r["throughput_msg_s"], 0),
            _fmt(r["peak_rss_mib"], 0) + (f" ({r['processes']}p)" if r.get("processes") else ""),
            f"{_fmt(lag['p50'])}/{_fmt(lag['p99'])}" if lag else "-",
            _fmt(heavy["p99"]) if heavy else "-",
            _fmt(r.get("compilations_after_warmup")) if design in JAX_DESIGNS else "-",
            f"{_fmt(first.get('cold_s'))}/{_fmt(first.get('warm_s'))}" if first else "-",
        ])
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = [" | ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"forkless": "tab:blue", "spawn": "tab:orange", "io-ceiling": "tab:green", "compute-ceiling": "tab:gray",
               "forkless-nojax": "tab:purple", "inline": "tab:red"}
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for ax, load, title in ((axes[0], "rate_1k", "1,000 msg/s"), (axes[1], "rate_10k", "10,000 msg/s")):
        for design in DESIGNS:
            qs = [np.asarray(r["latency_quantiles_ms"]) for r in results["runs"]
                  if r["design"] == design and r["load"] == load and not r["heavy"] and r["latency_quantiles_ms"]]
            if not qs:
                continue
            lat = np.sort(np.concatenate(qs))
            cdf = np.linspace(0, 1, len(lat))
            ax.plot(lat, cdf, label=design, color=colours[design])
        ax.set_xscale("log")
        ax.set_xlabel("latency from due time (ms, log)")
        ax.set_ylabel("fraction of messages")
        ax.set_title(f"latency distribution at {title}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    names = [n for n in (*DESIGNS, "compute-ceiling") if n in results["summary"]]
    values = [results["summary"][n]["throughput_msg_s"] or 0 for n in names]
    bars = axes[2].bar(names, values, color=[colours[n] for n in names])
    axes[2].set_yscale("log")
    axes[2].set_ylabel("messages per second (log)")
    axes[2].set_title(f"max throughput (window {results['plan']['window']} in flight)")
    for bar, v in zip(bars, values):
        axes[2].annotate(f"{v:,.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=9)
    m = results["machine"]
    fig.suptitle(f"forkless benchmark · {results['date']} · {m['cpu']}, {m['cores']} cores · "
                 f"Python {m['python']}, jax {m['jax']} · `{results['command']}`", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the whole run ---------------------------------------------------------------------------


def rotated(items: tuple[str, ...], k: int) -> Iterator[str]:
    k %= len(items)
    yield from items[k:] + items[:k]


def run_all(plan: Plan, out: Path, command: str) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="forkless-bench-") as tmp:
        work = Path(tmp)
        (work / "logs").mkdir()
        # one persistent compilation cache per design: empty for the cold start, then warm for
        # the warm start and every later run (so no load run pays for, or measures, XLA)
        caches = {design: str(work / f"jax-cache-{design}") for design in DESIGNS}
        # forkless-nojax has no start-up figure: it compiles what forkless does, so it takes
        # forkless's cache, warm once forkless's cold start is measured (its first run paid a
        # cold compile, ~7 s on 2 cores); a heavier step (the heavy runs, the step-cost section)
        # is the same program whichever design runs it: one cache for them all, so only the
        # first design to run it compiles it (~6 s each for the others, measuring nothing)
        caches["forkless-nojax"] = caches["forkless"]
        caches[HEAVIER] = str(work / "jax-cache-heavier-steps")
        runs: list[dict[str, Any]] = []
        startup: dict[str, dict[str, Any]] = {}
        print("start-up (process start to first result):", flush=True)
        for design in plan.startup_designs:
            cold = time_to_first_result(design, caches[design], work, f"{design}-first-cold")
            warm = time_to_first_result(design, caches[design], work, f"{design}-first-warm")
            startup[design] = {"cold_s": cold, "warm_s": warm}
        print("ceilings:", flush=True)
        compute = compute_ceiling(plan, work, str(work / "jax-cache-compute"))
        floor = lag_floor(plan.lag_floor_s)
        print(f"loads ({plan.repeats} repeat(s), {plan.duration_s:g} s each, first {plan.warmup_s:g} s not counted):",
              flush=True)
        for rep in range(plan.repeats):
            for load in LOADS:
                for design in rotated(DESIGNS, rep):
                    runs.append(run_load(design, load, plan, work, caches[design], f"{design}-{load}-r{rep}"))
        runs += heavy_runs(plan, work, caches)
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
    return results


def heavy_runs(plan: Plan, work: Path, caches: dict[str, str]) -> list[dict[str, Any]]:
    """forkless, spawn and inline at 1,000 msg/s with the heavy step (the IO loop's lag while a
    long step runs), where the plan has them."""
    if not plan.heavy_runs:
        return []
    print("heavy step at 1,000 msg/s:", flush=True)
    # size 0: bench.heavy's HEAVY_SIZE (bench.run imports no JAX)
    lighter = None if plan.heavy_iters is None else {"size": 0, "iters": plan.heavy_iters}
    return [run_load(design, "rate_1k", plan, work, caches[HEAVIER], f"{design}-heavy", heavy=True, step=lighter)
            for design in JAX_DESIGNS]


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
    app_1k = {str(size): {q: _median([(r["loadgen"].get("latency_ms") or {}).get(q) for r in rs])
                          for q in ("p50", "p99")} for size, rs in table_runs.items()}
    return {"state_scaling": {**scaling, "app_1k": app_1k}, "devices": section,
            "devices_elapsed_s": time.monotonic() - devices_started,
            "table_runs": {str(size): rs for size, rs in table_runs.items()}}


def report(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"{results['date']} · {m['cpu']} · {m['cores']} cores · Python {m['python']} · jax {m['jax']} · "
        f"{results['elapsed_s']} s",
        "latency in ms from the due time (medians over repeats); max msg/s with a bounded window;",
        "lag = IO-loop lag during traffic at 1,000 msg/s (heavy: with a "
        f"{'~100 ms' if results['plan'].get('heavy_iters') is None else 'lighter (smoke size)'} step); "
        f"idle-loop lag floor here p50 {results['summary']['idle_loop_lag_ms']['p50']:.2f} "
        f"p99 {results['summary']['idle_loop_lag_ms']['p99']:.2f} ms",
        "",
        table(results["summary"]),
        "",
        "targets:",
    ]
    for t in results["targets"]:
        mark = {True: "met   ", False: "MISSED", None: "n/a   "}[t["met"]]
        lines.append(f"  {mark} {t['target']}: {_fmt(t['value'])} (limit {_fmt(t['limit'])})")
    lines += ["", "step cost:", step_map_markdown(results), "", "latency budget (per hop, µs):",
              hops_markdown(results), "", "CPU per message and the device's floor:", per_message.markdown(results)]
    return "\n".join(lines)


# ---- the results blocks of bench/docs/last-run.md and bench/README.md ---------------------------


def _md(v: Any, digits: int = 2) -> str:
    """A figure for the Markdown table: en dash when absent, thousands separated from 1,000 up."""
    if v is None:
        return "–"
    if isinstance(v, float) and abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _send_lag_p50_ms(results: dict[str, Any]) -> float | None:
    """Median over the 1,000 msg/s runs of the load generator's own p50 lateness (send - due)."""
    return _median([(r["loadgen"].get("send_lag_ms") or {}).get("p50") for r in results["runs"]
                    if r["load"] == "rate_1k" and not r["heavy"]])


def state_scaling_markdown(results: dict[str, Any]) -> str:
    """The "state scaling" part of the report (step time, ceiling, memory, app latency by table size)."""
    scaling = results.get("state_scaling")
    if not scaling:
        return "(this run has no state-scaling section)"
    app = scaling.get("app_1k", {})
    lines = [state_scaling.table(scaling), "",
             "The app at 1,000 msg/s (forkless as users run it, 16 streams) by table size, medians, ms:", "",
             "| FORKLESS_MAX_STREAMS | p50 | p99 |", "|---|---|---|"]
    for size, lat in app.items():
        lines.append(f"| {int(size):,} | {_md(lat['p50'])} | {_md(lat['p99'])} |")
    return "\n".join(lines)


def _verdict(ratios: dict[str, float | None]) -> str:
    """Forkless against inline at one step cost, in words (10% either way counts as level)."""
    parts = []
    tp, p50, ping = ratios.get("throughput"), ratios.get("p50_1k"), ratios.get("ping_p99")
    if tp is not None:
        parts.append(f"forkless {tp:.2f}x inline's max throughput" if tp >= 1.1 else
                     f"inline {1 / tp:.2f}x forkless's max throughput" if tp <= 1 / 1.1 else
                     f"level on max throughput ({tp:.2f}x)")
    if p50 is not None:
        parts.append(f"inline's p50 @1k {p50:.2f}x lower" if p50 >= 1.1 else
                     f"forkless's p50 @1k {1 / p50:.2f}x lower" if p50 <= 1 / 1.1 else f"level on p50 @1k ({p50:.2f}x)")
    if ping is not None:
        parts.append(f"a ping waits {1 / ping:.1f}x longer in inline (p99)" if ping <= 1 / 1.1 else
                     f"a ping waits {ping:.1f}x longer in forkless (p99)" if ping >= 1.1 else "pings level")
    return "; ".join(parts) if parts else "–"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.0f}%"


def _overlap_cell(o: dict[str, float | None] | None) -> str:
    """Pipelining in one cell: the share of the IO thread's CPU time that fell in steps, the
    steps' share of the wall time, and the IO thread's cores while the main thread stepped."""
    if not o:
        return "–"
    return (f"{_pct(o.get('io_cpu_in_steps_share'))} · {_pct(o.get('steps_wall_share'))} · "
            f"{_md(o.get('io_busy_in_steps'))}")


def step_map_markdown(results: dict[str, Any]) -> str:
    """The "step cost" part of the report: forkless, inline and spawn at each step cost, and
    forkless against inline in words (``summary["step_map"]``, ``summarise_steps``)."""
    steps = results["summary"].get("step_map")
    if not steps:
        return "(this run has no step-cost section)"
    plan = results["plan"]
    section = results.get("step_costs") or {}
    costs = steps["costs"]
    heavy = [c for c in costs if c != DEFAULT_STEP]
    iters = ", ".join(f"{costs[c]['iters']} for ~{costs[c]['target_ms']:g} ms" for c in heavy)
    lines = [
        f"The step made heavier with `bench/heavy.py` ({steps['size']}x{steps['size']} matmuls a step: {iters}), "
        f"calibrated on this machine at the start of the section (`bench/step_cost.py`; "
        f"{section.get('elapsed_s', '–')} s for the whole section). Medians over {plan['repeats']} repeat(s) of "
        f"{plan.get('step_duration_s', plan['duration_s']):g} s (the first {plan['warmup_s']:g} s not counted), "
        "designs rotated. Latency at 1,000 msg/s, in ms from the due time, with the ping probe's connection open; "
        "ping: round trip of a WebSocket ping sent every ~5 ms on a second connection served by the loop that "
        "answers the feed (`bench/ping_probe.py`), ms; max msg/s with "
        f"{plan['window']:,} in flight (the default step's from the table above). Step ms: the calibration's "
        "`Engine.step` of one message / of a full batch, and the mean step each design saw. Pipelining (forkless "
        "only; inline has one thread): of its IO thread's CPU time, the share that fell while the main thread was "
        "inside a step (its CPU clock read around each step), beside the share of the time the main thread spent "
        "in steps (what the first would be if the IO thread's work ignored the steps), and the IO thread's CPU "
        "seconds per second of step.",
        "",
        "| step | step ms: calibrated (1 / full) | design | step ms seen | mean batch @1k | p50 @1k | p99 @1k "
        "| max msg/s | at max: mean batch · CPU µs a msg · cores design / generator "
        "| at max: IO thread's CPU in steps · main thread in steps · IO cores while stepping "
        "| ping p50 / p99 | pings lost |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cost, row in costs.items():
        name = "default detector" if cost == DEFAULT_STEP else f"~{row['target_ms']:g} ms"
        calibrated = ("–" if row["calibrated_step_ms"] is None else
                      f"{_md(row['calibrated_step_ms'])} / {_md(row['calibrated_step_ms_full'])}")
        for design, d in row["designs"].items():
            ping, cpu = d["ping_ms"], d.get("cpu_window") or {}
            at_max = (f"{_md(d.get('batch_size_mean_window'), 0)} · {_md(cpu.get('client_us_per_msg'), 1)} · "
                      f"{_md(cpu.get('client_cores'))} / {_md(cpu.get('loadgen_cores'))}")
            lines.append(f"| {name} | {calibrated} | {design} | {_md(d['step_ms_mean'])} "
                         f"| {_md(d['batch_size_mean_1k'], 1)} | {_md(d['rate_1k'].get('p50'))} "
                         f"| {_md(d['rate_1k'].get('p99'))} | {_md(d['throughput_msg_s'])} | {at_max} "
                         f"| {_overlap_cell(d.get('overlap_window'))} "
                         f"| {_md(ping['p50'])} / {_md(ping['p99'])} | {d['pings_lost'] if d['pings'] else '–'} |")
    lines += ["", "Forkless against inline, by step cost (ratios of the medians above):", "",
              "| step | forkless / inline: p50 @1k | p99 @1k | max msg/s (each repeat's) | ping p99 | in words |",
              "|---|---|---|---|---|---|"]
    for cost, row in costs.items():
        name = "default detector" if cost == DEFAULT_STEP else f"~{row['target_ms']:g} ms"
        r = row["forkless_vs_inline"]
        each = ", ".join(_md(v) for v in r.get("throughput_by_repeat") or [])
        lines.append(f"| {name} | {_md(r['p50_1k'])} | {_md(r['p99_1k'])} | {_md(r['throughput'])} ({each}) "
                     f"| {_md(r['ping_p99'])} | {_verdict(r)} |")
    return "\n".join(lines)


def devices_markdown(results: dict[str, Any]) -> str:
    """The devices block of bench/docs/devices.md for one ``devices.json`` (``devices_section`` and its run)."""
    m, plan, section = results["machine"], results["plan"], results["devices"]
    when = datetime.datetime.fromisoformat(results["date"]).astimezone(datetime.UTC)
    lines = [
        f"Run of {when:%Y-%m-%d %H:%M} UTC: `{results['command']}` with `JAX_PLATFORMS="
        f"{results.get('jax_platforms') or 'cpu'}` and `JAX_NUM_CPU_DEVICES` 1, 2, 4, {results['elapsed_s']:.0f} s "
        f"in all, on {m['cpu']}, {m['cores']} cores. Step alone: full batches of "
        f"{section['by_devices'][str(section['counts'][0])]['batch_size']}, {plan['compute_s']:g} s each; app: "
        f"forkless, medians over {plan['repeats']} repeat(s) of {plan['duration_s']:g} s with {plan['window']:,} "
        f"messages in flight, {results['loadgen_settings']['streams']} streams.",
        "",
        "| devices | step alone msg/s | step ms a batch | host routing µs a batch | app max msg/s "
        "| app vs 1 device | mean batch | per-device batch fill | compiles after warm-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    one = section["by_devices"][str(section["counts"][0])]["app_max_msg_s"]
    for n in section["counts"]:
        r = section["by_devices"][str(n)]
        ratio = r["app_max_msg_s"] / one if one and r["app_max_msg_s"] else None
        fill = "–" if r["device_fill"] is None else f"{100 * r['device_fill']:.0f}%"
        lines.append(f"| {n} | {_md(r['compute_msg_s'])} | {_md(r['step_ms'])} | {_md(r['host_routing_us'], 1)} "
                     f"| {_md(r['app_max_msg_s'])} | {_md(ratio)} | {_md(r['batch_size_mean'], 1)} | {fill} "
                     f"| {_md(r['compilations_after_warmup'])} |")
    return "\n".join(lines) + "\n"


def write_devices_block(results: dict[str, Any], page: Path = DEVICES_PAGE) -> bool:
    """Put ``devices_markdown(results)`` between the devices markers of ``page``; True if it changed."""
    return _write_block(page, DEVICES_BLOCK, devices_markdown(results))


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


def hops_markdown(results: dict[str, Any]) -> str:
    """Per hop, p50/p99 in µs at 1k and 10k msg/s, for forkless, forkless-nojax (the same path
    with a host identity for the step) and spawn (the same stamps: its inbound and outbound
    hops are the multiprocessing queues, pickling included), from the sampled messages."""
    s = results["summary"]
    designs = [d for d in ("forkless", "forkless-nojax", "spawn") if (s.get(d) or {}).get("hops_us")]
    if not designs:
        return "(not measured in this run)"
    head = "| hop | " + " | ".join(f"{d} {q} @{load}" for d in designs for load in ("1k", "10k")
                                    for q in ("p50", "p99")) + " |"
    lines = ["One message in 64 carries stamps (`controller/batching.py`, `HOPS`); µs, medians over the "
             "repeats of each run's quantile. `step` is pad + run + outputs to the host.", "",
             head, "|---" * (1 + 4 * len(designs)) + "|"]
    hops = list(s[designs[0]]["hops_us"]["rate_1k"])
    for hop in hops:
        cells = [_md((s[d]["hops_us"][load].get(hop) or {}).get(q), 0) for d in designs
                 for load in ("rate_1k", "rate_10k") for q in ("p50", "p99")]
        lines.append(f"| {hop} | " + " | ".join(cells) + " |")
    overlap = (s.get("forkless") or {}).get("overlap") or {}
    if any(overlap.values()):
        lines += ["", "Pipelining, forkless with the default step (medians over the repeats; the step-cost table "
                  "has it at the heavier steps): of the IO thread's CPU time, the share that fell while the main "
                  "thread was inside a step, beside the main thread's share of the time in steps; the IO "
                  "thread's CPU in cores, over the run and while the main thread stepped.", "",
                  "| load | IO thread's CPU in steps | main thread in steps | IO thread, cores | IO cores while "
                  "stepping |", "|---|---|---|---|---|"]
        for load, name in (("rate_1k", "1,000 msg/s"), ("rate_10k", "10,000 msg/s"), ("window", "max throughput")):
            o = overlap.get(load) or {}
            lines.append(f"| {name} | {_pct(o.get('io_cpu_in_steps_share'))} | {_pct(o.get('steps_wall_share'))} "
                         f"| {_md(o.get('io_cores'))} | {_md(o.get('io_busy_in_steps'))} |")
    return "\n".join(lines)


def summary_markdown(results: dict[str, Any]) -> str:
    """bench/README.md's block: when, where and the main table of one ``results.json`` (the first
    part of ``results_markdown``)."""
    return "\n".join(_main_table(results)) + "\n"


def results_markdown(results: dict[str, Any]) -> str:
    """The measured part of bench/docs/last-run.md for one ``results.json``: when, where, the
    table, the targets, and the sections' tables.

    Everything here comes from ``results``; the hand-written text around the block must not
    quote its figures. ``write_results_block`` puts it between the block's markers.
    """
    s = results["summary"]
    lines = _main_table(results)
    floor = s.get("idle_loop_lag_ms") or {}
    compute = results.get("compute_ceiling") or {}
    heavy_step = s["forkless"].get("heavy_step_ms")
    lines += [
        "",
        f"On this machine in this run: the load generator's own send lag at 1,000 msg/s, p50 "
        f"{_md(_send_lag_p50_ms(results))} ms (part of every latency above, the same for every design); "
        f"an idle asyncio loop's lag, p50 {_md(floor.get('p50'))} / p99 {_md(floor.get('p99'))} ms; "
        f"the heavy step (`bench/heavy.py`) {_md(heavy_step, 0)} ms a batch on average in forkless; "
        f"the compute ceiling's step {_md(compute.get('step_ms_mean'))} ms a batch of "
        f"{compute.get('batch_size', '–')}.",
        "",
        "| target (`targets()` in `bench/run.py`) | forkless | limit | judged on this run |",
        "|---|---|---|---|",
    ]
    for t in results["targets"]:
        verdict = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['target']} | {_md(t['value'])} | {_md(t['limit'])} | {verdict} |")
    lines += ["", "#### Step cost: forkless, inline and spawn", "", step_map_markdown(results),
              "", "#### Latency budget", "", hops_markdown(results), "",
              "#### CPU per message and the device's floor", "", per_message.markdown(results),
              "", "#### State scaling", "", state_scaling_markdown(results)]
    return "\n".join(lines) + "\n"


def _main_table(results: dict[str, Any]) -> list[str]:
    """When and where the run was made, and its main table, as lines."""
    m, plan, s = results["machine"], results["plan"], results["summary"]
    when = datetime.datetime.fromisoformat(results["date"]).astimezone(datetime.UTC)
    # runs made before "jax_platforms" was recorded ran the clients with client_env's default
    platform_ = results.get("jax_platforms") or "cpu"
    versions = ", ".join(f"{mod} {m[mod]}" for mod in ("jax", "jaxlib", "aiohttp", "janus", "numpy") if m.get(mod))
    settings = results["loadgen_settings"]
    lines = [
        f"Run of {when:%Y-%m-%d %H:%M} UTC: `{results['command']}` with `JAX_PLATFORMS={platform_}`, "
        f"{results['elapsed_s']:.0f} s in all, on {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, "
        + (f"JAX device {results['jax_device']}, " if results.get("jax_device") else "")
        + f"Python {m['python']}, {versions}.",
        f"Medians over {plan['repeats']} repeat(s) of {plan['duration_s']:g} s (the first {plan['warmup_s']:g} s "
        f"not counted); latency in ms from the due time; {settings['streams']} streams, {settings['features']} "
        f"features; maximum throughput with {plan['window']:,} messages in flight.",
        "",
        "| design | p50 @1k | p99 @1k | p99.9 @1k | p50 @10k | p99 @10k | p99.9 @10k | max msg/s "
        "| peak RSS MiB (processes) | IO-loop lag p50/p99 ms | lag p99 during the heavy step "
        "| compiles after warm-up | first result cold / warm cache |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # a design this stored run did not have is left out
    return lines + [_main_row(design, s[design]) for design in (*DESIGNS, "compute-ceiling") if design in s]


def _main_row(design: str, r: dict[str, Any]) -> str:
    """One design's row of the main table."""
    cells = [design]
    if design == "compute-ceiling":
        cells += ["–"] * 6 + [_md(r["throughput_msg_s"])] + ["–"] * 5
    else:
        cells += [_md(r[load][q]) for load in ("rate_1k", "rate_10k") for q in ("p50", "p99", "p999")]
        cells.append(_md(r["throughput_msg_s"]))
        rss = "–" if r["peak_rss_mib"] is None else f"{r['peak_rss_mib']:.0f}"
        cells.append(rss + (f" ({r['processes']})" if r.get("processes") else ""))
        lag, heavy, first = r.get("loop_lag_ms_1k"), r.get("loop_lag_ms_heavy"), r.get("first_result_s")
        cells.append(f"{_md(lag['p50'])} / {_md(lag['p99'])}" if lag else "–")
        cells.append(_md(heavy["p99"]) if heavy else "–")
        cells.append(_md(r.get("compilations_after_warmup")) if design in JAX_DESIGNS else "–")
        cells.append(f"{_md(first.get('cold_s'))} s / {_md(first.get('warm_s'))} s" if first else "–")
    return "| " + " | ".join(cells) + " |"


def _write_block(path: Path, name: str, body: str) -> bool:
    """Put ``body`` between the markers ``name`` of ``path``; True if it changed."""
    # gendocs imports this module (it regenerates every block, this one included): imported
    # here, when a run has finished, so that neither module needs the other to import first
    from gendocs import replace_block

    text = path.read_text(encoding="utf-8")
    new = replace_block(text, name, body)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def write_summary_block(results: dict[str, Any], readme: Path = BENCH_README) -> bool:
    """Put ``summary_markdown(results)`` between the summary markers of ``readme``; True if it changed."""
    return _write_block(readme, SUMMARY_BLOCK, summary_markdown(results))


def write_results_block(results: dict[str, Any], page: Path = RESULTS_PAGE) -> bool:
    """Put ``results_markdown(results)`` between the results markers of ``page``; True if it changed."""
    return _write_block(page, RESULTS_BLOCK, results_markdown(results))


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
    # bench/README.md and bench/docs/ describe bench/out/results.json (tests/test_docs.py holds them together)
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
