"""A run's tables: the text report, the Markdown blocks of the benchmark's documents, and the plot.

Rules:
- Everything shown comes from the stored results (results.json, devices.json), so a block can be rewritten
  from a stored run (``--report-only``, ``python gendocs.py``) and tests/docs/test_docs.py checks that it is.
- A block is written between its markers only (``write_*_block``, through ``bench/blocks.py``); the
  hand-written text around it does not quote its figures.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench import per_message, state_scaling
from bench.blocks import write_block
from bench.plan import (
    BENCH_README,
    DEFAULT_STEP,
    DESIGNS,
    DEVICES_BLOCK,
    DEVICES_PAGE,
    JAX_DESIGNS,
    RESULTS_BLOCK,
    RESULTS_PAGE,
    SUMMARY_BLOCK,
    fmt,
    median,
)


def table(s: dict[str, Any]) -> str:
    head = ["design", "p50@1k", "p99@1k", "p99.9@1k", "p50@10k", "p99@10k", "p99.9@10k", "max msg/s",
            "peak RSS MiB", "lag p50/p99 ms", "lag p99 heavy", "compiles", "1st result cold/warm s"]
    rows = [head]
    for design in (*DESIGNS, "compute-ceiling"):
        if design not in s:  # a design this stored run did not have
            continue
        r = s[design]
        if design == "compute-ceiling":
            rows.append([design, *["-"] * 6, fmt(r["throughput_msg_s"], 0), *["-"] * 5])
            continue
        lag = r.get("loop_lag_ms_1k")
        heavy = r.get("loop_lag_ms_heavy")
        first = r.get("first_result_s") or {}
        rows.append([
            design,
            *(fmt(r[load][q]) for load in ("rate_1k", "rate_10k") for q in ("p50", "p99", "p999")),
            fmt(r["throughput_msg_s"], 0),
            fmt(r["peak_rss_mib"], 0) + (f" ({r['processes']}p)" if r.get("processes") else ""),
            f"{fmt(lag['p50'])}/{fmt(lag['p99'])}" if lag else "-",
            fmt(heavy["p99"]) if heavy else "-",
            fmt(r.get("compilations_after_warmup")) if design in JAX_DESIGNS else "-",
            f"{fmt(first.get('cold_s'))}/{fmt(first.get('warm_s'))}" if first else "-",
        ])
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = [" | ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"forkless": "tab:blue", "spawn": "tab:orange", "io-ceiling": "tab:green", "compute-ceiling": "tab:gray",
               "forkless-nojax": "tab:purple", "inline": "tab:red", "forkless-ft": "tab:cyan"}
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for ax, load, title in ((axes[0], "rate_1k", "1,000 msg/s"), (axes[1], "rate_10k", "10,000 msg/s")):
        for design in DESIGNS:
            qs = [np.asarray(r["latency_quantiles_ms"]) for r in results["runs"]
                  if r["design"] == design and r["load"] == load and not r["heavy"] and r["latency_quantiles_ms"]]
            if not qs:
                continue
            lat = np.sort(np.concatenate(qs))
            cdf = np.linspace(0, 1, len(lat))
            ax.plot(lat, cdf, label=design, color=colours[design])
        ax.set_xscale("log")
        ax.set_xlabel("latency from due time (ms, log)")
        ax.set_ylabel("fraction of messages")
        ax.set_title(f"latency distribution at {title}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    names = [n for n in (*DESIGNS, "compute-ceiling") if n in results["summary"]]
    values = [results["summary"][n]["throughput_msg_s"] or 0 for n in names]
    bars = axes[2].bar(names, values, color=[colours[n] for n in names])
    axes[2].set_yscale("log")
    axes[2].set_ylabel("messages per second (log)")
    axes[2].set_title(f"max throughput (window {results['plan']['window']} in flight)")
    for bar, v in zip(bars, values):
        axes[2].annotate(f"{v:,.0f}", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=9)
    m = results["machine"]
    fig.suptitle(f"forkless benchmark · {results['date']} · {m['cpu']}, {m['cores']} cores · "
                 f"Python {m['python']}, jax {m['jax']} · `{results['command']}`", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"{results['date']} · {m['cpu']} · {m['cores']} cores · Python {m['python']} · jax {m['jax']} · "
        f"{results['elapsed_s']} s",
        "latency in ms from the due time (medians over repeats); max msg/s with a bounded window;",
        "lag = IO-loop lag during traffic at 1,000 msg/s (heavy: with a "
        f"{'~100 ms' if results['plan'].get('heavy_iters') is None else 'lighter (smoke size)'} step); "
        f"idle-loop lag floor here p50 {results['summary']['idle_loop_lag_ms']['p50']:.2f} "
        f"p99 {results['summary']['idle_loop_lag_ms']['p99']:.2f} ms",
        "",
        table(results["summary"]),
        "",
        "targets:",
    ]
    for t in results["targets"]:
        mark = {True: "met   ", False: "MISSED", None: "n/a   "}[t["met"]]
        lines.append(f"  {mark} {t['target']}: {fmt(t['value'])} (limit {fmt(t['limit'])})")
    lines += ["", "step cost:", step_map_markdown(results), "", "latency budget (per hop, µs):",
              hops_markdown(results), "", "CPU per message and the device's floor:", per_message.markdown(results)]
    return "\n".join(lines)


def md(v: Any, digits: int = 2) -> str:
    """A figure for the Markdown table: en dash when absent, thousands separated from 1,000 up."""
    if v is None:
        return "–"
    if isinstance(v, float) and abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _send_lag_p50_ms(results: dict[str, Any]) -> float | None:
    """Median over the 1,000 msg/s runs of the load generator's own p50 lateness (send - due)."""
    return median([(r["loadgen"].get("send_lag_ms") or {}).get("p50") for r in results["runs"]
                    if r["load"] == "rate_1k" and not r["heavy"]])


