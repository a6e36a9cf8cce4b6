"""``forkless relay``: the WebSocket feeds published into a JetStream stream. The relay runs as a
subprocess (``python app.py relay``) between a real WebSocket server (the ``websockets`` library's,
tests/servers.py) and a real nats-server (tests/natsserver.py); the stream is read back with nats-py."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import urllib.request
from typing import Any

import numpy as np
import pytest

from forkless.controller.codec import JsonCodec
from forkless.io_loop.connectors.jetstream.partitions import escape_stream
from forkless.io_loop.errors import FeedFatal, IOThreadError, MetricsServerError
from forkless.io_loop.relay.relaystats import ACROSS_RECONNECT, WITHIN_CONNECTION, SeqGaps
from tests.harness import UNIT_S, run_app, wait_until
from tests.servers import FeedConn, make_messages

pytestmark = pytest.mark.timeout(120 * UNIT_S)

FEATURES = 4
SUBJECT = "ticks"
STREAM = "RELAYED"


def _env(nats_url: str, ws_url: str, **extra: str) -> dict[str, str]:
    return {"FORKLESS_RELAY_NATS": nats_url, "FORKLESS_RELAY_SUBJECT": SUBJECT, "FORKLESS_WS_URL": ws_url,
            "FORKLESS_FEATURES": str(FEATURES), "FORKLESS_STATUS_S": "0", "FORKLESS_HEARTBEAT_S": "0",
            "FORKLESS_CONNECT_TIMEOUT_S": "2", "FORKLESS_RECONNECT_MIN_S": "0.05", "FORKLESS_RECONNECT_MAX_S": "0.3",
            "FORKLESS_SHUTDOWN_TIMEOUT_S": "20", **extra}


def _make_stream(url: str) -> None:
    from tests.natsserver import create_streams

    create_streams(url, stream=STREAM, subjects=[f"{SUBJECT}.>"], results="")


def _stored(url: str) -> list[tuple[str, dict[str, str], bytes]]:
    """Every message of the stream, in order: (subject, headers, payload)."""
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    async def body() -> list[tuple[str, dict[str, str], bytes]]:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
        try:
            js = nc.jetstream()
            total = (await js.stream_info(STREAM)).state.messages
            out: list[tuple[str, dict[str, str], bytes]] = []
            if total:
                sub = await js.pull_subscribe(">", stream=STREAM, config=ConsumerConfig(
                    deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, inactive_threshold=10,
                    mem_storage=True))
                while len(out) < total:
                    for msg in await sub.fetch(min(1000, total - len(out)), timeout=5):
                        out.append((msg.subject, dict(msg.headers or {}), msg.data))
            return out
        finally:
            await nc.close()

    return asyncio.run(body())


def _count(url: str) -> int:
    from tests.natsserver import stream_state

    return stream_state(url, STREAM).messages


def _wait_stored(url: str, n: int, what: str) -> None:
    wait_until(lambda: _count(url) >= n, timeout_s=30 * UNIT_S, what=what, poll_s=0.05)


def _sending(batches: list[list[Any]], *, gates: dict[int, threading.Event] | None = None):
    """A feed script: connection i sends ``batches[i]`` (waiting, before message k of the first
    connection, for ``gates[k]`` to be set), then reads until the client closes; a connection past
    the list only reads."""

    async def script(conn: FeedConn) -> None:
        reader = conn.reading(timeout=120)
        frames = batches[conn.index] if conn.index < len(batches) else []
        for i, frame in enumerate(frames):
            gate = (gates or {}).get(i) if conn.index == 0 else None
            if gate is not None:
                await asyncio.get_running_loop().run_in_executor(None, gate.wait, 60)
            await conn.send(frame)
            if i % 16 == 15:
                await asyncio.sleep(0)
        await reader

    return script


def _end(proc: Any) -> Any:
    proc.signal(signal.SIGTERM)
    return proc.finish(60 * UNIT_S)


# ---- (1) every message arrives once, decodable to what the feed sent, on the escaped subject ---------


def test_every_message_is_stored_once_on_its_escaped_subject_and_decodes_to_what_the_feed_sent(
        feed_server, nats_server, app):
    _make_stream(nats_server.url)
    messages = make_messages(120, streams=3, features=FEATURES, seed=3)
    for i, m in enumerate(messages):  # a stream name with a '.' and a space; numbers float32 cannot hold
        if i % 3 == 0:
            m["stream"] = "a.b c"
        if i % 5 == 0:
            m["x"] = [0.1, 1 / 3, 123456789.123456789, 7]
    server = feed_server(_sending([messages]), impl="websockets")
    # -X importtime: every module the relay imports while it runs is written to stderr
    proc = app("relay", env=_env(nats_server.url, server.url), program=("-X", "importtime", "app.py"))
    _wait_stored(nats_server.url, len(messages), "every message stored")
    result = _end(proc)
    assert result.returncode == 0, result.stderr[-3000:]

    stored = _stored(nats_server.url)
    assert len(stored) == len(messages)
    ids = [headers["Nats-Msg-Id"] for _, headers, _ in stored]
    run_id = ids[0].split(":")[0]
    assert ids == [f"{run_id}:{n}" for n in range(1, len(messages) + 1)]
    as_float32, as_float64 = JsonCodec(FEATURES), JsonCodec(FEATURES, dtype=np.float64)
    for (subject, _, payload), sent in zip(stored, messages):
        assert subject == f"{SUBJECT}.{escape_stream(sent['stream'])}"
        for codec in (as_float32, as_float64):
            got, want = codec.decode(payload), codec.decode(json.dumps(sent))
            assert (got.seq, got.stream) == (want.seq, want.stream) == ([sent["seq"]], [sent["stream"]])
            assert got.x.dtype == want.x.dtype and np.array_equal(got.x, want.x), (payload, sent)
    assert f"{SUBJECT}.a~2Eb~20c" in {subject for subject, _, _ in stored}


def test_the_waiting_messages_leave_in_one_write_each_with_its_id_and_its_acknowledgement_subject(nats_server):
    import nats

    from forkless.controller.config import Config
    from forkless.io_loop.connectors.jetstream.publisher import Publisher, _Connection, _Publication
    from forkless.io_loop.connectors.jetstream.transport import Transport
    from forkless.io_loop.relay.relaystats import RelayStats

    _make_stream(nats_server.url)
    config = Config(relay_nats=nats_server.url, relay_subject=SUBJECT, ws_url="ws://127.0.0.1:9/feed")
    payloads = [json.dumps({"seq": n, "stream": f"s{n % 3}", "x": [n, 0.5]}).encode() for n in range(1, 21)]

    async def body() -> tuple[list[bytes], list[str], str]:
        nc = await nats.connect(nats_server.url, allow_reconnect=False, connect_timeout=2)
        try:
            publisher = Publisher(config.relay, RelayStats(), ["0"], timeouts=config.timeouts,
                                  reconnect=config.reconnect, tls=config.tls)
            prefix = nc.new_inbox() + "."
            acks: list[str] = []
            enough = asyncio.Event()

            async def on_ack(msg: Any) -> None:
                acks.append(msg.subject)
                if len(acks) == len(payloads):
                    enough.set()

            await nc.subscribe(prefix + "*", cb=on_ack)
            await nc.flush()
            writes: list[bytes] = []  # every write to the server's socket, whichever way nats-py makes it
            transport = nc._transport
            write, writelines = transport.write, transport.writelines
            transport.write = lambda data: (writes.append(bytes(data)), write(data))[1]
            transport.writelines = lambda parts: (writes.append(b"".join(parts)), writelines(parts))[1]
            for n, payload in enumerate(payloads, 1):
                publisher._waiting.append(_Publication(None, n, f"{SUBJECT}.s{n % 3}", payload))
            await publisher._publish_waiting(Transport(nc, 2.0), _Connection(asyncio.Event()), prefix)
            await asyncio.wait_for(enough.wait(), 10 * UNIT_S)
            return writes, acks, prefix
        finally:
            await nc.close()

    writes, acks, prefix = asyncio.run(body())
    assert len([w for w in writes if b"HPUB" in w]) == 1  # the 20 publications in one write
    assert sorted(acks) == sorted(f"{prefix}{n}" for n in range(1, 21))
    stored = _stored(nats_server.url)
    run_id = stored[0][1]["Nats-Msg-Id"].split(":")[0]
    assert [(subject, headers["Nats-Msg-Id"], payload) for subject, headers, payload in stored] == \
        [(f"{SUBJECT}.s{n % 3}", f"{run_id}:{n}", payload) for n, payload in enumerate(payloads, 1)]


# ---- (6) no JAX in the relay process ---------------------------------------------------------------


def test_the_relay_process_never_imports_jax(feed_server, nats_server, app):
    _make_stream(nats_server.url)
    server = feed_server(_sending([make_messages(10, features=FEATURES)]), impl="websockets")
    proc = app("relay", env=_env(nats_server.url, server.url), program=("-X", "importtime", "app.py"))
    _wait_stored(nats_server.url, 10, "the messages stored")
    result = _end(proc)
    assert result.returncode == 0, result.stderr[-3000:]
    imported = [line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:") and "|" in line]
    # the relay ran, and imports were seen
    assert "forkless.io_loop.connectors.jetstream.publisher" in imported and "nats" in imported
    assert not [name for name in imported if name == "jax" or name.startswith(("jax.", "jaxlib"))]
    assert not [name for name in imported
                if name in ("forkless.controller.loop", "forkless.controller.engine", "forkless.controller.processor")]


# ---- (2) the NATS server paused, then restarted, mid-run: nothing lost, nothing duplicated --------------


def test_a_nats_server_paused_then_restarted_mid_run_loses_and_duplicates_nothing(feed_server, nats_server, app):
    _make_stream(nats_server.url)
    messages = make_messages(600, streams=4, features=FEATURES, seed=5)
    paused, stopped = threading.Event(), threading.Event()
    server = feed_server(_sending([messages], gates={200: paused, 400: stopped}), impl="websockets")
    proc = app("relay", env=_env(nats_server.url, server.url, FORKLESS_MAX_BATCH="16", FORKLESS_RELAY_MAX_HELD="16",
                                 FORKLESS_QUEUE_SIZE="4"))
    _wait_stored(nats_server.url, 200, "the first third stored")
    # paused (SIGSTOP): the next messages are published into its socket and never acknowledged; the
    # relay gives up on the connection and publishes them again once it answers (same ids)
    nats_server.pause()
    paused.set()
    proc.wait_for_line(r"relay: no acknowledgement from", stream="stderr", timeout_s=30 * UNIT_S)
    nats_server.resume()
    _wait_stored(nats_server.url, 400, "the second third stored")
    nats_server.stop()  # SIGTERM: what it stored stays in its store
    stopped.set()  # the feed sends the last third while the server is down
    proc.wait_for_line(r"relay: connecting to .* failed", stream="stderr", timeout_s=30 * UNIT_S)
    nats_server.start()  # same port, same store
    _wait_stored(nats_server.url, len(messages), "every message stored after the restart")
    result = _end(proc)
    assert result.returncode == 0, result.stderr[-3000:]

    stored = _stored(nats_server.url)
    seqs = [json.loads(payload)["seq"] for _, _, payload in stored]
    ids = [headers["Nats-Msg-Id"] for _, headers, _ in stored]
    assert sorted(seqs) == [m["seq"] for m in messages]  # each once: nothing lost, nothing twice
    assert len(set(ids)) == len(ids) == len(messages)
    assert seqs == sorted(seqs)  # and in the order the feed sent them
    books = re.search(r"relay books: 600 messages read = 600 stored \+ 0 held \+ 0 never stored.*; "
                      r"(\d+) publications retried", result.stderr)
    assert books and int(books.group(1)) > 0, result.stderr[-3000:]  # the pause made the relay publish again


def test_a_message_published_again_after_its_acknowledgement_was_lost_is_counted_as_one_duplicate(
        feed_server, nats_server, app):
    _make_stream(nats_server.url)
    messages = make_messages(2, features=FEATURES, seed=9)
    paused = threading.Event()
    server = feed_server(_sending([messages], gates={1: paused}), impl="websockets")
    proc = app("relay", env=_env(nats_server.url, server.url))
    _wait_stored(nats_server.url, 1, "the first message stored")
    # paused: the second message is published into its socket and never acknowledged; the relay gives
    # up on the connection, the server (continued) stores it from that connection's bytes, and the
    # relay's publication again with the same id is acknowledged as a duplicate (nats-server 2.15
    # writes '"duplicate": true', with a space)
    nats_server.pause()
    paused.set()
    proc.wait_for_line(r"relay: no acknowledgement from", stream="stderr", timeout_s=30 * UNIT_S)
    nats_server.resume()
    _wait_stored(nats_server.url, 2, "the second message stored")
    result = _end(proc)  # the stop waits for the held message's acknowledgement
    assert result.returncode == 0, result.stderr[-3000:]

    assert "relay books: 2 messages read = 2 stored" in result.stderr, result.stderr[-3000:]
    assert "1 publications retried, 1 duplicates dropped by the stream" in result.stderr, result.stderr[-3000:]
    assert [json.loads(payload)["seq"] for _, _, payload in _stored(nats_server.url)] == [0, 1]


# ---- (3) a seq gap across a reconnect of the feed is counted and logged --------------------------------


def test_a_seq_gap_across_a_feed_reconnect_and_within_a_connection_is_counted_and_logged(
        feed_server, nats_server, app):
    _make_stream(nats_server.url)
    first = make_messages(10, features=FEATURES, seed=1)  # seq 0-9, then the server drops the connection
    second = make_messages(10, features=FEATURES, seed=2, start=15)  # seq 15-24: 10-14 missed while down
    second += make_messages(5, features=FEATURES, seed=3, start=30)  # 25-29 skipped within the connection

    async def script(conn: FeedConn) -> None:
        if conn.index == 0:
            for m in first:
                await conn.send(m)
            return  # closes the connection: the relay reconnects
        await _sending([[], second])(conn)

    server = feed_server(script, impl="websockets")
    proc = app("relay", env=_env(nats_server.url, server.url, FORKLESS_METRICS_ADDR="127.0.0.1:0"))
    _wait_stored(nats_server.url, 25, "every message stored")
    metrics = _metrics(proc)
    result = _end(proc)
    assert result.returncode == 0, result.stderr[-3000:]

    assert 'forkless_relay_seq_gaps_total{reason="across a reconnect"} 1.0' in metrics
    assert 'forkless_relay_seq_missing_total{reason="across a reconnect"} 5.0' in metrics
    assert 'forkless_relay_seq_gaps_total{reason="within a connection"} 1.0' in metrics
    assert 'forkless_relay_seq_missing_total{reason="within a connection"} 5.0' in metrics
    assert "feed '0': seq 15 followed 9 across a reconnect: 5 messages missing" in result.stderr
    assert ("seq gaps in this run: 1 gaps across a reconnect (5 messages missing); 1 gaps within a connection "
            "(5 messages missing)") in result.stderr
    assert len(_stored(nats_server.url)) == 25  # the gap is reported, not filled or hidden


def test_a_start_compares_the_feeds_first_seq_with_the_last_stored_and_logs_a_gap_with_its_size(
        feed_server, nats_server, app):
    _make_stream(nats_server.url)
    first = make_messages(20, features=FEATURES, seed=4)  # seq 0-19, stored by the first relay
    later = make_messages(10, features=FEATURES, seed=5, start=27)  # 20-26: as if read by a relay killed -9
    server = feed_server(_sending([first, later]), impl="websockets")
    one = app("relay", env=_env(nats_server.url, server.url))
    _wait_stored(nats_server.url, 20, "the first run's messages stored")
    done = _end(one)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"feed '0' starts at seq 0; stream {STREAM!r} holds nothing under {SUBJECT}.> yet" in done.stderr
    two = app("relay", env=_env(nats_server.url, server.url))
    _wait_stored(nats_server.url, 30, "the second run's messages stored")
    done = _end(two)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (f"feed '0' starts at seq 27, the last one stored in stream {STREAM!r} is seq 19: a gap of 7 messages "
            "between the runs") in done.stderr


@pytest.mark.parametrize("data, problem", [
    (b'{"stream":"RELAY","seq":7}', ""),
    (b'{"stream":"error","seq":7}', ""),  # '"error"' as a value: stored
    (b'{"stream":"RELAY","seq":7,"duplicate":true}', ""),
    (b'{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}',
     "the server did not store a message to {subject}: maximum messages exceeded"),
    (b'{"error":"refused"}', "the server did not store a message to {subject}: refused"),
    (b'["error"]', "the server's acknowledgement is not a JSON object: b'[\"error\"]'"),
    (b'{"error": nope', "the server's acknowledgement is not JSON"),
])
def test_an_acknowledgement_is_read_as_stored_or_as_the_servers_reason_and_never_raises(data, problem):
    from types import SimpleNamespace

    from forkless.io_loop.connectors.jetstream.publisher import _ack_problem

    assert _ack_problem(SimpleNamespace(headers=None, data=data)) == problem


def test_seq_gaps_are_followed_per_feed_or_per_stream_and_a_restarted_numbering_is_not_a_gap():
    per_feed = SeqGaps("feed")
    assert per_feed.observe(0, 1, [0, 1, 2], ["a", "b", "a"]) == []
    gaps = per_feed.observe(0, 2, [5, 6, 9], ["a", "b", "a"])
    assert [(g.before, g.seq, g.reason, g.missing) for g in gaps] == [(2, 5, ACROSS_RECONNECT, 2),
                                                                     (6, 9, WITHIN_CONNECTION, 2)]
    assert per_feed.observe(1, 1, [100], ["a"]) == []  # another feed: its own numbering
    back = per_feed.observe(0, 3, [0], ["a"])
    assert [(g.reason, g.missing) for g in back] == [(ACROSS_RECONNECT, 0)]
    assert (dict(per_feed.gaps), dict(per_feed.missing), dict(per_feed.back)) == (
        {ACROSS_RECONNECT: 1, WITHIN_CONNECTION: 1}, {ACROSS_RECONNECT: 2, WITHIN_CONNECTION: 2},
        {ACROSS_RECONNECT: 1})
    per_stream = SeqGaps("stream")
    assert per_stream.observe(0, 1, [0, 0, 1, 1, 3], ["a", "b", "a", "b", "a"])[0].missing == 1
    assert SeqGaps("none").observe(0, 1, [0, 9], ["a", "a"]) == []


# ---- (4) SIGTERM: everything read is stored, then exit 0 ----------------------------------------------


def _metrics(proc: Any) -> str:
    """The relay's /metrics now (its address from the log line saying where it serves them)."""
    url = re.search(r"metrics on (\S+)", proc.wait_for_line(r"metrics on ", stream="stderr",
                                                             timeout_s=10 * UNIT_S)).group(1)
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def test_sigterm_stores_everything_read_even_what_is_held_then_exits_0(feed_server, nats_server, app):
    _make_stream(nats_server.url)
    messages = make_messages(105, streams=8, features=FEATURES, seed=7)
    paused = threading.Event()
    server = feed_server(_sending([messages], gates={100: paused}), impl="websockets")
    proc = app("relay", env=_env(nats_server.url, server.url, FORKLESS_MAX_BATCH="8", FORKLESS_RELAY_MAX_HELD="3",
                                 FORKLESS_METRICS_ADDR="127.0.0.1:0"))
    _wait_stored(nats_server.url, 100, "the first 100 messages stored")
    # the server paused: the last 5 are read and held when the SIGTERM comes, 3 of them published and
    # unacknowledged (FORKLESS_RELAY_MAX_HELD, not FORKLESS_MAX_BATCH, bounds them), 2 waiting
    nats_server.pause()
    paused.set()
    wait_until(lambda: _metric(_metrics(proc), 'forkless_messages_read_total{feed="0"}') == 105
               and _metric(_metrics(proc), "forkless_relay_published_total") >= 103, timeout_s=30 * UNIT_S,
               what="the last 5 read and 3 of them published", poll_s=0.05)
    text = _metrics(proc)
    assert (_metric(text, "forkless_relay_published_total"), _metric(text, "forkless_relay_acked_total")) == (103, 100)
    assert 3 <= _metric(text, "forkless_relay_in_flight") <= 5  # held: taken, not acknowledged (its name kept)
    proc.signal(signal.SIGTERM)
    proc.wait_for_line(r"SIGTERM received", stream="stderr", timeout_s=30 * UNIT_S)
    nats_server.resume()
    result = proc.finish(60 * UNIT_S)
    assert result.returncode == 0, result.stderr[-3000:]

    assert "relay books: 105 messages read = 105 stored + 0 held + 0 never stored" in result.stderr
    stored = [json.loads(payload)["seq"] for _, _, payload in _stored(nats_server.url)]
    assert stored == list(range(105))


