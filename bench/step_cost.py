"""Calibrate the heavy step (``bench.heavy``) to a step cost on this machine: ~1 ms, ~10 ms.

    python -m bench.step_cost --targets-ms 1 10 [--size 128] [--out calibration.json]

The cost of a step of ``heavy_processor(config, size, iters)`` is the default detector's plus
``iters`` ``size x size`` matmuls, so it grows linearly in ``iters``. This measures the
default step (``iters`` 0), then ``k`` iterations (``k`` grown until they add a measurable
0.3 ms), takes the slope, picks ``iters`` for each target, and times that step again (once
more corrected if it missed by over 20%). Times are medians of warm calls of the step
compiled ahead of time with the state donated (what ``compile_step`` builds), outputs on the
host, at a batch of one message (the batch a design sees at 1,000 msg/s); the final figures
are measured through ``compile_step`` → ``Engine.step`` exactly as the designs run it, at one
message and at a full batch. Each design also reports the mean step time it saw.

Prints (or writes to ``--out``) JSON: ``{"size", "base_ms", "per_iter_ms", "targets":
[{"target_ms", "iters", "step_ms", "step_ms_full"}, ...], "batch_full", "platform", "device"}``.

Rules:
- Times are medians of warm calls of the step compiled ahead of time, state donated, outputs on the
  host; the final figures go through ``compile_step`` -> ``Engine.step``, as the designs run it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

SIZE = 128  # small matmuls: fine steps in cost (about 30 µs each on the 2-core CPU of the runs)
MEASURABLE_MS = 0.3
MAX_ITERS = 1 << 16


def _config() -> Any:
    from forkless.controller.config import Config

    return Config.from_env(ws_url="ws://127.0.0.1:1/")


def time_step(config: Any, size: int, iters: int, m: int = 1, seconds: float = 0.3) -> float:
    """Median ms of a warm step (AOT-compiled, state donated, outputs on the host) of ``m`` messages."""
    import jax

    from bench.heavy import processor_for
    from forkless.controller.batching import bucket_for, pad_batch

    processor = processor_for(config, size=size, iters=iters)
    bucket = bucket_for(m, config.buckets)
    rng = np.random.default_rng(0)
    batch = pad_batch(rng.standard_normal((m, config.features)).astype(np.float32),
                      (np.arange(m) % 16).astype(np.int32), bucket, config.max_streams)
    state = jax.device_put(processor.init(config))
    step = jax.jit(processor.step, donate_argnums=0).lower(state, batch).compile()
    for _ in range(3):
        state, out = step(state, batch)
        jax.device_get(out)
    times = []
    end = time.perf_counter() + seconds
    while len(times) < 5 or (time.perf_counter() < end and len(times) < 200):
        t0 = time.perf_counter()
        state, out = step(state, batch)
        jax.device_get(out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def engine_step_ms(config: Any, size: int, iters: int, sizes: tuple[int, ...], seconds: float = 0.3) -> list[float]:
    """Median ms of ``Engine.step`` (``compile_step``'s engine, as the designs run it) on each
    number of messages in ``sizes``."""
    from bench.heavy import processor_for
    from forkless.controller.engine import compile_step

    engine = compile_step(processor_for(config, size=size, iters=iters), config)
    rng = np.random.default_rng(1)
    medians = []
    for m in sizes:
        x = rng.standard_normal((m, config.features)).astype(np.float32)
        key = (np.arange(m) % 16).astype(np.int32)
        for _ in range(3):
            engine.step(x, key)
        times = []
        end = time.perf_counter() + seconds
        while len(times) < 5 or (time.perf_counter() < end and len(times) < 200):
            t0 = time.perf_counter()
            engine.step(x, key)
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times) * 1000)
    return medians


def calibrate(targets_ms: list[float], size: int = SIZE, seconds: float = 0.3) -> dict[str, Any]:
    import jax

    config = _config()
    base = time_step(config, size, 0, seconds=seconds)
    k = 8
    while True:
        added = time_step(config, size, k, seconds=seconds) - base
        if added >= MEASURABLE_MS or k >= MAX_ITERS:
            break
        k *= 4
    per_iter = max(added / k, 1e-6)
    out = []
    for target in targets_ms:
        iters = max(1, round((target - base) / per_iter))
        got = time_step(config, size, iters, seconds=seconds)
        if abs(got / target - 1) > 0.2 and got > base:  # not linear enough here: correct once
            iters = max(1, round(iters * (target - base) / (got - base)))
        one, full = engine_step_ms(config, size, iters, (1, config.max_batch), seconds)
        out.append({"target_ms": target, "iters": iters, "step_ms": round(one, 3), "step_ms_full": round(full, 3)})
    return {"size": size, "base_ms": round(base, 4), "per_iter_ms": round(per_iter, 5), "targets": out,
            "batch_full": config.max_batch, "platform": jax.devices()[0].platform,
            "device": jax.devices()[0].device_kind}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_cost", description=__doc__.splitlines()[0])
    p.add_argument("--targets-ms", type=float, nargs="+", default=[1.0, 10.0])
    p.add_argument("--size", type=int, default=SIZE)
    p.add_argument("--seconds", type=float, default=0.3, help="timing per candidate")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    figures = calibrate(a.targets_ms, a.size, a.seconds)
    text = json.dumps(figures)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
