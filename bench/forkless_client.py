"""The forkless design as the benchmark runs it: this project exactly as a user runs it.

    python -m bench.forkless_client --url ws://127.0.0.1:PORT/ --out stats.json
        [--heavy | --heavy-iters N [--heavy-size S]]

It does what ``python app.py`` does (``load_config`` from the environment, the app's logging,
``Controller(config).run()`` with the default codec, the default processor and the status
line on) with ``FORKLESS_WS_URL`` set to ``--url`` (or, for a JSON list of URLs,
``FORKLESS_FEEDS`` with one feed each); a unix address (``ws+unix://``, bench/unix.py) is handed
over as a user would: ``FORKLESS_WS_UNIX_SOCKET`` beside ``FORKLESS_WS_URL=ws://localhost/``, or a
feed's ``"unix_socket"``. Two additions, outside the controller:

- an ``on_event`` for the feeds' connection events (``OnEvent(fn, connections=True)``): the
  controller's figures are read once when the first feed's connection comes up and once when the
  last one's goes down (a load generator closes it when its run is over), which also calls
  ``request_stop()``; a timer calls it after ``--max-s`` seconds whatever happens. Nothing polls
  the controller while it is measured: the other designs have no probe either;
- at the end, the controller's own figures (``ctl.stats()``) are written as JSON to
  ``--out``: IO-loop lag quantiles during traffic (first message in to connection closed),
  compilations after warm-up, the internal latency (received to reply written: ``write_latency``),
  batch sizes, step times, and the pipelining figure (``overlap``: the IO thread's CPU time
  that fell while the main thread was inside a step, against the steps' share of the time), and
  the CPU µs per message of the IO thread and of the main thread apart (``cpu_us_per_msg``).

``--heavy`` runs ``bench.heavy.heavy_processor`` instead of the default (lag measurement);
``--heavy-iters N --heavy-size S`` a heavy step of a calibrated cost (``bench.step_cost``).
A second URL in the list (``bench.run`` does this for the ping probe, ``bench.ping_probe``) is
a second feed on the IO thread's loop.
``--no-jax`` is the floor of the thread design: the same controller, queues, codec and IO
thread, with the step replaced by a host identity (the default processor's outputs, all
zero, made with numpy; no XLA call per batch), so the benchmark can tell what the threads
cost from what JAX costs.

Rules:
- The controller runs exactly as ``python app.py`` runs it; what is added (the connection events'
  callback, the timer, the figures file) reads its counters (``ctl.stats()``) twice and calls
  ``request_stop()``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from typing import Any

from bench.unix import forkless_env, forkless_feed


def _q(hist: Any, q: float) -> float | None:
    v = hist.quantile(q)
    return None if math.isnan(v) else v


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


def _us(v: float | None) -> float | None:
    return None if v is None else v * 1e6


def _window_hops(first: Any, last: Any) -> dict[str, Any]:
    if first is None or not first.hops:
        return dict(last.hops)
    return {hop: h - first.hops[hop] for hop, h in last.hops.items()}


def overlap(first: Any, last: Any) -> dict[str, Any]:
    """Pipelining over the window: how much of the IO thread's CPU time fell while the main
    thread was inside a step (``StatsSnapshot.step_io_cpu_s``), against the steps' share of
    the wall time (what the share would be if the IO thread's work ignored the steps)."""
    if first is None or math.isnan(last.io_cpu_s) or math.isnan(first.io_cpu_s):
        return {}
    wall = last.at - first.at
    io_cpu = last.io_cpu_s - first.io_cpu_s
    in_steps = last.step_io_cpu_s - first.step_io_cpu_s
    step_s = (last.step_seconds - first.step_seconds).total
    return {
        "wall_s": wall, "io_cpu_s": io_cpu, "io_cpu_in_steps_s": in_steps, "step_s": step_s,
        "io_cores": io_cpu / wall if wall > 0 else None,
        "io_cpu_in_steps_share": in_steps / io_cpu if io_cpu > 0 else None,  # of the IO thread's CPU time
        "io_busy_in_steps": in_steps / step_s if step_s > 0 else None,  # IO CPU seconds a second of step
        "steps_wall_share": step_s / wall if wall > 0 else None,  # the main thread inside a step
    }


def summarise(first: Any, last: Any, final: Any) -> dict[str, Any]:
    """The JSON written at the end: window figures (``last - first``) and totals (``final``)."""
    lag = last.loop_lag - first.loop_lag if first is not None else last.loop_lag
    batch = final.batch_size
    return {
        "design": "forkless",
        "loop_lag_ms": {"p50": _ms(_q(lag, 0.5)), "p99": _ms(_q(lag, 0.99)),
                        "max": _ms(_q(lag, 1.0)), "samples": lag.n},
        # received -> reply written, as measured before the results' own latency existed (``final.latency``:
        # received -> results handed over)
        "internal_latency_ms": {"p50": _ms(_q(final.write_latency, 0.5)), "p99": _ms(_q(final.write_latency, 0.99))},
        "step_ms_mean": None if math.isnan(final.step_seconds.mean) else final.step_seconds.mean * 1000,
        "batch_size_mean": None if math.isnan(batch.mean) else batch.mean,
        "batches": final.batches,
        "messages_in": final.messages_in,
        "processed": final.processed,
        "results_out": final.messages_out,
        "errors": final.errors,
        "dropped": final.dropped,
        "compilations": final.compilations,
        "compilations_after_warmup": final.compilations_after_warmup,
        "devices": list(final.devices),
        # the latency budget over the window: per hop, p50/p99 in µs and how many were sampled
        "hops_us": {hop: {"p50": _us(_q(h, 0.5)), "p99": _us(_q(h, 0.99)), "n": h.n}
                    for hop, h in _window_hops(first, last).items()},
        "device_messages": list(final.device_messages),
        "device_fill": None if math.isnan(final.device_fill) else final.device_fill,
        "overlap": overlap(first, last),
        "pid": os.getpid(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.forkless_client", description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="ws:// URL of the feed (bench.loadgen), or a JSON list of "
                   "URLs: one feed each (FORKLESS_FEEDS)")
    p.add_argument("--out", required=True, help="where to write the JSON figures")
    p.add_argument("--heavy", action="store_true", help="run the heavy-step processor (bench.heavy)")
    p.add_argument("--heavy-iters", type=int, default=0, help="run bench.heavy with this many matmuls a step")
    p.add_argument("--heavy-size", type=int, default=0, help="... of this size (default: bench.heavy's)")
    p.add_argument("--max-s", type=float, default=120.0, help="stop after this long whatever happens")
    p.add_argument("--no-jax", action="store_true", help="the same path with the step replaced by a host "
                   "identity (zeros out, no XLA call): what the thread design costs without JAX")
    a = p.parse_args(argv)

    # the product's own variables, as a user sets them: a unix address (bench.unix) through
    # FORKLESS_WS_UNIX_SOCKET, or a feed's "unix_socket"
    if a.url.startswith("["):  # several feeds: a JSON list of URLs (bench.feeds_scaling)
        os.environ["FORKLESS_FEEDS"] = json.dumps([forkless_feed(url, f"f{i}")
                                                   for i, url in enumerate(json.loads(a.url))])
    else:
        os.environ.update(forkless_env(a.url))
    from app import load_config
    from forkless.controller.logs import setup_logging
    from forkless.controller.loop import Controller
    from forkless.controller.wiring import OnEvent, Runtime
    from forkless.io_loop.crossing import ConnectionEvent

    config = load_config()
    setup_logging(config.log_level, config.log_format)
    processor = None
    if a.heavy or a.heavy_iters:
        from bench.heavy import processor_for

        processor = processor_for(config, a.heavy, a.heavy_size, a.heavy_iters)
    feeds = len(json.loads(a.url)) if a.url.startswith("[") else 1
    window: dict[str, Any] = {}
    up: set[str] = set()
    seen: set[str] = set()

    def on_event(source: str, event: Any) -> None:
        """The feeds' connections, in the main thread: the window opens as the first comes up and closes
        once every feed has been connected and none is any more (the load generators are done)."""
        if not isinstance(event, ConnectionEvent):
            return
        if event.connected:
            up.add(source)
            seen.add(source)
            if "first" not in window:
                window["first"], window["main_cpu_first"] = ctl.stats(), time.thread_time()
        else:
            up.discard(source)
            if len(seen) == feeds and not up and "last" not in window:
                window["last"], window["main_cpu_last"] = ctl.stats(), time.thread_time()
                ctl.request_stop()

    # as the program runs it (controller/commands/cli.py): the objects alive at the start frozen, so a
    # collection does not walk JAX's (a free-threaded build's collections are whole and stop every thread)
    ctl = (_host_identity_controller() if a.no_jax else Controller)(
        config, processor=processor, on_event=OnEvent(on_event, connections=True), runtime=Runtime(freeze_gc=True))
    backstop = threading.Timer(a.max_s, ctl.request_stop)
    backstop.daemon = True
    backstop.start()
    ctl.run()
    backstop.cancel()
    final = ctl.stats()
    figures = summarise(window.get("first"), window.get("last", final), final)
    figures["cpu_us_per_msg"] = cpu_per_message(window)
    if a.no_jax:
        figures["design"] = "forkless-nojax"
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(figures, f)
    return 0


def cpu_per_message(window: dict[str, Any]) -> dict[str, float | None]:
    """CPU µs per message over the window (first message in to every feed closed), the IO thread
    (the controller's own clock of it) and the main thread (the stepping thread's clock) apart;
    XLA's own threads and the rest of the process are in neither (``bench.run`` has the process's)."""
    first, last = window.get("first"), window.get("last")
    if first is None or last is None or last.messages_in <= first.messages_in:
        return {"io_thread": None, "main_thread": None, "messages": None}
    n = last.messages_in - first.messages_in
    io = (last.io_cpu_s - first.io_cpu_s) / n * 1e6
    main = (window["main_cpu_last"] - window["main_cpu_first"]) / n * 1e6
    return {"io_thread": None if math.isnan(io) else io, "main_thread": None if math.isnan(main) else main,
            "messages": n}


def _host_identity_controller() -> type:
    """``Controller`` whose engine answers every message with zeros on the host: the same controller,
    queues, codec, batches, slots, replies and IO side, no device step (the engine is the loop's one seam
    to the device: its ``dispatch``/``ready``/``finish``/``reset``). One step at a time, as on the CPU."""
    from types import SimpleNamespace

    import numpy as np

    from forkless.controller.loop import Controller

    class HostIdentityEngine:
        platform = "cpu"
        resets_in_step = False
        live_weights = None
        devices = ("host",)

        def __init__(self, config: Any) -> None:
            self.settings = SimpleNamespace(steps_in_flight=1)
            self.features = config.features
            self.device_messages, self.device_rows = [0], 0  # stats(): messages and rows a device ran
            self.state = self.weights = None

        def dispatch(self, x: Any, key: Any) -> Any:
            m = len(key)
            self.device_messages[0] += m
            self.device_rows += m
            stepped = ({"anomaly": np.zeros(m, bool), "score": np.zeros(m, np.float32),
                        "z": np.zeros((m, self.features), np.float32)}, np.zeros(m, bool))
            return SimpleNamespace(m=m, stepped=stepped)  # the engine's Pending, as far as it is read

        def ready(self, pending: Any) -> bool:
            return True

        def finish(self, pending: Any) -> Any:
            return pending.stepped

        def reset(self, slots: Any) -> None:
            pass

        def abandon(self) -> None:
            pass

        def describe(self) -> str:
            return "the host (no device step)"

    class HostIdentity(Controller):
        def _compile(self, after_bucket: Any) -> None:
            if self.engine is None:
                self.engine = HostIdentityEngine(self.config)
                print("forkless-nojax: no device step, the host answers every message", file=sys.stderr, flush=True)

    return HostIdentity


if __name__ == "__main__":
    sys.exit(main())