# ---- (5) configuration the relay cannot use: exit 2 naming it --------------------------------------------


@pytest.mark.parametrize(("env", "named"), [
    ({"FORKLESS_RELAY_SUBJECT": "ticks"}, "FORKLESS_RELAY_NATS"),
    ({"FORKLESS_RELAY_NATS": "nats://127.0.0.1:4222"}, "FORKLESS_RELAY_SUBJECT"),
    ({"FORKLESS_RELAY_NATS": "nats://127.0.0.1:4222", "FORKLESS_RELAY_SUBJECT": "ticks.*"},
     "FORKLESS_RELAY_SUBJECT='ticks.*'"),
    ({"FORKLESS_RELAY_NATS": "nats://127.0.0.1:4222", "FORKLESS_RELAY_SUBJECT": "ticks",
      "FORKLESS_FEEDS": json.dumps([{"url": "ws://127.0.0.1:9/feed", "name": "w"},
                                    {"name": "js", "nats": "nats://127.0.0.1:4222", "stream": "S",
                                     "replies": "none"}])}, "feed 1 ('js') is a JetStream feed"),
    ({"FORKLESS_RELAY_NATS": "nats://127.0.0.1:4222", "FORKLESS_RELAY_SUBJECT": "ticks",
      "FORKLESS_OVERFLOW": "drop_oldest"}, "FORKLESS_OVERFLOW"),
])
def test_a_configuration_the_relay_cannot_use_exits_2_naming_it(env, named):
    result = run_app("relay", env=env)
    assert result.returncode == 2, result.stderr
    assert "configuration error" in result.stderr and named in result.stderr, result.stderr


