"""The documents' commands and code examples must stay true: the README's test command is what
CI runs, and every embedding example (the README's short one, EMBEDDING.md's) runs here.

The generated tables (variables, metrics, exit statuses) are checked in tests/docs/test_docs.py.
"""

from __future__ import annotations

import json
import math
import random
import re
import signal

import pytest

from tests.harness import ROOT, UNIT_S, AppResult, run_app
from tests.servers import LoopbackServer, send_frames

README = (ROOT / "README.md").read_text()
# the embedding guide: EMBEDDING.md and its pages under docs/embedding/
GUIDE = (ROOT / "EMBEDDING.md", *sorted((ROOT / "docs" / "embedding").glob("*.md")))
EMBEDDING = "".join(path.read_text() for path in GUIDE)


def example(name: str, document: str = "EMBEDDING.md") -> str:
    """The code of the ``<!-- example: NAME -->`` block of ``document``."""
    text = README if document == "README.md" else EMBEDDING
    match = re.search(rf"<!-- example: {name} -->\n```python\n(.*?)```", text, re.S)
    assert match, f"{document} example {name!r} not found"
    return match.group(1)


def run_example(name: str, url: str, document: str = "EMBEDDING.md") -> AppResult:
    return run_app(env={"FORKLESS_WS_URL": url, "FORKLESS_RECONNECT_MIN_S": "0.1"},
                   program=("-c", example(name, document)), timeout_s=90 * UNIT_S)


def test_the_test_command_in_the_readme_is_what_ci_runs():
    command = ("python -m venv .venv && . .venv/bin/activate && python -m pip install -r requirements-dev.txt"
               " && JAX_PLATFORMS=cpu python -m pytest -q")
    assert f"```\n{command}\n```" in README
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci.splitlines()


def test_the_readme_s_short_example_runs_its_own_processor_with_the_json_codec(feed_server):
    frames = [json.dumps({"seq": i, "stream": "s", "x": [float(i)] * 8}) for i in range(10)]
    server = feed_server(send_frames(frames))
    proc = run_example("short", server.url, "README.md")
    server.wait_for(lambda: len(server.connections) == 1 and server.connections[0].closed_at is not None,
                    5 * UNIT_S, "the example's connection closed")
    assert proc.returncode == 0, proc.stderr
    replies = server.replies()
    assert [r["seq"] for r in replies] == list(range(10))
    # however the messages were batched, the last reply holds every message of the stream
    assert replies[-1]["n"] == 10 and replies[-1]["mean"] == [4.5] * 8


def test_every_example_in_the_documents_is_run_by_a_test():
    tested = {("README.md", "short"), ("EMBEDDING.md", "blocking"), ("EMBEDDING.md", "on_results"),
              ("EMBEDDING.md", "driven"), ("EMBEDDING.md", "subscribe"), ("EMBEDDING.md", "source"),
              ("EMBEDDING.md", "portal"), ("EMBEDDING.md", "credentials"), ("EMBEDDING.md", "reconnecting"),
              ("EMBEDDING.md", "relogin"), ("EMBEDDING.md", "weights"),  # relogin: tests/io_loop/test_relogin.py
              ("EMBEDDING.md", "connection_events"),  # tests/io_loop/test_connection_events.py
              ("EMBEDDING.md", "stop"), ("EMBEDDING.md", "sink"), ("EMBEDDING.md", "results_sink"),
              ("EMBEDDING.md", "deadlines"),  # deadlines: tests/io_loop/test_send_deadlines.py
              ("EMBEDDING.md", "settings"), ("EMBEDDING.md", "rows")}
    found = {(doc, name) for doc, text in (("README.md", README), ("EMBEDDING.md", EMBEDDING))
             for name in re.findall(r"<!-- example: (\w+) -->", text)}
    assert found == tested


