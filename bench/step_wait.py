"""Forkless's batches after a long step: FORKLESS_MAX_WAIT_MS against the step, beside inline.

    JAX_PLATFORMS=cpu python -m bench.step_wait [--repeats 3] [--seconds 2.5] [--max-wait-ms 50]
                                                [--base PATH]

At the bounded window (``bench.run``'s maximum-throughput load), with the heavy step calibrated
to ~1 ms and ~10 ms (``bench.step_cost``): forkless as it ships (``FORKLESS_MAX_WAIT_MS`` 2),
forkless with ``FORKLESS_MAX_WAIT_MS`` above the step (``--max-wait-ms 0``: not run), inline,
and with ``--base`` forkless of another checkout (before a change), rotated in each repeat.
What it was written to show: the micro-batcher (``controller/batching.py``) restarted a
leftover's deadline when it took a full batch; after a step longer than the deadline the next
batch went out with the leftover alone, without topping it up from what was waiting, so
batches alternated full and short (until 2026-12-01: a leftover now begins collecting with the
first chunk added to it). Prints per variant: max msg/s of each repeat and their median, the
mean batch, the CPU µs a message and the cores the design kept busy, and for forkless the
pipelining figure (the share of its IO thread's CPU time that fell in steps, beside the main
thread's share of the time in steps).

Rules:
- The variants are rotated in each repeat; another checkout's forkless runs from its own root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.loads import run_load
from bench.plan import REPO_ROOT, Plan, step_name
from bench.sections import calibrate_steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_wait", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.5, help="each run's length (the first 1 s not counted)")
    p.add_argument("--max-wait-ms", type=float, default=50.0, help="FORKLESS_MAX_WAIT_MS of the second variant")
    p.add_argument("--base", default="", help="another checkout whose forkless runs as a variant too")
    p.add_argument("--out", default="", help="also write every run's figures here (JSON)")
    a = p.parse_args(argv)
    here = REPO_ROOT
    plan = Plan.full()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="forkless-step-wait-") as tmp:
        work = Path(tmp)
        (work / "logs").mkdir()
        calibration = calibrate_steps(plan, work)
        wait = f"{a.max_wait_ms:g}"
        # (name, design, environment, checkout)
        variants = [("forkless", "forkless", {}, here)]
        if a.base:
            variants.insert(0, ("forkless (base)", "forkless", {}, Path(a.base).resolve()))
        if a.max_wait_ms > 0:
            variants.append((f"forkless, FORKLESS_MAX_WAIT_MS={wait}", "forkless", {"FORKLESS_MAX_WAIT_MS": wait},
                             here))
        variants.append(("inline", "inline", {}, here))
        for target in calibration["targets"]:
            cost = step_name(target["target_ms"])
            step = {"cost": cost, "size": calibration["size"], "iters": target["iters"]}
            for rep in range(a.repeats):
                k = rep % len(variants)
                for name, design, env, root in variants[k:] + variants[:k]:
                    side = "base" if root != here else "here"
                    tag = f"{design}-{side}{'-wait' + wait if env else ''}-{cost}-r{rep}"
                    run = run_load(design, "window", plan, work, str(work / f"jax-cache-{design}-{side}"), tag,
                                   env=env, step=step, duration_s=a.seconds, root=root)
                    rows.append({"variant": name, "cost": cost, "step_ms": target["step_ms"],
                                 "throughput_msg_s": run["loadgen"]["throughput_msg_s"],
                                 "batch_size_mean": (run["client"] or {}).get("batch_size_mean"), **run["cpu"],
                                 "overlap": (run["client"] or {}).get("overlap") or {}})
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    print("\n| step | variant | max msg/s (each repeat) | median | mean batch | CPU µs a msg | cores "
          "| IO thread's CPU in steps · main thread in steps |")
    print("|---|---|---|---|---|---|---|---|")
    for cost in dict.fromkeys(r["cost"] for r in rows):
        for name, *_ in variants:
            mine = [r for r in rows if r["cost"] == cost and r["variant"] == name]
            each = ", ".join(f"{r['throughput_msg_s']:,.0f}" for r in mine)
            med = statistics.median(r["throughput_msg_s"] for r in mine)
            print(f"| ~{mine[0]['step_ms']:.1f} ms | {name} | {each} | {med:,.0f} "
                  f"| {statistics.median(r['batch_size_mean'] or 0 for r in mine):.0f} "
                  f"| {statistics.median(r['client_us_per_msg'] or 0 for r in mine):.1f} "
                  f"| {statistics.median(r['client_cores'] or 0 for r in mine):.2f} "
                  f"| {_share(mine, 'io_cpu_in_steps_share')} · {_share(mine, 'steps_wall_share')} |")
    return 0


def _share(rows: list[dict[str, Any]], key: str) -> str:
    """The median of a pipelining share over the repeats (``bench.forkless_client.overlap``), in %."""
    values = [r["overlap"][key] for r in rows if r["overlap"].get(key) is not None]
    return f"{100 * statistics.median(values):.0f}%" if values else "–"


if __name__ == "__main__":
    sys.exit(main())
