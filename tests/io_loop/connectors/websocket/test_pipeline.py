"""The whole pipeline in one process against a real WebSocket server on 127.0.0.1: aiohttp's,
and for the core and reconnect tests also the ``websockets`` library's, so a bug that
aiohttp's client and server share cannot hide."""

from __future__ import annotations

import json
import os
import threading
import warnings

import numpy as np
import pytest

from forkless import Config, Controller
from tests.harness import UNIT_S, drive
from tests.reference import EWMAReference
from tests.servers import SERVERS, send_frames

# both threads end to end, the books balanced: run on free-threaded CPython too (.ci/run)
pytestmark = pytest.mark.threads

F = 4


def make_messages(n, streams=5, seed=0, spike_every=37):
    rng = np.random.default_rng(seed)
    out = []
    for seq in range(n):
        x = rng.normal(size=F) * (1 + seq % 3)
        if seq % spike_every == spike_every - 1:
            x[seq % F] += 40
        out.append({"seq": seq, "stream": f"s{rng.integers(0, streams)}", "x": x.round(6).tolist()})
    return out


def drive_until_replies(ctl, server, n_replies):
    """Drive the controller until the server holds ``n_replies`` reply frames; return them, decoded."""
    drive(ctl, lambda: server.received_count >= n_replies, timeout_s=30 * UNIT_S, what=f"{n_replies} replies")
    return server.replies()


def check_against_reference(messages, replies, **ref_args):
    ref = EWMAReference(**ref_args)
    by_seq = {r["seq"]: r for r in replies}
    flagged = 0
    for m in messages:
        z, score, anomaly = ref(m["stream"], m["x"])
        r = by_seq[m["seq"]]
        assert r["stream"] == m["stream"]
        np.testing.assert_allclose(r["z"], z, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(r["score"], score, rtol=1e-4, atol=1e-4)
        assert r["anomaly"] == anomaly, (m, r)
        flagged += anomaly
    return flagged


@pytest.mark.parametrize(("impl", "handoff"), [*((impl, "park") for impl in sorted(SERVERS)), ("aiohttp", "spin")])
def test_results_match_the_one_at_a_time_reference_in_arrival_order(feed_server, impl, handoff):
    messages = make_messages(600)
    # mix single-message frames and batch frames (batch frames repeat streams inside one frame)
    frames, i = [], 0
    while i < len(messages):
        k = 1 if (i // 50) % 2 == 0 else 7
        part = messages[i:i + k]
        frames.append(json.dumps(part[0] if k == 1 else part))
        i += k
    cfg = Config(ws_url="ws://x", features=F, max_batch=16, warmup=5, status_s=0, handoff=handoff)
    server = feed_server(send_frames(frames), impl=impl)
    with Controller(cfg.replace(ws_url=server.url)) as ctl:
        assert ctl.handoff.handoff == handoff  # spin asked for explicitly spins on the CPU too
        drive_until_replies(ctl, server, len(messages))
    server.wait_for(lambda: server.connections[0].closed_at is not None, 5 * UNIT_S, "the client's close")
    replies = server.replies()
    assert [r["seq"] for r in replies] == list(range(len(messages)))  # all answered once, in order
    assert check_against_reference(messages, replies, warmup=5) > 0
    assert [conn.client_close_code for conn in server.connections] == [1000]


def test_bad_input_gets_an_error_each_and_later_messages_are_still_processed(feed_server):
    good = make_messages(30, spike_every=1000)
    bad = [
        "not json at all",
        "[1, 2]",
        json.dumps({"seq": 1000, "stream": "a", "x": [1, 2]}),
        json.dumps({"seq": 1001, "stream": "a", "x": [1, "2", 3, 4]}),
        '{"seq": 1002, "stream": "a", "x": [1, 1e39, 3, 4]}',
        json.dumps({"seq": 1003, "x": [1, 2, 3, 4]}),
        json.dumps({"stream": "a", "x": [1, 2, 3, 4]}),
        json.dumps({"seq": "7", "stream": "a", "x": [1, 2, 3, 4]}),
        b"\xff\xff",
        json.dumps({"seq": 1004, "stream": "new-stream-over-the-limit", "x": [1, 2, 3, 4]}),
    ]
    frames = [json.dumps(m) for m in good[:10]] + bad + [json.dumps(m) for m in good[10:]]
    cfg = Config(ws_url="ws://x", features=F, max_streams=5, status_s=0)
    server = feed_server(send_frames(frames))
    with Controller(cfg.replace(ws_url=server.url)) as ctl:
        replies = drive_until_replies(ctl, server, len(good) + 11)  # "[1, 2]" holds two bad elements
    # after the stop: the IO thread counts a frame once its write returned, which can be after
    # the server has it, so a snapshot taken as the last reply arrives may not count it yet
    stats = ctl.stats()
    errors = [r for r in replies if "error" in r]
    results = [r for r in replies if "error" not in r]
    assert sorted(r["seq"] for r in results) == list(range(30))
    assert len(errors) == 11
    reasons = {r["error"] for r in errors}
    assert {"not JSON", "not an object", "x must have 4 numbers, got 2", "x must hold numbers only",
            "x must be finite and within ±1e18", "missing field: stream", "missing field: seq",
            "seq must be an integer", "not UTF-8", "too many streams (FORKLESS_MAX_STREAMS=5)"} == reasons
    assert {r["seq"] for r in errors} == {None, 1000, 1001, 1002, 1003, 1004}
    check_against_reference(good, results)
    assert stats.errors_total == 11 and stats.messages_out == 30 and stats.errors_out == 11


def test_nothing_forks_and_jax_never_warns_about_fork(feed_server):
    forks = []
    os.register_at_fork(before=lambda: forks.append(threading.current_thread().name))
    messages = make_messages(100)
    cfg = Config(ws_url="ws://x", features=F, status_s=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # JAX's "os.fork() was called" RuntimeWarning would raise
        server = feed_server(send_frames([json.dumps(m) for m in messages]))
        with Controller(cfg.replace(ws_url=server.url)) as ctl:
            replies = drive_until_replies(ctl, server, len(messages))
    assert len(replies) == 100
    assert forks == []
    assert sorted(t.name for t in threading.enumerate() if t.name.startswith("forkless")) == []


@pytest.mark.parametrize("impl", sorted(SERVERS))
def test_state_survives_a_reconnect(feed_server, impl):
    messages = make_messages(60, streams=2)
    cfg = Config(ws_url="ws://x", features=F, status_s=0, reconnect_min_s=0.05, reconnect_max_s=0.1)
    first, second = ([json.dumps(m) for m in part] for part in (messages[:30], messages[30:]))
    server = feed_server(send_frames(first, second), impl=impl)
    with Controller(cfg.replace(ws_url=server.url)) as ctl:
        drive_until_replies(ctl, server, 30)
        server.drop()
        replies = drive_until_replies(ctl, server, 60)
        assert ctl.stats().reconnects == 1
    assert len(server.connections) == 2
    assert len(replies) == 60
    check_against_reference(messages, replies)


def test_the_controller_refuses_to_process_before_start():
    with pytest.raises(RuntimeError, match="start"):
        Controller(Config(status_s=0)).process_pending()