def test_the_weights_example_swaps_the_weights_between_two_batches_with_nothing_compiled(feed_server):
    frames = [json.dumps({"seq": i, "stream": "s", "x": [1.0] * 8}) for i in range(10)]
    server = feed_server(send_frames(frames, gap_s=0.1))  # paced: the swap falls between two messages
    proc = run_example("weights", server.url)
    assert proc.returncode == 0, proc.stderr
    swapped = re.search(r"weights v2 since message (\d+), compilations after warm-up 0", proc.stdout)
    assert swapped, proc.stdout
    k = int(swapped.group(1))
    replies = server.replies()
    # 8 ones with w = 1, b = 0, then with w = 2, b = 1; the running total carries on across the swap
    assert [r["y"] for r in replies] == [8.0] * k + [17.0] * (10 - k) and 5 <= k < 10
    assert [r["total"] for r in replies] == [8.0 * (i + 1) for i in range(k)] + \
        [8.0 * k + 17.0 * (i + 1) for i in range(10 - k)]


def test_the_blocking_embedding_example_runs_with_its_own_processor_and_codec(feed_server):
    frames = ["a,0,3,4", "b,1,1,0", "a,2,0,2", "a,3,bad"]
    server = feed_server(send_frames(frames, gap_s=0.2))  # paced: one message per batch
    proc = run_example("blocking", server.url)
    server.wait_for(lambda: len(server.connections) == 1 and server.connections[0].closed_at is not None,
                    5 * UNIT_S, "the example's connection closed")
    assert proc.returncode == 0, proc.stderr
    assert server.received == ["0,a,1,5.000", "1,b,1,1.000", "2,a,2,2.000", "error,None,need 2 values"]


def test_the_driven_embedding_example_runs_the_default_detector(feed_server):
    frames = [json.dumps({"seq": i, "stream": "s", "x": [float(i % 3)] * 8}) for i in range(50)]
    server = feed_server(send_frames(frames))
    proc = run_example("driven", server.url)
    server.wait_for(lambda: len(server.connections) == 1 and server.connections[0].closed_at is not None,
                    5 * UNIT_S, "the example's connection closed")
    assert proc.returncode == 0, proc.stderr
    assert "50 results sent, 0 anomalies, 0 errors" in proc.stdout
    assert len(server.replies()) == 50


def test_the_settings_example_builds_its_config_from_groups_over_the_environment(feed_server):
    frames = [json.dumps({"seq": i, "stream": "s", "x": [float(i % 3)] * 8}) for i in range(20)]
    server = feed_server(send_frames(frames))
    proc = run_example("settings", server.url)
    assert proc.returncode == 0, proc.stderr
    assert "ReconnectSettings(min_s=0.1, max_s=5.0, reset_s=5.0, tries=0) 256 256" in proc.stdout
    assert "20 results sent, 0 unanswered" in proc.stdout
    assert len(server.replies()) == 20


def test_the_on_results_example_acts_on_anomalies_in_program(feed_server):
    frames = [json.dumps({"seq": i, "stream": "s", "x": [float(i % 3)] * 8}) for i in range(40)]
    frames.append(json.dumps({"seq": 40, "stream": "s", "x": [90.0] * 8}))  # a spike after warm-up
    server = feed_server(send_frames(frames))
    proc = run_example("on_results", server.url)
    assert proc.returncode == 0, proc.stderr
    assert "1 anomalies acted on in-program: [('s', 40)]" in proc.stdout
    assert len(server.replies()) == 41


