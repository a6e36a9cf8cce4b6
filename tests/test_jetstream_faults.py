"""JetStream feeds against the faults of issue 30, each with a real nats-server (tests/natsserver.py)
and the app as a subprocess: a stream deleted and made again, retention of other subjects'
messages, every checkpoint damaged, a payload over FORKLESS_MAX_MSG_BYTES."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.harness import UNIT_S, wait_until
from tests.servers import make_messages
from tests.test_jetstream import _app_env, _js_feed

pytestmark = pytest.mark.timeout(180 * UNIT_S)


def _admin(url: str, body: Any) -> Any:
    from tests.natsserver import _with_js

    return asyncio.run(_with_js(url, body))


def _scores(url: str) -> int:
    from tests.natsserver import stream_state

    return stream_state(url, "SCORES").messages


def test_a_stream_deleted_and_made_again_while_running_exits_2_and_is_never_resumed_into(app, nats_server, tmp_path):
    from tests.natsserver import create_streams, publish

    create_streams(nats_server.url)
    messages = make_messages(330, streams=3, seed=31)
    publish(nats_server.url, "ticks.a", [json.dumps(m) for m in messages[:30]])
    # a fixed 2 s before each reconnect: the new stream holds more than the old position before it
    env = _app_env(nats_server.url, tmp_path / "ckpt", tmp_path / "jax-cache", FORKLESS_RECONNECT_MIN_S="2",
                   FORKLESS_RECONNECT_MAX_S="2")
    proc = app(env=env)
    wait_until(lambda: _scores(nats_server.url) == 30, timeout_s=60 * UNIT_S, what="30 results", poll_s=0.1)

    async def make_again(nc: Any, js: Any) -> None:
        from nats.js.api import StreamConfig

        await js.delete_stream("TICKS")
        await js.add_stream(StreamConfig(name="TICKS", subjects=["ticks.>"]))
        futures = [await js.publish_async("ticks.a", json.dumps(m).encode()) for m in messages[30:]]
        assert [(await f).seq for f in futures][-1] == 300  # past the old position (30)

    _admin(nats_server.url, make_again)
    done = proc.finish(60 * UNIT_S)
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "stream 'TICKS' was deleted and made again" in line and "FORKLESS_CHECKPOINT_RESTORE=never" in line, line
    assert _scores(nats_server.url) == 30  # nothing of the new stream answered from the old one's state


def _feed(**extra: Any) -> Any:
    pytest.importorskip("nats")
    from controller.loop import Controller
    from io_loop.counters import IOStats
    from io_loop.jetstream import JetStreamFeed
    from tests.test_jetstream import _config

    cfg = _config([_js_feed("nats://127.0.0.1:4222", **extra)])
    return JetStreamFeed(cfg.io_settings(), Controller(cfg).codec, IOStats(), cfg.feed_specs[0], inbound=None,
                         outbox=None)


def test_a_stream_that_ends_before_what_this_run_saw_of_it_or_was_created_again_is_refused():
    import datetime

    from io_loop.errors import PositionLost

    feed = _feed()
    created = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC)
    feed._check_identity(40, created)
    feed._check_position(1, 40)
    feed._check_identity(45, created)  # the same stream, grown
    feed.source.stream_last_seq = 45
    with pytest.raises(PositionLost, match="ends at sequence 44, but this run saw it reach 45"):
        feed._check_identity(44, created)
    with pytest.raises(PositionLost, match=r"was deleted and made again: created 2026-12-01T12:00:01\+00:00"):
        feed._check_identity(500, created + datetime.timedelta(seconds=1))
