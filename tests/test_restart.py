"""What the process knows survives it: the app (a subprocess, as users run it) checkpoints its
state and stream table into FORKLESS_CHECKPOINT_DIR and restores them on the next start."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from websockets.asyncio.server import serve

from controller.checkpoint import list_checkpoints, load_newest
from controller.config import Config
from controller.processor import default_processor
from tests.reference import EWMAReference

ROOT = Path(__file__).resolve().parent.parent
F = 4


class Feed:
    """A ``websockets`` feed: sends ``frames`` one by one, each after the reply to the one before
    (lock-step), records every reply; ``done`` is set when all are answered."""

    def __init__(self, frames: list[str], lockstep: bool = True) -> None:
        self.frames, self.lockstep = frames, lockstep
        self.replies: list[dict] = []
        self.done = threading.Event()
        self.url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _handler(self, ws) -> None:
        for frame in self.frames:
            await ws.send(frame)
            if self.lockstep:
                self.replies.append(json.loads(await ws.recv()))
        if not self.lockstep:
            async for reply in ws:
                self.replies.append(json.loads(reply))
        self.done.set()
        await asyncio.Event().wait()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with serve(self._handler, "127.0.0.1", 0) as server:
            self.url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/feed"
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> Feed:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def _messages(n: int, start: int = 0) -> list[dict]:
    rng = np.random.default_rng(21)
    xs = rng.normal(size=(start + n, F)).round(4)
    xs[start + n - 5, 0] += 30  # a spike late in the run: anomalies after the restart need the history
    return [{"seq": i, "stream": f"s{i % 5}", "x": xs[i].tolist()} for i in range(start, start + n)]


def _env(ckpt: Path, url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKLESS_")}
    env.update(JAX_PLATFORMS="cpu", FORKLESS_WS_URL=url, FORKLESS_FEATURES=str(F), FORKLESS_MAX_BATCH="16",
               FORKLESS_STATUS_S="0", FORKLESS_CHECKPOINT_DIR=str(ckpt), FORKLESS_RECONNECT_MIN_S="5")
    env.update(extra)
    return env


def _run_until(feed: Feed, env: dict[str, str], timeout: float = 60) -> tuple[int, str]:
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert feed.done.wait(timeout), "the feed's messages were not all answered"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


def test_an_orderly_restart_continues_every_stream_as_if_never_restarted(tmp_path):
    whole = _messages(120)
    first, second = whole[:60], whole[60:]
    with Feed([json.dumps(m) for m in first]) as feed:
        code, err = _run_until(feed, _env(tmp_path, feed.url))
    assert code == 0, err
    assert "no checkpoint in" in err and len(list_checkpoints(tmp_path)) == 1
    with Feed([json.dumps(m) for m in second]) as feed:
        code, err = _run_until(feed, _env(tmp_path, feed.url))
        replies = feed.replies
    assert code == 0, err
    assert "restored 5 streams from" in err and "60 messages processed before" in err
    ref = EWMAReference()
    for m in first:
        ref(m["stream"], m["x"])
    for m, r in zip(second, replies, strict=True):
        z, _, anomaly = ref(m["stream"], m["x"])
        assert r["seq"] == m["seq"]
        np.testing.assert_allclose(r["z"], z, rtol=1e-4, atol=1e-4)
        assert r["anomaly"] == anomaly
    assert any(r["anomaly"] for r in replies)


def test_restore_never_starts_fresh_and_a_mismatched_setting_exits_2_naming_it(tmp_path):
    with Feed([json.dumps(m) for m in _messages(10)]) as feed:
        assert _run_until(feed, _env(tmp_path, feed.url))[0] == 0
    # FEATURES differs: the checkpoint cannot be mixed into this run
    env = _env(tmp_path, "ws://127.0.0.1:9/feed", FORKLESS_FEATURES="3")
    proc = subprocess.run([sys.executable, "app.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("forkless: checkpoint error: checkpoint ") and "features: 4 in the checkpoint, 3 now" in last
    assert "Traceback" not in proc.stderr
    # RESTORE=never: the same directory, a fresh start (seq 0 of a stream gets z = 0 again)
    fresh = _messages(10)
    with Feed([json.dumps(m) for m in fresh]) as feed:
        code, err = _run_until(feed, _env(tmp_path, feed.url, FORKLESS_CHECKPOINT_RESTORE="never"))
        replies = feed.replies
    assert code == 0, err and "restored" not in err
    assert replies[0]["z"] == [0.0] * F and replies[0]["seq"] == 0


def test_kill_9_during_periodic_checkpoints_always_leaves_a_checkpoint_that_restores(tmp_path):
    rng = random.Random(4)
    cfg = Config(features=F, max_streams=4096)
    like = default_processor(cfg).init(cfg)
    expect = {"features": F, "max_streams": 4096, "processor": "ewma/1"}
    frames = [json.dumps(_messages(200, start=0)[i % 200] | {"seq": i}) for i in range(20_000)]
    for _ in range(3):
        with Feed(frames, lockstep=False) as feed:
            proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True,
                                    env=_env(tmp_path, feed.url, FORKLESS_CHECKPOINT_S="0.05",
                                             FORKLESS_CHECKPOINT_KEEP="2"))
            try:
                end = time.monotonic() + 60
                while len(list_checkpoints(tmp_path)) < 2 and time.monotonic() < end:
                    time.sleep(0.02)
                time.sleep(rng.uniform(0.0, 0.4))  # somewhere in the middle of the writes
                proc.send_signal(signal.SIGKILL)
                proc.communicate(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
        restored = load_newest(tmp_path, expect, like)  # raises if the newest is damaged and nothing else is there
        assert restored is not None, "no complete checkpoint after a kill -9"
        assert restored.path == list_checkpoints(tmp_path)[-1]  # files appear only when complete
        assert restored.streams == 5 and restored.processed > 0