def test_the_subscribe_example_signs_every_connection_and_consumes_the_acknowledgements(feed_server):
    import hashlib
    import hmac

    messages = [{"seq": i, "stream": "ab"[i % 2], "x": [float(i)] * 8} for i in range(4)]

    async def script(conn):
        await conn.recv(timeout=10)  # the subscription
        await conn.send({"event": "subscribed"})
        if conn.index == 0:
            for m in messages:
                await conn.send(m)
            for _ in messages:
                await conn.recv(timeout=10)
            await conn.close_keep_reading()  # the example reconnects and subscribes again
        else:
            await conn.read_until_closed(timeout=30)

    server = feed_server(script, impl="websockets")
    proc = run_example("subscribe", server.url)
    assert proc.returncode == 0, proc.stderr
    assert "6 frames in, 4 messages, 0 errors, 2 connections" in proc.stdout
    subs = [json.loads(conn.received[0]) for conn in server.connections]
    assert [(sub["connection"], sub["streams"]) for sub in subs] == [(1, []), (2, ["a", "b"])]
    for sub in subs:
        payload = f"{sub['ts']}:{sub['connection']}:{','.join(sub['streams'])}".encode()
        assert sub["sig"] == hmac.new(b"secret-1", payload, hashlib.sha256).hexdigest()
    replies = [json.loads(frame) for conn in server.connections for frame in conn.received[1:]]
    assert [r["seq"] for r in replies] == [0, 1, 2, 3] and not any("error" in r for r in replies)


def test_the_reconnecting_example_is_counted_as_a_built_in_feed_and_answers_every_message(feed_server):
    messages = [{"seq": i, "stream": "ab"[i % 2], "x": [float(i)] * 8} for i in range(20)]

    async def script(conn):  # ten messages a connection; the first is closed once they are answered
        part = messages[:10] if conn.index == 0 else messages[10:]
        for m in part:
            await conn.send(m)
        if conn.index == 0:
            for _ in part:
                await conn.recv(timeout=30)
            await conn.close_keep_reading()
        else:
            await conn.read_until_closed(timeout=30)

    server = feed_server(script, impl="websockets")
    proc = run_app(env={"QUOTES_URL": server.url}, program=("-c", example("reconnecting")), timeout_s=90 * UNIT_S)
    assert proc.returncode == 0, proc.stderr
    assert "20 replies, 2 connections, 1 reconnect" in proc.stdout
    replies = [json.loads(frame) for conn in server.connections for frame in conn.received]
    assert sorted(r["seq"] for r in replies) == list(range(20))


def test_the_rows_example_hands_over_what_its_source_decoded_itself(feed_server):
    trades = [{"id": i, "s": "BTCUSDT" if i % 2 else "ETHUSDT", "p": f"{37000 + i}.10", "q": "0.5"} for i in range(20)]
    frames = [json.dumps(trades[i:i + 5]) for i in range(0, 20, 5)]  # an exchange's own shape, 5 trades a frame
    server = feed_server(send_frames(frames), impl="websockets")
    proc = run_app(env={"TRADES_URL": server.url}, program=("-c", example("rows")), timeout_s=90 * UNIT_S)
    assert proc.returncode == 0, proc.stderr
    assert f"processed {list(range(20))} messages in 20" in proc.stdout
    assert server.received == []  # replies = "none": the exchange is sent nothing


def test_the_source_example_keeps_its_own_client_answers_the_heartbeat_and_orders_at_once(feed_server):
    trades = [{"type": "trade", "symbol": "BTCUSDT", "price": "37000.1000", "seq": i} for i in range(3)]

    async def exchange(conn):  # pings, then trades; each order is filled; nothing else may come
        await conn.send({"type": "ping", "id": 7})
        for trade in trades:
            await conn.send(trade)
        while True:
            frame = await conn.recv(timeout=30)
            if frame is None:
                return
            sent = json.loads(frame)
            if sent.get("type") == "order":
                await conn.send({"type": "fill", "client_order_id": sent["client_order_id"], "price": "37000.1000"})

    server = feed_server(exchange, impl="websockets")
    proc = run_app(env={"EXCHANGE_URL": server.url}, program=("-c", example("source")), timeout_s=90 * UNIT_S)
    assert proc.returncode == 0, proc.stderr
    assert "filled ['o0', 'o1', 'o2'] pongs 1 compilations 0" in proc.stdout  # events only: nothing compiled
    received = [json.loads(frame) for frame in server.received]
    assert received[0] == {"type": "pong", "id": 7}
    assert [r["type"] for r in received[1:]] == ["order"] * 3  # nothing else reached the exchange


