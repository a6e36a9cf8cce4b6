"""Rewrite every generated block of the documents from the code that owns its facts.

    python gendocs.py           rewrite the blocks that are out of date
    python gendocs.py --check   change nothing; exit 1 and name the blocks that are out of date

A generated block sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` (read and written by
``bench/blocks.py``, which the benchmark writes its own blocks through too); the text
between the markers is exactly what its function returns (``tests/docs/test_docs.py`` holds every
block to it, so a hand edit fails the tests). What is generated, and from where:

- README.md ``exit``: ``exit_statuses_markdown()`` (``controller.errors.EXIT_STATUSES`` and the
  ``exit_status``/``exit_meaning`` of each class in ``controller.errors.ENDS_A_RUN``)
- docs/variables.md ``variables``: ``controller.settings.vardocs.variables_table_markdown()`` (``VARIABLES``)
- docs/metrics.md ``metrics``: ``controller.metrics.metrics_table_markdown()`` (``metric_families``)
- docs/relay.md ``relay-metrics``: ``controller.commands.relaycmd.relay_metrics_table_markdown()`` (the relay's)
- bench/README.md ``bench:summary``: ``bench.tables.summary_markdown()`` of ``bench/out/results.json``
  (the main table), and bench/docs/last-run.md ``bench:results``: ``bench.tables.results_markdown()``
  of it (a full ``python -m bench.run`` rewrites both blocks itself)
- bench/docs/devices.md ``bench:devices``: ``bench.tables.devices_markdown()`` of ``bench/out/devices.json``
  (written by ``python -m bench.run --devices-only`` or a full run)
- bench/docs/partitioned.md ``bench:partitioned``: ``bench.partitioned.markdown()`` of ``bench/out/partitioned.json``
  (written by ``python -m bench.run --partitioned-only``)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import partitioned
from bench.blocks import read_block, write_block
from bench.plan import DEFAULT_OUT, DEVICES_BLOCK, RESULTS_BLOCK, SUMMARY_BLOCK
from bench.tables import (
    devices_markdown,
    results_markdown,
    summary_markdown,
)
from forkless.controller.commands.relaycmd import relay_metrics_table_markdown
from forkless.controller.commands.vardocs import variables_table_markdown
from forkless.controller.errors import ENDS_A_RUN, EXIT_STATUSES
from forkless.controller.metrics import metrics_table_markdown

ROOT = Path(__file__).resolve().parent
REGENERATE = "python gendocs.py"

def exit_statuses_markdown() -> str:
    """The table of exit statuses: a row per ``EXIT_STATUSES`` entry (what the status means, whatever
    ends the run with it), each followed by a row per exception class that ends a run with that
    status (``ENDS_A_RUN``: its ``exit_status`` and ``exit_meaning``)."""
    lines = ["| exit status | exception | meaning |", "|---|---|---|"]
    for code, text in EXIT_STATUSES.items():
        lines.append(f"| {code} | | {text} |")
        lines += [f"| {code} | `{cls.__name__}` | {cls.exit_meaning} |"
                  for cls in ENDS_A_RUN if cls.exit_status == code]
    return "\n".join(lines) + "\n"


def bench_results_markdown() -> str:
    """``results_markdown`` of the committed ``bench/out/results.json``."""
    return results_markdown(json.loads((DEFAULT_OUT / "results.json").read_text(encoding="utf-8")))


def bench_summary_markdown() -> str:
    """``summary_markdown`` of the committed ``bench/out/results.json``."""
    return summary_markdown(json.loads((DEFAULT_OUT / "results.json").read_text(encoding="utf-8")))


def bench_devices_markdown() -> str:
    """``devices_markdown`` of the committed ``bench/out/devices.json``."""
    return devices_markdown(json.loads((DEFAULT_OUT / "devices.json").read_text(encoding="utf-8")))


def bench_partitioned_markdown() -> str:
    """``bench.partitioned.markdown`` of the committed ``bench/out/partitioned.json``."""
    return partitioned.markdown(json.loads((DEFAULT_OUT / "partitioned.json").read_text(encoding="utf-8")))


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository's root
    name: str
    render: Callable[[], str]


BLOCKS = (
    Block("README.md", "exit", exit_statuses_markdown),
    Block("docs/variables.md", "variables", variables_table_markdown),
    Block("docs/metrics.md", "metrics", metrics_table_markdown),
    Block("docs/relay.md", "relay-metrics", relay_metrics_table_markdown),
    Block("bench/README.md", SUMMARY_BLOCK, bench_summary_markdown),
    Block("bench/docs/last-run.md", RESULTS_BLOCK, bench_results_markdown),
    Block("bench/docs/devices.md", DEVICES_BLOCK, bench_devices_markdown),
    Block("bench/docs/partitioned.md", partitioned.BLOCK, bench_partitioned_markdown),
)


def stale_blocks(root: Path = ROOT) -> list[str]:
    """``path: name`` of every block whose text is not what its function returns."""
    return [f"{b.path}: {b.name}" for b in BLOCKS
            if read_block((root / b.path).read_text(encoding="utf-8"), b.name) != b.render()]


def regenerate(root: Path = ROOT) -> list[str]:
    """Rewrite every out-of-date block; returns ``path: name`` of those rewritten."""
    return [f"{b.path}: {b.name}" for b in BLOCKS if write_block(root / b.path, b.name, b.render())]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=REGENERATE, description="Rewrite the generated blocks of the documents.")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is out of date")
    a = p.parse_args(argv)
    if a.check:
        stale = stale_blocks()
        for block in stale:
            print(f"out of date: {block} (run {REGENERATE})")
        return 1 if stale else 0
    for block in regenerate():
        print(f"rewrote {block}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
