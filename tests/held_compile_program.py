"""The ``forkless`` program, with the default processor held inside its compile until a file exists:
a test sees what the program does while it compiles (its endpoints, what it tells systemd) for as long
as it looks, with no timing in it.

    python tests/held_compile_program.py RELEASE_PATH        (run by tests/program/test_probes.py)

The processor's step waits for ``RELEASE_PATH`` the first time JAX traces it, which is inside the
controller's compile (``start()``); a bound (``HOLD_S``) keeps a forgotten one from hanging.
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from forkless.controller.commands.cli import exit_with, main  # noqa: E402  (after the path is set)
from forkless.controller.config import Config  # noqa: E402
from forkless.controller.processor import Processor, default_processor  # noqa: E402

HOLD_S = 600.0  # the longest the compile is held when no test releases it


def held(processor: Processor, release: str) -> Processor:
    """``processor`` whose step, when traced, first waits for ``release`` to exist."""

    def step(state, batch):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + HOLD_S
        while not os.path.exists(release):
            if time.monotonic() > deadline:
                raise RuntimeError(f"held_compile_program: {release} did not appear within {HOLD_S:g}s")
            time.sleep(0.01)
        return processor.step(state, batch)

    return processor._replace(step=step)


if __name__ == "__main__":
    exit_with(main([], processor=held(default_processor(Config.from_env()), sys.argv[1]),
                   prog="held_compile_program"))
