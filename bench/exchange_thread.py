"""The exchange user's program, thread design: ``DataClientWorker`` in a plain
``threading.Thread`` running ``asyncio.run``, two ``queue.Queue``s to the main loop.

    python -m bench.exchange_thread --url http://HOST:PORT --duration S --stats PATH
        --prices PATH --force-order-every S

The worker and the main loop are bench/exchange_client.py's; only the hand-over is here.

Rules:
- Only the hand-over is here; the two ``queue.Queue``s are all the threads share.
"""

from __future__ import annotations

import queue
import sys
import threading

from bench.exchange_client import DataClientWorker, parse_args, run_main


def main(argv: list[str] | None = None) -> int:
    args = parse_args("python -m bench.exchange_thread", argv)
    to_main: queue.Queue = queue.Queue()
    to_worker: queue.Queue = queue.Queue()
    worker = DataClientWorker(args.url, to_main, to_worker)
    thread = threading.Thread(target=worker.run, name="data-client", daemon=True)
    thread.start()
    return run_main(args, "thread", to_worker, to_main, thread.is_alive, thread.join)


if __name__ == "__main__":
    sys.exit(main())
