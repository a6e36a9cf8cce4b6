"""How long a stall that holds the GIL an exchange session survives, and what helps (issue 54 item 12).

    JAX_PLATFORMS=cpu python -m bench.gil_stall [--designs forkless,thread,spawn] [--stalls 0.5,1,2,4,8,16]
        [--kind c-call|c-sleep] [--ping-every 2] [--pong-within 1] [--extra-s 8] [--gc-sizes 1000000,3000000]
        [--out bench/out/gil_stall.json] [--markdown PATH]
    JAX_PLATFORMS=cpu python -m bench.gil_stall --quick --out PATH --logs DIR   # the smoke run: tiny sizes

Three sections (``--sections``), written as one JSON object (``--out``) and a Markdown report (stdout,
and ``--markdown``); each process's output goes to ``--logs`` (bench/out/logs/gil_stall, ignored by git):

- ``threads``: in this process, a ticking thread (``time.sleep(TICK_S)`` in a loop, as an idle IO
  loop waits) and the main thread doing each kind of stall (KINDS) for ``THREADS_S``: the ticking
  thread's longest gap within the stall is how long it was kept from running. No network: the
  mechanism alone.
- ``session``: the toy exchange (bench/exchange.py, a ping every ``--ping-every`` s to be answered
  within ``--pong-within`` s, else close 4001) serves on a thread of this process; each design's
  client runs in a process of its own (``python -m bench.gil_stall client``): ``forkless``
  (examples/exchange_session.py's ``ExchangeSession`` under an events-only ``Controller``, /metrics
  served), ``thread`` and ``spawn`` (bench/exchange_client.py's ``DataClientWorker`` on a
  ``threading.Thread``, or in a ``multiprocessing`` spawn child with a GIL of its own). The client's
  main thread stalls when told, at a phase of the heartbeat: ``after-ping`` (AFTER_PING_S after a
  ping was answered: the next ping comes about ``ping_every`` later) or ``before-ping`` (LEAD_S
  before the next ping is due). A stall that holds the GIL (``--kind``: ``c-call``, or ``c-sleep``)
  runs at each of ``--stalls`` seconds in both phases; the others (``chunked``, ``python``,
  ``sleep``) at ``--extra-s`` before a ping, for forkless; a control (``none``: no stall) opens
  each design. For forkless, the IO-loop lag that
  /metrics showed across the trial (``forkless_io_loop_lag_seconds``, scraped before and after).
- ``gc``: in a fresh process per heap size (``python -m bench.gil_stall gc-probe``), JAX imported
  and ``N`` live lists (a container the collector walks, as every parsed JSON array and row is):
  ``gc.collect()``'s pause and how long a ticking thread was held meanwhile, before and after
  ``gc.freeze()``; then a workload that parses and keeps rows (the heap grows by half), its
  automatic collections timed by ``gc.callbacks``, with the default thresholds, with
  RAISED_THRESHOLDS, and after ``gc.freeze()``.

The kinds of stall (KINDS): ``c-call`` holds the GIL in one C call (``sum(itertools.repeat(1, n))``:
no bytecode runs, so the interpreter never offers the GIL to another thread; ``n`` calibrated in
the stalling process to the seconds wanted, so as long as the machine's speed then allows),
``c-sleep`` holds it in one C call that waits (libc's ``usleep`` through ``ctypes.PyDLL``, which
keeps the GIL, as a C extension's blocking call that does not release it: exactly as long on any
machine; the ``--quick`` run's), ``chunked`` does the same work in calls of CHUNK_S,
``python`` is pure-Python work (bytecode: the GIL is offered every switch interval), ``sleep``
releases the GIL (as a main thread waiting on the device or in a blocking call that releases it).

Rules:
- The process that stalls is never the exchange's: the exchange's clock and its verdicts keep running.
- A stall's length is the stalling process's own measured wall time, never the calibration's target.
- The verdict is the exchange's counters: a trial survived when, until ``ping_every + pong_within +
  JUDGE_SLACK_S`` after the stall ended, the exchange counted no missed ping, no 4001 close and no new
  connection, and counted a pong on time after the stall.
- Every process this starts (the clients, the gc probes) is waited for, or killed, before it returns.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import itertools
import json
import math
import os
import platform
import queue
import select
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "bench" / "out" / "gil_stall.json"
DEFAULT_LOGS = REPO_ROOT / "bench" / "out" / "logs" / "gil_stall"  # ignored by git
KINDS = ("none", "c-call", "c-sleep", "chunked", "python", "sleep")
HELD = ("c-call", "c-sleep")  # the kinds that hold the GIL throughout
THREAD_KINDS = ("c-call", "chunked", "python", "sleep")  # the threads section's
PHASES = ("after-ping", "before-ping")
DESIGNS = ("forkless", "thread", "spawn")
RATE = 500.0  # trades per second, as in the exchange-session benchmark
CALIBRATE_ITEMS = 2_000_000
CHUNK_S = 0.001  # a chunked C call's piece: shorter than the 5 ms switch interval
POLL_S = 0.01  # how often a client's main loop looks at its commands
AFTER_PING_S = 0.05  # after-ping: the stall starts this long after the harness saw a pong counted
LEAD_S = 0.1  # before-ping: ... this long before the next ping is due
JUDGE_SLACK_S = 0.5
READY_TIMEOUT_S = 180.0  # a client's start: JAX's import and the first connection, on a loaded machine
RECONNECT_TIMEOUT_S = 60.0
TICK_S = 0.001
THREADS_S = 2.0
REPEATS = 3
RAISED_THRESHOLDS = (50_000, 50, 100)  # CPython's default is (700, 10, 10)
METRIC = "forkless_io_loop_lag_seconds"


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


# ---- the stalls (run in the process that stalls) -------------------------------------------------


def calibrate_ns_per_item() -> float:
    """Nanoseconds an item of ``sum(itertools.repeat(1, n))`` takes here: the best of three."""
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        sum(itertools.repeat(1, CALIBRATE_ITEMS))
        best = min(best, time.perf_counter() - t0)
    return best * 1e9 / CALIBRATE_ITEMS


def stall(kind: str, seconds: float, ns_per_item: float) -> None:
    """Do ``kind`` of stall (KINDS) for about ``seconds``."""
    items = max(1, int(seconds * 1e9 / ns_per_item))
    if kind == "none":
        return
    if kind == "c-call":  # one C call: no bytecode runs until it returns
        sum(itertools.repeat(1, items))
    elif kind == "c-sleep":  # one C call that waits holding the GIL (PyDLL keeps it): exactly as long, any machine
        ctypes.PyDLL(None).usleep(ctypes.c_uint(round(seconds * 1e6)))
    elif kind == "chunked":  # the same work; between two calls the interpreter can hand the GIL over
        chunk = max(1, int(CHUNK_S * 1e9 / ns_per_item))
        for start in range(0, items, chunk):
            sum(itertools.repeat(1, min(chunk, items - start)))
    elif kind == "python":
        end, n = time.perf_counter() + seconds, 0
        while time.perf_counter() < end:
            n += 1
    elif kind == "sleep":  # the GIL released, as while waiting on the device
        time.sleep(seconds)
    else:
        raise ValueError(f"unknown stall kind {kind!r}; expected one of {KINDS}")


class Ticker:
    """A thread that sleeps ``TICK_S`` in a loop and stamps each wake-up: a gap between two stamps
    longer than the tick is how long it could not run (the GIL held elsewhere, or no CPU)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ticker", daemon=True)

    def _run(self) -> None:
        stamps, stop = self.stamps, self._stop
        while not stop.is_set():
            time.sleep(TICK_S)
            stamps.append(time.perf_counter())

    def __enter__(self) -> Ticker:
        self._thread.start()
        while not self.stamps:
            time.sleep(TICK_S)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10.0)

    def longest_gap_s(self, t0: float, t1: float) -> float:
        """The longest time within ``[t0, t1]`` between two stamps (a gap clipped to the window: one
        that began before ``t0`` counts from ``t0``), waiting for the first stamp after ``t1``."""
        deadline = time.perf_counter() + 5.0
        while self.stamps[-1] < t1 and time.perf_counter() < deadline:
            time.sleep(TICK_S)
        longest = 0.0
        for a, b in itertools.pairwise(self.stamps[:]):
            if b >= t0 and a <= t1:
                longest = max(longest, min(b, t1) - max(a, t0))
        return longest