def state_scaling_markdown(results: dict[str, Any]) -> str:
    """The "state scaling" part of the report (step time, ceiling, memory, app latency by table size)."""
    scaling = results.get("state_scaling")
    if not scaling:
        return "(this run has no state-scaling section)"
    app = scaling.get("app_1k", {})
    lines = [state_scaling.table(scaling), "",
             "The app at 1,000 msg/s (forkless as users run it, 16 streams) by table size, medians, ms:", "",
             "| FORKLESS_MAX_STREAMS | p50 | p99 |", "|---|---|---|"]
    for size, lat in app.items():
        lines.append(f"| {int(size):,} | {md(lat['p50'])} | {md(lat['p99'])} |")
    return "\n".join(lines)


def _verdict(ratios: dict[str, float | None]) -> str:
    """Forkless against inline at one step cost, in words (10% either way counts as level)."""
    parts = []
    tp, p50, ping = ratios.get("throughput"), ratios.get("p50_1k"), ratios.get("ping_p99")
    if tp is not None:
        parts.append(f"forkless {tp:.2f}x inline's max throughput" if tp >= 1.1 else
                     f"inline {1 / tp:.2f}x forkless's max throughput" if tp <= 1 / 1.1 else
                     f"level on max throughput ({tp:.2f}x)")
    if p50 is not None:
        parts.append(f"inline's p50 @1k {p50:.2f}x lower" if p50 >= 1.1 else
                     f"forkless's p50 @1k {1 / p50:.2f}x lower" if p50 <= 1 / 1.1 else f"level on p50 @1k ({p50:.2f}x)")
    if ping is not None:
        parts.append(f"a ping waits {1 / ping:.1f}x longer in inline (p99)" if ping <= 1 / 1.1 else
                     f"a ping waits {ping:.1f}x longer in forkless (p99)" if ping >= 1.1 else "pings level")
    return "; ".join(parts) if parts else "–"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.0f}%"


def _overlap_cell(o: dict[str, float | None] | None) -> str:
    """Pipelining in one cell: the share of the IO thread's CPU time that fell in steps, the
    steps' share of the wall time, and the IO thread's cores while the main thread stepped."""
    if not o:
        return "–"
    return (f"{_pct(o.get('io_cpu_in_steps_share'))} · {_pct(o.get('steps_wall_share'))} · "
            f"{md(o.get('io_busy_in_steps'))}")