def test_the_stop_example_gets_every_fill_of_the_orders_sent_right_before_the_stop():
    from tests.ws_exchange import WsExchange

    exchange = WsExchange()
    try:
        proc = run_app(env={"EXCHANGE_URL": exchange.start()}, program=("-c", example("stop")),
                       timeout_s=90 * UNIT_S)
        orders = exchange.figures()["orders"]
    finally:
        exchange.stop()
    assert proc.returncode == 0, proc.stderr
    assert orders == [f"c{i}" for i in range(10)]
    assert "filled 10 of 10 through the stop; still awaited at its end: {}" in proc.stdout, proc.stdout


def test_the_portal_example_runs_the_classic_multiprocessing_client_unchanged_on_the_io_thread(feed_server):
    frames = [json.dumps({"seq": i, "price": 100.0 + i}) for i in range(10)]
    server = feed_server(send_frames(frames))
    proc = run_example("portal", server.url)
    server.wait_for(lambda: len(server.connections) == 1 and server.connections[0].closed_at is not None,
                    5 * UNIT_S, "the example's connection closed")
    assert proc.returncode == 0, proc.stderr
    assert "10 messages in, 10 orders out" in proc.stdout
    assert server.replies() == [{"order": i} for i in range(10)]


def test_the_credentials_example_logs_in_again_when_its_token_is_refused_and_the_feed_goes_on():
    from tests.login_server import LoginFeedServer, token_of
    from tests.servers import make_messages

    first, second = make_messages(4, features=8), make_messages(4, features=8, start=4)

    async def script(conn):
        for m in first if conn.index == 0 else second:
            await conn.send(m)
        for _ in range(4):
            await conn.recv(timeout=10)
        if conn.index == 0:
            conn.server.expire(token_of(conn))
            await conn.close_keep_reading(4003)  # "token expired": the reconnect's token is refused with 401
        else:
            await conn.read_until_closed(timeout=30)

    with LoginFeedServer(script) as server:
        proc = run_app(env={"FORKLESS_WS_URL": server.url, "EXCHANGE_LOGIN_URL": server.login_url,
                            "FORKLESS_RECONNECT_MIN_S": "0.1"},
                       program=("-c", example("credentials")), timeout_s=90 * UNIT_S)
        assert proc.returncode == 0, proc.stderr
        assert not server.script_errors
        assert "8 messages, 2 connections, 1 refused" in proc.stdout
        assert server.logins == ["tok-1", "tok-2"]
        assert [(seen.token, seen.status) for seen in server.handshakes] == [("tok-1", None), ("tok-1", 401),
                                                                              ("tok-2", None)]
        assert "asking before_connect for new credentials" in proc.stderr and "tok-" not in proc.stderr
        assert sorted(json.loads(frame)["seq"] for frame in server.received) == list(range(8))