# ---- giving up: the server unreachable, or no stream for the subject, RECONNECT_TRIES times -------------


def test_an_unreachable_server_is_given_up_after_the_tries_with_exit_3_and_no_secret_shown(free_port, feed_server):
    server = feed_server(_sending([make_messages(5, features=FEATURES)]), impl="websockets")
    result = run_app("relay", env=_env(f"nats://relay:SECRET-PW@127.0.0.1:{free_port}", server.url,
                                       FORKLESS_RECONNECT_TRIES="2"))
    assert result.returncode == 3, result.stderr[-3000:]
    assert f"relay: giving up on nats://127.0.0.1:{free_port} after 2 failed attempts in a row" in result.stderr
    assert "SECRET-PW" not in result.stderr + result.stdout


def test_no_stream_for_the_subject_is_retried_then_given_up_with_exit_3_naming_the_subject(feed_server, nats_server):
    server = feed_server(_sending([[{"seq": 1, "stream": "a.b c", "x": [1, 2, 3, 4]}]]), impl="websockets")
    result = run_app("relay", env=_env(nats_server.url, server.url, FORKLESS_RECONNECT_TRIES="2"),
                     timeout_s=60 * UNIT_S)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "no stream stores the subject 'ticks.a~2Eb~20c'" in result.stderr
    assert "1 messages taken from the feeds were never stored" in result.stderr


