"""A host program that embeds the controller, as a user's would: it sets process-wide things of
its own first (frozen objects, the collector off, signal handlers, a switch interval, a worker
thread pinned to one CPU), runs ``Controller.run()`` with the settings in FORKLESS_* variables,
and prints, as its last line of stdout, JSON of what it found before and after the run.

    python tests/host_program.py        (run by tests/controller/lifetime/test_host.py)
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from forkless import OnResults  # noqa: E402
from forkless.controller.config import Config  # noqa: E402  (after the path is set)
from forkless.controller.loop import Controller  # noqa: E402


def host_handler(signum: int, frame: object) -> None:
    print(f"host handler: {signum}", flush=True)


def affinities() -> dict[str, list[int]]:
    """Every thread of this process that is the host's (main and worker): its CPUs."""
    return {name: sorted(os.sched_getaffinity(tid)) for name, tid in HOST_THREADS.items()}


HOST_THREADS: dict[str, int] = {}


def settings(sentinel: object) -> dict[str, object]:
    return {
        "sentinel_frozen": not any(o is sentinel for o in gc.get_objects()),
        "frozen_count_positive": gc.get_freeze_count() > 0,
        "gc_enabled": gc.isenabled(),
        "sigint": repr(signal.getsignal(signal.SIGINT)),
        "sigterm": repr(signal.getsignal(signal.SIGTERM)),
        "switch_interval": sys.getswitchinterval(),
        "affinity": affinities(),
    }


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    sentinel = ["the host's own object"]
    gc.freeze()
    gc.disable()
    signal.signal(signal.SIGTERM, host_handler)
    sys.setswitchinterval(0.0123)
    HOST_THREADS["main"] = threading.get_native_id()
    cpus = sorted(os.sched_getaffinity(0))
    done = threading.Event()

    def worker() -> None:
        HOST_THREADS["worker"] = threading.get_native_id()
        os.sched_setaffinity(0, {cpus[-1]})
        ready.set()
        done.wait()

    ready = threading.Event()
    thread = threading.Thread(target=worker, name="host-worker", daemon=True)
    thread.start()
    ready.wait()
    before = settings(sentinel)
    seen = []

    during: dict[str, object] = {}

    def on_results(seq: list, stream: list, outputs: dict) -> None:
        if not seen:
            during.update(settings(sentinel))
            print("first results", flush=True)
        seen.append(len(seq))

    interrupted = False
    try:
        Controller(Config.from_env(), sinks=[OnResults(on_results)]).run()
    except KeyboardInterrupt:
        interrupted = True
    after = settings(sentinel)
    done.set()
    print(json.dumps({"before": before, "during": during, "after": after, "interrupted": interrupted,
                      "results": sum(seen),
                      "cpus": cpus}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
