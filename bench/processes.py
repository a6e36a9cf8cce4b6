"""The designs' processes: their command lines and environments, what they use (memory, CPU), their stop.

Rules:
- A design runs in a process of its own, started from a checkout's root, with ``client_env``: CPU JAX unless
  ``JAX_PLATFORMS`` says otherwise, a persistent compilation cache only where one is given; on an accelerator
  a design that never steps on a device keeps off it (``host_only``).
- ``TreeSampler`` reads a process and every descendant (the multiprocessing resource tracker included) every
  ``SAMPLE_S`` on a thread of its own and never signals them; ``stop_tree`` is the one place a run's process is
  ended: its own exit first, then SIGTERM, then SIGKILL for it and what it started.
- A unix run (``use_unix_sockets``) is chosen once, for this process and everything it starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench import unix
from bench.plan import FEATURES, FT_DESIGNS, FT_PYTHON, HOST_DESIGNS, SAMPLE_S, Plan


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
              "forkless-ft": "bench.forkless_client", "spawn": "bench.spawn_client",
              "inline": "bench.inline_client"}[design]
    extra = ["--heavy"] if heavy else []
    if step is not None:
        extra += ["--heavy-size", str(step["size"]), "--heavy-iters", str(step["iters"])]
    if max_s is not None and design in ("forkless", "forkless-nojax", "forkless-ft", "spawn"):
        extra += ["--max-s", f"{max_s:g}"]
    if probe_url and design.startswith("forkless"):
        url = json.dumps([url, probe_url])  # the probe is a second feed (FORKLESS_FEEDS)
    elif probe_url:
        extra += ["--probe-url", probe_url]
    python = FT_PYTHON if design in FT_DESIGNS and FT_PYTHON else sys.executable
    return ([python, "-m", module, "--url", url, "--out", str(figures)] + extra
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


def interpreter_env(design: str) -> dict[str, str]:
    """A free-threaded design's PYTHONPATH (FORKLESS_BENCH_FT_PYTHONPATH, else none): the benchmark's own
    (the TPU host's names its Python 3.11 JAX) would load the other interpreter's extension modules."""
    return {"PYTHONPATH": os.environ.get("FORKLESS_BENCH_FT_PYTHONPATH", "")} if design in FT_DESIGNS else {}


def host_only(design: str, plan: Plan) -> dict[str, str]:
    """``JAX_PLATFORMS=cpu`` for a design that never steps on a device, in an accelerator's plan."""
    return {"JAX_PLATFORMS": "cpu"} if plan.accelerator and design in HOST_DESIGNS else {}