def threads_section(seconds: float) -> dict[str, Any]:
    """Each kind of stall on the main thread while a ticking thread waits to run (the module docstring)."""
    ns = calibrate_ns_per_item()
    rows = []
    with Ticker() as ticker:
        for kind in THREAD_KINDS:
            t0 = time.perf_counter()
            stall(kind, seconds, ns)
            t1 = time.perf_counter()
            rows.append({"kind": kind, "stall_s": round(t1 - t0, 4),
                         "ticker_longest_gap_s": round(ticker.longest_gap_s(t0, t1), 4)})
    return {"seconds": seconds, "ns_per_item": round(ns, 3), "switch_interval_s": sys.getswitchinterval(),
            "rows": rows}


# ---- the client: one design's program, stalling when told ----------------------------------------


def emit(obj: dict[str, Any]) -> None:
    """One line of JSON to the harness (stdout is the harness's; logs go to stderr)."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Commands:
    """The harness's commands, a JSON line each on stdin, read without blocking (``select`` and
    ``os.read``: a buffered ``readline`` could hold a second line where ``select`` cannot see it)."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno()
        self.buffer = b""
        self.ended = False

    def next(self) -> dict[str, Any] | None:
        """The next command if one has come; ``{"stop": True}`` once stdin has ended."""
        while b"\n" not in self.buffer and not self.ended and select.select([self.fd], [], [], 0)[0]:
            chunk = os.read(self.fd, 65536)
            self.buffer += chunk
            self.ended = not chunk
        if b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            return json.loads(line)
        return {"stop": True} if self.ended else None


