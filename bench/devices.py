"""The controller's compiled step alone on however many devices this process has, in msg/s,
and what routing a batch to them costs on the host.

    JAX_NUM_CPU_DEVICES=4 python -m bench.devices [--seconds 2] [--streams 16] [--out figures.json]

The step the controller compiles (``controller.engine.compile_step``: the guarded EWMA
step, state donated, sharded by stream over every local device with ``shard_map`` when there
are several), for full batches of ``FORKLESS_MAX_BATCH`` messages whose streams take turns
as the load generator's do, routed to their devices beforehand; one ``device_get`` of the
outputs per batch, as the controller does. Separately, the host side of one batch as
``BatchStep._run_step`` (controller/batchstep.py) does it: padding (one device) or grouping by
device into the ``[N, Bd]`` layout, and putting the outputs back in arrival order. ``bench/sections.py``'s devices
section runs this for 1, 2 and 4 forced CPU devices, each in a process of its own.

Rules:
- One device count a process, fixed by the environment (``JAX_NUM_CPU_DEVICES``) before JAX starts.
- The step and the host's routing are timed apart: the step on batches routed beforehand.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from bench.device_floor import write_figures


def measure(seconds: float = 2.0, streams: int = 16) -> dict:
    import jax

    from forkless.controller.batching import pad_batch
    from forkless.controller.config import Config
    from forkless.controller.engine import compile_step
    from forkless.controller.processor import default_processor
    from forkless.controller.slots import StreamSlots

    cfg = Config.from_env(ws_url="ws://127.0.0.1:1/")
    engine = compile_step(default_processor(cfg), cfg)
    layout = engine._layout  # the benchmark lays batches out itself, to time the step alone
    place = layout.placement
    bucket = cfg.max_batch
    rng = np.random.default_rng(0)
    slots = StreamSlots(cfg.max_streams)
    names = [f"s{k}" for k in range(streams)]
    messages = []  # (x, slot) per batch, streams round robin like the load generator's
    for i in range(16):
        keys, _, _ = slots.lookup([names[j % streams] for j in range(i * bucket, (i + 1) * bucket)], 0.0)
        messages.append((rng.standard_normal((bucket, cfg.features)).astype(np.float32), keys))

    def host_batch(x: np.ndarray, keys: np.ndarray) -> tuple:
        if place is None:
            return pad_batch(x, keys, bucket, cfg.max_streams), bucket, None
        route = place.route(keys, cfg.buckets)
        return place.pack(x, keys, route), route.bucket, route

    batches = [host_batch(x, keys) for x, keys in messages]
    state = engine.take_state()
    for batch, bd, _ in batches[:4]:  # warm up
        state, *out = engine.steps[bd](state, batch)
        jax.device_get(out)
    n = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while True:
        batch, bd, _ = batches[n % len(batches)]
        state, *out = engine.steps[bd](state, batch)  # (outputs, bad), or the packed results
        out = jax.device_get(out)
        n += 1
        if n % 8 == 0 and time.perf_counter() >= end:
            break
    elapsed = time.perf_counter() - t0
    # the host's share of a batch: lay it out, and put the outputs back in arrival order
    reps = 2000
    t1 = time.perf_counter()
    for i in range(reps):
        x, keys = messages[i % len(messages)]
        _, _, route = host_batch(x, keys)
        if route is None:
            back = {name: np.asarray(v)[:bucket] for name, v in out[0].items()}
        else:
            back = layout.results((np.asarray(out[0]),), 0, route, np.asarray).outputs
    route_us = (time.perf_counter() - t1) / reps * 1e6
    del back
    return {"design": "compute-ceiling", "devices": list(engine.devices), "device_count": len(engine.devices),
            "throughput_msg_s": n * bucket / elapsed, "batches": n, "batch_size": bucket,
            "step_ms_mean": elapsed / n * 1000, "host_routing_us": route_us, "streams": streams}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.devices", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--out", default="", help="write the figures as JSON here (default: print them)")
    a = p.parse_args(argv)
    figures = measure(a.seconds, a.streams)
    write_figures(figures, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
