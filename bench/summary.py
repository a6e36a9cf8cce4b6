"""From a run's raw runs to its summary: medians over the repeats, per design, load and step cost.

Rules:
- Pure: dicts in, dicts out; no process, no file, no clock.
- A figure is the median over the repeats (``median``: absent values skipped); what a run did not measure
  stays absent (None, or left out), never zero.
"""

from __future__ import annotations

from typing import Any

from bench.plan import DEFAULT_STEP, DESIGNS, FT_DESIGNS, JAX_DESIGNS, LOADS, MAP_DESIGNS, median, step_name


def summarise(runs: list[dict[str, Any]], startup: dict[str, Any], compute: dict[str, Any],
              floor: dict[str, Any], steps: dict[str, Any] | None = None) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for design in DESIGNS:
        mine = [r for r in runs if r["design"] == design and not r["heavy"]]
        if not mine and design in FT_DESIGNS:  # no free-threaded interpreter in this run
            continue
        row: dict[str, Any] = {}
        for load in ("rate_1k", "rate_10k"):
            lats = [r["loadgen"].get("latency_ms") or {} for r in mine if r["load"] == load]
            row[load] = {q: median([lat.get(q) for lat in lats]) for q in ("p50", "p99", "p999")}
        row["throughput_msg_s"] = median([r["loadgen"].get("throughput_msg_s") for r in mine if r["load"] == "window"])
        row["peak_rss_mib"] = max((r["peak_rss_mib"] for r in mine), default=None)
        row["processes"] = max((r["processes"] for r in mine), default=None)
        if design != "io-ceiling":  # the latency budget: median over the repeats of each hop's quantiles
            row["hops_us"] = {load: _median_hops([(r["client"] or {}).get("hops_us") or {} for r in mine
                                                  if r["load"] == load]) for load in ("rate_1k", "rate_10k")}
            row["overlap"] = {load: _median_overlap([r for r in mine if r["load"] == load]) for load in LOADS}
        row["peak_processes"] = max(mine, key=lambda r: r["peak_rss_mib"])["peak_processes"] if mine else []
        row["cpu_us_per_msg"] = {load: cpu_per_message([r for r in mine if r["load"] == load]) for load in LOADS}
        if design in JAX_DESIGNS:
            lags = [(r["client"] or {}).get("loop_lag_ms") or {} for r in mine if r["load"] == "rate_1k"]
            row["loop_lag_ms_1k"] = {q: median([lag.get(q) for lag in lags]) for q in ("p50", "p99")}
            heavy = [r for r in runs if r["design"] == design and r["heavy"]]
            hl = [(r["client"] or {}).get("loop_lag_ms") or {} for r in heavy]
            row["loop_lag_ms_heavy"] = {q: median([lag.get(q) for lag in hl]) for q in ("p50", "p99")}
            row["heavy_latency_ms"] = {q: median([(r["loadgen"].get("latency_ms") or {}).get(q) for r in heavy])
                                       for q in ("p50", "p99")}
            row["heavy_step_ms"] = median([(r["client"] or {}).get("step_ms_mean") for r in heavy])
            after = [(r["client"] or {}).get("compilations_after_warmup") for r in runs if r["design"] == design]
            row["compilations_after_warmup"] = max((a for a in after if a is not None), default=None)
            row["first_result_s"] = startup.get(design, {})
        summary[design] = row
    summary["compute-ceiling"] = {"throughput_msg_s": compute.get("throughput_msg_s")}
    if compute.get("device_floor"):
        summary["device_floor"] = compute["device_floor"]
    summary["idle_loop_lag_ms"] = floor
    if steps is not None:
        summary["step_map"] = summarise_steps(steps, summary, runs)
    return summary


def cpu_per_message(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Medians over ``runs`` of the CPU µs a message: the design's whole process tree (sampled by
    ``TreeSampler``), and forkless's IO thread and main thread apart (its own clocks of them)."""
    own = [((r.get("client") or {}).get("cpu_us_per_msg") or {}) for r in runs]
    return {"process": median([r["cpu"].get("client_us_per_msg") for r in runs]),
            "io_thread": median([o.get("io_thread") for o in own]),
            "main_thread": median([o.get("main_thread") for o in own])}


OVERLAP = ("io_cpu_in_steps_share", "io_busy_in_steps", "steps_wall_share", "io_cores")


