"""State scaling: the step's cost and the process's memory against the size of the state table.

    python -m bench.state_scaling [--quick] [--out figures.json]

For S (``max_streams``) in 4,096 … 10,000,000 and batch sizes B in (1, 256), F = 8: the
median time of the default step, compiled ahead of time with the state donated, warm,
state kept on the device (``jax.block_until_ready`` after each call); the compute ceiling
B / step time; the state's bytes. The same for the step as it was before issue 10 (a
``while_loop`` carrying the whole table, no donation) at S = 4,096 and 1,000,000, for a
before/after. And the peak RSS of a child process that only builds the state and runs
donated steps, at S = 10^6 and 10^7, F = 8 and 64, against the state's bytes.

Each batch holds B distinct streams spread over the whole table (one occurrence round),
so every S does the same work per step; repeated streams add rounds whatever S is.

The B = 256 step times are measured twice: compiled as the controller compiles it (no op
split across threads on the CPU: ``controller.device.compiled.unsplit_cpu_ops``), and as a plain
``jax.jit`` compiles it, which is how the controller compiled it before. XLA:CPU splits an
op across its thread pool when its cost model, which counts the whole table for a gather
or scatter into it, says the op is big; so at large S a plain compile makes the step's
gathers and scatters 2-task parallel ops, each paying a hand-off to a second thread.

Targets: step time at S = 10^6 and 10^7 within 1.3x of S = 4,096 for the same B; peak RSS
at S = 10^7, F = 8 at most the state's bytes + 0.3 GB.

Rules:
- Every S does the same work per step: a batch's B distinct streams are spread over the whole table.
- Peak RSS is measured in a child process that builds only the state.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
FEATURES = 8
SIZES = (4096, 65536, 1_000_000, 10_000_000)
BATCHES = (1, 256)
OLD_SIZES = (4096, 1_000_000)
RSS_CASES = ((1_000_000, 8), (1_000_000, 64), (10_000_000, 8), (10_000_000, 64))
STEP_RATIO_TARGET = 1.3
RSS_HEADROOM_BYTES = 300_000_000


def _old_ewma_step(alpha: float = 0.05, threshold: float = 4.0, warmup: int = 20, eps: float = 1e-6) -> Any:
    """The EWMA step before issue 10, kept for the before/after: the table is the loop carry."""
    import jax
    import jax.numpy as jnp

    from forkless.controller.processor import EWMAState, _occurrence_rank

    def step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        x = batch.x.astype(jnp.float32)
        spare = state.count.shape[0] - 1
        key = jnp.where(batch.valid, batch.key, spare)
        rank = jnp.where(batch.valid, _occurrence_rank(key), -1)
        rounds = jnp.max(rank) + 1

        def body(carry: tuple) -> tuple:
            r, st, z, n = carry
            active = rank == r
            idx = jnp.where(active, key, spare)
            cnt, mean, var = st.count[idx], st.mean[idx], st.var[idx]
            first = (cnt == 0)[:, None]
            d = x - mean
            z_r = jnp.where(first, 0.0, d / jnp.sqrt(var + eps))
            new_mean = jnp.where(first, x, mean + alpha * d)
            new_var = jnp.where(first, 0.0, (1.0 - alpha) * (var + alpha * d * d))
            st = EWMAState(st.count.at[idx].set(cnt + 1), st.mean.at[idx].set(new_mean),
                           st.var.at[idx].set(new_var))
            return r + 1, st, jnp.where(active[:, None], z_r, z), jnp.where(active, cnt, n)

        init = (jnp.int32(0), state, jnp.zeros_like(x), jnp.zeros(key.shape, jnp.int32))
        _, state, z, n = jax.lax.while_loop(lambda c: c[0] < rounds, body, init)
        score = jnp.max(jnp.abs(z), axis=1)
        return state, {"z": z, "score": score, "anomaly": (n >= warmup) & (score > threshold) & batch.valid}

    return step


def _batches(streams: int, bucket: int, count: int, seed: int = 0) -> list[Any]:
    """``count`` device batches of ``bucket`` distinct streams drawn from the whole table."""
    import jax

    from forkless.controller.batching import pad_batch

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        key = rng.choice(streams, size=bucket, replace=False).astype(np.int32)
        x = rng.standard_normal((bucket, FEATURES)).astype(np.float32)
        out.append(jax.device_put(pad_batch(x, key, bucket, streams)))
    return out


def _state_bytes(state: Any) -> int:
    import jax

    return sum(leaf.nbytes for leaf in jax.tree.leaves(state))


def time_step(streams: int, bucket: int, iterations: int, old: bool = False, split: bool = False) -> dict:
    """Median wall time of one warm step (µs): the new step donated, or the old one not;
    compiled as the controller does, or (``split``, and ``old``) by a plain ``jax.jit``."""
    import contextlib

    import jax

    from forkless.controller.config import Config
    from forkless.controller.device.compiled import unsplit_cpu_ops
    from forkless.controller.processor import default_processor

    cfg = Config(features=FEATURES, max_streams=streams)
    processor = default_processor(cfg)
    step_fn = _old_ewma_step(cfg.alpha, cfg.threshold, cfg.warmup) if old else processor.step
    jitted = jax.jit(step_fn) if old else jax.jit(step_fn, donate_argnums=0)
    batches = _batches(streams, bucket, 8)
    state = jax.device_put(processor.init(cfg))
    state_bytes = _state_bytes(state)
    with contextlib.nullcontext() if old or split else unsplit_cpu_ops(jax.devices()):
        step = jitted.lower(state, batches[0]).compile()
    for i in range(max(10, iterations // 10)):  # warm up: caches, page faults, thread pool
        state, out = step(state, batches[i % len(batches)])
        jax.block_until_ready((state, out))
    times = []
    for i in range(iterations):
        t0 = time.perf_counter()
        state, out = step(state, batches[i % len(batches)])
        jax.block_until_ready((state, out))
        times.append(time.perf_counter() - t0)
    del state, out
    step_us = statistics.median(times) * 1e6
    return {"streams": streams, "batch": bucket, "features": FEATURES, "old": old, "split": split,
            "step_us": step_us, "ceiling_msg_s": bucket / step_us * 1e6, "state_bytes": state_bytes,
            "iterations": iterations}


def _child(streams: int, features: int, steps: int) -> dict:
    """In a child process: build the state, run ``steps`` donated steps, report the peak RSS."""
    import jax

    from forkless.controller.config import Config
    from forkless.controller.processor import default_processor

    cfg = Config(features=features, max_streams=streams)
    processor = default_processor(cfg)
    state = jax.device_put(processor.init(cfg))
    state_bytes = _state_bytes(state)
    rng = np.random.default_rng(0)
    from forkless.controller.batching import pad_batch

    batch = pad_batch(rng.standard_normal((256, features)).astype(np.float32),
                      rng.choice(streams, size=256, replace=False).astype(np.int32), 256, streams)
    step = jax.jit(processor.step, donate_argnums=0).lower(state, batch).compile()
    for _ in range(steps):
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    return {"streams": streams, "features": features, "state_bytes": state_bytes,
            "peak_rss_bytes": _peak_rss_bytes(), "steps": steps}


def _peak_rss_bytes() -> int:
    """This process's peak RSS: ``VmHWM``, the high-water mark of its own address space.

    Not ``getrusage(...).ru_maxrss``: Linux carries that across ``fork`` + ``exec``, so a
    child started from this (large) benchmark process would report the parent's size.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: KiB, best effort


