"""The exceptions that end a run for a reason the program reports in one line, and the exit statuses.

Rules:
- One root: every exception forkless raises on purpose derives from ``ForklessError``, defined in
  ``io_loop/errors.py`` (the leaf imports nothing from here) with the IO side's and ``ConfigError``. Each is
  imported from the module that defines it; a caller catches them as ``forkless.X``.
- Each class carries its exit status (``exit_status``), its line's label (``exit_label``) and its README row
  (``exit_meaning``); the programs map every ``ForklessError`` by them, in one clause.
- ``EXIT_STATUSES`` says what each status means, beside the classes that end a run with it (``ENDS_A_RUN``):
  ``gendocs.py`` makes the README's table of both.
"""

from __future__ import annotations

import os
from typing import Any

from forkless.io_loop.errors import (
    EXIT_CONFIG,
    EXIT_CRASH,
    EXIT_FEED,
    EXIT_INTERRUPTED,
    EXIT_LOSSY_STOP,
    EXIT_OK,
    ConfigError,
    DeploymentMismatch,
    FeedFatal,
    ForklessError,
    IOThreadError,
    LeaseHeld,
    LeaseLost,
    MetricsServerError,
    PositionLost,
)

__all__ = ["ENDS_A_RUN", "EXIT_STATUSES", "CheckpointMismatch", "ProcessorContractError"]

# what each status means, whatever ends the run with it; the classes in ENDS_A_RUN add their own lines
EXIT_STATUSES = {
    EXIT_OK: "clean stop: every message received answered (or --check passed)",
    EXIT_CRASH: "crash, traceback printed (or --check: JAX, compilation or the metrics address failed)",
    EXIT_CONFIG: "bad configuration, one line naming what is wrong",
    EXIT_FEED: "the feed cannot be used (or --check: a feed is unreachable); forkless relay: also its NATS server, "
               "or messages read and not stored by the stop's deadline",
    EXIT_LOSSY_STOP: "an orderly stop (a signal, FORKLESS_DURATION) that lost messages: results or replies dropped, "
                     "messages left unanswered, results a sink gave up or events given up; the books line and a "
                     "warning say what (FORKLESS_LOSSY_STOP_EXIT sets this status: 0 exits as a clean stop)",
    EXIT_INTERRUPTED: "a second Ctrl-C (SIGINT) during the orderly stop: the IO side aborted, what was not sent is "
                      "counted as dropped, no checkpoint written",
}


class ProcessorContractError(ForklessError, ValueError):
    """A processor's step breaks the contract (docs/embedding/contract.md): found when it is compiled,
    before any connection is made: exit status 2."""

    exit_status = EXIT_CONFIG
    exit_label = "processor error"
    exit_meaning = "a processor that breaks the contract (found when compiling, before any connection)"


class CheckpointMismatch(ForklessError, ValueError):
    """A complete checkpoint that this run cannot continue from: a shape-defining setting, the
    state's structure or a state leaf differs. The CLI exits with status 2."""

    exit_status = EXIT_CONFIG
    exit_label = "checkpoint error"
    exit_meaning = "a checkpoint written with other settings (or by another processor)"

    def __init__(self, path: str | os.PathLike, setting: str, saved: Any, current: Any) -> None:
        self.path = str(path)
        self.setting = setting
        self.saved = saved
        self.current = current
        super().__init__(
            f"checkpoint {self.path} does not fit this run: {setting}: {saved!r} in the checkpoint, "
            f"{current!r} now; run with the settings it was written with, or start empty with "
            f"FORKLESS_CHECKPOINT_RESTORE=never or another FORKLESS_CHECKPOINT_DIR")


# the classes that end a run of the program for a reason of their own, in the README table's order
ENDS_A_RUN: tuple[type[ForklessError], ...] = (
    IOThreadError,
    ConfigError,
    MetricsServerError,
    ProcessorContractError,
    CheckpointMismatch,
    PositionLost,
    LeaseHeld,
    DeploymentMismatch,
    FeedFatal,
    LeaseLost,
)