# ---- end to end: the demo feed -> the relay -> JetStream -> a JetStream feed of the app -> results -------


def test_the_demo_feed_through_the_relay_is_consumed_by_the_app_one_result_per_message(nats_server, app):
    from tests.natsserver import create_streams, read_stream

    create_streams(nats_server.url, stream=STREAM, subjects=[f"{SUBJECT}.>"], results="SCORES",
                   results_subject="scores")
    relayed = run_app("relay", env={**_env(nats_server.url, ""), "FORKLESS_DEMO_RATE": "2000",
                                    "FORKLESS_DEMO_STREAMS": "6", "FORKLESS_DURATION": "1.5"},
                      timeout_s=60 * UNIT_S)
    assert relayed.returncode == 0, relayed.stderr[-3000:]
    read = int(re.search(r"relay books: (\d+) messages read = \1 stored", relayed.stderr).group(1))
    assert read > 0 and _count(nats_server.url) == read

    feed = {"name": "ticks", "nats": nats_server.url, "stream": STREAM, "subject": f"{SUBJECT}.>", "results": "scores"}
    proc = app(env={"FORKLESS_FEEDS": json.dumps([feed]), "FORKLESS_FEATURES": str(FEATURES),
                    "FORKLESS_STATUS_S": "0", "FORKLESS_MAX_STREAMS": "64"})
    from tests.natsserver import stream_state

    wait_until(lambda: stream_state(nats_server.url, "SCORES").messages >= read, timeout_s=90 * UNIT_S,
               what="a result for every relayed message", poll_s=0.2)
    result = _end(proc)
    assert result.returncode == 0, result.stderr[-3000:]
    inputs = {(m["stream"], m["seq"]) for m in (json.loads(p) for _, _, p in _stored(nats_server.url))}
    outputs = [json.loads(payload) for _, payload in read_stream(nats_server.url, "SCORES")]
    assert len(outputs) == read and not [o for o in outputs if "error" in o]
    assert {(o["stream"], o["seq"]) for o in outputs} == inputs  # one result per message, nothing else