def _run_child(*args: str) -> Any:
    """Run this module with ``args`` in a fresh interpreter; its last stdout line, as JSON."""
    cmd = [sys.executable, "-m", "bench.state_scaling", *args]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def peak_rss(streams: int, features: int, steps: int = 50) -> dict:
    """Run ``_child`` in a fresh interpreter (so nothing else is in its RSS) and return its figures."""
    return _run_child("--child", f"{streams},{features},{steps}")


def _step_iterations(streams: int, scale: float) -> int:
    base = {4096: 400, 65536: 400, 1_000_000: 300, 10_000_000: 200}[streams]
    return max(20, int(base * scale))


def measure(quick: bool = False) -> dict:
    """Every figure of the module docstring, as a dict; ``quick`` runs fewer sizes and iterations."""
    sizes = SIZES[:1] + SIZES[2:3] if quick else SIZES
    rss_cases = RSS_CASES[:1] if quick else RSS_CASES
    scale = 0.25 if quick else 1.0
    steps = [time_step(s, b, _step_iterations(s, scale)) for s in sizes for b in BATCHES]
    old = [time_step(s, b, max(5, int((200 if s <= 65536 else 20) * scale)), old=True)
           for s in OLD_SIZES if s in sizes for b in BATCHES]
    split = [time_step(s, 256, _step_iterations(s, scale), split=True) for s in sizes]
    baseline = peak_rss(4096, 8)  # the interpreter, JAX and XLA, with a state of 300 kB
    rss = [peak_rss(s, f) for s, f in rss_cases]
    return {"steps": steps, "old": old, "steps_split": split, "rss_baseline": baseline, "rss": rss,
            "targets": _targets(steps, rss, split)}


def _ratios(steps: list[dict]) -> dict[str, float]:
    base = {r["batch"]: r["step_us"] for r in steps if r["streams"] == SIZES[0]}
    return {f"S={r['streams']},B={r['batch']}": r["step_us"] / base[r["batch"]]
            for r in steps if r["streams"] >= 1_000_000}