def serve_commands(wait: Callable[[float], None], ns_per_item: float) -> None:
    """The client's main loop: ``wait(timeout)`` runs the design's own work (hand-overs) between
    commands; a ``{"stall", "seconds", "at"}`` command stalls at ``at`` (monotonic, system-wide on
    Linux: the harness's clock) and answers with what it measured; ``{"stop"}`` returns."""
    commands = Commands()
    scheduled: dict[str, Any] | None = None
    while True:
        command = commands.next()
        if command is not None:
            if command.get("stop"):
                return
            scheduled = command
        now = time.monotonic()
        if scheduled is not None and now >= scheduled["at"]:
            t0 = time.monotonic()
            stall(scheduled["stall"], scheduled["seconds"], ns_per_item)
            t1 = time.monotonic()
            emit({"stalled": scheduled["stall"], "started": t0, "ended": t1, "measured_s": t1 - t0,
                  "late_s": t0 - scheduled["at"]})
            scheduled = None
            continue
        wait(min(POLL_S, scheduled["at"] - now) if scheduled is not None else POLL_S)


def run_forkless_client(url: str, ns_per_item: float) -> None:
    # here, not at the top: the spawn design's child imports this module and must load neither forkless nor JAX
    from examples.exchange_session import ExchangeSession
    from forkless import Config, Controller

    session = ExchangeSession(url)
    events: Counter[str] = Counter()

    def on_event(source: str, event: dict[str, Any]) -> None:
        events[event["type"]] += 1

    config = Config(status_s=0.0, metrics_addr="127.0.0.1:0")
    with Controller(config, sources=[session], on_event=on_event, events_only=True) as ctl:
        emit({"ready": "forkless", "metrics_url": ctl.metrics_url, "ns_per_item": ns_per_item, "pid": os.getpid()})
        serve_commands(lambda timeout: ctl.process_pending(timeout=timeout), ns_per_item)
    snap = ctl.stats()
    emit({"final": {"logins": session.logins, "events": dict(events), "events_dropped": snap.events_dropped,
                    "dropped": snap.dropped}})