def step_map_markdown(results: dict[str, Any]) -> str:
    """The "step cost" part of the report: forkless, inline and spawn at each step cost, and
    forkless against inline in words (``summary["step_map"]``, ``summarise_steps``)."""
    steps = results["summary"].get("step_map")
    if not steps:
        return "(this run has no step-cost section)"
    plan = results["plan"]
    section = results.get("step_costs") or {}
    costs = steps["costs"]
    heavy = [c for c in costs if c != DEFAULT_STEP]
    iters = ", ".join(f"{costs[c]['iters']} for ~{costs[c]['target_ms']:g} ms" for c in heavy)
    lines = [
        f"The step made heavier with `bench/heavy.py` ({steps['size']}x{steps['size']} matmuls a step: {iters}), "
        f"calibrated on this machine at the start of the section (`bench/step_cost.py`; "
        f"{section.get('elapsed_s', '–')} s for the whole section). Medians over {plan['repeats']} repeat(s) of "
        f"{plan.get('step_duration_s', plan['duration_s']):g} s (the first {plan['warmup_s']:g} s not counted), "
        "designs rotated. Latency at 1,000 msg/s, in ms from the due time, with the ping probe's connection open; "
        "ping: round trip of a WebSocket ping sent every ~5 ms on a second connection served by the loop that "
        "answers the feed (`bench/ping_probe.py`), ms; max msg/s with "
        f"{plan['window']:,} in flight (the default step's from the table above). Step ms: the calibration's "
        "`Engine.step` of one message / of a full batch, and the mean step each design saw. Pipelining (forkless "
        "only; inline has one thread): of its IO thread's CPU time, the share that fell while the main thread was "
        "inside a step (its CPU clock read around each step), beside the share of the time the main thread spent "
        "in steps (what the first would be if the IO thread's work ignored the steps), and the IO thread's CPU "
        "seconds per second of step.",
        "",
        "| step | step ms: calibrated (1 / full) | design | step ms seen | mean batch @1k | p50 @1k | p99 @1k "
        "| max msg/s | at max: mean batch · CPU µs a msg · cores design / generator "
        "| at max: IO thread's CPU in steps · main thread in steps · IO cores while stepping "
        "| ping p50 / p99 | pings lost |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cost, row in costs.items():
        name = "default detector" if cost == DEFAULT_STEP else f"~{row['target_ms']:g} ms"
        calibrated = ("–" if row["calibrated_step_ms"] is None else
                      f"{md(row['calibrated_step_ms'])} / {md(row['calibrated_step_ms_full'])}")
        for design, d in row["designs"].items():
            ping, cpu = d["ping_ms"], d.get("cpu_window") or {}
            at_max = (f"{md(d.get('batch_size_mean_window'), 0)} · {md(cpu.get('client_us_per_msg'), 1)} · "
                      f"{md(cpu.get('client_cores'))} / {md(cpu.get('loadgen_cores'))}")
            lines.append(f"| {name} | {calibrated} | {design} | {md(d['step_ms_mean'])} "
                         f"| {md(d['batch_size_mean_1k'], 1)} | {md(d['rate_1k'].get('p50'))} "
                         f"| {md(d['rate_1k'].get('p99'))} | {md(d['throughput_msg_s'])} | {at_max} "
                         f"| {_overlap_cell(d.get('overlap_window'))} "
                         f"| {md(ping['p50'])} / {md(ping['p99'])} | {d['pings_lost'] if d['pings'] else '–'} |")
    lines += ["", "Forkless against inline, by step cost (ratios of the medians above):", "",
              "| step | forkless / inline: p50 @1k | p99 @1k | max msg/s (each repeat's) | ping p99 | in words |",
              "|---|---|---|---|---|---|"]
    for cost, row in costs.items():
        name = "default detector" if cost == DEFAULT_STEP else f"~{row['target_ms']:g} ms"
        r = row["forkless_vs_inline"]
        each = ", ".join(md(v) for v in r.get("throughput_by_repeat") or [])
        lines.append(f"| {name} | {md(r['p50_1k'])} | {md(r['p99_1k'])} | {md(r['throughput'])} ({each}) "
                     f"| {md(r['ping_p99'])} | {_verdict(r)} |")
    return "\n".join(lines)


def devices_markdown(results: dict[str, Any]) -> str:
    """The devices block of bench/docs/devices.md for one ``devices.json`` (``devices_section`` and its run)."""
    m, plan, section = results["machine"], results["plan"], results["devices"]
    when = datetime.datetime.fromisoformat(results["date"]).astimezone(datetime.UTC)
    lines = [
        f"Run of {when:%Y-%m-%d %H:%M} UTC: `{results['command']}` with `JAX_PLATFORMS="
        f"{results.get('jax_platforms') or 'cpu'}` and `JAX_NUM_CPU_DEVICES` 1, 2, 4, {results['elapsed_s']:.0f} s "
        f"in all, on {m['cpu']}, {m['cores']} cores. Step alone: full batches of "
        f"{section['by_devices'][str(section['counts'][0])]['batch_size']}, {plan['compute_s']:g} s each; app: "
        f"forkless, medians over {plan['repeats']} repeat(s) of {plan['duration_s']:g} s with {plan['window']:,} "
        f"messages in flight, {results['loadgen_settings']['streams']} streams.",
        "",
        "| devices | step alone msg/s | step ms a batch | host routing µs a batch | app max msg/s "
        "| app vs 1 device | mean batch | per-device batch fill | compiles after warm-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    one = section["by_devices"][str(section["counts"][0])]["app_max_msg_s"]
    for n in section["counts"]:
        r = section["by_devices"][str(n)]
        ratio = r["app_max_msg_s"] / one if one and r["app_max_msg_s"] else None
        fill = "–" if r["device_fill"] is None else f"{100 * r['device_fill']:.0f}%"
        lines.append(f"| {n} | {md(r['compute_msg_s'])} | {md(r['step_ms'])} | {md(r['host_routing_us'], 1)} "
                     f"| {md(r['app_max_msg_s'])} | {md(ratio)} | {md(r['batch_size_mean'], 1)} | {fill} "
                     f"| {md(r['compilations_after_warmup'])} |")
    return "\n".join(lines) + "\n"


def write_devices_block(results: dict[str, Any], page: Path = DEVICES_PAGE) -> bool:
    """Put ``devices_markdown(results)`` between the devices markers of ``page``; True if it changed."""
    return write_block(page, DEVICES_BLOCK, devices_markdown(results))


def hops_markdown(results: dict[str, Any]) -> str:
    """Per hop, p50/p99 in µs at 1k and 10k msg/s, for forkless, forkless-nojax (the same path
    with a host identity for the step) and spawn (the same stamps: its inbound and outbound
    hops are the multiprocessing queues, pickling included), from the sampled messages."""
    s = results["summary"]
    designs = [d for d in ("forkless", "forkless-ft", "forkless-nojax", "spawn") if (s.get(d) or {}).get("hops_us")]
    if not designs:
        return "(not measured in this run)"
    head = "| hop | " + " | ".join(f"{d} {q} @{load}" for d in designs for load in ("1k", "10k")
                                    for q in ("p50", "p99")) + " |"
    lines = ["One message in 64 carries stamps (`controller/batching.py`, `HOPS`); µs, medians over the "
             "repeats of each run's quantile. `step` is pad + run + outputs to the host.", "",
             head, "|---" * (1 + 4 * len(designs)) + "|"]
    hops = list(s[designs[0]]["hops_us"]["rate_1k"])
    for hop in hops:
        cells = [md((s[d]["hops_us"][load].get(hop) or {}).get(q), 0) for d in designs
                 for load in ("rate_1k", "rate_10k") for q in ("p50", "p99")]
        lines.append(f"| {hop} | " + " | ".join(cells) + " |")
    overlap = (s.get("forkless") or {}).get("overlap") or {}
    if any(overlap.values()):
        lines += ["", "Pipelining, forkless with the default step (medians over the repeats; the step-cost table "
                  "has it at the heavier steps): of the IO thread's CPU time, the share that fell while the main "
                  "thread was inside a step, beside the main thread's share of the time in steps; the IO "
                  "thread's CPU in cores, over the run and while the main thread stepped.", "",
                  "| load | IO thread's CPU in steps | main thread in steps | IO thread, cores | IO cores while "
                  "stepping |", "|---|---|---|---|---|"]
        for load, name in (("rate_1k", "1,000 msg/s"), ("rate_10k", "10,000 msg/s"), ("window", "max throughput")):
            o = overlap.get(load) or {}
            lines.append(f"| {name} | {_pct(o.get('io_cpu_in_steps_share'))} | {_pct(o.get('steps_wall_share'))} "
                         f"| {md(o.get('io_cores'))} | {md(o.get('io_busy_in_steps'))} |")
    return "\n".join(lines)


def summary_markdown(results: dict[str, Any]) -> str:
    """bench/README.md's block: when, where and the main table of one ``results.json`` (the first
    part of ``results_markdown``)."""
    return "\n".join(_main_table(results)) + "\n"


def results_markdown(results: dict[str, Any]) -> str:
    """The measured part of bench/docs/last-run.md for one ``results.json``: when, where, the
    table, the targets, and the sections' tables.

    Everything here comes from ``results``; the hand-written text around the block must not
    quote its figures. ``write_results_block`` puts it between the block's markers.
    """
    s = results["summary"]
    lines = _main_table(results)
    floor = s.get("idle_loop_lag_ms") or {}
    compute = results.get("compute_ceiling") or {}
    heavy_step = s["forkless"].get("heavy_step_ms")
    lines += [
        "",
        f"On this machine in this run: the load generator's own send lag at 1,000 msg/s, p50 "
        f"{md(_send_lag_p50_ms(results))} ms (part of every latency above, the same for every design); "
        f"an idle asyncio loop's lag, p50 {md(floor.get('p50'))} / p99 {md(floor.get('p99'))} ms; "
        f"the heavy step (`bench/heavy.py`) {md(heavy_step, 0)} ms a batch on average in forkless; "
        f"the compute ceiling's step {md(compute.get('step_ms_mean'))} ms a batch of "
        f"{compute.get('batch_size', '–')}.",
        "",
        "| target (`targets()` in `bench/run.py`) | forkless | limit | judged on this run |",
        "|---|---|---|---|",
    ]
    for t in results["targets"]:
        verdict = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['target']} | {md(t['value'])} | {md(t['limit'])} | {verdict} |")
    lines += ["", "#### Step cost: forkless, inline and spawn", "", step_map_markdown(results),
              "", "#### Latency budget", "", hops_markdown(results), "",
              "#### CPU per message and the device's floor", "", per_message.markdown(results),
              "", "#### State scaling", "", state_scaling_markdown(results)]
    return "\n".join(lines) + "\n"


def _main_table(results: dict[str, Any]) -> list[str]:
    """When and where the run was made, and its main table, as lines."""
    m, plan, s = results["machine"], results["plan"], results["summary"]
    when = datetime.datetime.fromisoformat(results["date"]).astimezone(datetime.UTC)
    # runs made before "jax_platforms" was recorded ran the clients with client_env's default
    platform_ = results.get("jax_platforms") or "cpu"
    versions = ", ".join(f"{mod} {m[mod]}" for mod in ("jax", "jaxlib", "aiohttp", "janus", "numpy") if m.get(mod))
    settings = results["loadgen_settings"]
    lines = [
        f"Run of {when:%Y-%m-%d %H:%M} UTC: `{results['command']}` with `JAX_PLATFORMS={platform_}`, "
        f"{results['elapsed_s']:.0f} s in all, on {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, "
        + (f"JAX device {results['jax_device']}, " if results.get("jax_device") else "")
        + f"Python {m['python']}, {versions}.",
        f"Medians over {plan['repeats']} repeat(s) of {plan['duration_s']:g} s (the first {plan['warmup_s']:g} s "
        f"not counted); latency in ms from the due time; {settings['streams']} streams, {settings['features']} "
        f"features; maximum throughput with {plan['window']:,} messages in flight.",
        "",
        "| design | p50 @1k | p99 @1k | p99.9 @1k | p50 @10k | p99 @10k | p99.9 @10k | max msg/s "
        "| peak RSS MiB (processes) | IO-loop lag p50/p99 ms | lag p99 during the heavy step "
        "| compiles after warm-up | first result cold / warm cache |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # a design this stored run did not have is left out
    return lines + [_main_row(design, s[design]) for design in (*DESIGNS, "compute-ceiling") if design in s]


def _main_row(design: str, r: dict[str, Any]) -> str:
    """One design's row of the main table."""
    cells = [design]
    if design == "compute-ceiling":
        cells += ["–"] * 6 + [md(r["throughput_msg_s"])] + ["–"] * 5
    else:
        cells += [md(r[load][q]) for load in ("rate_1k", "rate_10k") for q in ("p50", "p99", "p999")]
        cells.append(md(r["throughput_msg_s"]))
        rss = "–" if r["peak_rss_mib"] is None else f"{r['peak_rss_mib']:.0f}"
        cells.append(rss + (f" ({r['processes']})" if r.get("processes") else ""))
        lag, heavy, first = r.get("loop_lag_ms_1k"), r.get("loop_lag_ms_heavy"), r.get("first_result_s")
        cells.append(f"{md(lag['p50'])} / {md(lag['p99'])}" if lag else "–")
        cells.append(md(heavy["p99"]) if heavy else "–")
        cells.append(md(r.get("compilations_after_warmup")) if design in JAX_DESIGNS else "–")
        cells.append(f"{md(first.get('cold_s'))} s / {md(first.get('warm_s'))} s" if first else "–")
    return "| " + " | ".join(cells) + " |"


def write_summary_block(results: dict[str, Any], readme: Path = BENCH_README) -> bool:
    """Put ``summary_markdown(results)`` between the summary markers of ``readme``; True if it changed."""
    return write_block(readme, SUMMARY_BLOCK, summary_markdown(results))


def write_results_block(results: dict[str, Any], page: Path = RESULTS_PAGE) -> bool:
    """Put ``results_markdown(results)`` between the results markers of ``page``; True if it changed."""
    return write_block(page, RESULTS_BLOCK, results_markdown(results))
