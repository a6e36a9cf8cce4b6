"""One run of a design: against the load generator (``run_load``), and from its process's start to its first
result (``time_to_first_result``).

Rules:
- A run's processes (the design, ``bench.loadgen``, a ``bench.ping_probe`` where asked) are started here and
  ended here (``stop_tree``), whatever happens; the design's output goes to the run's log.
- A run ends when the generator reports (every message answered, or its drain bound): the figures are the
  generator's RESULT, the design's own figures file, and the samplers' memory and CPU in the measured window
  (the generator's, on this process's clock: its warm-up not counted).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import unix
from bench.loadgen import start_loadgen, wait_result
from bench.ping_probe import start_probe
from bench.plan import CONNECT_S, DRAIN_S, FEATURES, LOADS, LOADS_RATE, REPO_ROOT, STREAMS, Plan, bound, fmt
from bench.processes import (
    TreeSampler,
    client_cmd,
    client_env,
    cpu_cores,
    host_only,
    interpreter_env,
    stop_tree,
    unix_args,
)


def run_load(design: str, load: str, plan: Plan, work: Path, cache_dir: str, tag: str,
             heavy: bool = False, env: dict[str, str] | None = None, step: dict[str, Any] | None = None,
             probe: bool = False, duration_s: float | None = None, root: Path | None = None) -> dict[str, Any]:
    """One design against one load-generator run; the loadgen RESULT plus the client's figures.

    ``step``: a calibrated heavy step (``size``, ``iters``, ``cost``); ``probe``: a
    ``bench.ping_probe`` pings the design over a second connection (its RESULT under ``"probe"``);
    ``duration_s``: instead of the plan's; ``root``: the checkout whose design runs (``bench.ab``,
    ``bench.step_wait``), this one by default."""
    duration = plan.duration_s if duration_s is None else duration_s
    figures_path = work / f"{tag}.json"
    prober, probe_url, ping = None, None, None
    if probe:
        prober, probe_url = start_probe(["--duration", str(duration), "--warmup-s", str(plan.warmup_s),
                                         "--drain-s", f"{DRAIN_S:g}", "--connect-timeout", f"{CONNECT_S:g}",
                                         *unix_args(f"{tag}-probe")])
    loadgen, url = start_loadgen(loadgen_args(load, plan, duration, tag))
    started = time.perf_counter()
    try:
        with open(work / "logs" / f"{tag}.log", "w", encoding="utf-8") as log:
            client = subprocess.Popen(client_cmd(design, url, figures_path, heavy, step, probe_url,
                                                 max_s=CONNECT_S + duration + DRAIN_S + bound(60)),
                                      cwd=root or REPO_ROOT,
                                      env={**client_env(cache_dir), **host_only(design, plan),
                                           **interpreter_env(design), **(env or {})},
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
    figures = json.loads(figures_path.read_text()) if figures_path.exists() else None
    # the measured window on this clock: the generator reports when its run (connect to the last
    # reply) ended, elapsed_s after it began; the CPU the design and the generator used in it
    begun = reported - float(result.get("elapsed_s") or 0.0)
    cpu = cpu_in_window(load, result, rss, generator, (begun + plan.warmup_s, begun + duration))
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
    print_run(run, ping if probe else None)
    return run


def loadgen_args(load: str, plan: Plan, duration: float, tag: str) -> list[str]:
    """``bench.loadgen``'s arguments for one run of ``load``."""
    args = [*LOADS[load], "--duration", str(duration), "--warmup-s", str(plan.warmup_s),
            "--streams", str(STREAMS), "--features", str(FEATURES), "--host", "127.0.0.1", "--port", "0",
            *unix_args(tag)]
    if load == "window":
        args += ["--window", str(plan.window)]
    # the run ends once every message is answered (see DRAIN_S); the design connects once it has
    # compiled, which a loaded machine can take a minute over
    return [*args, "--drain-s", f"{DRAIN_S:g}", "--connect-timeout", f"{CONNECT_S:g}"]


def cpu_in_window(load: str, result: dict[str, Any], client: TreeSampler, generator: TreeSampler,
                  window: tuple[float, float]) -> dict[str, float | None]:
    """The cores the design and the generator kept busy in ``window``, and the design's CPU µs a message."""
    client_cores = cpu_cores(client.cpu_series, *window)
    answered_per_s = result.get("throughput_msg_s") if load == "window" else float(LOADS_RATE.get(load, 0))
    return {"client_cores": client_cores, "loadgen_cores": cpu_cores(generator.cpu_series, *window),
            "client_us_per_msg": (client_cores / answered_per_s * 1e6) if client_cores and answered_per_s else None}


def print_run(run: dict[str, Any], ping: dict[str, Any] | None) -> None:
    """A run's one line of progress (``ping``: the probe's RESULT, None without a probe)."""
    result = run["loadgen"]
    lat = result.get("latency_ms") or result.get("rtt_ms") or {}
    pinged = f"  ping p99 {fmt(((ping or {}).get('rtt_ms') or {}).get('p99'))} ms" if "probe" in run else ""
    print(f"  {run['tag']:<28} sent {result.get('sent')} answered {result.get('answered')} "
          f"p50 {fmt(lat.get('p50'))} p99 {fmt(lat.get('p99'))} ms  "
          f"{fmt(result.get('throughput_msg_s'), 0)} msg/s  rss {run['peak_rss_mib']} MiB{pinged}", flush=True)


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
