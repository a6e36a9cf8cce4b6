"""Step time of the EWMA detector built on ``stream_processor`` against the hand-written step it
replaced (tests/reference_ewma.py), in one process, alternating, both compiled by
``controller.engine.compile_step`` (guarded, state donated, as the controller runs them).

    JAX_PLATFORMS=cpu python -m bench.stream_step [--rounds 9] [--steps 200]

For each case (streams S, batch B, distinct streams per batch): ``rounds`` times, ``steps``
warm steps of the old step, then of the new one (the order swapped every round); prints the
median step time of each and the new/old ratio. F = 8. Batches are drawn from the whole
table; "B/4 distinct" batches hold each stream four times (four occurrence rounds).

Rules:
- Both steps in one process, compiled alike, run alternately, the order swapped every round; medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from forkless.controller.batching import pad_batch
from forkless.controller.config import Config
from forkless.controller.engine import compile_step
from forkless.controller.processor import default_processor
from tests.reference_ewma import reference_ewma_processor

FEATURES = 8
CASES = ((4096, 256, 256), (1_000_000, 256, 256), (4096, 256, 64), (1_000_000, 256, 64), (1_000_000, 1, 1))


def _batches(streams: int, bucket: int, distinct: int, count: int = 8) -> list:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        key = np.repeat(rng.choice(streams, size=distinct, replace=False), bucket // distinct).astype(np.int32)
        rng.shuffle(key)
        x = rng.standard_normal((bucket, FEATURES)).astype(np.float32)
        out.append(jax.device_put(pad_batch(x, key, bucket, streams)))
    return out


def _run(built, state, batches, bucket: int, steps: int) -> tuple:
    step = built.steps[bucket]
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, out, bad = step(state, batches[i % len(batches)])
        jax.block_until_ready((state, out, bad))
        times.append(time.perf_counter() - t0)
    return state, times


def measure(streams: int, bucket: int, distinct: int, rounds: int, steps: int) -> dict:
    cfg = Config(features=FEATURES, max_streams=streams, max_batch=256)
    impls = {"old": compile_step(reference_ewma_processor(cfg.alpha, cfg.threshold, cfg.warmup), cfg),
             "new": compile_step(default_processor(cfg), cfg)}
    states = {name: built.take_state() for name, built in impls.items()}
    batches = _batches(streams, bucket, distinct)
    times: dict[str, list[float]] = {"old": [], "new": []}
    for name, built in impls.items():  # warm up
        states[name], _ = _run(built, states[name], batches, bucket, 50)
    for r in range(rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            states[name], t = _run(impls[name], states[name], batches, bucket, steps)
            times[name] += t
    for leaf_old, leaf_new in zip(jax.tree.leaves(states["old"]), jax.tree.leaves(states["new"])):
        assert np.array_equal(np.asarray(leaf_old), np.asarray(leaf_new))  # the same work was done
    old_us, new_us = (statistics.median(times[k]) * 1e6 for k in ("old", "new"))
    return {"streams": streams, "batch": bucket, "distinct": distinct, "old_us": old_us, "new_us": new_us,
            "ratio": new_us / old_us}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print(f"{'streams':>9} {'B':>4} {'distinct':>8} {'old µs':>8} {'new µs':>8} {'new/old':>7}", flush=True)
    for streams, bucket, distinct in CASES:
        m = measure(streams, bucket, distinct, args.rounds, args.steps)
        print(f"{m['streams']:>9} {m['batch']:>4} {m['distinct']:>8} {m['old_us']:>8.1f} {m['new_us']:>8.1f} "
              f"{m['ratio']:>7.3f}", flush=True)


if __name__ == "__main__":
    main()
