"""Several feeds: the maximum throughput with 1, 4 and 16 feeds at the same total load.

    python -m bench.feeds_scaling [--quick] [--repeats 3] [--out figures.json]

For N in (1, 4, 16): one load generator (``bench.loadgen --mode window --connections N``,
in its own process) serves N connections, each keeping ``WINDOW / N`` messages in flight, so
the total load is the same closed loop of ``WINDOW`` messages whatever N; the forkless client
(``bench.forkless_client``, the app as users run it) opens them as N feeds with
``FORKLESS_FEEDS`` (N = 1 is the one-feed path, without the router). One generator process
for all N connections, so that N does not also change how many processes share the cores.
Reported: the total throughput (the sum of the generators' result replies per second in
their measurement windows), median over the repeats, which alternate N in rotated order so
the machine's noise lands on every N; and the ratio to N = 1.

Target (issue 13): total throughput with 16 feeds >= 0.8x that of 1 feed.

Rules:
- One generator process serves all N connections, and the total load is the same whatever N: only the
  number of feeds changes.
- N is rotated between repeats; a figure is the median over them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.loadgen import start_loadgen, wait_result
from bench.plan import REPO_ROOT
from bench.processes import client_env, stop_tree

FEEDS = (1, 4, 16)
WINDOW = 1024
STREAMS = 16
FEATURES = 8
TARGET = 0.8


def one_run(feeds: int, duration_s: float, warmup_s: float, cache_dir: str, work: Path) -> dict[str, Any]:
    """One generator serving N connections and one forkless client; the summed throughput."""
    args = ["--mode", "window", "--window", str(WINDOW // feeds), "--duration", str(duration_s),
            "--warmup-s", str(warmup_s), "--streams", str(STREAMS), "--features", str(FEATURES),
            "--host", "127.0.0.1", "--port", "0", "--connections", str(feeds)]
    generator, url = start_loadgen(args)
    figures = work / f"feeds{feeds}.json"
    client = subprocess.Popen([sys.executable, "-m", "bench.forkless_client", "--out", str(figures),
                               "--url", url if feeds == 1 else json.dumps([url] * feeds)],
                              cwd=REPO_ROOT, env={**client_env(cache_dir), "FORKLESS_STATUS_S": "0"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        result = wait_result(generator, timeout=duration_s + 90)
    finally:
        stop_tree(client, 30.0)
    per = result.get("per_connection") or [result]
    lost = sum(result.get(k, 0) for k in ("missing", "duplicates", "unexpected", "mismatched"))
    return {"feeds": feeds, "throughput_msg_s": result["throughput_msg_s"],
            "per_feed_msg_s": [round(r["throughput_msg_s"]) for r in per], "lost": lost}


def run(repeats: int, duration_s: float, warmup_s: float) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="forkless-feeds-") as tmp:
        work = Path(tmp)
        cache_dir = str(work / "jax-cache")
        for k in range(repeats):
            order = FEEDS[k % len(FEEDS):] + FEEDS[:k % len(FEEDS)]
            for feeds in order:
                r = one_run(feeds, duration_s, warmup_s, cache_dir, work)
                print(f"  {feeds:>2} feeds: {r['throughput_msg_s']:,.0f} msg/s  (lost {r['lost']})", flush=True)
                runs.append(r)
    median = {n: statistics.median(r["throughput_msg_s"] for r in runs if r["feeds"] == n) for n in FEEDS}
    return {"runs": runs, "median_msg_s": median, "ratio_to_1": {n: median[n] / median[1] for n in FEEDS},
            "target": TARGET, "window": WINDOW, "repeats": repeats, "duration_s": duration_s,
            "date": time.strftime("%Y-%m-%d")}


def markdown(figures: dict[str, Any]) -> str:
    """The table for bench/README.md."""
    lines = ["| feeds | max throughput (median, msg/s) | ratio to 1 feed |", "|---|---|---|"]
    for n in FEEDS:
        key = n if n in figures["median_msg_s"] else str(n)
        lines.append(f"| {n} | {figures['median_msg_s'][key]:,.0f} | {figures['ratio_to_1'][key]:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.feeds_scaling", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one short repeat (a smoke run)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="write the figures as JSON here")
    a = p.parse_args(argv)
    repeats, duration_s, warmup_s = (1, 1.5, 0.3) if a.quick else (a.repeats, 4.0, 1.0)
    figures = run(repeats, duration_s, warmup_s)
    print(markdown(figures), end="")
    ratio = figures["ratio_to_1"][16]
    print(f"16 feeds / 1 feed: {ratio:.2f} (target >= {TARGET}): {'met' if ratio >= TARGET else 'MISSED'}")
    if a.out:
        Path(a.out).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
