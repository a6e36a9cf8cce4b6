"""Several feeds in one process (FORKLESS_FEEDS): configuration, stream identity, each reply on
the connection its message came from, one feed down or refused without holding the others,
per-feed figures, and secrets of every feed kept out of every output."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from typing import Any

import numpy as np
import pytest

from forkless import Runtime
from forkless.controller.config import Config
from forkless.controller.loop import Controller
from forkless.controller.metrics import metric_families
from forkless.controller.processor import ewma_processor
from forkless.controller.stats import status_line
from forkless.io_loop.crossing import HOPS, PICKED, READ, SAMPLE_EVERY, WRITTEN, Trace
from forkless.io_loop.errors import ConfigError
from tests.controller.test_loop import chunk
from tests.fake_io import FakeIO, drain
from tests.harness import UNIT_S, assert_books_balance, drive, quick_config, run_app
from tests.reference import EWMAReference
from tests.servers import FeedConn, assert_results_match_reference, make_messages, parse_replies

pytestmark = pytest.mark.timeout(90 * UNIT_S)

PROCESSOR = ewma_processor()
FEATURES = 4


def _feeds(*feeds: dict) -> str:
    return json.dumps(list(feeds))


def _config(feeds: str, **changes: Any) -> Config:
    return quick_config(feeds=feeds, features=FEATURES, **{"reconnect_reset_s": 1.0, **changes})


def _renamed(messages: list[dict], prefix: str, seq_from: int) -> list[dict]:
    """The same messages with stream names ``prefix<k>`` and seqs from ``seq_from`` (so a reply
    that went to the wrong connection shows up as a seq that feed never sent)."""
    return [{**m, "stream": prefix + m["stream"][1:], "seq": seq_from + i} for i, m in enumerate(messages)]


# ---- configuration ------------------------------------------------------------------------------


def test_feeds_are_read_with_names_defaults_and_a_json_subscribe_sent_as_compact_text():
    cfg = Config.from_env({"FORKLESS_FEEDS": _feeds(
        {"url": "ws://127.0.0.1:9001/a", "name": "venue-a", "subscribe": {"op": "sub", "args": ["x"]}},
        {"url": "wss://127.0.0.1:9002/b", "headers": {"X-Key": "k"}, "required": False},
        {"url": "ws://127.0.0.1:9003/c", "subscribe": "SUB c"})})
    a, b, c = cfg.feed_specs
    assert (a.name, b.name, c.name) == ("venue-a", "1", "2")
    assert a.subscribe == '{"op":"sub","args":["x"]}' and c.subscribe == "SUB c" and b.subscribe == ""
    assert b.headers == (("X-Key", "k"),) and not b.required and a.required
    assert not cfg.uses_demo_feed and cfg.stream_keys_by_feed


def test_the_one_feed_shorthand_is_one_feed_named_0_with_plain_stream_keys():
    cfg = Config(ws_url="ws://127.0.0.1:9/feed", subscribe='{"op":"sub"}')
    (feed,) = cfg.feed_specs
    assert (feed.name, feed.url, feed.subscribe) == ("0", "ws://127.0.0.1:9/feed", '{"op":"sub"}')
    assert not cfg.stream_keys_by_feed
    two = _feeds({"url": "ws://h:1/a"}, {"url": "ws://h:2/b"})
    assert not Config(feeds=two, shared_streams=True).stream_keys_by_feed


def test_feeds_may_come_from_a_file(tmp_path):
    path = tmp_path / "feeds.json"
    path.write_text(_feeds({"url": "ws://127.0.0.1:9001/a", "name": "a"}, {"url": "ws://127.0.0.1:9002/b"}))
    cfg = Config.from_env({"FORKLESS_FEEDS": f"@{path}"})
    assert [f.name for f in cfg.feed_specs] == ["a", "1"]


@pytest.mark.parametrize(("env", "expected"), [
    ({"FORKLESS_FEEDS": _feeds({"url": "ws://h:1/a"}), "FORKLESS_WS_URL": "ws://h:2/b"},
     "either FORKLESS_FEEDS or FORKLESS_WS_URL"),
    ({"FORKLESS_FEEDS": _feeds({"url": "ws://h:1/a"}), "FORKLESS_SUBSCRIBE": '{"k": "SUBSECRET"}'},
     "either FORKLESS_FEEDS or FORKLESS_SUBSCRIBE"),
    ({"FORKLESS_FEEDS": _feeds({"url": "ws://h:1/a", "name": "a"}, {"url": "http://h:2/b", "name": "bee"})},
     "feed 1 ('bee'): \"url\" must be a ws:// or wss:// URL"),
    ({"FORKLESS_FEEDS": _feeds({"url": "ws://h:1/a"}, {"url": "ws://h:2/b", "headers": ["x"]})},
     "feed 1 ('1'): \"headers\" must be a JSON object of string values"),
    ({"FORKLESS_FEEDS": _feeds({"url": "ws://h:1/a", "name": "x"}, {"url": "ws://h:2/b", "name": "x"})},
     "feed names must differ: 'x'"),
    ({"FORKLESS_FEEDS": _feeds({"url": "ws://h:1/a", "name": "a b"})}, "feed 0: \"name\" must be"),
    ({"FORKLESS_FEEDS": _feeds({"url": "ws://h:1/a", "token": "t"})}, "feed 0 ('0'): unknown field(s) 'token'"),
    ({"FORKLESS_FEEDS": "[]"}, "a non-empty JSON list"),
    ({"FORKLESS_FEEDS": "@/no/such/feeds.json"}, "cannot read /no/such/feeds.json"),
    ({"FORKLESS_FEEDS": _feeds({"url": "ws://u:PWSECRET@h:1/a", "name": "a"}), "FORKLESS_AUTH_TOKEN": "TOKSECRET"},
     "one source of credentials"),
    # JSON has no NaN or infinity: such a subscribe would be sent as a frame that is not JSON
    ({"FORKLESS_FEEDS": '[{"url": "ws://h:1/a", "subscribe": {"k": "SUBSECRET", "x": NaN}}]'},
     "feed 0 ('0'): \"subscribe\" is a text or a JSON value with finite numbers only"),
    ({"FORKLESS_FEEDS": '[{"url": "ws://h:1/a", "subscribe": [1e999]}]'}, '"subscribe" is a text or a JSON value'),
])
def test_a_bad_feeds_setting_names_the_feed_and_the_field_and_never_a_secret(env, expected):
    with pytest.raises(ConfigError) as err:
        Config.from_env(env)
    text = str(err.value)
    assert expected in text, text
    for secret in ("PWSECRET", "TOKSECRET", "SUBSECRET", "http://h"):
        assert secret not in text


def test_feeds_exit_2_with_one_line_naming_the_feed():
    env = {"FORKLESS_FEEDS": _feeds({"url": "ws://h:1/a", "name": "a", "subscribe": {"key": "SUB-SECRET"}},
                                    {"url": "wss://h:2/b?token=Q-SECRET", "name": "b", "headers": {"X": 1}})}
    result = run_app(env=env)
    assert result.returncode == 2
    assert "FORKLESS_FEEDS" in result.stderr and "feed 1 ('b'): \"headers\"" in result.stderr
    assert "SUB-SECRET" not in result.stderr + result.stdout and "Q-SECRET" not in result.stderr + result.stdout


# ---- stream identity and routing (fake IO side: exact order) -------------------------------------


def _chunk(feed: int, seqs: list[int], streams: list[str], xs: np.ndarray):
    c = chunk(seqs, streams, xs)
    c.feed = feed
    return c


@pytest.mark.parametrize("shared", [False, True])
def test_a_batch_mixing_feeds_is_answered_per_feed_in_order_and_streams_are_per_feed_unless_shared(shared):
    # three feeds; "s0" exists on feeds 0 and 2: two streams, or one if FORKLESS_SHARED_STREAMS=1
    cfg = Config(feeds=_feeds({"url": "ws://h:1/a"}, {"url": "ws://h:2/b"}, {"url": "ws://h:3/c"}),
                 shared_streams=shared, features=2, max_batch=64, max_streams=16, max_wait_ms=50.0, status_s=0.0,
                 warmup=1)
    rng = np.random.default_rng(3)
    plan = [(0, "s0"), (2, "s0"), (1, "t1"), (0, "s1"), (2, "s0"), (0, "s0"), (1, "t1"), (2, "s2")] * 4
    xs = rng.normal(size=(len(plan), 2)).round(4)
    fake = FakeIO()
    with Controller(cfg, processor=ewma_processor(), runtime=Runtime(io_factory=fake)) as ctl:
        for i, (feed, stream) in enumerate(plan):
            fake.inbound.put_nowait(_chunk(feed, [i], [stream], xs[i:i + 1]))
        while ctl.process_pending():
            pass
        items = drain(fake.outbound)
    assert any(len(item.parts) == 3 for item in items)  # batches did mix the feeds: one bundle, a part per feed
    got: dict[int, list[dict]] = {0: [], 1: [], 2: []}
    for part in (part for item in items for part in item.unbundled()):
        got[part.feed].extend(json.loads(frame) for frame in part.frames)
    ref = EWMAReference(warmup=1)
    for feed in (0, 1, 2):
        mine = [i for i, (f, _) in enumerate(plan) if f == feed]
        assert [r["seq"] for r in got[feed]] == mine  # every reply on its feed, in arrival order
    by_seq = {r["seq"]: r for rs in got.values() for r in rs}
    for i, (feed, stream) in enumerate(plan):  # arrival order is the processing order here
        z, score, _ = ref(stream if shared else f"{feed}:{stream}", xs[i])
        np.testing.assert_allclose(by_seq[i]["z"], z, rtol=2e-3, atol=2e-3, err_msg=f"message {i}")
        assert abs(by_seq[i]["score"] - score) <= 2e-3 * max(1.0, abs(score))
        assert by_seq[i]["stream"] == stream  # the reply names the stream as the feed sent it


# ---- real feeds --------------------------------------------------------------------------------


def _servers(feed_server, scripts):
    impls = ["aiohttp", "websockets", "aiohttp"]
    return [feed_server(script, impl=impls[i % 3]) for i, script in enumerate(scripts)]


def _sender(messages: list[dict], done: threading.Event | None = None, *, after: threading.Event | None = None):
    """A script: (after ``after`` is set) send ``messages`` one by one, then read until every
    one is answered (then set ``done``) and the client closes."""

    async def script(conn: FeedConn) -> None:
        reader = conn.reading(timeout=60)
        while after is not None and not after.is_set():
            await asyncio.sleep(0.01)
        for i, m in enumerate(messages):
            await conn.send(m)
            if i % 8 == 0:
                await asyncio.sleep(0.001)
        while conn.server.received_count < len(messages):
            await asyncio.sleep(0.005)
        if done is not None:
            done.set()
        await reader

    return script


def test_three_feeds_each_reply_on_its_own_connection_equal_to_the_reference_per_feed_and_stream(feed_server):
    a = _renamed(make_messages(150, streams=4, seed=1), "s", 0)
    b = _renamed(make_messages(150, streams=3, seed=2), "b", 1000)
    c = _renamed(make_messages(150, streams=4, seed=3), "s", 2000)  # s0..s3 again: other streams (feed c)
    done = [threading.Event() for _ in range(3)]
    servers = _servers(feed_server, [_sender(msgs, ev) for msgs, ev in zip((a, b, c), done)])
    cfg = _config(_feeds(*({"url": s.url, "name": n} for s, n in zip(servers, "abc"))))
    with Controller(cfg, processor=PROCESSOR) as ctl:
        drive(ctl, lambda: all(ev.is_set() for ev in done), timeout_s=30 * UNIT_S, what="every feed answered")
        snap = ctl.stats()
        fams = {fam.name: fam for fam in metric_families(snap)}
        line = status_line(snap, None)
    for server, messages in zip(servers, (a, b, c)):
        results, errors = parse_replies(server.received)
        assert errors == []
        assert_results_match_reference(messages, results)  # its own seqs only: none went astray
    assert [f.name for f in snap.feeds] == ["a", "b", "c"]
    assert [f.io.messages_in for f in snap.feeds] == [150, 150, 150] and snap.messages_in == 450
    assert [f.io.results_out for f in snap.feeds] == [150, 150, 150] and snap.messages_out == 450
    assert snap.streams_active == 11 and snap.connected and snap.ready
    out = {s.labels["feed"]: s.value for s in fams["forkless_messages"].samples if s.labels["direction"] == "out"}
    assert out == {"a": 150, "b": 150, "c": 150}
    assert {s.labels["feed"]: s.value for s in fams["forkless_connected"].samples} == {"a": 1, "b": 1, "c": 1}
    assert "feeds 3/3 connected" in line
    assert_books_balance(ctl)


def test_a_feed_restarting_mid_run_loses_nothing_and_does_not_hold_back_the_other_feeds(feed_server):
    a = _renamed(make_messages(120, streams=4, seed=4), "s", 0)
    b = _renamed(make_messages(160, streams=4, seed=5), "s", 1000)
    c = _renamed(make_messages(120, streams=4, seed=6), "s", 2000)
    b_down = threading.Event()
    done_a, done_b, done_c = threading.Event(), threading.Event(), threading.Event()
    b_connections_when_others_done: list[int] = []

    async def restarting(conn: FeedConn) -> None:
        # connection 0: half the messages, then the server restarts: close, refuse connections
        # for a while; connection 1: the other half
        reader = conn.reading(timeout=60)
        half = b[:80] if conn.index == 0 else b[80:]
        for m in half:
            await conn.send(m)
        if conn.index == 0:
            await conn.send_close()
            await reader
            b_down.set()
            await conn.server.refuse_for(4.0 * UNIT_S)
            return
        while conn.server.received_count < len(b):
            await asyncio.sleep(0.005)
        done_b.set()
        await reader

    def others_done() -> bool:
        if done_a.is_set() and done_c.is_set() and not b_connections_when_others_done:
            b_connections_when_others_done.append(len(servers[1].connections))
        return done_a.is_set() and done_b.is_set() and done_c.is_set()

    servers = _servers(feed_server, [_sender(a, done_a, after=b_down), restarting, _sender(c, done_c, after=b_down)])
    cfg = _config(_feeds(*({"url": s.url, "name": n} for s, n in zip(servers, "abc"))))
    with Controller(cfg, processor=PROCESSOR) as ctl:
        drive(ctl, others_done, timeout_s=40 * UNIT_S, what="every feed answered")
        snap = ctl.stats()
    for server, messages in zip(servers, (a, b, c)):
        results, errors = parse_replies(server.received)
        assert errors == []
        assert_results_match_reference(messages, results)  # b's streams continue across its restart
    assert b_connections_when_others_done == [1]  # a and c were fully answered while b was down
    assert [f.io.reconnects for f in snap.feeds] == [0, 1, 0]
    assert snap.dropped == {}
    assert_books_balance(ctl)


def test_a_feed_refused_with_401_is_given_up_and_the_others_go_on(feed_server, free_port):
    a = _renamed(make_messages(100, streams=4, seed=7), "s", 0)
    done = threading.Event()
    good = feed_server(_sender(a, done))
    refused = feed_server(impl="websockets", handshake_status=lambda i: 401)
    cfg = _config(_feeds({"url": good.url, "name": "good"}, {"url": refused.url, "name": "locked"}),
                  metrics_addr=f"127.0.0.1:{free_port}")
    with Controller(cfg, processor=PROCESSOR) as ctl:
        drive(ctl, lambda: done.is_set() and ctl.stats().feeds[1].given_up != "", timeout_s=30 * UNIT_S,
              what="the good feed answered and the refused one given up")
        with pytest.raises(RuntimeError, match=r"send\('locked'\): 1 frames not sent: the source has ended "
                                               r"\(it gave up: .*HTTP 401"):
            ctl.send("locked", "an order to the feed that gave up")
        snap = ctl.stats()
        with pytest.raises(urllib.error.HTTPError) as not_ready:
            urllib.request.urlopen(f"{ctl.metrics_url}/readyz", timeout=5 * UNIT_S)
        readyz = json.loads(not_ready.value.read())
    results, errors = parse_replies(good.received)
    assert errors == [] and len(refused.attempts) == 1
    assert_results_match_reference(a, results)
    assert "HTTP 401" in snap.feeds[1].given_up and snap.feeds[0].given_up == ""
    assert not snap.ready  # a required feed gave up
    assert readyz["feeds"]["locked"]["given_up"] and readyz["feeds"]["good"]["connected"]
    assert any("required feed 'locked' gave up" in reason for reason in readyz["reasons"])
    assert_books_balance(ctl)


def test_an_optional_feed_that_gave_up_leaves_the_process_ready(feed_server, free_port):
    good = feed_server()
    refused = feed_server(handshake_status=lambda i: 403)
    cfg = _config(_feeds({"url": good.url}, {"url": refused.url, "required": False}),
                  metrics_addr=f"127.0.0.1:{free_port}")
    with Controller(cfg, processor=PROCESSOR) as ctl:
        drive(ctl, lambda: ctl.stats().feeds[1].given_up != "" and ctl.stats().ready, timeout_s=20 * UNIT_S,
              what="the optional feed given up, the process ready")
        with urllib.request.urlopen(f"{ctl.metrics_url}/readyz", timeout=5 * UNIT_S) as answer:
            readyz = json.loads(answer.read())
    assert readyz["status"] == "ready" and readyz["feeds"]["1"]["given_up"]


def test_the_process_exits_3_when_every_feed_has_given_up_and_at_the_first_with_feed_fatal_any(feed_server):
    good = feed_server()
    refused = [feed_server(handshake_status=lambda i: 401) for _ in range(2)]
    env = {"FORKLESS_FEATURES": "4", "FORKLESS_STATUS_S": "0", "FORKLESS_CONNECT_TIMEOUT_S": "2"}
    every = run_app(env={**env, "FORKLESS_FEEDS": _feeds(*({"url": s.url} for s in refused))},
                    timeout_s=60 * UNIT_S)
    assert every.returncode == 3, every.stderr
    assert "every feed has given up" in every.stderr
    one = run_app(env={**env, "FORKLESS_FEED_FATAL": "any", "FORKLESS_FEEDS": _feeds(
        {"url": good.url, "name": "good"}, {"url": refused[0].url, "name": "bad"})})
    assert one.returncode == 3, one.stderr
    assert "feed 'bad'" in one.stderr and "FORKLESS_FEED_FATAL=any" in one.stderr


def test_secrets_of_every_feed_are_used_but_never_appear_in_any_output(feed_server):
    messages = _renamed(make_messages(20, streams=2, seed=8), "s", 0)
    done = threading.Event()
    # (the websockets test server answers a path with a query with 404: it gets the 401 role)
    servers = [feed_server(_sender(messages, done)), feed_server(),
               feed_server(impl="websockets", handshake_status=lambda i: 401)]
    secrets = ["SUB-SECRET-1", "HDR-SECRET-2", "QUERY-SECRET-3", "PASS-SECRET-4", "SUB-SECRET-5"]
    feeds = _feeds(
        {"url": servers[0].url, "name": "a", "subscribe": {"auth": secrets[0]}, "headers": {"X-Key": secrets[1]}},
        {"url": servers[1].url + f"?token={secrets[2]}", "name": "b", "subscribe": secrets[4]},
        {"url": servers[2].url.replace("ws://", f"ws://user:{secrets[3]}@"), "name": "c"})
    env = {"FORKLESS_FEEDS": feeds, "FORKLESS_FEATURES": "4", "FORKLESS_STATUS_S": "0.2",
           "FORKLESS_DURATION": str(3 * UNIT_S), "FORKLESS_LOG_LEVEL": "DEBUG"}
    check = run_app("--check", env=env)
    run = run_app(env=env)
    helped = run_app("--help", env=env)
    assert run.returncode == 0, run.stderr
    assert check.returncode == 3 and "feed 'c'" in check.stdout + check.stderr  # c refuses with 401
    assert "b=ws://127.0.0.1" in check.stdout  # feeds are shown, without their secrets
    for result in (check, run, helped):
        for secret in secrets:
            assert secret not in result.stdout + result.stderr, (secret, result.stdout, result.stderr)
    # they were used: the subscribe messages and the header reached the servers
    assert servers[0].connections[0].received[0] == json.dumps({"auth": secrets[0]}, separators=(",", ":"))
    assert [conn.received[:1] for conn in servers[1].connections] == [[secrets[4]]] * 2, servers[1].describe()
    assert servers[0].attempts[0].headers["X-Key"] == secrets[1]


def _lockstep_timed(messages: list[dict], sent_ns: list[int], replied_ns: list[int], done: threading.Event):
    """A script: send each message only once the one before is answered (so every chunk the
    client hands over holds one message), stamping ``time.monotonic_ns()`` just before each
    send and just after its reply arrived; then set ``done`` and read until the client closes."""

    async def script(conn: FeedConn) -> None:
        for m in messages:
            sent_ns.append(time.monotonic_ns())
            await conn.send(m)
            assert await conn.recv(timeout=30 * UNIT_S) is not None, f"no reply to seq {m['seq']}"
            replied_ns.append(time.monotonic_ns())
        done.set()
        await conn.read_until_closed(timeout=60)

    return script


def test_one_message_in_64_carries_hop_stamps_in_order_taken_between_its_send_and_its_reply(feed_server, monkeypatch):
    # the latency budget (crossing.HOPS), with two feeds: each feed's handover samples its first
    # message and then one in SAMPLE_EVERY (io_loop/handover.py); with one message per chunk
    # that is exactly messages 0, 64, ..., 320 of each feed. The server's own clock brackets
    # each sampled message's stamps, and the histograms hold exactly what the stamps say.
    n = 5 * SAMPLE_EVERY + 1  # the last message is a sampled one
    messages = [_renamed(make_messages(n, streams=4, seed=9), "s", 0),
                _renamed(make_messages(n, streams=4, seed=10), "s", 1000)]
    sent_ns: list[list[int]] = [[], []]
    replied_ns: list[list[int]] = [[], []]
    done = [threading.Event(), threading.Event()]
    stamped: list[tuple[int, list[int]]] = []  # (feed, stamps) of each sampled message, once written
    hops_s = Trace.hops_s

    def recorded_hops_s(trace: Trace) -> list[float]:  # the writer calls it once WRITTEN is stamped
        stamped.append((trace.feed, list(trace.ns)))
        return hops_s(trace)

    monkeypatch.setattr(Trace, "hops_s", recorded_hops_s)
    servers = _servers(feed_server, [_lockstep_timed(messages[f], sent_ns[f], replied_ns[f], done[f]) for f in (0, 1)])
    cfg = _config(_feeds({"url": servers[0].url}, {"url": servers[1].url}))
    with Controller(cfg, processor=PROCESSOR) as ctl:
        drive(ctl, lambda: all(ev.is_set() for ev in done), timeout_s=30 * UNIT_S, what="both feeds answered")
    snap = ctl.stats()  # after the stop: the IO thread has written and counted everything
    per_feed = 1 + (n - 1) // SAMPLE_EVERY
    for feed in (0, 1):
        stamps = sorted(ns for f, ns in stamped if f == feed)
        assert len(stamps) == per_feed, (feed, len(stamps))
        for k, ns in enumerate(stamps):
            i = k * SAMPLE_EVERY  # the message it was sampled from
            assert all(ns) and ns == sorted(ns), (feed, i, ns)  # every stamp taken, each after the one before
            assert sent_ns[feed][i] <= ns[READ] and ns[PICKED] <= replied_ns[feed][i], (feed, i)
    hops = snap.hops
    assert list(hops) == [*HOPS, "total"]
    assert all(h.n == 2 * per_feed for h in hops.values())
    for h, name in enumerate(HOPS):
        assert hops[name].total == pytest.approx(sum(ns[h + 1] - ns[h] for _, ns in stamped) * 1e-9, rel=1e-9)
    assert hops["total"].total == pytest.approx(sum(ns[WRITTEN] - ns[READ] for _, ns in stamped) * 1e-9, rel=1e-9)
    assert [f.io.hops["total"].n for f in snap.feeds] == [per_feed, per_feed]
    fam = {f.name: f for f in metric_families(snap)}["forkless_hop_seconds"]
    counts = {s.labels["hop"]: s.value for s in fam.samples if s.name.endswith("_count")}
    assert counts == dict.fromkeys([*HOPS, "total"], 2 * per_feed)
