"""The compute ceiling: the default jitted step alone, on pre-built batches, in msg/s.

    python -m bench.compute_ceiling [--seconds 2] [--streams 16] [--out figures.json]

The step the controller runs, compiled ahead of time for the largest bucket
(``FORKLESS_MAX_BATCH``, full batches, no padding), state kept on the device, one
``device_get`` of the outputs per batch as the controller does. Streams are assigned round
robin like the load generator's, so a batch has the same per-stream repeats the designs see.
No sockets, no JSON, no queues: no design can process messages faster than this.
``--floor-s S``: the device's round trip of a trivial step as well (``bench.device_floor``),
in the same process, so that a TPU run opens the chip once for both.

Rules:
- One process, JAX in it: only the step and its one ``device_get`` a batch are timed, on batches built
  beforehand.
- ``--floor-s`` measures the device floor in this same process, so an accelerator is opened once.
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
    from forkless.controller.processor import default_processor

    cfg = Config.from_env(ws_url="ws://127.0.0.1:1/")
    processor = default_processor(cfg)
    bucket = cfg.max_batch
    rng = np.random.default_rng(0)
    batches = [
        pad_batch(rng.standard_normal((bucket, cfg.features)).astype(np.float32),
                  (np.arange(i * bucket, (i + 1) * bucket) % streams).astype(np.int32), bucket, cfg.max_streams)
        for i in range(16)
    ]
    state = jax.device_put(processor.init(cfg))
    step = jax.jit(processor.step).lower(state, batches[0]).compile()
    for b in batches[:4]:  # warm up
        state, out = step(state, b)
        jax.device_get(out)
    n = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while True:
        state, out = step(state, batches[n % len(batches)])
        jax.device_get(out)
        n += 1
        if n % 8 == 0 and time.perf_counter() >= end:
            break
    elapsed = time.perf_counter() - t0
    return {"design": "compute-ceiling", "throughput_msg_s": n * bucket / elapsed, "batches": n,
            "batch_size": bucket, "step_ms_mean": elapsed / n * 1000, "streams": streams}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compute_ceiling", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--floor-s", type=float, default=0.0, help="also measure the device's round trip of a "
                   "trivial step (bench.device_floor) this long, in this process: under \"device_floor\"")
    p.add_argument("--out", default="", help="write the figures as JSON here (default: print them)")
    a = p.parse_args(argv)
    figures = measure(a.seconds, a.streams)
    if a.floor_s > 0:
        from bench.device_floor import measure as floor

        figures["device_floor"] = floor(a.floor_s, a.streams)
    write_figures(figures, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
