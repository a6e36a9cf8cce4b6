"""The "CPU per message and the device's floor" part of the benchmark's tables (``bench.run``'s
report and results block, ``results.md`` of an accelerator run).

Rules: everything comes from ``results.json`` (``summary[design]["cpu_us_per_msg"]``,
``summary["device_floor"]``); a run made before these figures existed gets one line saying so,
never an empty table.
"""

from __future__ import annotations

from typing import Any

LOADS = (("rate_1k", "1,000 msg/s"), ("rate_10k", "10,000 msg/s"), ("window", "max throughput"))
DESIGNS = ("forkless", "forkless-ft", "forkless-nojax", "spawn", "inline", "io-ceiling")


def _us(v: Any) -> str:
    return "–" if v is None else f"{v:,.1f}"


def cpu_markdown(results: dict[str, Any]) -> str:
    """Per design and load: the process tree's CPU µs a message, and for forkless (and
    forkless-nojax) its IO thread's and main thread's apart."""
    s = results["summary"]
    designs = [d for d in DESIGNS if (s.get(d) or {}).get("cpu_us_per_msg")]
    if not designs:
        return "(CPU per message not measured in this run)"
    lines = ["CPU µs a message over each run's measured window, medians over the repeats: the design's "
             "processes together (sampled every 50 ms, children included), and for forkless its IO thread and "
             "its main (stepping) thread apart, on their own CPU clocks (XLA's threads and the rest of the "
             "process in neither). The other designs' threads are not split: spawn's child is its IO side, inline "
             "and io-ceiling are one thread.", "",
             "| design | " + " | ".join(f"{name}: all / IO thread / main thread" for _, name in LOADS) + " |",
             "|---" * (1 + len(LOADS)) + "|"]
    for d in designs:
        cells = []
        for load, _ in LOADS:
            c = s[d]["cpu_us_per_msg"].get(load) or {}
            cells.append(f"{_us(c.get('process'))} / {_us(c.get('io_thread'))} / {_us(c.get('main_thread'))}")
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def floor_markdown(results: dict[str, Any]) -> str:
    """The device's own round trip of a trivial per-stream step (``bench.device_floor``)."""
    floor = results["summary"].get("device_floor")
    if not floor:
        return "(the device floor was not measured in this run)"
    rt = floor["round_trip_ms"]
    return (f"The device's own round trip of a trivial per-stream state step (`bench/device_floor.py`: one "
            f"message a step, state donated, outputs back on the host, one step in flight) on {floor['device']}: "
            f"p50 {rt['p50']:.3f} ms, p99 {rt['p99']:.3f} ms, {floor['steps_per_s']:,.0f} steps/s over "
            f"{floor['steps']:,} steps: the floor a one-message latency cannot beat here.")


def markdown(results: dict[str, Any]) -> str:
    """Both parts, the floor first."""
    return floor_markdown(results) + "\n\n" + cpu_markdown(results)