def _median_overlap(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Medians over ``runs`` of the client's pipelining figures (``bench.forkless_client.overlap``);
    empty for a design that has none."""
    each = [(r.get("client") or {}).get("overlap") or {} for r in runs]
    return {k: median([o.get(k) for o in each]) for k in OVERLAP} if any(each) else {}


def _median_hops(per_run: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    hops = [hop for hop in (per_run[0] if per_run else {})]
    return {hop: {q: median([run.get(hop, {}).get(q) for run in per_run]) for q in ("p50", "p99")} for hop in hops}


def summarise_steps(section: dict[str, Any], summary: dict[str, Any],
                    main_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per step cost and design: medians over the repeats of p50/p99 at 1,000 msg/s, the ping
    round trip, the step time the design saw, the maximum throughput and the CPU used at it
    (the default step's from the main table's window runs); and forkless's ratios to inline."""
    calibration = section["calibration"]
    by_target = {step_name(t["target_ms"]): t for t in calibration["targets"]}
    out: dict[str, Any] = {"size": calibration["size"], "platform": calibration.get("platform"),
                           "device": calibration.get("device"), "costs": {}}
    for cost in (DEFAULT_STEP, *section["steps"]):
        target = by_target.get(cost, {})
        row: dict[str, Any] = {"target_ms": target.get("target_ms"), "iters": target.get("iters"),
                               "calibrated_step_ms": target.get("step_ms"),
                               "calibrated_step_ms_full": target.get("step_ms_full"), "designs": {}}
        for design in MAP_DESIGNS:
            mine = [r for r in section["runs"] if r["design"] == design and r["cost"] == cost]
            rate = [r for r in mine if r["load"] == "rate_1k"]
            window = [r for r in mine if r["load"] == "window"]
            main = summary.get(design) or {}
            cpu_runs = window or ([r for r in main_runs if r["design"] == design and r["load"] == "window"
                                   and not r["heavy"]] if cost == DEFAULT_STEP else [])
            if rate:
                latency = {q: median([(r["loadgen"].get("latency_ms") or {}).get(q) for r in rate])
                           for q in ("p50", "p99", "p999")}
            else:  # no ping runs at the default step (--quick): the main table's latencies
                latency = dict(main.get("rate_1k") or {})
            pings = [(r.get("probe") or {}) for r in rate]
            row["designs"][design] = {
                "rate_1k": latency,
                "throughput_msg_s": (median([r["loadgen"].get("throughput_msg_s") for r in window]) if window
                                     else main.get("throughput_msg_s") if cost == DEFAULT_STEP else None),
                "ping_ms": {q: median([(p.get("rtt_ms") or {}).get(q) for p in pings]) for q in ("p50", "p99", "max")},
                "pings": sum(p.get("pings") or 0 for p in pings),
                "pings_lost": sum(p.get("lost") or 0 for p in pings),
                "step_ms_mean": median([(r["client"] or {}).get("step_ms_mean") for r in mine]),
                "batch_size_mean_1k": median([(r["client"] or {}).get("batch_size_mean") for r in rate]),
                "batch_size_mean_window": median([(r["client"] or {}).get("batch_size_mean") for r in cpu_runs]),
                # at the maximum throughput: cores the design and the generator kept busy, the design's CPU a message
                "cpu_window": {k: median([(r.get("cpu") or {}).get(k) for r in cpu_runs])
                               for k in ("client_cores", "loadgen_cores", "client_us_per_msg")},
                # at the maximum throughput: pipelining (forkless only: its IO thread against its steps)
                "overlap_window": _median_overlap(cpu_runs),
                "answered_all": all(r["loadgen"].get("sent") == r["loadgen"].get("answered") for r in mine),
                "runs": len(mine),
            }
        f, i = row["designs"]["forkless"], row["designs"]["inline"]

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a and b else None

        # forkless's throughput over inline's in each repeat (the two ran minutes apart at most):
        # the spread says how far the machine's other work moved the ratio of the medians
        windows = [r for r in section["runs"] if r["cost"] == cost and r["load"] == "window"] or (
            [r for r in main_runs if r["load"] == "window" and not r["heavy"]] if cost == DEFAULT_STEP else [])
        by_repeat: dict[str, dict[str, float]] = {}
        for r in windows:
            by_repeat.setdefault(r["tag"].rsplit("-r", 1)[-1], {})[r["design"]] = r["loadgen"].get("throughput_msg_s")
        row["forkless_vs_inline"] = {
            "p50_1k": ratio(f["rate_1k"].get("p50"), i["rate_1k"].get("p50")),
            "p99_1k": ratio(f["rate_1k"].get("p99"), i["rate_1k"].get("p99")),
            "throughput": ratio(f["throughput_msg_s"], i["throughput_msg_s"]),
            "throughput_by_repeat": [ratio(pair.get("forkless"), pair.get("inline"))
                                     for _, pair in sorted(by_repeat.items())],
            "ping_p99": ratio(f["ping_ms"]["p99"], i["ping_ms"]["p99"]),
        }
        out["costs"][cost] = row
    return out
