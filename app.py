"""forkless: an asyncio WebSocket feed and a JAX loop in one process, no fork.

    python app.py            run (the embedded demo feed when FORKLESS_WS_URL is unset)
    python app.py --check    validate the set-up, compile, try the feed, and exit
    python app.py --help     list every FORKLESS_* variable with its default

Exit status: 0 clean stop; 1 crash (traceback printed); 2 bad configuration (or a
FORKLESS_METRICS_ADDR that cannot be served);
3 the feed cannot be used (handshake refused with 4xx, or reconnect tries used up).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import traceback
from typing import Any

from controller.config import PREFIX, VARIABLES, Config, ConfigError, help_text

EXIT_OK, EXIT_CRASH, EXIT_CONFIG, EXIT_FEED = 0, 1, 2, 3

log = logging.getLogger("forkless")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python app.py",
        description="Run a WebSocket feed through a jitted JAX step in one process (no fork).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Environment variables (JAX's own, e.g. JAX_PLATFORMS, pass through untouched):\n"
        + help_text()
        + "\n\nExit status: 0 clean stop, 1 crash, 2 bad configuration, 3 feed unusable.",
    )
    parser.add_argument("--check", action="store_true",
                        help="validate the configuration, show JAX devices, compile every bucket, "
                             "try one connection to the feed, then exit 0 or non-zero with the reason")
    return parser


def load_config(environ: Any = None) -> Config:
    """``Config.from_env`` plus a warning for ``FORKLESS_*`` names that mean nothing (typos)."""
    environ = os.environ if environ is None else environ
    known = {var.env for var in VARIABLES}
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in known)
    for name in unknown:
        print(f"forkless: warning: {name} is not a forkless variable and is ignored "
              "(see python app.py --help)", file=sys.stderr)
    return Config.from_env(environ)


def main(argv: list[str] | None = None, *, processor: Any = None, codec: Any = None) -> int:
    """The program; also callable by embedding scripts that bring their own processor/codec."""
    args = _parser().parse_args(argv)
    try:
        config = load_config()
    except ConfigError as exc:
        print(f"forkless: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG

    from controller.logs import flush_log_repeats, setup_logging

    setup_logging(config.log_level, config.log_format)

    if args.check:
        from controller.check import run_check

        return run_check(config, processor=processor, codec=codec)

    from controller.loop import Controller
    from io_loop import FeedFatal, IOThreadError

    controller = Controller(config, processor=processor, codec=codec)
    try:
        controller.run()
    except FeedFatal as exc:
        print(f"forkless: feed error: {exc}", file=sys.stderr)
        return EXIT_FEED
    except IOThreadError as exc:
        from io_loop.http import MetricsServerError

        if isinstance(exc.__cause__, MetricsServerError):  # a setting that cannot be served
            print(f"forkless: configuration error: {exc.__cause__}", file=sys.stderr)
            return EXIT_CONFIG
        print(f"forkless: {exc}", file=sys.stderr)
        traceback.print_exception(exc.__cause__ or exc, file=sys.stderr)
        return EXIT_CRASH
    finally:
        flush_log_repeats()
    demo = controller.demo
    if demo is not None:
        print(demo.summary().line(), flush=True)
    return EXIT_OK


if __name__ == "__main__":
    status = main()
    # exiting now: a late Ctrl-C must not interrupt the interpreter's own clean-up (atexit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(status)