# ---- the relay's exit statuses: every ForklessError by its class, in-process, no thread or server ----


class _NoSink:
    """A sink that is never run (the IO thread's start fails first)."""

    name = "nothing"

    async def run(self, ctx: Any) -> None:
        raise AssertionError("not run")


class _IOThatFails:
    """An IO thread whose start fails with ``raised`` (the relay's IOThread, as Relay builds it)."""

    raised: BaseException

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.joined = False

    def start(self) -> None:
        raise self.raised

    @property
    def alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> bool:
        self.joined = True
        return True


def _crash() -> IOThreadError:
    try:
        raise OSError("the loop broke")
    except OSError as cause:
        try:
            raise IOThreadError("the IO thread died: OSError('the loop broke')") from cause
        except IOThreadError as exc:
            return exc


@pytest.mark.parametrize(("raised", "status", "first_line"), [
    (FeedFatal("relay: giving up on nats://127.0.0.1:1"), 3, "forkless: feed error: relay: giving up on nats://127.0.0.1:1"),
    (MetricsServerError("cannot serve metrics"), 2, "forkless: configuration error: cannot serve metrics"),
    (_crash(), 1, "forkless: the IO thread died: OSError('the loop broke')"),
], ids=lambda v: type(v).__name__)
def test_the_relay_ends_with_the_class_s_exit_status_and_its_line(monkeypatch, capsys, raised, status, first_line):
    from forkless.controller.commands import relaycmd
    from forkless.controller.config import Config
    from forkless.controller.lifetime import sinkrun

    monkeypatch.setattr(_IOThatFails, "raised", raised, raising=False)
    monkeypatch.setattr(sinkrun, "IOThread", _IOThatFails)  # the relay's runtime builds it
    config = Config(relay_nats="nats://127.0.0.1:1", relay_subject=SUBJECT)
    relay = relaycmd.Relay(config, relaycmd.relay_settings(config), lambda *args, **kwargs: _NoSink(), None)
    assert relay.run() == status == raised.exit_status
    err = capsys.readouterr().err
    assert err.startswith(first_line + "\n"), err
    if status == 1:
        assert "OSError: the loop broke" in err
    else:
        assert err == first_line + "\n"
    assert relay.io.joined == isinstance(raised, FeedFatal)  # the stop's end of the thread, after a feed gave up