def test_the_csv_example_runs_against_the_csv_feed_that_ships_with_it(capsys):
    import asyncio
    import sys
    import threading

    from aiohttp import web

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import csv_feed
    finally:
        sys.path.pop(0)
    ready = threading.Event()
    box: dict = {}

    async def serve() -> None:
        app = web.Application()
        app.router.add_get("/feed", csv_feed.feed)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["url"] = f"ws://127.0.0.1:{runner.addresses[0][1]}/feed"
        box["stop"] = stop = asyncio.Event()
        box["loop"] = asyncio.get_running_loop()
        ready.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert ready.wait(10 * UNIT_S)
    try:
        proc = run_example("blocking", box["url"])
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(10 * UNIT_S)
    assert proc.returncode == 0, proc.stderr
    assert "decode failed" not in proc.stderr and "Traceback" not in proc.stderr
    replies = [line.removeprefix("reply: ").split(",") for line in capsys.readouterr().out.splitlines()
               if line.startswith("reply: ")]
    assert len(replies) >= 2  # both streams (the example runs 3 s, the feed sends 10 lines a second)
    assert [int(r[0]) for r in replies] == list(range(len(replies)))  # every line answered, in order
    rng = random.Random(0)  # the feed's lines, made again as csv_feed.py makes them
    for seq, stream, count, norm in replies:
        x1, x2 = (float(f"{rng.uniform(-3, 3):.3f}") for _ in range(2))
        assert (stream, int(count)) == ("ab"[int(seq) % 2], int(seq) // 2 + 1)  # streams take turns
        assert float(norm) == pytest.approx(math.hypot(x1, x2), abs=6e-4), (seq, x1, x2)  # printed to 3 decimals


def _sink_example(feed_server, app, name: str, last: str, replies: int) -> tuple[LoopbackServer, AppResult]:
    """docs/embedding/sinks.md's example ``name`` run against a feed of 10 messages on two streams,
    stopped by SIGTERM once it printed ``last`` (a pattern) and the feed has its ``replies`` (the
    example runs "until SIGINT/SIGTERM or FORKLESS_DURATION": the stop comes as soon as there is
    nothing more to wait for, however fast or slow the machine)."""
    frames = [json.dumps({"seq": i, "stream": f"s{i % 2}", "x": [float(i)] * 8}) for i in range(10)]
    server = feed_server(send_frames(frames))
    running = app(env={"FORKLESS_WS_URL": server.url, "FORKLESS_STATUS_S": "0"}, program=("-c", example(name)))
    running.wait_for_line(last, timeout_s=90 * UNIT_S)
    server.wait_for(lambda: server.received_count >= replies, 30 * UNIT_S, f"the feed's {replies} replies")
    running.signal(signal.SIGTERM)
    proc = running.finish(60 * UNIT_S)
    assert proc.returncode == 0, proc.stderr
    return server, proc


def test_the_sink_example_prints_every_message_and_its_books_balance(feed_server, app):
    _, proc = _sink_example(feed_server, app, "sink", r"^got s1 9 ", replies=0)
    got = [line.split() for line in proc.stdout.splitlines() if line.startswith("got ")]
    assert [(g[1], int(g[2])) for g in got] == [(f"s{i % 2}", i) for i in range(10)]
    assert "written 10 of 10" in proc.stdout


def test_the_results_sink_example_prints_every_result_in_order_and_its_books_balance(feed_server, app):
    server, proc = _sink_example(feed_server, app, "results_sink", r"^result 0 s1 9 ", replies=10)
    got = [line.split() for line in proc.stdout.splitlines() if line.startswith("result ")]
    assert [(g[1], g[2], int(g[3])) for g in got] == [("0", f"s{i % 2}", i) for i in range(10)]
    replies = {r["seq"]: r["score"] for r in server.replies()}  # the feed's replies, with the same scores
    assert [round(replies[int(g[3])], 3) for g in got] == [float(g[4]) for g in got]
    assert "written 10 of 10" in proc.stdout


def test_the_weights_example_restores_its_own_checkpoint_on_its_next_start(feed_server, tmp_path):
    """The example's state (its params hold a 0-d weight, "b") checkpointed at its stop fits the same
    program's next start: every leaf keeps its shape, a 0-d one too, and the running totals go on."""
    frames = [json.dumps({"seq": i, "stream": "s", "x": [1.0] * 8}) for i in range(10)]
    env = {"FORKLESS_RECONNECT_MIN_S": "0.1", "FORKLESS_CHECKPOINT_DIR": str(tmp_path)}
    totals = []
    for _ in range(2):  # the same program twice, on the same checkpoint directory
        server = feed_server(send_frames(frames, gap_s=0.1))
        proc = run_app(env={**env, "FORKLESS_WS_URL": server.url}, program=("-c", example("weights")),
                       timeout_s=90 * UNIT_S)
        assert proc.returncode == 0, proc.stderr
        assert re.search(r"weights v2 since message \d+", proc.stdout), proc.stdout
        totals.append([r["total"] for r in server.replies()])
        assert len(totals[-1]) == 10 and any(p.suffix == ".fkc" for p in tmp_path.iterdir())
    # the second start took the stream's running total from the first one's checkpoint (its weights from init)
    assert totals[1][0] == totals[0][-1] + 8.0, totals
