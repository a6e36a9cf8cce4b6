"""The JetStream recipe of docs/jetstream.md ("A local recipe"), in three steps, with nats-py:

    python examples/jetstream_demo.py setup      # the input stream TICKS and the results stream SCORES
                                                 # (--partitions P: TICKS partitioned by the server, P parts)
    python examples/jetstream_demo.py publish    # demo messages into TICKS (--count, --rate)
    python examples/jetstream_demo.py compare    # exactly one result per input, equal to a reference

``compare`` reads both streams back and checks that every input message has exactly one result
(the id ``TICKS:<sequence>:0``) and that each equals the default detector run one message at a
time over the inputs in stream order, in float64 (as if the app had never been restarted).

Options: ``--nats`` (default nats://127.0.0.1:4222), ``--features`` (FORKLESS_FEATURES, 8),
``--window`` (the results stream's duplicate window in seconds; it must cover a checkpoint
interval plus a restart: 2 x FORKLESS_CHECKPOINT_S + 60 s at least).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys

import nats
import numpy as np
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig, SubjectTransform

ALPHA, THRESHOLD, WARMUP, EPS = 0.05, 4.0, 20, 1e-6  # the defaults of FORKLESS_ALPHA, _THRESHOLD, _WARMUP


async def setup(args: argparse.Namespace) -> None:
    nc = await nats.connect(args.nats)
    js = nc.jetstream()
    if args.partitions:  # docs/partitions.md ("The stream"): ticks.<stream> stored as ticks.<partition>.<stream>
        dest = f"ticks.{{{{partition({args.partitions},1)}}}}.{{{{wildcard(1)}}}}"
        transform = SubjectTransform(src="ticks.*", dest=dest)
        await js.add_stream(StreamConfig(name="TICKS", subjects=["ticks.*"], subject_transform=transform))
        shown = f"ticks.* stored as ticks.<partition of {args.partitions}>.<stream>"
    else:
        await js.add_stream(StreamConfig(name="TICKS", subjects=["ticks.>"]))
        shown = "ticks.>"
    await js.add_stream(StreamConfig(name="SCORES", subjects=["scores"], duplicate_window=args.window))
    print(f"streams TICKS ({shown}) and SCORES (scores, duplicate window {args.window:g} s) on {args.nats}")
    await nc.close()


async def publish(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    base = [[rng.uniform(-5, 5) for _ in range(args.features)] for _ in range(args.streams)]
    nc = await nats.connect(args.nats)
    js = nc.jetstream()
    first = (await js.stream_info("TICKS")).state.last_seq
    for start in range(0, args.count, 100):
        futures = []
        for i in range(start, min(start + 100, args.count)):
            k = i % args.streams
            x = [round(b + rng.gauss(0.0, 1.0), 6) for b in base[k]]
            if rng.random() < 0.005 and i > WARMUP * args.streams:
                x[0] += 12.0  # an anomaly now and then
            payload = json.dumps({"seq": first + i, "stream": f"sensor-{k}", "x": x}).encode()
            futures.append(await js.publish_async(f"ticks.sensor-{k}", payload))
        for future in futures:
            await future
        print(f"\rpublished {min(start + 100, args.count)} of {args.count}", end="", flush=True)
        await asyncio.sleep(100 / args.rate)
    print()
    await nc.close()


async def _read(js: nats.js.JetStreamContext, stream: str) -> list[nats.aio.msg.Msg]:
    total = (await js.stream_info(stream)).state.messages
    sub = await js.pull_subscribe(">", stream=stream, config=ConsumerConfig(
        deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, inactive_threshold=30, mem_storage=True))
    out: list[nats.aio.msg.Msg] = []
    while len(out) < total:
        out.extend(await sub.fetch(min(1000, total - len(out)), timeout=5))
    await sub.unsubscribe()
    return out


async def compare(args: argparse.Namespace) -> int:
    nc = await nats.connect(args.nats)
    js = nc.jetstream()
    inputs = await _read(js, "TICKS")
    results: dict[str, list[dict]] = {}
    for msg in await _read(js, "SCORES"):
        results.setdefault((msg.headers or {}).get("Nats-Msg-Id", "?"), []).append(json.loads(msg.data))
    await nc.close()
    n: dict[str, int] = {}
    mean: dict[str, np.ndarray] = {}
    var: dict[str, np.ndarray] = {}
    missing = twice = wrong = anomalies = 0
    worst = 0.0
    for msg in inputs:
        m = json.loads(msg.data)
        stream, x = m["stream"], np.asarray(m["x"], np.float64)
        seen = n.get(stream, 0)
        if seen == 0:
            z = np.zeros_like(x)
            mean[stream], var[stream] = x.copy(), np.zeros_like(x)
        else:
            d = x - mean[stream]
            z = d / np.sqrt(var[stream] + EPS)
            mean[stream] = mean[stream] + ALPHA * d
            var[stream] = (1 - ALPHA) * (var[stream] + ALPHA * d * d)
        n[stream] = seen + 1
        got = results.get(f"TICKS:{msg.metadata.sequence.stream}:0", [])
        if not got:
            missing += 1
            continue
        twice += len(got) > 1
        gap = float(np.max(np.abs(np.asarray(got[0]["z"]) - z) / np.maximum(1.0, np.abs(z))))
        worst = max(worst, gap)
        wrong += gap > 2e-3 or got[0]["seq"] != m["seq"]
        anomalies += bool(got[0]["anomaly"])
    extra = len(results) - (len(inputs) - missing)
    print(f"{len(inputs)} inputs, {sum(map(len, results.values()))} results: {missing} missing, {twice} answered "
          f"more than once, {extra} without an input, {wrong} differing from the reference (largest relative "
          f"difference of z {worst:.1e}); {anomalies} anomalies flagged")
    ok = not (missing or twice or extra or wrong)
    print("exactly one result per input, each equal to a run never restarted" if ok else "MISMATCH")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("setup", "publish", "compare"))
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=1000.0, help="messages a second")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--window", type=float, default=300.0, help="SCORES' duplicate window, seconds")
    parser.add_argument("--partitions", type=int, default=0,
                        help="setup: partition TICKS into this many partitions (docs/partitions.md)")
    args = parser.parse_args()
    step = {"setup": setup, "publish": publish, "compare": compare}[args.step]
    return asyncio.run(step(args)) or 0


if __name__ == "__main__":
    sys.exit(main())