def run_worker_client(design: str, url: str, ns_per_item: float) -> None:
    # here, not at the top: numpy and psutil (bench.exchange_client's) only in the designs that use them
    import multiprocessing as mp

    from bench.exchange_client import GO, DataClientWorker, run_worker

    if design == "thread":
        to_main: Any = queue.Queue()
        to_worker: Any = queue.Queue()
        worker = threading.Thread(target=DataClientWorker(url, to_main, to_worker).run, name="data-client",
                                  daemon=True)
    else:  # spawn: the worker in a child with its own interpreter, so its own GIL
        ctx = mp.get_context("spawn")
        to_main, to_worker = ctx.Queue(), ctx.Queue()
        worker = ctx.Process(target=run_worker, args=(url, to_main, to_worker), name="data-client", daemon=True)
    worker.start()
    to_worker.put(GO)
    seen: Counter[str] = Counter()
    closes: Counter[str] = Counter()
    end: dict[str, Any] = {}

    def take(item: tuple[str, Any, int]) -> None:
        kind, obj, _ = item
        seen[kind] += 1
        if kind == "closed":
            closes[str(obj)] += 1
        elif kind == "end":
            end.update(obj)

    def wait(timeout: float) -> None:
        try:
            take(to_main.get(timeout=timeout))
            while True:
                take(to_main.get_nowait())
        except queue.Empty:
            return

    emit({"ready": design, "metrics_url": None, "ns_per_item": ns_per_item, "pid": os.getpid()})
    serve_commands(wait, ns_per_item)
    to_worker.put(None)
    deadline = time.monotonic() + 10.0
    while not end and time.monotonic() < deadline:
        wait(0.1)
    worker.join(5.0)
    if design == "spawn" and worker.is_alive():
        worker.terminate()
        worker.join(2.0)
    emit({"final": {"events": dict(seen), "closes": dict(closes), "worker": end}})


def client_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gil_stall client")
    p.add_argument("--design", choices=DESIGNS, required=True)
    p.add_argument("--url", required=True)
    a = p.parse_args(argv)
    ns = calibrate_ns_per_item()
    if a.design == "forkless":
        run_forkless_client(a.url, ns)
    else:
        run_worker_client(a.design, a.url, ns)
    return 0


# ---- the gc probe: one heap size in a fresh process ---------------------------------------------


class CollectionTimer:
    """Every automatic collection's generation and pause, by ``gc.callbacks``."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._t0))

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for gen in (0, 1, 2):
            mine = [p for g, p in self.pauses if g == gen]
            out[f"gen{gen}"] = {"n": len(mine), "max_ms": round(max(mine, default=0.0) * 1e3, 3),
                                "total_ms": round(sum(mine) * 1e3, 3)}
        return out


def workload(items: int, ticker: Ticker) -> dict[str, Any]:
    """Parse ``items`` small JSON rows, keep each (the heap grows by ``items`` lists), and time every
    automatic collection meanwhile; the ticking thread's longest gap over the whole of it."""
    timer = CollectionTimer()
    kept: list[Any] = []
    gc.callbacks.append(timer)
    try:
        t0 = time.perf_counter()
        for i in range(items):
            row = json.loads(f'[{i & 255}, "{i}.5", {{"k": {i & 7}}}]')  # a list, and a dict that dies with it
            kept.append(row[:2])
        t1 = time.perf_counter()
    finally:
        gc.callbacks.remove(timer)
    out = {"items": items, "wall_s": round(t1 - t0, 3), "collections": timer.figures(),
           "ticker_longest_gap_ms": round(ticker.longest_gap_s(t0, t1) * 1e3, 3)}
    del kept
    return out


def timed_collections(ticker: Ticker) -> dict[str, Any]:
    """``gc.collect()`` REPEATS times: each pause, and how long the ticking thread was held."""
    pauses, held = [], []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        gc.collect()
        t1 = time.perf_counter()
        pauses.append(t1 - t0)
        held.append(ticker.longest_gap_s(t0, t1))
    return {"pause_ms": [round(p * 1e3, 3) for p in pauses],
            "pause_ms_median": round(statistics.median(pauses) * 1e3, 3),
            "ticker_held_ms_median": round(statistics.median(held) * 1e3, 3)}


