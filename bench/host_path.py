"""The host's own work a message, in one process, without sockets or a device (issue 46 item 3):

    python -m bench.host_path [--feeds 2] [--frames-per-chunk 16] [--messages 200000] [--repeats 5]

Rules: the product's own parts, each called as the controller calls it, on literal frames shaped
as ``bench.loadgen`` sends them (one message a frame, ``FEATURES`` numbers, ``STREAMS`` streams):
the IO thread's part (``JsonCodec.decode_frames`` of a chunk's frames, one socket read's, where
the checkout has it, else ``JsonCodec.decode`` of each; ``Handover.add`` and its chunk; the
writer's ``HeldReply.finish`` of each reply item: not the framing, which needs a socket) and the
main thread's (``MicroBatcher`` add and take, ``BatchStep``: slots, the batch padded, replies
encoded and assembled, latency observed), apart, on the process's CPU clock. The step is a host
identity (the default detector's outputs made with numpy from the batch, after ``pad_batch`` as
``OneDevice.lay_out`` calls it: ``z`` the input's numbers, ``score`` their mean magnitude, so the
replies hold numbers of the usual length), so what is measured is the host's Python, not XLA.
For A/B of two checkouts, run this file in each (``cd A && PYTHONPATH=. python /this/bench/host_path.py``:
the product is the checkout's, the measurement this file's) alternately; it prints one JSON
line of CPU µs a message, the least of the repeats (the least is the one least disturbed on a
shared machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from forkless.io_loop.jsontext import dumps

FEATURES = 8
STREAMS = 16


class HostIdentity:
    """An engine whose step pads the batch as the one-device layout does and answers zeros."""

    def __init__(self, config: Any) -> None:
        from forkless.controller.batching import bucket_for, pad_batch

        self.config, self._bucket_for, self._pad = config, bucket_for, pad_batch

    def step(self, x: np.ndarray, key: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        cfg = self.config
        m = len(key)
        batch = self._pad(x, key, self._bucket_for(m, cfg.buckets), cfg.max_streams, np.float32)
        b = len(batch.key)
        outputs = {"z": batch.x.astype(np.float32), "score": np.abs(batch.x).mean(axis=1, dtype=np.float32),
                   "anomaly": np.zeros(b, bool)}
        return {k: v[:m] for k, v in outputs.items()}, np.zeros(m, bool)

    # one step at a time, as the controller's engine on the CPU (FORKLESS_STEPS_IN_FLIGHT's auto)
    resets_in_step = False

    def dispatch(self, x: np.ndarray, key: np.ndarray) -> Any:
        return SimpleNamespace(m=len(key), stepped=self.step(x, key))  # the engine's Pending, as far as read

    def finish(self, pending: Any) -> tuple[dict[str, np.ndarray], np.ndarray]:
        return pending.stepped  # type: ignore[no-any-return]

    def ready(self, pending: Any) -> bool:
        return True

    def reset(self, slots: list[int]) -> None:
        pass


def frames(n: int, feeds: int) -> list[tuple[int, bytes]]:
    """``(feed, frame)`` for n messages, each feed's streams ``s0`` … in turn."""
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((n, FEATURES)).round(6).tolist()
    return [(i % feeds, dumps({"seq": i, "stream": f"s{i % STREAMS}", "x": xs[i]})) for i in range(n)]


def run(n: int, feeds: int, per_chunk: int) -> dict[str, float]:
    from forkless.controller.batching import MicroBatcher
    from forkless.controller.batchstep import BatchStep
    from forkless.controller.checkpoints.positions import SourcePositions
    from forkless.controller.codec import JsonCodec, guarded_codec
    from forkless.controller.config import Config
    from forkless.controller.replies import Replies
    from forkless.controller.slots import StreamSlots
    from forkless.controller.stats import MainStats
    from forkless.io_loop.counters import IOStats
    from forkless.io_loop.handover import Handover
    from forkless.io_loop.writer import HeldReply

    cfg = Config(features=FEATURES, max_batch=256, max_streams=1024, max_wait_ms=0.0, status_s=0.0)
    codec = guarded_codec(JsonCodec(FEATURES), FEATURES, max_frame_items=cfg.max_frame_items, dtype=np.float32)
    stats = MainStats.for_run(cfg.buckets, feeds)
    replies = Replies(codec, stats, ["all"] * feeds, cfg.max_streams)
    out: list[Any] = []
    step = BatchStep(HostIdentity(cfg), StreamSlots(cfg.max_streams), replies, SourcePositions(cfg.feed_specs), stats,
                     put=lambda item, deadline: out.append(item), on_results=lambda *args: None,
                     feed_prefixes=[f"f{i}:" for i in range(feeds)] if feeds > 1 else None)
    try:
        batcher = MicroBatcher(cfg.max_batch, 0.0, cfg.buckets)
    except TypeError:  # a checkout from before the batcher padded in place
        batcher = MicroBatcher(cfg.max_batch, 0.0)
    io_stats = IOStats()
    held = HeldReply(None, io_stats)
    queue: asyncio.Queue[Any] = asyncio.Queue()
    handovers = [Handover(queue, cfg.max_batch, feed=f) for f in range(feeds)]
    wire = frames(n, feeds)
    cpu = {"io": 0.0, "main": 0.0}

    # a read's frames in one pass (SourceContext.emit(frames)), where the checkout's codec has it
    decode_frames = getattr(codec, "decode_frames", None)

    async def pump() -> None:
        clock = time.thread_time
        for start in range(0, n, per_chunk * feeds):
            t0 = clock()
            read = wire[start:start + per_chunk * feeds]
            for feed, handover in enumerate(handovers):
                frames = [frame for f, frame in read if f == feed]
                decoded = decode_frames(frames) if decode_frames is not None else None
                if decoded is not None:
                    handover.add(decoded, 1_000)
                else:
                    for frame in frames:
                        handover.add(codec.decode(frame), 1_000)
            chunks = [h._take_to_put() for h in handovers]
            t1 = clock()
            for chunk in chunks:
                if chunk is not None:
                    batcher.add(chunk, 0.0)
            while (taken := batcher.take()) is not None:
                step(taken)
            t2 = clock()
            for item in out:
                for part in item.unbundled():
                    held._took(part)
                    held.wrote(len(part.frames))
                    held.finish()
            out.clear()
            cpu["io"] += t1 - t0 + clock() - t2
            cpu["main"] += t2 - t1

    asyncio.run(pump())
    if io_stats.results_out != n:  # every message answered by a result frame, or the figures measure less
        raise RuntimeError(f"host_path: {io_stats.results_out} result frames for {n} messages")
    return {"io_us_per_msg": cpu["io"] / n * 1e6, "main_us_per_msg": cpu["main"] / n * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_path", description=__doc__.splitlines()[0])
    p.add_argument("--feeds", type=int, default=1)
    p.add_argument("--frames-per-chunk", type=int, default=16, help="frames a feed's chunk gathers (one read pass)")
    p.add_argument("--messages", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    runs = [run(a.messages, a.feeds, a.frames_per_chunk) for _ in range(a.repeats)]
    best = {k: round(min(r[k] for r in runs), 3) for k in runs[0]}
    print(json.dumps({"feeds": a.feeds, "frames_per_chunk": a.frames_per_chunk, **best,
                      "each": [{k: round(v, 3) for k, v in r.items()} for r in runs]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
