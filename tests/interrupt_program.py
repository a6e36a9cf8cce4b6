"""An embedding program whose orderly stop cannot end by itself, for the second SIGINT that lands
inside the stop's join of the IO thread (tests/controller/lifetime/test_host.py).

    python -m tests.interrupt_program

Its source emits until the stop and then never writes a reply (its peer went away), so the IO
thread keeps every reply and the stop's join waits for it (FORKLESS_SHUTDOWN_TIMEOUT_S is long);
cancelled, the source takes a moment to close (as a polite close of a connection does). It prints
"emitted 200" once it has; a watcher thread prints "in the join" once the main thread is inside
the stop's join of the IO thread. Its last line of stdout is JSON: whether ``run()`` raised
``KeyboardInterrupt`` and the books as ``stats()`` read them right after.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
from typing import Any

from forkless import Config, Controller
from forkless.controller.processor import ewma_processor


class GoesQuietAtTheStop:
    name = "quiet"

    async def run(self, ctx: Any) -> None:
        try:
            seq = 0
            while not ctx.stopping.is_set():
                await ctx.emit(json.dumps({"seq": seq, "stream": f"s{seq % 5}", "x": [1.0] * ctx.features}))
                seq += 1
                if seq == 200:
                    print("emitted 200", flush=True)
                await asyncio.sleep(0.002)
            await asyncio.Event().wait()  # its peer went away: no reply is ever written
        except asyncio.CancelledError:
            await asyncio.sleep(0.1)  # closing its connection takes a moment
            raise


def watch_for_the_join() -> None:
    """Say when the main thread is inside the stop's join of the IO thread (controller/lifetime/lifecycle.py)."""
    main = threading.main_thread().ident
    while True:
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code.co_name == "end_io":
                print("in the join", flush=True)
                return
            frame = frame.f_back
        time.sleep(0.005)


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    config = Config(features=4, max_batch=16, max_streams=8, queue_size=100_000, status_s=0.0,
                    shutdown_timeout_s=600.0)
    ctl = Controller(config, processor=ewma_processor(), sources=[GoesQuietAtTheStop()])
    threading.Thread(target=watch_for_the_join, daemon=True).start()
    interrupted = False
    try:
        ctl.run()
    except KeyboardInterrupt:
        interrupted = True
    s = ctl.stats()
    print(json.dumps({"interrupted": interrupted, "messages_in": s.messages_in, "messages_out": s.messages_out,
                      "answer_errors_out": s.answer_errors_out, "no_reply": s.no_reply, "dropped": s.dropped,
                      "unanswered": s.unanswered}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