def test_the_relay_s_metrics_are_the_controller_s_one_collector_with_bounded_reasons() -> None:
    """One Prometheus collector (controller/metrics.py) serves the relay's families too: the same
    label bound (MAX_REASONS, the rarest summed as "other") holds for the relay's bad input."""
    from forkless.controller import metrics
    from forkless.controller.commands import relaycmd
    from forkless.controller.metrics import MAX_REASONS, make_registry, render
    from forkless.io_loop.counters import IOStats
    from forkless.io_loop.relay.relaystats import RelayStats

    io = IOStats()
    for n in range(MAX_REASONS + 8):
        io.errors[f"reason {n:02d}"] += 1 + n
    view = relaycmd.RelayView(io.snapshot(), RelayStats().snapshot())
    text = render(make_registry(lambda: view, families=relaycmd.relay_metric_families, process=False)).decode()
    assert "forkless_relay_taken_total 0.0" in text
    assert 'forkless_io_loop_lag_seconds_bucket{le="+Inf"} 0.0' in text
    errors = [line for line in text.splitlines() if line.startswith("forkless_errors_total{")]
    assert len(errors) == MAX_REASONS + 1 and 'forkless_errors_total{reason="other"} 36.0' in text
    assert relaycmd.exposition is metrics.exposition  # no collector of its own
