"""What a float64 input costs (``Description(input_dtype=np.float64)``), on this machine.

    JAX_PLATFORMS=cpu python -m bench.input_dtype [--runs 5] [--out figures.json]

Two figures, each printed as the median and the least of ``--runs`` runs:

- ``decode``: ``JsonCodec.decode`` per message, float32 against float64 (one message a
  frame, and frames of 64), and what splitting each value into a pair of float32s (hi, lo)
  would add on top of a float64 decode. In this process, JAX not involved.
- ``step``: ``Engine.step`` of the default detector on a full batch of B = 256 (256 distinct
  streams, the real pad, transfer and fetch), compiled by ``controller.engine.compile_step``.
  JAX's 64-bit mode is process-wide and fixed once arrays exist, so each configuration runs
  in its own process (``JAX_ENABLE_X64=0|1``): x64 off with float32 input (the default), x64
  on with float32 input, x64 on with float64 input. The default detector casts its input to
  float32 and keeps a float32 state, so the last one measures the path's cost (the wider
  transfer and the cast), not float64 arithmetic.

Rules:
- JAX's 64-bit mode is process-wide: each configuration's step runs in a process of its own; the
  decode runs in this one, without JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

FEATURES = 8  # the default FORKLESS_FEATURES
B = 256  # the default FORKLESS_MAX_BATCH


def _frames(n: int, batch: int) -> list[bytes]:
    from forkless.io_loop.jsontext import dumps

    rng = np.random.default_rng(0)
    xs = (rng.standard_normal((n * batch, FEATURES)) * 1000 + 37000).round(2)
    items = [{"seq": i, "stream": f"s{i % 64}", "x": xs[i].tolist()} for i in range(n * batch)]
    if batch == 1:
        return [dumps(item) for item in items]
    return [dumps(items[i * batch:(i + 1) * batch]) for i in range(n)]


def _per_message_us(fn, frames: list[bytes], batch: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for frame in frames:
            fn(frame)
        best = min(best, time.perf_counter() - t0)
    return best / (len(frames) * batch) * 1e6


def decode_once() -> dict[str, float]:
    from forkless.controller.codec import JsonCodec

    out = {}
    for batch in (1, 64):
        frames = _frames(20_000 // batch, batch)
        f32 = JsonCodec(FEATURES)
        try:
            f64 = JsonCodec(FEATURES, dtype=np.float64)
        except TypeError:  # a codec without input dtypes (the code before them)
            f64 = None
        out[f"decode_f32_us_b{batch}"] = _per_message_us(f32.decode, frames, batch)
        if f64 is not None:
            out[f"decode_f64_us_b{batch}"] = _per_message_us(f64.decode, frames, batch)

            def pair(frame: bytes, decode=f64.decode) -> None:  # the hi/lo alternative
                x = decode(frame).x
                hi = x.astype(np.float32)
                (x - hi).astype(np.float32)

            out[f"decode_f64_pair_us_b{batch}"] = _per_message_us(pair, frames, batch)
    return out


def step_once(dtype: str, seconds: float = 2.0) -> dict[str, float]:
    import jax

    from forkless.controller.config import Config
    from forkless.controller.engine import compile_step
    from forkless.controller.processor import default_processor

    cfg = Config(features=FEATURES, max_batch=B)
    processor = default_processor(cfg)
    if dtype == "float64":
        processor = processor._replace(description=dataclasses.replace(processor.description, input_dtype=np.float64))
    engine = compile_step(processor, cfg)
    rng = np.random.default_rng(0)
    xs = [(rng.standard_normal((B, FEATURES)) * 1000 + 37000).astype(dtype) for _ in range(16)]
    key = np.arange(B, dtype=np.int32)
    for x in xs:  # warm up
        engine.step(x, key)
    times = []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        engine.step(xs[i % len(xs)], key)
        times.append(time.perf_counter() - t0)
        i += 1
    return {"x64": bool(jax.config.jax_enable_x64), "dtype": dtype, "steps": len(times),
            "step_us_median": statistics.median(times) * 1e6}


CONFIGS = (("0", "float32"), ("1", "float32"), ("1", "float64"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.input_dtype", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--out")
    p.add_argument("--only", choices=("decode", "step"))
    p.add_argument("--step-child", metavar="DTYPE", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.step_child:
        print(json.dumps(step_once(args.step_child, args.seconds)))
        return 0
    figures: dict[str, list[float]] = {}  # every run's figure, sorted
    if args.only != "step":
        runs = [decode_once() for _ in range(args.runs)]
        for name in runs[0]:
            figures[name] = sorted(r[name] for r in runs)
    if args.only != "decode":
        for x64, dtype in CONFIGS:
            env = {**os.environ, "JAX_ENABLE_X64": x64, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
            got = []
            for _ in range(args.runs):
                done = subprocess.run([sys.executable, "-m", "bench.input_dtype", "--step-child", dtype,
                                       "--seconds", str(args.seconds)], env=env, capture_output=True, text=True,
                                      check=True)
                got.append(json.loads(done.stdout.strip().splitlines()[-1])["step_us_median"])
            figures[f"step_us_x64_{'on' if x64 == '1' else 'off'}_{dtype}"] = sorted(got)
    print(f"{'':<30} {'median':>8} {'min':>8}  (of {args.runs} runs)")
    for name, runs in figures.items():
        print(f"{name:<30} {statistics.median(runs):>8.3f} {runs[0]:>8.3f}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(figures, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
