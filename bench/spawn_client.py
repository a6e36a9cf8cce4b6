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

Rules:
- The top level imports no JAX (the child imports this module); the child reports ``jax_imported``.
- The parent does what controller/loop.py does with the project's own batcher, slots, padding and
  codec: only the hand-over (two ``multiprocessing`` queues) differs.
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
    child = Child(settings, inbound, outbound)
    loop = asyncio.get_running_loop()
    loop.add_reader(outbound._reader.fileno(), child.on_results)  # the queue's pipe: readable = results
    lag_task = asyncio.create_task(child.watch_lag())
    try:
        await child.ready.wait()  # as the controller: connect only once every bucket is compiled
        await child.serve(url, settings)
    finally:
        lag_task.cancel()
        loop.remove_reader(outbound._reader.fileno())
        child.flush()
        figures = child.figures
        figures["lag_s"] = child.lags
        figures["hops_s"] = child.hops
        figures["jax_imported"] = "jax" in sys.modules
        figures["pid"] = os.getpid()
        inbound.put(("end", figures))


class Child:
    """The child's loop: frames read and decoded, everything decoded in one pass of the loop put on *inbound*
    as one item; results taken from *outbound* (its pipe watched by the loop) and written, a batch a write."""

    def __init__(self, settings: dict[str, Any], inbound: Any, outbound: Any) -> None:
        import aiohttp

        from forkless.controller.codec import JsonCodec  # numpy and msgspec: no JAX in the child

        self.text = aiohttp.WSMsgType.TEXT
        self.codec = JsonCodec(settings["features"], max_frame_items=settings["max_frame_items"])
        self.inbound, self.outbound = inbound, outbound
        self.loop = asyncio.get_running_loop()
        self.seqs: list[Any] = []
        self.streams: list[str] = []
        self.xs: list[np.ndarray] = []
        self.flush_pending = False
        self.lags: list[float] = []
        self.figures: dict[str, Any] = {"frames_in": 0, "messages_in": 0, "results_out": 0}
        self.traffic = False
        # the latency budget, as the forkless design stamps it (io_loop/crossing.py HOPS): one
        # message in SAMPLE_EVERY carries its stamps across both queues; the child computes the hops
        self.first_ns = [0, 0]  # read and decoded, of the first frame of the item being gathered
        self.until_sample = 1
        self.hops: list[list[float]] = []
        self.to_send: deque[list[str]] = deque()
        self.wake = asyncio.Event()
        self.ready = asyncio.Event()

    def flush(self) -> None:
        # everything decoded in this pass of the loop goes over as one item
        self.flush_pending = False
        if self.seqs:
            xs = self.xs
            x = xs[0] if len(xs) == 1 else np.concatenate(xs, axis=0)
            self.until_sample -= len(self.seqs)
            stamps = None
            if self.until_sample <= 0:
                self.until_sample = SAMPLE_EVERY
                stamps = [*self.first_ns, time.monotonic_ns()]  # read, decoded, put on the inbound queue
            self.inbound.put(("c", self.seqs, self.streams, x, stamps))
            self.seqs, self.streams, self.xs = [], [], []

    def on_results(self) -> None:
        while True:
            try:
                item = self.outbound.get_nowait()
            except queue.Empty:
                break
            if item == READY:
                self.ready.set()
            else:
                picked = time.monotonic_ns()  # taken by the child's writer side
                for stamps in item[1]:
                    stamps[8] = picked
                self.to_send.append(item)
        self.wake.set()

    async def send(self, ws: Any, frame: str | bytes) -> None:
        # UTF-8 JSON from the codec: a text frame as is (as io_loop/connectors/websocket/client.py)
        if type(frame) is bytes:
            await ws.send_frame(frame, self.text)
        else:
            await ws.send_str(frame)

    async def serve(self, url: str, settings: dict[str, Any]) -> None:
        """The feed's connection (and the probe's) until the feed closes it."""
        probe_url = settings.get("probe_url")
        probe_task = None
        # one session a socket: a unix address needs a connector of its own (bench.unix)
        async with client_session(url) as session, client_session(probe_url or url) as probing:
            if probe_url:
                probe = await probing.ws_connect(handshake_url(probe_url), autoping=True, heartbeat=None)
                probe_task = asyncio.create_task(drain_probe(probe))
            async with session.ws_connect(handshake_url(url), heartbeat=settings["heartbeat_s"] or None,
                                          max_msg_size=settings["max_msg_bytes"], autoping=True) as ws:
                writer = asyncio.create_task(self.write(ws))
                try:
                    await self.read(ws)
                finally:
                    self.traffic = False
                    writer.cancel()
                    (outcome,) = await asyncio.gather(writer, return_exceptions=True)
                    if not isinstance(outcome, asyncio.CancelledError):
                        self.figures["writer_failed"] = repr(outcome)  # never silently
                        print(f"spawn child: the writer failed: {outcome!r}", file=sys.stderr, flush=True)
            if probe_task is not None:
                await probe.close()
                await asyncio.gather(probe_task, return_exceptions=True)

    async def read(self, ws: Any) -> None:
        """Each frame read and decoded (errors answered at once); a pass's messages gathered for ``flush``."""
        import aiohttp

        text, binary, error = aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.ERROR
        codec, figures, loop = self.codec, self.figures, self.loop
        async for msg in ws:
            if msg.type is text or msg.type is binary:
                read_ns = time.monotonic_ns()
                self.traffic = True
                figures["frames_in"] += 1
                decoded = codec.decode(msg.data)
                if not self.seqs:
                    self.first_ns[:] = [read_ns, time.monotonic_ns()]
                for reason, seq in decoded.errors:
                    await self.send(ws, codec.encode_error(reason, seq))
                if len(decoded):
                    figures["messages_in"] += len(decoded)
                    self.seqs.extend(decoded.seq)
                    self.streams.extend(decoded.stream)
                    self.xs.append(decoded.x)
                    if not self.flush_pending:
                        self.flush_pending = True
                        loop.call_soon(self.flush)
            elif msg.type is error:
                break

    async def write(self, ws: Any) -> None:
        # the same one-write-per-batch corking as io_loop/connectors/websocket/client.py, so the designs differ
        # only in how work crosses between threads or processes
        from forkless.io_loop.net.aiohttp_compat import cork  # aiohttp: no JAX in the child

        corked = cork(ws)
        to_send, figures = self.to_send, self.figures
        while True:
            await self.wake.wait()
            self.wake.clear()
            while to_send:
                frames, traces = to_send.popleft()
                if corked is not None:
                    corked.corked = True
                try:
                    for frame in frames:
                        await self.send(ws, frame)
                finally:
                    if corked is not None:
                        corked.uncork()
                figures["results_out"] += len(frames)
                if traces:
                    written = time.monotonic_ns()
                    for stamps in traces:
                        stamps[9] = written
                        self.hops.append([(stamps[i + 1] - stamps[i]) * 1e-9 for i in range(9)]
                                         + [(written - stamps[0]) * 1e-9])

    async def watch_lag(self) -> None:
        # as io_loop/thread.py: how long a ready callback waits for its turn
        while True:
            await asyncio.sleep(LAG_INTERVAL_S)
            start = self.loop.time()
            await asyncio.sleep(0)
            if self.traffic:
                self.lags.append(self.loop.time() - start)


