"""The edges both programs share (``forkless``, controller/commands/cli.py, and ``forkless relay``,
controller/commands/relaycmd.py): the configuration read from the environment at the start, and a
``ForklessError`` turned into the program's one line and exit status at the end.

Rules:
- Each program imports this; neither imports the other's module for it (``cli`` dispatches to the relay,
  the relay imports nothing of ``cli``), so the two commands form no import cycle.
- Nothing here imports JAX: ``load_config`` runs before it, and a bad variable exits 2 without its start-up.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

from forkless.controller.config import Config
from forkless.controller.settings.variables import PREFIX, VARIABLES
from forkless.io_loop.errors import EXIT_CRASH, ForklessError

__all__ = ["load_config", "report"]


def load_config(environ: Any = None) -> Config:
    """``Config.from_env`` plus a warning for ``FORKLESS_*`` names that mean nothing (typos), and the
    demo feed's settings checked when it runs (before JAX is imported)."""
    environ = os.environ if environ is None else environ
    known = {var.env for var in VARIABLES}
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in known)
    for name in unknown:
        print(f"forkless: warning: {name} is not a forkless variable and is ignored "
              "(see --help)", file=sys.stderr)
    config = Config.from_env(environ)
    if config.uses_demo_feed:  # the program runs no source of its own: the demo feed runs
        config.check_demo_feed()
    return config


def report(exc: ForklessError) -> int:
    """Write the program's line for ``exc`` to stderr (``forkless: <exit_label>: <message>``, and for
    a crash the traceback of its cause) and return its class's ``exit_status``."""
    print(f"forkless: {exc.exit_label}: {exc}" if exc.exit_label else f"forkless: {exc}", file=sys.stderr)
    if exc.exit_status == EXIT_CRASH:
        traceback.print_exception(exc.__cause__ or exc, file=sys.stderr)
    return exc.exit_status
