"""The exceptions that end a run for a reason the program reports in one line.

Rules:
- The four the IO side raises (``FeedFatal``, ``MetricsServerError``, ``PositionLost``, ``IOThreadError``) are
  defined in ``io_loop/errors.py`` (the leaf imports nothing from here) and re-exported here,
  the same classes, so the composition layer and embedding code catch them by these names.
- The process's exit statuses are stated here, once; ``app.py``/``forkless``, ``--check`` and
  the README's table all use these names.
"""

from __future__ import annotations

import os
from typing import Any

from io_loop.errors import (
    DeploymentMismatch,
    FeedFatal,
    IOThreadError,
    LeaseHeld,
    LeaseLost,
    MetricsServerError,
    PositionLost,
)

__all__ = [
    "EXIT_CONFIG",
    "EXIT_CRASH",
    "EXIT_FEED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_STATUSES",
    "CheckpointMismatch",
    "DeploymentMismatch",
    "FeedFatal",
    "IOThreadError",
    "LeaseHeld",
    "LeaseLost",
    "MetricsServerError",
    "PositionLost",
    "ProcessorContractError",
]

EXIT_OK, EXIT_CRASH, EXIT_CONFIG, EXIT_FEED = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C
EXIT_STATUSES = {
    EXIT_OK: "clean stop (or --check passed)",
    EXIT_CRASH: "crash, traceback printed (or --check: JAX, compilation or the metrics address failed)",
    EXIT_CONFIG: "bad configuration, one line naming the variable (or a FORKLESS_METRICS_ADDR that cannot be "
                 "served, a processor that breaks the contract, a checkpoint written with other settings, or a "
                 "JetStream stream that no longer holds the messages the checkpoint needs, was made again, or whose "
                 "position every checkpoint lost by being damaged, or partitions whose "
                 "lease another live instance holds, or live instances of the stream started with another "
                 "FORKLESS_INSTANCES or partition_count)",
    EXIT_FEED: "the feed cannot be used: handshake refused with a 4xx, or reconnect tries used up; with "
               "several feeds, every feed (or one, with FORKLESS_FEED_FATAL=any) (or --check: a feed is unreachable); "
               "a partition's lease lost (not renewed in time); forkless relay: also its NATS server, or messages "
               "read and not stored by the stop's deadline",
    EXIT_INTERRUPTED: "a second Ctrl-C (SIGINT) during the orderly stop: the IO side aborted, what was not sent is "
                      "counted as dropped, no checkpoint written",
}


class ProcessorContractError(ValueError):
    """A processor's step breaks the contract (README "Embedding"): found when it is compiled,
    before any connection is made: exit status 2."""


class CheckpointMismatch(ValueError):
    """A complete checkpoint that this run cannot continue from: a shape-defining setting, the
    state's structure or a state leaf differs. The CLI exits with status 2."""

    def __init__(self, path: str | os.PathLike, setting: str, saved: Any, current: Any) -> None:
        self.path = str(path)
        self.setting = setting
        self.saved = saved
        self.current = current
        super().__init__(
            f"checkpoint {self.path} does not fit this run: {setting}: {saved!r} in the checkpoint, "
            f"{current!r} now; run with the settings it was written with, or start empty with "
            f"FORKLESS_CHECKPOINT_RESTORE=never or another FORKLESS_CHECKPOINT_DIR")