async def drain_probe(probe: Any) -> None:
    async for _ in probe:  # pings are answered inside receive(), on this loop
        pass


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

    from forkless.controller.device.compiled import compilations

    parent = Parent(cfg, heavy, heavy_size, heavy_iters)
    compilations_at_ready = compilations()
    outbound.put(READY)
    child_figures = parent.serve(inbound, outbound, child, time.monotonic() + max_s)

    outbound.cancel_join_thread()  # the child may be gone: never hang on a full pipe at exit
    child.join(5.0)
    if child.is_alive():
        child.terminate()
        child.join(2.0)
    figures = {
        "design": "spawn",
        **child_lag_and_hops(child_figures),
        "batch_size_mean": float(np.mean(parent.sizes)) if parent.sizes else None,
        # pad + step + outputs on the host
        "step_ms_mean": parent.step_s / parent.batches * 1000 if parent.batches else None,
        "batches": parent.batches,
        "processed": parent.processed,
        "compilations": compilations(),
        "compilations_after_warmup": compilations() - compilations_at_ready,
        "child": child_figures,
        "child_imported_jax": child_figures.get("jax_imported"),
        "pid": os.getpid(),
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(figures, f)
    return 0


class Parent:
    """The parent's loop, as controller/loop.py's: items from the child into the micro-batcher, each batch
    through the slots and the compiled step (compiled here, before the child is told to connect), its
    replies onto *outbound*; what it measured."""

    def __init__(self, cfg: Any, heavy: bool, heavy_size: int, heavy_iters: int) -> None:
        import jax

        from forkless.controller.batching import MicroBatcher
        from forkless.controller.codec import JsonCodec
        from forkless.controller.engine import _read_in_place, compile_step
        from forkless.controller.processor import default_processor
        from forkless.controller.slots import StreamSlots

        if heavy or heavy_iters:
            from bench.heavy import processor_for

            processor = processor_for(cfg, heavy, heavy_size, heavy_iters)
        else:
            processor = default_processor(cfg)
        self.cfg = cfg
        self.codec = JsonCodec(cfg.features, max_frame_items=cfg.max_frame_items)
        ready = compile_step(processor, cfg)
        # the same compiled steps as the controller's; this design drives them itself
        self.compiled, self.layout = ready.steps, ready.layout
        self.state = ready.take_state()
        # outputs fetched as the engine does: read in place on the CPU (controller/engine.py _read_in_place)
        self.fetch = _read_in_place if jax.devices()[0].platform == "cpu" else jax.device_get
        self.batcher = MicroBatcher(cfg.max_batch, cfg.max_wait_ms / 1000)
        self.slots = StreamSlots(cfg.max_streams)
        self.batches = self.processed = 0
        self.step_s = 0.0
        self.sizes: list[int] = []

    def serve(self, inbound: Any, outbound: Any, child: Any, deadline: float) -> dict[str, Any]:
        """Until the child's last item (its figures, returned) and every batch is answered, or ``deadline``."""
        from forkless.io_loop.crossing import TAKEN, Chunk, Trace

        batcher = self.batcher
        child_figures: dict[str, Any] = {}
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
            outbound.put(self.step(taken))
        return child_figures

    def step(self, taken: Any) -> tuple[list[str], list[list[int]]]:
        """One taken batch: its streams' slots (refused past max_streams, as the controller does), the step,
        the replies encoded; the outbound item (the frames, the sampled messages' stamps)."""
        from forkless.io_loop.crossing import ENCODED, FETCHED, OUTBOUND, STEP

        cfg, codec = self.cfg, self.codec
        n = len(taken)
        key, ok, _ = self.slots.lookup(taken.stream, time.monotonic())
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
            # out and its outputs fetched the same way (packed on an accelerator: controller/device/layouts.py)
            bucket, batch, route, _ = self.layout.lay_out(x, key)
            self.state, *ran = self.compiled[bucket](self.state, batch)
            outputs = self.layout.results(tuple(ran), m, route, self.fetch).outputs
            self.step_s += time.perf_counter() - t0
            stamp(taken.traces, FETCHED)
            frames = codec.encode_results(seq, stream, outputs)
            self.processed += m
        else:
            stamp(taken.traces, FETCHED)
        stamp(taken.traces, ENCODED)
        if not ok.all():
            good = iter(frames)
            reason = f"too many streams (FORKLESS_MAX_STREAMS={cfg.max_streams})"
            frames = [next(good) if ok[i] else codec.encode_error(reason, taken.seq[i]) for i in range(n)]
        self.batches += 1
        self.sizes.append(n)
        stamp(taken.traces, OUTBOUND)
        return frames, [trace.ns for trace in taken.traces]


def stamp(traces: list, at: int) -> None:
    now = time.monotonic_ns()
    for trace in traces:
        trace.ns[at] = now


def child_lag_and_hops(child_figures: dict[str, Any]) -> dict[str, Any]:
    """The child's loop lag and latency budget (``lag_s``, ``hops_s``, taken out of its figures) as
    forkless reports them (bench/forkless_client.py): µs per hop, ms of lag."""
    from forkless.io_loop.counters import SECONDS_BOUNDS, Histogram
    from forkless.io_loop.crossing import HOPS

    lag = Histogram(SECONDS_BOUNDS)
    lag.observe_many(child_figures.pop("lag_s", []))
    snap = lag.snapshot()

    def ms(q: float) -> float | None:
        v = snap.quantile(q)
        return None if math.isnan(v) else v * 1000

    sampled = np.asarray(child_figures.pop("hops_s", []), float).reshape(-1, len(HOPS) + 1)
    return {
        # the latency budget, as forkless reports it (bench/forkless_client.py): µs per hop
        "hops_us": {hop: {"p50": float(np.quantile(sampled[:, i], 0.5)) * 1e6 if len(sampled) else None,
                          "p99": float(np.quantile(sampled[:, i], 0.99)) * 1e6 if len(sampled) else None,
                          "n": len(sampled)} for i, hop in enumerate((*HOPS, "total"))},
        "loop_lag_ms": {"p50": ms(0.5), "p99": ms(0.99), "max": ms(1.0), "samples": snap.n},
    }


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