def gc_probe(size: int, with_jax: bool) -> dict[str, Any]:
    if with_jax:  # a realistic heap: the program has JAX loaded (its modules are containers the collector walks)
        import jax.numpy as jnp

        jnp.zeros(4).block_until_ready()
    gc.collect()
    before = len(gc.get_objects())
    t0 = time.perf_counter()
    held = [[k & 255, 1] for k in range(size)]  # lists: never untracked, as json arrays and rows are not
    build_s = time.perf_counter() - t0
    out: dict[str, Any] = {"size": size, "with_jax": with_jax, "objects_before": before,
                           "tracked_objects": len(gc.get_objects()), "build_s": round(build_s, 3),
                           "thresholds_default": gc.get_threshold()}
    grow = size // 2
    with Ticker() as ticker:
        out["collect"] = timed_collections(ticker)
        out["workload_default"] = workload(grow, ticker)
        default = gc.get_threshold()
        gc.set_threshold(*RAISED_THRESHOLDS)
        try:
            gc.collect()
            out["workload_raised_thresholds"] = workload(grow, ticker)
        finally:
            gc.set_threshold(*default)
        gc.collect()
        gc.freeze()  # what Controller(freeze_gc=True) does at start(), after one collection
        try:
            out["frozen_objects"] = gc.get_freeze_count()
            out["collect_frozen"] = timed_collections(ticker)
            out["workload_frozen"] = workload(grow, ticker)
        finally:
            gc.unfreeze()
    del held
    return out


def gc_probe_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gil_stall gc-probe")
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--no-jax", action="store_true")
    a = p.parse_args(argv)
    emit(gc_probe(a.size, not a.no_jax))
    return 0


def gc_section(sizes: list[int], with_jax: bool, log_dir: Path) -> list[dict[str, Any]]:
    out = []
    for size in sizes:
        cmd = [sys.executable, "-m", "bench.gil_stall", "gc-probe", "--size", str(size)] + ([] if with_jax else
                                                                                          ["--no-jax"])
        with (log_dir / f"gc-probe-{size}.log").open("w", encoding="utf-8") as err:
            done = subprocess.run(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=err, text=True, timeout=1800,
                                  env=child_env())
        if done.returncode != 0:
            raise RuntimeError(f"gc-probe --size {size} exited {done.returncode} (see {err.name})")
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"gc: {size:,} lists: collect {out[-1]['collect']['pause_ms_median']} ms, "
              f"frozen {out[-1]['collect_frozen']['pause_ms_median']} ms", file=sys.stderr, flush=True)
    return out


# ---- the harness: the exchange here, a client process per design --------------------------------


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


class Client:
    """One design's client process: JSON lines in (its stdin) and out (its stdout, read by a thread)."""

    def __init__(self, design: str, url: str, log: Path) -> None:
        self.design, self.log = design, log
        with log.open("w", encoding="utf-8") as err:  # the child has its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bench.gil_stall", "client", "--design", design, "--url", url],
                cwd=REPO_ROOT, env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"client-{design}", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                continue  # not ours: a library's print
        self.lines.put(None)

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self, key: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                obj = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{self.design} client: no {key!r} within {timeout_s:.0f}s "
                                   f"(see {self.log})") from None
            if obj is None:
                raise RuntimeError(f"{self.design} client ended before {key!r} (exit {self.proc.wait()}; "
                                   f"see {self.log})")
            if key in obj:
                return obj

    def finish(self) -> dict[str, Any]:
        """Stop it; its last figures ({} if it could not say)."""
        final: dict[str, Any] = {}
        try:
            if self.proc.poll() is None:
                self.send({"stop": True})
                final = self.read("final", 60.0)["final"]
            self.proc.wait(30.0)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            print(f"{self.design} client: {exc}", file=sys.stderr, flush=True)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10.0)
        return final


def scrape(url: str | None) -> str | None:
    if url is None:
        return None
    with urllib.request.urlopen(f"{url}/metrics", timeout=60.0) as resp:
        return resp.read().decode()


