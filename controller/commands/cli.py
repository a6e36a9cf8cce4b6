"""The program behind ``python app.py`` and the ``forkless`` console script.

    forkless            run (the embedded demo feed when FORKLESS_WS_URL is unset)
    forkless --check    validate the set-up, compile, try the feed, and exit
    forkless --help     list every FORKLESS_* variable with its default
    forkless relay      publish the WebSocket feeds into a JetStream stream (controller/commands/relaycmd.py, no JAX)

Exit statuses are stated once: each exception's ``exit_status`` (``ForklessError``, controller/errors.py
and io_loop/errors.py), and what each status means in general (``EXIT_STATUSES``).

Rules:
- The configuration is read and validated before JAX is imported: a bad variable exits 2
  in a fraction of a second, without JAX's start-up (hence the function-level imports of
  the modules that import JAX: the preflight and the controller loop).
- Every way a run can end maps to one exit status here, and only here (``forkless relay``'s
  in controller/commands/relaycmd.py, a program of its own without JAX): every ``ForklessError`` by its
  class's attributes, with one clause (``report``, controller/commands/edge.py, the relay's too); a second
  Ctrl-C is 130; anything else is a crash.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

from forkless.controller.commands.edge import load_config, report
from forkless.controller.errors import EXIT_STATUSES
from forkless.controller.logs import flush_log_repeats, setup_logging
from forkless.controller.settings.vardocs import help_text
from forkless.controller.wiring import Runtime
from forkless.io_loop.errors import EXIT_INTERRUPTED, EXIT_OK, ForklessError

__all__ = ["console_main", "exit_with", "main"]

log = logging.getLogger("forkless")


def _parser(prog: str) -> argparse.ArgumentParser:
    statuses = ", ".join(f"{code} {text.split(' (')[0]}" for code, text in EXIT_STATUSES.items())
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run a WebSocket feed through a jitted JAX step in one process (no fork).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Environment variables (JAX's own, e.g. JAX_PLATFORMS, pass through untouched):\n"
        + help_text()
        + f"\n\nExit status: {statuses}.",
    )
    parser.epilog += f"\n\n{prog} relay publishes the WebSocket feeds into a JetStream stream ({prog} relay --help)."
    parser.add_argument("--check", action="store_true",
                        help="validate the configuration, show JAX devices, compile every bucket, "
                             "try one connection to the feed, then exit 0 or non-zero with the reason")
    return parser


def main(argv: list[str] | None = None, *, processor: Any = None, codec: Any = None,
         prog: str = "python app.py") -> int:
    """The program; also callable by embedding scripts that bring their own processor/codec."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["relay"]:
        # the relay imports nats-py (an optional extra) and no JAX: only when asked for
        from forkless.controller.commands.relaycmd import relay_main

        return relay_main(argv[1:], prog=prog)
    args = _parser(prog).parse_args(argv)
    try:
        config = load_config()
    except ForklessError as exc:  # a ConfigError
        return report(exc)

    setup_logging(config.log_level, config.log_format)

    if args.check:
        from forkless.controller.commands.check import run_check  # imports JAX: only after the configuration is valid

        return run_check(config, processor=processor, codec=codec)

    from forkless.controller.loop import Controller  # imports JAX: only after the configuration is valid

    # the program owns its process: it freezes the objects alive at start (controller/lifetime/host.py), and
    # tells systemd where it is when systemd runs it (controller/lifetime/sdnotify.py)
    controller = None
    try:
        controller = Controller(config, processor=processor, codec=codec,
                                runtime=Runtime(freeze_gc=True, notify_systemd=True))
        controller.run()
    except KeyboardInterrupt:  # a second Ctrl-C: run() aborted the IO side and gave the process back
        print("forkless: second interrupt: exiting now", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ForklessError as exc:  # FeedFatal, a ConfigError known only once JAX runs, IOThreadError, …
        return report(exc)
    finally:
        flush_log_repeats()
    for line in controller.summaries() if controller is not None else ():
        print(line, flush=True)
    return EXIT_OK


def exit_with(status: int) -> None:
    """End the process now, with ``status``, once everything it wrote is flushed.

    The run is over and its output written, so the interpreter's teardown is skipped
    (``os._exit``): tearing down JAX's runtime took 0.25-0.6 s here, time a stop that must
    end by FORKLESS_SHUTDOWN_TIMEOUT_S does not have, and an IO thread left behind by an
    aborted stop cannot hold the exit either. Only the program does this; an embedding
    program's own exit is its business."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a late Ctrl-C must not interrupt the flush
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be written anyway
            pass
    os._exit(status)


def console_main() -> None:
    """Entry point of the ``forkless`` console script (the same program as ``python app.py``)."""
    exit_with(main(prog="forkless"))
