"""A/B of the forkless design between two checkouts, in one run: ``python -m bench.ab --base PATH``.

Each load of ``bench.run`` (1,000 and 10,000 msg/s, and the bounded window for maximum
throughput) runs against the forkless client of this checkout (B) and of ``--base`` (A),
alternating A B A B … so drift of a shared machine falls on both; the load generator is this
checkout's. Prints medians side by side and the ratio B/A per figure. For "did a change keep
the figures within noise" (the architecture refactor), not for the dated report. ``--design-a``/``-b``
``forkless-ft`` runs a side on the free-threaded interpreter (FORKLESS_BENCH_FT_PYTHON), so the two
builds, or two settings on the free-threaded one, can be compared the same way.

Rules:
- Each side's design runs from its own checkout (``run_load(..., root=)``); the load generator, the plan
  and the table are this checkout's.
- The sides alternate within the run, so a drift of the machine falls on both; a figure is a median over
  the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.loads import run_load
from bench.plan import FT_PYTHON, REPO_ROOT, Plan
from bench.processes import use_unix_sockets

FIGURES = (("rate_1k", "p50"), ("rate_1k", "p99"), ("rate_10k", "p50"), ("rate_10k", "p99"), ("window", "msg/s"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the other checkout (its bench/forkless_client.py runs as A); "
                   "'.' for this one, with --env-a/--env-b to A/B a setting")
    p.add_argument("--env-a", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable of side A's client (repeatable), e.g. FORKLESS_STEPS_IN_FLIGHT=1")
    p.add_argument("--env-b", action="append", default=[], metavar="NAME=VALUE", help="the same for side B")
    p.add_argument("--design-a", choices=("forkless", "forkless-ft"), default="forkless",
                   help="side A's design: forkless-ft runs it on FORKLESS_BENCH_FT_PYTHON (bench/plan.py)")
    p.add_argument("--design-b", choices=("forkless", "forkless-ft"), default="forkless", help="side B's")
    p.add_argument("--plan", choices=("full", "tpu"), default="full",
                   help="each run's length: full (4 s, the default) or tpu (2.5 s, bench/tpu.sh's)")
    p.add_argument("--unix", action="store_true",
                   help="every socket a unix-domain one, no inet socket (a host without TCP: bench/tpu.sh --ab)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the raw runs here as JSON")
    p.add_argument("--loads", default="rate_1k,rate_10k,window",
                   help="which loads, comma-separated (one alone takes more repeats in the same time)")
    p.add_argument("--hops", action="store_true",
                   help="also the client's own latency budget: each hop's p50 (µs) and its CPU µs a message "
                        "(the process's, and its IO and main threads' apart) and the messages a step")
    p.add_argument("--heavy-iters", type=int, default=0,
                   help="both sides run bench.heavy's step with this many matmuls a batch (0: the default step)")
    p.add_argument("--heavy-size", type=int, default=0, help="... of this size (0: bench.heavy's HEAVY_SIZE)")
    a = p.parse_args(argv)
    loads = [load for load in a.loads.split(",") if load]
    unknown = sorted(set(loads) - {load for load, _ in FIGURES})
    if unknown:
        p.error(f"--loads: {', '.join(unknown)} is not one of rate_1k, rate_10k, window")
    roots = {"A": Path(a.base).resolve(), "B": REPO_ROOT}
    envs = {"A": _env(p, a.env_a), "B": _env(p, a.env_b)}
    designs = {"A": a.design_a, "B": a.design_b}
    if "forkless-ft" in designs.values() and not FT_PYTHON:
        p.error("forkless-ft needs FORKLESS_BENCH_FT_PYTHON: a free-threaded interpreter (a venv's python)")
    plan = Plan.full() if a.plan == "full" else Plan.tpu()
    if a.unix:
        use_unix_sockets()
    step = {"size": a.heavy_size, "iters": a.heavy_iters} if a.heavy_iters > 0 else None
    runs: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "logs").mkdir()
        for side in roots:  # warm each side's compilation cache once, not counted
            cache = str(work / f"cache-{side}")
            run_load(designs[side], "rate_1k", Plan.quick(), work, cache, f"warm-{side}", env=envs[side],
                     root=roots[side], heavy=step is not None, step=step)
        for rep in range(a.repeats):
            for load in loads:
                for side in ("A", "B") if rep % 2 == 0 else ("B", "A"):
                    r = run_load(designs[side], load, plan, work, str(work / f"cache-{side}"), f"{side}-{load}-{rep}",
                                 env=envs[side], root=roots[side], heavy=step is not None, step=step)
                    lg = r["loadgen"]
                    if load == "window":
                        runs.setdefault((side, "window msg/s"), []).append(lg.get("throughput_msg_s"))
                    else:
                        for q in ("p50", "p99"):
                            runs.setdefault((side, f"{load} {q}"), []).append((lg.get("latency_ms") or {}).get(q))
                    runs.setdefault((side, "peak RSS MiB"), []).append(r["peak_rss_mib"])
                    if a.hops:
                        for hop, h in ((r.get("client") or {}).get("hops_us") or {}).items():
                            runs.setdefault((side, f"{load} {hop} p50 µs"), []).append(h.get("p50"))
                        runs.setdefault((side, f"{load} CPU µs/msg"), []).append(r["cpu"]["client_us_per_msg"])
                        # how full the steps ran: more steps in flight may dispatch smaller batches
                        runs.setdefault((side, f"{load} messages a step"), []).append(
                            (r.get("client") or {}).get("batch_size_mean"))
                        own = (r.get("client") or {}).get("cpu_us_per_msg") or {}
                        for thread in ("io_thread", "main_thread"):
                            runs.setdefault((side, f"{load} {thread} CPU µs/msg"), []).append(own.get(thread))
    print(f"\nA = {a.design_a} {roots['A']} {' '.join(a.env_a)}\nB = {a.design_b} {roots['B']} {' '.join(a.env_b)}\n"
          f"medians over {a.repeats} alternating repeats")
    print("| figure | A | B | B/A |\n|---|---|---|---|")
    names = ([f"{load} {q}" for load, q in FIGURES if load != "window" and load in loads]
             + ["window msg/s"] * ("window" in loads) + ["peak RSS MiB"])
    names += sorted({name for side, name in runs if side == "A" and name not in names})  # --hops
    for name in names:
        va = statistics.median([v for v in runs.get(("A", name), []) if v is not None] or [float("nan")])
        vb = statistics.median([v for v in runs.get(("B", name), []) if v is not None] or [float("nan")])
        print(f"| {name} | {va:,.3f} | {vb:,.3f} | {vb / va if va else float('nan'):.2f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({f"{s} {n}": v for (s, n), v in runs.items()}, indent=1))
    return 0


def _env(p: argparse.ArgumentParser, pairs: list[str]) -> dict[str, str]:
    """``NAME=VALUE`` pairs as a dict; a pair without ``=`` is a usage error."""
    bad = [pair for pair in pairs if "=" not in pair]
    if bad:
        p.error(f"--env-a/--env-b take NAME=VALUE, not {', '.join(bad)}")
    return dict(pair.split("=", 1) for pair in pairs)


if __name__ == "__main__":
    sys.exit(main())
