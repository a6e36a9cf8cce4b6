"""The results' acknowledgement as an event (io_loop/sinks/sink.py ``Acknowledged``): a checkpoint with
JetStream positions waits on it (controller/recovery.py ``await_replies``), reading the IO
side's snapshot once, then once after each acknowledgement, never in a poll. The path through a real
nats-server is tests/io_loop/connectors/jetstream/test_jetstream.py's checkpoint-after-the-replies test."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from forkless.controller.config import Config
from forkless.io_loop.sinks.sink import Acknowledged
from tests.harness import UNIT_S

pytestmark = pytest.mark.timeout(30 * UNIT_S)

# how long the test gives a poll to show itself before it acknowledges (a correct waiter never
# looks meanwhile, however long this is; a poll every few ms always does)
QUIET_S = 0.5


def _recovery(snapshot: Any) -> Any:
    from forkless.controller.processor import StateShape, ewma_processor
    from forkless.controller.recovery import Recovery
    from forkless.controller.slots import StreamSlots
    from forkless.controller.stats import MainStats

    feed = {"name": "ticks", "nats": "nats://127.0.0.1:4222", "stream": "TICKS", "subject": "ticks.>",
            "results": "scores"}
    cfg = Config.from_env({"FORKLESS_FEEDS": json.dumps([feed]), "FORKLESS_FEATURES": "2"})
    return Recovery(cfg.checkpoints, StateShape.of(cfg), ewma_processor(), StreamSlots(8),
                    MainStats.for_run(cfg.buckets, 1), snapshot, cfg.feed_specs)


def test_the_wait_for_replies_reads_the_io_snapshot_only_when_an_acknowledgement_is_signalled():
    confirmed = [(0, -1)]
    looked = threading.Event()
    seen: list[int] = []  # the acknowledgements signalled when each snapshot was read
    recovery: Any = None

    def snapshot() -> Any:
        seen.append(recovery.acknowledged.count)
        looked.set()
        source = SimpleNamespace(confirmed=confirmed[0])
        return SimpleNamespace(feeds=[SimpleNamespace(name="ticks", io=SimpleNamespace(source=source))])

    recovery = _recovery(snapshot)
    outcome: list[Any] = []
    waiter = threading.Thread(target=lambda: outcome.append(recovery.await_replies({"ticks": {"replied": [5, 0]}})))
    waiter.start()
    assert looked.wait(10 * UNIT_S)  # the first look: the replies not yet stored
    looked.clear()
    assert not looked.wait(QUIET_S), f"the snapshot was read again with no acknowledgement: {seen}"
    confirmed[0] = (5, 0)  # the IO side: the replies stored, then the signal (jspublish, then HeldReply.finish)
    recovery.acknowledged.notify()
    waiter.join(10 * UNIT_S)
    assert not waiter.is_alive() and outcome == [None]
    assert seen == [0, 1]


def test_an_acknowledgement_that_does_not_cover_the_positions_keeps_the_wait_going():
    ack = Acknowledged()
    state = {"stored": 0}
    looks: list[int] = []

    def caught_up() -> bool:
        looks.append(state["stored"])
        return state["stored"] >= 2

    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(ack.wait_for(caught_up, 10 * UNIT_S)))
    waiter.start()
    for stored in (1, 2):
        while len(looks) < stored:  # the waiter has looked (stored - 1) times: it waits for the next signal
            threading.Event().wait(0.001)
        state["stored"] = stored
        ack.notify()
    waiter.join(10 * UNIT_S)
    assert result == [True] and looks == [0, 1, 2]


def test_no_acknowledgement_within_the_timeout_is_false():
    ack = Acknowledged()
    assert ack.wait_for(lambda: False, 0.05) is False and ack.count == 0
