"""One packed array each way, or one array per input and output: a step's round trip both ways.

    python -m bench.packed_io [--seconds 1] [--sizes 1,256] [--rounds 3] [--out figures.json]

Rules: the default detector (3 inputs: x, key, valid; 4 outputs with the finiteness flags) on
one device, through the engine's own layout (controller/device/layouts.py ``OneDevice``) with
``packed`` forced each way: "arrays" hands the compiled step a padded ``Batch`` and fetches its
outputs as the engine does (read in place on the CPU, ``jax.device_get`` elsewhere); "packed"
hands it one uint32 array and fetches one byte array. Each step is timed from the batch's
layout to its results on the host (one step in flight), after a warm-up, at each batch size of
``--sizes``; the two modes alternate ``--rounds`` times so the machine's noise lands in both.
The engine packs on an accelerator and not on the CPU (``layouts.accelerated``); this says by
how much either choice wins where it is run (bench/tpu.sh runs it on the TPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

from bench.device_floor import write_figures

WARMUP_STEPS = 20
MODES = ("arrays", "packed")


def _steps(packed: bool, size: int, features: int, streams: int) -> tuple[Any, Any, Any]:
    """A layout of ``packed``, its fresh state and the step compiled for ``size``'s bucket."""
    import jax

    from forkless.controller.config import Config
    from forkless.controller.device.layouts import OneDevice
    from forkless.controller.processor import default_processor

    config = Config(features=features, max_streams=streams, max_batch=max(size, 1))
    processor = default_processor(config)
    layout = OneDevice(processor, config, jax.devices()[0], packed=packed)
    state = layout.fresh()
    bucket = config.buckets[-1]
    layout.check(processor.step, state, bucket)
    template = layout.compile_template(state)(state)  # unused: no guard reset compiled in (one step at a time)
    compiled = layout.lower(layout.jit(processor.step, False), state, template, bucket).compile()
    return layout, state, lambda state, batch: compiled(state, batch, template)


def measure(seconds: float = 1.0, sizes: tuple[int, ...] = (1, 256), rounds: int = 3, features: int = 8,
            streams: int = 4096) -> dict[str, Any]:
    """Per mode and batch size: the round trip's p50/p99/mean in ms and steps a second."""
    import jax

    from forkless.controller.engine import _read_in_place

    device = jax.devices()[0]
    fetch = _read_in_place if device.platform == "cpu" else jax.device_get
    rng = np.random.default_rng(0)
    figures: dict[str, Any] = {"device": str(device), "platform": device.platform, "features": features,
                               "streams": streams, "rounds": rounds, "sizes": {}}
    for size in sizes:
        xs = rng.standard_normal((64, size, features)).astype(np.float32)
        keys = rng.integers(0, streams, (64, size)).astype(np.int32)
        built = {mode: list(_steps(mode == "packed", size, features, streams)) for mode in MODES}
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(rounds):
            for mode in MODES:
                layout, state, compiled = built[mode]
                n, end = 0, None
                while True:
                    t0 = time.perf_counter()
                    _bucket, batch, route, _written = layout.lay_out(xs[n % 64], keys[n % 64])
                    state, *ran = compiled(state, batch)
                    layout.results(tuple(ran), size, route, fetch)
                    t1 = time.perf_counter()
                    n += 1
                    if n == WARMUP_STEPS:
                        end = t1 + seconds / rounds
                    elif n > WARMUP_STEPS:
                        times[mode].append(t1 - t0)
                        if end is not None and t1 >= end:
                            break
                built[mode][1] = state
        per_mode = {}
        for mode in MODES:
            ms = np.asarray(times[mode]) * 1000
            per_mode[mode] = {"steps": len(ms), "round_trip_ms": {"p50": float(np.quantile(ms, 0.5)),
                                                                  "p99": float(np.quantile(ms, 0.99)),
                                                                  "mean": float(ms.mean())},
                              "steps_per_s": len(ms) / (float(ms.sum()) / 1000)}
        per_mode["packed_over_arrays_p50"] = (per_mode["packed"]["round_trip_ms"]["p50"]
                                              / per_mode["arrays"]["round_trip_ms"]["p50"])
        figures["sizes"][str(size)] = per_mode
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.packed_io", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=1.0, help="per mode and batch size, over all rounds")
    p.add_argument("--sizes", default="1,256", help="batch sizes (messages a step), comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="", help="write the figures as JSON here (default: print them)")
    a = p.parse_args(argv)
    write_figures(measure(a.seconds, tuple(int(s) for s in a.sizes.split(",")), a.rounds), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
