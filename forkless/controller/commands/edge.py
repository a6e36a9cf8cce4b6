"""The edges both programs share (``forkless``, controller/commands/cli.py, and ``forkless relay``,
controller/commands/relaycmd.py): the configuration read from the environment at the start, and a
``ForklessError`` turned into the program's one line and exit status at the end.

Rules:
- Each program imports this; neither imports the other's module for it (``cli`` dispatches to the relay,
  the relay imports nothing of ``cli``), so the two commands form no import cycle.
- Nothing here imports JAX: ``load_config`` runs before it, and a bad variable exits 2 without its start-up.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Mapping
from typing import Any

from forkless.controller.config import VARIABLES, Config, variable
from forkless.controller.logs import program_line
from forkless.io_loop.errors import EXIT_CRASH, ForklessError
from forkless.io_loop.settings import PREFIX

__all__ = ["early_log_format", "load_config", "report"]


def early_log_format(environ: Mapping[str, str] | None = None) -> str:
    """FORKLESS_LOG_FORMAT as the environment gives it, read before the rest of the configuration, so
    that the lines written before logging is set up (a configuration error) take it too; "text" where it
    is unset or not allowed (that error is then reported as text)."""
    environ = os.environ if environ is None else environ
    log_format = variable("LOG_FORMAT")
    try:
        return log_format.parse(environ[log_format.env])
    except (KeyError, ValueError):
        return "text"


def load_config(environ: Any = None) -> Config:
    """``Config.from_env`` plus a warning for ``FORKLESS_*`` names that mean nothing (typos), and the
    demo feed's settings checked when it runs (before JAX is imported)."""
    environ = os.environ if environ is None else environ
    known = {var.env for var in VARIABLES}
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in known)
    fmt = early_log_format(environ)
    for name in unknown:
        program_line(f"{name} is not a forkless variable and is ignored (see --help)", fmt=fmt,
                     level=logging.WARNING, label="warning" if fmt == "text" else "", variable=name)
    config = Config.from_env(environ)
    if config.uses_demo_feed:  # the program runs no source of its own: the demo feed runs
        config.check_demo_feed()
    return config


def report(exc: ForklessError, fmt: str = "text") -> int:
    """Write the program's line for ``exc`` to stderr (``forkless: <exit_label>: <message>``, and for
    a crash the traceback of its cause; with ``fmt="json"`` one JSON object with ``exit_status`` and
    ``traceback`` fields) and return its class's ``exit_status``."""
    crash = "".join(traceback.format_exception(exc.__cause__ or exc)) if exc.exit_status == EXIT_CRASH else ""
    program_line(str(exc), fmt=fmt, label=exc.exit_label, traceback=crash, exit_status=exc.exit_status)
    return exc.exit_status
