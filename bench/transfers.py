"""The transfer figures of a bench/tpu.sh run as one markdown table: a step's round trip with
one array per input and output against one packed array each way (bench/packed_io.py), and
the largest step-to-step gap while a checkpoint is taken (bench/checkpoint_stall.py).

    python -m bench.transfers OUT      # reads OUT/packed_io.json and OUT/checkpoint_stall.json

Rules: reads the two files and prints; measures nothing, changes nothing.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any


def _ms(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


def table(packed: dict[str, Any], stall: dict[str, Any], day: str) -> str:
    lines = [f"## Transfers ({packed.get('device', '?')}, {day})", "",
             "A step's round trip (the default detector: 3 inputs, 4 outputs; bench/packed_io.py):", "",
             "| messages a step | one array each (p50 / p99 ms, steps/s) | packed (p50 / p99 ms, steps/s) "
             "| packed / arrays |",
             "|---|---|---|---|"]
    for size, modes in packed.get("sizes", {}).items():
        cells = [f"{_ms(modes[m]['round_trip_ms']['p50'])} / {_ms(modes[m]['round_trip_ms']['p99'])}, "
                 f"{modes[m]['steps_per_s']:.0f}" for m in ("arrays", "packed")]
        lines.append(f"| {size} | {cells[0]} | {cells[1]} | {modes['packed_over_arrays_p50']:.2f} |")
    lines += ["", f"Checkpoints of {stall.get('streams', '?')} streams x {stall.get('features', '?')} features at "
              f"{stall.get('rate', '?')} msg/s, every {stall.get('every_s', '?')} s (bench/checkpoint_stall.py "
              "--writer controller):", "",
              "| phase | largest gap (ms) | largest gap during a checkpoint (ms) | median window max (ms) "
              "| checkpoints |",
              "|---|---|---|---|---|"]
    for mode, m in stall.get("modes", {}).items():
        lines.append(f"| {mode} | {_ms(m['gaps'].get('max_ms'))} | {_ms(m['gaps_during_checkpoint'].get('max_ms'))} | "
                     f"{_ms(m['window_max_gap_ms'].get('median'))} | {m['checkpoints']} |")
    lines += ["", f"checkpoint failures: {stall.get('checkpoint_failures', '?')}; \"whole\": cloned on the device, "
              "the host copy waited for on the writer thread; \"device-get\": the host copy on the main thread "
              "(before issue 48)"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    packed = json.loads((out / "packed_io.json").read_text())
    stall = json.loads((out / "checkpoint_stall.json").read_text())
    print(table(packed, stall, datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
