"""The spawn design: the usual answer to "JAX does not survive fork", written to be fast.

    python -m bench.spawn_client --url ws://127.0.0.1:PORT/ --out stats.json
        [--heavy | --heavy-iters N [--heavy-size S]] [--probe-url ws://...]

Two processes (plus the multiprocessing resource tracker):

- the **child**, started with ``multiprocessing.get_context("spawn")``, never imports JAX
  (``"jax" in sys.modules`` is checked and reported). It runs the aiohttp WebSocket client:
  it decodes each frame with the project's ``JsonCodec`` and, rather than one queue item per
  message, puts everything decoded in one pass of its event loop as ONE item (columns:
  ``seq``, ``stream``, ``x``) on the inbound ``multiprocessing.Queue``. Results come back
  as lists of encoded frames on the outbound queue; the child waits for them on the queue's
  pipe with ``loop.add_reader`` (no helper thread, no executor) and writes them in order.
  A lag monitor task, the same as the forkless IO thread's, measures its loop lag.
- the **parent** starts the child first (its start-up overlaps the compilation; the child
  connects once the parent says it is ready, as the controller does), then does
  what ``controller/loop.py`` does: ``Config.from_env`` for the same knobs, the default
  processor, every bucket compiled ahead of time, the same ``MicroBatcher`` rules (wait for
  a first item, add what is already waiting while ``wants_more``), ``StreamSlots``,
  the engine's layout of a batch and of its results (``Engine.layout``: padded, or packed on an
  accelerator), one ``device_get`` per batch, ``JsonCodec.encode_results``, one outbound
  item per batch.

``--probe-url``: the child also opens a second connection, to ``bench.ping_probe``, on its
loop (the loop that answers the feed's pings), and only reads it.

The child ends when the feed closes the connection and tells the parent with a last
("end", figures) item; the parent finishes its batch, writes the JSON figures to ``--out``
(loop lag of the child during traffic, compilations after warm-up, batch sizes) and exits.

This module is also what the spawned child imports, so its top level imports no JAX; the
child imports only the pure codec and aiohttp (the ``controller`` package's ``__init__``
imports nothing itself, and the child reports ``jax_imported`` to prove it stayed out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import queue
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from bench.unix import client_session, handshake_url

REPO_ROOT = Path(__file__).resolve().parent.parent
LAG_INTERVAL_S = 0.02  # as io_loop/counters.py
POLL_S = 0.1  # as controller/queues.py
SAMPLE_EVERY = 64  # as controller/batching.py (not imported: the child's imports stay minimal)
READY = "ready"  # parent -> child: compiled, connect now


# ---- the child: aiohttp client, no JAX -------------------------------------------------------


def child_main(url: str, settings: dict[str, Any], inbound: Any, outbound: Any) -> None:
    """Entry point of the spawned child."""
    asyncio.run(_child(url, settings, inbound, outbound))


async def _child(url: str, settings: dict[str, Any], inbound: Any, outbound: Any) -> None:
    import aiohttp
    from forkless.controller.codec import JsonCodec  # numpy and orjson: no JAX in the child
    from forkless.io_loop.aiohttp_compat import cork  # aiohttp: no JAX in the child

    text = aiohttp.WSMsgType.TEXT
    codec = JsonCodec(settings["features"], max_frame_items=settings["max_frame_items"])
    loop = asyncio.get_running_loop()
    seqs: list[Any] = []
    streams: list[str] = []
    xs: list[np.ndarray] = []
    flush_pending = False
    lags: list[float] = []
    figures: dict[str, Any] = {"frames_in": 0, "messages_in": 0, "results_out": 0}
    traffic = False
    # the latency budget, as the forkless design stamps it (controller/batching.py HOPS): one
    # message in SAMPLE_EVERY carries its stamps across both queues; the child computes the hops
    first_ns = [0, 0]  # read and decoded, of the first frame of the item being gathered
    until_sample = 1
    hops: list[list[float]] = []

    def flush() -> None:
        # everything decoded in this pass of the loop goes over as one item
        nonlocal seqs, streams, xs, flush_pending, until_sample
        flush_pending = False
        if seqs:
            x = xs[0] if len(xs) == 1 else np.concatenate(xs, axis=0)
            until_sample -= len(seqs)
            stamps = None
            if until_sample <= 0:
                until_sample = SAMPLE_EVERY
                stamps = [*first_ns, time.monotonic_ns()]  # read, decoded, put on the inbound queue
            inbound.put(("c", seqs, streams, x, stamps))
            seqs, streams, xs = [], [], []

    to_send: deque[list[str]] = deque()
    wake = asyncio.Event()
    ready = asyncio.Event()

    def on_results() -> None:
        while True:
            try:
                item = outbound.get_nowait()
            except queue.Empty:
                break
            if item == READY:
                ready.set()
            else:
                picked = time.monotonic_ns()  # taken by the child's writer side
                for stamps in item[1]:
                    stamps[8] = picked
                to_send.append(item)
        wake.set()

    async def send(ws: Any, frame: str | bytes) -> None:
        if type(frame) is bytes:  # UTF-8 JSON from the codec: a text frame as is (as io_loop/client.py)
            await ws.send_frame(frame, text)
        else:
            await ws.send_str(frame)

    async def write(ws: Any) -> None:
        # the same one-write-per-batch corking as io_loop/client.py, so the designs differ
        # only in how work crosses between threads or processes
        corked = cork(ws)
        while True:
            await wake.wait()
            wake.clear()
            while to_send:
                frames, traces = to_send.popleft()
                if corked is not None:
                    corked.corked = True
                try:
                    for frame in frames:
                        await send(ws, frame)
                finally:
                    if corked is not None:
                        corked.uncork()
                figures["results_out"] += len(frames)
                if traces:
                    written = time.monotonic_ns()
                    for stamps in traces:
                        stamps[9] = written
                        hops.append([(stamps[i + 1] - stamps[i]) * 1e-9 for i in range(9)]
                                    + [(written - stamps[0]) * 1e-9])

    async def watch_lag() -> None:
        # as io_loop/thread.py: how long a ready callback waits for its turn
        while True:
            await asyncio.sleep(LAG_INTERVAL_S)
            start = loop.time()
            await asyncio.sleep(0)
            if traffic:
                lags.append(loop.time() - start)

    loop.add_reader(outbound._reader.fileno(), on_results)  # the queue's pipe: readable = results
    async def drain_probe(probe: Any) -> None:
        async for _ in probe:  # pings are answered inside receive(), on this loop
            pass

    lag_task = asyncio.create_task(watch_lag())
    probe_task = None
    try:
        await ready.wait()  # as the controller: connect only once every bucket is compiled
        # one session a socket: a unix address needs a connector of its own (bench.unix)
        async with client_session(url) as session, client_session(settings.get("probe_url") or url) as probing:
            if settings.get("probe_url"):
                probe = await probing.ws_connect(handshake_url(settings["probe_url"]), autoping=True, heartbeat=None)
                probe_task = asyncio.create_task(drain_probe(probe))
            async with session.ws_connect(handshake_url(url), heartbeat=settings["heartbeat_s"] or None,
                                          max_msg_size=settings["max_msg_bytes"], autoping=True) as ws:
                writer = asyncio.create_task(write(ws))
                try:
                    async for msg in ws:
                        if msg.type is aiohttp.WSMsgType.TEXT or msg.type is aiohttp.WSMsgType.BINARY:
                            read_ns = time.monotonic_ns()
                            traffic = True
                            figures["frames_in"] += 1
                            decoded = codec.decode(msg.data)
                            if not seqs:
                                first_ns[:] = [read_ns, time.monotonic_ns()]
                            for reason, seq in decoded.errors:
                                await send(ws, codec.encode_error(reason, seq))
                            if len(decoded):
                                figures["messages_in"] += len(decoded)
                                seqs.extend(decoded.seq)
                                streams.extend(decoded.stream)
                                xs.append(decoded.x)
                                if not flush_pending:
                                    flush_pending = True
                                    loop.call_soon(flush)
                        elif msg.type is aiohttp.WSMsgType.ERROR:
                            break
                finally:
                    traffic = False
                    writer.cancel()
                    (outcome,) = await asyncio.gather(writer, return_exceptions=True)
                    if not isinstance(outcome, asyncio.CancelledError):
                        figures["writer_failed"] = repr(outcome)  # never silently
                        print(f"spawn child: the writer failed: {outcome!r}", file=sys.stderr, flush=True)
            if probe_task is not None:
                await probe.close()
                await asyncio.gather(probe_task, return_exceptions=True)
    finally:
        lag_task.cancel()
        loop.remove_reader(outbound._reader.fileno())
        flush()
        figures["lag_s"] = lags
        figures["hops_s"] = hops
        figures["jax_imported"] = "jax" in sys.modules
        figures["pid"] = os.getpid()
        inbound.put(("end", figures))


# ---- the parent: the same batching and jitted step as controller/loop.py ---------------------


def parent_main(url: str, out: str, heavy: bool, max_s: float, heavy_size: int = 0, heavy_iters: int = 0,
                probe_url: str = "") -> int:
    from forkless.controller.config import Config  # no JAX yet: the child is started before JAX loads

    cfg = Config.from_env(ws_url=handshake_url(url))
    settings = {"features": cfg.features, "max_frame_items": cfg.max_frame_items,
                "heartbeat_s": cfg.heartbeat_s, "max_msg_bytes": cfg.max_msg_bytes, "probe_url": probe_url}
    ctx = mp.get_context("spawn")
    inbound = ctx.Queue()
    outbound = ctx.Queue()
    child = ctx.Process(target=child_main, args=(url, settings, inbound, outbound), name="spawn-io", daemon=True)
    child.start()  # before compiling: the child's start-up overlaps the compilation

    import jax
    from forkless.controller.batching import (
        ENCODED,
        FETCHED,
        HOPS,
        OUTBOUND,
        STEP,
        TAKEN,
        Chunk,
        MicroBatcher,
        Trace,
    )
    from forkless.controller.codec import JsonCodec
    from forkless.controller.compiled import compilations
    from forkless.controller.engine import _read_in_place, compile_step
    from forkless.controller.processor import default_processor
    from forkless.controller.slots import StreamSlots
    from forkless.controller.stats import SECONDS_BOUNDS, Histogram

    if heavy or heavy_iters:
        from bench.heavy import processor_for

        processor = processor_for(cfg, heavy, heavy_size, heavy_iters)
    else:
        processor = default_processor(cfg)
    codec = JsonCodec(cfg.features, max_frame_items=cfg.max_frame_items)
    ready = compile_step(processor, cfg)
    # the same compiled steps as the controller's; this design drives them itself
    compiled, layout = ready.steps, ready.layout
    state = ready.take_state()
    # outputs fetched as the engine does: read in place on the CPU (controller/engine.py _read_in_place)
    fetch = _read_in_place if jax.devices()[0].platform == "cpu" else jax.device_get
    compilations_at_ready = compilations()
    outbound.put(READY)

    batcher = MicroBatcher(cfg.max_batch, cfg.max_wait_ms / 1000)
    slots = StreamSlots(cfg.max_streams)
    child_figures: dict[str, Any] = {}
    batches = processed = 0
    step_s = 0.0
    sizes: list[int] = []
    deadline = time.monotonic() + max_s
    ended = False

    def add(item: tuple) -> bool:
        if item[0] == "end":
            child_figures.update(item[1])
            return True
        trace = None
        if item[4] is not None:  # a sampled message: its stamps so far, then taken by the parent
            trace = Trace(0, item[4][0], item[4][1])
            trace.ns[2], trace.ns[TAKEN] = item[4][2], time.monotonic_ns()
        batcher.add(Chunk(item[1], item[2], item[3], 0, trace=trace), time.monotonic())
        return False

    def stamp(traces: list, at: int) -> None:
        now = time.monotonic_ns()
        for trace in traces:
            trace.ns[at] = now

    while (not ended or len(batcher)) and time.monotonic() < deadline:
        if not len(batcher):
            try:
                ended = add(inbound.get(timeout=POLL_S))
            except queue.Empty:
                if not child.is_alive():
                    break
                continue
        while not ended and batcher.wants_more(time.monotonic()):
            try:
                ended = add(inbound.get_nowait())
            except queue.Empty:
                break
        taken = batcher.take()
        if taken is None:
            continue
        n = len(taken)
        key, ok, _ = slots.lookup(taken.stream, time.monotonic())
        if not ok.all():  # as the controller: refuse streams past max_streams with an error
            idx = np.flatnonzero(ok)
            seq = [taken.seq[i] for i in idx.tolist()]
            stream = [taken.stream[i] for i in idx.tolist()]
            x, key = taken.x[idx], key[idx]
        else:
            seq, stream, x = taken.seq, taken.stream, taken.x
        frames: list[str] = []
        stamp(taken.traces, STEP)
        if seq:
            m = len(seq)
            t0 = time.perf_counter()
            # the same compiled (guarded, state-donated) step as the controller's, the batch laid
            # out and its outputs fetched the same way (packed on an accelerator: controller/layouts.py)
            bucket, batch, route, _ = layout.lay_out(x, key)
            state, *ran = compiled[bucket](state, batch)
            outputs = layout.results(tuple(ran), m, route, fetch).outputs
            step_s += time.perf_counter() - t0
            stamp(taken.traces, FETCHED)
            frames = codec.encode_results(seq, stream, outputs)
            processed += m
        else:
            stamp(taken.traces, FETCHED)
        stamp(taken.traces, ENCODED)
        if not ok.all():
            good = iter(frames)
            reason = f"too many streams (FORKLESS_MAX_STREAMS={cfg.max_streams})"
            frames = [next(good) if ok[i] else codec.encode_error(reason, taken.seq[i]) for i in range(n)]
        batches += 1
        sizes.append(n)
        stamp(taken.traces, OUTBOUND)
        outbound.put((frames, [trace.ns for trace in taken.traces]))

    outbound.cancel_join_thread()  # the child may be gone: never hang on a full pipe at exit
    child.join(5.0)
    if child.is_alive():
        child.terminate()
        child.join(2.0)
    lag = Histogram(SECONDS_BOUNDS)
    lag.observe_many(child_figures.pop("lag_s", []))
    snap = lag.snapshot()

    def ms(q: float) -> float | None:
        v = snap.quantile(q)
        return None if math.isnan(v) else v * 1000

    sampled = np.asarray(child_figures.pop("hops_s", []), float).reshape(-1, len(HOPS) + 1)
    figures = {
        "design": "spawn",
        # the latency budget, as forkless reports it (bench/forkless_client.py): µs per hop
        "hops_us": {hop: {"p50": float(np.quantile(sampled[:, i], 0.5)) * 1e6 if len(sampled) else None,
                          "p99": float(np.quantile(sampled[:, i], 0.99)) * 1e6 if len(sampled) else None,
                          "n": len(sampled)} for i, hop in enumerate((*HOPS, "total"))},
        "loop_lag_ms": {"p50": ms(0.5), "p99": ms(0.99), "max": ms(1.0), "samples": snap.n},
        "batch_size_mean": float(np.mean(sizes)) if sizes else None,
        "step_ms_mean": step_s / batches * 1000 if batches else None,  # pad + step + outputs on the host
        "batches": batches,
        "processed": processed,
        "compilations": compilations(),
        "compilations_after_warmup": compilations() - compilations_at_ready,
        "child": child_figures,
        "child_imported_jax": child_figures.get("jax_imported"),
        "pid": os.getpid(),
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(figures, f)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spawn_client",
                                description="The spawn design (child: aiohttp, no JAX; parent: JAX).")
    p.add_argument("--url", required=True, help="ws:// URL of the feed (bench.loadgen)")
    p.add_argument("--out", required=True, help="where to write the JSON figures")
    p.add_argument("--heavy", action="store_true", help="run the heavy-step processor (bench.heavy)")
    p.add_argument("--heavy-iters", type=int, default=0, help="run bench.heavy with this many matmuls a step")
    p.add_argument("--heavy-size", type=int, default=0, help="... of this size (default: bench.heavy's)")
    p.add_argument("--probe-url", default="", help="the child also connects to this bench.ping_probe")
    p.add_argument("--max-s", type=float, default=120.0, help="stop after this long whatever happens")
    a = p.parse_args(argv)
    return parent_main(a.url, a.out, a.heavy, a.max_s, a.heavy_size, a.heavy_iters, a.probe_url)


if __name__ == "__main__":
    sys.exit(main())
