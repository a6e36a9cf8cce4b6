"""The exit status of an orderly stop that lost messages: 4 (``EXIT_LOSSY_STOP``) and a warning saying what was
lost, so a supervisor can tell it from a clean stop (0); ``FORKLESS_LOSSY_STOP_EXIT`` chooses another status, 0
for the old behaviour. The app runs as a process (the exit status is the process's)."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import struct
from types import SimpleNamespace

import pytest

from forkless.controller.commands.cli import stop_status
from forkless.controller.stats import StatsSnapshot, losses
from forkless.io_loop.counters import SECONDS_BOUNDS, Histogram
from forkless.io_loop.errors import EXIT_LOSSY_STOP
from tests.harness import UNIT_S

MESSAGES = 10


def _text_frame(payload: bytes) -> bytes:
    """An unmasked (server to client) WebSocket text frame."""
    size = len(payload)
    head = bytes([0x81, size]) if size < 126 else bytes([0x81, 126]) + struct.pack("!H", size)
    return head + payload


async def _messages_then_gone(conn) -> None:
    """The first connection: the messages and a close frame in one TCP write, then the socket closed. The client
    reads both in one turn of its loop, before the messages are even handed to the main thread, so their replies
    can only wait for a connection that never comes before the stop's deadline: lost, deterministically."""
    if conn.index:
        await conn.read_until_closed(timeout=60 * UNIT_S)
        return
    batch = [{"seq": i, "stream": f"s{i % 3}", "x": [1.0, 2.0]} for i in range(MESSAGES)]
    transport = conn.request.transport
    transport.write(_text_frame(json.dumps(batch).encode()) + b"\x88\x02" + struct.pack("!H", 1001))
    transport.close()


@pytest.mark.parametrize("setting, status", [(None, EXIT_LOSSY_STOP), ("0", 0)],
                         ids=["default: exit 4", "FORKLESS_LOSSY_STOP_EXIT=0: exit 0"])
def test_an_orderly_stop_that_dropped_replies_exits_4_unless_told_otherwise(feed_server, app, setting, status):
    feed = feed_server(_messages_then_gone)
    env = {"FORKLESS_WS_URL": feed.url, "FORKLESS_FEATURES": "2", "FORKLESS_MAX_BATCH": "16",
           "FORKLESS_STATUS_S": "0", "FORKLESS_RECONNECT_MIN_S": "60", "FORKLESS_RECONNECT_MAX_S": "60",
           "FORKLESS_SHUTDOWN_TIMEOUT_S": "1"}
    if setting is not None:
        env["FORKLESS_LOSSY_STOP_EXIT"] = setting
    proc = app(env=env)
    # the close frame and the socket's end come in one read: aiohttp reports either (1001, or 1006 when it saw
    # the end first), and either way connection 1 is gone with the replies its messages were waiting for
    proc.wait_for_line(r"connection 1 to .* lost: (closed by the server|lost without a close frame)", stream="stderr",
                       timeout_s=120 * UNIT_S)
    proc.signal(signal.SIGTERM)
    result = proc.finish(timeout_s=60 * UNIT_S)
    assert result.returncode == status, result.stderr[-3000:]
    # the books line (the reason is the stop's business: unsent at stop, source ended …)
    assert re.search(rf"books: in {MESSAGES} = results 0 \+ .* \+ dropped {MESSAGES} \(", result.stderr)
    warning = f"the stop lost messages (dropped {MESSAGES}; the books line says which): exit status {status}"
    assert warning in result.stderr


def test_what_counts_as_lost_and_the_status_it_gives() -> None:
    seconds = Histogram(SECONDS_BOUNDS).snapshot()
    clean = StatsSnapshot(at=0.0, messages_in=5, frames_in=5, messages_out=5, errors_out=0, processed=5, batches=1,
                          errors={"not JSON": 2}, dropped={}, connects=1, reconnects=0, connect_failures=0,
                          connected=False, connection_since=0.0, inbound_depth=0, outbound_depth=0, unsent=0,
                          batch_size=Histogram((1, 2)).snapshot(), latency=seconds, loop_lag=seconds,
                          step_seconds=seconds, compilations=0, compilations_after_warmup=0, devices=(), ready=False)
    assert losses(clean) == {} and stop_status(clean, EXIT_LOSSY_STOP) == 0  # bad input refused is not a loss
    sink = SimpleNamespace(taken=3, written=1, dropped={"unwritten at the stop": 2}, held=0, unwritten=2, batches=1)
    lossy = dataclasses.replace(clean, messages_in=9, dropped={"unsent at stop": 3}, sinks=(("results", sink),),
                                sink_results_unsent=4, events_dropped={"inbound overflow (drop_oldest)": 6})
    assert losses(lossy) == {"dropped": 3, "unanswered": 1, "dropped by sinks": 2,
                             "results never handed to the sinks": 4, "events dropped": 6}
    assert stop_status(lossy, EXIT_LOSSY_STOP) == 4 and stop_status(lossy, 0) == 0
