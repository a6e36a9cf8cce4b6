"""What the process knows survives it: the app (a subprocess, as users run it) checkpoints its
state and stream table into FORKLESS_CHECKPOINT_DIR and restores them on the next start, also
after a kill -9 in the middle of its periodic checkpoints."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from forkless.controller.checkpoints.checkpoint import list_checkpoints, load_newest, read_checkpoint
from forkless.controller.checkpoints.checkpointer import Checkpointer
from forkless.controller.config import Config
from forkless.controller.metrics import KNOWN_REASONS
from forkless.controller.processor import default_processor
from tests.harness import KILLED_EXIT_S, UNIT_S, app_env, wait_until
from tests.reference import EWMAReference

ROOT = Path(__file__).resolve().parents[2]
F = 4


def _lockstep(frames: list[str]):
    """A script: each frame is sent after the reply to the one before (one message a batch)."""

    async def script(conn) -> None:
        for frame in frames:
            await conn.send_frame(frame)
            assert await conn.recv(timeout=30 * UNIT_S) is not None, "no reply"
        await conn.read_until_closed(timeout=60 * UNIT_S)

    return script


def _messages(n: int, start: int = 0) -> list[dict]:
    rng = np.random.default_rng(21)
    xs = rng.normal(size=(start + n, F)).round(4)
    xs[start + n - 5, 0] += 30  # a spike late in the run: anomalies after the restart need the history
    return [{"seq": i, "stream": f"s{i % 5}", "x": xs[i].tolist()} for i in range(start, start + n)]


def _env(ckpt: Path, url: str, **extra: str) -> dict[str, str]:
    env = app_env()  # the session's compilation cache: every life of these runs loads one program
    env.update(FORKLESS_WS_URL=url, FORKLESS_FEATURES=str(F), FORKLESS_MAX_BATCH="16",
               FORKLESS_STATUS_S="0", FORKLESS_CHECKPOINT_DIR=str(ckpt), FORKLESS_RECONNECT_MIN_S="5")
    env.update(extra)
    return env


def _run_until(feed, n: int, env: dict[str, str]) -> tuple[int, str]:
    """Run the app until the feed has ``n`` replies, then SIGTERM it: (exit status, stderr)."""
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        feed.wait_for(lambda: feed.received_count >= n, 60 * UNIT_S, f"{n} replies")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30 * UNIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


def test_an_orderly_restart_continues_every_stream_as_if_never_restarted(tmp_path, feed_server):
    whole = _messages(120)
    first, second = whole[:60], whole[60:]
    feed = feed_server(_lockstep([json.dumps(m) for m in first]), impl="websockets")
    code, err = _run_until(feed, len(first), _env(tmp_path, feed.url))
    assert code == 0, err
    assert "no checkpoint in" in err and len(list_checkpoints(tmp_path)) == 1
    feed = feed_server(_lockstep([json.dumps(m) for m in second]), impl="websockets")
    code, err = _run_until(feed, len(second), _env(tmp_path, feed.url))
    replies = feed.replies()
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


def test_restore_never_starts_fresh_and_a_mismatched_setting_exits_2_naming_it(tmp_path, feed_server):
    feed = feed_server(_lockstep([json.dumps(m) for m in _messages(10)]), impl="websockets")
    assert _run_until(feed, 10, _env(tmp_path, feed.url))[0] == 0
    # FEATURES differs: the checkpoint cannot be mixed into this run
    env = _env(tmp_path, "ws://127.0.0.1:9/feed", FORKLESS_FEATURES="3")
    proc = subprocess.run([sys.executable, "app.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("forkless: checkpoint error: checkpoint ") and "features: 4 in the checkpoint, 3 now" in last
    assert "Traceback" not in proc.stderr
    # RESTORE=never: the same directory, a fresh start (seq 0 of a stream gets z = 0 again)
    fresh = _messages(10)
    feed = feed_server(_lockstep([json.dumps(m) for m in fresh]), impl="websockets")
    code, err = _run_until(feed, 10, _env(tmp_path, feed.url, FORKLESS_CHECKPOINT_RESTORE="never"))
    replies = feed.replies()
    assert code == 0, err
    assert "restored" not in err
    assert replies[0]["z"] == [0.0] * F and replies[0]["seq"] == 0


def _endless(rng_seed: int = 5):
    """A script: batch frames of 10 messages over 5 streams, paced, until the connection ends
    (the app is killed); replies are recorded meanwhile."""

    async def script(conn) -> None:
        reader = conn.reading()
        rng = np.random.default_rng(rng_seed)
        seq = 0
        while not conn.closing():
            frame = [{"seq": seq + i, "stream": f"s{(seq + i) % 5}", "x": rng.normal(size=F).round(4).tolist()}
                     for i in range(10)]
            try:
                await conn.send(frame)
            except Exception:  # the app was killed under it: the send that found out ends the feed
                break
            seq += 10
            await asyncio.sleep(0.002)  # pacing only: about 5000 messages a second
        await reader

    return script


def _writing(directory: Path) -> bool:
    """Whether a checkpoint is being written into ``directory`` now: a file without a final name
    (call once this run's writer has written one: it removes what an earlier run left)."""
    return len(os.listdir(directory)) > len(list_checkpoints(directory))


def _newest(directory: Path) -> str | None:
    paths = list_checkpoints(directory)
    return paths[-1].name if paths else None


# where each run is killed, each a condition waited for: while its process has a checkpoint
# half written, or just after one got its final name (the rotation of older files may be next)
KILL_POINTS = ("just-written", "mid-write")


def test_kill_9_during_periodic_checkpoints_always_leaves_complete_checkpoints_the_newest_restoring(
        tmp_path, feed_server, app):
    ckpt = tmp_path / "ckpt"
    max_streams = 4096
    cfg = Config(features=F, max_streams=max_streams)
    like = default_processor(cfg).init(cfg)
    expect = {"features": F, "max_streams": max_streams, "processor": "ewma", "processor_version": "1"}
    processed = 0
    for run, point in enumerate(KILL_POINTS):
        feed = feed_server(_endless(run), impl="websockets")
        before = _newest(ckpt)
        proc = app(env=_env(ckpt, feed.url, FORKLESS_MAX_STREAMS=str(max_streams), FORKLESS_CHECKPOINT_S="0.05",
                            FORKLESS_CHECKPOINT_KEEP="2"))
        wait_until(lambda before=before: _newest(ckpt) != before, timeout_s=60 * UNIT_S,
                   what=f"run {run}: a first checkpoint")
        if point == "mid-write":
            wait_until(lambda: _writing(ckpt), timeout_s=60 * UNIT_S,
                       what=f"run {run}: a checkpoint being written", poll_s=0.001)
        else:
            seen = _newest(ckpt)
            wait_until(lambda seen=seen: _newest(ckpt) != seen, timeout_s=60 * UNIT_S,
                       what=f"run {run}: the next checkpoint", poll_s=0.001)
        proc.signal(signal.SIGKILL)
        result = proc.finish(timeout_s=30 * UNIT_S)
        assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
        if run:
            assert f"{processed} messages processed before" in result.stderr  # it went on from the last run

        paths = list_checkpoints(ckpt)
        assert 1 <= len(paths) <= 3, paths  # keep=2, plus one renamed into place just before the kill's rotation
        for path in paths:  # a final name means a complete file, whenever the kill came
            read_checkpoint(path)
        restored = load_newest(ckpt, expect, like)  # raises if the newest is damaged
        assert restored is not None and restored.path == paths[-1], f"run {run}"
        assert restored.streams == 5
        # one moment's data, not a mix: the state's per-stream counts add up to its processed count
        assert int(np.asarray(restored.state.count)[:max_streams].sum()) == restored.processed >= processed
        processed = restored.processed

    restart = Checkpointer(ckpt)
    restart.start()  # what the next run does first: a half-written file goes
    assert restart.stop(30 * UNIT_S)
    assert sorted(os.listdir(ckpt)) == [path.name for path in list_checkpoints(ckpt)]


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics parsed by prometheus_client's own parser: (sample name, labels) -> value."""
    with urllib.request.urlopen(url + "/metrics", timeout=10 * UNIT_S) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def test_counters_start_at_0_after_a_kill_9_and_the_restored_counts_are_gauges(tmp_path, feed_server, app):
    """Prometheus's rules across a kill -9 and a restore: every ``_total`` starts at 0 in the new
    process and never goes down in it; what the checkpoint had counted is in ``forkless_restored_*``;
    the checkpoint's time is the newest checkpoint's from the restore on; the next checkpoint
    records the sum, so the counts go on."""
    ckpt = tmp_path / "ckpt"
    extra = {"FORKLESS_THRESHOLD": "0.5", "FORKLESS_WARMUP": "2"}  # anomalies aplenty, so their count is seen
    feed = feed_server(_endless(), impl="websockets")
    proc = app(env=_env(ckpt, feed.url, FORKLESS_CHECKPOINT_S="0.05", **extra))
    cfg = Config(features=F)
    like = default_processor(cfg).init(cfg)
    expect = {"features": F, "max_streams": cfg.max_streams, "processor": "ewma", "processor_version": "1"}

    def checkpointed() -> bool:
        newest = list_checkpoints(ckpt)
        try:
            return bool(newest) and read_checkpoint(newest[-1])[0]["counts"].get("anomalies", 0) > 0
        except FileNotFoundError:  # rotated away meanwhile
            return False

    wait_until(checkpointed, timeout_s=60 * UNIT_S, what="a checkpoint that counted anomalies")
    proc.signal(signal.SIGKILL)
    assert proc.finish(timeout_s=KILLED_EXIT_S).returncode == -signal.SIGKILL
    before = load_newest(ckpt, expect, like)
    assert before.processed > 0 and before.counts["anomalies"] > 0

    go = threading.Event()
    frames = [json.dumps(m) for m in _messages(30)]

    async def later(conn) -> None:  # nothing until the test has looked at the restored process
        await asyncio.to_thread(go.wait, 60 * UNIT_S)
        await _lockstep(frames)(conn)

    feed = feed_server(later, impl="websockets")
    proc = app(env=_env(ckpt, feed.url, FORKLESS_METRICS_ADDR="127.0.0.1:0", **extra))
    url = re.search(r"metrics on (http://\S+)/metrics", proc.wait_for_line(r"metrics on http://", stream="stderr",
                                                                             timeout_s=120 * UNIT_S)).group(1)
    proc.wait_for_line(r"connection 1 to .* open", stream="stderr", timeout_s=60 * UNIT_S)
    first = _scrape(url)
    for name in ("forkless_messages_total", "forkless_processed_total", "forkless_batches_total",
                 "forkless_anomalies_total", "forkless_dropped_total", "forkless_errors_total"):
        assert _total(first, name) == 0, (name, _total(first, name))
    for family in ("forkless_dropped", "forkless_errors"):  # labelled series there from the start, at 0
        for reason in KNOWN_REASONS[family]:
            assert first[(family + "_total", (("reason", reason),))] == 0, (family, reason)
    assert _total(first, "forkless_restored_processed") == before.processed
    assert _total(first, "forkless_restored_anomalies") == before.counts["anomalies"]
    newest_at = _total(first, "forkless_checkpoint_last_success_timestamp_seconds")  # the restored one's, not 0
    assert newest_at == pytest.approx(before.wall_time, abs=1e-3)

    go.set()
    feed.wait_for(lambda: feed.received_count >= len(frames), 60 * UNIT_S, "every reply")
    wait_until(lambda: _total(_scrape(url), "forkless_processed_total") == len(frames), timeout_s=30 * UNIT_S,
               what="the replies' messages counted")
    second = _scrape(url)
    for key, value in first.items():  # no counter went down in this process
        if key[0].endswith("_total"):
            assert second.get(key, 0) >= value, key
    assert _total(second, "forkless_processed_total") == len(frames) == second[
        ("forkless_messages_total", (("direction", "in"), ("feed", "0")))]
    assert _total(second, "forkless_restored_processed") == before.processed
    anomalies = _total(second, "forkless_anomalies_total")
    proc.signal(signal.SIGTERM)
    result = proc.finish(timeout_s=60 * UNIT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"before this process (its checkpoint): processed {before.processed}, anomalies " in result.stderr
    after = load_newest(ckpt, expect, like)  # the stop's checkpoint: the counts went on
    assert after.processed == before.processed + len(frames)
    assert after.counts["anomalies"] == before.counts["anomalies"] + anomalies
