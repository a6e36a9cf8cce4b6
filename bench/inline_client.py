"""The inline design: what a user would write instead of forkless, written to be fast.

    python -m bench.inline_client --url ws://127.0.0.1:PORT/ --out stats.json
        [--heavy | --heavy-iters N [--heavy-size S]] [--probe-url ws://...]

One process, one thread, one asyncio loop: no queue, no thread hop. Everything happens on
the event loop, the compiled step included:

- a **reader** task reads the frames aiohttp has already parsed (``async for`` over the
  connection does not yield while its buffer holds frames) and decodes each one with the
  project's ``JsonCodec``; the first frame of a pass wakes the stepper;
- the **stepper** task runs once the reader has drained everything received (the loop's next
  turn): it takes every message of that read pass (micro-batching by read pass, never waiting
  for more), cuts it into batches of at most ``FORKLESS_MAX_BATCH``, and for each one looks
  up the stream slots (``controller/slots.py``, recycled slots reset first), runs the same
  compiled step as forkless (``compile_step`` → ``Engine.step``: every bucket compiled ahead
  of time, the state donated, the outputs read in place on the CPU), encodes the replies
  with ``JsonCodec.encode_results`` and writes them corked, one socket write per batch
  (``io_loop/net/aiohttp_compat.py``'s ``cork``, as forkless and the spawn design write).

While the step runs, the loop does not turn: nothing is read, no ping is answered. That is the
design's whole difference from forkless, where the IO loop has its own thread and JAX
releases the GIL while XLA runs. The readiness protocol is the others': every bucket is
compiled before the connection is opened (the load generator's clock starts at the connect).

``--probe-url``: a second connection on the same loop to ``bench.ping_probe``, which pings it
and times the pongs (answered by aiohttp's ``receive`` in this loop, like the feed's own).
The design ends when the feed closes its connection; its figures (loop lag during traffic,
compilations after warm-up, batch sizes, step times, the Python threads it ran) go to ``--out``.

Rules:
- One thread, one loop: every step runs on it (the design's whole point).
- The same codec, slots, compiled step and corked writes as forkless; every bucket is compiled before
  the connection opens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import threading
import time
from typing import Any

import numpy as np

from bench.unix import client_session, handshake_url

LAG_INTERVAL_S = 0.02  # as io_loop/counters.py and the spawn child


class Inline:
    """The decoded messages of the current read pass, and the step of each pass."""

    def __init__(self, engine: Any, codec: Any, slots: Any, config: Any) -> None:
        from forkless.controller.engine import StepFailed

        self.engine, self.codec, self.slots, self.config = engine, codec, slots, config
        self._step_failed = StepFailed
        self.seqs: list[Any] = []
        self.streams: list[str] = []
        self.xs: list[np.ndarray] = []
        self.kick = asyncio.Event()
        self.too_many = f"too many streams (FORKLESS_MAX_STREAMS={config.max_streams})"
        self.figures: dict[str, Any] = {"frames_in": 0, "messages_in": 0, "results_out": 0, "errors_out": 0,
                                        "batches": 0, "processed": 0, "step_s": 0.0, "passes": 0}
        self.traffic = False  # between the first frame in and the connection's end (the lag counts then)
        self.lags: list[float] = []
        self.sizes: list[int] = []

    def add(self, decoded: Any) -> None:
        self.seqs.extend(decoded.seq)
        self.streams.extend(decoded.stream)
        self.xs.append(decoded.x)
        self.figures["messages_in"] += len(decoded)
        if not self.kick.is_set():
            self.kick.set()  # the stepper runs once the reader has drained this pass

    def take(self) -> tuple[list[Any], list[str], np.ndarray | None]:
        seqs, streams, xs = self.seqs, self.streams, self.xs
        self.seqs, self.streams, self.xs = [], [], []
        if not seqs:
            return seqs, streams, None
        return seqs, streams, xs[0] if len(xs) == 1 else np.concatenate(xs, axis=0)

    def step(self, seq: list[Any], stream: list[str], x: np.ndarray) -> list[bytes]:
        """One batch (at most max_batch messages): slots, the compiled step, one frame per message."""
        codec, engine, figures = self.codec, self.engine, self.figures
        n = len(seq)
        key, ok, recycled = self.slots.lookup(stream, time.monotonic())
        if recycled:
            engine.reset(recycled)  # a recycled slot starts from a fresh state, before the step
        refused = not ok.all()
        if refused:  # as the controller: streams past max_streams are answered with an error
            rows = np.flatnonzero(ok)
            run_seq, run_stream = [seq[i] for i in rows.tolist()], [stream[i] for i in rows.tolist()]
            x, key = x[rows], key[rows]
        else:
            run_seq, run_stream = seq, stream
        frames: list[bytes] = []
        if run_seq:
            t0 = time.perf_counter()
            try:
                outputs, bad = engine.step(x, key)
            except self._step_failed:
                figures["errors_out"] += len(run_seq)
                frames = [codec.encode_error("processing failed", s) for s in run_seq]
            else:
                figures["step_s"] += time.perf_counter() - t0
                figures["batches"] += 1
                figures["processed"] += len(run_seq)
                if bad.any():  # as the controller: those streams start again, their messages get an error
                    engine.reset(sorted({int(k) for k in key[bad]}))
                frames = codec.encode_results(run_seq, run_stream, outputs)
                if bad.any():
                    for j in np.flatnonzero(bad).tolist():
                        frames[j] = codec.encode_error("processing produced a non-finite result", run_seq[j])
        if refused:
            good = iter(frames)
            frames = [next(good) if ok[i] else codec.encode_error(self.too_many, seq[i]) for i in range(n)]
        return frames


async def send(ws: Any, frame: str | bytes, text: Any) -> None:
    # UTF-8 JSON from the codec: a text frame as is (as io_loop/connectors/websocket/client.py)
    if type(frame) is bytes:
        await ws.send_frame(frame, text)
    else:
        await ws.send_str(frame)


async def serve(url: str, inline: Inline, probe_url: str | None) -> dict[str, Any]:
    """The design's run: the feed's connection (and the probe's), the reader, the stepper, the lag watch."""
    cfg, figures = inline.config, inline.figures
    lag_task = asyncio.create_task(watch_lag(inline))
    probe_task = None
    try:
        # one session a socket: a unix address needs a connector of its own (bench.unix)
        async with client_session(url) as session, client_session(probe_url or url) as probing:
            if probe_url:
                probe = await probing.ws_connect(handshake_url(probe_url), autoping=True, heartbeat=None)
                probe_task = asyncio.create_task(drain_probe(probe))
            async with session.ws_connect(handshake_url(url), heartbeat=cfg.heartbeat_s or None, autoping=True,
                                          max_msg_size=cfg.max_msg_bytes + 1) as ws:
                step_task = asyncio.create_task(stepper(ws, inline))
                try:
                    await read_feed(ws, inline)
                finally:
                    inline.traffic = False
                    step_task.cancel()
                    (outcome,) = await asyncio.gather(step_task, return_exceptions=True)
                    if not isinstance(outcome, asyncio.CancelledError):
                        figures["stepper_failed"] = repr(outcome)  # never silently
                        print(f"inline: the stepper failed: {outcome!r}", file=sys.stderr, flush=True)
            if probe_task is not None:
                await probe.close()
                await asyncio.gather(probe_task, return_exceptions=True)
    finally:
        lag_task.cancel()
        await asyncio.gather(lag_task, return_exceptions=True)
    figures["lag_s"] = inline.lags
    figures["sizes"] = inline.sizes
    return figures


async def read_feed(ws: Any, inline: Inline) -> None:
    """The reader: every frame decoded as it comes (errors answered at once), added to the read pass."""
    import aiohttp

    text, binary = aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY
    codec, figures = inline.codec, inline.figures
    async for msg in ws:
        if msg.type is text or msg.type is binary:
            inline.traffic = True
            figures["frames_in"] += 1
            decoded = codec.decode(msg.data)
            for reason, seq in decoded.errors:
                figures["errors_out"] += 1
                await send(ws, codec.encode_error(reason, seq), text)
            if len(decoded):
                inline.add(decoded)
        elif msg.type is aiohttp.WSMsgType.ERROR:
            break


async def stepper(ws: Any, inline: Inline) -> None:
    """The stepper: each read pass's messages, in batches of at most ``max_batch``, stepped and written corked."""
    import aiohttp

    from forkless.io_loop.net.aiohttp_compat import cork

    text = aiohttp.WSMsgType.TEXT
    figures, sizes = inline.figures, inline.sizes
    corked = cork(ws)
    max_batch = inline.config.max_batch
    while True:
        await inline.kick.wait()
        inline.kick.clear()
        seq, stream, x = inline.take()
        if x is None:
            continue
        figures["passes"] += 1
        for start in range(0, len(seq), max_batch):
            end = start + max_batch
            frames = inline.step(seq[start:end], stream[start:end], x[start:end])
            sizes.append(len(frames))
            if corked is not None:
                corked.corked = True
            try:
                for frame in frames:
                    await send(ws, frame, text)
            finally:
                if corked is not None:
                    corked.uncork()  # the batch's frames leave in one write
            figures["results_out"] += len(frames)


async def watch_lag(inline: Inline) -> None:
    """As io_loop/thread.py: how long a ready callback waits for its turn (here: the step too)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(LAG_INTERVAL_S)
        start = loop.time()
        await asyncio.sleep(0)
        if inline.traffic:
            inline.lags.append(loop.time() - start)


async def drain_probe(probe: Any) -> None:
    async for _ in probe:  # pings are answered inside receive(), on this loop
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.inline_client", description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="ws:// URL of the feed (bench.loadgen)")
    p.add_argument("--out", required=True, help="where to write the JSON figures")
    p.add_argument("--heavy", action="store_true", help="run the heavy-step processor (bench.heavy, its defaults)")
    p.add_argument("--heavy-iters", type=int, default=0, help="run bench.heavy with this many matmuls a step")
    p.add_argument("--heavy-size", type=int, default=0, help="... of this size (default: bench.heavy's)")
    p.add_argument("--probe-url", default="", help="also connect to this bench.ping_probe")
    a = p.parse_args(argv)

    from forkless.controller.codec import JsonCodec
    from forkless.controller.config import Config
    from forkless.controller.device.compiled import compilations
    from forkless.controller.engine import compile_step
    from forkless.controller.slots import StreamSlots
    from forkless.io_loop.counters import SECONDS_BOUNDS, Histogram

    cfg = Config.from_env(ws_url=handshake_url(a.url))
    from bench.heavy import processor_for

    processor = processor_for(cfg, a.heavy, a.heavy_size, a.heavy_iters)
    engine = compile_step(processor, cfg)  # every bucket, ahead of time, before connecting
    inline = Inline(engine, JsonCodec(cfg.features, max_frame_items=cfg.max_frame_items),
                    StreamSlots(cfg.max_streams, idle_s=cfg.stream_idle_s), cfg)
    at_ready = compilations()
    figures = asyncio.run(serve(a.url, inline, a.probe_url or None))

    lag = Histogram(SECONDS_BOUNDS)
    lag.observe_many(figures.pop("lag_s"))
    snap = lag.snapshot()

    def ms(q: float) -> float | None:
        v = snap.quantile(q)
        return None if math.isnan(v) else v * 1000

    sizes = figures.pop("sizes")
    step_s = figures.pop("step_s")
    figures.update({
        "design": "inline",
        "loop_lag_ms": {"p50": ms(0.5), "p99": ms(0.99), "max": ms(1.0), "samples": snap.n},
        "step_ms_mean": step_s / figures["batches"] * 1000 if figures["batches"] else None,
        "batch_size_mean": float(np.mean(sizes)) if sizes else None,
        "compilations": compilations(),
        "compilations_after_warmup": compilations() - at_ready,
        "threads": sorted(t.name for t in threading.enumerate()),
        "pid": os.getpid(),
    })
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(figures, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
