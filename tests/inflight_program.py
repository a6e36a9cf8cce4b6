"""A program that runs the feeds of its environment (``FORKLESS_FEEDS``) with a counting processor
whose steps do work enough to be dispatched asynchronously on the CPU, so that with
``FORKLESS_STEPS_IN_FLIGHT`` > 1 steps are really in flight
(tests/io_loop/connectors/jetstream/test_jetstream.py, kill -9
with steps in flight). Public API only, but for the last line it prints.

    python -m tests.inflight_program

Each reply is ``{"seq", "stream", "n"}``: ``n`` the stream's count of messages applied, so a
message applied twice or never shows in the replies. ``run()`` keeps steps in flight between
its calls; it stops on SIGTERM, then prints the most steps that were in flight at once.
"""

from __future__ import annotations

import sys

from forkless import Config, Controller, Description, Processor
from forkless.controller.logs import setup_logging
from tests.source_program import init, steps_seen_done_late, working_step


def main() -> int:
    config = Config.from_env()
    setup_logging(config.log_level, config.log_format)
    steps_seen_done_late()
    processor = Processor(init, working_step, description=Description(name="count", version="1"))
    ctl = Controller(config, processor=processor)
    ctl.run()
    print(f"most steps in flight {ctl._intake.flight.most}", flush=True)  # private: read for the test only
    return 0


if __name__ == "__main__":
    sys.exit(main())
