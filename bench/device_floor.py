"""The device's own round trip of a trivial per-stream state step: the floor a one-message
latency cannot beat on this device.

    python -m bench.device_floor [--seconds 1] [--streams 16] [--out figures.json]

Rules: one message a step (its stream's key and its ``x`` put on the device), a step that reads
and writes that stream's row of a ``(streams, features)`` float32 state (an EWMA: the least a
stateful step does), the state donated (updated in place, as the controller's step is), and
its outputs (the row and a score) back on the host before the next step starts: one step in
flight, as a message that arrives alone meets it. Timed per step on the host's clock, after a
warm-up; no sockets, no JSON, no queues, no batching. ``bench.compute_ceiling --floor-s S``
measures it in the ceiling's process (one opening of the chip for both, ~15 s on a TPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

FEATURES = 8
WARMUP_STEPS = 20


def measure(seconds: float = 1.0, streams: int = 16, features: int = FEATURES) -> dict[str, Any]:
    """Per step: p50/p99/mean round trip in ms, and steps a second, over ``seconds`` of steps."""
    import jax
    import jax.numpy as jnp

    def step(state: Any, key: Any, x: Any) -> tuple[Any, Any]:
        row = state[key] * 0.9 + x * 0.1
        return state.at[key].set(row), (row, jnp.sum(row * row))

    compiled = jax.jit(step, donate_argnums=0)
    state = jax.device_put(jnp.zeros((streams, features), jnp.float32))
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((64, features)).astype(np.float32)
    keys = (np.arange(64) % streams).astype(np.int32)
    times: list[float] = []
    n = 0
    end = None
    while True:
        t0 = time.perf_counter()
        state, out = compiled(state, keys[n % 64], xs[n % 64])
        jax.device_get(out)
        t1 = time.perf_counter()
        n += 1
        if n == WARMUP_STEPS:
            end = t1 + seconds
        elif n > WARMUP_STEPS:
            times.append(t1 - t0)
            if end is not None and t1 >= end:
                break
    ms = np.asarray(times) * 1000
    return {"device": str(jax.devices()[0]), "platform": jax.devices()[0].platform, "steps": len(times),
            "round_trip_ms": {"p50": float(np.quantile(ms, 0.5)), "p99": float(np.quantile(ms, 0.99)),
                              "mean": float(ms.mean())},
            "steps_per_s": len(times) / (float(ms.sum()) / 1000), "streams": streams, "features": features}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.device_floor", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--out", default="", help="write the figures as JSON here (default: print them)")
    a = p.parse_args(argv)
    figures = measure(a.seconds, a.streams)
    write_figures(figures, a.out)
    return 0


def write_figures(figures: dict[str, Any], out: str) -> None:
    """A measuring module's figures as JSON: into the file ``out``, or printed when it is empty
    (bench.devices, bench.compute_ceiling and this module's ``--out``)."""
    if out:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(figures, f)
    else:
        print(json.dumps(figures))


if __name__ == "__main__":
    sys.exit(main())
