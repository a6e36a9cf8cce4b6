"""The program behind ``python app.py`` and the ``forkless`` console script.

    forkless            run (the embedded demo feed when FORKLESS_WS_URL is unset)
    forkless --check    validate the set-up, compile, try the feed, and exit
    forkless --help     list every FORKLESS_* variable with its default
    forkless relay      publish the WebSocket feeds into a JetStream stream (controller/commands/relaycmd.py, no JAX)

Rules:
- The configuration is read and validated before JAX is imported: a bad variable exits 2 at once (hence the
  function-level imports of the modules that import JAX).
- With FORKLESS_LOG_FORMAT=json every line the program writes to stderr is JSON: its own lines through
  ``program_line`` (the format read before the configuration, ``early_log_format``), uncaught exceptions too.
- Every way a run ends maps to one exit status here, and only here (the relay's in its own module): every
  ``ForklessError`` by its class's ``exit_status``, in one clause (``report``); a second Ctrl-C is 130; anything else
  a crash; an orderly stop 0, or FORKLESS_LOSSY_STOP_EXIT when it lost messages (``stop_status``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import traceback
from typing import Any

from forkless.controller.commands.edge import early_log_format, load_config, report
from forkless.controller.commands.vardocs import help_text
from forkless.controller.errors import EXIT_STATUSES
from forkless.controller.lifetime.endpoints import serve_last_books
from forkless.controller.logs import flush_log_repeats, program_line, setup_logging
from forkless.controller.stats import losses
from forkless.controller.wiring import Runtime
from forkless.io_loop.errors import EXIT_CRASH, EXIT_INTERRUPTED, EXIT_OK, ForklessError, LeaseLost

__all__ = ["console_main", "exit_with", "main", "stop_status"]

log = logging.getLogger("forkless")


def _parser(prog: str) -> argparse.ArgumentParser:
    statuses = ", ".join(f"{code} {text.split(' (')[0]}" for code, text in EXIT_STATUSES.items())
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run a WebSocket feed through a jitted JAX step in one process (no fork).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Environment variables (JAX's own, e.g. JAX_PLATFORMS, pass through untouched):\n"
        + help_text()
        + f"\n\nExit status: {statuses}."
        + f"\n\n{prog} relay publishes the WebSocket feeds into a JetStream stream ({prog} relay --help).",
    )
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
        return report(exc, early_log_format())

    setup_logging(config.run.log_level, config.run.log_format)
    fmt = config.run.log_format
    if fmt == "json":  # the program owns its process: nothing on stderr escapes the format
        logging.captureWarnings(True)
        sys.excepthook = _json_uncaught
        threading.excepthook = lambda args: _json_uncaught(args.exc_type, args.exc_value, args.exc_traceback,
                                                           thread=args.thread.name if args.thread else "")

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
        program_line("second interrupt: exiting now", fmt=fmt, exit_status=EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    except LeaseLost as exc:  # its last books, "lease lost" counted, scraped before the exit (endpoints.py)
        if controller is not None and config.metrics_addr:
            serve_last_books(config, controller.stats, config.lease_s)
        return report(exc, fmt)
    except ForklessError as exc:  # FeedFatal, a ConfigError known only once JAX runs, IOThreadError, …
        return report(exc, fmt)
    finally:
        flush_log_repeats()
    for line in controller.summaries() if controller is not None else ():
        print(line, flush=True)
    return stop_status(controller.stats(), config.run.lossy_stop_exit)


def stop_status(final: Any, lossy: int) -> int:
    """The exit status of an orderly stop whose books are ``final`` (the controller's last snapshot): 0 when it
    lost nothing, else ``lossy`` (FORKLESS_LOSSY_STOP_EXIT, 4 by default), with a warning saying what was lost."""
    lost = losses(final)
    if not lost:
        return EXIT_OK
    what = ", ".join(f"{kind} {n}" for kind, n in lost.items())
    log.warning("the stop lost messages (%s; the books line says which): exit status %d%s", what, lossy,
                " (FORKLESS_LOSSY_STOP_EXIT=0 exits 0)" if lossy else " as set by FORKLESS_LOSSY_STOP_EXIT",
                extra={"exit_status": lossy, "lost": what})
    return lossy


def _json_uncaught(kind: type[BaseException], exc: BaseException | None, tb: Any, thread: str = "") -> None:
    """An exception nothing caught (a crash of the program, or of a thread), written as one JSON line with its
    traceback (``sys.excepthook`` and ``threading.excepthook`` in JSON mode)."""
    where = f" in thread {thread}" if thread else ""
    program_line(f"uncaught exception{where}: {kind.__name__}: {exc}", fmt="json", level=logging.CRITICAL,
                 traceback="".join(traceback.format_exception(kind, exc, tb)), exit_status=EXIT_CRASH)


def exit_with(status: int) -> None:
    """End the process now, with ``status``, once everything it wrote is flushed.

    The run is over and its output written, so the interpreter's teardown is skipped
    (``os._exit``): tearing down JAX's runtime takes time a stop bounded by
    FORKLESS_SHUTDOWN_TIMEOUT_S does not have, and an IO thread left behind by an aborted stop
    cannot hold the exit either. Only the program does this; an embedding program's exit is its own."""
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