def lag_histogram(text: str) -> dict[str, float]:
    """``forkless_io_loop_lag_seconds``'s cumulative buckets (by ``le``), ``sum`` and ``count``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(METRIC + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[le] = float(line.rsplit(" ", 1)[1])
        elif line.startswith((METRIC + "_sum ", METRIC + "_count ")):
            out[line.split(" ", 1)[0].rsplit("_", 1)[1]] = float(line.rsplit(" ", 1)[1])
    return out


def lag_between(before: str | None, after: str | None) -> dict[str, Any]:
    """What the lag histogram gained between two scrapes: its samples, the bucket of the largest
    (``(lo, hi]`` seconds: /metrics shows every fifth bound, 1, 3.16, 10, 31.6 s ...), those over 1 s."""
    if before is None or after is None:
        return {}
    b, a = lag_histogram(before), lag_histogram(after)
    gained = {le: a[le] - b.get(le, 0.0) for le in a}
    count = gained.get("count", 0.0)
    bounds = sorted((float(le), n) for le, n in gained.items() if le not in ("+Inf", "sum", "count"))
    lo, hi = 0.0, math.inf
    for bound, n in bounds:
        if n >= count:
            hi = bound
            break
        lo = bound
    return {"lag_samples": int(count), "lag_largest_in_s": [lo, hi if hi != math.inf else None],
            "lag_samples_over_1s": int(count - gained.get("1.0", 0.0)), "lag_sum_s": round(gained.get("sum", 0.0), 3)}


def plan(design: str, held: str, stalls: list[float], phases: list[str],
         extra_s: float) -> list[tuple[str, float, str]]:
    """The trials of a design, in order: (kind, seconds, phase); ``held`` is the kind of the ``stalls``."""
    trials = [("none", 0.0, "after-ping")]
    trials += [(held, s, phase) for s in stalls for phase in phases]
    if design == "forkless" and extra_s > 0:
        trials += [(kind, extra_s, "before-ping") for kind in ("chunked", "python", "sleep")]
    return trials


def run_trial(ex: Any, client: Client, metrics_url: str | None, kind: str, seconds: float, phase: str,
              ping_every_s: float, pong_within_s: float) -> dict[str, Any]:
    """One stall, judged by the exchange (the module's rules); waits for the session to be back after a drop."""
    pongs = ex.counters()["pongs_on_time"]
    ex.wait_for(lambda c: c["pongs_on_time"] > pongs, 3 * ping_every_s + 30.0, "a ping answered before the stall")
    answered_at = time.monotonic()
    at = answered_at + (AFTER_PING_S if phase == "after-ping" else ping_every_s - LEAD_S)
    metrics_before = scrape(metrics_url)
    before = ex.counters()
    client.send({"stall": kind, "seconds": seconds, "at": at})
    done = client.read("stalled", seconds * 20 + 120.0)
    pongs_at_end = ex.counters()["pongs_on_time"]
    time.sleep(max(0.0, done["ended"] + ping_every_s + pong_within_s + JUDGE_SLACK_S - time.monotonic()))
    after = ex.counters()
    metrics_after = scrape(metrics_url)
    delta = {"pings_missed": after["pings_missed"] - before["pings_missed"],
             "closes_4001": after["closes"]["4001"] - before["closes"]["4001"],
             "connections": after["connections"] - before["connections"],
             "pongs_on_time_after": after["pongs_on_time"] - pongs_at_end}
    survived = (delta["pings_missed"], delta["closes_4001"], delta["connections"]) == (0, 0, 0) and \
        delta["pongs_on_time_after"] > 0
    row = {"design": client.design, "kind": kind, "phase": phase, "target_s": seconds,
           "measured_s": round(done["measured_s"], 3), "late_s": round(done["late_s"], 4), "survived": survived,
           **delta, **lag_between(metrics_before, metrics_after)}
    if not survived:  # the exchange dropped it: wait for the client's next connection
        ex.wait_for(lambda c: c["connections"] > before["connections"], RECONNECT_TIMEOUT_S,
                    f"{client.design} connected again after the drop")
    print(f"{client.design} {kind} {phase} {seconds}s: measured {row['measured_s']}s, "
          f"{'survived' if survived else 'dropped'}", file=sys.stderr, flush=True)
    return row


def session_section(designs: list[str], held: str, stalls: list[float], phases: list[str], extra_s: float,
                    ping_every_s: float, pong_within_s: float, log_dir: Path) -> dict[str, Any]:
    from bench.exchange import Exchange  # here: aiohttp's import only for the section that serves the exchange

    rows: list[dict[str, Any]] = []
    exchanges, clients = {}, {}
    for design in designs:
        ex = Exchange(rate=RATE, ping_every_s=ping_every_s, pong_within_s=pong_within_s)
        url = ex.start()
        client = Client(design, url, log_dir / f"client-{design}.log")
        ready: dict[str, Any] = {}
        try:
            ready = client.read("ready", READY_TIMEOUT_S)
            for kind, seconds, phase in plan(design, held, stalls, phases, extra_s):
                rows.append(run_trial(ex, client, ready["metrics_url"], kind, seconds, phase, ping_every_s,
                                      pong_within_s))
        finally:
            clients[design] = {"final": client.finish(), "exit": client.proc.returncode,
                               "ns_per_item": ready.get("ns_per_item")}
            exchanges[design] = ex.counters()
            ex.stop()
    return {"ping_every_s": ping_every_s, "pong_within_s": pong_within_s, "rate": RATE, "rows": rows,
            "thresholds": thresholds(rows), "exchange": exchanges, "clients": clients}


def thresholds(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per design and phase, the longest stall that held the GIL (HELD) survived and the shortest dropped
    (measured s)."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["kind"] not in HELD:
            continue
        mine = out.setdefault(row["design"], {}).setdefault(row["phase"], {"longest_survived_s": None,
                                                                          "shortest_dropped_s": None})
        s = row["measured_s"]
        if row["survived"]:
            mine["longest_survived_s"] = max(s, mine["longest_survived_s"] or 0.0)
        elif mine["shortest_dropped_s"] is None or s < mine["shortest_dropped_s"]:
            mine["shortest_dropped_s"] = s
    return out


# ---- the report ---------------------------------------------------------------------------------


def _s(value: Any) -> str:
    return "–" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def markdown(result: dict[str, Any]) -> str:
    run = result["run"]
    lines = [f"Run of {run['date']}: `{run['command']}` on {run['machine']}, load average {run['load_before']} "
             f"before, {run['load_after']} after.", ""]
    threads = result.get("threads")
    if threads:
        lines += [f"### A ticking thread while the main thread stalls for {threads['seconds']:g} s",
                  f"(switch interval {threads['switch_interval_s'] * 1e3:g} ms; one item of the C call "
                  f"{threads['ns_per_item']:g} ns)", "",
                  "| kind | stall s | ticking thread's longest gap s |", "|---|---|---|"]
        lines += [f"| {r['kind']} | {r['stall_s']:g} | {r['ticker_longest_gap_s']:g} |" for r in threads["rows"]]
        lines.append("")
    session = result.get("session")
    if session:
        lines += [f"### The exchange session: a ping every {session['ping_every_s']:g} s, a pong due within "
                  f"{session['pong_within_s']:g} s", "",
                  "| design | kind | phase | target s | measured s | survived | missed pings | 4001 closes | "
                  "IO-loop lag: largest sample in (s) | lag samples over 1 s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in session["rows"]:
            largest = r.get("lag_largest_in_s")
            lag = f"({_s(largest[0])}, {_s(largest[1]) if largest[1] is not None else '∞'}]" if largest else "–"
            lines.append(f"| {r['design']} | {r['kind']} | {r['phase']} | {r['target_s']:g} | {r['measured_s']:g} | "
                         f"{'yes' if r['survived'] else '**no**'} | {r['pings_missed']} | {r['closes_4001']} | {lag} | "
                         f"{_s(r.get('lag_samples_over_1s'))} |")
        lines += ["", "The longest stall that held the GIL survived, and the shortest dropped (measured s):", "",
                  "| design | after a ping: survived / dropped | just before a ping: survived / dropped |",
                  "|---|---|---|"]
        for design, phases in session["thresholds"].items():
            cells = [f"{_s(phases.get(p, {}).get('longest_survived_s'))} / "
                     f"{_s(phases.get(p, {}).get('shortest_dropped_s'))}" for p in PHASES]
            lines.append(f"| {design} | {cells[0]} | {cells[1]} |")
        lines.append("")
    for probe in result.get("gc", []):
        lines += [f"### gc: {probe['size']:,} live lists ({probe['tracked_objects']:,} tracked objects, "
                  f"{probe['objects_before']:,} before them{', JAX loaded' if probe['with_jax'] else ''})", "",
                  "| | full collection ms (median of 3) | a ticking thread held ms |", "|---|---|---|",
                  f"| gc.collect() | {probe['collect']['pause_ms_median']:g} | "
                  f"{probe['collect']['ticker_held_ms_median']:g} |",
                  f"| after gc.freeze() ({probe['frozen_objects']:,} frozen) | "
                  f"{probe['collect_frozen']['pause_ms_median']:g} | "
                  f"{probe['collect_frozen']['ticker_held_ms_median']:g} |",
                  "", f"Parsing and keeping {probe['workload_default']['items']:,} more rows (automatic collections):",
                  "", "| setting | gen0 n | gen1 n | gen2 n | gen2 longest ms | all collections ms | "
                  "a ticking thread's longest gap ms | wall s |", "|---|---|---|---|---|---|---|---|"]
        for label, key in (("default thresholds", "workload_default"),
                           (f"gc.set_threshold{RAISED_THRESHOLDS}", "workload_raised_thresholds"),
                           ("after gc.freeze()", "workload_frozen")):
            w = probe[key]
            c = w["collections"]
            total = sum(c[g]["total_ms"] for g in ("gen0", "gen1", "gen2"))
            lines.append(f"| {label} | {c['gen0']['n']} | {c['gen1']['n']} | {c['gen2']['n']} | "
                         f"{c['gen2']['max_ms']:g} | {total:.1f} | {w['ticker_longest_gap_ms']:g} | {w['wall_s']:g} |")
        lines.append("")
    return "\n".join(lines)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["client"]:
        return client_main(argv[1:])
    if argv[:1] == ["gc-probe"]:
        return gc_probe_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench.gil_stall", description=__doc__.split("\n\n")[0])
    p.add_argument("--designs", default=",".join(DESIGNS))
    p.add_argument("--stalls", default="0.5,1,2,4,8,16", help="the stalls that hold the GIL, seconds")
    p.add_argument("--kind", choices=HELD, default="c-call", help="their kind")
    p.add_argument("--extra-s", type=float, default=8.0, help="the chunked, python and sleep stalls (forkless), s")
    p.add_argument("--ping-every", type=float, default=2.0)
    p.add_argument("--pong-within", type=float, default=1.0)
    p.add_argument("--gc-sizes", default="1000000,3000000", help="live lists per gc probe ('' for none)")
    p.add_argument("--threads-s", type=float, default=THREADS_S)
    p.add_argument("--sections", default="threads,session,gc")
    p.add_argument("--quick", action="store_true",
                   help="the smoke run: forkless only, a ping every 0.3 s due in 0.3 s, a c-sleep of 2 s after a "
                        "ping, the other kinds for 0.05 s; gc over 20,000 lists without JAX")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--logs", default=str(DEFAULT_LOGS), help="each process's output goes here")
    p.add_argument("--markdown", help="also write the report here")
    a = p.parse_args(argv)
    designs = [d for d in a.designs.split(",") if d]
    unknown = sorted(set(designs) - set(DESIGNS))
    if unknown:
        p.error(f"unknown designs {unknown}; expected some of {','.join(DESIGNS)}")
    stalls = [float(s) for s in a.stalls.split(",") if s]
    sizes = [int(s) for s in a.gc_sizes.split(",") if s]
    ping_every, pong_within, extra_s, threads_s, with_jax = a.ping_every, a.pong_within, a.extra_s, a.threads_s, True
    phases, held = list(PHASES), a.kind
    if a.quick:  # c-sleep: a stall exactly as long whatever the machine's speed (the smoke test's verdict)
        designs, held, stalls, phases, extra_s = ["forkless"], "c-sleep", [2.0], ["after-ping"], 0.05
        ping_every, pong_within = 0.3, 0.3
        sizes, threads_s, with_jax = [20_000], 0.05, False
    sections = set(a.sections.split(","))
    out = Path(a.out)
    log_dir = Path(a.logs)
    log_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"run": {"date": now_iso(), "command": "python -m bench.gil_stall " + " ".join(argv),
                                      "machine": machine(), "load_before": [round(x, 2) for x in os.getloadavg()]}}
    if "threads" in sections:
        result["threads"] = threads_section(threads_s)
    if "session" in sections:
        result["session"] = session_section(designs, held, stalls, phases, extra_s, ping_every, pong_within,
                                            log_dir)
    if "gc" in sections and sizes:
        result["gc"] = gc_section(sizes, with_jax, log_dir)
    result["run"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    report = markdown(result)
    print(report)
    if a.markdown:
        Path(a.markdown).write_text(report + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
