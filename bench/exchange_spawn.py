"""The exchange user's program, spawn design: ``DataClientWorker`` in a
``multiprocessing.get_context("spawn")`` child (which never imports JAX), two
``multiprocessing`` queues to the main loop in the parent.

    python -m bench.exchange_spawn --url http://HOST:PORT --duration S --stats PATH
        --prices PATH --force-order-every S

The worker and the main loop are bench/exchange_client.py's; only the hand-over is here. The
child is started before the parent loads JAX, so its start-up overlaps the compilation.

Rules:
- Only the hand-over is here; the child is started before the parent loads JAX and never imports it.
"""

from __future__ import annotations

import multiprocessing as mp
import sys

from bench.exchange_client import parse_args, run_main, run_worker


def main(argv: list[str] | None = None) -> int:
    args = parse_args("python -m bench.exchange_spawn", argv)
    ctx = mp.get_context("spawn")
    to_main = ctx.Queue()
    to_worker = ctx.Queue()
    child = ctx.Process(target=run_worker, args=(args.url, to_main, to_worker), name="data-client", daemon=True)
    child.start()

    def join(timeout_s: float) -> None:
        child.join(timeout_s)
        if child.is_alive():
            child.terminate()
            child.join(2.0)
        to_worker.cancel_join_thread()  # never hang at exit on a pipe the child no longer reads

    return run_main(args, "spawn", to_worker, to_main, child.is_alive, join)


if __name__ == "__main__":
    sys.exit(main())