def _targets(steps: list[dict], rss: list[dict], split: list[dict]) -> dict:
    ratios = _ratios(steps)
    ratios_split = _ratios(split)
    headroom = {f"S={r['streams']},F={r['features']}": r["peak_rss_bytes"] - r["state_bytes"] for r in rss}
    big = [r for r in rss if r["streams"] == 10_000_000 and r["features"] == 8]
    return {"step_ratio_vs_4096": ratios,
            "step_ratio_ok": all(v <= STEP_RATIO_TARGET for v in ratios.values()),
            "step_ratio_split_vs_4096": ratios_split,
            "rss_minus_state_bytes": headroom,
            "rss_ok": all(r["peak_rss_bytes"] <= r["state_bytes"] + RSS_HEADROOM_BYTES for r in big) if big else None}


def table(figures: dict) -> str:
    """The figures as markdown tables."""
    mb = 1e6
    base = {r["batch"]: r["step_us"] for r in figures["steps"] if r["streams"] == SIZES[0]}
    lines = [f"Donated O(B) step, F={FEATURES}, median of warm steps:", "",
             "| S (max_streams) | B | step µs | vs S=4096 | ceiling msg/s | state MB |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in figures["steps"]:
        lines.append(f"| {r['streams']:,} | {r['batch']} | {r['step_us']:.1f} | "
                     f"{r['step_us'] / base[r['batch']]:.2f}x | {r['ceiling_msg_s']:,.0f} | "
                     f"{r['state_bytes'] / mb:,.1f} |")
    if figures["old"]:
        new = {(r["streams"], r["batch"]): r["step_us"] for r in figures["steps"]}
        lines += ["", "Before/after (old: while_loop carrying the table, no donation):", "",
                  "| S | B | old step µs | new step µs | speed-up |", "|---:|---:|---:|---:|---:|"]
        for r in figures["old"]:
            n = new[(r["streams"], r["batch"])]
            lines.append(f"| {r['streams']:,} | {r['batch']} | {r['step_us']:,.1f} | {n:.1f} | "
                         f"{r['step_us'] / n:,.1f}x |")
    lines += ["", "B=256 compiled by a plain jax.jit (XLA:CPU splits the table ops across threads; "
              "the controller's compile before this was measured), same run:", "",
              "| S | B | step µs | vs S=4096 | controller's compile µs | ceiling msg/s |",
              "|---:|---:|---:|---:|---:|---:|"]
    base1 = figures["steps_split"][0]["step_us"]
    ours = {(r["streams"], r["batch"]): r["step_us"] for r in figures["steps"]}
    for r in figures["steps_split"]:
        lines.append(f"| {r['streams']:,} | {r['batch']} | {r['step_us']:.1f} | {r['step_us'] / base1:.2f}x | "
                     f"{ours[(r['streams'], r['batch'])]:.1f} | {r['ceiling_msg_s']:,.0f} |")
    b = figures["rss_baseline"]
    lines += ["", "Peak RSS of a child holding the state and running 50 donated steps (B=256):", "",
              "| S | F | state MB | peak RSS MB | RSS - state MB |", "|---:|---:|---:|---:|---:|"]
    for r in [b, *figures["rss"]]:
        lines.append(f"| {r['streams']:,} | {r['features']} | {r['state_bytes'] / mb:,.1f} | "
                     f"{r['peak_rss_bytes'] / mb:,.1f} | {(r['peak_rss_bytes'] - r['state_bytes']) / mb:,.1f} |")
    t = figures["targets"]
    ratios = ", ".join(f"{k}: {v:.2f}x" for k, v in t["step_ratio_vs_4096"].items())
    ratios1 = ", ".join(f"{k}: {v:.2f}x" for k, v in t["step_ratio_split_vs_4096"].items())
    lines += ["", f"Target step time within {STEP_RATIO_TARGET}x of S=4096: "
              f"{'met' if t['step_ratio_ok'] else 'NOT met'} ({ratios}); "
              f"a plain jax.jit's split ops: {ratios1}"]
    if t["rss_ok"] is not None:
        lines.append(f"Target peak RSS at S=10M, F=8 <= state + {RSS_HEADROOM_BYTES / 1e9:.1f} GB: "
                     f"{'met' if t['rss_ok'] else 'NOT met'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.state_scaling", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="S = 4096 and 10^6 only, fewer iterations")
    p.add_argument("--out", default="", help="also write the figures as JSON here")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)  # "S,F,steps": the RSS child
    a = p.parse_args(argv)
    if a.child:
        streams, features, steps = (int(v) for v in a.child.split(","))
        print(json.dumps(_child(streams, features, steps)))
        return 0
    figures = measure(a.quick)
    print(table(figures))
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(figures, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
